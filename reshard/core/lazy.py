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
``read_box`` / ``view_box``        any box (``offsets``, ``sizes``)
``materialize()``                  the whole tensor (small replicated tensors, checks)
=================================  ===================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LazyTensor(ABC):
    """A tensor of known ``shape`` and ``dtype`` whose bytes are read when asked for."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

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

    def release(self, t: torch.Tensor) -> None:
        """``t`` (a view this tensor returned) has been written: give back what holds it (pages
        of a mapped file). Default: nothing."""

    def _box(self, dim: int, start: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets = tuple(start if i == dim else 0 for i in range(len(self.shape)))
        sizes = tuple(length if i == dim else d for i, d in enumerate(self.shape))
        return offsets, sizes

    def read(self, dim: int, start: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_box(*self._box(dim, start, length), out=out)

    def view(self, dim: int, start: int, length: int) -> torch.Tensor | None:
        return self.view_box(*self._box(dim, start, length))

    def materialize(self) -> torch.Tensor:
        return self.read_box(tuple(0 for _ in self.shape), tuple(self.shape))


def materialized(t: object) -> object:
    """``t`` itself, or its bytes when it is a :class:`LazyTensor`."""
    return t.materialize() if isinstance(t, LazyTensor) else t
