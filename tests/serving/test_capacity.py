"""The capacity planner's byte counts, pinned to the released tensor inventory (spec 4.3 / 5.2 / 2.4)
and to the engine's state layout, and its verdicts on the deployment article's example (8 x 80 GiB)."""

from __future__ import annotations

import json
import math

import pytest

from ced_cli.main import main
from ced_jax import sharding
from ced_jax.config import preset
from serving.planning.capacity import (
    GIB,
    Hardware,
    activation_ledger,
    checkpoint_bytes,
    format_plan,
    kv_bytes_per_token,
    kv_ledger,
    mesh_candidates,
    plan,
    weight_ledger,
)

EP = sharding.EP_TP_RULES
# Backbone and Engram-table bytes of the release, by stored dtype (hf_inventory; the spec's
# storage table adds DSpark and vision on top, see test_checkpoint_bytes_match_spec_storage_table).
BACKBONE = {
    "BF16": 2_845_928_448,
    "F32": 157_428_160,
    "F8_E4M3": 6_836_715_520,
    "F8_E8M0": 16_993_607_680,
    "I8": 271_790_899_200,
}
ENGRAM_TABLES = {"F8_E4M3": 196_613_849_600, "F8_E8M0": 6_144_182_800}
# wo_a: FP8 [8192, 4096] + ue8m0 [256, 128] in the release, dequantised to BF16 by the model.
WO_A_FP8, WO_A_SCALE, WO_A_BF16 = 8192 * 4096, 256 * 128, 8192 * 4096 * 2


@pytest.fixture(scope="module")
def flash():
    return preset("v41-flash")


def test_checkpoint_bytes_pinned(flash):
    stored = checkpoint_bytes(flash)
    assert stored["backbone"] == BACKBONE
    assert stored["engram_table"] == ENGRAM_TABLES
    assert sum(BACKBONE.values()) == 298_624_579_008  # the "about 300 GB" of FP8/FP4 backbone


def test_checkpoint_bytes_match_spec_storage_table(flash):
    """Spec 5.2 'Storage by dtype' (all groups, rounded to 3-4 digits)."""
    stored = checkpoint_bytes(flash)
    total = {d: sum(g.get(d, 0) for g in stored.values()) for d in BACKBONE}
    spec = {"BF16": 3.95e9, "F32": 1.69e8, "F8_E4M3": 2.040e11, "F8_E8M0": 2.356e10, "I8": 2.786e11}
    for dtype, want in spec.items():
        assert total[dtype] == pytest.approx(want, rel=2e-3), dtype


def test_resident_weights_are_the_stored_bytes_with_wo_a_in_bf16(flash):
    led = weight_ledger(flash, {"data": 1, "expert": 1, "tensor": 1}, EP, engram_on_host=False)
    layers = flash.num_layers
    want = {d: BACKBONE.get(d, 0) + ENGRAM_TABLES.get(d, 0) for d in BACKBONE}
    want["F8_E4M3"] -= layers * WO_A_FP8
    want["F8_E8M0"] -= layers * WO_A_SCALE
    want["BF16"] += layers * WO_A_BF16
    assert led["resident_total_by_dtype"] == want
    assert led["per_device_by_dtype"] == want  # one device holds everything
    assert led["host"] == 0


def test_per_device_weights_follow_the_rules(flash):
    # Expert parallelism over 8: each device holds 48 of the 384 experts, and their scales.
    ep8 = weight_ledger(flash, {"data": 1, "expert": 8, "tensor": 1}, EP, engram_on_host=True)
    assert ep8["per_device_by_dtype"]["I8"] == BACKBONE["I8"] // 8
    assert ep8["host"] == sum(ENGRAM_TABLES.values())
    # Pure tensor parallelism over 8 splits the expert width instead: the same bytes per device.
    tp8 = weight_ledger(flash, {"data": 1, "expert": 1, "tensor": 8}, sharding.TP_RULES, engram_on_host=True)
    assert tp8["per_device_by_dtype"]["I8"] == BACKBONE["I8"] // 8
    # embed and head [129280, 5120] BF16 are vocabulary-parallel under tensor parallelism.
    assert tp8["per_device_by_part"]["embed_head"] == 2 * 129280 * 5120 * 2 // 8
    assert ep8["per_device_by_part"]["embed_head"] == 2 * 129280 * 5120 * 2
    # Data parallelism replicates: 2 x (expert 4) holds twice what expert 8 holds.
    dp = weight_ledger(flash, {"data": 2, "expert": 4, "tensor": 1}, EP, engram_on_host=True)
    assert dp["per_device_by_dtype"]["I8"] == 2 * ep8["per_device_by_dtype"]["I8"]


