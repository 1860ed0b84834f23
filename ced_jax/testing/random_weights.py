"""Random weights in the released DeepSeek-V4.1 checkpoint formats, by the `mid` generation scheme: the
weights of the embedded `tiny` preset (`tiny_params`, what `ced_jax.load("tiny")` runs), of tests and
of the synthetic checkpoints `conversion.synthetic` writes.

The scheme is bench/configs/mid/README.md, "How to regenerate the weights"; it is reproduced
exactly so that `bench/make_mid_weights.py` yields the published content hash:
- every tensor has its own generator, `numpy.random.default_rng(int.from_bytes(SHA-256(
  f"{seed}:{name}")[:8], "little"))`, keyed by the HF name (a quantised pair by its `.weight`
  name; the `.scale` comes from quantising the same draw), so tensors can be made in any order;
- normal: `standard_normal(shape, float32) *= float32(std)`, then `+= float32(mean)` if mean != 0;
  uniform: `random(shape, float32) * float32(high - low) + float32(low)`; hc_base: normal std 0.5
  plus 1.0 on the comb diagonal. Stds per tensor kind live in `ced_jax.checkpoint.mapping`;
- FP8 (dense B x B blocks, Engram tables 1 x B per row): scale = the smallest power of two
  >= max(amax, 2^-100) / 448 (float32 division), weight = e4m3fn(RNE(clamp(w / scale, +-448)));
- FP4 experts (1 x 32 groups): scale = smallest power of two >= max(amax, 2^-100) / 6; codes are
  E2M1 of clamp(w / scale, +-6), round to nearest with ties to the even code, sign bit from
  signbit (so small negatives give code 8, "-0"); two codes per byte, even index in the low nibble;
- BF16: round to nearest even from float32.
The e4m3 cast is ml_dtypes' float32 -> float8_e4m3fn, which rounds to nearest even (subnormals
included) but does not saturate (past 464 it gives NaN). The clamp is kept as the README states it;
it never acts, because with a power-of-two scale >= amax/448 no float32 |w / scale| exceeds 448
(the float32 spacing near 448 * 2^k is wider than the rounding of amax / 448).
`tests/conversion/test_synthetic.py` checks the rounding against an independent e4m3 grid.

`random_params` assembles the draws into our parameter tree with the checkpoint loader's own
`ParamAssembler`, so it gives the same arrays as writing a checkpoint and loading it. Because every
tensor has its own generator, adding DSpark stages (`mtp.*`) to a config leaves its backbone draws
bit-identical.

The tiny preset's DSpark stages: random draws (which accept almost no drafts) unless a trained draft
is shipped as `TINY_DSPARK_FILE` (released `mtp.*` names and dtypes, one safetensors file), which
`tiny_dspark_params` then reads instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from ced_jax.checkpoint.hf_loader import ParamAssembler, load_group_file
from ced_jax.checkpoint.mapping import FP4_GROUP, STORAGE_DTYPES, TEXT_GROUPS, TensorSpec, hf_inventory
from ced_jax.config import ASSETS, ModelConfig, preset
from pallas_kernels import formats
from pallas_kernels.formats import np_e2m1_codes, np_pack_nibbles, np_ue8m0_byte_ceil, np_ue8m0_to_f32

TINY_SEED = 1234  # the embedded tiny model's weights
# A trained DSpark draft for the tiny preset, when shipped (else the stages are random draws).
TINY_DSPARK_FILE = ASSETS / "tiny" / "dspark.safetensors"
# The `tiny-draft` preset (`tiny_draft_preset_params`): tiny's weights with a backbone whose greedy
# continuation a draft can learn, and its trained draft.
TINY_DRAFT_DSPARK_FILE = ASSETS / "tiny-draft" / "dspark.safetensors"
TINY_DRAFT_EMBED_SCALE = 2.5
TINY_DRAFT_HEAD_SCALE = 0.25
TINY_DRAFT_PERMUTATION_SEED = 0
FP8_MAX = np.float32(formats.FP8_MAX)  # float32, so amax / FP8_MAX is the README's float32 division
FP4_MAX = np.float32(formats.FP4_MAX)
AMAX_FLOOR = np.float32(2.0**-100)


# ---------------------------------------------------------------------- draws
def tensor_rng(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def draw(spec: TensorSpec, seed: int) -> np.ndarray:
    """The float32 values of a weight (logical shape), before any rounding or quantisation."""
    init = spec.init
    assert init is not None, f"{spec.name} has no draw of its own"
    rng = tensor_rng(seed, spec.name)
    shape = spec.logical_shape
    if init.kind == "uniform":
        x = rng.random(shape, dtype=np.float32) * np.float32(init.high - init.low) + np.float32(init.low)
        return x
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(init.std)
    if init.mean != 0:
        x += np.float32(init.mean)
    if init.kind == "hc_base":
        x[list(init.diag)] += np.float32(1.0)
    return x


# ---------------------------------------------------------------------- formats
# The codecs (ue8m0 ceiling byte, e2m1 rounding, nibble packing) are `pallas_kernels.formats`'; the
# recipe (amax floor, float32 division by the format's maximum, block shapes) is the README's.


def quantize_fp8(w: np.ndarray, block_rows: int, block_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (float8_e4m3fn [out, in], ue8m0 bytes [ceil(out/br), ceil(in/bc)])."""
    out, inn = w.shape
    ob, ib = -(-out // block_rows), -(-inn // block_cols)
    # Zero padding leaves every block's amax unchanged.
    padded = np.zeros((ob * block_rows, ib * block_cols), np.float32)
    padded[:out, :inn] = w
    tiles = padded.reshape(ob, block_rows, ib, block_cols)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), AMAX_FLOOR)
    byte = np_ue8m0_byte_ceil(amax / FP8_MAX)
    scaled = tiles / np_ue8m0_to_f32(byte)[:, None, :, None]
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(padded.shape)[:out, :inn].copy(), byte


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (packed uint8 [out, in/2], ue8m0 bytes [out, in/32])."""
    out, inn = w.shape
    groups = w.reshape(out, inn // FP4_GROUP, FP4_GROUP)
    amax = np.maximum(np.abs(groups).max(axis=2), AMAX_FLOOR)
    byte = np_ue8m0_byte_ceil(amax / FP4_MAX)
    v = np.clip(groups / np_ue8m0_to_f32(byte)[:, :, None], -FP4_MAX, FP4_MAX)
    return np_pack_nibbles(np_e2m1_codes(v).reshape(out, inn)), byte


def generate(spec: TensorSpec, seed: int, block: int) -> dict[str, np.ndarray]:
    """The stored tensor(s) made from one draw, in our storage dtypes (`mapping.STORAGE_DTYPES`):
    {weight, scale} for a quantised pair (`spec` is its weight), else {name}. `block` is the FP8
    block size (cfg.weight_block_size)."""
    x = draw(spec, seed)
    if spec.quant is None:
        return {spec.name: x.astype(STORAGE_DTYPES[spec.dtype])}
    scale_name = spec.name[: -len(".weight")] + ".scale"
    if spec.quant == "fp4":
        q, s = quantize_fp4(x)
    elif spec.quant == "fp8_rows":
        q, s = quantize_fp8(x, 1, block)
    else:
        q, s = quantize_fp8(x, block, block)
    return {spec.name: q, scale_name: s}


def iter_hf_tensors(
    cfg: ModelConfig, seed: int, names: Iterable[str] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in our storage dtype) for `names` (default: the whole inventory), in the
    order given. A pair's weight and scale come from one draw, made once when both are asked for."""
    inventory = hf_inventory(cfg)
    order = list(inventory if names is None else names)
    unknown = [n for n in order if n not in inventory]
    if unknown:
        raise KeyError(f"not in the inventory of this config: {unknown[:10]}")
    pending = set(order)
    partners: dict[str, np.ndarray] = {}
    for name in order:
        pending.discard(name)
        if name in partners:
            yield name, partners.pop(name)
            continue
        made = generate(inventory[inventory[name].weight_name], seed, cfg.weight_block_size)
        arr = made.pop(name)
        partners.update((k, v) for k, v in made.items() if k in pending)
        yield name, arr


