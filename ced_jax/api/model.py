"""`Model`: the parameters on device and the programs of `ced_jax.engine` (`Model.programs`, shared
with the serving engine), with the tokenizer and the vision tower. `generate` and `logits` run a
`Session`: the same state, step function and sampler as `ced-jax serve`. Engram hash rows are computed
on the host from the token history.

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
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from ced_jax import generation, sharding
from ced_jax.api.replay import (
    check_replay_patch,
    collect_decisions,
    concat_axis,
    fixture_decisions,
    forced_slice,
    is_fixture,
    pad_axis,
    pad_forced,
)
from ced_jax.api.session import Session
from ced_jax.api.summary import describe
from ced_jax.checkpoint import place
from ced_jax.checkpoint.digest import arrays_digest, directory_digest
from ced_jax.checkpoint.mapping import DSPARK_PREFIX
from ced_jax.checkpoint.weight_layout import apply_weight_layout, check_compatible, default_weight_layout
from ced_jax.config import ModelConfig
from ced_jax.engine import LoadedModel
from ced_jax.engram_hash import EngramHasher
from ced_jax.engram_store import EngramStore, check_placement
from ced_jax.generation import bucket, check_ids, check_prefill_mode, pieces, prefill_split
from ced_jax.options import Impl
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
        if impl.cpu:
            from pallas_kernels import _cpu

            _cpu.require()  # kernels not built on this machine: one line now, not at the first trace
        if weight_layout is None:
            weight_layout = default_weight_layout(cfg, backend=jax.default_backend(), mesh=mesh, impl=impl)
        check_compatible(weight_layout, mesh=mesh, impl=impl)
        self.weight_layout = weight_layout
        if bf16_as_f32 is None:
            bf16_as_f32 = jax.default_backend() == "cpu"
        rules = sharding.get_rules(rules)
        # DSpark stages (`mtp.*` paths) go to params["mtp"]: see `place.dspark_to_device`.
        draft = {k: v for k, v in flat_params.items() if k.startswith(DSPARK_PREFIX)}
        backbone = {k: v for k, v in flat_params.items() if not k.startswith(DSPARK_PREFIX)}
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
    has_draft_stages = property(lambda self: self.loaded.has_draft_stages)

    @property
    def dspark(self) -> bool:
        """The old name of `has_draft_stages` (elsewhere dspark is the number of drafts per step)."""
        warnings.warn("Model.dspark is now Model.has_draft_stages", DeprecationWarning, stacklevel=2)
        return self.has_draft_stages

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
    def new_session(self, batch: int, max_len: int, *, with_draft: bool = False) -> Session:
        """`batch` sequences of up to `max_len` tokens on one engine; with_draft: a speculative engine
        (`Session.speculative_step`)."""
        return Session(self, batch, max_len, with_draft=with_draft)

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
        replay = fixture_decisions(replay, index_k_mode)[0] if is_fixture(replay) else replay or {}
        patch = fixture_decisions(patch, index_k_mode)[1] if is_fixture(patch) else patch or {}
        t, n = len(prompt), len(dec)
        check_replay_patch(self.cfg, replay, patch, t, n)
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
                inputs["token_types"] = pad_axis(types[None, s:e], 1, width, -1)
                inputs["span_embeds"] = pad_axis(spans[None, s:e], 1, width)
            return width, inputs

        for s, e in pieces(0, split, chunk):  # CED's encoder pass
            session.step(**piece_inputs(s, e)[1], encoder_only=True)
        for s, e in pieces(split, t, chunk):
            width, inputs = piece_inputs(s, e)
            forced = pad_forced(
                forced_slice(self.cfg, replay, patch, "prefill", slice(s, e), patch_layers), width
            )
            logits, aux = session.step(
                **inputs, forced=forced, capture_blocks=capture_blocks,
                decoder_from=np.array([split], np.int32) if split else None,
            )  # fmt: skip
            out.setdefault("prefill_logits_full", []).append(logits[0, : e - s])
            collect_decisions(out, aux, "prefill", capture_blocks, batch_index=0, length=e - s)
        for i, tok in enumerate(dec):
            forced = forced_slice(self.cfg, replay, patch, "decode", i, patch_layers)
            logits, aux = session.step(
                np.asarray([[tok]]), forced=forced, capture_blocks=capture_blocks, index_k_mode=index_k_mode
            )
            out.setdefault("decode_logits", []).append(logits[0])
            collect_decisions(out, aux, "decode", capture_blocks, batch_index=0)
        result = {k: np.concatenate(v, axis=concat_axis(k)) for k, v in out.items()}
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
