"""Parity of the DSpark draft stages (`ced_jax.model.dspark`) with DeepSeek's reference on the vision/DSpark
golden fixture (`--vision-golden DIR`, default tests/golden/tiny-v; scenario 2 of its README), in both
main-model index-key modes (`reference_*`, `intended_*`).

Layer-local first: every piece is fed the fixture's own recorded inputs, so each comparison isolates
one function: main_x from main_hidden; each stage's ring after the prefill insertion and at the end;
each stage's output from its recorded input and pre-mix (own gate ids compared exactly, then the
recorded ids replayed for a decision-free output); the collapse, the norm, the shared head, the
Markov bias (indexed by the recorded previous draft ids), logits and confidence from the recorded
values before them; the greedy draft ids from our base logits. Then the whole draft step, step by
step from the fixture's main_x and input ids, with our own rings.

Measured on tiny-v (both modes, all 6 steps): main_x (prefill: one element one bf16 ulp apart since
84fc36f's fixed-order row sums, asserted as the bf16 arrays below), prefill and end rings, stage-0 input, head
input, head-norm output and base logits bit-exact; gate ids exact; gate weights <= 1.2e-7 and
pre-mixes <= 2.4e-7 (f32 summation order); stage outputs bit-exact except single elements one bf16
ulp apart (largest 3.9e-3 on values in [0.5, 1)); Markov bias <= 2.4e-7, logits <= 4.8e-7,
confidence <= 5.7e-6 (f32 GEMM order); draft ids exact. Asserted: bf16 arrays within 1 bf16 ulp of
the recorded value on at most 1% of elements (others exact), f32 arrays within 1e-5 * max(1, scale).

Shapes come from the fixture's config.json; arrays a fixture lacks are left out (their names are
listed in the message of the test that would have used them). Negative controls that must fail:
the Markov bias indexed by the input id at every position, and a stage attending to a ring that
lacks the current position's context.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ced_jax.checkpoint.dspark import load_dspark_params
from ced_jax.checkpoint.hf_loader import CheckpointError, Shard, read_index
from ced_jax.config import ModelConfig
from ced_jax.model import dspark as ds

MODES = ("reference", "intended")
BF16_ULP = 2.0**-7  # relative spacing bound of bf16 (8 significant bits)
# A pre-mix is computed from the block's bf16 streams, so a stream element one ulp off moves it by
# ~1e-4 (measured 7.1e-5 on the one such row of tiny-v; 2.4e-7 elsewhere).
PRE_MIX_REL = 2e-4


# ------------------------------------------------------------------------------- fixture
@pytest.fixture(scope="module")
def fixture_dir(request) -> Path:
    return Path(request.config.getoption("vision_golden"))


@pytest.fixture(scope="module")
def golden(fixture_dir) -> dict:
    path = fixture_dir / "expected_dspark.safetensors"
    if not path.is_file():
        pytest.skip(f"{path} absent: this fixture has no DSpark scenario")
    return load_file(str(path))


@pytest.fixture(scope="module")
def cfg(fixture_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(fixture_dir)


@pytest.fixture(scope="module")
def params(fixture_dir, cfg) -> dict:
    return load_dspark_params(fixture_dir, cfg)


@pytest.fixture(scope="module")
def shared(fixture_dir) -> dict:
    """The backbone's embed and head, which the stages share."""
    weight_map = read_index(fixture_dir)
    out = {}
    for name in ("embed.weight", "head.weight"):
        with Shard(fixture_dir, weight_map[name]) as shard:
            out[name.split(".")[0]] = jnp.asarray(shard.read(name, *shard.dtype_shape(name)))
    return out