def model_groups(cfg: ModelConfig) -> tuple[str, ...]:
    """The groups of our parameter tree `cfg` describes: the text model, plus "dspark" when it has
    DSpark stages (vision weights are the vision encoder's, not drawn here)."""
    return (*TEXT_GROUPS, "dspark") if cfg.num_nextn_predict_layers > 0 else TEXT_GROUPS


def random_params(cfg: ModelConfig, seed: int, groups: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Our params in memory (flat dotted paths -> numpy in our storage dtypes): the same arrays as
    `conversion.synthetic.write_synthetic_checkpoint` then `load_hf_checkpoint(include=groups)`
    (same draws, same `ParamAssembler`), for small configs such as `tiny`. `groups`: default
    `model_groups(cfg)` (the DSpark stages' `mtp.*` paths included when the config has them)."""
    groups = model_groups(cfg) if groups is None else tuple(groups)
    assembler = ParamAssembler(cfg, groups)
    names = [n for n, s in hf_inventory(cfg).items() if s.group in groups]
    for name, arr in iter_hf_tensors(cfg, seed, names):
        assembler.add(name, arr)
    return assembler.finish()


def tiny_dspark_params(path: str | Path = TINY_DSPARK_FILE, seed: int = TINY_SEED) -> dict[str, np.ndarray]:
    """The tiny preset's DSpark stages (flat `mtp.*` paths): read from `path` when that file exists
    (a trained draft: released names and dtypes, checked against the tiny config), else drawn like
    the other random weights (`TINY_SEED`)."""
    cfg = preset("tiny")
    path = Path(path)
    if path.is_file():
        return load_group_file(path, cfg, "dspark")
    return random_params(cfg, seed, ("dspark",))


def tiny_params(*, with_draft: bool = True) -> dict[str, np.ndarray]:
    """The weights of the embedded `tiny` preset (deterministic: `TINY_SEED`), with its DSpark
    stages (`tiny_dspark_params`) unless `with_draft=False`."""
    flat = random_params(preset("tiny"), TINY_SEED, TEXT_GROUPS)
    if with_draft:
        flat.update(tiny_dspark_params())
    return flat


def tiny_draft_preset_params(*, with_draft: bool = True) -> dict[str, np.ndarray]:
    """The weights of the embedded `tiny-draft` preset: `tiny`'s, except the embedding (scaled by
    `TINY_DRAFT_EMBED_SCALE`) and the head (row `perm[t]` = embedding row t x `TINY_DRAFT_HEAD_SCALE`,
    `perm` a fixed random permutation of the vocabulary), plus its own DSpark stages
    (`TINY_DRAFT_DSPARK_FILE`, trained by `ced-jax train-draft`; random draws until it exists).

    Why: tiny's random backbone is chaotic (its greedy next token is its most frequent successor 4 %
    of the time), so no draft can agree with it and speculative decoding cannot be measured on it. A
    larger embedding keeps the input token visible in the last hidden state, so the head maps it to
    `perm[token]` about 60 % of the time (measured on greedy continuations of random prompts: 26 % at
    scale 1, 39 % at 2, 60 % at 2.5, 83 % at 3, 97 % at 4) and the layers, i.e. the context, decide the
    rest. Every layer runs as in `tiny`; only these two tensors differ."""
    cfg = preset("tiny")
    flat = random_params(cfg, TINY_SEED, TEXT_GROUPS)
    embed = flat["embed.weight"].astype(np.float32)
    perm = np.random.default_rng(TINY_DRAFT_PERMUTATION_SEED).permutation(cfg.vocab_size)
    head = np.empty_like(embed)
    head[perm] = embed * TINY_DRAFT_HEAD_SCALE
    flat["embed.weight"] = (embed * TINY_DRAFT_EMBED_SCALE).astype(ml_dtypes.bfloat16)
    flat["head.weight"] = head.astype(ml_dtypes.bfloat16)
    if with_draft:
        flat.update(tiny_dspark_params(TINY_DRAFT_DSPARK_FILE))
    return flat


EMBEDDED_PRESETS = {
    "tiny": (tiny_params, TINY_DSPARK_FILE),
    "tiny-draft": (tiny_draft_preset_params, TINY_DRAFT_DSPARK_FILE),
}


def embedded_params(name: str, *, with_draft: bool) -> dict[str, np.ndarray]:
    """The weights of an embedded preset (`EMBEDDED_PRESETS`), with its DSpark stages if `with_draft`."""
    params, _ = EMBEDDED_PRESETS[name]
    return params(with_draft=with_draft)
