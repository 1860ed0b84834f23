"""Every GPU Pallas kernel against its reference, and timed against its roofline, on one device.

    python bench/device_check.py                   # on an H200: v41-flash shapes, Triton kernels
    python bench/device_check.py --smoke           # anywhere: tiny shapes, kernels interpreted
    python bench/device_check.py --backend tpu     # the Mosaic kernels instead (on a TPU)
    [--repeats 20] [--json results.json] [--only gmm,attention,indexer,mhc]

Shapes come from the `v41-flash` preset: the FP4 grouped matmul through w1/w3 (K = D) and w2
(K = F) at decode batch 1, 8, 32, 64 (B x top-k rows) and a 4K-token prefill; paged sparse
attention over the FP8 window (128 entries) plus 512 selected FP4 entries, decode at the same
batches and a 4K-token prefill; indexer scoring + top-k over FP4 keys (decode at 32K compressed
keys, prefill of 4K tokens over 2K keys); the mHC mixing of one site (4 streams of 4096) at the
decode batches and over 4K tokens. Experts are one device's half (E/2), as served on two
or more devices (one device holding all 384 experts of one w1 is past the Triton kernel's i32
offsets, see `kernel_triton.check_addressable`).

For each case: the kernel's output against the reference (`pallas_kernels.*.reference`, jitted on
the same device) with the tolerances of tests/pallas_kernels (the kernels form every product
exactly and differ in f32 summation order only; the mHC mixing also in the backend's division, bar
2e-5 of the output scale), then the kernel's median time over `repeats`
calls (after a warm-up; compile excluded) against its roofline: max(bytes / 4.3 TB/s, FLOPs / 790
TFLOP/s) with the bytes each kernel must move (touched experts' packed weights and scales,
gathered entries, visible keys, activations in and results out, as stored) and its matmul FLOPs.
One table is printed; the exit status is 1 if any check fails.

The `vision` group (issue 14) times the ViT + aligner program (`ced_jax.vision.VisionEncoder`, XLA,
no Pallas kernel) at the released vision tower's shapes (32 blocks, width 1024, 16 heads; random
bf16 weights) on a 544x544 image (1521 patches, bucket 2048) and on the largest image the token
budget allows (4000x3000: 8748 patches, bucket 9189), against max(bf16 weight bytes / 4.3 TB/s,
matmul FLOPs / 790 TFLOP/s) (`ced_jax.vision.tower.forward_flops`, padded patches included). Its
check: the image run at the next larger bucket (more padding, masked) gives the same rows to 1e-2 of
their largest magnitude (exactly on CPU; a GPU may reorder the sums).

--smoke runs the same code in interpret mode at small shapes, so that it is exercised on a CPU
(tests/pallas_kernels/test_device_check.py); its timings are the interpreter's and mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ced_jax.config import preset  # noqa: E402
from pallas_kernels import formats  # noqa: E402
from pallas_kernels.grouped_matmul import gmm  # noqa: E402
from pallas_kernels.grouped_matmul import reference as gmm_ref  # noqa: E402
from pallas_kernels.indexer import index_scores, select_topk  # noqa: E402
from pallas_kernels.indexer import reference as index_ref  # noqa: E402
from pallas_kernels.mhc import hc_mixes  # noqa: E402
from pallas_kernels.mhc import reference as mhc_ref  # noqa: E402
from pallas_kernels.sparse_attention import (  # noqa: E402
    reference as attn_ref,
)
from pallas_kernels.sparse_attention import (  # noqa: E402
    sparse_attention_decode,
    sparse_attention_prefill,
)

HBM_BYTES_PER_S = 4.3e12  # H200
FLOPS_PER_S = 790e12  # H200 dense bf16, as budgeted
DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_TOKENS = 4096


@dataclasses.dataclass
class Row:
    kernel: str
    shape: str
    error: str  # the check's metric, printed
    ok: bool
    time_s: float
    bytes: float
    flops: float

    @property
    def roofline_s(self) -> float:
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / FLOPS_PER_S)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["roofline_s"] = self.roofline_s
        d["fraction_of_roofline"] = self.roofline_s / self.time_s if self.time_s else None
        return d


def time_call(fn, args, repeats: int) -> float:
    """Median seconds per call after one warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ------------------------------------------------------------------------- inputs (on device)
def fp8_rows(key, shape) -> jax.Array:
    """f32 values on the FP8 grid times per-row powers of two (FP8-dequantised activations)."""
    k1, k2 = jax.random.split(key)
    x = (jax.random.normal(k1, shape, jnp.float32) * 4).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return x * jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -6, 6).astype(jnp.float32))


