"""Make a checkpoint at any URL readable by the (local-path) core: discovery, above storage (fsspec
alone, which knows no format) and the formats (which classify what is listed).

Three steps, which the Prefect flow runs as separate tasks and :func:`materialize` runs in a row:

1. :func:`discover` lists the model-state objects (name, size, ETag) — optimizer shards
   (``zero_pp_rank_*``) are never listed; for a Megatron run folder only the latest iteration;
   for a descriptor JSON exactly the files it lists — and has the formats classify each object
   once (:class:`~reshard.formats.ObjectClass`: marker or weights, who reads and who checks it),
   a record the later steps read instead of asking the formats again;
2. :func:`fetch` brings one object local: a local file is used in place (never copied, never
   written), a remote one goes through the :class:`~reshard.storage.cache.ShardCache`;
3. :func:`build_view` hard-links the fetched files into a private folder that mirrors the
   remote names, so ``reshard.formats.locate`` sees what it would see locally.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.core.errors import StorageError
from reshard.core.options import ReshardOptions
from reshard.crashpoints import crash_point
from reshard.formats import (
    ObjectClass,
    classify,
    descriptor_entries,
    listing_patterns,
    locate,
    needed_ranges,
    select_objects,
    skeleton_ranges,
)
from reshard.storage.cache import RemoteObject, ShardCache, is_skeleton
from reshard.storage.location import Location, open_location, storage_errors


@dataclass
class Discovery:
    """What a source URL holds: the objects to fetch, each classified (name -> its class), and,
    for descriptors, the JSON itself."""

    url: str
    is_local: bool
    objects: list[RemoteObject]
    descriptor_name: str | None = None
    descriptor_bytes: bytes | None = None
    classes: Mapping[str, ObjectClass] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.classes:
            self.classes = classify([o.name for o in self.objects])

    def is_marker(self, name: str) -> bool:
        return self.classes[name].marker

    def to_record(self) -> dict[str, Any]:
        """A JSON-able record (what the flow's tasks pass each other)."""
        return {"url": self.url, "is_local": self.is_local, "objects": [dataclasses.asdict(o) for o in self.objects],
                "descriptor_name": self.descriptor_name,
                "descriptor_b64": base64.b64encode(self.descriptor_bytes).decode() if self.descriptor_bytes else None,
                "classes": {n: c.to_record() for n, c in self.classes.items()}}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Discovery:
        return cls(rec["url"], rec["is_local"], [RemoteObject(**o) for o in rec["objects"]], rec["descriptor_name"],
                   base64.b64decode(rec["descriptor_b64"]) if rec["descriptor_b64"] else None,
                   {n: ObjectClass.from_record(c) for n, c in rec["classes"].items()})


@dataclass
class LocalSource:
    """A source made local: pass ``path`` to ``reshard.formats.locate``."""

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


def check_source_exists(loc: Location) -> None:
    """Raise the one-line error for a source that is not there, worded for its kind of URL
    (a local path has no bucket or credentials to check). Cheap: one stat or one request."""
    with storage_errors(loc.url):
        loc.fs.invalidate_cache()
        if loc.fs.exists(loc.path):
            return
    if loc.is_local:
        raise StorageError("no such file or folder", culprit=loc.url, hint="check the path")
    raise StorageError("no such bucket, prefix or object", culprit=loc.url,
                       hint="check the URL (bucket and prefix) and the credentials")


def list_objects(loc: Location, options: ReshardOptions | None = None) -> list[RemoteObject]:
    """Model-state objects under a folder URL (and the files ``options`` need besides, e.g. ZeRO
    optimizer files for ``--weights master``), with size and ETag (their cache identity)."""
    check_source_exists(loc)
    with storage_errors(loc.url):
        found = loc.fs.find(loc.path, detail=True)
    base = loc.path.rstrip("/")
    objs = []
    wanted = listing_patterns(options)  # what some registered format reads
    for path, info in sorted(found.items()):
        rel = path[len(base):].lstrip("/") if path.startswith(base) else PurePosixPath(path).name
        if info.get("type", "file") != "file" or not any(p.search(rel) for p in wanted):
            continue
        if rel.startswith(".reshard"):
            continue
        if rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
            raise StorageError(f"object key {path!r} escapes its folder ('..' or absolute segment)",
                               culprit=loc.url, hint="remove or rename the object; reshard never follows such keys")
        objs.append(RemoteObject(url=loc.child_url(rel), path=path, name=rel, size=int(info["size"]),
                                 etag=_etag(info)))
    return objs


def _needed(loc: Location, objs: list[RemoteObject]) -> list[RemoteObject]:
    """The listed objects a conversion needs, as the formats decide from their markers (a Megatron-LM
    run folder: only the iteration its marker names)."""
    by_name = {o.name: o for o in objs}

    def read(name: str) -> bytes:
        with storage_errors(by_name[name].url):
            return loc.fs.cat_file(by_name[name].path)

    return [by_name[n] for n in select_objects(list(by_name), read, lambda n: by_name[n].url)]


def discover(url: str, storage_options: Mapping[str, Any] | None = None,
             options: ReshardOptions | None = None) -> Discovery:
    """List what must be fetched for the checkpoint at ``url`` (folder or descriptor JSON) to
    convert it under ``options`` (None: the default options)."""
    loc = open_location(url, storage_options)
    with storage_errors(url):
        is_file = loc.fs.isfile(loc.path)
    if is_file:
        return _discover_descriptor(loc)
    disc = Discovery(url, loc.is_local, _needed(loc, list_objects(loc, options)))
    if all(disc.is_marker(o.name) for o in disc.objects):
        raise StorageError("holds no checkpoint (no model-state files under this prefix)", culprit=url,
                           hint="point at the folder that holds mp_rank_XX_model_states.pt files")
    return disc


def _discover_descriptor(loc: Location) -> Discovery:
    """A descriptor JSON: exactly the files it lists, relative to its folder (no '..')."""
    with storage_errors(loc.url):
        raw = loc.fs.cat_file(loc.path)
    name = PurePosixPath(loc.path).name
    if loc.is_local:  # core validates local descriptors itself (absolute base_dir allowed there)
        files = locate(loc.path).files
        objs = [RemoteObject(url=str(f), path=str(f), name=f.name, size=f.stat().st_size,
                             etag=f"mtime:{f.stat().st_mtime}") for f in files]
        return Discovery(loc.url, True, objs, name, raw)
    entries = descriptor_entries(raw, loc.url)
    folder = loc.path.rsplit("/", 1)[0]
    folder_url = loc.url.rsplit("/", 1)[0]
    objs = []
    with storage_errors(loc.url):
        for rel in entries:
            info = loc.fs.info(f"{folder}/{rel}")
            objs.append(RemoteObject(f"{folder_url}/{rel}", f"{folder}/{rel}", str(rel), int(info["size"]),
                                     _etag(info)))
    return Discovery(loc.url, False, objs, name, raw)


def fetch(loc: Location, obj: RemoteObject, kind: ObjectClass, cache: ShardCache | None,
          markers: Mapping[str, Path] | None = None, *, stream: bool = False) -> Path:
    """Local path of one object's bytes (in place for local files, else via the cache); ``kind``:
    its class from discovery. With the
    checkpoint's fetched ``markers`` (name -> local path), only the byte ranges its format says
    the conversion reads are fetched (``reshard.formats.needed_ranges``). ``stream``: a weight file
    its format can read while converting gets a stand-in (holding what the format reads from disk,
    often nothing; see :func:`attach_streamed`), unless the cache holds the whole file already."""
    if loc.is_local:
        return Path(obj.path)
    crash_point("fetching")
    if cache is None:
        raise StorageError("a remote source needs a shard cache", culprit=obj.url)
    if stream and markers is not None and not cache.holds(obj):
        def pread(n: int, offset: int) -> bytes:
            with storage_errors(obj.url):
                return loc.fs.cat_file(obj.path, start=offset, end=offset + n)

        skeleton = skeleton_ranges(obj.name, kind, obj.size, pread, markers)
        if skeleton is not None:
            return cache.fetch(loc, obj, skeleton, skeleton=True)
    ranges = needed_ranges(obj.name, markers) if markers else None
    return cache.fetch(loc, obj, ranges)


def attach_streamed(view_file: Path, fetched: Path, loc: Location, obj: RemoteObject) -> None:
    """Make the view's file ``view_file`` (linked to ``fetched``) read its bytes from ``obj`` while
    converting, when ``fetched`` is a stand-in; nothing when it is the whole file."""
    if is_skeleton(fetched):
        from reshard.core import remote
        from reshard.storage.remote_read import RangeReader

        held = remote.source_for(view_file)  # kept when it reads this very object: its structure is read once
        if not (isinstance(held, RangeReader) and held.identity == obj.identity):
            remote.attach(view_file, RangeReader(loc, obj))


def build_view(disc: Discovery, fetched: Mapping[str, Path], view: Path) -> Path:
    """The local path to hand to ``reshard.formats.locate``."""
    if disc.is_local:
        return Path(open_location(disc.url).path)  # used in place
    for name, path in fetched.items():
        ShardCache.link(path, view / name)
    if disc.descriptor_name is not None:
        _write_once(view / disc.descriptor_name, disc.descriptor_bytes or b"")
        return view / disc.descriptor_name
    return view


def _write_once(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically, unless it is there already: every task of a run
    lays out the view, and a reader in another thread must never see a half-written file."""
    with contextlib.suppress(OSError):  # not there yet
        if path.read_bytes() == data:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def materialize(url: str, storage_options: Mapping[str, Any] | None = None,
                cache: ShardCache | None = None, workdir: Path | None = None,
                disc: Discovery | None = None, *, stream: bool = False) -> LocalSource:
    """Discover (unless ``disc`` is that listing already), fetch (4 at a time) and build the
    local view in one go. ``stream``: weight files as skeletons read while converting (see
    :func:`fetch`); :func:`reshard.core.remote.detach` the view when done."""
    disc = disc or discover(url, storage_options)
    if disc.is_local:
        return LocalSource(url, build_view(disc, {}, Path()), disc.objects)
    loc = open_location(url, storage_options)
    cache = cache or ShardCache()
    workdir = workdir or cache.new_workdir("src")
    hits0 = cache.hits
    with ThreadPoolExecutor(max_workers=4) as pool:  # markers first: they say which bytes the rest need
        futs = {o.name: pool.submit(fetch, loc, o, disc.classes[o.name], cache) for o in disc.objects
                if disc.is_marker(o.name)}
        markers = {name: fut.result() for name, fut in futs.items()}
        futs = {o.name: pool.submit(fetch, loc, o, disc.classes[o.name], cache, markers, stream=stream)
                for o in disc.objects if o.name not in markers}
        fetched = {**markers, **{name: fut.result() for name, fut in futs.items()}}
    out = LocalSource(url, build_view(disc, fetched, workdir / "source"), disc.objects)
    by_name = {o.name: o for o in disc.objects}
    for name, path in fetched.items():
        attach_streamed(workdir / "source" / name, path, loc, by_name[name])
    out.cached = cache.hits - hits0
    out.fetched = len(disc.objects) - out.cached
    return out


# --- an incrementally filled view (the pipeline starts converting before every shard is here) ----

def skeleton_view(disc: Discovery, view: Path) -> Path:
    """The path to hand to ``reshard.formats.locate`` before all shards are fetched.

    Every object gets a *placeholder* under ``view``: an empty sparse file of the object's size,
    so ``locate`` sees the full layout and sizes. Placeholders hold no bytes: whoever reads a
    shard must first put it in place with :func:`link_into_view` (the pipeline's tasks do, for
    exactly the shards they read). For a local source the view is the source itself."""
    for obj in [] if disc.is_local else disc.objects:
        dst = view / obj.name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.placeholder")
            with open(tmp, "wb") as f:
                f.truncate(obj.size)
            os.replace(tmp, dst)
    return build_view(disc, {}, view)  # the descriptor, if any; a local source in place


def link_into_view(fetched: Path, dst: Path) -> None:
    """Replace ``dst`` (a placeholder or an earlier link) by the fetched file, atomically: a
    concurrent reader sees either the placeholder or the whole file, never a partial copy, and
    the cache file itself is never written through the view."""
    ShardCache.link(fetched, dst)
