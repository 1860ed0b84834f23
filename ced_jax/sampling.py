"""Token sampling as pure JAX functions over a batch of rows with per-row parameters.

Invariants (what makes serving reproducible):
- Row independence: every operation is row-wise (sort, cumsum, categorical with a per-row key), so a
  row's result depends only on that row's logits and parameters, not on the other rows of the batch.
- Seeded by position: the key for the token placed at absolute position `p` is
  `fold_in(PRNGKey(seed), p)`. A request sampled alone, among 31 others, or after a prefix-cache hit
  draws the same random numbers for the same positions.
- Parameters are arrays, never static arguments, so greedy and sampled rows share one compiled program
  (a static `return_logprobs`-style flag is a classic cause of recompiles after warm-up). The only
  static argument is `num_logprobs`, fixed per engine.

Semantics, in order: the token mask (constrained decoding, `apply_token_bitmask`), temperature
scaling, then top-k, then top-p on the scaled distribution, then a categorical draw. temperature == 0
is greedy (argmax of the masked logits, lowest id on ties) and ignores top-k/top-p. The mask is an
array too: an unconstrained row is all ones, which leaves its logits bit for bit as they were, so
constrained and unconstrained rows share one program and give the same tokens as without masks.
Ties at the top-k/top-p threshold are all kept (deterministic, and at most a few extra candidates).
Returned log-probabilities are those of the raw model distribution (log_softmax of the logits, before
the mask, temperature and filtering), as OpenAI-style APIs report them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf.

    logits: f32[B, V]; temperature, top_p: f32[B]; top_k: i32[B] (0 or >= V = off).
    Rows with temperature 0 are returned unscaled (they are sampled greedily).
    """
    vocab = logits.shape[-1]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits.astype(jnp.float32) / safe_t[:, None]  # [B, V]
    desc = -jnp.sort(-scaled, axis=-1)  # [B, V], largest first
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)  # [B]
    idx = jnp.arange(vocab)[None, :]
    in_k = idx < k[:, None]  # [B, V] over sorted positions
    # Nucleus over the top-k survivors: keep a sorted position when the mass strictly before it is
    # < top_p, so the most likely token is always kept.
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # [B]
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits with the tokens a packed mask forbids set to -inf.

    logits: f32[B, V]; bitmask: i32[B, W], W = ceil(V / 32): bit j of word w set <=> token 32 w + j
    allowed (the llguidance / xgrammar layout); an all-ones row (-1 words) allows everything.
    """
    rows, vocab = logits.shape
    # Arithmetic shift then & 1 reads bit j of each word, the sign bit included.
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] == 1  # [B, V]
    return jnp.where(allowed, logits, -jnp.inf)


def mask_words(vocab_size: int) -> int:
    """W, the int32 words of one mask row for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32)


def row_keys(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """uint32[B, 2] keys: fold_in(PRNGKey(seed), position) per row."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, positions)


def sample(
    logits: jax.Array,
    positions: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
    token_bitmask: jax.Array | None = None,
    *,
    num_logprobs: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Samples one token per row.

    logits: f32[B, V]; positions: i32[B], the absolute position each sampled token will occupy;
    temperature, top_p: f32[B]; top_k: i32[B]; seed: u32[B]; token_bitmask: i32[B, W] or None (no mask).
    Returns (token i32[B], logprob f32[B], top_ids i32[B, N], top_logprobs f32[B, N]), N = num_logprobs.
    """
    logits = logits.astype(jnp.float32)
    masked = logits if token_bitmask is None else apply_token_bitmask(logits, token_bitmask)
    filtered = filter_logits(masked, temperature, top_p, top_k)
    keys = row_keys(seed.astype(jnp.uint32), positions.astype(jnp.uint32))
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)  # [B]
    greedy = jnp.argmax(masked, axis=-1)
    token = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)  # [B, V], of the raw logits (unmasked)
    token_logp = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    if num_logprobs > 0:
        top_logp, top_ids = jax.lax.top_k(logp, num_logprobs)
    else:
        top_logp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return token, token_logp, top_ids.astype(jnp.int32), top_logp


@functools.cache
def jitted_sample(num_logprobs: int):
    """A jitted `sample` for one `num_logprobs` (one cache entry per shape of logits)."""
    return jax.jit(functools.partial(sample, num_logprobs=num_logprobs))


# --------------------------------------------------------------------- speculative decoding
# Random streams: the target's draw for position p uses row_keys(seed, p) (as `sample`); the draft's
# draw and the acceptance test for the draft at position p fold these constants into that key, so
# the three never share random numbers.
DRAFT_STREAM = 1
ACCEPT_STREAM = 2


