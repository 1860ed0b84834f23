"""Host-side Engram n-gram hashing (DeepSeek-V4.1, spec section 4.4).

Engram layers add rows of large embedding tables chosen by hashing the last few tokens. The hash is
integer work on token ids only, so it runs here in numpy, ahead of the device step; the device then
only gathers the rows this module names.

Conventions
-----------
* Token ids go through a *compressed token map* first: token ids whose decoded text normalises to the
  same string share one compressed id (see `build_token_map`).
* `K = cfg.engram_max_ngram_size`. The hash at position p looks at the compressed ids at p, p-1, ...,
  p-(K-1) ("shift" s = 0..K-1). Look-back stops at the sequence start and at DEAD (image-span)
  tokens: from the first blocked shift on, every larger shift is blocked too, and blocked slots hold
  `pad_id`, the compressed id of token `cfg.engram_pad_token_id`.
* Per engram layer there are K-1 n-gram sizes (2..K) times `cfg.engram_n_heads` heads; each pair has
  its own prime modulus and its own slice of the layer's table. The output columns of one position and
  layer are ordered n-gram-size-major, then head: column `(n - 2) * n_heads + h`.
* History: serving hashes a sequence in chunks (prefill chunks, then one token per decode step). The
  state carried between chunks is the compressed ids of the last K-1 positions, oldest first, with
  `NO_HISTORY` (-2) for positions before the sequence start and `DEAD` (-1) for image tokens.
* All hash arithmetic is int64 with numpy's wrap-around on overflow, as in the reference; table rows
  fit int32, which is what the device gathers with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ced_jax.config import ModelConfig

NO_HISTORY = -2  # history slot before the sequence start
DEAD = -1  # history slot holding an image-span token; look-back stops there

# Any 64-bit n is decided exactly by Miller-Rabin with these bases (they cover n < 3.3e24).
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
# The reference seeds each layer's multiplier generator with this constant times the layer id.
_MULTIPLIER_SEED_FACTOR = 10007


class EngramConfigError(ValueError):
    """The config and the token map (or tokenizer) disagree about the Engram tables."""


# ---------------------------------------------------------------------- primes
def is_prime(n: int) -> bool:
    """Deterministic primality test for 0 <= n < 2**64 (Miller-Rabin with fixed bases)."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    odd_part, twos = n - 1, 0
    while odd_part % 2 == 0:
        odd_part //= 2
        twos += 1
    for base in _MILLER_RABIN_BASES:
        x = pow(base, odd_part, n)
        if x in (1, n - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> np.ndarray:
    """Prime moduli, int64 [n_engram_layers, K-1, n_heads].

    Drawn in order layer -> n-gram size -> head as the next prime above the search point that no
    earlier (layer, n-gram size, head) took. The search point restarts at `engram_vocab_size - 1` for
    every (layer, n-gram size), so later layers re-scan the same range and skip the primes in use.
    """
    n_sizes = cfg.engram_max_ngram_size - 1
    primes = np.zeros((len(cfg.engram_layer_ids), n_sizes, cfg.engram_n_heads), dtype=np.int64)
    used: set[int] = set()
    for layer_idx in range(len(cfg.engram_layer_ids)):
        for size_idx in range(n_sizes):
            current = cfg.engram_vocab_size - 1
            for head in range(cfg.engram_n_heads):
                candidate = current + 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                primes[layer_idx, size_idx, head] = candidate
                current = candidate
    return primes


# ---------------------------------------------------------------------- compressed token map
def _text_normalizer():
    # Imported here so that hashing from a precomputed map does not need the tokenizers package.
    from tokenizers import Regex, normalizers

    lone_space_sentinel = "\ue000"  # private-use char; keeps a token that is just whitespace from Strip
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), lone_space_sentinel),
            normalizers.Strip(),
            normalizers.Replace(lone_space_sentinel, " "),
        ]
    )


