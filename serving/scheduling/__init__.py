"""Scheduling: the scheduler (`scheduler`: the request lifecycle and the step loop) and its parts:
request checks (`validation`), where an admitted request goes (`placement`), a step's prefill
chunks (`prefill`), the prefix cache and the host / disk KV tiers (`prefix`, `pages`, `kv_tiers`),
DSpark drafts (`speculation`) and the async event streams (`streams`)."""
