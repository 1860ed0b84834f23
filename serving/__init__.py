"""Serving for ced-jax: a host-side scheduler driving a static-shape device engine, over gRPC and HTTP.

Layout (request flow top to bottom; docs/architecture.md has the layer table):
- `server.py`: lifecycle (ports, gRPC + HTTP + metrics, graceful shutdown); `grpc_service.py`: the
  grpc.aio servicer; `http/`: the HTTP APIs; `proto/`: the public ced.v1 API (stubs generated on import).
- `requests.py`: a request and its stream events; `scheduling/`: the scheduler (admission,
  continuous batching, chunked prefill, stop handling, on its own thread), request checks, event
  streams, the page allocator and prefix cache, the host / disk KV tiers.
- `engine/`: the interface a device engine implements (`protocol.py`), `jax_engine.py` over
  `ced_jax.engine`, the multi-host hand-over (`multihost.py`); `testing/`: a hand-computable mock engine.
- `config.py`: ServeConfig, the one declaration of serving shapes and limits with their defaults and
  flags (`ced-jax serve`'s parser is generated from it).
- `planning/`: the `ced-jax plan` memory planner and the compiled proof; `client.py`: the Python
  client and `ced-jax client`; `work_pools.py`: the bounded pools before the scheduler.
"""
