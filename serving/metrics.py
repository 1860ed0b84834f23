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
All updates come from the scheduler thread; prometheus_client is thread-safe for the HTTP reader.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
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
            "ced_images_per_request", "Images in a request that has any.", buckets=(1, 2, 4, 8, 16, 32), registry=r
        )
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(finish_reason=reason)
        self._hit = 0
        self._query = 0

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
