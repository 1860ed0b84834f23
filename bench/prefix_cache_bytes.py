"""Bytes per cached prompt token that a prefix-cache hit needs kept (issue 13, point 2).

    python bench/prefix_cache_bytes.py [--models tiny v41-flash] [--page-size 16] [--json]

A cached block is its device page (compressed KV and index keys: `kv_bytes_per_token` x page_size,
890 B/token for v41-flash) and the prefix cache's host entry (`serving.scheduling.pages.CacheEntry`: the
block's tokens, its key, its parent's key and its scope tag). Nothing else is kept: on a hit the
engine replays the last `replay_tokens` cached tokens to rebuild the SWA rings (spec 4.2, "encoder
SWA bounded replay"; the compressor's partial group is empty at a page boundary and the Engram
history is the tokens'). Before that, every block kept a host snapshot of the slot state (every
layer's SWA ring, the compressor partial groups, DSpark's context rings, the Engram history),
reported here as "before" for comparison.

For every model (a preset's config: nothing is loaded or allocated, the state's shapes come from
`jax.eval_shape`), per cached token:
- device: the page bytes (`ced_jax.cache.kv_bytes_per_token`, checked against
  `ced_jax.engine.page_io.PageLayout`, the host and disk tiers' blob);
- host entry: the arrays and keys of a real `PagePool` entry registered for one block (Python
  object headers not counted), divided by page_size;
- host tier / disk tier: what `serving.scheduling.kv_tiers` keeps for a demoted block (the blob plus its chain
  link; the disk file's fixed header too), divided by page_size;
- before: the snapshot's arrays per block, divided by page_size;
and the ratio of device + host entry to the device bytes (goal: <= 1.1), and the replay a hit costs
(`ced_jax.engine.replay_tokens`, with and without DSpark's context rings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ced_jax import cache as cache_lib  # noqa: E402
from ced_jax.config import preset  # noqa: E402
from ced_jax.engine import replay_tokens  # noqa: E402
from ced_jax.engine.page_io import PageLayout  # noqa: E402
from serving.scheduling import kv_tiers  # noqa: E402
from serving.scheduling.pages import ROOT_KEY, PagePool  # noqa: E402

ENGRAM_HISTORY_BYTES = 8  # int64 per history slot (`ced_jax.engram_hash`)


def _entry_bytes(page_size: int) -> int:
    """The arrays and keys of a prefix-cache entry for one block, measured on a real `PagePool`."""
    pool = PagePool(1, page_size)
    (page,) = pool.allocate(1)
    key = pool.register(ROOT_KEY, np.arange(page_size, dtype=np.int32), page)
    e = pool.entry(key)
    return e.tokens.nbytes + len(e.key) + len(e.parent) + len(e.scope) + len(e.extra)


def measure(name: str, page_size: int) -> dict:
    cfg = preset(name)
    dspark = bool(cfg.num_nextn_predict_layers)
    state = jax.eval_shape(
        lambda: cache_lib.init_paged_cache(
            cfg, max_slots=1, page_size=page_size, num_pages=1,
            draft_stages=cfg.num_nextn_predict_layers if dspark else 0,
        )
    )  # fmt: skip
    device = cache_lib.kv_bytes_per_token(state)
    layout = PageLayout.for_config(cfg, page_size)
    assert layout.page_bytes == device * page_size, (layout.page_bytes, device)
    entry = _entry_bytes(page_size)
    link = 3 * 16 + page_size * 4  # key, parent, scope tag, tokens (the tiers' BlockMeta)
    disk_header = kv_tiers._PREFIX + kv_tiers._FIXED.size  # magic, checksum, fixed fields
    plain = cache_lib.buffer_bytes((state.window, state.state_kv, state.state_score))
    rings = cache_lib.buffer_bytes(state.draft_window)
    ngram = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
    before = plain + ngram * ENGRAM_HISTORY_BYTES
    return {
        "model": name,
        "page_size": page_size,
        "device_kv_bytes_per_token": device,
        "host_entry_bytes_per_token": entry / page_size,
        "host_tier_bytes_per_token": (layout.page_bytes + link) / page_size,
        "disk_tier_bytes_per_token": (layout.page_bytes + link + disk_header) / page_size,
        "kept_over_device": (device + entry / page_size) / device,
        "before_snapshot_bytes_per_token": before / page_size,
        "before_snapshot_with_dspark_bytes_per_token": (before + rings) / page_size,
        "replay_tokens": replay_tokens(cfg, page_size),
        "replay_tokens_dspark": replay_tokens(cfg, page_size, with_draft=True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "v41-flash"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="print one JSON object per model")
    args = ap.parse_args(argv)
    for name in args.models:
        r = measure(name, args.page_size)
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{name} (page {r['page_size']}):")
        print(f"  device KV (pages)            {r['device_kv_bytes_per_token']:10.2f} B/token")
        print(f"  host prefix-cache entry      {r['host_entry_bytes_per_token']:10.2f} B/token")
        print(f"  kept in all / device KV      {r['kept_over_device']:10.4f} x  (goal <= 1.1)")
        print(f"  host tier (demoted block)    {r['host_tier_bytes_per_token']:10.2f} B/token")
        print(f"  disk tier (file)             {r['disk_tier_bytes_per_token']:10.2f} B/token")
        print(f"  before: host snapshot        {r['before_snapshot_bytes_per_token']:10.2f} B/token"
              f" ({r['before_snapshot_with_dspark_bytes_per_token']:.2f} with DSpark rings)")  # fmt: skip
        print(f"  replay per hit               {r['replay_tokens']:10d} tokens"
              f" ({r['replay_tokens_dspark']} with DSpark)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
