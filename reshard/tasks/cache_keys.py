"""Prefect cache keys for the shard tasks.

Prefect's default cache policy includes the run id, so nothing would be reused across runs.
Each key here is built from what decides the task's result — the shard's identity (URL +
ETag, or size + mtime), the options that affect the bytes, and the code version — and is only
handed out while the task's *artifact* still exists (the cached shard file, the staged or
committed output). When the artifact is gone the key function returns a fresh one, so the task
runs again instead of returning a path to nothing.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from reshard.storage.cache import RemoteObject, ShardCache
from reshard.tasks.identity import code_version, digest


def _miss(key: str) -> str:
    return f"{key}:stale:{uuid.uuid4().hex}"


def fetch_key(_ctx: Any, p: dict[str, Any]) -> str:
    obj = RemoteObject(**p["obj"])
    key = "fetch:" + digest(obj.identity, code_version())
    if p.get("is_local"):
        return key
    if not ShardCache(p["cache_dir"]).entry(obj).is_file():
        return _miss(key)
    return key


def check_key(_ctx: Any, p: dict[str, Any]) -> str:
    return "check:" + digest(p["identity"], p["module_key"], code_version())


def target_key(kind: str):
    """Key for convert/upload of one target rank: valid while its output exists somewhere
    (local staged file, remote staged object, or the committed checkpoint of this conversion)."""

    def key_fn(_ctx: Any, p: dict[str, Any]) -> str:
        from reshard.tasks.target_tasks import output_present

        job = p["job"]
        key = f"{kind}:" + digest(job["conversion_id"], job["destination"], p["name"])
        local_ok = kind == "convert"
        if output_present(job, p["name"], accept_local_file=local_ok):
            return key
        return _miss(key)

    return key_fn


def local_exists(path: str | Path) -> bool:
    return Path(path).is_file()