def test_kv_ledger_is_the_engine_state_890_bytes_per_token_plus_slots(flash):
    assert kv_bytes_per_token(flash) == 890
    mesh = {"data": 2, "expert": 4, "tensor": 1}
    context, page = 1 << 20, 16
    kv = kv_ledger(flash, mesh, EP, max_seqs=32, context=context, page_size=page)
    assert kv["bytes_per_token"] == 890
    per_seq = kv["per_sequence"]
    assert per_seq["compressed"] == 890 * context
    assert per_seq["swa_rings"] == 40 * 128 * 528  # 512 FP8 + 16 ue8m0 per entry, every layer
    assert per_seq["compressor_states"] == 3 * 2 * 2 * 512 * 4  # ratio-2 sources, f32 kv + score
    assert "page_table" not in per_seq  # host state, sent with each step's metadata
    assert kv["total"] == 32 * kv["per_sequence_total"]
    assert kv["sequences_per_device"] == 16  # the slots split over data
    # The engine keeps every page on every device (the prefix cache shares pages between slots);
    # only the per-slot state (rings, partial groups) is split with the slots.
    slot_state = per_seq["swa_rings"] + per_seq["compressor_states"]
    assert kv["per_device"] == 32 * per_seq["compressed"] + 16 * slot_state


def test_kv_ledger_takes_whole_pages(flash):
    """A context that is not a whole number of pages holds whole pages, as a server's max_context."""
    one = {"data": 1, "expert": 1, "tensor": 1}
    odd = kv_ledger(flash, one, EP, max_seqs=1, context=17, page_size=16)
    assert odd["pages"] == 2 and odd["per_sequence"]["compressed"] == 890 * 32
    with pytest.raises(ValueError, match="page_size 15 is not a multiple"):
        kv_ledger(flash, one, EP, max_seqs=1, context=30, page_size=15)


def test_activations_grow_with_the_buckets(flash):
    mesh = {"data": 1, "expert": 8, "tensor": 1}
    small = activation_ledger(flash, mesh, EP, prefill_bucket=64, max_seqs=8, context=8192)
    big = activation_ledger(flash, mesh, EP, prefill_bucket=512, max_seqs=64, context=1 << 20)
    assert big["decode"]["peak"] > small["decode"]["peak"] > 0  # 64 rows against 8
    # The prefill's page step has the same 64 tokens at both shapes: only its indexer grows with the
    # context, and with the row scored in blocks it stays below the head's step here.
    assert big["prefill"]["indexer"] > small["prefill"]["indexer"]
    assert big["prefill"]["peak"] == small["prefill"]["peak"] > 0
    # The server's prefill runs a page (16 tokens) of each of its 4 rows per loop iteration; the
    # indexer scores a 1M-entry row in blocks of 8,192 entries (32 heads' scores of one block), and
    # the row's scores (twice: the blocks, then the joined row) grow with the context.
    assert big["prefill"]["tokens"] == 4 * 16 and big["prefill"]["rows"] == 4
    assert big["prefill"]["indexer"] == 4 * 16 * (32 * (8192 + 128) + 2 * (1 << 20)) * 4
    assert small["prefill"]["indexer"] == 4 * 16 * 32 * (8192 + 128) * 4  # one block: no join
    # The prefill makes its weights' f32 copies inside each page iteration, one sublayer's at a time as
    # a decode step does (`ced_jax.engine.programs._loop_params`; hoisted out of the loop they were 30.8 GiB
    # per device here): at the small shapes its peak is within 1 GiB of the decode step's.
    assert abs(small["prefill"]["peak"] - small["decode"]["peak"]) < GIB


