"""Capacity planner: will DeepSeek-V4.1-Flash fit on N devices of G GiB, and on which mesh?

Four ledgers per device, each from the real layout rather than a bytes-per-parameter guess:

- weights: every tensor of the released checkpoint in the dtype it is actually stored in
  (`ced_jax.checkpoint.mapping.hf_inventory`: FP4 experts packed two per byte, FP8 with ue8m0
  scales, BF16 / F32 for the rest), mapped to our parameter tree (`our_param_specs`: experts
  stacked, `wo_a` dequantised to BF16 as the model keeps it) and divided over the mesh by the very
  rules the runtime places them with (`ced_jax.sharding.logical_to_spec` over the parameters'
  logical axes). The two Engram hash tables either live in host memory (their rows are gathered per
  token, spec 5.5: `ced_jax.engram_store`, zero device bytes) or on every device (the rules do not
  split them), which is what `serve --engram-placement host|device` does; the recommendation names
  the flag;
- activations: the live set of the reference path (impl="reference") in the server's two programs,
  the prefill (`prefill_rows` chunks, a page of each per loop iteration) and one decode batch, from
  the shapes the model materialises, the f32 copies the reference makes of its dense weights
  included, one sublayer's at a time in both programs (the prefill's page loop ties the parameters
  to its counter, `ced_jax.engine.programs._loop_params`, so XLA cannot hoist every copy out of it; see
  `activation_ledger` for the terms). `ced-jax plan --compile` (`serving.planning.compile_proof`)
  compiles both programs and sets XLA's memory analysis beside the ledgers;
- KV: the serving engine's device state itself, `jax.eval_shape` of `ced_jax.cache.init_paged_cache`
  at the server's shapes (nothing allocated): the page buffers in the deployment formats (890 bytes
  per token for v41-flash) for every sequence's context in whole pages, and each slot's
  sliding-window rings, compressor partial groups and page table; each buffer divided over the mesh
  as the engine lays it out (`ced_jax.cache.paged_cache_axes` under the rules: per-slot state over
  the batch axis, page buffers on every device);
- framework overhead: max(1 GiB, 5 % of device memory) for the runtime, compiled programs,
  collective scratch and allocator slack (an assumption, stated as such).

With DSpark speculative decoding (`dspark` K > 0, `serve --dspark K`): the weights ledger adds the
draft stages' parameters (`our_param_specs(cfg, ("dspark",))`, in their storage dtypes), whole on
every device as the runtime replicates them; the KV ledger is the state of `new_state(...,
with_draft=True)`: each slot's draft context rings (num_nextn_predict_layers x sliding_window x
fp8_entry_bytes(head_dim)) and its stored draft logits (dspark_block_size x vocab f32), split with
the slots; the decode activations are those of the verify step, K + 1 tokens per sequence. The
draft stages' own forward (dspark_block_size positions per slot through SWA-only blocks) is not
priced separately: its blocks have no indexer nor compressed entries and run before the verify
step, whose live set is the larger one for K + 1 >= dspark_block_size (the usual K = block - 1 or
block); for a smaller K this may underestimate the decode peak.

The workload (sequences, context, prefill chunk, page size) defaults to a server's:
`serving.config.ServeConfig`. `plan()` evaluates one mesh, or every (data, expert, tensor)
factorisation of the device count, and recommends a fitting mesh: one that leaves 10 % of each
device free if any does, then the most data-parallel replicas, Engram tables on device rather than
host, the widest expert axis. It also restates the naive estimate of the deployment article (every
parameter in BF16).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import jax
import ml_dtypes
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax import sharding
from ced_jax.checkpoint.mapping import TEXT_GROUPS, hf_inventory, our_param_specs
from ced_jax.config import ModelConfig
from ced_jax.model import flatten_specs, param_specs
from ced_jax.model.layers import kernels
from serving.config import ServeConfig, default_long_prefill_chunk

SERVE = ServeConfig()  # the shapes a server starts with: the default workload

GIB = 1024**3
GB = 1000**3
OVERHEAD_MIN_BYTES = GIB
OVERHEAD_FRACTION = 0.05
HEADROOM = 0.10  # a recommended mesh should leave this share of each device free
F32 = 4


# ---------------------------------------------------------------------- weights
_inventory = functools.lru_cache(maxsize=4)(hf_inventory)


def _stored_dtype(path: str, dtype: np.dtype) -> str:
    """Our storage dtype -> the checkpoint's dtype name (uint8 is packed FP4 or ue8m0 scales)."""
    if dtype == np.uint8:
        return "I8" if ".ffn.experts." in path and path.endswith(".weight") else "F8_E8M0"
    return {
        np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
        np.dtype(ml_dtypes.bfloat16): "BF16",
        np.dtype(np.float32): "F32",
    }[np.dtype(dtype)]


