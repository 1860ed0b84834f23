"""The engines the scheduler drives: `protocol`, `jax_engine` and the multi-host `multihost`."""