def test_mesh_candidates():
    got = mesh_candidates(8)
    assert len(got) == 10 and all(math.prod(m.values()) == 8 for m in got)
    assert {"data": 1, "expert": 4, "tensor": 2} in got


def test_article_example_8x80(flash):
    """8 x 80 GiB: not in BF16 (~1104 GB), yes in the native formats with Engram in host memory."""
    with_host = plan(flash, Hardware(8, 80, 512))
    art = with_host["article_estimate"]
    assert art["backbone_parameters"] == 551_880_835_184
    assert art["bf16_bytes"] == 1_103_761_670_368
    assert not art["bf16_fits_devices"] and art["stored_backbone_fits_devices"]
    assert with_host["fits"]
    best = with_host["recommended"]
    assert best["engram_tables"] == "host"
    # expert=8: the routed experts split eight ways. (Before the prefill's page loop stopped XLA from
    # hoisting every dense weight's f32 copy out of it, those copies left expert=8 under 10 % free.)
    assert best["mesh"] == {"data": 1, "expert": 8, "tensor": 1}
    assert best["per_device_total"] <= 0.9 * 80 * GIB
    assert best["host_total"] == sum(ENGRAM_TABLES.values())
    # Without a host memory budget the tables are still memory-mapped on the host (the engine's
    # default), so the same layout is recommended; on device they would fit nowhere.
    alone = plan(flash, Hardware(8, 80))
    assert alone["fits"] and alone["recommended"]["engram_tables"] == "host"
    assert alone["recommended"]["mesh"] == best["mesh"]
    on_device = [c for c in alone["candidates"] if c["engram_tables"] == "device"]
    assert on_device and not any(c["fits"] for c in on_device)
    # A host budget smaller than the tables rules host placement out.
    small = plan(flash, Hardware(8, 80, 64))
    assert not small["fits"] and "host memory" in small["advice"][0]


def test_plan_checks_its_inputs(flash):
    with pytest.raises(ValueError, match="has 4 devices"):
        plan(flash, Hardware(8, 80), mesh={"data": 1, "expert": 4, "tensor": 1})
    with pytest.raises(ValueError, match="--devices"):
        plan(flash, Hardware(0, 80))


def test_plan_refuses_meshes_the_rules_cannot_lay_out(flash):
    """64 devices: tensor=64 would split V4.1-Flash's 32 indexer heads and data=64 the 32 server
    slots. Both meshes are refused with the reason (never priced as if replicated, which the
    runtime refuses too); every other factorisation is evaluated and one is recommended."""
    p = plan(flash, Hardware(64, 80, 512), max_seqs=32)
    refused = {tuple(r["mesh"].values()): r["reason"] for r in p["refused"]}
    assert set(refused) == {(1, 1, 64), (64, 1, 1)}
    assert "weights_proj.weight (32, 5120)" in refused[(1, 1, 64)]
    assert "'index_heads', size 32" in refused[(1, 1, 64)] and "'tensor' of size 64" in refused[(1, 1, 64)]
    assert "'batch', size 32" in refused[(64, 1, 1)] and "'data' of size 64" in refused[(64, 1, 1)]
    evaluated = {tuple(c["mesh"].values()) for c in p["candidates"]}
    assert evaluated == {tuple(m.values()) for m in mesh_candidates(64)} - set(refused)
    assert p["fits"] and tuple(p["recommended"]["mesh"].values()) in evaluated
    assert "refused: --mesh data=1,expert=1,tensor=64" in format_plan(p)
    # 7 devices: 7 divides neither the vocabulary, the 384 experts nor 32 slots.
    with pytest.raises(ValueError, match=r"no \(data, expert, tensor\) mesh of 7 devices lays out"):
        plan(flash, Hardware(7, 80, 512), max_seqs=32)


def test_cli_plan_names_the_parameter_a_mesh_cannot_split(capsys):
    argv = ["plan", "--model", "v41-flash", "--devices", "64", "--device-memory", "80", "--mesh", "tensor=64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    for part in ("data=1,expert=1,tensor=64", "weights_proj.weight (32, 5120)", "'index_heads', size 32",
                 "'tensor' of size 64"):  # fmt: skip
        assert part in err, (part, err)


