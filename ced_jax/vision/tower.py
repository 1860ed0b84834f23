"""The DeepSeek ViT and the 3x3 aligner (spec 6.3), and `VisionEncoder`, their jitted program.

Numerics follow the reference, which runs both in bf16 with fp32 norm internals: activations are f32
arrays holding bf16 values (see `ced_jax.quant`), every linear accumulates in f32 and rounds once
(bias included), RMSNorm (eps 1e-6) and RoPE compute in f32 and round, SiLU/GELU compute in f32 and
round, each elementwise product and residual add rounds. Attention follows torch's CPU
scaled_dot_product_attention for bf16 (the reference's kernel): f32 scores and probabilities, an
online softmax over key blocks of `ATTN_KV_BLOCK`, the output rounded once (`vit_attention`).

Shapes: P patches (padded to a bucket: rows past `n_valid` are masked out of attention as keys and
their outputs are garbage that nothing reads), W the ViT width, Hh heads of Dh, D the text width,
N aligner tokens (padded likewise).
"""

from __future__ import annotations

import math
import threading
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ced_jax.config import ModelConfig, VisionConfig
from ced_jax.invariant import reciprocal_sqrt, rounded_square, sum_small, torch_mean_last
from ced_jax.model.layers.common import HIGHEST, rope_inv_freq
from ced_jax.quant import round_bf16
from ced_jax.vision.params import vision_param_specs
from ced_jax.vision.preprocess import PreparedImage, span_length


