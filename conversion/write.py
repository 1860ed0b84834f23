"""The data pass: every shard streamed into the Orbax items of a temporary directory, then the copied
files and the manifest.

- Shard by shard, tensor by tensor (`conversion.stream`). A tensor group (one layer, one Engram
  table, the embedding, the final norm + head) is saved with `ocp.v1.partial.save` as soon as its
  last tensor has been read, then freed (gc + malloc_trim), so the peak is about the largest group (in
  output bytes) plus the interpreter, JAX and Orbax. An Engram table is one group: with `--engram
  skip` or a smaller table the bound is a layer. Compressed items are plain zarr3 (a directory per
  leaf, a file per chunk), because OCDBT holds every encoded chunk of a save until it commits (+0.7x
  a group); uncompressed items are OCDBT, whose chunks only reference the group's arrays.
  `bench/convert.py` measures the bound on a 4.3 GiB checkpoint (BENCHMARKS.md, "Conversion").
- Orbax chunks: one per routed expert in the stacked arrays (a restore with experts sharded over
  devices reads only its own experts), otherwise at most `CHUNK_BYTES`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import shutil
from pathlib import Path

from ced_jax.checkpoint.converted import ENGRAM_ITEM, FORMAT, FORMAT_VERSION, MANIFEST_NAME
from ced_jax.checkpoint.digest import file_sha256
from ced_jax.checkpoint.hf_loader import INDEX_NAME
from ced_jax.engram_store import RAW_DIR, write_raw
from ced_jax.trees import nest
from conversion.groups import GroupBuilder
from conversion.interrupt import check_interrupt
from conversion.options import ConversionError, ConvertOptions
from conversion.plan import Plan
from conversion.progress import progress_bar
from conversion.save_noise import QuietNonOcdbtMerge
from conversion.stream import StreamReader

CONVERTER_VERSION = "1.0"
# Copied beside the checkpoint when the source has them (config.json is required).
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "engram_token_map.json")
CHUNK_BYTES = 64 << 20  # Orbax chunk size: restore granularity along axis 0


def write_checkpoint(
    plan: Plan, hf: Path, tmp: Path, options: ConvertOptions, include: tuple[str, ...]
) -> dict:
    """Stream every shard of `plan` into the Orbax items under `tmp` (the temporary directory), then
    copy the side files and write the manifest. Returns the counts for the summary."""
    import orbax.checkpoint as ocp

    total_bytes = sum(plan.file_sizes.values())
    n_tensors = len(plan.weight_map)
    bar = progress_bar(total_bytes, options.progress)
    builders: dict[str, GroupBuilder] = {}
    produced: dict[str, dict] = {}
    items_used: dict[str, dict] = {}
    raw_leaves: dict[str, dict] = {}
    write_engram_raw = (
        options.engram_raw and options.engram == "separate" and options.weights_dtype == "native"
    )
    sources: list[dict] = []
    done_tensors = 0
    consumed = 0
    quiet = QuietNonOcdbtMerge()
    logging.getLogger("absl").addFilter(quiet)
    try:
        with _orbax_context(options.compression):
            for file in plan.files:
                reader = StreamReader(hf / file, bar)
                try:
                    for name, begin, end in reader.entries:
                        check_interrupt()  # between tensors: never inside a read or an Orbax save
                        key = plan.group_of.get(name)
                        if key is None:  # ignored: read only to hash it
                            reader.skip_to(end)
                        else:
                            builder = builders.get(key)
                            if builder is None:
                                builder = builders[key] = GroupBuilder(
                                    plan.groups[key], plan, options.weights_dtype
                                )
                            dest = builder.destination(name)
                            reader.read_into(name, begin, end, dest)
                            consumed += 1
                            if builder.filled(name, dest):
                                del dest
                                bar.set_postfix_str(f"tensors {done_tensors + 1}/{n_tensors}, saving {key}")
                                leaves = builders.pop(key).finish()
                                group = plan.groups[key]
                                ocp.v1.partial.save(tmp / group.item, nest(leaves))
                                if write_engram_raw and group.item == ENGRAM_ITEM:
                                    for path, arr in leaves.items():
                                        write_raw(tmp / RAW_DIR, plan.cfg, path, arr)
                                        raw_leaves[path] = {
                                            "file": f"{RAW_DIR}/{path}.bin",
                                            "bytes": arr.nbytes,
                                        }
                                info = items_used.setdefault(group.item, {"leaves": 0, "bytes": 0})
                                for path, arr in leaves.items():
                                    produced[path] = {
                                        "item": group.item,
                                        "shape": list(arr.shape),
                                        "dtype": str(arr.dtype),
                                    }
                                    info["leaves"] += 1
                                    info["bytes"] += arr.nbytes
                                del leaves, builder
                                _release_memory()
                        done_tensors += 1
                        bar.set_postfix_str(f"tensors {done_tensors}/{n_tensors}", refresh=False)
                    digest = reader.finish()
                finally:
                    reader.close()
                sources.append({"file": file, "bytes": plan.file_sizes[file], "sha256": digest})
            if builders:
                raise ConversionError(f"groups never completed: {sorted(builders)[:5]}")
            missing = sorted(set(plan.targets) - set(produced))
            if missing:
                raise ConversionError(f"{len(missing)} model leaves were not produced, e.g. {missing[:5]}")
            check_interrupt()
            for item in items_used:
                bar.set_postfix_str(f"finalizing {item}")
                ocp.v1.partial.finalize(tmp / item)
            bar.set_postfix_str(f"tensors {done_tensors}/{n_tensors}, done")
    finally:
        logging.getLogger("absl").removeFilter(quiet)
        bar.close()

    for name in (INDEX_NAME, *COPIED_FILES):
        src = hf / name
        if not src.is_file():
            continue
        if name != INDEX_NAME:
            shutil.copyfile(src, tmp / name)
        sources.append({"file": name, "bytes": src.stat().st_size, "sha256": file_sha256(src)})
    largest = max(plan.groups.values(), key=lambda g: g.out_bytes)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "converter": {"name": "convert_weights", "version": CONVERTER_VERSION, "package": _package_version()},
        "options": {
            "include": list(include),
            "engram": options.engram,
            "weights_dtype": options.weights_dtype,
            "compression": options.compression,
        },
        "model": plan.cfg.name,
        "items": {k: {"path": k, **v} for k, v in sorted(items_used.items())},
        "sources": sources,
        "tensors": {
            "source": n_tensors,
            "consumed": consumed,
            "folded_scales": plan.folded,
            "ignored": [{"name": n, "reason": r} for n, r in sorted(plan.ignored.items())],
        },
        "leaves": dict(sorted(produced.items())),
    }
    if raw_leaves:
        manifest["engram_raw"] = {"path": RAW_DIR, "leaves": dict(sorted(raw_leaves.items()))}
    if consumed + len(plan.ignored) != n_tensors:
        raise ConversionError(
            f"coverage: {consumed} tensors consumed + {len(plan.ignored)} ignored != {n_tensors} in the index"
        )
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return {
        "tensors": n_tensors,
        "consumed": consumed,
        "ignored": len(plan.ignored),
        "leaves": len(produced),
        "items": sorted(items_used),
        "source_bytes": total_bytes,
        "written_bytes": sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
        "largest_group": largest.key,
        "largest_group_bytes": largest.out_bytes,
    }


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ced-jax")
    except PackageNotFoundError:
        return "unknown"


def _release_memory() -> None:
    """Return freed group buffers to the OS: without this glibc keeps them and RSS creeps up."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _orbax_context(compression: bool):
    import orbax.checkpoint as ocp

    ctx = ocp.v1.Context()
    ctx.array.saving.use_compression = compression
    # Orbax copies numpy leaves before writing unless told not to: that would double every group.
    # Safe here, because a group's arrays are not touched until its save has returned.
    ctx.memory.deepcopy_host_arrays = False
    # OCDBT keeps every encoded chunk of a save alive until the save's commit (measured: a 768 MB
    # bf16 leaf saved with zstd peaks at +540 MB, the compressed size, whatever the data file size
    # target; uncompressed chunks merely reference the group's arrays). So compressed checkpoints
    # use plain zarr3 (a directory per leaf, a file per chunk: +64 MB per chunk in flight), and
    # uncompressed ones OCDBT (few files). Restore reads either.
    ctx.array.saving.use_ocdbt = not compression
    # Chunks of at most CHUNK_BYTES, split along the largest axes (Orbax's greedy rule): a table or
    # the embedding is read a slab at a time. Routed experts [E, out, in] are chunked one expert each
    # instead, so a restore with experts sharded over devices reads only the experts it keeps.
    ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
    per_expert = ocp.v1.options.ArrayOptions.Saving.StorageOptions(shard_axes=(0,))

    def storage_options(keypath, _value):
        keys = [getattr(k, "key", None) for k in keypath]
        return per_expert if "experts" in keys else None

    ctx.array.saving.scoped_storage_options_creator = storage_options
    return ctx
