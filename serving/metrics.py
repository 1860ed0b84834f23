"""Prometheus metrics of one server, in a registry of their own (several servers can share a process).

Definitions (the ones benchmark tools get wrong are spelled out):
- `ced_time_to_first_token_seconds`: request arrival (admission call) to the first token being handed
  to the stream, queue time included.
- `ced_time_per_output_token_seconds`: per finished request with >= 2 tokens,
  (time of last token - time of first token) / (tokens - 1). The first token is excluded, so TTFT
  never leaks into TPOT; requests with one token contribute nothing (not 0).
- `ced_queue_time_seconds`: arrival to getting a decode slot.
- `ced_prefix_cache_{hit,query}_tokens_total`: prompt tokens served from / looked up in the prefix
  cache; `ced_prefix_cache_hit_rate` is their ratio since start.
- `ced_compiles_after_warmup`: XLA compilations by engine calls after warm-up; must stay 0.
- DSpark speculative decoding (`--dspark K`): `ced_dspark_steps_total` counts decode steps that
  verified drafts (one per step, whatever its rows), `ced_dspark_draft_tokens_{proposed,accepted}_total`
  the drafts sent for verification / accepted, summed over rows. `ced_dspark_accepted_length` is a
  histogram of accepted drafts per row per speculative step; `ced_dspark_mean_accepted_length` their
  mean since start. `ced_decode_steps_per_output_token` (any K, 0 included): row-steps of decode /
  tokens those steps produced, since start (1 without DSpark; 1 / (1 + mean accepted) with it).
All updates come from the scheduler thread; prometheus_client is thread-safe for the HTTP reader.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_STEP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ced_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "ced_time_per_output_token_seconds",
            "Per request, (last token - first token) / (tokens - 1); excludes the first token.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "ced_queue_time_seconds", "Arrival to decode slot.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("ced_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active_slots = Gauge("ced_active_slots", "Decode slots holding a request.", registry=r)
        self.slots_total = Gauge("ced_slots_total", "Decode slots.", registry=r)
        self.pages_used = Gauge("ced_kv_pages_used", "KV pages referenced by running requests.", registry=r)
        self.pages_free = Gauge("ced_kv_pages_free", "KV pages on the free list.", registry=r)
        self.pages_cached = Gauge(
            "ced_kv_pages_cached", "Unreferenced KV pages kept by the prefix cache (evictable).", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "ced_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.prefix_query_tokens = Counter(
            "ced_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "ced_prefix_cache_hit_rate", "Hit tokens / queried tokens since start.", registry=r
        )
        self.compiles_after_warmup = Gauge(
            "ced_compiles_after_warmup", "XLA compilations by engine calls after warm-up.", registry=r
        )
        self.requests_finished = Counter(
            "ced_requests_finished", "Finished requests.", ["finish_reason"], registry=r
        )
        self.requests_rejected = Counter(
            "ced_requests_rejected", "Requests refused at admission.", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("ced_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.kv_tier_pages = Gauge(
            "ced_kv_tier_pages",
            "KV blocks held below the device (host, pending disk write, disk).",
            ["tier"],
            registry=r,
        )
        self.kv_tier_bytes = Gauge(
            "ced_kv_tier_bytes", "Bytes of the KV blocks per lower tier.", ["tier"], registry=r
        )
        self.kv_tier_hits = Counter(
            "ced_kv_tier_hits",
            "Prefix blocks restored to the device from a lower tier.",
            ["tier"],
            registry=r,
        )
        self.kv_disk_events = Counter(
            "ced_kv_disk_events",
            "KV disk tier files removed or not written, by cause (corrupt, refused: another model or "
            "format at start-up, stale_temp: a dead writer's, evicted, write_error).",
            ["event"],
            registry=r,
        )
        # Set by `WorkPools.export` (serving/work_pools.py): read from the pools when scraped.
        self.pool_jobs = Gauge(
            "ced_pool_jobs",
            "Jobs of the pools that work before the scheduler (prepare, image-fetch, tokenize), running "
            "or waiting for a thread.",
            ["pool", "state"],
            registry=r,
        )
        self.pool_refused = Counter(
            "ced_pool_refused",
            "Jobs refused because their tenant already had max_waiting jobs queued in the pool (429).",
            ["pool"],
            registry=r,
        )
        self.kv_tier_demotions = Counter(
            "ced_kv_tier_demotions", "Blocks the device prefix cache evicted into the host tier.", registry=r
        )
        self.kv_promotion_seconds = Histogram(
            "ced_kv_tier_promotion_seconds",
            "Reading one block from disk into host memory (read, checksum, insert).",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
            registry=r,
        )
        self.segment_yields = Counter(
            "ced_decode_segment_yields",
            "Times a decoding request gave up its slot to waiting requests (decode_segment_tokens).",
            registry=r,
        )
        self.overlap_dropped_rows = Counter(
            "ced_overlap_dropped_rows",
            "Rows of overlapped decode steps whose request had left its slot (a stop string, an abort, "
            "a deadline, a yield) by the time the step's tokens were taken; their results were dropped.",
            registry=r,
        )
        self.generation_tokens = Counter("ced_generation_tokens", "Sampled tokens.", registry=r)
        self.vit_runs = Counter("ced_vit_runs", "Images run through the ViT and aligner.", registry=r)
        self.image_feature_cache_hits = Counter(
            "ced_image_feature_cache_hits", "Images whose span rows came from the feature cache.", registry=r
        )
        self.image_feature_cache_misses = Counter(
            "ced_image_feature_cache_misses", "Images not in the feature cache (the ViT ran).", registry=r
        )
        self.image_feature_cache_bytes = Gauge(
            "ced_image_feature_cache_bytes", "Bytes of span rows held by the feature cache.", registry=r
        )
        self.images_per_request = Histogram(
            "ced_images_per_request",
            "Images in a request that has any.",
            buckets=(1, 2, 4, 8, 16, 32),
            registry=r,
        )
        self.dspark_steps = Counter(
            "ced_dspark_steps", "Decode steps that verified DSpark drafts.", registry=r
        )
        self.dspark_proposed = Counter(
            "ced_dspark_draft_tokens_proposed", "Draft tokens sent for verification (all rows).", registry=r
        )
        self.dspark_accepted = Counter(
            "ced_dspark_draft_tokens_accepted", "Draft tokens accepted by the target (all rows).", registry=r
        )
        self.dspark_accepted_length = Histogram(
            "ced_dspark_accepted_length",
            "Accepted drafts per row per speculative decode step.",
            buckets=(0, 1, 2, 3, 4, 5, 6, 8),
            registry=r,
        )
        self.dspark_mean_accepted_length = Gauge(
            "ced_dspark_mean_accepted_length",
            "Mean accepted drafts per row per speculative decode step, since start.",
            registry=r,
        )
        self.device_idle = Histogram(
            "ced_device_idle_between_steps_seconds",
            "From a scheduler step's last device result on the host to the next step's first dispatch, "
            "while there is work: the device's idle time between steps, seen from the host.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "ced_step_seconds",
            "A scheduler step's device time seen from the host: its first dispatch to its last result.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.decode_steps_per_output_token = Gauge(
            "ced_decode_steps_per_output_token",
            "Decode row-steps / tokens they produced, since start (1 without speculative decoding).",
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(finish_reason=reason)
        self._hit = 0
        self._query = 0
        self._spec_row_steps = 0
        self._spec_accepted = 0
        self._decode_row_steps = 0
        self._decode_tokens = 0

    def observe_step(self, idle_before_s: float | None, busy_s: float) -> None:
        """One scheduler step that ran work: the idle gap before it (None: the first after a pause)."""
        if idle_before_s is not None:
            self.device_idle.observe(idle_before_s)
        self.step_time.observe(busy_s)

    def observe_decode_step(self, emitted, n_drafts=None) -> None:
        """One decode step: the tokens each active row produced (`emitted`, ints >= 1), and for a
        speculative step the drafts each row verified (`n_drafts`, same order)."""
        self._decode_row_steps += len(emitted)
        self._decode_tokens += int(sum(emitted))
        if self._decode_tokens:
            self.decode_steps_per_output_token.set(self._decode_row_steps / self._decode_tokens)
        if n_drafts is None:
            return
        self.dspark_steps.inc()
        self.dspark_proposed.inc(int(sum(n_drafts)))
        for e in emitted:
            self.dspark_accepted.inc(int(e) - 1)
            self.dspark_accepted_length.observe(int(e) - 1)
            self._spec_accepted += int(e) - 1
        self._spec_row_steps += len(emitted)
        self.dspark_mean_accepted_length.set(self._spec_accepted / self._spec_row_steps)

    def observe_prefix(self, hit_tokens: int, query_tokens: int) -> None:
        self.prefix_hit_tokens.inc(hit_tokens)
        self.prefix_query_tokens.inc(query_tokens)
        self._hit += hit_tokens
        self._query += query_tokens
        self.prefix_hit_rate.set(self._hit / self._query if self._query else 0.0)


class MetricsServer:
    """The HTTP endpoint (`/metrics`) on a daemon thread."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0):
        self._httpd, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.port = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
