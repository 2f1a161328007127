"""Prefect tasks wrapping the core engine (one per shard / target rank)."""