@pytest.fixture(scope="module")
def fns(cfg):
    """The jitted pure functions, cfg bound."""
    return {
        "main_x": jax.jit(lambda p, h: ds.main_x(p, cfg, h)),
        "insert": jax.jit(lambda p, r, mx, s, n: ds.insert_context(p, cfg, r, mx, s, n)),
        "stage": jax.jit(
            lambda p, x, pre, ring, pos, ids, s: ds.stage_forward(p, cfg, s, x, pre, ds.pack_rings(ring), pos, ids),
            static_argnums=6,
        ),
        "draft": jax.jit(lambda p, e, h, r, mx, ids, pos: ds.draft_step(p, cfg, e, h, r, mx, ids, pos)),
    }


# ------------------------------------------------------------------------------- helpers
def _f32_close(ours, ref, what: str, rel: float = 1e-5) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    err = float(np.max(np.abs(ours - ref))) if ref.size else 0.0
    tol = rel * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"
    return err


def _bf16_close(ours, ref, what: str) -> float:
    """bf16 streams: at most 1% of elements differ, each by at most one bf16 ulp of its value plus
    half an ulp of its row's RMS (a one-ulp rounding difference upstream, carried through the mHC
    mix, lands on small values as a few of their own ulps)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    diff = np.abs(ours - ref)
    row_rms = np.sqrt(np.mean(np.square(ref), axis=-1, keepdims=True))
    within = diff <= BF16_ULP * (np.abs(ref) + 0.5 * row_rms)
    assert np.all(within), f"{what}: {int(np.sum(~within))} elements beyond tolerance (max {diff.max():.3g})"
    off = float(np.mean(diff > 0))
    assert off <= 0.01, f"{what}: {off:.2%} of elements differ (at most 1% allowed)"
    return float(diff.max())


def _exact(ours, ref, what: str) -> None:
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    bad = np.argwhere(ours != ref)
    assert bad.size == 0, f"{what}: {len(bad)} mismatches, first at {bad[0].tolist()}"


def _drafts_match(ours, ref_ids, ref_logits, what: str, min_gap: float = 1e-3) -> None:
    """Draft ids [N, B+1] are discrete: compare the input id, then each draft position while the
    recorded row's top-2 logit gap exceeds min_gap (later positions depend on the earlier ids)."""
    ours, ref_ids = np.asarray(ours), np.asarray(ref_ids)
    _exact(ours[:, 0], ref_ids[:, 0], f"{what} (input ids)")
    top2 = np.sort(ref_logits, axis=-1)[..., -2:]
    for r in range(ref_ids.shape[0]):
        for j in range(ref_ids.shape[1] - 1):
            if top2[r, j, 1] - top2[r, j, 0] <= min_gap:
                break
            assert ours[r, j + 1] == ref_ids[r, j + 1], (
                f"{what}: row {r} position {j}: {ours[r, j + 1]} vs {ref_ids[r, j + 1]}"
            )


def _need(golden: dict, *names: str) -> None:
    absent = [n for n in names if n not in golden]
    if absent:
        pytest.skip(f"fixture lacks {absent}")


def _prefill_len(golden: dict) -> int:
    return int(golden["prefill_main_x"].shape[0])


def _positions(golden: dict, mode: str) -> np.ndarray:
    """Position p of each draft step (the main model's decode position)."""
    if "decode_positions" in golden:
        return golden["decode_positions"].astype(np.int32)
    return (_prefill_len(golden) + np.arange(golden[f"{mode}_main_x"].shape[0])).astype(np.int32)


def _prefill_rings(params, cfg, fns, golden):
    mx = jnp.asarray(golden["prefill_main_x"])[None]
    rings = ds.empty_rings(cfg, 1)
    return fns["insert"](params, rings, mx, jnp.array([0]), jnp.array([mx.shape[1]]))


def _step_rings(params, cfg, fns, golden, mode):
    """[S, T, W, Dh]: each stage's ring as draft step i reads it (prefill context plus steps 0..i)."""
    rings = _prefill_rings(params, cfg, fns, golden)
    mx = golden[f"{mode}_main_x"]
    t = mx.shape[0]
    tiled = jnp.broadcast_to(rings, (rings.shape[0], t, *rings.shape[2:]))
    start = jnp.full((t,), int(_positions(golden, mode)[0]))
    chunk = jnp.broadcast_to(jnp.asarray(mx)[None], (t, *mx.shape))
    return fns["insert"](params, tiled, chunk, start, jnp.arange(1, t + 1))


