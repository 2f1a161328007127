"""Ranged reads of a source object while it is converted (:class:`RangeReader`), so a remote
checkpoint never has to lie whole on local disk (see :mod:`reshard.core.remote`).

A conversion reads each source file mostly front to back (tensors are written in the order the
files hold them), a few MiB at a time, and a request's latency would leave the link idle between
reads. So the object is read in aligned blocks of :data:`BLOCK` bytes through one process-wide
cache: a read waits for the blocks it covers and asks for the next :data:`READ_AHEAD` ones of
the same object in the background; blocks are dropped least recently used once the cache holds
:data:`CACHE_BYTES` (memory, not disk: nothing here touches the disk).

Every block is requested with the object's ETag as ``If-Match`` (S3): an object replaced while
the conversion runs fails the read instead of mixing two versions. A short body is read again
(botocore retries requests, not truncated bodies); after :data:`ATTEMPTS` the error is a
transient :class:`~reshard.core.errors.StorageError`, which the flow retries as a whole task.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from reshard.core.errors import StorageError
from reshard.storage.cache import RemoteObject
from reshard.storage.if_match import changed, changed_error, get_range, if_match_of
from reshard.storage.location import Location, is_transient_error, storage_errors

#: Bytes per cached block (one ranged GET).
BLOCK = 4 << 20
#: Blocks of an object read ahead of the last one asked for.
READ_AHEAD = 4
#: Blocks kept (and being read) at most, over all objects of the process.
CACHE_BYTES = 128 << 20
#: Requests in flight at most, over all objects of the process.
CONCURRENCY = 8
#: Tries of one block before its read fails.
ATTEMPTS = 4


class _Blocks:
    """The process-wide block cache: ``(reader, index) -> Future[bytes]``, least recently used first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: OrderedDict[tuple[int, int], Future[bytes]] = OrderedDict()
        self.pool = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="reshard-read")

    def get(self, reader: RangeReader, index: int, *, wait: bool) -> Future[bytes] | None:
        """The block's future (started if new); None when it is new and ``wait`` is False but
        the cache has no room for it (a read-ahead that would push out blocks still to be read)."""
        key = (reader.key, index)
        with self.lock:
            fut = self.blocks.get(key)
            if fut is not None:
                self.blocks.move_to_end(key)
                return fut
            if not wait and len(self.blocks) * BLOCK >= CACHE_BYTES:
                return None
            fut = self.pool.submit(reader._fetch, index)
            self.blocks[key] = fut
            self._evict()
            return fut

    def _evict(self) -> None:
        over = len(self.blocks) - CACHE_BYTES // BLOCK
        for key in list(self.blocks):
            if over <= 0:
                break
            if self.blocks[key].done():
                del self.blocks[key]
                over -= 1

    def forget(self, reader: RangeReader) -> None:
        with self.lock:
            for key in [k for k in self.blocks if k[0] == reader.key]:
                self.blocks.pop(key).cancel()


_BLOCKS: _Blocks | None = None
_KEYS = itertools.count()
_BLOCKS_LOCK = threading.Lock()
_STRUCTURE_POOL: ThreadPoolExecutor | None = None


def _structure_pool() -> ThreadPoolExecutor:
    """The threads exact ranges are read on (not the block cache's: a block's reader may wait on them)."""
    global _STRUCTURE_POOL
    with _BLOCKS_LOCK:
        if _STRUCTURE_POOL is None:
            _STRUCTURE_POOL = ThreadPoolExecutor(max_workers=CONCURRENCY, thread_name_prefix="reshard-structure")
        return _STRUCTURE_POOL


def _blocks() -> _Blocks:
    global _BLOCKS
    with _BLOCKS_LOCK:
        if _BLOCKS is None:
            _BLOCKS = _Blocks()
        return _BLOCKS


class RangeReader:
    """The bytes of one listed object, read by range (a :class:`reshard.core.remote.ByteSource`)."""

    def __init__(self, loc: Location, obj: RemoteObject) -> None:
        self.fs, self.path, self.url, self.size = loc.fs, obj.path, obj.url, obj.size
        self.key = next(_KEYS)  # the cache's name for this object (never reused, unlike id())
        self.identity = obj.identity
        self.if_match = if_match_of(loc.fs, obj.etag)

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if n == 0:
            return
        if offset < 0 or offset + n > self.size:
            raise StorageError(f"asked for bytes {offset}-{offset + n} of a {self.size}-byte object", culprit=self.url,
                               hint="the checkpoint's index does not match its files; re-copy the checkpoint")
        blocks = _blocks()
        first, last = offset // BLOCK, (offset + n - 1) // BLOCK
        futures = [blocks.get(self, b, wait=True) for b in range(first, last + 1)]
        for b in range(last + 1, min(last + 1 + READ_AHEAD, -(-self.size // BLOCK))):
            if blocks.get(self, b, wait=False) is None:
                break
        at = 0
        for b, fut in zip(range(first, last + 1), futures):
            data = fut.result()  # type: ignore[union-attr]
            lo = max(offset, b * BLOCK) - b * BLOCK
            take = min(len(data) - lo, n - at)
            out[at:at + take] = data[lo:lo + take]
            at += take

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each ``(offset, length)`` range exactly, :data:`CONCURRENCY` at a time (a file's
        structure: many small ranges; not cached here, the caller keeps them)."""
        for off, n in ranges:
            if off < 0 or n < 0 or off + n > self.size:
                raise StorageError(f"asked for bytes {off}-{off + n} of a {self.size}-byte object", culprit=self.url,
                                   hint="the checkpoint's structure does not match its size; re-copy the checkpoint")
        if len(ranges) == 1:
            return [self._exact(*ranges[0])]
        return list(_structure_pool().map(lambda r: self._exact(*r), ranges))

    def _exact(self, start: int, n: int) -> bytes:
        return self._read(start, start + n) if n else b""

    def _fetch(self, index: int) -> bytes:
        start = index * BLOCK
        return self._read(start, min(self.size, start + BLOCK))

    def _read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, checked for length and read again when short."""
        last = ""
        for _ in range(ATTEMPTS):
            try:
                with storage_errors(self.url):
                    data = self._get(start, end)
            except StorageError:
                raise
            except Exception as exc:  # a body cut after botocore gave up: read the block again
                if changed(exc):
                    raise changed_error(self.url) from None
                if not is_transient_error(exc):
                    raise
                last = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            if len(data) == end - start:
                return data
            last = f"got {len(data)} of {end - start} bytes"
        raise StorageError(f"bytes {start}-{end} could not be read ({last})", culprit=self.url,
                           hint="the network or the storage endpoint is failing; retry later", transient=True)

    def _get(self, start: int, end: int) -> bytes:
        return get_range(self.fs, self.path, start, end, self.if_match)

    def forget(self) -> None:
        """Drop this object's cached blocks (the conversion is over)."""
        _blocks().forget(self)
