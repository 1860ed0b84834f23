"""The scheduler (`scheduler`) and its parts: checks, placement, prefill, pages and KV tiers, drafts."""