def build_token_map(tokenizer_json_path: str | Path) -> np.ndarray:
    """Compressed id of every token id of a `tokenizers` tokenizer.json, int64 [vocab].

    Each id is decoded on its own and the text normalised (NFKC, accents stripped, lower case,
    whitespace runs collapsed, stripped, a lone space kept). Ids whose decoded text holds U+FFFD are
    partial UTF-8 sequences; normalising them would merge unrelated byte fragments, so they are keyed
    by their raw token string instead. Compressed ids are numbered by first appearance of each key.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json_path))
    normalizer = _text_normalizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    token_map = np.empty(vocab, dtype=np.int64)
    for token_id in range(vocab):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return token_map


def load_token_map_file(path: str | Path) -> np.ndarray:
    """Read a precomputed map: JSON {"compressed_vocab_size": N, "token_map": [...]} -> int64 [vocab]."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict) or "token_map" not in raw or "compressed_vocab_size" not in raw:
        raise EngramConfigError(f"{path}: expected an object with 'compressed_vocab_size' and 'token_map'")
    token_map = np.asarray(raw["token_map"], dtype=np.int64)
    if token_map.ndim != 1 or token_map.size == 0:
        raise EngramConfigError(f"{path}: 'token_map' must be a non-empty list of integers")
    distinct = int(token_map.max()) + 1
    if token_map.min() < 0 or distinct != raw["compressed_vocab_size"]:
        raise EngramConfigError(
            f"{path}: 'token_map' ids must lie in [0, compressed_vocab_size) and reach its top; "
            f"compressed_vocab_size={raw['compressed_vocab_size']}, "
            f"ids span {token_map.min()}..{distinct - 1}"
        )
    return token_map


