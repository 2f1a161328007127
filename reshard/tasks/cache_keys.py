"""Prefect cache keys for the shard tasks.

Prefect's default cache policy includes the run id, so nothing would be reused across runs.
Each key here is built from what decides the task's result — the shard's identity (URL +
ETag, or size + mtime), the options that affect the bytes, and the code version.

A cached result is only reused while the task's *artifact* still exists (the cached shard
file, the staged or committed output): the flow checks that before submitting and forces a
refresh (``refresh_cache=True``) when it is gone, so a task never returns a path to nothing.
"""

from __future__ import annotations

from typing import Any

from reshard.storage.cache import RemoteObject
from reshard.tasks.identity import code_version, digest


def fetch_key(_ctx: Any, p: dict[str, Any]) -> str:
    return "fetch:" + digest(RemoteObject(**p["obj"]).identity, bool(p.get("stream")), code_version())


def check_key(_ctx: Any, p: dict[str, Any]) -> str:
    return "check:" + digest(p["identity"], p["module_key"], p["fmt"], p["role"], code_version())


def target_key(kind: str):
    """Key for convert/upload of one target rank of one conversion at one destination."""

    def key_fn(_ctx: Any, p: dict[str, Any]) -> str:
        job = p["job"]
        return f"{kind}:" + digest(job["conversion_id"], job["destination"], p["name"])

    return key_fn