# ------------------------------------------------------------------------------- main_x, rings
def test_main_x(params, fns, golden):
    _need(golden, "prefill_main_hidden", "prefill_main_x")
    # bf16 values (main_norm's output): since the batch-invariant row sums (84fc36f, RMSNorm's sum
    # of squares in a fixed order) one element of tiny-v's prefill main_x is one bf16 ulp from the
    # reference (4.9e-4), the rest bit-exact; the decode-step rows below stay exact.
    _bf16_close(
        fns["main_x"](params, jnp.asarray(golden["prefill_main_hidden"])),
        golden["prefill_main_x"],
        "prefill_main_x",
    )
    for mode in MODES:
        if f"{mode}_main_hidden" in golden:
            ours = fns["main_x"](params, jnp.asarray(golden[f"{mode}_main_hidden"]))
            _exact(ours, golden[f"{mode}_main_x"], f"{mode}_main_x")


def test_prefill_and_end_rings(params, cfg, fns, golden):
    _need(golden, "prefill_main_x")
    rings = _prefill_rings(params, cfg, fns, golden)
    for s in range(cfg.num_nextn_predict_layers):
        if f"prefill_ring_stage{s}" in golden:
            _exact(rings[s, 0], golden[f"prefill_ring_stage{s}"], f"prefill_ring_stage{s}")
    for mode in MODES:
        if f"{mode}_main_x" not in golden:
            continue
        end = _step_rings(params, cfg, fns, golden, mode)[:, -1]
        for s in range(cfg.num_nextn_predict_layers):
            if f"{mode}_end_ring_stage{s}" in golden:
                _exact(end[s], golden[f"{mode}_end_ring_stage{s}"], f"{mode}_end_ring_stage{s}")


# ------------------------------------------------------------------------------- stages
@pytest.mark.parametrize("mode", MODES)
def test_stages_from_recorded_inputs(params, cfg, fns, golden, shared, mode):
    names = [f"{mode}_{k}" for k in ("main_x", "input_ids", "stage_input", "stage_pre_mix")]
    _need(golden, *names)
    n_stages = cfg.num_nextn_predict_layers
    rings = _step_rings(params, cfg, fns, golden, mode)
    pos = jnp.asarray(_positions(golden, mode))
    x_in, pre_in = golden[f"{mode}_stage_input"], golden[f"{mode}_stage_pre_mix"]
    x0, pre0 = ds.stage0_input(shared["embed"], cfg, jnp.asarray(golden[f"{mode}_input_ids"]))
    _exact(x0, x_in[:, 0], f"{mode}_stage_input[:, 0]")
    _exact(pre0, pre_in[:, 0], f"{mode}_stage_pre_mix[:, 0]")
    for s in range(n_stages):
        x, pre = jnp.asarray(x_in[:, s]), jnp.asarray(pre_in[:, s])
        recorded = None
        if f"{mode}_gate_indices" in golden:
            recorded = jnp.asarray(golden[f"{mode}_gate_indices"][:, s])
            _, _, own_ids, _ = fns["stage"](params, x, pre, rings[s], pos, None, s)
            _exact(np.sort(np.asarray(own_ids), -1), np.sort(recorded, -1), f"{mode}_gate_indices stage {s}")
        out, out_pre, _, weights = fns["stage"](params, x, pre, rings[s], pos, recorded, s)
        if f"{mode}_gate_weights" in golden:
            _f32_close(weights, golden[f"{mode}_gate_weights"][:, s], f"{mode}_gate_weights stage {s}")
        if s + 1 < n_stages:
            _bf16_close(out, x_in[:, s + 1], f"stage {s} output vs {mode}_stage_input[:, {s + 1}]")
            _f32_close(
                out_pre,
                pre_in[:, s + 1],
                f"stage {s} pre-mix vs {mode}_stage_pre_mix[:, {s + 1}]",
                PRE_MIX_REL,
            )
        else:
            if f"{mode}_last_stage_output" in golden:
                _bf16_close(out, golden[f"{mode}_last_stage_output"], f"{mode}_last_stage_output")
            if f"{mode}_last_stage_pre_mix" in golden:
                _f32_close(
                    out_pre, golden[f"{mode}_last_stage_pre_mix"], f"{mode}_last_stage_pre_mix", PRE_MIX_REL
                )


