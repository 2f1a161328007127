"""Source files read while converting, range by range, instead of fetched whole first.

A checkpoint on object storage need not be copied to local disk before it is converted: the
conversion reads only byte ranges, and knows which ones when it reads them. For such a file the
local view holds a *stand-in* — a sparse file of the object's size holding nothing, or only what
its format reads from disk (a safetensors header) — and a :class:`ByteSource` that reads any
range from where the object lives. The storage layer makes both and attaches the source to the
stand-in's path (:func:`attach`); a format opening the file looks it up (:func:`source_for`),
reads the file's structure (zip directory, pickle, headers: a few KiB per tensor) into memory
through it (:func:`structure`), and hands the planner and the engine :class:`RemoteTensor` s:
lazy tensors whose boxes are read through the source while the target is written. Nothing reads
a stand-in's holes: a tensor of a streamed file exists only as a :class:`RemoteTensor`, and local
disk holds no byte of it.

=============================  ===================================================================
call                           what it is for
=============================  ===================================================================
``attach(path, source)``       the storage layer: ``path`` (a stand-in) stands for ``source``
``source_for(path)``           a format opening ``path``: its source, or None (a whole local file)
``structure(source, ranges)``  a format parsing a streamed file: a file object over it whose
                               ``ranges`` (its structure) are fetched at once, kept in memory
``detach(root)``               a conversion is over: forget the sources under the folder ``root``
``materialize_lazy(obj)``      entries copied into an output as they are (not module tensors):
                               every :class:`RemoteTensor` in ``obj`` read into a real tensor,
                               storages shared as they were
=============================  ===================================================================

This module knows no network: a source is anything with ``read_into`` and ``fetch``.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from reshard.core.lazy import LazyTensor

#: The most bytes one :meth:`RemoteTensor.read_box` holds at once beside its output: a box whose
#: rows are scattered over a larger span (a column slice) is read that many bytes of rows at a time.
SPAN_BYTES = 16 << 20


class ByteSource(Protocol):
    """Where the bytes of one streamed file are (the storage layer's, e.g. ranged GETs)."""

    url: str  # named in errors
    size: int

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes ``[offset, offset + len(out))``, or raise (tensor
        bytes: read in large aligned blocks, read ahead)."""

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)`` range, exactly (a file's structure: many small
        ranges, asked for at once), or raise."""


_lock = threading.Lock()
_sources: dict[str, ByteSource] = {}


def attach(path: str | os.PathLike[str], source: ByteSource) -> None:
    """Make the skeleton at ``path`` stand for ``source`` in this process."""
    with _lock:
        _sources[os.path.abspath(path)] = source


def source_for(path: str | os.PathLike[str]) -> ByteSource | None:
    """The source the file at ``path`` stands for, or None: ``path`` holds its own bytes."""
    with _lock:
        return _sources.get(os.path.abspath(path))


def detach(root: str | os.PathLike[str]) -> None:
    """Forget every source attached to a path under the folder ``root`` (or ``root`` itself)."""
    root = os.path.abspath(root)
    with _lock:
        for p in [p for p in _sources if p == root or p.startswith(root + os.sep)]:
            del _sources[p]


class StructureFile(io.RawIOBase):
    """A read-only file object over a streamed file for its format's parser (``torch.load``'s zip
    reader, a directory walk): the ranges given up front are fetched at once and kept in memory;
    a read outside them fetches exactly what it asks for (and keeps it too). Memory: the file's
    structure, a few hundred bytes per tensor."""

    def __init__(self, source: ByteSource, spans: dict[int, bytes]) -> None:
        super().__init__()
        self.source, self.spans, self.pos = source, _disjoint(spans), 0
        self._starts = sorted(self.spans)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.source.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def pread(self, n: int, offset: int) -> bytes:
        """``n`` bytes at ``offset`` (fewer at the end of the file)."""
        n = max(0, min(n, self.source.size - offset))
        out = bytearray(n)
        at = 0
        while at < n:
            i = bisect.bisect_right(self._starts, offset + at) - 1
            if i >= 0:
                start = self._starts[i]
                span = self.spans[start]
                if start <= offset + at < start + len(span):
                    take = min(n - at, start + len(span) - offset - at)
                    out[at:at + take] = span[offset + at - start:offset + at - start + take]
                    at += take
                    continue
            nxt = self._starts[i + 1] if i + 1 < len(self._starts) else self.source.size
            want = min(n - at, nxt - offset - at)
            (data,) = self.source.fetch([(offset + at, want)])
            self.spans[offset + at] = data
            bisect.insort(self._starts, offset + at)
        return bytes(out)

    def readinto(self, b: Any) -> int:
        data = self.pread(len(b), self.pos)
        memoryview(b).cast("B")[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _disjoint(spans: dict[int, bytes]) -> dict[int, bytes]:
    """``spans`` (offset -> bytes, overlapping or touching) joined into disjoint ones."""
    out: dict[int, bytes] = {}
    start, buf = None, bytearray()
    for off in sorted(spans):
        data = spans[off]
        if start is not None and off <= start + len(buf):
            end = off + len(data)
            if end > start + len(buf):
                buf += data[start + len(buf) - off:]
            continue
        if start is not None:
            out[start] = bytes(buf)
        start, buf = off, bytearray(data)
    if start is not None:
        out[start] = bytes(buf)
    return out


_structures: weakref.WeakKeyDictionary[Any, dict[int, bytes]] = weakref.WeakKeyDictionary()


def structure(source: ByteSource, ranges: Callable[[Callable[[int, int], bytes]], Sequence[tuple[int, int]]]
              ) -> StructureFile:
    """A :class:`StructureFile` over ``source`` whose structure ``ranges(pread)`` names (``pread(n,
    offset)`` reads exactly, e.g. the tail and directory they are found from) — fetched once per
    source object and process, however often the file is opened."""
    with _lock:
        spans = _structures.get(source)
    if spans is None:
        probe = StructureFile(source, {})
        wanted = [(o, n) for o, n in ranges(probe.pread) if n > 0]
        spans = dict(probe.spans)
        for (o, _n), data in zip(wanted, source.fetch(wanted)):
            spans[o] = data
        with _lock:
            _structures[source] = spans
    return StructureFile(source, dict(spans))


class RemoteStorage:
    """One storage of a streamed torch file: ``nbytes`` at ``offset`` of ``source``. Tensors that
    view one storage share the object, so copying them out keeps them sharing (as torch.load would)."""

    def __init__(self, source: ByteSource, offset: int, nbytes: int) -> None:
        self.source, self.offset, self.nbytes = source, offset, nbytes

    def load(self) -> torch.UntypedStorage:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self.source.read_into(self.offset, _bytes_of(buf))
        return buf.untyped_storage()


class RemoteTensor(LazyTensor):
    """A tensor of a streamed file: a strided view (``storage_offset``, ``shape``, ``stride`` in
    elements) of a :class:`RemoteStorage`, read box by box.

    ====================================  ===================================================
    box                                   read
    ====================================  ===================================================
    whole rows (a contiguous run)         straight into the output (no copy between)
    anything else (a column slice)        the span of source rows it lies in, at most
                                          :data:`SPAN_BYTES` at a time, copied out of it
    ====================================  ===================================================
    """

    def __init__(self, storage: RemoteStorage, storage_offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False) -> None:
        self.storage, self.storage_offset = storage, storage_offset
        self.shape, self.stride, self.dtype = tuple(shape), tuple(stride), dtype
        self.requires_grad = requires_grad

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(sizes, dtype=self.dtype)
        if math.prod(sizes) == 0:
            return out
        if not self.shape:  # a 0-dim tensor
            self._read(self.storage_offset, 1, (), (), out)
            return out
        isz = self.dtype.itemsize  # n rows span (n - 1) row strides and one row's span
        one = self._span(offsets, (1, *sizes[1:])) * isz
        rows = 1 + max(0, SPAN_BYTES - one) // max(1, self.stride[0] * isz)
        for r0 in range(0, sizes[0], rows):
            n = min(rows, sizes[0] - r0)
            o = (offsets[0] + r0, *offsets[1:])
            s = (n, *sizes[1:])
            first = self.storage_offset + sum(a * st for a, st in zip(o, self.stride))
            self._read(first, self._span(o, s), s, self.stride, out.narrow(0, r0, n))
        return out

    def _span(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
        """Elements from the box's first to its last (inclusive) in the storage."""
        return 1 + sum((s - 1) * st for s, st in zip(sizes, self.stride))

    def _read(self, first: int, span: int, sizes: tuple[int, ...], stride: tuple[int, ...],
              out: torch.Tensor) -> None:
        isz = self.dtype.itemsize
        where = self.storage.offset + first * isz
        if span == math.prod(sizes) and out.is_contiguous() and (not sizes or _is_dense(sizes, stride)):
            self.storage.source.read_into(where, _bytes_of(out))  # the box is one run: read in place
            return
        buf = torch.empty(span * isz, dtype=torch.uint8)
        self.storage.source.read_into(where, _bytes_of(buf))
        out.copy_(buf.view(self.dtype).as_strided(sizes, stride))

    def __repr__(self) -> str:
        return f"RemoteTensor({self.storage.source.url}@{self.storage.offset}, {list(self.shape)}, {self.dtype})"


def _is_dense(sizes: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Are ``sizes`` at ``stride`` the row-major layout of a contiguous block?"""
    expect = 1
    for s, st in zip(reversed(sizes), reversed(stride)):
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    import ctypes

    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def materialize_lazy(obj: Any, _memo: dict[int, torch.UntypedStorage] | None = None) -> Any:
    """``obj`` with every :class:`RemoteTensor` in it (in dicts, lists, tuples, namespaces) read
    into a real tensor; tensors of one storage share one real storage. Anything else is returned
    as it is (the same object when nothing in it is remote)."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, RemoteTensor):
        key = id(obj.storage)
        if key not in memo:
            memo[key] = obj.storage.load()
        t = torch.empty(0, dtype=obj.dtype)
        t.set_(memo[key], obj.storage_offset, obj.shape, obj.stride)
        t.requires_grad_(obj.requires_grad)
        return t
    return rebuilt(obj, lambda v: materialize_lazy(v, memo))


def rebuilt(obj: Any, each: Callable[[Any], Any]) -> Any:
    """``obj`` with ``each`` applied to the values it holds; the same object when none changed."""
    if isinstance(obj, dict):
        new = {k: each(v) for k, v in obj.items()}
        if all(new[k] is v for k, v in obj.items()):
            return obj
        out = type(obj)() if type(obj) is not dict else {}
        out.update(new)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [each(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(items)
    if hasattr(obj, "__dict__") and type(obj).__module__ in ("argparse", "types"):  # Namespace, SimpleNamespace
        new = {k: each(v) for k, v in vars(obj).items()}
        if all(new[k] is v for k, v in vars(obj).items()):
            return obj
        out = type(obj)()
        for k, v in new.items():
            setattr(out, k, v)
        return out
    return obj

