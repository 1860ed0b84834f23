"""The engines the scheduler drives: the protocol (`protocol`), the JAX implementation (`jax_engine`)
and the multi-host proxy (`multihost`)."""