def test_stale_ring_control_fails(params, cfg, fns, golden):
    """Negative control: the stage reading a ring without the current position's main_x must not match."""
    mode = "reference"
    _need(golden, f"{mode}_main_x", f"{mode}_stage_input", f"{mode}_stage_pre_mix", f"{mode}_gate_indices")
    if cfg.num_nextn_predict_layers == 1:
        _need(golden, f"{mode}_last_stage_output")
    rings = _step_rings(params, cfg, fns, golden, mode)
    stale = jnp.concatenate([_prefill_rings(params, cfg, fns, golden), rings[:, :-1]], axis=1)
    pos = jnp.asarray(_positions(golden, mode))
    x, pre = (
        jnp.asarray(golden[f"{mode}_stage_input"][:, 0]),
        jnp.asarray(golden[f"{mode}_stage_pre_mix"][:, 0]),
    )
    ids = jnp.asarray(golden[f"{mode}_gate_indices"][:, 0])
    out = fns["stage"](params, x, pre, stale[0], pos, ids, 0)[0]
    ref = (
        golden[f"{mode}_stage_input"][:, 1]
        if cfg.num_nextn_predict_layers > 1
        else golden[f"{mode}_last_stage_output"]
    )
    with pytest.raises(AssertionError):
        _bf16_close(out, ref, "stale-ring control")


# ------------------------------------------------------------------------------- output heads
@pytest.mark.parametrize("mode", MODES)
def test_head_markov_confidence(params, cfg, golden, shared, mode):
    g = lambda k: golden[f"{mode}_{k}"]
    _need(golden, *(f"{mode}_{k}" for k in ("head_input", "head_norm_output", "base_logits", "draft_ids")))
    if f"{mode}_last_stage_output" in golden and f"{mode}_last_stage_pre_mix" in golden:
        hin = ds.head_input(jnp.asarray(g("last_stage_output")), jnp.asarray(g("last_stage_pre_mix")))
        _bf16_close(hin, g("head_input"), f"{mode}_head_input")
    normed, _ = ds.base_logits(params, cfg, shared["head"], jnp.asarray(g("head_input")))
    _bf16_close(normed, g("head_norm_output"), f"{mode}_head_norm_output")
    _, base = ds.base_logits(params, cfg, shared["head"], jnp.asarray(g("head_input")))
    _f32_close(base, g("base_logits"), f"{mode}_base_logits")
    block = g("base_logits").shape[1]
    prev = jnp.asarray(g("draft_ids")[:, :block])  # position j's previous id: recorded input / draft j-1
    emb, bias = ds.markov(params, cfg, prev)
    if f"{mode}_markov_embed" in golden:
        _exact(emb, g("markov_embed"), f"{mode}_markov_embed")
    if f"{mode}_markov_bias" in golden:
        _f32_close(bias, g("markov_bias"), f"{mode}_markov_bias")
    if f"{mode}_logits" in golden:
        _f32_close(g("base_logits") + np.asarray(bias), g("logits"), f"{mode}_logits")
    if f"{mode}_confidence" in golden:
        conf = ds.confidence(params, cfg, jnp.asarray(g("head_input")), emb)
        _f32_close(conf, g("confidence"), f"{mode}_confidence")
    # Greedy sequential drafting from the recorded base logits reproduces the recorded draft ids.
    _, _, _, drafts = ds.sequential_markov(
        params, cfg, jnp.asarray(g("base_logits")), jnp.asarray(g("draft_ids")[:, 0])
    )
    if f"{mode}_logits" in golden:
        _drafts_match(drafts, g("draft_ids"), g("logits"), f"{mode}_draft_ids")


