"""Pure tensor math and checkpoint semantics (no fsspec, no Prefect)."""