def _category(path: str) -> str:
    if path.startswith("mtp."):
        return "dspark_stages"
    if ".engram.embed." in path:
        return "engram_tables"
    if ".ffn.experts." in path:
        return "routed_experts"
    if ".ffn.shared_experts." in path:
        return "shared_experts"
    if path.startswith(("embed.", "head.")):
        return "embed_head"
    if ".attn." in path:
        return "attention"
    return "other"


@functools.lru_cache(maxsize=4)
def checkpoint_bytes(cfg: ModelConfig) -> dict:
    """Bytes of the released checkpoint by group and dtype, exactly as stored."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for spec in _inventory(cfg).values():
        out[spec.group][spec.dtype] += spec.nbytes
    return {g: dict(v) for g, v in out.items()}


@functools.lru_cache(maxsize=4)
def _resident_tensors(cfg: ModelConfig) -> tuple:
    """(path, shape, itemsize, stored dtype, part, logical axes) of every parameter we hold
    (the inventory walk is the slow part; a plan evaluates many meshes)."""
    axes = {name: spec.axes for name, spec in flatten_specs(param_specs(cfg)).items()}
    return tuple(
        (path, shape, np.dtype(dtype).itemsize, _stored_dtype(path, dtype), _category(path), axes[path])
        for path, (shape, dtype) in our_param_specs(cfg, TEXT_GROUPS).items()
    )


@functools.lru_cache(maxsize=4)
def _dspark_tensors(cfg: ModelConfig) -> tuple:
    """(path, shape, itemsize, stored dtype, part) of every DSpark stage parameter
    (`params["mtp"]`, as `ced_jax.load` holds them: storage dtypes, experts stacked)."""
    return tuple(
        (path, shape, np.dtype(dtype).itemsize, _stored_dtype(path, dtype), _category(path))
        for path, (shape, dtype) in our_param_specs(cfg, ("dspark",)).items()
    )


def weight_ledger(
    cfg: ModelConfig,
    mesh: dict[str, int],
    rules: sharding.Rules,
    engram_on_host: bool,
    *,
    with_draft: bool = False,
) -> dict:
    """Per-device and total resident weight bytes (by dtype and by part) under `rules` on `mesh`.
    with_draft: also the DSpark draft stages, whole on every device (the runtime replicates them:
    `ced_jax.checkpoint.place.dspark_to_device`)."""
    per_device_dtype: dict[str, int] = defaultdict(int)
    per_device_part: dict[str, int] = defaultdict(int)
    total_dtype: dict[str, int] = defaultdict(int)
    host = 0
    for _path, shape, itemsize, stored, part in _dspark_tensors(cfg) if with_draft else ():
        nbytes = math.prod(shape) * itemsize
        total_dtype[stored] += nbytes
        per_device_dtype[stored] += nbytes
        per_device_part[part] += nbytes
    for path, shape, itemsize, stored, part, axes in _resident_tensors(cfg):
        nbytes = math.prod(shape) * itemsize
        total_dtype[stored] += nbytes
        if part == "engram_tables" and engram_on_host:
            host += nbytes
            continue
        spec = sharding.logical_to_spec(axes, rules, shape, mesh, name=f"parameter {path}")
        shard = math.prod(sharding.shard_shape(shape, spec, mesh)) * itemsize
        per_device_dtype[stored] += shard
        per_device_part[part] += shard
    return {
        "resident_total_by_dtype": dict(total_dtype),
        "resident_total": sum(total_dtype.values()),
        "per_device_by_dtype": dict(per_device_dtype),
        "per_device_by_part": dict(per_device_part),
        "per_device": sum(per_device_dtype.values()),
        "host": host,
        "engram_tables": "host" if engram_on_host else "device",
    }


# ---------------------------------------------------------------------- activations
def _local(size: int, axis: str, rules: sharding.Rules, mesh: dict[str, int], what: str) -> int:
    """Per-device extent of a dimension of `size` carrying logical `axis` (of the activation
    `what`), by the rules."""
    spec = sharding.logical_to_spec((axis,), rules, (size,), mesh, name=what)
    return sharding.shard_shape((size,), spec, mesh)[0]


def _dequantised_weights(cfg: ModelConfig, mesh: dict[str, int], rules: sharding.Rules) -> dict:
    """The f32 copies of the dense weights one device makes (the reference path dequantises every
    FP8 weight and widens every BF16 one before its f32 matmul: `ced_jax.model.layers.common`), per device:
    the largest single copy of each sublayer
    ("attention" with its indexer and compressor, "engram" its wkv, "moe" the shared expert and gate,
    "head"). Routed experts are dequantised one expert at a time inside the MoE (see `_step_activations`);
    F32 weights need no copy; the embedding's rows are gathered before they are widened."""
    largest: dict[str, int] = defaultdict(int)
    for path, shape, _itemsize, stored, part, axes in _resident_tensors(cfg):
        if stored not in ("BF16", "F8_E4M3") or part in ("engram_tables", "routed_experts", "dspark_stages"):
            continue
        spec = sharding.logical_to_spec(axes, rules, shape, mesh, name=f"parameter {path}")
        copy = math.prod(sharding.shard_shape(shape, spec, mesh)) * F32
        if path.startswith("head."):
            site = "head"
        elif ".attn." in path:
            site = "attention"
        elif ".engram." in path:
            site = "engram"
        elif ".ffn." in path:
            site = "moe"
        else:
            continue  # the embedding (rows gathered first) and the norms (vectors)
        largest[site] = max(largest[site], copy)
    return dict(largest)