def test_markov_by_input_id_control_fails(params, cfg, golden):
    """Negative control: the Markov bias indexed by the input id at every position must not match."""
    mode = "reference"
    _need(golden, f"{mode}_base_logits", f"{mode}_draft_ids", f"{mode}_logits")
    base = jnp.asarray(golden[f"{mode}_base_logits"])
    ids = jnp.asarray(golden[f"{mode}_draft_ids"][:, 0])
    forced = jnp.broadcast_to(ids[:, None], base.shape[:2])
    logits = ds.sequential_markov(params, cfg, base, ids, forced_prev=forced)[0]
    with pytest.raises(AssertionError):
        _f32_close(logits, golden[f"{mode}_logits"], "input-id Markov control")


# ------------------------------------------------------------------------------- whole step
def test_draft_steps_end_to_end(params, cfg, fns, golden, shared):
    """Both modes as two rows: prefill insertion, then each step from the recorded main_x and input id."""
    modes = [m for m in MODES if f"{m}_main_x" in golden and f"{m}_input_ids" in golden]
    if not modes or "prefill_main_x" not in golden:
        pytest.skip("fixture lacks prefill_main_x or <mode>_main_x / <mode>_input_ids")
    rows = len(modes)
    rings = jnp.broadcast_to(
        _prefill_rings(params, cfg, fns, golden),
        (cfg.num_nextn_predict_layers, rows, cfg.sliding_window, cfg.head_dim),
    )
    steps = golden[f"{modes[0]}_main_x"].shape[0]
    for i in range(steps):
        mx = jnp.asarray(np.stack([golden[f"{m}_main_x"][i] for m in modes]))
        ids = jnp.asarray(np.stack([golden[f"{m}_input_ids"][i] for m in modes]))
        pos = jnp.asarray(np.stack([_positions(golden, m)[i] for m in modes]))
        out, rings = fns["draft"](params, shared["embed"], shared["head"], rings, mx, ids, pos)
        for r, m in enumerate(modes):
            for key in ("logits", "confidence", "markov_bias"):
                if f"{m}_{key}" in golden:
                    # Whole-step budget: a one-ulp stage output would move these by ~1e-3 of scale.
                    _f32_close(getattr(out, key)[r], golden[f"{m}_{key}"][i], f"{m}_{key}[{i}]", rel=1e-3)
            if f"{m}_draft_ids" in golden and f"{m}_logits" in golden:
                ref = golden[f"{m}_draft_ids"][i : i + 1]
                _drafts_match(
                    out.draft_ids[r : r + 1], ref, golden[f"{m}_logits"][i : i + 1], f"{m}_draft_ids[{i}]"
                )
    for r, m in enumerate(modes):
        for s in range(cfg.num_nextn_predict_layers):
            if f"{m}_end_ring_stage{s}" in golden:
                _exact(rings[s, r], golden[f"{m}_end_ring_stage{s}"], f"{m}_end_ring_stage{s}")


# ------------------------------------------------------------------------------- loader
def test_loader_names_a_missing_tensor(fixture_dir, cfg, tmp_path):
    """A checkpoint whose index lacks one DSpark tensor is refused with that tensor's name."""
    index = json.loads((fixture_dir / "model.safetensors.index.json").read_text())
    victim = next(n for n in index["weight_map"] if n.startswith("mtp.") and n.endswith("main_norm.weight"))
    del index["weight_map"][victim]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for file in set(index["weight_map"].values()):
        (tmp_path / file).symlink_to((fixture_dir / file).resolve())
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_dspark_params(tmp_path, cfg)
