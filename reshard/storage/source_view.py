"""Make a checkpoint at any URL readable by the (local-path) core.

Local sources are used in place — never copied, never written. Remote sources are listed,
their model-state files fetched through the :class:`~reshard.storage.cache.ShardCache`, and
hard-linked into a private work folder that mirrors the remote names, so ``core.source.locate``
sees the same folder structure it would see locally. Optimizer shards (``zero_pp_rank_*``)
are never fetched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.core.errors import StorageError
from reshard.storage.cache import RemoteObject, ShardCache
from reshard.storage.location import Location, open_location, storage_errors

#: Files of a checkpoint folder that hold model weights or describe them.
MODEL_FILE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in (
    r"(^|/)mp_rank_\d+(_\d+)?_model_states\.pt$",
    r"(^|/)layer_\d+-model_\d+-model_states\.pt$",
    r"(^|/)mp_rank_\d+(_\d+)?/model_optim_rng\.pt$",
    r"(^|/)[^/]+\.json$",
    r"(^|/)latest(_checkpointed_iteration\.txt)?$",
))
LATEST_ITER_FILE = "latest_checkpointed_iteration.txt"


@dataclass
class LocalSource:
    """A source made local: pass ``path`` to ``core.source.locate``."""

    url: str
    path: Path
    objects: list[RemoteObject] = field(default_factory=list)
    fetched: int = 0
    cached: int = 0


def _etag(info: Mapping[str, Any]) -> str | None:
    for k in ("ETag", "etag", "md5Hash", "content_md5"):
        if info.get(k):
            return str(info[k]).strip('"')
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    return f"mtime:{mtime}" if mtime else None


def list_objects(loc: Location) -> list[RemoteObject]:
    """Model-state objects under a folder URL, with size and ETag (their cache identity)."""
    with storage_errors(loc.url):
        loc.fs.invalidate_cache()
        if not loc.fs.exists(loc.path):
            raise StorageError("no such bucket, prefix or object", culprit=loc.url,
                               hint="check the URL (bucket and prefix) and the credentials")
        found = loc.fs.find(loc.path, detail=True)
    base = loc.path.rstrip("/")
    objs = []
    for path, info in sorted(found.items()):
        rel = path[len(base):].lstrip("/") if path.startswith(base) else PurePosixPath(path).name
        if info.get("type", "file") != "file" or not any(p.search(rel) for p in MODEL_FILE_PATTERNS):
            continue
        objs.append(RemoteObject(url=loc.child_url(rel), path=path, name=rel, size=int(info["size"]),
                                 etag=_etag(info)))
    return objs


def _only_latest_iteration(loc: Location, objs: list[RemoteObject]) -> list[RemoteObject]:
    """For a Megatron run folder, keep just the iteration named by the tracker file."""
    tracker = next((o for o in objs if o.name == LATEST_ITER_FILE), None)
    if tracker is None:
        return objs
    with storage_errors(tracker.url):
        text = loc.fs.cat_file(tracker.path).decode().strip()
    prefix = f"iter_{int(text):07d}/" if text.isdigit() else f"{text}/"
    return [o for o in objs if o.name == LATEST_ITER_FILE or o.name.startswith(prefix)]


def materialize(url: str, storage_options: Mapping[str, Any] | None = None,
                cache: ShardCache | None = None, workdir: Path | None = None) -> LocalSource:
    """Return a local view of the checkpoint at ``url`` (fetching remote shards into the cache)."""
    loc = open_location(url, storage_options)
    if loc.is_local:
        p = Path(loc.path)
        return LocalSource(url, p)
    cache = cache or ShardCache()
    workdir = workdir or cache.new_workdir("src")
    view = workdir / "source"
    with storage_errors(url):
        is_file = loc.fs.isfile(loc.path)
    if is_file:
        return _materialize_descriptor(loc, cache, view)
    objs = _only_latest_iteration(loc, list_objects(loc))
    if not any(o.name.endswith(".pt") for o in objs):
        raise StorageError("holds no checkpoint (no model-state .pt files under this prefix)", culprit=url,
                           hint="point at the folder that holds mp_rank_XX_model_states.pt files")
    return _fetch_into(loc, objs, cache, view, view)


def _fetch_into(loc: Location, objs: list[RemoteObject], cache: ShardCache, view: Path,
                result_path: Path) -> LocalSource:
    out = LocalSource(loc.url, result_path, objs)
    hits0 = cache.hits

    def one(o: RemoteObject) -> None:
        ShardCache.link(cache.fetch(loc, o), view / o.name)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for fut in [pool.submit(one, o) for o in objs]:
            fut.result()
    out.cached = cache.hits - hits0
    out.fetched = len(objs) - out.cached
    return out


def _materialize_descriptor(loc: Location, cache: ShardCache, view: Path) -> LocalSource:
    """A remote descriptor JSON: fetch it and exactly the files it lists (relative only)."""
    with storage_errors(loc.url):
        raw = loc.fs.cat_file(loc.path)
    name = PurePosixPath(loc.path).name
    try:
        data = json.loads(raw)
        entries = list(data["checkpoints"])
        base = data.get("base_dir") or ""
    except (ValueError, KeyError, TypeError) as exc:
        raise StorageError(f"malformed descriptor JSON: {exc}", culprit=loc.url, hint="fix the JSON") from None
    rels = []
    for e in entries:
        rel = PurePosixPath(str(base), str(e)) if base else PurePosixPath(str(e))
        if rel.is_absolute() or ".." in rel.parts or "://" in str(rel):
            raise StorageError(f"descriptor entry {e!r} (base_dir {base!r}) is not a relative path",
                               culprit=loc.url, hint="remote descriptors must list files relative to their folder")
        rels.append(str(rel))
    folder = loc.path.rsplit("/", 1)[0]
    folder_url = loc.url.rsplit("/", 1)[0]
    objs = []
    with storage_errors(loc.url):
        for rel in rels:
            path = f"{folder}/{rel}"
            info = loc.fs.info(path)
            objs.append(RemoteObject(f"{folder_url}/{rel}", path, rel, int(info["size"]), _etag(info)))
    view.mkdir(parents=True, exist_ok=True)
    (view / name).write_bytes(raw)
    src = _fetch_into(loc, objs, cache, view, view / name)
    return src