def _step_activations(
    cfg: ModelConfig,
    mesh: dict[str, int],
    rules: sharding.Rules,
    n: int,
    chunk: int,
    context: int,
    step_tokens: int | None = None,
) -> dict:
    """Live bytes of one forward with n tokens on a device (chunk = tokens per sequence); step_tokens:
    the step's tokens over all devices (None: n), which the MoE splits over its token shards.

    The sublayers run one after another, so the peak is the residual streams plus the largest of
    attention, indexer, Engram, MoE and head, each with the f32 copy of its largest dense weight
    (`_dequantised_weights`). In the server's prefill the forward repeats in a loop (a page per
    iteration) whose parameters are tied to the loop counter (`ced_jax.engine.programs._loop_params`): without
    that, XLA hoisted every weight's f32 copy out of the loop and all of them were live through it
    (30.8 GiB per device for v41-flash at expert=8, measured by `serving.planning.compile_proof`)."""
    D, M, hd, W = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.sliding_window
    heads = _local(cfg.num_heads, "q_heads", rules, mesh, "attention heads")
    index_heads = _local(cfg.index_n_heads, "index_heads", rules, mesh, "indexer heads")
    copies = _dequantised_weights(cfg, mesh, rules)
    weight = lambda site: copies.get(site, 0)  # noqa: E731
    streams = 3 * n * M * D * F32  # input, residual, output of an mHC site
    # q and o; logits over window ring + chunk keys and over the selected compressed entries.
    attention = n * (2 * heads * hd + heads * (W + chunk + cfg.index_topk) + cfg.index_topk * hd) * F32
    # Per-head indexer scores before the head reduction, over every compressed entry so far; a longer
    # row is scored a block at a time (`ced_jax.model.layers.kernels.index_scores`), so the per-head
    # scores are one
    # block's, beside the row's scores and their copy as the blocks are joined.
    ratios = [cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids] or [1]
    entries = -(-context // min(ratios))
    block = min(entries, kernels.INDEX_SCORE_BLOCK)
    joined = 2 * entries if entries > block else 0
    indexer = n * (index_heads * (block + cfg.index_head_dim) + joined) * F32
    # Engram: the step's rows dequantised (C per token), then key and value for every stream.
    engram = (
        n * (cfg.engram_hash_cols * cfg.engram_head_dim + (M + 1) * D) * F32 if cfg.engram_layer_ids else 0
    )
    # MoE: padded all_to_all buffers, hidden activations, and the routed experts' f32 weights: with
    # at least as many rows as local experts and unsplit experts, the reference loops over the experts
    # and dequantises one expert's w1, w3, w2 at a time; with fewer rows it gathers each row's expert
    # matrix (one of w1/w3/w2 at a time); with experts split along their width, the dequantised stack.
    ml = _moe_split(cfg, mesh, rules)
    n_loc = -(-(n if step_tokens is None else step_tokens) // ml["token_shards"])
    rows = ml["ep"] * n_loc * cfg.num_experts_per_tok
    F, f_loc, d_loc, e_loc = cfg.moe_intermediate_size, ml["f_local"], ml["d_local"], ml["e_local"]
    buffers = rows * (2 * D + 3 * f_loc + F + 2 * d_loc) * F32
    if rows < e_loc:
        dequant = rows * max(f_loc * D, d_loc * F) * F32
    elif ml["f_split"]:
        dequant = e_loc * max(f_loc * D, d_loc * F) * F32
    else:
        dequant = (2 * f_loc * D + d_loc * F) * F32
    vocab = _local(cfg.vocab_size, "vocab", rules, mesh, "logits")
    head = n * (vocab + cfg.vocab_size) * F32  # sharded logits, then replicated for the host
    parts = {
        "attention": attention + weight("attention"),
        "indexer": indexer,
        "engram": engram + weight("engram"),
        "moe": buffers + dequant + weight("moe"),
        "head": head + weight("head"),
    }
    return {
        "tokens": n,
        "streams": streams,
        **parts,
        "moe_expert_dequant": dequant,
        "peak": streams + max(parts.values()),
    }


def _moe_split(cfg: ModelConfig, mesh: dict[str, int], rules: sharding.Rules) -> dict:
    """How the routed experts split on `mesh` (the same derivation as ced_jax.sharding.moe_layout)."""
    from ced_jax.model.layers.moe import EXPERT_AXES

    E, F, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w1 = sharding.logical_to_spec(EXPERT_AXES, rules, (E, F, D // 2), mesh, name="routed experts w1")
    w2 = sharding.logical_to_spec(EXPERT_AXES, rules, (E, D, F // 2), mesh, name="routed experts w2")
    ep = mesh.get(w1[0], 1) if w1[0] else 1
    width_axes = {a for a in (w1[1], w2[1]) if a}
    token_shards = math.prod(s for a, s in mesh.items() if a not in width_axes)
    return {
        "ep": ep,
        "e_local": E // ep,
        "f_local": F // (mesh[w1[1]] if w1[1] else 1),
        "d_local": D // (mesh[w2[1]] if w2[1] else 1),
        "token_shards": token_shards,
        "f_split": bool(w1[1]),
    }


def prefill_rows(max_seqs: int) -> int:
    """Rows of the server's prefill program for `max_seqs` slots (`ServeConfig.prefill_rows`' default)."""
    return max(ServeConfig(max_slots=max_seqs).prefill_rows)


def activation_ledger(
    cfg: ModelConfig,
    mesh: dict[str, int],
    rules: sharding.Rules,
    *,
    prefill_bucket: int,
    max_seqs: int,
    context: int,
    page_size: int = SERVE.page_size,
    dspark: int = 0,
    long_prefill_step: int | None = None,
) -> dict:
    """Per-device activation peak of the server's prefill programs and of a decode step.

    Prefill (`ced_jax.engine.programs.prefill_batch`): `prefill_rows(max_seqs)` rows of `prefill_bucket`-token
    chunks, run a page of every row per loop iteration (rows x page_size tokens per forward, chunk
    page_size; the chunk length does not change the peak; its outputs beside the state are only the
    samples). The long-prompt prefill (`ServeConfig.long_prefill_chunk`): one row per device block,
    `long_prefill_step` tokens per forward (None: the server's default at this context, 0: none).
    Decode: `max_seqs` sequences split over the batch axis, one token each (with `dspark` K drafts the
    verify step: K + 1 tokens each)."""
    seqs = _sequences_per_device(mesh, rules, max_seqs)
    rows = prefill_rows(max_seqs)
    # Data-parallel attention (dp_ep): the prefill's rows are a multiple of the devices (the server
    # refuses others) and each device runs its block of them.
    shards = _attention_shards(mesh, rules)
    rows = -(-rows // shards) * shards
    prefill = _step_activations(
        cfg, mesh, rules, rows // shards * page_size, page_size, context, step_tokens=rows * page_size
    )
    prefill["rows"] = rows
    prefill["rows_per_device"] = rows // shards
    per_seq = dspark + 1
    decode = _step_activations(
        cfg, mesh, rules, seqs * per_seq, per_seq, context, step_tokens=max_seqs * per_seq
    )
    decode["tokens_per_sequence"] = per_seq
    if long_prefill_step is None:
        long_prefill_step = SERVE.long_prefill_step if default_long_prefill_chunk(context) else 0
    ledger = {"prefill": prefill, "decode": decode}
    if long_prefill_step:
        ledger["long_prefill"] = _step_activations(
            cfg, mesh, rules, long_prefill_step, long_prefill_step, context,
            step_tokens=long_prefill_step * shards,
        )  # fmt: skip
    return {**ledger, "per_device": max(part["peak"] for part in ledger.values())}


def _attention_shards(mesh: dict[str, int], rules: sharding.Rules) -> int:
    """Devices attention is data-parallel over (each with its own rows, slots and pages): > 1 only
    under rules that split the page pool (dp_ep)."""
    layout = sharding.make_layout(mesh, rules)
    return 1 if layout is None else layout.attention_shards


def _sequences_per_device(mesh: dict[str, int], rules: sharding.Rules, max_seqs: int) -> int:
    """Sequences one device holds: the server's slots split over the batch's mesh axis, which must
    divide them (the engine lays its cache out by the same rule)."""
    spec = sharding.logical_to_spec(
        ("batch",), rules, (max_seqs,), mesh, name="--max-seqs (the server's slots)"
    )
    return sharding.shard_shape((max_seqs,), spec, mesh)[0]


# ---------------------------------------------------------------------- KV
def engine_state(
    cfg: ModelConfig, *, max_slots: int, page_size: int, max_context: int, with_draft: bool = False
) -> cache_lib.PagedCache:
    """The serving engine's device state for these shapes, every sequence's pages included, as
    ShapeDtypeStructs: `jax.eval_shape` of the `init_paged_cache` that `JaxEngine` runs (through
    `ced_jax.engine.new_state`; with_draft: with the draft stages' context rings and each slot's draft
    logits, as a speculative engine's state has them)."""
    num_pages = max_slots * (max_context // page_size)
    return jax.eval_shape(
        lambda: cache_lib.init_paged_cache(
            cfg,
            max_slots=max_slots,
            page_size=page_size,
            num_pages=num_pages,
            draft_stages=cfg.num_nextn_predict_layers if with_draft else 0,
            draft_vocab=cfg.vocab_size if with_draft else 0,
            draft_block=cfg.dspark_block_size if with_draft else 0,
        )
    )


def kv_bytes_per_token(cfg: ModelConfig, page_size: int = SERVE.page_size) -> float:
    """Compressed main KV and index keys of every KV source per token, as the page buffers hold them
    (spec 2.4: 890 for V4.1-Flash)."""
    state = engine_state(cfg, max_slots=1, page_size=page_size, max_context=page_size)
    return cache_lib.kv_bytes_per_token(state)


def _per_device_bytes(state: cache_lib.PagedCache, mesh: dict[str, int], rules: sharding.Rules) -> int:
    """Bytes one device holds of `state` laid out as the engine lays it (`paged_cache_axes`)."""
    axes = jax.tree.leaves(cache_lib.paged_cache_axes(state), is_leaf=lambda a: isinstance(a, tuple))
    total = 0
    for buf, buf_axes in zip(jax.tree.leaves(state), axes, strict=True):
        spec = sharding.logical_to_spec(buf_axes, rules, buf.shape, mesh)
        total += math.prod(sharding.shard_shape(buf.shape, spec, mesh)) * np.dtype(buf.dtype).itemsize
    return total


def kv_ledger(
    cfg: ModelConfig,
    mesh: dict[str, int],
    rules: sharding.Rules,
    *,
    max_seqs: int,
    context: int,
    page_size: int = SERVE.page_size,
    with_draft: bool = False,
) -> dict:
    """The engine's state for `max_seqs` slots of `context` tokens (rounded up to whole pages, as a
    server's max_context is), in total and per device; with_draft: a speculative engine's (draft rings
    and draft logits per slot)."""
    max_context = -(-context // page_size) * page_size
    state = engine_state(
        cfg, max_slots=max_seqs, page_size=page_size, max_context=max_context, with_draft=with_draft
    )
    per_seq = {  # every buffer holds max_seqs equal shares (num_pages: max_context's pages per slot)
        "compressed": cache_lib.buffer_bytes((state.kv, state.index_k)) // max_seqs,
        "swa_rings": cache_lib.buffer_bytes(state.window) // max_seqs,
        "compressor_states": cache_lib.buffer_bytes((state.state_kv, state.state_score)) // max_seqs,
        "draft_rings": cache_lib.buffer_bytes(state.draft_window) // max_seqs,
        "draft_logits": cache_lib.buffer_bytes(state.draft_logits) // max_seqs,
    }
    return {
        "bytes_per_token": cache_lib.kv_bytes_per_token(state),
        "page_size": page_size,
        "pages": max_seqs * (max_context // page_size),
        "pages_per_device": max_seqs * (max_context // page_size) // _attention_shards(mesh, rules),
        "per_sequence": per_seq,
        "per_sequence_total": sum(per_seq.values()),
        "sequences_per_device": _sequences_per_device(mesh, rules, max_seqs),
        "total": cache_lib.buffer_bytes(state),
        "per_device": _per_device_bytes(state, mesh, rules),
    }


# ---------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Hardware:
    devices: int
    device_memory_gib: float
    host_memory_gib: float | None = None  # per host; None: nothing may be offloaded

    def __post_init__(self):
        _check_number("devices (--devices)", self.devices, 1, integer=True)
        _check_number("device_memory_gib (--device-memory)", self.device_memory_gib, 0, above=True)
        if self.host_memory_gib is not None:
            _check_number("host_memory_gib (--host-memory)", self.host_memory_gib, 0)

    @property
    def device_bytes(self) -> int:
        return int(self.device_memory_gib * GIB)


def _check_number(name: str, value, minimum: float, *, integer: bool = False, above: bool = False) -> None:
    """`value` is a number >= minimum (> with `above`): finite, an int where `integer` (not a bool)."""
    kind = "an integer" if integer else "a finite number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or not (value > minimum if above else value >= minimum):
        raise ValueError(f"{name} must be {kind} {'>' if above else '>='} {minimum:g}, got {value!r}")


def overhead_bytes(device_bytes: int) -> int:
    return max(OVERHEAD_MIN_BYTES, int(OVERHEAD_FRACTION * device_bytes))


def evaluate(
    cfg: ModelConfig,
    hw: Hardware,
    mesh: dict[str, int],
    *,
    rules: str = sharding.DEFAULT_RULES,
    engram_on_host: bool,
    max_seqs: int,
    context: int,
    prefill_bucket: int,
    page_size: int,
    dspark: int = 0,
    long_prefill_step: int | None = None,
) -> dict:
    """The four ledgers of one mesh and placement, and whether they fit (`dspark`: K drafts per
    step, 0 = off; `long_prefill_step`: `activation_ledger`'s)."""
    table = sharding.get_rules(rules)
    weights = weight_ledger(cfg, mesh, table, engram_on_host, with_draft=dspark > 0)
    acts = activation_ledger(
        cfg,
        mesh,
        table,
        prefill_bucket=prefill_bucket,
        max_seqs=max_seqs,
        context=context,
        page_size=page_size,
        dspark=dspark,
        long_prefill_step=long_prefill_step,
    )
    kv = kv_ledger(
        cfg, mesh, table, max_seqs=max_seqs, context=context, page_size=page_size, with_draft=dspark > 0
    )
    overhead = overhead_bytes(hw.device_bytes)
    per_device = weights["per_device"] + acts["per_device"] + kv["per_device"] + overhead
    host_need = weights["host"]
    # Tables in host memory are memory-mapped files (ced_jax.engram_store): they need no RAM to run,
    # only page cache to run warm. A host memory given is a budget the tables must fit in.
    host_ok = host_need == 0 or hw.host_memory_gib is None or host_need <= hw.host_memory_gib * GIB
    return {
        "mesh": dict(mesh),
        "rules": rules,
        "engram_tables": weights["engram_tables"],
        "ledgers": {"weights": weights, "activations": acts, "kv": kv, "overhead": {"per_device": overhead}},
        "per_device_total": per_device,
        "device_free": hw.device_bytes - per_device,
        "host_total": host_need,
        "fits": per_device <= hw.device_bytes and host_ok,
    }


# On CPU (development, tests) the KV pool is host memory: a fixed budget, as vLLM's CPU backend has
# one (4 GiB there). Smaller here: every context width the pool allows is another set of compiled
# programs (--decode-context-buckets), which a CPU compiles slowly (tiny at 32 slots: 2 widths and
# about 3 minutes cold at 256 MiB; 4 widths, 7 minutes and 7.5 GB at 4 GiB; BENCHMARKS.md).
CPU_KV_BUDGET_BYTES = 256 * 1024**2


def auto_max_context(
    cfg: ModelConfig,
    *,
    device_bytes: int | None,
    mesh: dict[str, int],
    rules: str = sharding.DEFAULT_RULES,
    engram_on_host: bool = True,
    max_seqs: int,
    prefill_bucket: int,
    page_size: int,
    dspark: int = 0,
) -> int:
    """`serve --max-context auto`: the largest context (whole pages, at most the model's own) at which
    `max_seqs` sequences fit. `device_bytes`: one accelerator's memory, filled with the four ledgers
    up to HEADROOM free (90 % used, as vLLM's gpu_memory_utilization); None (CPU): the KV ledger alone
    within CPU_KV_BUDGET_BYTES. ValueError when not even one page per sequence fits."""

    def need(context: int) -> tuple[int, int]:
        e = evaluate(
            cfg, Hardware(1, (device_bytes or GIB) / GIB), mesh, rules=rules, engram_on_host=engram_on_host,
            max_seqs=max_seqs, context=context, prefill_bucket=prefill_bucket, page_size=page_size,
            dspark=dspark, long_prefill_step=SERVE.long_prefill_step,  # the long program at any context
        )  # fmt: skip
        return e["per_device_total"], e["ledgers"]["kv"]["per_device"]

    limit = cfg.max_position_embeddings // page_size * page_size
    small, large = page_size, max(limit, 2 * page_size)
    (total0, kv0), (total1, kv1) = need(small), need(large)
    if device_bytes is None:  # grows with the KV ledger alone
        budget, base, slope = CPU_KV_BUDGET_BYTES, kv0, (kv1 - kv0) / (large - small)
    else:
        budget, base, slope = int((1 - HEADROOM) * device_bytes), total0, (total1 - total0) / (large - small)
    if base > budget:
        raise ValueError(
            f"--max-context auto: {max_seqs} sequences of one page already need {_g(base)} GiB per device, "
            f"beyond the {_g(budget)} GiB available; lower --max-slots or add devices (ced-jax plan)"
        )
    context = small + int((budget - base) / slope) if slope > 0 else limit
    return max(page_size, min(limit, context // page_size * page_size))


def mesh_candidates(devices: int) -> list[dict[str, int]]:
    """Every (data, expert, tensor) factorisation of the device count."""
    out = []
    for d in range(1, devices + 1):
        if devices % d:
            continue
        for e in range(1, devices // d + 1):
            if (devices // d) % e:
                continue
            out.append({"data": d, "expert": e, "tensor": devices // d // e})
    return out


def article_estimate(cfg: ModelConfig, hw: Hardware) -> dict:
    """The deployment article's weight estimate (every backbone parameter in BF16) next to the
    bytes actually stored."""
    params = sum(spec.params for spec in _inventory(cfg).values() if spec.group == "backbone")
    stored = checkpoint_bytes(cfg)
    backbone = sum(stored.get("backbone", {}).values())
    tables = sum(stored.get("engram_table", {}).values())
    capacity = hw.devices * hw.device_bytes
    return {
        "backbone_parameters": params,
        "bf16_bytes": 2 * params,
        "bf16_fits_devices": 2 * params <= capacity,
        "stored_backbone_bytes": backbone,
        "stored_engram_table_bytes": tables,
        "stored_backbone_fits_devices": backbone <= capacity,
        "device_capacity_bytes": capacity,
    }


def plan(
    cfg: ModelConfig,
    hw: Hardware,
    *,
    mesh: dict[str, int] | None = None,
    rules: str = sharding.DEFAULT_RULES,
    max_seqs: int = SERVE.max_slots,
    context: int = SERVE.max_context,
    prefill_bucket: int = max(SERVE.prefill_buckets),
    page_size: int = SERVE.page_size,
    dspark: int = SERVE.dspark,
) -> dict:
    """Evaluate `mesh` (or every candidate), recommend a mesh and Engram placement, and correct
    the naive BF16 estimate. Engram tables are tried in host memory (memory-mapped, the engine's
    default placement; within `host_memory_gib` when given) and on device. dspark: K draft tokens per
    decode step (`serve --dspark K`; 0 = off)."""
    for name, value in (
        ("max_seqs (--max-seqs)", max_seqs),
        ("context (--context)", context),
        ("prefill_bucket (--prefill-bucket)", prefill_bucket),
        ("page_size (--page-size)", page_size),
    ):
        _check_number(name, value, 1, integer=True)
    _check_dspark(cfg, dspark)
    if mesh is not None and math.prod(mesh.values()) != hw.devices:
        raise ValueError(f"mesh {mesh} has {math.prod(mesh.values())} devices, --devices is {hw.devices}")
    placements = [True, False]
    kw = dict(
        rules=rules,
        max_seqs=max_seqs,
        context=context,
        prefill_bucket=prefill_bucket,
        page_size=page_size,
        dspark=dspark,
    )
    # A mesh the rules cannot lay the model out on (a mesh axis that does not divide a dimension it
    # splits) is refused, never evaluated as if it replicated: the runtime refuses it alike.
    candidates, refused = [], []
    for m in mesh_candidates(hw.devices) if mesh is None else [mesh]:
        try:
            candidates += [evaluate(cfg, hw, m, engram_on_host=host, **kw) for host in placements]
        except sharding.ShardingError as e:
            if mesh is not None:
                raise sharding.ShardingError(f"mesh {_mesh_text(m)}: {e}") from None
            refused.append({"mesh": dict(m), "reason": str(e)})
    if not candidates:
        raise sharding.ShardingError(
            f"no (data, expert, tensor) mesh of {hw.devices} devices lays out {cfg.name} by the "
            f"{rules} rules; e.g. {_mesh_text(refused[0]['mesh'])}: {refused[0]['reason']}"
        )
    fitting = [c for c in candidates if c["fits"]]
    # Layouts that leave HEADROOM of the device free come first (KV growth beyond the planned
    # workload, fragmentation); then the most replicas (throughput), tables in host memory (the
    # engine's default: no device memory, a host gather per step), the widest expert axis (EP moves
    # activations, TP all-gathers in every layer), and the most free memory.
    floor = HEADROOM * hw.device_bytes
    fitting.sort(
        key=lambda c: (
            c["device_free"] < floor,
            -c["mesh"]["data"],
            c["engram_tables"] != "host",
            -c["mesh"]["expert"],
            -c["device_free"],
        )
    )
    best = fitting[0] if fitting else min(candidates, key=lambda c: c["per_device_total"])
    advice = []
    if not fitting and hw.host_memory_gib is not None and best["host_total"] > hw.host_memory_gib * GIB:
        advice.append(f"the Engram tables need {best['host_total'] / GIB:.1f} GiB of host memory")
    return {
        "model": cfg.name,
        "hardware": {
            "devices": hw.devices,
            "device_memory_bytes": hw.device_bytes,
            "host_memory_bytes": None if hw.host_memory_gib is None else int(hw.host_memory_gib * GIB),
        },
        "workload": {
            "max_seqs": max_seqs,
            "context": context,
            "prefill_bucket": prefill_bucket,
            "page_size": page_size,
            "dspark": dspark,
        },
        "checkpoint_bytes": checkpoint_bytes(cfg),
        "article_estimate": article_estimate(cfg, hw),
        "fits": bool(fitting),
        "advice": advice,
        "recommended" if fitting else "closest": best,
        "candidates": [
            {
                "mesh": c["mesh"],
                "engram_tables": c["engram_tables"],
                "per_device_total": c["per_device_total"],
                "fits": c["fits"],
            }
            for c in candidates
        ],
        "refused": refused,
    }


def _check_dspark(cfg: ModelConfig, k: int) -> None:
    """The K a server accepts (`serving.engine.jax_engine` refuses the same): 0, or up to the draft block
    (and sliding_window - 1) of a model with DSpark stages."""
    _check_number("dspark (--dspark)", k, 0, integer=True)
    if k == 0:
        return
    if not cfg.num_nextn_predict_layers or not cfg.dspark_block_size:
        raise ValueError(
            f"--dspark {k}: the model {cfg.name!r} has no DSpark draft stages; plan it with --dspark 0"
        )
    limit = min(cfg.dspark_block_size, cfg.sliding_window - 1)
    if k > limit:
        raise ValueError(
            f"--dspark {k}: at most the model's draft block size {cfg.dspark_block_size} "
            f"(and sliding_window - 1 = {cfg.sliding_window - 1})"
        )


def _mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


# ---------------------------------------------------------------------- text report
def _g(n: float) -> str:
    return f"{n / GIB:8.2f} GiB ({n / GB:7.1f} GB)"


def format_plan(p: dict) -> str:
    hw, a = p["hardware"], p["article_estimate"]
    lines = [
        f"{p['model']}: {hw['devices']} devices x {hw['device_memory_bytes'] / GIB:g} GiB"
        + (f", host {hw['host_memory_bytes'] / GIB:g} GiB" if hw["host_memory_bytes"] else ""),
        f"workload: {p['workload']['max_seqs']} sequences x {p['workload']['context']} tokens, "
        f"prefill chunk {p['workload']['prefill_bucket']}, {p['workload']['page_size']}-token pages"
        + (f", DSpark K={p['workload']['dspark']}" if p["workload"]["dspark"] else ""),
        "",
        "naive estimate (every parameter BF16): "
        f"{a['backbone_parameters'] / 1e9:.1f}B x 2 B = {a['bf16_bytes'] / GB:.0f} GB -> "
        + ("fits" if a["bf16_fits_devices"] else "does NOT fit")
        + f" in {a['device_capacity_bytes'] / GB:.0f} GB of devices",
        "as stored (FP4 experts, FP8 + ue8m0, BF16/F32 rest): "
        f"backbone {a['stored_backbone_bytes'] / GB:.1f} GB"
        f" + Engram tables {a['stored_engram_table_bytes'] / GB:.1f} GB",
        "",
    ]
    c = p.get("recommended") or p["closest"]
    led = c["ledgers"]
    mesh = _mesh_text(c["mesh"])
    head = "recommended" if p["fits"] else "nothing fits; closest"
    lines += [
        # the flags that make `serve` lay the model out as these ledgers assume
        f"{head}: --mesh {mesh} --rules {c['rules']} --engram-placement {c['engram_tables']}",
        f"  weights      {_g(led['weights']['per_device'])} per device",
    ]
    for dtype, n in sorted(led["weights"]["per_device_by_dtype"].items()):
        lines.append(f"    {dtype:9s}  {_g(n)}")
    if "dspark_stages" in led["weights"]["per_device_by_part"]:
        lines.append(
            f"    DSpark stages (replicated) {_g(led['weights']['per_device_by_part']['dspark_stages'])}"
        )
    lines += [
        f"  activations  {_g(led['activations']['per_device'])} per device "
        f"(prefill {led['activations']['prefill']['peak'] / GIB:.2f} GiB, "
        f"decode {led['activations']['decode']['peak'] / GIB:.2f} GiB"
        + (
            f" at {led['activations']['decode']['tokens_per_sequence']} tokens per sequence"
            if led["activations"]["decode"]["tokens_per_sequence"] > 1
            else ""
        )
        + (
            f", long-prompt prefill {led['activations']['long_prefill']['peak'] / GIB:.2f} GiB"
            if "long_prefill" in led["activations"]
            else ""
        )
        + ")",
        f"  KV           {_g(led['kv']['per_device'])} per device "
        f"({led['kv']['bytes_per_token']:g} B/token in "
        + (
            f"{led['kv']['pages']} pages on every device + "
            if led["kv"]["pages_per_device"] == led["kv"]["pages"]
            else f"{led['kv']['pages_per_device']} of {led['kv']['pages']} pages per device + "
        )
        + f"{led['kv']['per_sequence']['swa_rings'] / 2**20:.2f} MiB "
        f"SWA rings per sequence, {led['kv']['sequences_per_device']} sequences' slots per device)",
    ]
    per_seq = led["kv"]["per_sequence"]
    draft = per_seq["draft_rings"] + per_seq["draft_logits"]
    if draft:
        lines.append(
            f"               incl. DSpark {per_seq['draft_rings'] / 2**20:.2f} MiB draft rings + "
            f"{per_seq['draft_logits'] / 2**20:.2f} MiB draft logits per sequence"
        )
    lines += [
        f"  overhead     {_g(led['overhead']['per_device'])} per device",
        f"  total        {_g(c['per_device_total'])} of {_g(hw['device_memory_bytes'])} per device"
        f" -> {'fits' if c['fits'] else 'does NOT fit'}",
    ]
    if c["host_total"]:
        lines.append(f"  host         {_g(c['host_total'])} (Engram tables)")
    lines += [f"advice: {a}" for a in p["advice"]]
    lines += [f"refused: --mesh {_mesh_text(r['mesh'])}: {r['reason']}" for r in p["refused"]]
    return "\n".join(lines)
