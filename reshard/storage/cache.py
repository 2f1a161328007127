"""A local cache of source shards keyed by their identity (URL + ETag/size).

A shard fetched once is reused by later runs as long as the object is unchanged. Downloads
land in a private temp file and are renamed into place only after their size (and MD5, when
the ETag is a plain MD5) checks out, so a concurrent run never sees a partial file. s3fs's
concurrent ranged ``get_file`` does not retry a truncated body, so every download is verified
and a short or corrupt one is fetched again (whole-shard retry; request retries stay in
botocore).

The cache is bounded (``max_bytes``, ``$RESHARD_CACHE_MAX_BYTES``, default 4 GiB: what a
worker's local disk gives the cache): least recently used entries are evicted. Runs read shards
through hard links in their own work folder, so evicting an entry never pulls a file from under
a running conversion. A streamed source (the default for remote ones) keeps only stand-ins here
(sparse files holding nothing, or a safetensors header); whole shards (``--cache-sources``) need
room for the shards a target reads.

Location: ``$RESHARD_CACHE_DIR`` or ``~/.cache/reshard``; clear it with ``rm -rf`` at any time
when no conversion is running.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from reshard.core.errors import StorageError
from reshard.core.options import parse_size
from reshard.storage.if_match import changed, changed_error, get_range, if_match_of
from reshard.storage.location import Location, is_transient_error, storage_errors

DEFAULT_MAX_BYTES = 4 << 30
FETCH_ATTEMPTS = 4
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")


SKELETON = "skeleton"


def is_skeleton(path: str | os.PathLike[str]) -> bool:
    """Is ``path`` a cache entry standing in for a file read while converting (see
    :meth:`ShardCache.fetch`)?"""
    return Path(path).name.endswith(f".{SKELETON}")


def default_max_bytes() -> int:
    """``$RESHARD_CACHE_MAX_BYTES`` (``4GiB``, ``500MB``, bytes), else :data:`DEFAULT_MAX_BYTES`."""
    env = os.environ.get("RESHARD_CACHE_MAX_BYTES")
    return parse_size(env, "RESHARD_CACHE_MAX_BYTES") if env else DEFAULT_MAX_BYTES


def default_cache_dir() -> Path:
    env = os.environ.get("RESHARD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "reshard"


@dataclass(frozen=True)
class RemoteObject:
    """One listed object: its identity is (url, etag, size)."""

    url: str
    path: str
    name: str
    size: int
    etag: str | None

    @property
    def identity(self) -> str:
        return hashlib.sha256(f"{self.url}\0{self.etag}\0{self.size}".encode()).hexdigest()[:40]


class ShardCache:
    """Content-identity keyed cache of downloaded shards (see module docstring)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, max_bytes: int | None = None,
                 chunksize: int = 32 << 20, max_concurrency: int = 8):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.shards = self.root / "shards"
        self.work = self.root / "work"
        self.max_bytes = max_bytes if max_bytes is not None else default_max_bytes()
        self.chunksize = chunksize
        self.max_concurrency = max_concurrency
        self.shards.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def entry(self, obj: RemoteObject) -> Path:
        return self.shards / obj.identity

    def skeleton_entry(self, obj: RemoteObject) -> Path:
        return self.shards / f"{obj.identity}.{SKELETON}"

    def holds(self, obj: RemoteObject) -> bool:
        """Is the whole of ``obj`` in the cache (from an earlier whole fetch)?"""
        entry = self.entry(obj)
        return entry.is_file() and entry.stat().st_size == obj.size

    def fetch(self, loc: Location, obj: RemoteObject, ranges: Sequence[tuple[int, int]] | None = None,
              *, skeleton: bool = False) -> Path:
        """Local path of ``obj``'s bytes: from the cache, or downloaded and verified.

        ``ranges`` (``(offset, length)`` pairs): only these bytes are needed — say the model's
        chunks of a file that also holds optimizer state. The entry is then a sparse file of the
        object's size holding just those ranges (its own cache entry, named by the ranges), each
        range's length checked; the MD5 of a whole object cannot be checked on a part of it.
        ``skeleton``: the entry stands in for a file read while converting (the ranges are what its
        format reads from disk, often none; :func:`is_skeleton` tells such an entry by its name)."""
        if ranges is None:
            def whole(tmp: Path) -> str | None:
                with storage_errors(obj.url):
                    self._download(loc, obj, tmp)
                return self._verify(loc, obj, tmp)

            return self._cached(obj, self.entry(obj), whole)
        spans = sorted((int(o), int(n)) for o, n in ranges if n > 0)
        if any(o < 0 or o + n > obj.size for o, n in spans):
            raise StorageError(f"asked for bytes outside the {obj.size}-byte object", culprit=obj.url,
                               hint="the checkpoint's index does not match its files; re-copy the checkpoint")
        pieces = [(start, min(start + self.chunksize, o + n)) for o, n in spans
                  for start in range(o, o + n, self.chunksize)]

        def part(tmp: Path) -> str | None:
            with storage_errors(obj.url):
                self._read_ranges(loc, obj, tmp, pieces)
            return None  # each range's length is checked as it is read

        if skeleton:  # a file's structure is a fact of its bytes: one per identity (the flow looks for it)
            return self._cached(obj, self.skeleton_entry(obj), part)
        tag = hashlib.sha256(repr(spans).encode()).hexdigest()[:16]
        return self._cached(obj, self.shards / f"{obj.identity}.ranges-{tag}", part)

    def _cached(self, obj: RemoteObject, dest: Path, fill: Callable[[Path], str | None]) -> Path:
        """``dest`` when the cache holds it (of the object's size), else ``fill`` a temporary file
        (returning a problem or None), retried while failures are transient, moved into place."""
        if dest.is_file() and dest.stat().st_size == obj.size:
            os.utime(dest)  # LRU order
            self.hits += 1
            return dest
        self.misses += 1
        last = ""
        for _attempt in range(FETCH_ATTEMPTS):
            tmp = self.shards / f".{dest.name}.{uuid.uuid4().hex}.part"
            try:
                problem = fill(tmp)
                if problem is None:
                    os.replace(tmp, dest)
                    self.evict(keep={dest})
                    return dest
                last = problem
            except StorageError as exc:
                if not exc.transient:
                    raise
                last = exc.message
            except Exception as exc:  # a body cut mid-stream after botocore gave up: fetch again
                if not is_transient_error(exc):
                    raise
                last = f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:
                tmp.unlink(missing_ok=True)
        raise StorageError(f"download failed verification {FETCH_ATTEMPTS} times ({last})", culprit=obj.url,
                           hint="the object may be changing or the network corrupting data; retry later",
                           transient=True)

    def _read_ranges(self, loc: Location, obj: RemoteObject, tmp: Path, pieces: list[tuple[int, int]]) -> None:
        """Concurrent ranged reads of ``pieces`` (``[start, end)``) into a file of the object's size."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, obj.size)

            pinned = if_match_of(loc.fs, obj.etag)  # the listed version, or an error: never two versions' bytes

            def get(start: int, end: int) -> bytes:
                try:
                    return get_range(loc.fs, obj.path, start, end, pinned)
                except Exception as exc:
                    if changed(exc):
                        raise changed_error(obj.url, f"since it was listed{self._now(loc, obj)}") from None
                    raise

            def read_range(r: tuple[int, int]) -> None:
                start, end = r
                data = get(start, end)
                if len(data) != end - start:
                    data = get(start, end)  # one re-read of a short range
                if len(data) != end - start:
                    raise StorageError(f"range {start}-{end} returned {len(data)} bytes", culprit=obj.url,
                                       transient=True)
                os.pwrite(fd, data, start)

            with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
                for fut in [pool.submit(read_range, r) for r in pieces]:
                    fut.result()
        finally:
            os.close(fd)

    @staticmethod
    def _now(loc: Location, obj: RemoteObject) -> str:
        """What the object is now, beside what was listed (for the error; nothing when unknown)."""
        try:
            loc.fs.invalidate_cache(obj.path)
            now = int(loc.fs.info(obj.path)["size"])
        except Exception:  # gone, or unreadable: the error names the object either way
            return ""
        return f" ({obj.size} B then, {now} B now)"

    def _download(self, loc: Location, obj: RemoteObject, tmp: Path) -> None:
        """Concurrent ranged reads into a preallocated file; each range's length is checked
        (a short body is re-read; request retries stay in the client)."""
        if obj.size <= self.chunksize and if_match_of(loc.fs, obj.etag) is None:
            data = loc.fs.cat_file(obj.path)
            tmp.write_bytes(data)
            return
        self._read_ranges(loc, obj, tmp, [(start, min(start + self.chunksize, obj.size))
                                          for start in range(0, obj.size, self.chunksize)])

    def _verify(self, loc: Location, obj: RemoteObject, tmp: Path) -> str | None:
        size = tmp.stat().st_size
        if size != obj.size:
            with storage_errors(obj.url):
                loc.fs.invalidate_cache(obj.path)
                now = int(loc.fs.info(obj.path)["size"])
            if now is not None and now != obj.size:
                raise StorageError(f"object changed size between listing ({obj.size} B) and fetch ({now} B)",
                                   culprit=obj.url, hint="do not convert a checkpoint that is still being written")
            return f"got {size} of {obj.size} bytes"
        etag = (obj.etag or "").strip('"').lower()
        if _PLAIN_MD5.match(etag):
            h = hashlib.md5(usedforsecurity=False)
            with open(tmp, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() != etag:
                return "MD5 does not match the ETag"
        return None

    def evict(self, keep: set[Path] = frozenset()) -> int:
        """Drop least recently used entries until the cache fits ``max_bytes``; returns bytes freed.
        Safe against concurrent fetches/evictions (entries may vanish while we look)."""
        entries = []
        for p in self.shards.iterdir():
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, min(st.st_size, st.st_blocks * 512), p))  # sparse entries: what they hold
        total = sum(size for _, size, _ in entries)
        freed = 0
        for _, size, p in sorted(entries):
            if total - freed <= self.max_bytes:
                break
            if p in keep:
                continue
            p.unlink(missing_ok=True)
            freed += size
        return freed

    def conversion_work(self, conversion_id: str) -> Path:
        """The work folder of one conversion: every run of it (a resumed one included) works
        there, and the run that commits it removes it (:mod:`reshard.storage.workdirs`)."""
        return self.work / conversion_id[:24]

    def finish_work(self, conversion_id: str) -> bool:
        """Conversion ``conversion_id`` is committed: remove its work folder unless a run of it
        is still using it. True when removed (or there was none)."""
        from reshard.storage.workdirs import WorkUse

        with WorkUse(self.conversion_work(conversion_id)) as use:
            return use.finish()

    def new_workdir(self, label: str) -> Path:
        """A private folder for one run (hard-linked source view, staged outputs)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:60]
        d = self.work / f"{safe}-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        d.mkdir(parents=True)
        return d

    @staticmethod
    def link(src: Path, dst: Path) -> None:
        """Put the cached ``src`` at ``dst`` (hard link, else a copy), atomically: a reader
        of ``dst`` sees the old entry or the new one, never a missing or partial file."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() and os.path.samefile(src, dst):
            return  # a resumed run's view already links this entry
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.link")
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)