def test_cli_plan(capsys):
    argv = ["plan", "--model", "v41-flash", "--devices", "8", "--device-memory", "80"]
    assert main([*argv, "--host-memory", "512", "--mesh", "expert=4,tensor=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["mesh"] == {"data": 1, "expert": 4, "tensor": 2}
    assert set(out["recommended"]["ledgers"]) == {"weights", "activations", "kv", "overhead"}
    assert main(argv) == 0  # fits with the tables memory-mapped on the host (the engine's default)
    text = capsys.readouterr().out
    assert "1104 GB" in text and "--engram-placement host" in text
    assert main([*argv, "--host-memory", "64"]) == 1  # a host budget too small: exit 1, with the reason
    text = capsys.readouterr().out
    assert "does NOT fit" in text
    assert main([*argv, "--mesh", "expert=3"]) == 2
    assert "has 3 devices" in capsys.readouterr().err


# ---------------------------------------------------------------------- DSpark (serve --dspark K)
def test_dspark_state_is_the_speculative_engines_state(flash):
    """With DSpark the KV ledger is `new_state(..., with_draft=True)` of the engine: its bytes equal
    `jax.eval_shape` of it, and the difference to the plain state is each slot's draft rings
    (stages x window x SWA entry) and stored draft logits (block x vocab f32), split with the slots."""
    import jax

    from ced_jax import cache as cache_lib
    from ced_jax.engine import StateShapes, new_state
    from pallas_kernels import formats

    mesh = {"data": 2, "expert": 4, "tensor": 1}
    seqs, context, page = 8, 8192, 16
    plain = kv_ledger(flash, mesh, EP, max_seqs=seqs, context=context, page_size=page)
    spec = kv_ledger(flash, mesh, EP, max_seqs=seqs, context=context, page_size=page, with_draft=True)
    shapes = StateShapes(
        max_slots=seqs, page_size=page, num_pages=seqs * context // page, max_context=context
    )
    engine = jax.eval_shape(lambda: new_state(flash, shapes, with_draft=True))
    assert spec["total"] == cache_lib.buffer_bytes(engine)
    assert plain["total"] == cache_lib.buffer_bytes(jax.eval_shape(lambda: new_state(flash, shapes)))
    rings = flash.num_nextn_predict_layers * flash.sliding_window * formats.fp8_entry_bytes(flash.head_dim)
    logits = flash.dspark_block_size * flash.vocab_size * 4
    assert (rings, logits) == (3 * 128 * 528, 5 * 129280 * 4)
    assert spec["per_sequence"]["draft_rings"] == rings and spec["per_sequence"]["draft_logits"] == logits
    assert plain["per_sequence"]["draft_rings"] == plain["per_sequence"]["draft_logits"] == 0
    assert spec["total"] - plain["total"] == seqs * (rings + logits)
    assert spec["per_device"] - plain["per_device"] == (seqs // 2) * (rings + logits)  # data=2 splits slots


def test_dspark_weights_are_the_stages_on_every_device(flash):
    import numpy as np

    from ced_jax.checkpoint.mapping import our_param_specs

    stages = sum(
        math.prod(shape) * np.dtype(dtype).itemsize
        for shape, dtype in our_param_specs(flash, ("dspark",)).values()
    )
    assert stages > 7e9  # three stages with their own experts: not a rounding error beside 80 GiB
    for mesh, rules in (
        ({"data": 1, "expert": 8, "tensor": 1}, EP),
        ({"data": 1, "expert": 1, "tensor": 8}, sharding.TP_RULES),
    ):
        plain = weight_ledger(flash, mesh, rules, engram_on_host=True)
        spec = weight_ledger(flash, mesh, rules, engram_on_host=True, with_draft=True)
        assert spec["per_device"] - plain["per_device"] == stages  # replicated, whatever the mesh
        assert spec["per_device_by_part"]["dspark_stages"] == stages
        assert spec["resident_total"] - plain["resident_total"] == stages
        assert spec["host"] == plain["host"]


def test_dspark_decode_activations_are_the_verify_step(flash):
    mesh = {"data": 1, "expert": 8, "tensor": 1}
    kw = dict(prefill_bucket=512, max_seqs=32, context=1 << 16)
    plain = activation_ledger(flash, mesh, EP, **kw)
    spec = activation_ledger(flash, mesh, EP, **kw, dspark=4)
    assert plain["decode"]["tokens"] == 32 and spec["decode"]["tokens"] == 32 * 5
    assert spec["decode"]["tokens_per_sequence"] == 5
    # Logits at every verified position, beside the head weight's f32 copy (vocab x D, tensor=1).
    head_copy = flash.vocab_size * flash.hidden_size * 4
    assert spec["decode"]["head"] - head_copy == 5 * (plain["decode"]["head"] - head_copy) > 0
    assert spec["decode"]["peak"] > plain["decode"]["peak"]
    # The prefill's step is the same (it returns no slot state: a prefix hit replays instead).
    assert spec["prefill"] == plain["prefill"]


def test_plan_with_dspark(flash, capsys):
    base = plan(flash, Hardware(8, 80, 512), mesh={"data": 1, "expert": 4, "tensor": 2})
    spec = plan(flash, Hardware(8, 80, 512), mesh={"data": 1, "expert": 4, "tensor": 2}, dspark=4)
    a, b = base["recommended"]["ledgers"], spec["recommended"]["ledgers"]
    assert spec["workload"]["dspark"] == 4 and base["workload"]["dspark"] == 0
    for ledger in ("weights", "kv"):
        assert b[ledger]["per_device"] > a[ledger]["per_device"], ledger
    # The verify step is larger than a decode step, and on this layout larger than the prefill's page
    # step too, so it is the activations' peak.
    assert b["activations"]["decode"]["peak"] > a["activations"]["decode"]["peak"]
    assert b["activations"]["per_device"] == b["activations"]["decode"]["peak"]
    assert b["activations"]["per_device"] > a["activations"]["per_device"]
    added = sum(b[k]["per_device"] - a[k]["per_device"] for k in ("weights", "activations", "kv"))
    assert spec["recommended"]["per_device_total"] - base["recommended"]["per_device_total"] == added
    assert "DSpark K=4" in format_plan(spec) and "draft logits" in format_plan(spec)
    with pytest.raises(ValueError, match=r"--dspark 6: at most the model's draft block size 5"):
        plan(flash, Hardware(8, 80, 512), dspark=6)
    with pytest.raises(ValueError, match=r"--dspark 1: the model .* has no DSpark draft stages"):
        plan(flash.replace(num_nextn_predict_layers=0), Hardware(8, 80, 512), dspark=1)
    argv = ["plan", "--model", "v41-flash", "--devices", "8", "--device-memory", "80", "--host-memory", "512"]
    assert main([*argv, "--mesh", "expert=4,tensor=2", "--dspark", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["dspark"] == 4
    assert out["recommended"]["per_device_total"] == spec["recommended"]["per_device_total"]
    assert main([*argv, "--dspark", "-1"]) == 2
    assert "dspark (--dspark) must be an integer >= 0, got -1" in capsys.readouterr().err


def test_dp_ep_splits_the_pages_and_the_rows_over_every_device():
    """Under dp_ep each device holds its own slots' pages (an eighth of the pool on 8 devices) and runs
    its block of the prefill's rows, whose count is rounded up to the devices as the server needs."""
    cfg = preset("v41-flash")
    mesh = {"data": 1, "expert": 8, "tensor": 1}
    kw = dict(max_seqs=32, context=2048)
    ep = kv_ledger(cfg, mesh, sharding.EP_TP_RULES, **kw)
    dp = kv_ledger(cfg, mesh, sharding.DP_EP_RULES, **kw)
    assert ep["pages_per_device"] == ep["pages"] == dp["pages"] == 8 * dp["pages_per_device"]
    assert dp["per_device"] * 8 == dp["total"]  # every buffer, pages and per-slot state, split 8 ways
    assert ep["per_device"] > dp["per_device"]
    act = activation_ledger(cfg, mesh, sharding.DP_EP_RULES, prefill_bucket=128, **kw)
    assert act["prefill"]["rows"] == 8 and act["prefill"]["rows_per_device"] == 1
    assert act["prefill"]["tokens"] == 16 and act["decode"]["tokens"] == 4  # one 16-token page; 32 / 8
