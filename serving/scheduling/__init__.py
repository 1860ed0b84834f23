"""Scheduling: the scheduler (`scheduler`), page accounting (`pages`) and the host / disk KV tiers
(`kv_tiers`)."""
