"""ViT + aligner time per image (`ced_jax.vision.VisionEncoder`), on whatever JAX backend is default.

    python bench/vision.py [--fixture tests/golden/tiny-v] [--released] [--sizes 544x544,4000x3000]
                           [--repeats 5] [--warmup 1] [--json]

- Fixture shapes: the fixture's own checkpoint and images (its config's vision tower).
- Released shapes (`--released`): `preset("v41-flash")`'s vision tower (32 blocks, width 1024, 1024
  image tokens) with random bf16 weights drawn from the mapping's init (`ced_jax.testing.random_weights`),
  on synthetic images of the given sizes (uniform noise; pre-processing does not depend on content).
  544x544 is the upscale threshold (39x39 patches, bucket 2048); 4000x3000 is shrunk to the 1024-token
  budget (81x108 patches, bucket 9189).
Per image: pre-processing time, the first call (compile + run), then the median (and min / max) of
`--repeats` timed calls after `--warmup` untimed ones. Each timed call is `encoder.features(image)` at
the image's bucket: host patches in, ViT output and aligner rows back on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

import io  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from ced_jax.checkpoint.vision import load_vision_params, vision_inventory  # noqa: E402
from ced_jax.config import ModelConfig, preset  # noqa: E402
from ced_jax.testing.random_weights import draw  # noqa: E402
from ced_jax.vision.preprocess import prepare_image  # noqa: E402
from ced_jax.vision.tower import VisionEncoder, forward_flops  # noqa: E402


def random_vision_params(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    return {name: draw(spec, seed).astype(ml_dtypes.bfloat16) for name, spec in vision_inventory(cfg).items()}


def noise_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A JPEG of uniform noise (a 4000x3000 noise PNG would pass the 20 MiB upload limit)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buf, format="JPEG", quality=85
    )
    return buf.getvalue()


def time_image(encoder: VisionEncoder, label: str, data: bytes, repeats: int, warmup: int) -> dict:
    t = time.perf_counter()
    image = prepare_image(data, encoder.vcfg)
    prep = time.perf_counter() - t
    t = time.perf_counter()
    encoder.features(image)
    first = time.perf_counter() - t
    for _ in range(warmup):
        encoder.features(image)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        encoder.features(image)
        times.append(time.perf_counter() - t)
    return {
        "image": label,
        "canvas_hw": [image.n_vit_h * encoder.vcfg.patch_size, image.n_vit_w * encoder.vcfg.patch_size],
        "patches": image.num_patches,
        "bucket": encoder.bucket_for(image.num_patches),
        "image_tokens": image.n_llm_h * image.n_llm_w,
        "span_len": image.span_len,
        "preprocess_s": round(prep, 4),
        "first_call_s": round(first, 3),
        "gflop": round(forward_flops(encoder.vcfg, encoder.cfg.hidden_size, encoder.bucket_for(image.num_patches),
                                     image.n_llm_h * image.n_llm_w) / 1e9, 2),
        "median_s": round(statistics.median(times), 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
        "repeats": repeats,
    }


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The backend's f32 matmul rate (GFLOP/s, median of `repeats`), the roofline the ViT's matmuls
    (f32 on widened bf16 values) are compared against."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(a))
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default=str(REPO / "tests" / "golden" / "tiny-v"))
    ap.add_argument("--no-fixture", action="store_true", help="skip the fixture shapes")
    ap.add_argument("--released", action="store_true", help="also run the released vision tower's shapes")
    ap.add_argument("--sizes", default="544x544,4000x3000", help="synthetic image sizes WxH for --released")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--released-repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)

    import jax

    rows = []
    if not args.no_fixture:
        d = Path(args.fixture)
        cfg = ModelConfig.from_pretrained(d)
        encoder = VisionEncoder(cfg, load_vision_params(d, cfg))
        inputs = json.loads((d / "inputs.json").read_text())
        for plan in inputs["images"]:
            row = time_image(
                encoder, plan["file"], (d / plan["file"]).read_bytes(), args.repeats, args.warmup
            )
            rows.append({"shapes": f"fixture {d.name}", **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.released:
        cfg = preset("v41-flash")
        t = time.perf_counter()
        encoder = VisionEncoder(cfg, random_vision_params(cfg))
        print(json.dumps({"released_weights_s": round(time.perf_counter() - t, 1)}), flush=True)
        for size in args.sizes.split(","):
            w, h = (int(x) for x in size.lower().split("x"))
            row = time_image(encoder, f"noise {w}x{h}", noise_jpeg(w, h), args.released_repeats, args.warmup)
            rows.append({"shapes": "released v41-flash", **row})
            print(json.dumps(rows[-1]), flush=True)

    peak = gemm_gflops()
    for r in rows:
        r["gflops_per_s"] = round(r["gflop"] / r["median_s"], 1)
        r["of_gemm_peak"] = round(r["gflops_per_s"] / peak, 3)
    print(json.dumps({"gemm_f32_gflops_per_s": round(peak, 1)}), flush=True)
    print(
        f"\nbackend: {jax.default_backend()} ({jax.devices()[0].device_kind}), {len(jax.devices())} device(s); "
        f"roofline: an f32 2048^3 matmul measured in this run, {peak:.1f} GFLOP/s"
    )
    header = (
        "| shapes | image | patches (bucket) | image tokens | pre-processing s | first call s | median s "
        "| GFLOP | GFLOP/s (of the matmul roofline) |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shapes']} | {r['image']} -> {r['canvas_hw'][1]}x{r['canvas_hw'][0]} "
            f"| {r['patches']} ({r['bucket']}) "
            f"| {r['image_tokens']} | {r['preprocess_s']} | {r['first_call_s']} "
            f"| {r['median_s']} ({r['min_s']}-{r['max_s']}), n={r['repeats']} "
            f"| {r['gflop']} | {r['gflops_per_s']} ({r['of_gemm_peak']:.0%}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