class _EncoderPrograms:
    """The jitted encoder programs of one vision config, by (bucket, keep_block_inputs)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[int, bool], object] = {}


# Shared by every encoder of a vision config while one is alive (a second load compiles nothing);
# held weakly so that the executables go with the last encoder.
_PROGRAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_PROGRAMS_LOCK = threading.Lock()

VIT_NORM_EPS = 1e-6
# torch's CPU flash attention splits keys into blocks of 512 (kvSplitSize) for long sequences.
ATTN_KV_BLOCK = 512
ATTN_Q_BLOCK = 1024  # queries per chunk (memory only)
ATTN_PV_ROWS = 128  # queries per block of the probabilities-times-values product (`_probs_times_values`)


def vit_rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    """The ViT's RMSNorm (eps 1e-6): f32, weight in f32, output rounded to bf16, as torch computes it
    on CPU: the mean of squares in its summation order and its rsqrt (`ced_jax.invariant`; removes the
    one norm1 flip per fixture that the old order left, tests/golden/PARITY.md)."""
    var = torch_mean_last(rounded_square(x))
    return round_bf16(weight.astype(jnp.float32) * (x * reciprocal_sqrt(var + jnp.float32(VIT_NORM_EPS))))


def vit_linear(x: jax.Array, params: dict, name: str) -> jax.Array:
    """bf16 linear: f32 accumulation, the bias added before the one rounding (torch's addmm)."""
    y = jnp.einsum("...k,nk->...n", x, params[f"{name}.weight"].astype(jnp.float32), precision=HIGHEST)
    bias = params.get(f"{name}.bias")
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return round_bf16(y)


def rope_tables(n_w: jax.Array, num_patches: int, vcfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [P, Dh/2]: the row position's frequencies, then the column's (each Dh/4 wide)."""
    head_dim = vcfg.hidden_size // vcfg.num_attention_heads
    inv_freq = jnp.asarray(rope_inv_freq(head_dim // 2, float(vcfg.rope_theta), None))
    idx = jnp.arange(num_patches, dtype=jnp.int32)
    rows, cols = (idx // n_w).astype(jnp.float32), (idx % n_w).astype(jnp.float32)
    freqs = jnp.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)
    return jnp.cos(freqs), jnp.sin(freqs)


def vit_rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split rotation of the whole head: x = (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). x: [P, H, Dh]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return round_bf16(jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))


def vit_attention(q: jax.Array, k: jax.Array, v: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Non-causal attention over the first n_valid keys, as torch's CPU flash kernel does it for bf16.

    q, k, v: [P, H, Dh] bf16 values -> [P, H, Dh] bf16 values, f32 inside. Per block of keys, the
    running maximum m_j (over blocks 0..j) gives p = exp(s - m_j); blocks are then rescaled to the
    final maximum (an online softmax). Measured on tiny-v block 0: this form leaves 10 of 1536 rows
    with a bf16 rounding flip against the reference, one global softmax 14, and rounding p to bf16
    before the product with V (the older kernel's behaviour) 1424, so the reference keeps p in f32.
    Queries go in chunks of `ATTN_Q_BLOCK` so the scores of a large image ([H, chunk, P] f32) stay
    small; each row's arithmetic does not depend on the chunking."""
    num = q.shape[0]
    if num <= ATTN_Q_BLOCK:
        return _attention_rows(q, k, v, n_valid)
    chunks = -(-num // ATTN_Q_BLOCK)
    qp = jnp.pad(q, ((0, chunks * ATTN_Q_BLOCK - num), (0, 0), (0, 0)))
    qp = qp.reshape(chunks, ATTN_Q_BLOCK, *q.shape[1:])
    out = jax.lax.map(lambda qc: _attention_rows(qc, k, v, n_valid), qp)
    return out.reshape(chunks * ATTN_Q_BLOCK, *q.shape[1:])[:num]


def _attention_rows(q: jax.Array, k: jax.Array, v: jax.Array, n_valid: jax.Array) -> jax.Array:
    """`vit_attention` for one chunk of queries q [Q, H, Dh] against all keys k, v [P, H, Dh]."""
    num_keys, _, head_dim = k.shape
    n_blocks = -(-num_keys // ATTN_KV_BLOCK)
    pad = n_blocks * ATTN_KV_BLOCK - num_keys
    kb = jnp.pad(k, ((0, pad), (0, 0), (0, 0))).reshape(n_blocks, ATTN_KV_BLOCK, *k.shape[1:])
    vb = jnp.pad(v, ((0, pad), (0, 0), (0, 0))).reshape(n_blocks, ATTN_KV_BLOCK, *v.shape[1:])  # J Kb H D
    # Scores block by block: one product's width would be the key count, and XLA:CPU's dot rounds a
    # column differently at another width (an image padded to a larger bucket), a block's never.
    scale = jnp.float32(1.0 / math.sqrt(head_dim))
    blocks = jnp.einsum("qhd,jkhd->hqjk", q, kb, precision=HIGHEST) * scale
    valid = (jnp.arange(n_blocks * ATTN_KV_BLOCK) < n_valid).reshape(n_blocks, ATTN_KV_BLOCK)
    blocks = jnp.where(valid, blocks, -jnp.inf)  # [H, Q, J, Kb]
    running_max = jax.lax.cummax(jnp.max(blocks, axis=-1), axis=2)  # [H, Q, J]
    # A block of masked keys before any valid one cannot occur: padding is at the end.
    exps = jnp.exp(blocks - running_max[..., None])
    final_max = running_max[..., -1:]
    rescale = jnp.exp(running_max - final_max)  # [H, Q, J]
    # The blocks are summed in order (sum_small): a reduce over J would pick its order by J, so the
    # rows of an image padded to a larger bucket (more, all-masked blocks) would round differently.
    denom = sum_small(jnp.sum(exps, axis=-1) * rescale, -1)  # [H, Q]
    partial_out = _probs_times_values(exps, vb)
    out = sum_small(partial_out * rescale[..., None], 2) / denom[..., None]  # [H, Q, Dh]
    return round_bf16(jnp.transpose(out, (1, 0, 2)))


def _probs_times_values(exps: jax.Array, vb: jax.Array) -> jax.Array:
    """exps [H, Q, J, Kb] times vb [J, Kb, H, Dh] over Kb -> [H, Q, J, Dh], with the queries in
    blocks of ATTN_PV_ROWS as a batch axis: XLA:CPU's dot rounds a row differently with another
    number of rows (measured at head_dim 64: 315,273 of an image's 676-patch results changed when
    padded to 1,024), a block's rows never, so an image's features do not depend on its bucket."""
    heads, num, blocks, width = exps.shape
    chunks = -(-num // ATTN_PV_ROWS)
    e = jnp.pad(exps, ((0, 0), (0, chunks * ATTN_PV_ROWS - num), (0, 0), (0, 0)))
    e = e.reshape(heads, chunks, ATTN_PV_ROWS, blocks, width)
    out = jnp.einsum("hcqjk,jkhd->hcqjd", e, vb, precision=HIGHEST)
    return out.reshape(heads, chunks * ATTN_PV_ROWS, blocks, -1)[:, :num]


def vit_block(
    params: dict,
    x: jax.Array,
    block: int,
    cos: jax.Array,
    sin: jax.Array,
    n_valid: jax.Array,
    vcfg: VisionConfig,
) -> jax.Array:
    """One pre-norm ViT block: x [P, W] -> [P, W] (bf16 values); cos/sin from `rope_tables`."""
    num = x.shape[0]
    heads = vcfg.num_attention_heads
    head_dim = vcfg.hidden_size // heads
    p = f"vision.blocks.{block}."
    h = vit_rms_norm(x, params[f"{p}norm1.weight"])
    qkv = vit_linear(h, params, f"{p}attn.wqkv")
    q, k, v = (t.reshape(num, heads, head_dim) for t in jnp.split(qkv, 3, axis=-1))
    o = vit_attention(vit_rotate(q, cos, sin), vit_rotate(k, cos, sin), v, n_valid)
    x = round_bf16(x + vit_linear(o.reshape(num, -1), params, f"{p}attn.wo"))
    h = vit_rms_norm(x, params[f"{p}norm2.weight"])
    gate, up = jnp.split(vit_linear(h, params, f"{p}mlp.w1"), 2, axis=-1)
    act = round_bf16(round_bf16(jax.nn.silu(gate)) * up)
    return round_bf16(x + vit_linear(act, params, f"{p}mlp.w2"))


def vit_forward(
    params: dict,
    patches: jax.Array,
    n_w: jax.Array,
    n_valid: jax.Array,
    vcfg: VisionConfig,
    *,
    keep_block_inputs: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """patches: f32 [P, 3*patch^2] (bf16 values, rows past n_valid are padding) -> (ViT output
    [P, W] after the final norm, block inputs [L, P, W] when asked: index b is what block b
    received, so index 0 is the patch embedding)."""
    cos, sin = rope_tables(n_w, patches.shape[0], vcfg)
    x = vit_linear(patches, params, "vision.patch_embed.proj")
    inputs = []
    for b in range(vcfg.num_hidden_layers):
        inputs.append(x)
        x = vit_block(params, x, b, cos, sin, n_valid, vcfg)
    out = vit_rms_norm(x, params["vision.norm.weight"])
    return out, (jnp.stack(inputs) if keep_block_inputs else None)


def aligner_gather_index(
    n_h: jax.Array, n_w: jax.Array, num_tokens: int, ratio: int
) -> tuple[jax.Array, jax.Array]:
    """(patch index [N, r*r], in-image mask [N, r*r]) of each token's r x r window, in
    reading order over the n_llm_h x n_llm_w token grid; windows past the image edge read zeros
    (the reference's zero padding to multiples of r)."""
    n_llm_w = -(-n_w // ratio)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tr, tc = t // n_llm_w, t % n_llm_w
    ki, kj = jnp.meshgrid(jnp.arange(ratio), jnp.arange(ratio), indexing="ij")
    rows = tr[:, None] * ratio + ki.reshape(-1)[None, :]
    cols = tc[:, None] * ratio + kj.reshape(-1)[None, :]
    inside = (rows < n_h) & (cols < n_w)
    return jnp.where(inside, rows * n_w + cols, 0), inside


def aligner_forward(
    params: dict, features: jax.Array, n_h: jax.Array, n_w: jax.Array, num_tokens: int, vcfg: VisionConfig
) -> jax.Array:
    """ViT output [P, W] of an n_h x n_w grid -> aligner rows [N, D] (bf16 values), tokens in reading
    order (rows past the real n_llm_h * n_llm_w are garbage). Each token's input is its 3x3 window
    in torch F.unfold order: channel, then kernel row, then kernel column."""
    merged = aligner_windows(features, n_h, n_w, num_tokens, vcfg)
    return vit_linear(aligner_act(params, merged), params, "aligner.w2")


def aligner_windows(
    features: jax.Array, n_h: jax.Array, n_w: jax.Array, num_tokens: int, vcfg: VisionConfig
) -> jax.Array:
    """ViT output [P, W] -> each token's window [N, W*r*r], channel-major (zeros past the image edge)."""
    index, inside = aligner_gather_index(n_h, n_w, num_tokens, vcfg.downsample_ratio)
    window = jnp.where(inside[..., None], features[index], 0.0)  # [N, r*r, W]
    return jnp.transpose(window, (0, 2, 1)).reshape(num_tokens, -1)


def aligner_act(params: dict, merged: jax.Array) -> jax.Array:
    """GELU(w1 x) of the merged windows [N, W*r*r] -> [N, D] (bf16 values): what the aligner's w2 reads."""
    return round_bf16(jax.nn.gelu(vit_linear(merged, params, "aligner.w1"), approximate=False))


def _encode(
    params, patches, n_h, n_w, n_valid, *, vcfg: VisionConfig, num_tokens: int, keep_block_inputs: bool
):
    vit, block_inputs = vit_forward(params, patches, n_w, n_valid, vcfg, keep_block_inputs=keep_block_inputs)
    aligned = aligner_forward(params, vit, n_h, n_w, num_tokens, vcfg)
    return vit, aligned, block_inputs


def max_patches(vcfg: VisionConfig) -> int:
    """The most patches a plan can produce: a span of at most max_image_tokens positions has at most
    max_image_tokens - 3 IMAGE tokens (one row), each a ratio x ratio window."""
    return vcfg.downsample_ratio**2 * (vcfg.max_image_tokens - 3)


def default_buckets(vcfg: VisionConfig, smallest: int = 256) -> tuple[int, ...]:
    """Powers of two from `smallest` below the maximum patch count, then the maximum itself."""
    top = max_patches(vcfg)
    out = []
    b = smallest
    while b < top:
        out.append(b)
        b *= 2
    out.append(top)
    return tuple(out)


def forward_flops(vcfg: VisionConfig, hidden_size: int, patches: int, image_tokens: int) -> float:
    """Matmul FLOPs of one ViT + aligner call over `patches` patches (the bucket: padded patches are
    computed too) giving `image_tokens` aligner rows, for benchmarks' rooflines: patch embedding,
    per block qkv / o / the fused SwiGLU MLP and the attention scores and values, then the aligner's
    two linears."""
    width, inner = vcfg.hidden_size, vcfg.intermediate_size
    patch_in = 3 * vcfg.patch_size**2
    per_block = 2 * patches * width * (3 * width + width + 2 * inner) + 2 * patches * inner * width
    per_block += 4 * patches * patches * width
    merged = width * vcfg.downsample_ratio**2
    aligner = 2 * image_tokens * (merged * hidden_size + hidden_size * hidden_size)
    return float(2 * patches * patch_in * width + vcfg.num_hidden_layers * per_block + aligner)


class VisionEncoder:
    """The ViT + aligner as one jitted program per patch bucket, on a flat param dict (released names).

    `features(image)` runs it (`runs` counts program runs, for the serving metrics);
    `span_embeddings(image)` is the image's span as the text model's input rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        flat_vision_params: dict[str, np.ndarray],
        *,
        buckets: tuple[int, ...] | None = None,
    ) -> None:
        if cfg.vision is None:
            raise ValueError("VisionEncoder: the model config has no vision tower (vision_config)")
        self.cfg, self.vcfg = cfg, cfg.vision
        specs = vision_param_specs(cfg)
        missing = sorted(set(specs) - set(flat_vision_params))
        if missing:
            raise ValueError(f"VisionEncoder: {len(missing)} vision tensor(s) missing, e.g. {missing[:5]}")
        for name, (shape, _) in specs.items():
            if tuple(np.shape(flat_vision_params[name])) != shape:
                raise ValueError(
                    f"VisionEncoder: {name} has shape {list(np.shape(flat_vision_params[name]))}, "
                    f"the config needs {list(shape)}"
                )
        # Kept in their stored dtype (bf16: half the memory of f32); the program widens them exactly.
        self.params = {k: jnp.asarray(np.asarray(flat_vision_params[k])) for k in specs}
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(self.vcfg)
        self.runs = 0
        self._start = np.asarray(self.params["image_start"], np.float32)
        self._newline = np.asarray(self.params["image_newline"], np.float32)
        self._end = np.asarray(self.params["image_end"], np.float32)
        with _PROGRAMS_LOCK:
            programs = _PROGRAMS.get(self.vcfg)
            if programs is None:
                programs = _PROGRAMS[self.vcfg] = _EncoderPrograms()
        self._programs = programs

    def bucket_for(self, num_patches: int) -> int:
        for b in self.buckets:
            if b >= num_patches:
                return b
        raise ValueError(f"image has {num_patches} patches, more than the largest bucket {self.buckets[-1]}")

    def _program(self, bucket: int, keep_block_inputs: bool):
        key = (bucket, keep_block_inputs)
        with _PROGRAMS_LOCK:
            if key not in self._programs.by_key:
                tokens = min(bucket, max(self.vcfg.max_image_tokens - 3, 1))
                fn = partial(_encode, vcfg=self.vcfg, num_tokens=tokens, keep_block_inputs=keep_block_inputs)
                self._programs.by_key[key] = jax.jit(fn)
            return self._programs.by_key[key]

    def features(
        self, image: PreparedImage, *, bucket: int | None = None, keep_block_inputs: bool = False
    ) -> dict:
        """{"vit_output": f32 [P, W], "aligner_output": f32 [n_llm_h * n_llm_w, D], and with
        keep_block_inputs "vit_block_input": f32 [L, P, W] (block b's input)}; bf16 values.
        `bucket`: the padded patch count to run at (default: the smallest bucket that fits)."""
        num = image.num_patches
        bucket = self.bucket_for(num) if bucket is None else bucket
        if bucket < num:
            raise ValueError(f"bucket {bucket} is smaller than the image's {num} patches")
        patches = np.zeros((bucket, image.patch_pixels.shape[1]), np.float32)
        patches[:num] = image.patch_values()
        program = self._program(bucket, keep_block_inputs)
        vit, aligned, block_inputs = program(
            self.params,
            jnp.asarray(patches),
            jnp.int32(image.n_vit_h),
            jnp.int32(image.n_vit_w),
            jnp.int32(num),
        )
        self.runs += 1
        tokens = image.n_llm_h * image.n_llm_w
        out = {"vit_output": np.asarray(vit)[:num], "aligner_output": np.asarray(aligned)[:tokens]}
        if keep_block_inputs:
            out["vit_block_input"] = np.asarray(block_inputs)[:, :num]
        return out

    def span_rows(self, image: PreparedImage, aligner_output: np.ndarray) -> np.ndarray:
        """f32 [span_len, D]: START, per token row the aligner rows then NEWLINE, then END."""
        d = aligner_output.shape[-1]
        grid = aligner_output.reshape(image.n_llm_h, image.n_llm_w, d)
        newline = np.broadcast_to(self._newline, (image.n_llm_h, 1, d))
        body = np.concatenate([grid, newline], axis=1).reshape(-1, d)
        rows = np.concatenate([self._start[None], body, self._end[None]], axis=0)
        assert rows.shape[0] == span_length(image.n_llm_h, image.n_llm_w)
        return rows

    def span_embeddings(self, image: PreparedImage) -> np.ndarray:
        """f32 [span_len, D], bf16 values: the rows the text model's span positions take."""
        return self.span_rows(image, self.features(image)["aligner_output"])
