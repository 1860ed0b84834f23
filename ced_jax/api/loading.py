"""`load`: a `Model` from a preset, a Hugging Face checkpoint directory or a `convert_weights` output.

Checkpoints are read by `ced_jax.checkpoint` (the released HF layout, or a directory written by
`convert_weights`); the `tiny` preset's weights come from `ced_jax.testing.random_weights`.

DSpark draft stages: `load(..., with_draft=None)` reads them when the checkpoint has them (config
`num_nextn_predict_layers` > 0 and the `mtp.*` tensors, or a converted checkpoint's `dspark` part),
into `Model.params["mtp"]` (the tree `ced_jax.checkpoint.dspark.load_dspark_params` returns, storage dtypes
kept, replicated on a mesh); `Model.has_draft_stages` says whether they are there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax

from ced_jax import compile_cache, sharding
from ced_jax.api.model import Model
from ced_jax.checkpoint import place
from ced_jax.checkpoint.converted import (
    included_parts,
    is_converted_checkpoint,
    load_flat,
    load_onto_mesh,
    read_manifest,
)
from ced_jax.checkpoint.hf_loader import CheckpointError, load_hf_checkpoint, read_index
from ced_jax.checkpoint.mapping import hf_inventory
from ced_jax.checkpoint.mesh_loader import load_hf_onto_mesh
from ced_jax.checkpoint.weight_layout import check_compatible
from ced_jax.config import ASSETS, PRESETS, ModelConfig, current_preset_name, preset
from ced_jax.engram_hash import EngramHasher
from ced_jax.engram_store import RAW_DIR, EngramStore, check_placement, has_raw
from ced_jax.testing.random_weights import EMBEDDED_PRESETS, embedded_params


def load(
    path_or_preset: str | Path,
    *,
    impl: str = "reference",
    prefill_chunk: int = 512,
    mesh: jax.sharding.Mesh | None = None,
    rules: str | dict = sharding.DEFAULT_RULES,
    with_draft: bool | None = None,
    engram_placement: str | None = None,
    weight_layout: str | None = None,
    compilation_cache: bool = True,
    compilation_cache_dir: str | Path | None = None,
    **old_names,
) -> Model:
    """A preset name ('tiny'), a Hugging Face checkpoint directory in the released format, or a
    directory written by `convert_weights` (read by ced_jax.checkpoint.converted).

    mesh: place and run the model on this (data, expert, tensor) mesh under `rules` (see
    ced_jax.sharding); None runs on the default device. On a mesh each parameter is read straight
    into its sharding, never the whole model into host memory: an HF directory by
    `ced_jax.checkpoint.mesh_loader` (each process reads the byte ranges of its devices' blocks), a
    converted one by Orbax restoring the params item into the target shardings. The Engram tables
    and the DSpark stages are read into host memory as without a mesh.
    with_draft: the DSpark draft stages (`Model.params["mtp"]`, `Model.has_draft_stages`). None: load
    them when the checkpoint has them (config num_nextn_predict_layers > 0 and the `mtp.*` tensors
    present, or a converted checkpoint's `dspark` part); True: required (a checkpoint without them is
    an error naming what is missing); False: skip them.
    engram_placement: where the Engram tables live (`ced_jax.api.model`): "host" or "device"; None:
    `default_engram_placement`. A converted checkpoint's raw table files (`engram_raw/`, written by
    `convert_weights`) are memory-mapped for "host", its Orbax Engram item read otherwise.
    weight_layout: "stored", "f32-dense" or "f32" (`ced_jax.checkpoint.weight_layout`: the FP8
    linears, and for "f32" the routed experts too, dequantised once here instead of at every step;
    same values); None: `ced_jax.checkpoint.weight_layout.default_weight_layout` ("f32" on one CPU
    device when the experts fit in 1 GiB as f32, else "stored").
    compilation_cache / compilation_cache_dir: JAX's persistent compilation cache for this process
    (`ced_jax.compile_cache`): on by default, in the directory already in use or the per-user one
    (`~/.cache/ced-jax/xla` on Linux), so a second process compiles nothing it compiled before.
    old_names: `dspark=` for with_draft (deprecated: elsewhere dspark is the number of drafts per step)."""
    with_draft = _renamed_with_draft(old_names, with_draft)
    compile_cache.configure(compilation_cache, compilation_cache_dir)
    if weight_layout is not None:
        check_compatible(weight_layout, mesh=mesh, impl=impl)
    if with_draft not in (None, True, False):
        raise ValueError(f"with_draft: expected None, True or False, got {with_draft!r}")
    if engram_placement is not None:
        check_placement(engram_placement)
    name = current_preset_name(str(path_or_preset))
    if name in PRESETS:
        cfg = preset(name)
        if name not in EMBEDDED_PRESETS:
            raise ValueError(
                f"preset {name!r} has no embedded weights; pass a checkpoint directory "
                f"(`ced-jax describe {name}` works without weights)"
            )
        read_draft = _want_draft(with_draft, cfg, f"preset {name!r}", lambda: None)
        flat = embedded_params(name, with_draft=read_draft)
        hasher = EngramHasher.from_token_map_file(cfg, ASSETS / "tiny" / "engram_token_map.json")
        return Model(
            cfg,
            flat,
            hasher=hasher,
            tokenizer_path=ASSETS / "tiny" / "tokenizer.json",
            impl=impl,
            prefill_chunk=prefill_chunk,
            mesh=mesh,
            rules=rules,
            engram_placement=engram_placement or default_engram_placement(name),
            weight_layout=weight_layout,
        )
    directory = Path(name)
    if not directory.is_dir():
        raise ValueError(f"{name!r} is neither a preset ({sorted(PRESETS)}) nor a checkpoint directory")
    cfg = ModelConfig.from_pretrained(directory)
    placement = engram_placement or default_engram_placement(directory)
    store = None
    if is_converted_checkpoint(directory):  # convert_weights output: Orbax items + ced_manifest.json
        read_draft = _want_draft(with_draft, cfg, str(directory), lambda: _converted_dspark_gap(directory))
        raw = placement == "host" and has_raw(directory / RAW_DIR, cfg)
        if raw:  # memory-mapped: the Orbax Engram item is not read
            store = EngramStore.open_raw(directory / RAW_DIR, cfg)
        if mesh is None:
            cfg, flat = load_flat(directory, parts=("dspark",) if read_draft else (), engram=not raw)
        else:  # the params item restored by Orbax straight into its shardings
            parts = ("dspark",) if read_draft else ()
            cfg, flat = load_onto_mesh(
                directory,
                mesh,
                sharding.get_rules(rules),
                parts=parts,
                engram=not raw,
                widen_bf16=jax.default_backend() == "cpu",
            )
    else:
        read_draft = _want_draft(with_draft, cfg, str(directory), lambda: _hf_dspark_gap(directory, cfg))
        include = ("text", "dspark") if read_draft else ("text",)
        if mesh is None:
            flat, _report = load_hf_checkpoint(directory, cfg, include=include)
        else:  # each parameter read block by block into its sharding (Engram tables, DSpark: host)
            flat, _report = load_hf_onto_mesh(
                directory,
                cfg,
                place.mesh_targets(cfg, mesh, rules),
                include=include,
                bf16_as_f32=jax.default_backend() == "cpu",
            )
    hasher = None
    if cfg.engram_layer_ids:
        if (directory / "engram_token_map.json").exists():
            hasher = EngramHasher.from_token_map_file(cfg, directory / "engram_token_map.json")
        elif (directory / "tokenizer.json").exists():
            hasher = EngramHasher.from_tokenizer_file(cfg, directory / "tokenizer.json")
        else:
            raise ValueError(f"{directory}: Engram layers need tokenizer.json or engram_token_map.json")
    tok = directory / "tokenizer.json"
    from ced_jax.checkpoint.vision import load_vision_params

    model = Model(
        cfg,
        flat,
        hasher=hasher,
        tokenizer_path=tok if tok.exists() else None,
        impl=impl,
        prefill_chunk=prefill_chunk,
        mesh=mesh,
        rules=rules,
        # None without a vision tower, or for a converted checkpoint written text-only (images are
        # then refused by name, text runs as before).
        vision_params=load_vision_params(directory, cfg, required=False),
        engram_placement=placement,
        engram_store=store,
        weight_layout=weight_layout,
    )
    model.weights_source = directory
    return model


def default_engram_placement(path_or_preset: str | Path) -> str:
    """The Engram placement `load` uses when none is given: "host" for every checkpoint and preset,
    so the tables never take device memory (logits bit-identical to "device"; the cost per step is
    in BENCHMARKS.md, "Engram off device")."""
    del path_or_preset
    return "host"


def _renamed_with_draft(old_names: dict, with_draft: bool | None) -> bool | None:
    """`load(dspark=...)`, the old spelling of with_draft: still accepted, with a DeprecationWarning."""
    unexpected = sorted(set(old_names) - {"dspark"})
    if unexpected:
        raise TypeError(f"load() got an unexpected keyword argument {unexpected[0]!r}")
    if "dspark" not in old_names:
        return with_draft
    warnings.warn(
        "load(dspark=...) is now load(with_draft=...) (dspark is the number of drafts per step in "
        "generate and serve)",
        DeprecationWarning,
        stacklevel=3,
    )
    if with_draft is not None:
        raise TypeError("load() got both with_draft and its old name dspark")
    return old_names["dspark"]


def _want_draft(with_draft: bool | None, cfg: ModelConfig, source: str, gap) -> bool:
    """Whether to load the DSpark stages. `gap()`: why the source lacks them although the config
    describes them (None when they are all there)."""
    if with_draft is False:
        return False
    if cfg.num_nextn_predict_layers <= 0:
        if with_draft:
            raise CheckpointError(
                f"with_draft=True: {source} has no DSpark stages (config.json text_config."
                "num_nextn_predict_layers is 0)"
            )
        return False
    why = gap()
    if why is None:
        return True
    if with_draft:
        raise CheckpointError(f"with_draft=True: {source}: {why}")
    return False


def _hf_dspark_gap(directory: Path, cfg: ModelConfig) -> str | None:
    """None when the index lists every `mtp.*` tensor `cfg` describes; otherwise why not. A partial set
    is a broken checkpoint, not an absent draft: it raises whatever `with_draft` says."""
    weight_map = read_index(directory)
    wanted = [n for n, s in hf_inventory(cfg).items() if s.group == "dspark"]
    missing = [n for n in wanted if n not in weight_map]
    if not missing:
        return None
    if len(missing) < len(wanted):
        raise CheckpointError(
            f"{directory}: {len(missing)} of the {len(wanted)} DSpark tensors are missing from the index, "
            f"e.g. {missing[:5]} (pass with_draft=False to load without the draft stages)"
        )
    return (
        f"config.json describes {cfg.num_nextn_predict_layers} DSpark stages but the index lists none of "
        f"their {len(wanted)} tensors (mtp.*), e.g. '{missing[0]}'"
    )


def _converted_dspark_gap(directory: Path) -> str | None:
    manifest = read_manifest(directory)
    if "dspark" in included_parts(manifest):
        return None
    return (
        f"converted without its DSpark stages (include={manifest['options']['include']}); "
        "convert again with --include text,dspark"
    )