def fp4_weights(key, e, n, k) -> tuple[jax.Array, jax.Array]:
    """Packed e2m1 codes (any byte is two valid codes) and ue8m0 scales near 1."""
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (e, n, k // 2), 0, 256).astype(jnp.uint8)
    scales = jax.random.randint(k2, (e, n, k // 32), 123, 131).astype(jnp.uint8)
    return codes, scales


def bf16_values(key, shape, scale=1.0) -> jax.Array:
    return formats.round_bf16(jax.random.normal(key, shape, jnp.float32) * scale)


# ---------------------------------------------------------------------------- grouped matmul
def check_gmm(label, m, k, n, e, top_k, *, backend, interpret, repeats, seed) -> Row:
    rng = np.random.default_rng(seed)
    tokens = m // top_k
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
    sizes = np.bincount(ids, minlength=e).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    lhs = fp8_rows(key, (m, k))
    w, s = fp4_weights(jax.random.fold_in(key, 1), e, n, k)
    args = (lhs, w, s, jnp.asarray(sizes))
    kernel = jax.jit(functools.partial(gmm, backend=backend, interpret=interpret))
    out = np.asarray(kernel(*args))
    ref = np.asarray(jax.jit(gmm_ref.gmm)(*args))
    scale = float(np.abs(ref).max())
    err = float(np.abs(out - ref).max()) / scale
    # tests/pallas_kernels bar (2e-6 of the output scale at K = 256), grown with sqrt(K / 256)
    # for the longer f32 sums.
    bar = 2e-6 * math.sqrt(k / 256)
    ok = bool(np.isfinite(out).all() and err <= bar)
    touched = int((sizes > 0).sum())
    nbytes = touched * n * (k // 2 + k // 32) + m * k * 4 + m * n * 4
    return Row(
        "gmm " + label,
        f"M={m} K={k} N={n} E={e} ({touched} touched)",
        f"max|d|/max|ref| {err:.1e} (<= {bar:.1e})",
        ok,
        time_call(kernel, args, repeats),
        nbytes,
        2.0 * m * n * k,
    )


# -------------------------------------------------------------------------- sparse attention
def attention_inputs(seed, b, t, h, d, window, n_sel, main_pages, per_page, decode):
    """Window: one page of `window` FP8 entries per sequence, all selected by every query (the ring).
    Main: `main_pages` pages of `per_page` FP4 entries per sequence, n_sel random ids per query,
    ~5 % of them -1. q bf16-exact; sink per head."""
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 6)
    lead = (b,) if decode else (b, t)
    win_pages = formats.pack_fp8_entries(jax.random.normal(ks[0], (b, window, d), jnp.float32))
    win_table = jnp.arange(b, dtype=jnp.int32)[:, None]
    win_idx = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), lead + (window,))
    main_vals = jax.random.normal(ks[1], (b * main_pages, per_page, d), jnp.float32)
    main_pages_u8 = jax.jit(formats.pack_fp4_entries)(main_vals)
    del main_vals
    main_table = jax.random.permutation(ks[2], b * main_pages).astype(jnp.int32).reshape(b, main_pages)
    capacity = main_pages * per_page
    main_idx = jax.random.randint(ks[3], lead + (n_sel,), 0, capacity).astype(jnp.int32)
    main_idx = jnp.where(jax.random.uniform(ks[4], main_idx.shape) < 0.05, -1, main_idx)
    q = bf16_values(ks[5], lead + (h, d))
    sink = jax.random.normal(jax.random.fold_in(key, 7), (h,), jnp.float32)
    segments = [(win_pages, win_table, win_idx), (main_pages_u8, main_table, main_idx)]
    return q, segments, sink


def check_attention(
    label, b, t, h, d, window, n_sel, main_pages, per_page, *, decode, backend, interpret, repeats, seed
) -> Row:
    q, segments, sink = attention_inputs(seed, b, t, h, d, window, n_sel, main_pages, per_page, decode)
    scale = d**-0.5
    fn = sparse_attention_decode if decode else sparse_attention_prefill
    ref_fn = attn_ref.sparse_attention_decode if decode else attn_ref.sparse_attention_prefill
    kernel = jax.jit(functools.partial(fn, scale=scale, backend=backend, interpret=interpret))
    out = np.asarray(kernel(q, segments, sink))
    ref = np.asarray(jax.jit(functools.partial(ref_fn, scale=scale))(q, segments, sink))
    close = np.isclose(out, ref, rtol=2**-7, atol=1e-6)
    equal = float(np.mean(out == ref))
    ok = bool(np.isfinite(out).all() and close.all() and equal > 0.98)
    rows = b * (1 if decode else t)
    n_entries = window + n_sel
    nbytes = rows * (window * formats.fp8_entry_bytes(d) + n_sel * formats.fp4_entry_bytes(d))
    nbytes += rows * h * d * 4 * 2 + sum(int(np.prod(s[2].shape)) * 4 for s in segments)
    return Row(
        "attention " + label,
        f"B={b} T={t} H={h} D={d} window={window} selected={n_sel}",
        f"equal {equal:.3f} (> 0.98), within 1 bf16 ulp {float(close.mean()):.4f} (= 1)",
        ok,
        time_call(kernel, (q, segments, sink), repeats),
        nbytes,
        4.0 * rows * h * n_entries * d,
    )


# ----------------------------------------------------------------------------------- indexer
def check_indexer(
    label, b, t, heads, dk, per_page, pages, top_k, *, backend, interpret, repeats, seed
) -> Row:
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 5)
    key_pages = jax.jit(formats.pack_index_keys)(
        jax.random.normal(ks[0], (b * pages, per_page, dk), jnp.float32)
    )
    table = jax.random.permutation(ks[1], b * pages).astype(jnp.int32).reshape(b, pages)
    keys = pages * per_page
    # Decode: every key visible; prefill: causal over the compressed keys (ratio keys / t).
    if t == 1:
        n_visible = jnp.full((b, 1), keys, jnp.int32)
    else:
        n_visible = jnp.broadcast_to((jnp.arange(1, t + 1) * keys // t).astype(jnp.int32), (b, t))
    q = formats.unpack_index_keys(formats.pack_index_keys(jax.random.normal(ks[2], (b, t, heads, dk))))
    weights = bf16_values(ks[3], (b, t, heads), 0.1)
    args = (q, weights, key_pages, table, n_visible)
    kernel_scores = functools.partial(index_scores, backend=backend, interpret=interpret)

    @jax.jit
    def kernel(*a):
        return select_topk(kernel_scores(*a), a[4], top_k)

    @jax.jit
    def both(*a):
        scores = kernel_scores(*a)
        return scores, select_topk(scores, a[4], top_k)

    scores, topk = (np.asarray(x) for x in both(*args))

    @jax.jit
    def reference(*a):
        return index_ref.index_scores(*a), index_ref.index_topk(*a, top_k=top_k)

    ref_scores, ref_topk = (np.asarray(x) for x in reference(*args))
    visible = np.isfinite(ref_scores)
    same_scores = float(np.mean(scores[visible] == ref_scores[visible]))
    same_rows = float(np.mean(np.all(np.sort(topk, -1) == np.sort(ref_topk, -1), -1)))
    ok = bool(np.array_equal(np.isfinite(scores), visible) and same_scores >= 0.999 and same_rows >= 0.99)
    n_vis = np.asarray(n_visible)
    visible_pages = -(-n_vis.max(axis=1) // per_page)
    nbytes = float(visible_pages.sum() * per_page * formats.index_key_bytes(dk))
    nbytes += b * t * (heads * dk + heads) * 4 + b * t * pages * per_page * 4 + b * t * top_k * 4
    return Row(
        "indexer " + label,
        f"B={b} T={t} I={heads} Dk={dk} keys={keys} top-k={top_k}",
        f"scores equal {same_scores:.4f} (>= 0.999), top-k rows {same_rows:.3f} (>= 0.99)",
        ok,
        time_call(kernel, args, repeats),
        nbytes,
        2.0 * heads * dk * float(n_vis.sum()),
    )


# --------------------------------------------------------------------------------- mHC mixing
def check_mhc(label, t, hc, d, *, backend, interpret, repeats, seed) -> Row:
    """One mixing site over t tokens' hc streams of width d, against the pure-jnp reference (XLA's
    own sums and quotients: the kernel differs in f32 order and in the backend's division)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    n_mix, k = (2 + hc) * hc, hc * d
    x = bf16_values(ks[0], (t, k), 3.0)
    fn = jax.random.normal(ks[1], (n_mix, k), jnp.float32) / math.sqrt(k)
    scale = jax.random.uniform(ks[2], (3,), jnp.float32, 0.5, 2.0)
    base = jax.random.normal(ks[3], (n_mix,), jnp.float32) * 0.5
    args = (x, fn, scale, base)
    kw = dict(hc=hc, iters=20, norm_eps=1e-20, hc_eps=1e-6)
    kernel = jax.jit(functools.partial(hc_mixes, backend=backend, interpret=interpret, **kw))
    got = [np.asarray(a) for a in kernel(*args)]
    want = [np.asarray(a) for a in jax.jit(functools.partial(mhc_ref.hc_mixes, **kw))(*args)]
    err = max(float(np.abs(g - w).max()) / float(np.abs(w).max()) for g, w in zip(got, want, strict=True))
    bar = 2e-5  # f32 rounding through 20 Sinkhorn iterations (tests/pallas_kernels: bit for bit interpreted)
    ok = bool(all(np.isfinite(g).all() for g in got) and err <= bar)
    return Row(
        "mhc " + label,
        f"T={t} hc={hc} D={d} iterations=20",
        f"max|d|/max|ref| {err:.1e} (<= {bar:.0e})",
        ok,
        time_call(kernel, args, repeats),
        float(t * k * 4 + n_mix * k * 4 + t * n_mix * 4),
        2.0 * t * k * (n_mix + 1),
    )


# ------------------------------------------------------------------------------------ driver
def check_vision(label, width, height, *, backend, interpret, repeats, seed) -> Row:
    """The ViT + aligner at the config of `label` ("released" or "smoke") on a noise image."""
    import io

    import ml_dtypes
    from PIL import Image

    from ced_jax.checkpoint.vision import vision_inventory
    from ced_jax.config import ModelConfig
    from ced_jax.testing.random_weights import draw
    from ced_jax.vision import prepare_image
    from ced_jax.vision.tower import VisionEncoder, forward_flops

    cfg = (
        preset("v41-flash")
        if label.startswith("released")
        else ModelConfig.from_pretrained(REPO / "tests" / "golden" / "tiny-v")
    )
    flat = {n: draw(spec, seed).astype(ml_dtypes.bfloat16) for n, spec in vision_inventory(cfg).items()}
    encoder = VisionEncoder(cfg, flat)
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    image = prepare_image(buf.getvalue(), cfg.vision)
    bucket = encoder.bucket_for(image.num_patches)
    tokens = image.n_llm_h * image.n_llm_w
    patches = np.zeros((bucket, image.patch_pixels.shape[1]), np.float32)
    patches[: image.num_patches] = image.patch_values()
    program = encoder._program(bucket, False)
    args = (
        encoder.params, jnp.asarray(patches), jnp.int32(image.n_vit_h), jnp.int32(image.n_vit_w),
        jnp.int32(image.num_patches),
    )  # fmt: skip
    got = np.asarray(program(*args)[1])[:tokens]
    larger = [b for b in encoder.buckets if b > bucket]
    want = encoder.features(image, bucket=larger[0])["aligner_output"] if larger else got
    scale = float(np.max(np.abs(want))) or 1.0
    err = float(np.max(np.abs(got - want))) / scale
    ok = bool(np.isfinite(got).all()) and err <= 1e-2
    weight_bytes = float(sum(np.asarray(v).nbytes for v in flat.values()))
    return Row(
        kernel="vision",
        shape=f"{label} {width}x{height} P={image.num_patches} (bucket {bucket}) T={tokens}",
        error=f"padded-bucket rel {err:.1e}",
        ok=ok,
        time_s=time_call(program, args, repeats),
        bytes=weight_bytes + patches.nbytes + tokens * cfg.hidden_size * 4,
        flops=forward_flops(cfg.vision, cfg.hidden_size, bucket, tokens),
    )


def cases(smoke: bool):
    """(group, function, label, positional shape args, keyword args) per check."""
    if smoke:
        d, f, e, top_k = 128, 64, 8, 2
        heads, dim, window, n_sel, per_page, main_pages = 4, 128, 16, 16, 16, 4
        i_heads, dk, i_per_page, i_pages, i_topk = 4, 128, 16, 4, 8
        batches, prefill = (2,), 24
    else:
        cfg = preset("v41-flash")
        d, f, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        e = cfg.n_routed_experts // 2
        heads, dim, window, n_sel = cfg.num_heads, cfg.head_dim, cfg.sliding_window, cfg.index_topk
        per_page, main_pages = 64, 64  # 4096 compressed entries per sequence to select from
        i_heads, dk, i_per_page, i_topk = cfg.index_n_heads, cfg.index_head_dim, 128, cfg.index_topk
        i_pages = 256  # 32K compressed keys (decode); prefill: 16 pages = 2K keys for 4K tokens
        batches, prefill = DECODE_BATCHES, PREFILL_TOKENS
    out = []
    for b in batches:
        out.append(("gmm", check_gmm, f"w1 decode B={b}", (b * top_k, d, f, e, top_k), {}))
        out.append(("gmm", check_gmm, f"w2 decode B={b}", (b * top_k, f, d, e, top_k), {}))
    out.append(("gmm", check_gmm, f"w1 prefill {prefill}", (prefill * top_k, d, f, e, top_k), {}))
    out.append(("gmm", check_gmm, f"w2 prefill {prefill}", (prefill * top_k, f, d, e, top_k), {}))
    for b in batches:
        args = (b, 1, heads, dim, window, n_sel, main_pages, per_page)
        out.append(("attention", check_attention, f"decode B={b}", args, {"decode": True}))
    args = (1, prefill, heads, dim, window, n_sel, main_pages, per_page)
    out.append(("attention", check_attention, f"prefill {prefill}", args, {"decode": False}))
    index = (i_heads, dk, i_per_page)
    for b in batches:
        out.append(("indexer", check_indexer, f"decode B={b}", (b, 1, *index, i_pages, i_topk), {}))
    p_pages = max(1, i_pages // 16)
    out.append(("indexer", check_indexer, f"prefill {prefill}", (1, prefill, *index, p_pages, i_topk), {}))
    hc, width = (4, 128) if smoke else (preset("v41-flash").hc_mult, d)
    for b in batches:
        out.append(("mhc", check_mhc, f"decode B={b}", (b, hc, width), {}))
    out.append(("mhc", check_mhc, f"prefill {prefill}", (prefill, hc, width), {}))
    if smoke:  # one case per kernel variant: interpret-mode compiles dominate on a CPU
        keep = {
            "gmm w1 decode B=2",
            "gmm w2 prefill 24",
            "attention decode B=2",
            "attention prefill 24",
            "indexer prefill 24",
            "mhc prefill 24",
        }
        out = [c for c in out if f"{c[0]} {c[2]}" in keep]
        out.append(("vision", check_vision, "smoke (tiny-v tower)", (300, 200), {}))
    else:
        out.append(("vision", check_vision, "released", (544, 544), {}))
        out.append(("vision", check_vision, "released", (4000, 3000), {}))
    return out


def format_table(rows: list[Row], smoke: bool) -> str:
    head = ("kernel", "shape", "check", "ok", "time us", "roofline us", "of roofline", "GB", "TFLOP")
    lines = [head]
    for r in rows:
        frac = f"{r.roofline_s / r.time_s:.0%}" if r.time_s else "-"
        lines.append(
            (
                r.kernel,
                r.shape,
                r.error,
                "ok" if r.ok else "FAIL",
                f"{r.time_s * 1e6:.1f}",
                f"{r.roofline_s * 1e6:.1f}",
                frac,
                f"{r.bytes / 1e9:.4f}",
                f"{r.flops / 1e12:.4f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)
    device = jax.devices()[0]
    note = " (smoke: interpreted, timings meaningless)" if smoke else ""
    return f"device: {device.platform} {device.device_kind}{note}\n{text}"


def run(argv=None) -> tuple[list[Row], int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (any machine)")
    parser.add_argument("--backend", choices=("gpu", "tpu"), default="gpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 20; smoke 1)")
    parser.add_argument(
        "--only", default="gmm,attention,indexer,mhc,vision", help="comma-separated kernel groups"
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    groups = set(args.only.split(","))
    unknown = groups - {"gmm", "attention", "indexer", "mhc", "vision"}
    if unknown:
        parser.error(f"--only: unknown group(s) {sorted(unknown)}")
    interpret = args.smoke
    if not interpret and jax.default_backend() == "cpu":
        parser.error("no accelerator here: the kernels run only on a GPU / TPU (use --smoke on a CPU)")
    repeats = args.repeats or (1 if args.smoke else 20)
    rows = []
    for seed, (group, fn, label, shape, kw) in enumerate(cases(args.smoke)):
        if group not in groups:
            continue
        row = fn(label, *shape, **kw, backend=args.backend, interpret=interpret, repeats=repeats, seed=seed)
        rows.append(row)
        status = "ok" if row.ok else "FAIL"
        print(f"{row.kernel}: {status} {row.time_s * 1e6:.1f} us", file=sys.stderr, flush=True)
    print(format_table(rows, args.smoke), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=2))
    return rows, 0 if all(r.ok for r in rows) else 1


def main(argv=None) -> int:
    return run(argv)[1]


if __name__ == "__main__":
    sys.exit(main())
