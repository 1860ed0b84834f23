"""`convert_weights`: a released-layout DeepSeek-V4.1 HF checkpoint -> an Orbax checkpoint, streaming.

    convert_weights --hf-dir DIR --out DIR [--include text,dspark,vision] [--engram separate|inline|skip]
                    [--weights-dtype native|bf16] [--overwrite]

Output layout (OUT/)
- `params/`: an Orbax v1 checkpoint of our parameter tree (`ced_jax.model.param_specs`), nested dicts
  keyed by the dotted path ('layers' -> '3' -> 'attn' -> 'wq_a' -> 'weight'), numpy leaves, so it
  restores onto any mesh (`restore`) or into host memory.
- `engram/` (with `--engram separate`, the default): the Engram hash tables
  (`layers.{i}.engram.embed.{weight,scale}`, same nesting) as their own Orbax checkpoint, so that a
  server can keep them in host memory (they are looked up by row, ~98 GB each in the release)
  while `params/` goes to the accelerators. `--engram inline` puts them in `params/`; `--engram
  skip` leaves them out (such a checkpoint cannot run the model; it is for inspecting the rest).
- `engram_raw/` (with `--engram separate` and native weights; `--no-engram-raw` leaves it out): the
  same tables once more as raw row-major files, `{leaf}.bin` (the array's bytes, nothing else) and
  `{leaf}.json` (shape, dtype, bytes, a hash of the config's Engram fields), which
  `ced_jax.engram_store.EngramStore.open_raw` memory-maps: with the Engram placement `host` (the
  default) `ced_jax.load` gathers each step's rows from them and never reads the Orbax item, so the
  tables cost neither device memory nor their size in host RAM. Twice the tables' disk space.
- `dspark/`, `vision/`: the DSpark draft stages (`mtp.*`, with `--include dspark`) and the vision
  tower, aligner and image delimiters (`ced_jax.checkpoint.vision.load_vision_params` reads them back), each
  as its own Orbax item restored into host memory. Without an explicit `--include` (options
  `include=None`), the vision item is written whenever config.json describes a vision tower, and the
  DSpark item whenever config.json describes DSpark stages (num_nextn_predict_layers > 0) and the
  index lists their `mtp.*` tensors, so a default conversion serves images and speculative decoding
  and `ced_jax.load(OUT)` gives what `ced_jax.load(HF_DIR)` gives (a checkpoint whose index lists
  none of the stages, e.g. one stripped of them, converts as text; one listing only some of them is
  an error naming a missing tensor). An explicit `--include text` leaves both out. DSpark stages
  are laid out like backbone layers (routed experts stacked, `mtp.{k}.attn.wo_a` dequantised);
  vision tensors keep their released names. Shapes and dtypes come from the config's inventory like
  everything else. Parts not included are ignored and listed in the manifest.
- `config.json`, `tokenizer.json`, `tokenizer_config.json`, `engram_token_map.json`: copied byte for
  byte when present, so `ced-jax describe OUT` reports what it reports on the source.
- `ced_manifest.json`: converter version, options, every source file (name, bytes, SHA-256), every
  leaf (item, shape, dtype), every ignored source tensor with the reason.

Formats (`--weights-dtype`)
- native (default): the stored bytes unchanged in our storage dtypes (`mapping.STORAGE_DTYPES`):
  FP8 e4m3 weights with their ue8m0 scale bytes, FP4 experts packed two per byte and stacked
  [E, ...], bf16 / f32 as stored. `attn.wo_a` is dequantised to bf16 as DeepSeek's converter does
  (its scale is consumed). This is what `ced_jax` runs.
- bf16: every quantised weight dequantised (exactly: e4m3 / e2m1 values times a power of two fit in
  bf16) into a bf16 leaf with no `.scale`, for backends without FP8/FP4 kernels. `ced_jax`'s model
  itself runs the native formats and refuses such a checkpoint.
- `--include` must contain `text`; `dspark` / `vision` are errors when config.json describes no
  such part.

How (each step in its module)
- `plan`: everything is validated before any tensor data is read; every failure is a
  `ConversionError` naming the tensor / file.
- `write`: shard by shard (`stream`), each tensor group saved and freed as soon as it is complete
  (`groups`), so memory is bounded by the largest group, not the checkpoint.
- `outdir`: written into a temporary directory beside OUT and renamed onto OUT only when complete;
  what `--out` may be, and what `--overwrite` may replace.
- `cli`: `convert_weights` / `ced-jax convert`; SIGTERM and Ctrl-C stop it between tensors (`interrupt`).
"""

from __future__ import annotations

import time
from pathlib import Path

from ced_jax.checkpoint.hf_loader import INDEX_NAME, read_index_json
from ced_jax.config import ConfigError, ModelConfig
from conversion.interrupt import check_interrupt
from conversion.options import ConversionError, ConvertOptions
from conversion.outdir import (
    check_paths,
    make_own_directory,
    move_into_place,
    remove_own_directory,
    remove_stale_temporaries,
)
from conversion.plan import check_fp4_dims, check_include, check_parts_described, default_include, make_plan
from conversion.write import write_checkpoint


def convert(hf_dir: str | Path, out_dir: str | Path, options: ConvertOptions | None = None) -> dict:
    """Convert `hf_dir` into `out_dir` (see the module docstring). Returns a summary dict; raises
    ConversionError (a ValueError) with the offending file / tensor named, leaving nothing behind."""
    options = options or ConvertOptions()
    start = time.perf_counter()
    if options.engram not in ("separate", "inline", "skip"):
        raise ConversionError(f"--engram: expected separate, inline or skip, got {options.engram!r}")
    if options.weights_dtype not in ("native", "bf16"):
        raise ConversionError(f"--weights-dtype: expected native or bf16, got {options.weights_dtype!r}")
    if options.include is not None:
        check_include(options.include)
    hf, out = check_paths(hf_dir, out_dir, options.overwrite)
    try:
        cfg = ModelConfig.from_pretrained(hf)
    except ConfigError as e:
        raise ConversionError(f"{hf / 'config.json'}: {e}") from None
    except FileNotFoundError:
        raise ConversionError(f"{hf}: no config.json") from None
    if options.include is None:
        include = default_include(cfg, read_index_json(hf)["weight_map"], hf / INDEX_NAME)
    else:
        include = check_include(options.include)
    check_parts_described(cfg, include, hf / "config.json")
    check_fp4_dims(cfg, hf / "config.json")
    plan = make_plan(hf, cfg, options, include)

    out.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(out)
    tmp = make_own_directory(out.parent, f".{out.name}.converting-")
    try:
        summary = write_checkpoint(plan, hf, tmp, options, include)
        check_interrupt()  # the last point at which OUT is still the previous conversion
        move_into_place(tmp, out)
    except BaseException:
        remove_own_directory(tmp)
        raise
    seconds = time.perf_counter() - start
    source_bytes = sum(plan.file_sizes.values())
    summary.update(
        out=str(out),
        seconds=round(seconds, 3),
        source_gb_per_s=round(source_bytes / seconds / 1e9, 4),
        peak_rss_bytes=peak_rss_bytes(),
        stale_temporaries_removed=stale,
    )
    return summary


def peak_rss_bytes() -> int:
    """VmHWM of this process (bytes): the peak resident set, anonymous + file-backed."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


__all__ = ["ConversionError", "ConvertOptions", "convert"]
