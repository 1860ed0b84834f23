"""The notebook / CLI API: `load(path_or_preset)` -> `Model` with `generate`, `logits`, `describe`.

A `Model` holds the parameters on device and the programs of `ced_jax.engine` (`Model.programs`,
shared with the serving engine). `generate` and `logits` run a `Session`: an `ced_jax.engine.Engine`
of one slot (or a few) with contiguous page tables, the same state, step function and sampler as
`ced-jax serve`. Engram hash rows are computed on the host from the token history.

Engram placement (`load(..., engram_placement=)`, `Model.engram_placement`): "host" keeps the two
Engram tables in host memory (`Model.engram_store`, a `ced_jax.engram_store.EngramStore`: memory-mapped
raw files a converted checkpoint carries, else numpy arrays) and ships each step's gathered rows with
its inputs, so `Model.params` has no table leaves and the device holds none of their bytes; "device"
puts them in `Model.params` and the programs gather from there. Logits are bit-identical either way.

With `mesh=` (a `ced_jax.sharding.make_mesh` mesh, possibly spanning several processes after
`jax.distributed.initialize`) the parameters are placed by `sharding.param_shardings`, the state by
`ced_jax.cache.paged_cache_axes`, and the programs are traced with the mesh and the rules passed to
`forward` (`sharding.make_layout`); logits and decisions come back replicated so that every process
can read them.

Images: `Model.vision` is the ViT + aligner (`ced_jax.vision.VisionEncoder`, None without a vision
tower); `encode_vl` expands a prompt's image placeholders into spans, and `logits` / `generate` take
images (or explicit `token_types` / `span_embeds`).

Checkpoints are read by `ced_jax.checkpoint` (the released HF layout, or a directory written by
`convert_weights`); the `tiny` preset's weights come from `ced_jax.testing.random_weights`.

DSpark draft stages: `load(..., dspark=None)` reads them when the checkpoint has them (config
`num_nextn_predict_layers` > 0 and the `mtp.*` tensors, or a converted checkpoint's `dspark` part),
into `Model.params["mtp"]` (the tree `ced_jax.checkpoint.dspark.load_dspark_params` returns, storage dtypes
kept, replicated on a mesh); `Model.dspark` says whether they are there.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax import compile_cache, generation, sharding
from ced_jax.checkpoint import place
from ced_jax.checkpoint.converted import (
    included_parts,
    is_converted_checkpoint,
    load_flat,
    load_onto_mesh,
    read_manifest,
)
from ced_jax.checkpoint.digest import arrays_digest, directory_digest
from ced_jax.checkpoint.hf_loader import CheckpointError, load_hf_checkpoint, read_index
from ced_jax.checkpoint.mapping import hf_inventory, parameter_counts
from ced_jax.checkpoint.mesh_loader import load_hf_onto_mesh
from ced_jax.checkpoint.weight_layout import apply_weight_layout, check_compatible, default_weight_layout
from ced_jax.config import ASSETS, PRESETS, ModelConfig, preset
from ced_jax.engine import Engine, LoadedModel, SamplingBatch, StateShapes
from ced_jax.engram_hash import EngramHasher
from ced_jax.engram_store import RAW_DIR, EngramStore, check_placement, has_raw
from ced_jax.generation import bucket, check_ids, check_prefill_mode, pieces, prefill_split
from ced_jax.options import Impl
from ced_jax.testing.random_weights import EMBEDDED_PRESETS, embedded_params
from ced_jax.text_ids import encode_ids


class Model:
    def __init__(
        self,
        cfg: ModelConfig,
        flat_params: dict[str, np.ndarray],
        *,
        hasher: EngramHasher | None,
        tokenizer_path: Path | None,
        impl: str = "reference",
        bf16_as_f32: bool | None = None,
        prefill_chunk: int = 512,
        mesh: jax.sharding.Mesh | None = None,
        rules: str | dict = sharding.DEFAULT_RULES,
        vision_params: dict[str, np.ndarray] | None = None,
        engram_placement: str = "device",
        engram_store: EngramStore | None = None,
        weight_layout: str | None = None,
    ):
        """engram_placement: "host" (the tables in `engram_store`, or taken out of `flat_params`
        into one) or "device" (in `params`, from `flat_params` or, when given, `engram_store`).
        weight_layout: how the quantised weights are kept (`ced_jax.checkpoint.weight_layout`); None:
        `default_weight_layout` for this backend, mesh and impl."""
        impl = Impl.parse(impl)  # an unknown kernel choice fails here, not when a program is first traced
        if weight_layout is None:
            weight_layout = default_weight_layout(cfg, backend=jax.default_backend(), mesh=mesh, impl=impl)
        check_compatible(weight_layout, mesh=mesh, impl=impl)
        self.weight_layout = weight_layout
        if bf16_as_f32 is None:
            bf16_as_f32 = jax.default_backend() == "cpu"
        rules = sharding.get_rules(rules)
        # DSpark stages (`mtp.*` paths) go to params["mtp"]: see `place.dspark_to_device`.
        draft = {k: v for k, v in flat_params.items() if k.startswith(place.DSPARK_PREFIX)}
        backbone = {k: v for k, v in flat_params.items() if not k.startswith(place.DSPARK_PREFIX)}
        self.engram_placement = check_placement(engram_placement)
        store = place.place_engram(cfg, backbone, engram_placement, engram_store)
        shardings = None if mesh is None else place.flat_param_shardings(cfg, backbone, mesh, rules)
        params = apply_weight_layout(
            place.to_device(backbone, bf16_as_f32, shardings), weight_layout, block=cfg.weight_block_size
        )
        # The DSpark stages stay stored: `ced_jax.training.dspark_train` starts from their stored pairs.
        if draft:
            params["mtp"] = place.dspark_to_device(cfg, draft, mesh)
        # What every engine of this model runs (its programs shared by every Session and server).
        self.loaded = LoadedModel(
            cfg=cfg, params=params, hasher=hasher, engram_store=store, mesh=mesh, rules=rules, impl=impl
        )
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self.prefill_chunk = prefill_chunk
        # The ViT + aligner (`ced_jax.vision.VisionEncoder`), None without a vision tower.
        self.vision = None
        if vision_params is not None:
            from ced_jax.vision.tower import VisionEncoder

            self.vision = VisionEncoder(cfg, vision_params)
        # The checkpoint directory the weights came from (`load` sets it): `weights_digest` hashes
        # its files instead of the arrays in memory.
        self.weights_source: Path | None = None

    def weights_digest(self) -> bytes:
        """16 bytes that differ for any difference in the weights (`ced_jax.checkpoint.digest`): the
        files of the checkpoint directory it was loaded from, else every array held, Engram tables and
        vision tower included. Slow for a big checkpoint the first time (its file hashes are cached)."""
        if self.weights_source is not None:
            return directory_digest(self.weights_source)
        leaves = jax.tree_util.tree_flatten_with_path(self.params)[0]
        arrays = [(jax.tree_util.keystr(path), np.asarray(jax.device_get(v))) for path, v in leaves]
        if self.engram_store is not None:
            arrays += [
                (f"engram_store.{i}.{j}", np.asarray(arr))
                for i, pair in enumerate(self.engram_store.tables)
                for j, arr in enumerate(pair)
            ]
        if self.vision is not None:
            arrays += [(f"vision.{k}", np.asarray(v)) for k, v in sorted(self.vision.params.items())]
        return arrays_digest(arrays)

    # The loaded model's parts, as attributes of the notebook API's object.
    cfg = property(lambda self: self.loaded.cfg)
    hasher = property(lambda self: self.loaded.hasher)
    engram_store = property(lambda self: self.loaded.engram_store)
    mesh = property(lambda self: self.loaded.mesh)
    rules = property(lambda self: self.loaded.rules)
    impl = property(lambda self: str(self.loaded.impl))  # the kernel choice as text, as given
    programs = property(lambda self: self.loaded.programs)
    draft_programs = property(lambda self: self.loaded.draft_programs)
    dspark = property(lambda self: self.loaded.dspark)

    @property
    def params(self) -> dict:
        return self.loaded.params

    @params.setter
    def params(self, params: dict) -> None:
        """Run this model object with other parameters of the same tree (a patched copy)."""
        self.loaded = dataclasses.replace(self.loaded, params=params)

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise ValueError("this model has no tokenizer.json; pass token ids instead of text")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """BOS, then the ids of `text`. `tokenizers` matches added tokens anywhere in the text, so a
        special-token spelling typed in `text` (e.g. "<｜end▁of▁sentence｜>") becomes the special id,
        as in vLLM; spec 16.1 prefers plain text for user-typed spellings (a range-aware renderer)."""
        return [self.cfg.bos_token_id] + encode_ids(self.tokenizer, text, add_special_tokens=False)

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ describe
    def describe(self) -> dict:
        return describe(self.cfg)

    # ------------------------------------------------------------------ running
    def new_session(self, batch: int, max_len: int, *, dspark: bool = False) -> Session:
        """`batch` sequences of up to `max_len` tokens on one engine; dspark: a speculative engine
        (`Session.speculative_step`)."""
        return Session(self, batch, max_len, dspark=dspark)

    def logits(
        self,
        prompt_ids,
        decode_ids=(),
        *,
        index_k_mode: str = "intended",
        replay: dict | None = None,
        patch: dict | None = None,
        capture: bool = False,
        prefill_chunk: int | None = None,
        patch_layers: Sequence[int] | None = None,
        token_types=None,
        span_embeds=None,
        images: Sequence | None = None,
        prefill_mode: str = "exact",
    ) -> dict:
        """Prefill `prompt_ids` from position 0, then feed `decode_ids` one at a time (teacher forcing).

        replay / patch use the golden fixture's names (see the CLI help). Returns fp32 arrays:
        prefill_logits_full [T, V], decode_logits [N, V]; with capture the decisions taken
        (prefill_topk_layer{l}, decode_topk_layer{l}, prefill_gate_indices, decode_gate_indices);
        with patch what each block produced (prefill_block_output, decode_block_output).
        patch_layers: replace the block inputs of these layers only (default: every layer of `patch`);
        the other blocks run on what the model computes.

        Images (spec 6.3): token_types [T] (-1 text, 0..3 image span) with span_embeds [T, D] (the
        span rows, ignored at text positions), or `images` (one image per span of token_types, in
        order: bytes, a path or a `PreparedImage`) run through `self.vision`. Decode ids are text.

        prefill_mode: "exact" (every layer over every prompt token, the reference's numbers) or "ced"
        (`prefill_split`: the encoder layers over the whole prompt, the decoder layers only over its
        last window; prefill_logits_full rows before that window are NaN, and capture, replay and
        patch are refused: they need every layer at every position)."""
        prompt = check_ids(prompt_ids, "prompt_ids", self.cfg.vocab_size, allow_empty=False)
        check_prefill_mode(prefill_mode)
        if prefill_mode == "ced" and (capture or replay or patch):
            raise ValueError("prefill_mode 'ced': capture, replay and patch need prefill_mode 'exact'")
        dec = check_ids(decode_ids, "decode_ids", self.cfg.vocab_size, allow_empty=True)
        types, spans = self._prompt_image_inputs(len(prompt), token_types, span_embeds, images)
        replay = fixture_decisions(replay, index_k_mode)[0] if _is_fixture(replay) else replay or {}
        patch = fixture_decisions(patch, index_k_mode)[1] if _is_fixture(patch) else patch or {}
        t, n = len(prompt), len(dec)
        _check_replay_patch(self.cfg, replay, patch, t, n)
        if patch_layers is not None:
            patch_layers = sorted({int(i) for i in patch_layers})
            bad = [i for i in patch_layers if not 0 <= i < self.cfg.num_layers]
            if bad:
                raise ValueError(f"patch_layers: layer {bad[0]} is outside [0, {self.cfg.num_layers})")
            if "prefill_block_input" not in patch and "decode_block_input" not in patch:
                raise ValueError("patch_layers: given without block inputs in `patch`")
        # Power-of-two buckets for the context and every prefill piece (the padding is not written and
        # its rows are dropped), as in `generate`: a new prompt length reuses the compiled programs.
        session = self.new_session(1, bucket(t + n, floor=256))
        chunk = prefill_chunk or t
        out: dict[str, list] = {}
        capture_blocks = bool(patch)
        split = prefill_split(self.cfg, t, prefill_mode)
        if split:
            out["prefill_logits_full"] = [np.full((split, self.cfg.vocab_size), np.nan, np.float32)]

        def piece_inputs(s: int, e: int) -> tuple[int, dict]:
            width = bucket(e - s, cap=prefill_chunk)
            tokens = np.full((1, width), self.cfg.pad_token_id, np.int32)
            tokens[0, : e - s] = prompt[s:e]
            inputs = dict(tokens=tokens, lens=np.array([e - s], np.int32), index_k_mode=index_k_mode)
            if types is not None:
                inputs["token_types"] = _pad_axis(types[None, s:e], 1, width, -1)
                inputs["span_embeds"] = _pad_axis(spans[None, s:e], 1, width)
            return width, inputs

        for s, e in pieces(0, split, chunk):  # CED's encoder pass
            session.step(**piece_inputs(s, e)[1], encoder_only=True)
        for s, e in pieces(split, t, chunk):
            width, inputs = piece_inputs(s, e)
            forced = _pad_forced(
                _forced_slice(self.cfg, replay, patch, "prefill", slice(s, e), patch_layers), width
            )
            logits, aux = session.step(
                **inputs, forced=forced, capture_blocks=capture_blocks,
                decoder_from=np.array([split], np.int32) if split else None,
            )  # fmt: skip
            out.setdefault("prefill_logits_full", []).append(logits[0, : e - s])
            _collect(out, aux, "prefill", capture_blocks, batch_index=0, length=e - s)
        for i, tok in enumerate(dec):
            forced = _forced_slice(self.cfg, replay, patch, "decode", i, patch_layers)
            logits, aux = session.step(
                np.asarray([[tok]]), forced=forced, capture_blocks=capture_blocks, index_k_mode=index_k_mode
            )
            out.setdefault("decode_logits", []).append(logits[0])
            _collect(out, aux, "decode", capture_blocks, batch_index=0)
        result = {k: np.concatenate(v, axis=_cat_axis(k)) for k, v in out.items()}
        if not capture and "prefill_gate_indices" in result:
            result = {k: v for k, v in result.items() if "topk" not in k and "gate_indices" not in k}
        if "decode_logits" not in result:
            result["decode_logits"] = np.zeros((0, self.cfg.vocab_size), np.float32)
        return result

    # ------------------------------------------------------------------ images
    def _require_vision(self, what: str) -> None:
        if self.vision is None:
            reason = (
                "its config has no vision_config"
                if self.cfg.vision is None
                else "no vision weights were loaded, e.g. a checkpoint converted text-only"
            )
            raise ValueError(f"{what}: this model has no vision tower ({reason}); it cannot take images")

    def prepare_images(self, images: Sequence) -> list:
        """Each image as a `ced_jax.vision.PreparedImage`: encoded bytes, a file path (str or Path),
        a PIL image or an already prepared image (pre-processing as the reference's)."""
        self._require_vision("images")
        from ced_jax.vision import PreparedImage, prepare_image

        if isinstance(images, (str, bytes, Path)) or not isinstance(images, Sequence):
            raise ValueError("images: expected a list of images (bytes, paths or PreparedImage)")
        out = []
        for i, image in enumerate(images):
            if isinstance(image, PreparedImage):
                out.append(image)
                continue
            if isinstance(image, (str, Path)):
                try:
                    image = Path(image).read_bytes()
                except OSError as e:
                    raise ValueError(f"images[{i}]: cannot read {image} ({e.strerror})") from None
            try:
                out.append(prepare_image(image, self.cfg.vision))
            except ValueError as e:  # ImageError: not an image, truncated, too large, ...
                raise ValueError(f"images[{i}]: {e}") from None
        return out

    def span_embeds_for(self, token_types, images: Sequence) -> np.ndarray:
        """f32 [T, D]: the ViT + aligner rows of `images` (one per span of `token_types`, in order)
        at their span positions, zeros at text positions."""
        prepared = self.prepare_images(images)
        types = np.asarray(token_types)
        if types.ndim != 1 or not np.issubdtype(types.dtype, np.integer):
            raise ValueError(f"token_types: expected a list of integers, got shape {list(types.shape)}")
        from ced_jax.vision import START

        starts = np.flatnonzero(types == START)
        if len(starts) != len(prepared):
            raise ValueError(
                f"token_types holds {len(starts)} image spans but {len(prepared)} images were given"
            )
        spans = np.zeros((len(types), self.cfg.hidden_size), np.float32)
        for i, (start, image) in enumerate(zip(starts, prepared, strict=True)):
            run = types[start : start + image.span_len]
            if run.shape != image.span_types.shape or np.any(run != image.span_types):
                raise ValueError(
                    f"token_types: the span at position {start} does not match images[{i}] "
                    f"({image.n_llm_h}x{image.n_llm_w} tokens, a span of {image.span_len})"
                )
            spans[start : start + image.span_len] = self.vision.span_embeddings(image)
        return spans

    def encode_vl(
        self, prompt_text: str, images: Sequence, *, add_bos: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A prompt with images: each image placeholder of `prompt_text` (`<｜deepseek_image｜>`, one
        per image, in order) expanded into its image's span. Returns (ids i32 [T], token_types i32
        [T], span_embeds f32 [T, D]) for `logits` / `generate`. add_bos: prepend BOS as `encode`
        does (False for a fully rendered prompt that spells it, such as a fixture's prompt_text)."""
        prepared = self.prepare_images(images)
        from ced_jax.vision import build_vl_prompt

        try:
            vl = build_vl_prompt(
                prompt_text,
                prepared,
                lambda text: encode_ids(self.tokenizer, text, add_special_tokens=False),
                image_token_id=self.cfg.image_token_id,
            )
        except ValueError as e:
            raise ValueError(f"prompt: {e}") from None
        ids, types = vl.ids, vl.token_types
        if add_bos:
            ids = np.concatenate([[self.cfg.bos_token_id], ids]).astype(np.int32)
            types = np.concatenate([[-1], types]).astype(np.int32)
        return ids, types, self.span_embeds_for(types, prepared)

    def _prompt_image_inputs(self, t: int, token_types, span_embeds, images):
        """Validate a prompt's image inputs: (token_types i32 [T], span_embeds f32 [T, D]) or (None, None)."""
        if images is not None:
            if span_embeds is not None:
                raise ValueError("images: give either images or span_embeds, not both")
            if token_types is None:
                raise ValueError("images: token_types of the prompt are needed to place the images")
            span_embeds = self.span_embeds_for(token_types, images)
        if token_types is None and span_embeds is None:
            return None, None
        if token_types is None or span_embeds is None:
            raise ValueError("token_types and span_embeds must be given together")
        types = np.asarray(token_types)
        if types.shape != (t,) or not np.issubdtype(types.dtype, np.integer):
            raise ValueError(
                f"token_types: expected {t} integers (one per prompt id), got shape {list(types.shape)}"
            )
        if types.size and (types.min() < -1 or types.max() > 3):
            raise ValueError("token_types: values must be -1 (text) or 0..3 (image span)")
        spans = np.asarray(span_embeds, np.float32)
        if spans.shape != (t, self.cfg.hidden_size):
            raise ValueError(
                f"span_embeds: expected shape {[t, self.cfg.hidden_size]}, got {list(spans.shape)}"
            )
        return types.astype(np.int32), spans

    def generate(
        self,
        prompt: str | list[int] | Sequence[str | list[int]],
        max_new_tokens: int | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        stop_at_eos: bool = True,
        images: Sequence | None = None,
        token_types=None,
        dspark: int = 0,
        prefill_mode: str = "exact",
    ):
        """Autoregressive generation. Temperature 0 is greedy; otherwise a draw keyed by (seed,
        position) with the server's sampler (temperature, then top_k and top_p; 0 and 1 are off), so a
        seed reproduces its tokens.

        prompt: text or token ids, or a list of them: a batch, prefilled and decoded together in one
        program (the result is then a list, in order). max_new_tokens (alias max_tokens; default 32):
        tokens generated per prompt. stop: strings that end a prompt's generation when its text holds
        one (the text is cut before it; token_ids keep the token that completed it).
        Each result: prompt_ids, token_ids, text (with a tokenizer), finish_reason ("stop": EOS or a
        stop string; "length").

        stream: an iterator of {"index", "token_id", "text"} as tokens come (text: what the token
        adds; index: the prompt's place in a batch), instead of the results.

        dspark: speculative decoding with up to this many DSpark drafts per step (0 = off; one prompt;
        the model must carry the stages). Greedy output is the same as without; sampled output follows
        the same distribution (rejection sampling). The result then has 'dspark': {'steps',
        'proposed', 'accepted'}.

        images: with a text prompt, one image per placeholder `<｜deepseek_image｜>` (`encode_vl`);
        with a list of ids, `token_types` places them (as in `logits`). One prompt.

        prefill_mode: "exact" or "ced" (`prefill_split`; as in `logits`)."""
        return generation.run(
            self, prompt, max_new_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, stream=stream, stop_at_eos=stop_at_eos, images=images,
            token_types=token_types, dspark=dspark, prefill_mode=prefill_mode,
        )  # fmt: skip

    def chat_prompt(
        self, messages: list[dict], *, thinking: bool = True, effort: str | int | None = None
    ) -> list[int]:
        """The prompt ids of a conversation, rendered by the server's chat encoder (`ced_jax.chat`,
        exact to DeepSeek's reference): messages in the reference's dict format (system / user /
        assistant / tool; `tools` on the first system message). effort: the hosted names (low, medium,
        high, max, ...) or a budget 1-100; None: high."""
        from ced_jax.chat import PromptEncoder, render_messages, resolve_thinking

        on, budget = resolve_thinking({"type": "enabled" if thinking else "disabled"}, effort)
        rendered = render_messages(
            messages, thinking_mode="thinking" if on else "chat", reasoning_effort=budget
        )
        return PromptEncoder(self.tokenizer).encode(rendered)

    def chat(
        self,
        messages: list[dict],
        *,
        thinking: bool = True,
        effort: str | int | None = None,
        **generate_kwargs,
    ) -> dict:
        """One assistant turn: `generate` (its arguments, one conversation, no streaming: stream
        `generate(model.chat_prompt(...), stream=True)`) on `chat_prompt`, with the answer parsed as
        the reference parses it into `message` {role, content, reasoning_content, tool_calls}. An
        answer cut by max_new_tokens keeps its text, split at `</think>`, without tool calls."""
        from ced_jax.chat import ChatFormatError, parse_completion
        from ced_jax.chat.encoding import EOS, THINK_END

        if generate_kwargs.get("stream"):
            raise ValueError("chat: stream with generate(model.chat_prompt(messages), stream=True)")
        result = self.generate(
            self.chat_prompt(messages, thinking=thinking, effort=effort), **generate_kwargs
        )
        text = self.tokenizer.decode(result["token_ids"], skip_special_tokens=False)
        mode = "thinking" if thinking and effort != "none" else "chat"
        try:
            message = parse_completion(text if text.endswith(EOS) else text + EOS, mode)
        except ChatFormatError:
            reasoning, _, content = text.partition(THINK_END) if mode == "thinking" else ("", "", text)
            message = {
                "role": "assistant",
                "content": content,
                "reasoning_content": reasoning,
                "tool_calls": [],
            }
        return {**result, "message": message}


class Session:
    """`batch` sequences advancing together (all start at position 0) on an `Engine` of `batch` slots
    with contiguous page tables: the same state, programs and sampler as the server."""

    def __init__(self, model: Model, batch: int, max_len: int, *, dspark: bool = False):
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
        self.model, self.batch, self.max_len = model, batch, max_len
        page = session_page_size(model.cfg)
        context = _round_up(max_len, page)
        # The rows split over the mesh axes of the `batch` rule (and, under data-parallel attention,
        # `dp_ep`, every device runs an equal block of them): the session's rows are padded with idle
        # ones (0 tokens: they write nothing) to a multiple of both, and every result is cut back to
        # `batch` rows.
        layout = sharding.make_layout(model.mesh, model.rules)
        blocks = 1 if layout is None else math.lcm(layout.attention_shards, layout.batch_shards)
        self.rows = _round_up(batch, blocks)
        shapes = StateShapes(
            max_slots=self.rows, page_size=page, num_pages=self.rows * (context // page), max_context=context
        )
        self.engine = Engine(model.loaded, shapes, dspark=dspark)
        self.slots = np.arange(self.rows, dtype=np.int32)
        self.page_tables = cache_lib.contiguous_page_tables(self.rows, shapes.pages_per_slot)
        self.positions = np.zeros(self.rows, np.int32)

    def _check(self, tokens, lens):
        tokens = np.asarray(tokens, np.int32)
        b, t = tokens.shape
        if b != self.batch:
            raise ValueError(f"tokens: expected {self.batch} rows, got {b}")
        lens = np.full(b, t, np.int32) if lens is None else np.asarray(lens, np.int32)
        if np.any(self.positions[:b] + lens > self.max_len):
            raise ValueError(f"sequence would exceed the session's max_len={self.max_len}")
        return self._pad(tokens), self._pad(lens)

    def _pad(self, a, axis: int = 0, value=0):
        """Rows [batch, ...] (along `axis`) -> [rows, ...], the idle rows filled with `value`."""
        if a is None or self.rows == self.batch:
            return a
        a = np.asarray(a)
        width = [(0, 0)] * a.ndim
        width[axis] = (0, self.rows - self.batch)
        return np.pad(a, width, constant_values=value)

    def _cut(self, tree, second: tuple[str, ...] = ()):
        """Results over `rows` -> over `batch` (keys in `second` carry the rows on axis 1)."""
        if self.rows == self.batch or tree is None:
            return tree
        b = self.batch
        if isinstance(tree, dict):
            return {
                k: jax.tree.map(lambda a: a[:, :b], v) if k in second else jax.tree.map(lambda a: a[:b], v)
                for k, v in tree.items()
            }
        return jax.tree.map(lambda a: a[:b], tree)

    def step_and_sample(self, tokens: np.ndarray, temperature, seed, top_p=1.0, top_k=0) -> np.ndarray:
        """Feed one token per row [B, 1] and draw each row's next token with `ced_jax.sampling`
        (keyed by seed and the new token's position; top_p 1 and top_k 0 are off) in the engine's
        decode program, the server's: int32 [B]. The parameters are numbers or one per row."""
        tokens, lens = self._check(tokens, None)
        b = self.batch
        rows = SamplingBatch.broadcast(b, temperature, top_p, top_k, seed)
        sampling = SamplingBatch(
            *(self._pad(getattr(rows, name), value=fill) for name, fill in
              (("temperature", 0), ("top_p", 1), ("top_k", 0), ("seed", 0)))
        )  # fmt: skip
        tok, *_ = self.engine.decode(
            self.slots, tokens[:, 0], self.positions, self._pad(np.ones(self.batch, bool)), self.page_tables,
            sampling, max_logprobs=0,
        )  # fmt: skip
        self.positions = self.positions + lens
        return np.asarray(tok)[: self.batch]

    def speculative_step(
        self, token: int, drafts: np.ndarray, n_drafts: int, temperature, seed, top_p=1.0, top_k=0
    ):
        """One speculative decode step of a one-row session: feed `token` (the last emitted one) and
        verify the first n_drafts of drafts [1, K] (`Engine.speculative_decode`). Returns the
        `ced_jax.engine.SpeculativeOutput`; the session advances by the accepted drafts + 1."""
        if self.batch != 1:
            raise ValueError("speculative_step: sessions of one row only")
        drafts = np.asarray(drafts, np.int32)
        if np.any(self.positions[:1] + drafts.shape[1] + 1 > self.max_len):
            raise ValueError(f"sequence would exceed the session's max_len={self.max_len}")
        r, live = self.rows, self._pad(np.ones(1, bool))
        out = self.engine.speculative_decode(
            self.slots, self._pad(np.array([token], np.int32)), self._pad(drafts),
            self._pad(np.array([n_drafts], np.int32)), self.positions, live, self.page_tables,
            SamplingBatch.broadcast(
                r, *(np.asarray(v).flat[0] for v in (temperature, top_p, top_k, seed))
            ),
            max_logprobs=0,
        )  # fmt: skip
        out = type(out)(*(np.asarray(a)[:1] for a in out))
        self.positions = self.positions + self._pad(out.accepted + 1)
        return out

    def step(
        self,
        tokens: np.ndarray,
        lens: np.ndarray | None = None,
        *,
        forced: dict | None = None,
        capture_blocks: bool = False,
        index_k_mode: str = "intended",
        token_types: np.ndarray | None = None,
        span_embeds: np.ndarray | None = None,
        decoder_from: np.ndarray | None = None,
        encoder_only: bool = False,
    ):
        """Feed tokens [B, T] (lens[b] valid), with optional image spans (token_types [B, T],
        span_embeds [B, T, D]). Returns (logits np [B, T, V], aux as numpy).

        CED prefill (`ModelConfig.ced_boundary`): encoder_only runs only the encoder pass (logits
        None); decoder_from i32 [B]: the rows' decoder layers see no SWA key before it (the start of
        the prompt's last window, where their bounded replay begins)."""
        tokens, lens = self._check(tokens, lens)
        floor = (
            None if decoder_from is None else self.engine.decoder_floor(self.rows, self._pad(decoder_from))
        )
        if forced is not None:
            forced = {
                k: jax.tree.map(lambda a, k=k: self._pad(a, axis=1 if k == "experts" else 0), v)
                for k, v in forced.items()
            }
        logits, aux = self.engine.step(
            tokens, self.positions, lens, self.slots, self.page_tables, forced=forced,
            capture_blocks=capture_blocks, index_k_mode=index_k_mode,
            token_types=self._pad(token_types, value=-1), span_embeds=self._pad(span_embeds),
            window_floor=floor, stop_at_layer=self.model.cfg.ced_boundary if encoder_only else None,
        )  # fmt: skip
        self.positions = self.positions + lens
        aux = self._cut(jax.tree.map(np.asarray, aux), second=("experts", "block_output"))
        return (None if logits is None else np.asarray(logits)[: self.batch]), aux


def session_page_size(cfg: ModelConfig) -> int:
    """Tokens per page of a notebook session: the smallest multiple of 16 that holds whole entries of
    every KV source (pages are private to a session's rows, so their size changes no value)."""
    return math.lcm(16, *(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))


# ---------------------------------------------------------------------- helpers
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


_FIXTURE_MODES = ("intended", "reference")


def _is_fixture(arrays: dict | None) -> bool:
    """A golden fixture's expected.safetensors (its decode arrays are recorded per index-key mode)."""
    return bool(arrays) and any(k.startswith(("decode_intended_", "decode_reference_")) for k in arrays)


def fixture_decisions(fixture: dict, index_k_mode: str = "intended") -> tuple[dict, dict]:
    """(replay, patch) for `Model.logits` from a golden fixture's arrays (`expected.safetensors`, as
    loaded): the recorded routing and top-k rows, and the block inputs, of the prefill and of the
    decode run in `index_k_mode`. `logits` applies it itself to a fixture given as replay or patch."""
    if index_k_mode not in _FIXTURE_MODES:
        raise ValueError(f"index_k_mode must be one of {list(_FIXTURE_MODES)}, got {index_k_mode!r}")

    layers = sorted({k.rsplit("topk_layer", 1)[1] for k in fixture if re.fullmatch(r".+_topk_layer\d+", k)})
    replay, patch = {}, {}
    for phase in ("prefill", "decode"):
        source = "prefill_" if phase == "prefill" else f"decode_{index_k_mode}_"
        for name in ("gate_indices", *(f"topk_layer{layer}" for layer in layers)):
            if source + name in fixture:
                replay[f"{phase}_{name}"] = fixture[source + name]
        for name in ("block_input", "pre_mix_input"):
            if source + name in fixture:
                patch[f"{phase}_{name}"] = fixture[source + name]
    return replay, patch


def _check_replay_patch(cfg: ModelConfig, replay: dict, patch: dict, t: int, n: int) -> None:
    """Validate replay / patch arrays by name and shape so a wrong file fails with a clear error."""
    L, k, M, D = cfg.num_layers, cfg.num_experts_per_tok, cfg.hc_mult, cfg.hidden_size
    expected: dict[str, tuple] = {
        "prefill_gate_indices": (L, t, k),
        "decode_gate_indices": (n, L, k),
        "prefill_block_input": (L, t, M, D),
        "prefill_pre_mix_input": (L, t, M),
        "decode_block_input": (n, L, M, D),
        "decode_pre_mix_input": (n, L, M),
    }
    for layer in cfg.index_source_layer_ids:  # any width up to index_topk: -1 marks unused slots
        expected[f"prefill_topk_layer{layer}"] = (t, None)
        expected[f"decode_topk_layer{layer}"] = (n, None)
    for source, what in ((replay, "replay"), (patch, "patch")):
        for name, arr in source.items():
            if name not in expected:
                raise ValueError(f"{what}: unknown array {name!r}")
            shape = expected[name]
            got = tuple(np.shape(arr))
            if len(got) != len(shape) or any(
                s is not None and s != g for s, g in zip(shape, got, strict=False)
            ):
                raise ValueError(f"{what}: {name} has shape {list(got)}, expected {list(shape)} (None = any)")
    for a, b in (
        ("prefill_block_input", "prefill_pre_mix_input"),
        ("decode_block_input", "decode_pre_mix_input"),
    ):
        if (a in patch) != (b in patch):
            raise ValueError(f"patch: {a} and {b} must be given together")


def _pad_axis(a: np.ndarray, axis: int, width: int, value=0) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, width - a.shape[axis])
    return np.pad(a, pad, constant_values=value)


def _pad_forced(forced: dict | None, width: int) -> dict | None:
    """A prefill piece's forced decisions and block inputs padded to `width` positions (their padding
    is never used: those positions are not written and their outputs are dropped)."""
    if forced is None:
        return None
    out = dict(forced)
    if "topk" in out:
        out["topk"] = {k: _pad_axis(v, 1, width) for k, v in out["topk"].items()}
    if "experts" in out:
        out["experts"] = _pad_axis(out["experts"], 2, width)
    for name in ("block_input", "pre_mix"):
        if name in out:
            out[name] = {k: _pad_axis(v, 1, width) for k, v in out[name].items()}
    return out


def _forced_slice(
    cfg: ModelConfig, replay: dict, patch: dict, phase: str, where, patch_layers: Sequence[int] | None = None
) -> dict | None:
    """Forced decisions/inputs for one prefill chunk (where = slice of tokens) or decode step (int);
    block inputs are patched for `patch_layers` only (None: every layer)."""
    forced: dict[str, Any] = {}
    topk = {}
    for layer in cfg.index_source_layer_ids:
        arr = replay.get(f"{phase}_topk_layer{layer}")
        if arr is not None:
            a = np.asarray(arr, np.int32)
            topk[str(layer)] = a[where][None] if phase == "prefill" else a[where][None, None]
    if topk:
        forced["topk"] = topk
    gates = replay.get(f"{phase}_gate_indices")
    if gates is not None:
        g = np.asarray(gates, np.int32)
        forced["experts"] = g[:, where][:, None] if phase == "prefill" else g[where][:, None, None]
    block = patch.get(f"{phase}_block_input")
    if block is not None:
        pre = np.asarray(patch[f"{phase}_pre_mix_input"], np.float32)
        block = np.asarray(block, np.float32)
        chosen = range(cfg.num_layers) if patch_layers is None else patch_layers
        if phase == "prefill":  # [L, T, ...] -> {layer: [1, T_chunk, ...]}
            forced["block_input"] = {str(i): block[i, where][None] for i in chosen}
            forced["pre_mix"] = {str(i): pre[i, where][None] for i in chosen}
        else:  # [N, L, ...] -> {layer: [1, 1, ...]}
            forced["block_input"] = {str(i): block[where, i][None, None] for i in chosen}
            forced["pre_mix"] = {str(i): pre[where, i][None, None] for i in chosen}
    return forced or None


def _collect(
    out: dict, aux: dict, phase: str, capture_blocks: bool, batch_index: int, length: int | None = None
) -> None:
    """Appends one step's decisions (prefill: the first `length` positions, the rest being padding)."""
    for layer, topk in aux["topk"].items():
        out.setdefault(f"{phase}_topk_layer{layer}", []).append(topk[batch_index, :length])
    experts = aux["experts"][:, batch_index, :length]  # [L, T, X]
    out.setdefault(f"{phase}_gate_indices", []).append(
        experts if phase == "prefill" else experts.transpose(1, 0, 2)
    )
    if capture_blocks:
        blocks = aux["block_output"][:, batch_index, :length]  # [L, T, M, D]
        out.setdefault(f"{phase}_block_output", []).append(
            blocks if phase == "prefill" else blocks.transpose(1, 0, 2, 3)
        )


def _cat_axis(name: str) -> int:
    return 1 if name in ("prefill_gate_indices", "prefill_block_output") else 0


# ---------------------------------------------------------------------- describe
def describe(cfg: ModelConfig) -> dict:
    """Config summary, parameter counts, active parameters per token, KV bytes: all from the layout."""
    counts = parameter_counts(cfg)
    inventory = hf_inventory(cfg)
    E, X = cfg.n_routed_experts, cfg.num_experts_per_tok

    def layer_active(i: int) -> float:
        total = 0.0
        for name, spec in inventory.items():
            if spec.group != "backbone" or not name.startswith(f"layers.{i}."):
                continue
            n = spec.params
            total += n * X / E if ".ffn.experts." in name else n
        return total

    head = math.prod(inventory["head.weight"].shape)
    decode_active = sum(layer_active(i) for i in range(cfg.num_layers)) + head
    # The causal encoder path of a prompt token: the layers below the first ratio-1 KV source, plus
    # that source's KV projection (its compressor and index-key projection).
    decoder_start = min(
        (s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 1), default=cfg.num_layers
    )
    kv_projection = sum(
        spec.params
        for name, spec in inventory.items()
        if name.startswith(f"layers.{decoder_start}.attn.compressor.")
        or name.startswith(f"layers.{decoder_start}.attn.indexer.wk")
        or name.startswith(f"layers.{decoder_start}.attn.indexer.k_norm")
    )
    prompt_active = sum(layer_active(i) for i in range(decoder_start)) + kv_projection
    # KV sizes are read off the serving cache's own buffers (shapes only, nothing allocated): one
    # slot, one page of the smallest size that holds whole entries of every KV source.
    page = math.lcm(*(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids))
    state = jax.eval_shape(partial(cache_lib.init_paged_cache, cfg, max_slots=1, page_size=page, num_pages=1))
    return {
        "model": cfg.name,
        "config": {
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "routed_experts": E,
            "experts_per_token": X,
            "layer_kinds": list(cfg.layer_kinds),
            "compress_ratios": list(cfg.compress_ratios[: cfg.num_layers]),
            "kv_source_layers": list(cfg.kv_source_layer_ids),
            "index_source_layers": list(cfg.index_source_layer_ids),
            "engram_layers": list(cfg.engram_layer_ids),
            "sliding_window": cfg.sliding_window,
            "max_position_embeddings": cfg.max_position_embeddings,
            "dspark_stages": cfg.num_nextn_predict_layers,
            "vision": cfg.vision is not None,
        },
        "parameters": {
            "backbone": counts["backbone"],
            "engram_tables": counts["engram_table"],
            "dspark": counts["dspark"],
            "vision": counts["vision"],
            "total": counts["total"],
        },
        "active_parameters_per_token": {
            "prompt_encoder_path": int(round(prompt_active)),
            "decode_path": int(round(decode_active)),
        },
        "kv_bytes_per_token": cache_lib.kv_bytes_per_token(state),
        "swa_bytes_per_sequence": cache_lib.buffer_bytes(state.window),
        "storage_bytes": {"weights": sum(spec.nbytes for spec in inventory.values())},
    }


# ---------------------------------------------------------------------- load
def load(
    path_or_preset: str | Path,
    *,
    impl: str = "reference",
    prefill_chunk: int = 512,
    mesh: jax.sharding.Mesh | None = None,
    rules: str | dict = sharding.DEFAULT_RULES,
    dspark: bool | None = None,
    engram_placement: str | None = None,
    weight_layout: str | None = None,
    compilation_cache: bool = True,
    compilation_cache_dir: str | Path | None = None,
) -> Model:
    """A preset name ('tiny'), a Hugging Face checkpoint directory in the released format, or a
    directory written by `convert_weights` (read by ced_jax.checkpoint.converted).

    mesh: place and run the model on this (data, expert, tensor) mesh under `rules` (see
    ced_jax.sharding); None runs on the default device. On a mesh each parameter is read straight
    into its sharding, never the whole model into host memory: an HF directory by
    `ced_jax.checkpoint.mesh_loader` (each process reads the byte ranges of its devices' blocks), a
    converted one by Orbax restoring the params item into the target shardings. The Engram tables
    and the DSpark stages are read into host memory as without a mesh.
    dspark: the DSpark draft stages (`Model.params["mtp"]`, `Model.dspark`). None: load them when
    the checkpoint has them (config num_nextn_predict_layers > 0 and the `mtp.*` tensors present, or
    a converted checkpoint's `dspark` part); True: required (a checkpoint without them is an error
    naming what is missing); False: skip them.
    engram_placement: where the Engram tables live (module docstring): "host" or "device"; None:
    `default_engram_placement`. A converted checkpoint's raw table files (`engram_raw/`, written by
    `convert_weights`) are memory-mapped for "host", its Orbax Engram item read otherwise.
    weight_layout: "stored", "f32-dense" or "f32" (`ced_jax.checkpoint.weight_layout`: the FP8
    linears, and for "f32" the routed experts too, dequantised once here instead of at every step;
    same values); None: `ced_jax.checkpoint.weight_layout.default_weight_layout` ("f32" on one CPU
    device when the experts fit in 1 GiB as f32, else "stored").
    compilation_cache / compilation_cache_dir: JAX's persistent compilation cache for this process
    (`ced_jax.compile_cache`): on by default, in the directory already in use or the per-user one
    (`~/.cache/ced-jax/xla` on Linux), so a second process compiles nothing it compiled before."""
    compile_cache.configure(compilation_cache, compilation_cache_dir)
    if weight_layout is not None:
        check_compatible(weight_layout, mesh=mesh, impl=impl)
    if dspark not in (None, True, False):
        raise ValueError(f"dspark: expected None, True or False, got {dspark!r}")
    if engram_placement is not None:
        check_placement(engram_placement)
    name = str(path_or_preset)
    if name in PRESETS:
        cfg = preset(name)
        if name not in EMBEDDED_PRESETS:
            raise ValueError(
                f"preset {name!r} has no embedded weights; pass a checkpoint directory "
                f"(`ced-jax describe {name}` works without weights)"
            )
        with_dspark = _want_dspark(dspark, cfg, f"preset {name!r}", lambda: None)
        flat = embedded_params(name, dspark=with_dspark)
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
        with_dspark = _want_dspark(dspark, cfg, str(directory), lambda: _converted_dspark_gap(directory))
        raw = placement == "host" and has_raw(directory / RAW_DIR, cfg)
        if raw:  # memory-mapped: the Orbax Engram item is not read
            store = EngramStore.open_raw(directory / RAW_DIR, cfg)
        if mesh is None:
            cfg, flat = load_flat(directory, parts=("dspark",) if with_dspark else (), engram=not raw)
        else:  # the params item restored by Orbax straight into its shardings
            parts = ("dspark",) if with_dspark else ()
            cfg, flat = load_onto_mesh(
                directory,
                mesh,
                sharding.get_rules(rules),
                parts=parts,
                engram=not raw,
                widen_bf16=jax.default_backend() == "cpu",
            )
    else:
        with_dspark = _want_dspark(dspark, cfg, str(directory), lambda: _hf_dspark_gap(directory, cfg))
        include = ("text", "dspark") if with_dspark else ("text",)
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


def _want_dspark(dspark: bool | None, cfg: ModelConfig, source: str, gap) -> bool:
    """Whether to load the DSpark stages. `gap()`: why the source lacks them although the config
    describes them (None when they are all there)."""
    if dspark is False:
        return False
    if cfg.num_nextn_predict_layers <= 0:
        if dspark:
            raise CheckpointError(
                f"dspark=True: {source} has no DSpark stages (config.json text_config."
                "num_nextn_predict_layers is 0)"
            )
        return False
    why = gap()
    if why is None:
        return True
    if dspark:
        raise CheckpointError(f"dspark=True: {source}: {why}")
    return False


def _hf_dspark_gap(directory: Path, cfg: ModelConfig) -> str | None:
    """None when the index lists every `mtp.*` tensor `cfg` describes; otherwise why not. A partial set
    is a broken checkpoint, not an absent draft: it raises whatever `dspark` says."""
    weight_map = read_index(directory)
    wanted = [n for n, s in hf_inventory(cfg).items() if s.group == "dspark"]
    missing = [n for n in wanted if n not in weight_map]
    if not missing:
        return None
    if len(missing) < len(wanted):
        raise CheckpointError(
            f"{directory}: {len(missing)} of the {len(wanted)} DSpark tensors are missing from the index, "
            f"e.g. {missing[:5]} (pass dspark=False to load without the draft stages)"
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
