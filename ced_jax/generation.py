"""`Model.generate`: one prompt or a batch, sampled by the server's sampler, streamed or collected.

The prompt's pieces are prefilled on a `Session` (the server's engine and programs), padded to power-
of-two lengths so that new lengths reuse compiled programs; then one token per step, drawn in the
decode program (`Session.step_and_sample`). `_Rows` applies the stopping rules (EOS, max_new_tokens,
stop strings) as the tokens come; the decoders yield (row, token) and stop when `_Rows` says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ced_jax.config import ModelConfig
from ced_jax.options import PREFILL_MODES
from ced_jax.sampling import jitted_sample


def run(
    model,
    prompt,
    max_new_tokens: int | None,
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    stop,
    stream: bool,
    stop_at_eos: bool,
    images,
    token_types,
    dspark: int,
    prefill_mode: str,
):
    """`Model.generate` (its docstring says what each argument does)."""
    check_prefill_mode(prefill_mode)
    if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
        raise ValueError(f"max_new_tokens {max_new_tokens} and max_tokens {max_tokens}: give one")
    limit = next((v for v in (max_new_tokens, max_tokens) if v is not None), 32)
    if limit < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {limit}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2^32), got {seed}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(x, str) or not x for x in stops):
        raise ValueError("stop: expected non-empty strings")
    batch = not isinstance(prompt, str) and len(prompt) > 0 and not isinstance(prompt[0], (int, np.integer))
    prompts = list(prompt) if batch else [prompt]
    if not prompts:
        raise ValueError("prompt: an empty batch")
    if batch and (images is not None or token_types is not None or dspark):
        raise ValueError("images, token_types and dspark take one prompt, not a batch")
    sampling = _Sampling(temperature, top_p, top_k, seed)
    rows = _Rows(model, prompts, limit, stops, stop_at_eos, incremental=stream or bool(stops))
    if batch:
        events = decode_batch(model, rows, sampling, prefill_mode)
    else:
        events = decode_one(model, rows, sampling, images, token_types, dspark, prefill_mode)
    if stream:
        return rows.stream(events)
    for _ in rows.stream(events):
        pass
    results = rows.results()
    if dspark:
        results[0]["dspark"] = rows.dspark_stats
    return results if batch else results[0]


def decode_one(model, rows: _Rows, sampling: _Sampling, images, token_types, dspark: int, prefill_mode: str):
    """(row, token) events of one prompt (rows.ids[0]), with images or DSpark drafting."""
    prompt = rows.prompts[0]
    types = spans = None
    if images is not None and isinstance(prompt, str):
        if token_types is not None:
            raise ValueError("token_types: not with a text prompt (its placeholders place the images)")
        ids, types, spans = model.encode_vl(prompt, images)
        ids = ids.tolist()
    else:
        ids = (
            model.encode(prompt)
            if isinstance(prompt, str)
            else check_ids(prompt, "prompt", model.cfg.vocab_size)
        )
        if images is not None or token_types is not None:
            types, spans = model._prompt_image_inputs(len(ids), token_types, None, images)
    rows.ids = [ids]
    if not 0 <= dspark <= model.cfg.dspark_block_size:
        raise ValueError(
            f"dspark must be 0..{model.cfg.dspark_block_size} (the model's draft block), got {dspark}"
        )
    max_tokens = rows.limit
    # Power-of-two context buckets: a new prompt or output length reuses the compiled programs.
    # (A speculative step writes up to `dspark` positions past the sequence before it knows
    # which are kept.)
    session = model.new_session(1, bucket(len(ids) + max_tokens + dspark, floor=256), with_draft=dspark > 0)
    chunk = model.prefill_chunk
    split = prefill_split(model.cfg, len(ids), prefill_mode)
    parts = [(s, e, True) for s, e in pieces(0, split, chunk)]  # CED's encoder pass
    parts += [(s, e, False) for s, e in pieces(split, len(ids), chunk)]
    for s, e, encoder_only in parts:
        piece = ids[s:e]
        # Chunks are padded to power-of-two lengths (the padding is not written), so prompts of
        # new lengths reuse the compiled programs.
        padded = np.full(bucket(len(piece), cap=chunk), model.cfg.pad_token_id)
        padded[: len(piece)] = piece
        image_inputs = {}
        if types is not None:
            piece_types = np.full(len(padded), -1, np.int32)
            piece_types[: len(piece)] = types[s:e]
            piece_spans = np.zeros((len(padded), model.cfg.hidden_size), np.float32)
            piece_spans[: len(piece)] = spans[s:e]
            image_inputs = dict(token_types=piece_types[None], span_embeds=piece_spans[None])
        logits, _ = session.step(
            padded[None], np.array([len(piece)], np.int32), **image_inputs, encoder_only=encoder_only,
            decoder_from=np.array([split], np.int32) if split and not encoder_only else None,
        )  # fmt: skip
    params = sampling.arrays(1)  # built once: the same every step
    out = [sampling.draw(logits[0, len(piece) - 1], len(ids))]
    yield 0, out[-1]
    if dspark:
        stats = rows.dspark_stats
        drafts, n = np.zeros((1, dspark), np.int32), 0  # no drafts before the first step
        while not rows.done[0]:
            # Never verify past max_tokens: at most max_tokens - len(out) - 1 drafts are useful.
            n = min(n, max_tokens - len(out) - 1)
            step = session.speculative_step(out[-1], drafts, n, **params)
            stats["steps"] += 1
            stats["proposed"] += n
            stats["accepted"] += int(step.accepted[0])
            for token in step.tokens[0, : step.accepted[0] + 1]:
                if rows.done[0]:
                    break
                out.append(int(token))
                yield 0, out[-1]
            drafts, n = step.next_drafts[:, :dspark], dspark
    while not rows.done[0]:
        out.append(int(session.step_and_sample(np.asarray([[out[-1]]]), **params)[0]))
        yield 0, out[-1]


def decode_batch(model, rows: _Rows, sampling: _Sampling, prefill_mode: str):
    """(row, token) events of a batch of prompts: one session of len(prompts) rows, prefilled in
    lockstep pieces (a row whose prompt is done feeds nothing) and decoded together; a finished
    row keeps its slot until every row is done (its tokens are not used)."""
    ids = [
        model.encode(p) if isinstance(p, str) else check_ids(p, f"prompt[{i}]", model.cfg.vocab_size)
        for i, p in enumerate(rows.prompts)
    ]
    rows.ids = ids
    b, chunk = len(ids), model.prefill_chunk
    session = model.new_session(b, bucket(max(map(len, ids)) + rows.limit, floor=256))
    splits = [prefill_split(model.cfg, len(x), prefill_mode) for x in ids]
    last = [None] * b  # each row's logits at its last prompt token
    for encoder_only, ranges in (
        (True, [(0, sp) for sp in splits]),
        (False, list(zip(splits, map(len, ids), strict=True))),
    ):
        steps = max(-(-(e - s) // chunk) for s, e in ranges)
        for k in range(steps):
            spans_k = [(min(s + k * chunk, e), min(s + (k + 1) * chunk, e)) for s, e in ranges]
            lens = np.array([e - s for s, e in spans_k], np.int32)
            tokens = np.full((b, bucket(int(lens.max()), cap=chunk)), model.cfg.pad_token_id, np.int32)
            for r, (s, e) in enumerate(spans_k):
                tokens[r, : e - s] = ids[r][s:e]
            floor = None if encoder_only or not any(splits) else np.array(splits, np.int32)
            logits, _ = session.step(tokens, lens, encoder_only=encoder_only, decoder_from=floor)
            if not encoder_only:
                for r, (s, e) in enumerate(spans_k):
                    if e > s and e == len(ids[r]):
                        last[r] = logits[r, e - s - 1]
    out = np.array([sampling.draw(last[r], len(ids[r])) for r in range(b)], np.int32)
    for r in range(b):
        yield r, int(out[r])
    params = sampling.arrays(b)
    while not all(rows.done):
        out = session.step_and_sample(out[:, None], **params)
        for r in range(b):
            if not rows.done[r]:
                yield r, int(out[r])


@dataclasses.dataclass(frozen=True)
class _Sampling:
    """`generate`'s sampling parameters, as the server's sampler takes them."""

    temperature: float
    top_p: float
    top_k: int
    seed: int

    def arrays(self, rows: int) -> dict:
        return dict(
            temperature=np.full(rows, self.temperature, np.float32),
            top_p=np.full(rows, self.top_p, np.float32),
            top_k=np.full(rows, self.top_k, np.int32),
            seed=np.full(rows, self.seed, np.uint32),
        )  # fmt: skip

    def draw(self, logits: np.ndarray, position: int) -> int:
        """One token from one row of logits (the first generated token, sampled on the host)."""
        return sample_token(logits, self.temperature, self.seed, position, self.top_p, self.top_k)


class _Rows:
    """The outputs of `generate`'s prompts as their tokens come: limits, EOS, stop strings, text."""

    def __init__(
        self,
        model,
        prompts: list,
        limit: int,
        stops: tuple[str, ...],
        stop_at_eos: bool,
        incremental: bool,
    ):
        """incremental: text decoded as tokens come (streaming, stop strings); else once at the end."""
        self.model, self.prompts, self.limit, self.stops, self.stop_at_eos = (
            model,
            prompts,
            limit,
            stops,
            stop_at_eos,
        )
        self.incremental = incremental and model.tokenizer_path is not None
        self.ids: list[list[int]] = []  # each prompt's ids, set by the decoder
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.text = [""] * len(prompts)  # shown so far (cut before a stop string)
        self.done = [False] * len(prompts)
        self.finish: list[str | None] = [None] * len(prompts)
        self.dspark_stats = {"steps": 0, "proposed": 0, "accepted": 0}

    def _add(self, row: int, token: int) -> str:
        """Records a token; returns the text it adds."""
        tokens = self.tokens[row]
        tokens.append(token)
        if self.stop_at_eos and token == self.model.cfg.eos_token_id:
            self.done[row], self.finish[row] = True, "stop"
        elif len(tokens) >= self.limit:
            self.done[row], self.finish[row] = True, "length"
        if not self.incremental:
            return ""
        full = self.model.decode_text(tokens)
        hit = min((i for i in (full.find(x) for x in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            full, self.done[row], self.finish[row] = full[:hit], True, "stop"
        elif not self.done[row]:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence: shown once it is whole
        delta, self.text[row] = full[len(self.text[row]) :], full
        return delta

    def stream(self, events):
        for row, token in events:
            if self.done[row]:
                continue
            yield {"index": row, "token_id": token, "text": self._add(row, token)}

    def results(self) -> list[dict]:
        out = []
        for r in range(len(self.prompts)):
            result = {"prompt_ids": self.ids[r], "token_ids": self.tokens[r], "finish_reason": self.finish[r]}
            if self.model.tokenizer_path is not None:
                result["text"] = self.text[r] if self.incremental else self.model.decode_text(self.tokens[r])
            out.append(result)
        return out


def check_prefill_mode(mode: str) -> None:
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill_mode must be one of {list(PREFILL_MODES)}, got {mode!r}")


def prefill_split(cfg: ModelConfig, prompt_len: int, mode: str) -> int:
    """Where a prompt's decoder pass starts: 0 for "exact" (every layer over every token); for "ced"
    (spec 4.2, CED prefill) prompt_len - sliding_window, the start of the prompt's last window: the
    tokens before it run only the encoder pass (the layers below `cfg.ced_boundary` plus that layer's
    compressed-KV projection), the rest every layer, the decoder layers' SWA truncated to the window
    (decoder SWA bounded replay). A prompt no longer than the window is the same in both modes.
    Raises for "ced" on a model without the CED layout."""
    check_prefill_mode(mode)
    if mode == "exact":
        return 0
    cfg.ced_boundary  # noqa: B018 (raises ConfigError without the layout)
    return max(0, prompt_len - cfg.sliding_window)


def pieces(begin: int, end: int, chunk: int):
    """[begin, end) cut into chunks of at most `chunk` tokens."""
    return [(s, min(end, s + chunk)) for s in range(begin, end, chunk)]


def check_ids(ids, field: str, vocab: int, allow_empty: bool = False) -> list[int]:
    try:
        values = [int(v) for v in ids]
        if any(float(v) != int(v) for v in ids):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a list of integer token ids") from None
    if not values and not allow_empty:
        raise ValueError(f"{field}: must not be empty")
    bad = [v for v in values if not 0 <= v < vocab]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return values


def sample_token(
    logits: np.ndarray, temperature: float, seed: int, position: int, top_p: float = 1.0, top_k: int = 0
) -> int:
    """One token from one row of logits with the server's sampler (`ced_jax.sampling`), so that a
    seed means the same draw in `generate` as in `ced-jax serve` (keyed by seed and position)."""
    token, *_ = jitted_sample(0)(
        np.asarray(logits, np.float32)[None], np.array([position], np.int32),
        np.array([temperature], np.float32), np.array([top_p], np.float32), np.array([top_k], np.int32),
        np.array([seed], np.uint32),
    )  # fmt: skip
    return int(token[0])


def bucket(n: int, *, floor: int = 16, cap: int | None = None) -> int:
    """The power of two >= n (at least `floor`, at most `cap`): a shape many lengths share."""
    width = max(floor, 1 << max(0, n - 1).bit_length())
    return width if cap is None else min(cap, width)
