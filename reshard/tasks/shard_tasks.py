"""Per-source-shard tasks: discover, fetch (to the shard cache), sanity-check.

Tasks exchange URLs, paths and small dict records — never tensors (Prefect pickles results).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from reshard.core.options import ReshardOptions
from reshard.crashpoints import crash_point
from reshard.discovery import attach_streamed, discover, fetch
from reshard.formats import ObjectClass, check_file
from reshard.storage.cache import RemoteObject, ShardCache, is_skeleton
from reshard.storage.location import open_location
from reshard.tasks.cache_keys import check_key, fetch_key
from reshard.tasks.retry import retry_if_transient

TRANSIENT_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=1),
                         retry_jitter_factor=0.5, retry_condition_fn=retry_if_transient)


@task(name="discover-shards", **TRANSIENT_RETRIES)
def discover_shards(source: str, storage_options: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """List the source's model-state objects (and what ``options`` need besides) with size and ETag
    (never cached: this *is* the freshness check that every other cache key depends on)."""
    return discover(source, storage_options, ReshardOptions.from_fields(options)).to_record()


@task(name="fetch-shard", cache_key_fn=fetch_key, persist_result=True, **TRANSIENT_RETRIES)
def fetch_shard(source: str, obj: dict[str, Any], kind: dict[str, Any], storage_options: dict[str, Any],
                cache_dir: str, is_local: bool, markers: dict[str, str] | None = None, stream: bool = False) -> str:
    """Local path of one shard (cache entry, verified size/MD5; in place for local files). With
    the checkpoint's fetched ``markers`` (name -> path), only the byte ranges the conversion reads
    (``kind``: the object's class from discovery);
    ``stream``: of a weight file, only its structure (the rest is read while converting)."""
    loc = open_location(source, storage_options)
    cache = None if is_local else ShardCache(cache_dir)
    found = {name: Path(p) for name, p in (markers or {}).items()}
    path = str(fetch(loc, RemoteObject(**obj), ObjectClass.from_record(kind), cache, found, stream=stream))
    crash_point("fetched")
    return path


@task(name="check-shard", cache_key_fn=check_key, persist_result=True)
def check_shard(path: str, identity: str, module_key: str, url: str, fmt: str | None, role: str,
                refetch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-shard check by the file's checker and role (see ``reshard.formats.ObjectClass``), on every
    fetched shard, local or remote. Cross-shard consistency is checked in the plan step.
    ``refetch`` (``fetch-shard``'s source, obj, kind, storage_options and cache_dir): where ``path`` is
    not on this machine (fetched by a worker on another), the shard is fetched here the same way."""
    if refetch is not None:
        loc, obj = open_location(refetch["source"], refetch["storage_options"]), RemoteObject(**refetch["obj"])
        if not Path(path).is_file():
            path = str(fetch(loc, obj, ObjectClass.from_record(refetch["kind"]), ShardCache(refetch["cache_dir"]), {},
                             stream=is_skeleton(path)))
        attach_streamed(Path(path), Path(path), loc, obj)  # a stand-in: its structure is read from the source
    return dict(check_file(path, fmt, role, module_key, url), path=path, role=role)
