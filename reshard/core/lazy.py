"""A source tensor read on demand, box by box: :class:`LazyTensor`.

Most formats hand the planner real tensors that are memory-mapped (a rank file's tensor is one
byte range of its file). A format whose tensors are spread over several blobs — a
``torch_dist`` parameter is chunks in several ``.distcp`` files — hands a :class:`LazyTensor`
instead: its shape and dtype are known from the index, and the engine reads only the box a
target needs (:meth:`LazyTensor.read`), while that target's tensor is being written. Memory is
the box plus the blob being copied from, never the checkpoint.

=================================  ===================================================
call                               returns
=================================  ===================================================
``read(dim, start, length[, out])``  all of the tensor but rows ``[start, start+length)``
                                   of ``dim``: shape ``shape`` with ``shape[dim] =
                                   length`` (copied into ``out`` when given)
``view(dim, start, length)``       the same box as a view of a mapped file, or None
``views(dim, start, length)``      the same box as views of mapped files, in order, each
                                   with the tensor that gives it back; or None
``read_box`` / ``view_box``        any box (``offsets``, ``sizes``)
``materialize()``                  the whole tensor (small replicated tensors, checks)
=================================  ===================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")


def overlaps(spans: Iterable[tuple[T, int, int]], lo: int, hi: int) -> list[tuple[T, int, int, int]]:
    """Of ``spans`` laid end to end (``(item, its first index, count)``), the parts covering
    ``[lo, hi)``: ``(item, first index in it, count, index in the range)``.

    ==============================  ============================================
    spans, range                    parts
    ==============================  ============================================
    ``(a, 0, 4), (b, 2, 3)``, 3..6  ``(a, 3, 1, 0), (b, 2, 2, 1)``
    ==============================  ============================================
    """
    out, at = [], 0
    for item, start, n in spans:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((item, start + a - at, b - a, a - lo))
        at += n
    return out


class LazyTensor(ABC):
    """A tensor of known ``shape`` and ``dtype`` whose bytes are read when asked for."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    #: Does reading any box read the whole tensor? (Then a reader asks for it in one box.)
    box_reads_whole: bool = False

    @abstractmethod
    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The box of this tensor at ``offsets`` of size ``sizes``, copied into ``out`` when given
        (any strides), else returned contiguous (a view of a mapped file where it lies in one
        place there, else a new tensor)."""

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        """The box as a contiguous view of where the bytes already are (a mapped file), or None
        when it is not one region there. Default: None."""
        return None

    def view_pieces(self, offsets: tuple[int, ...],
                    sizes: tuple[int, ...]) -> list[tuple[LazyTensor, torch.Tensor]] | None:
        """The box as contiguous views of where its bytes already are, in the box's byte order, each
        with the tensor whose :meth:`release` gives it back; None when a part is not one region of
        a mapped file. Default: :meth:`view_box`, as one piece."""
        view = self.view_box(offsets, sizes)
        return None if view is None else [(self, view)]

    def release(self, t: torch.Tensor) -> None:
        """``t`` (a view this tensor returned) has been written: give back what holds it (pages
        of a mapped file). Default: nothing."""

    def transposed(self) -> LazyTensor | None:
        """This tensor with its last two axes swapped, as a lazy tensor that reads it without
        transposing anything (a decoder whose codes are stored in that order), or None: a reader
        that wants the transpose then transposes what it reads. Default: None."""
        return None

    def _destination(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                     out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """Where :meth:`read_box` puts a box: ``(view, True)`` when no ``out`` is given and the box
        is one region of a mapped file (nothing left to copy), else ``(out or a new tensor, False)``."""
        if out is not None:
            return out, False
        view = self.view_box(offsets, sizes)
        if view is not None:
            return view, True
        return torch.empty(sizes, dtype=self.dtype), False

    def _box(self, dim: int, start: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets = tuple(start if i == dim else 0 for i in range(len(self.shape)))
        sizes = tuple(length if i == dim else d for i, d in enumerate(self.shape))
        return offsets, sizes

    def read(self, dim: int, start: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_box(*self._box(dim, start, length), out=out)

    def view(self, dim: int, start: int, length: int) -> torch.Tensor | None:
        return self.view_box(*self._box(dim, start, length))

    def views(self, dim: int, start: int, length: int) -> list[tuple[LazyTensor, torch.Tensor]] | None:
        return self.view_pieces(*self._box(dim, start, length))

    def materialize(self) -> torch.Tensor:
        return self.read_box(tuple(0 for _ in self.shape), tuple(self.shape))


def materialized(t: object) -> object:
    """``t`` itself, or its bytes when it is a :class:`LazyTensor`."""
    return t.materialize() if isinstance(t, LazyTensor) else t


class RowConcat(LazyTensor):
    """Rows of other lazy tensors, one after another: ``segments`` of ``(tensor, first row, rows)``.
    Fusing separate projections into one (Hugging Face's Q, K and V into megatron-core's grouped
    QKV; gate and up into SwiGLU's ``fc1``) is such a concatenation, so nothing is copied until a
    target reads a box; a box inside one segment is that tensor's own view (no copy).

    ==========================  ====================================================
    segments                    rows
    ==========================  ====================================================
    ``(a, 0, 4), (b, 2, 3)``    ``a[0:4]`` then ``b[2:5]``: 7 rows, the rest of each
                                row as in ``a`` and ``b`` (which must agree)
    ==========================  ====================================================
    """

    def __init__(self, segments: list[tuple[LazyTensor, int, int]]) -> None:
        first = segments[0][0]
        for t, start, rows in segments:
            if t.dtype != first.dtype or tuple(t.shape[1:]) != tuple(first.shape[1:]) or \
                    start < 0 or rows < 0 or start + rows > t.shape[0]:
                raise ValueError(f"cannot concatenate rows [{start}, {start + rows}) of {t!r} after {first!r}")
        self.segments = segments
        self.shape = (sum(rows for _, _, rows in segments), *first.shape[1:])
        self.dtype = first.dtype

    def _pieces(self, lo: int, hi: int) -> list[tuple[LazyTensor, int, int, int]]:
        """``(tensor, its first row, rows, row in the box)`` covering rows ``[lo, hi)``."""
        return overlaps(self.segments, lo, hi)

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        pieces = self._pieces(offsets[0], offsets[0] + sizes[0])
        if len(pieces) != 1:
            return None
        t, start, rows, _ = pieces[0]
        return t.view_box((start, *offsets[1:]), (rows, *sizes[1:]))

    def view_pieces(self, offsets: tuple[int, ...],
                    sizes: tuple[int, ...]) -> list[tuple[LazyTensor, torch.Tensor]] | None:
        """Each segment's rows of the box as views of its own tensor: a grouped QKV fused from Hugging
        Face's Q, K and V is written straight from their mappings, group by group, not gathered
        into a buffer first (a box narrower than a row is one view only a row at a time)."""
        out: list[tuple[LazyTensor, torch.Tensor]] = []
        for t, start, rows, _ in self._pieces(offsets[0], offsets[0] + sizes[0]):
            got = t.view_pieces((start, *offsets[1:]), (rows, *sizes[1:]))
            if got is None:
                return None
            out += got
        return out

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        out, done = self._destination(offsets, sizes, out)
        if done:
            return out
        for t, start, rows, at in self._pieces(offsets[0], offsets[0] + sizes[0]):
            t.read_box((start, *offsets[1:]), (rows, *sizes[1:]), out=out.narrow(0, at, rows))
        return out

    def release(self, t: torch.Tensor) -> None:
        for src in {id(s): s for s, _, _ in self.segments}.values():
            src.release(t)

    def __repr__(self) -> str:
        return f"RowConcat({[(s, a, n) for s, a, n in self.segments]!r})"


class Converted(LazyTensor):
    """A tensor computed from a whole other one (a transpose, a row permutation that is no run of
    rows): each read converts the whole source and keeps only the box asked for, so memory is one
    such tensor at a time (nothing is cached between reads: a target is written tensor by tensor)."""

    box_reads_whole = True

    def __init__(self, source: LazyTensor, convert: Callable[[torch.Tensor], torch.Tensor],
                 shape: tuple[int, ...]) -> None:
        self.source, self.convert, self.shape, self.dtype = source, convert, tuple(shape), source.dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        whole = self.convert(self.source.materialize())
        if tuple(whole.shape) != self.shape or whole.dtype != self.dtype:
            raise ValueError(f"conversion of {self.source!r} gave {tuple(whole.shape)} {whole.dtype}, "
                             f"not {self.shape} {self.dtype}")
        box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        if out is None:
            return box.contiguous()
        out.copy_(box)
        return out

    def __repr__(self) -> str:
        return f"Converted({self.source!r}, shape={self.shape})"


class RowsDecoded(LazyTensor):
    """A 2-D tensor ``[rows, cols]`` decoded from stored codes a band of whole rows at a time:
    ``decode(first_row, n)`` gives rows ``[first_row, first_row + n)`` as a ``[n, cols]`` tensor
    of ``dtype``. A box decodes the bands of rows it covers and keeps its columns, so memory is the
    box and one band (:data:`band_elements` decoded values), never the whole tensor.

    Why whole rows: every quantized release format reshard reads scales along the input axis
    (groups of a row's columns), so a band of rows is decoded from one box of codes and one box
    of scales; a narrower box of columns is rarer (a row-parallel split) and costs one band."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, decode: Callable[[int, int], torch.Tensor],
                 label: str, band_elements: int = 1 << 20) -> None:
        self.shape, self.dtype, self.decode, self.label = tuple(shape), dtype, decode, label
        self.band = max(1, band_elements // max(1, shape[1]))

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (m, n) = offsets, sizes
        if out is not None and (out.dtype != self.dtype or tuple(out.shape) != (m, n)):
            raise ValueError(f"out is {out.dtype} {list(out.shape)}, the box {self.dtype} {[m, n]}")
        out = torch.empty((m, n), dtype=self.dtype) if out is None else out
        for r in range(r0, r0 + m, self.band):
            k = min(self.band, r0 + m - r)
            rows = self.decode(r, k)
            out[r - r0:r - r0 + k].copy_(rows[:, c0:c0 + n])
        return out

    def __repr__(self) -> str:
        return f"RowsDecoded({self.label}, shape={list(self.shape)}, dtype={self.dtype})"


def box_of(t: torch.Tensor | LazyTensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """A box of ``t``; from a lazy (mapped or remote) tensor copied into a buffer of its own, so the
    source gives back the pages it read (a box narrower than a row is no view to give back later)."""
    if isinstance(t, LazyTensor):
        return t.read_box(offsets, sizes, out=torch.empty(sizes, dtype=t.dtype))
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def read_rows(t: torch.Tensor | LazyTensor, first: int, n: int) -> torch.Tensor:
    """Rows ``first .. first + n`` of a 2-D tensor (:func:`box_of` of its whole width)."""
    return box_of(t, (first, 0), (n, t.shape[1]))