# ---------------------------------------------------------------------- hasher
class EngramHasher:
    """Table row ids for every Engram layer, from raw token ids.

    Attributes (all numpy):
      token_map   int64 [vocab]: raw token id -> compressed id.
      pad_id      int: compressed id used for blocked look-back slots.
      primes      int64 [n_layers, K-1, n_heads]: modulus per (layer, n-gram size, head).
      offsets     int64 [n_layers, (K-1)*n_heads]: first table row of each (n-gram size, head) slice.
      multipliers int64 [n_layers, K]: odd multiplier per (layer, shift).
    """

    def __init__(self, cfg: ModelConfig, token_map: np.ndarray):
        token_map = np.asarray(token_map, dtype=np.int64)
        if token_map.ndim != 1:
            raise EngramConfigError(f"token_map must be 1-D, got shape {token_map.shape}")
        if len(token_map) > cfg.vocab_size:
            raise EngramConfigError(
                f"token map covers {len(token_map)} token ids, "
                f"more than the model's vocab_size {cfg.vocab_size}"
            )
        compressed_vocab = int(token_map.max()) + 1
        if compressed_vocab != cfg.engram_compressed_vocab_size:
            # The multipliers are derived from this number, so a mismatch silently changes every hash.
            raise EngramConfigError(
                f"the tokenizer compresses to {compressed_vocab} ids but config.engram_compressed_vocab_size "
                f"is {cfg.engram_compressed_vocab_size}"
            )
        if not 0 <= cfg.engram_pad_token_id < len(token_map):
            raise EngramConfigError(f"engram_pad_token_id {cfg.engram_pad_token_id} is outside the token map")
        if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
            raise EngramConfigError("engram_num_embeddings needs one entry per engram layer")

        self.n_layers = len(cfg.engram_layer_ids)
        self.max_ngram_size = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.hash_cols = (self.max_ngram_size - 1) * self.n_heads
        self.token_map = token_map
        self.compressed_vocab_size = compressed_vocab
        self.pad_id = int(token_map[cfg.engram_pad_token_id])

        self.primes = engram_primes(cfg)
        flat_primes = self.primes.reshape(self.n_layers, self.hash_cols)
        for layer_id, row_primes, rows in zip(
            cfg.engram_layer_ids, flat_primes, cfg.engram_num_embeddings, strict=True
        ):
            # The layer's table is the concatenation of one slice per prime, so the sizes must agree.
            if int(row_primes.sum()) != rows:
                raise EngramConfigError(
                    f"engram layer {layer_id}: its {self.hash_cols} primes sum to {int(row_primes.sum())}, "
                    f"but engram_num_embeddings says {rows} rows"
                )
        if max(cfg.engram_num_embeddings) > np.iinfo(np.int32).max:
            raise EngramConfigError("engram tables have more rows than int32 row ids can address")
        self.offsets = np.cumsum(flat_primes, axis=1) - flat_primes

        # Bound keeps id * multiplier for any compressed id within int64 (before the XOR mixing).
        bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
        self.multipliers = np.stack(
            [
                np.random.default_rng(_MULTIPLIER_SEED_FACTOR * layer_id).integers(
                    low=0, high=bound, size=self.max_ngram_size, dtype=np.int64
                )
                * 2
                + 1
                for layer_id in cfg.engram_layer_ids
            ]
        )

    @classmethod
    def from_tokenizer_file(cls, cfg: ModelConfig, tokenizer_json_path: str | Path) -> EngramHasher:
        """Build the compressed token map from a tokenizer.json (about a second per 100k ids)."""
        return cls(cfg, build_token_map(tokenizer_json_path))

    @classmethod
    def from_token_map_file(cls, cfg: ModelConfig, path: str | Path) -> EngramHasher:
        """Use a precomputed map file ({"compressed_vocab_size": N, "token_map": [...]})."""
        return cls(cfg, load_token_map_file(path))

    # ------------------------------------------------------------------ state
    def empty_history(self, batch: int) -> np.ndarray:
        """History for sequences that start at position 0: int64 [batch, K-1] of NO_HISTORY."""
        return np.full((batch, self.max_ngram_size - 1), NO_HISTORY, dtype=np.int64)

    def next_history(
        self, history: np.ndarray, tokens: np.ndarray, lens: np.ndarray, dead: np.ndarray | None = None
    ) -> np.ndarray:
        """History after appending the first lens[b] tokens of row b of `tokens` (the rest is padding).

        history: int [B, K-1]; tokens: int [B, T] raw ids; lens: int [B] in [0, T]; dead: bool [B, T].
        Returns int64 [B, K-1].
        """
        history, chunk = self._sequence_ids(history, tokens, dead)
        lens = np.asarray(lens)
        batch, width = chunk.shape
        if lens.shape != (batch,) or not np.issubdtype(lens.dtype, np.integer):
            raise ValueError(
                f"lens must be an integer array of shape ({batch},), got {lens.dtype} {lens.shape}"
            )
        if np.any(lens < 0) or np.any(lens > width):
            raise ValueError(f"lens must lie in [0, {width}], got {lens.tolist()}")
        keep = self.max_ngram_size - 1
        joined = np.concatenate([history, chunk], axis=1)
        # Row b's newest valid entry sits at column keep + lens[b] - 1 of `joined`.
        cols = lens[:, None] + np.arange(keep)[None, :]
        return np.take_along_axis(joined, cols, axis=1)

    # ------------------------------------------------------------------ hashing
    def hash_ids(self, history: np.ndarray, tokens: np.ndarray, dead: np.ndarray | None = None) -> np.ndarray:
        """Table row ids for each token of a chunk.

        history: int [B, K-1] compressed ids of the K-1 positions before the chunk, oldest first
                 (`empty_history` at the sequence start; `next_history` afterwards).
        tokens:  int [B, T] raw token ids.
        dead:    optional bool [B, T], True for image-span tokens.
        Returns int32 [B, T, n_layers, (K-1)*n_heads], rows into each layer's table.
        """
        history, chunk = self._sequence_ids(history, tokens, dead)
        batch, width = chunk.shape
        k = self.max_ngram_size
        joined = np.concatenate([history, chunk], axis=1)
        # window[:, t, s] is the id at shift s back from chunk position t.
        window = np.stack([joined[:, k - 1 - s : k - 1 - s + width] for s in range(k)], axis=-1)
        blocked = np.logical_or.accumulate(window < 0, axis=-1)
        window = np.where(blocked, self.pad_id, window)

        # [B, T, 1, K] * [L, K] -> [B, T, L, K]. The multiplier bound keeps these products inside int64,
        # so they (and their XORs) are non-negative; numpy int64 semantics are the reference's anyway.
        products = window[:, :, None, :] * self.multipliers
        rolling = np.bitwise_xor.accumulate(products, axis=-1)[..., 1:]  # n-gram sizes 2..K
        rows = np.mod(rolling[..., None], self.primes) + self.offsets.reshape(self.primes.shape)
        return rows.reshape(batch, width, self.n_layers, self.hash_cols).astype(np.int32)

    def _sequence_ids(
        self, history: np.ndarray, tokens: np.ndarray, dead: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validate the inputs; return (history int64 [B, K-1], chunk compressed ids int64 [B, T])."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype} {tokens.shape}")
        batch = tokens.shape[0]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= len(self.token_map)):
            raise ValueError(
                f"tokens holds ids outside [0, {len(self.token_map)}): min {tokens.min()}, max {tokens.max()}"
            )
        history = np.asarray(history)
        keep = self.max_ngram_size - 1
        if history.shape != (batch, keep) or not np.issubdtype(history.dtype, np.integer):
            raise ValueError(
                f"history must be an integer array of shape ({batch}, {keep}), "
                f"got {history.dtype} {history.shape}"
            )
        if history.size and (history.min() < NO_HISTORY or history.max() >= self.compressed_vocab_size):
            raise ValueError(
                f"history holds values outside [{NO_HISTORY}, compressed vocab): "
                f"min {history.min()}, max {history.max()}"
            )
        chunk = self.token_map[tokens]
        if dead is not None:
            dead = np.asarray(dead)
            if dead.shape != tokens.shape or dead.dtype != np.bool_:
                raise ValueError(
                    f"dead must be a bool array of shape {tokens.shape}, got {dead.dtype} {dead.shape}"
                )
            chunk = np.where(dead, DEAD, chunk)
        return history.astype(np.int64), chunk