def stream_keys(seed: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """uint32[B, 2]: fold_in(row_keys(seed, positions), stream)."""
    return jax.vmap(lambda k: jax.random.fold_in(k, stream))(row_keys(seed, positions))


def draft_token(
    logits: jax.Array,
    positions: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One drafted token per row from the draft's logits f32[B, V] for `positions` [B]: greedy rows
    take the argmax, sampled rows draw from the draft's own filtered distribution q (same temperature,
    top-k, top-p as the target). Returns (token i32[B], q's filtered logits f32[B, V])."""
    filtered = filter_logits(logits.astype(jnp.float32), temperature, top_p, top_k)
    keys = stream_keys(seed.astype(jnp.uint32), positions.astype(jnp.uint32), DRAFT_STREAM)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    token = jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1))
    return token.astype(jnp.int32), filtered


def speculative_sample(
    target_logits: jax.Array,
    draft_filtered: jax.Array,
    drafts: jax.Array,
    n_drafts: jax.Array,
    start: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
    token_bitmask: jax.Array | None,
    *,
    num_logprobs: int,
):
    """Verify drafted tokens against the target and sample what follows them.

    target_logits f32[B, T, V]: the target's logits after the input token (index 0) and after each
    draft (index j, j = 1..T-1), the chunk starting at position start [B], so index j's token lands
    at start + j + 1; drafts i32[B, T-1] (draft j at position start + j + 1), n_drafts i32[B] how
    many are real; draft_filtered f32[B, T-1, V] the draft's filtered logits each draft was drawn
    from (`draft_token`); token_bitmask i32[B, T, W] or None: mask j for the token at index j.

    Greedy rows (temperature 0) accept draft j while it equals the masked target argmax, then take the
    masked argmax at the first mismatch: exactly the tokens greedy decoding gives. Sampled rows use
    rejection sampling (Leviathan et al.; Chen et al.): accept draft j with probability
    min(1, p_j(d) / q_j(d)), p the target's filtered masked distribution and q the draft's; at the
    first rejection draw from normalise(max(p - q, 0)), and after n accepted drafts from p. The emitted
    tokens then follow the target's sampling distribution whatever the draft does.
    Returns (accepted i32[B] in 0..n_drafts, tokens i32[B, T] (row b emits tokens[b, :accepted + 1]),
    logprob f32[B, T], top_ids i32[B, T, N], top_logprobs f32[B, T, N]): log-probabilities of the
    raw target distribution, as `sample` reports them."""
    b, t, vocab = target_logits.shape
    logits = target_logits.astype(jnp.float32)
    flat = logits.reshape(b * t, vocab)
    masked = flat if token_bitmask is None else apply_token_bitmask(flat, token_bitmask.reshape(b * t, -1))
    rep = lambda a: jnp.repeat(a, t)
    p_filtered = filter_logits(masked, rep(temperature), rep(top_p), rep(top_k))
    p = jax.nn.softmax(p_filtered, axis=-1).reshape(b, t, vocab)
    greedy = jnp.argmax(masked, axis=-1).reshape(b, t).astype(jnp.int32)
    positions = start[:, None] + 1 + jnp.arange(t)[None, :]  # where index j's token lands
    seed = seed.astype(jnp.uint32)

    # Acceptance of draft j (at index j's position).
    q = jax.nn.softmax(draft_filtered, axis=-1)  # [B, T-1, V]
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    accept_keys = stream_keys(
        jnp.repeat(seed, t - 1), positions[:, :-1].reshape(-1).astype(jnp.uint32), ACCEPT_STREAM
    )
    u = jax.vmap(jax.random.uniform)(accept_keys).reshape(b, t - 1)
    sampled_ok = u * q_d < p_d  # u < p/q without dividing (q_d > 0: the draft drew d from q)
    greedy_ok = drafts == greedy[:, :-1]
    ok = jnp.where((temperature > 0)[:, None], sampled_ok, greedy_ok)
    ok = ok & (jnp.arange(t - 1)[None, :] < n_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    # The token after the accepted drafts: the residual distribution after a rejection, p otherwise.
    p_last = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, vocab), q.dtype)], axis=1)
    rejected = accepted < n_drafts
    q_last = jnp.where(
        rejected[:, None], jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0], 0.0
    )
    residual = jnp.maximum(p_last - q_last, 0.0)
    # p == q exactly leaves nothing: then p itself (a rejection is impossible there anyway).
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_last)
    last_pos = jnp.take_along_axis(positions, accepted[:, None], axis=1)[:, 0]
    drawn = jax.vmap(jax.random.categorical)(row_keys(seed, last_pos.astype(jnp.uint32)), jnp.log(residual))
    last_greedy = jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]
    last = jnp.where(temperature > 0, drawn, last_greedy).astype(jnp.int32)

    drafts_pad = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    idx = jnp.arange(t)[None, :]
    tokens = jnp.where(
        idx < accepted[:, None], drafts_pad, jnp.where(idx == accepted[:, None], last[:, None], 0)
    )
    tokens = tokens.astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V] raw
    token_logp = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    if num_logprobs > 0:
        top_logp, top_ids = jax.lax.top_k(logp, num_logprobs)
    else:
        top_logp = jnp.zeros((b, t, 0), jnp.float32)
        top_ids = jnp.zeros((b, t, 0), jnp.int32)
    return accepted, tokens, token_logp, top_ids.astype(jnp.int32), top_logp
