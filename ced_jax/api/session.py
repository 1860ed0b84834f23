"""`Session`: the notebook API's engine, a few sequences on an `Engine` of their own."""

from __future__ import annotations

import math

import jax
import numpy as np

from ced_jax import cache as cache_lib
from ced_jax import sharding
from ced_jax.config import ModelConfig
from ced_jax.engine import Engine, SamplingBatch, StateShapes


class Session:
    """`batch` sequences advancing together (all start at position 0) on an `Engine` of `batch` slots
    with contiguous page tables: the same state, programs and sampler as the server."""

    def __init__(self, model, batch: int, max_len: int, *, with_draft: bool = False):
        """model: the `ced_jax.api.model.Model` whose loaded parameters and programs the engine runs (not
        annotated: that module makes sessions, so this one does not import it)."""
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
        self.engine = Engine(model.loaded, shapes, with_draft=with_draft)
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
