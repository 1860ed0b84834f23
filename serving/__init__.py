"""gRPC serving for ced-jax: a host-side scheduler driving a static-shape device engine.

Layout (request flow top to bottom):
- `proto/`: the public ced.v1 API (`ced.proto`; stubs generated on import, never committed).
- `server.py`: grpc.aio servicer, health, reflection, graceful shutdown; proto <-> scheduler only.
- `scheduler.py`: admission, continuous batching, chunked prefill, stop handling, on its own thread.
- `pages.py`: page allocator and prefix cache; `text.py`: detokenization and stop strings.
- `engine_api.py`: the interface a device engine implements (sampling: `ced_jax.sampling`, shared with the library).
- `mock_engine.py`: a hand-computable engine for tests; `metrics.py`: Prometheus metrics.
- `config.py`: ServeConfig, the one declaration of serving shapes and limits with their defaults
  (`jax_engine.JaxEngine` is built from it, `ced-jax serve` takes its flag defaults from it).
- `capacity.py`: the `ced-jax plan` memory planner (KV sized from `jax.eval_shape` of the engine's state).
- `client.py`: Python client and the `ced-jax client` command.
- `work_pools.py`: the bounded pools of the work before the scheduler, shared fairly between tenants.
"""
