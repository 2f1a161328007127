"""Source files read while converting, range by range, instead of fetched whole first.

A checkpoint on object storage need not be copied to local disk before it is converted: the
conversion reads only byte ranges, and knows which ones when it reads them. For such a file the
local view holds a *skeleton* — a sparse file of the object's size holding only its structure
(zip directories, pickles, headers: what a format parses to find the tensors) — and a
:class:`ByteSource` that reads any other range from where the object lives. The storage layer
makes both and attaches the source to the skeleton's path (:func:`attach`); the formats look it
up when they open the file (:func:`source_for`) and hand the planner and the engine
:class:`RemoteTensor` s: lazy tensors whose boxes are read through the source while the target
is written. Nothing reads a skeleton's holes: a tensor of a streamed file exists only as a
:class:`RemoteTensor`.

=============================  ===================================================================
call                           what it is for
=============================  ===================================================================
``attach(path, source)``       the storage layer: ``path`` (a skeleton) stands for ``source``
``source_for(path)``           a format opening ``path``: its source, or None (a whole local file)
``detach(root)``               a conversion is over: forget the sources under the folder ``root``
``materialize_lazy(obj)``      entries copied into an output as they are (not module tensors):
                               every :class:`RemoteTensor` in ``obj`` read into a real tensor,
                               storages shared as they were
=============================  ===================================================================

This module knows no network: a source is anything with ``read_into``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
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
        """Fill ``out`` with the file's bytes ``[offset, offset + len(out))``, or raise."""


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

