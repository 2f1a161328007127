"""Many-to-one tensors: one Hugging Face tensor made of many megatron-core tensors, each a *slab*
of a new leading axis (GPT-OSS's and Llama 4's experts: one ``[E, ...]`` tensor per layer where
megatron-core holds ``E`` separate ones), and the fan-out back on import.

A :class:`Stacked` transform is a name-table row whose megatron-core template numbers the slabs
with a field (``{expert}``) that its Hugging Face template lacks: every megatron-core tensor of the
row names the same Hugging Face tensor. Each slab is made from its one megatron-core tensor alone,
so nothing is ever held but a slab:

* export: :func:`~reshard.models.hf_architectures.export_of` tells the writer which slab a tensor
  is (:attr:`~reshard.models.hf_architectures.Export.part`); the ``hf`` format lays the tensor out
  with the leading axis as long as the tensors naming it, writes the slabs in order, one at a
  time, and keeps them in one file (:func:`stacked_name`);
* import: :meth:`Stacked.fan_out` gives each megatron-core tensor as a lazy view of its slab
  (:class:`SlabView`): a transposed or interleaved slab is read whole once for its boxes, any
  other box reads only the rows of its slab that hold it (a view where the file is mapped), and
  the box is copied out.

Within a slab the transform may *transpose* (the last two axes: Hugging Face's ``[in, out]``
against megatron-core's ``[out, in]``) and hold megatron-core's ``halves`` fused rows
(SwiGLU's ``[gate; up]``) *interleaved* (row ``r`` of half ``j`` at Hugging Face row
``r * halves + j``) or concatenated as they are:

==============================  =====================================  ==============================
transform                       megatron-core tensor ``i``             Hugging Face slab ``i``
==============================  =====================================  ==============================
``Stacked(transpose=True,       ``[2f, h]`` = ``[gate; up]``           ``[h, 2f]``: columns gate 0,
halves=2, interleave=True)``                                           up 0, gate 1, up 1, ...
``Stacked(transpose=True,       ``[2f, h]``                            ``[h, 2f]``: all gate columns,
halves=2)``                                                            then all up columns
``Stacked(transpose=True)``     ``[h, f]``                             ``[f, h]``
``Stacked(halves=2,             ``[2f]`` (a bias)                      ``[2f]``: gate 0, up 0, ...
interleave=True)``
==============================  =====================================  ==============================

Pure: no files. The ``hf`` format (:mod:`reshard.formats.hf`) streams the bytes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lazy import LazyTensor
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import NameTable, OutTensor, WholeTensorTransform


class Stacked(WholeTensorTransform):
    """megatron-core tensors numbered by name field :attr:`stacks` as the slabs of one Hugging Face
    tensor (see the module table): ``transpose`` the last two axes, ``halves`` fused row blocks,
    ``interleave`` them row by row (else kept concatenated)."""

    def __init__(self, *, transpose: bool = False, halves: int = 1, interleave: bool = False,
                 stacks: str = "expert") -> None:
        if halves < 1 or (interleave and halves < 2):
            raise ValueError(f"halves {halves} with interleave {interleave}")
        self.transpose, self.halves, self.interleave, self.stacks = transpose, halves, interleave, stacks

    def __repr__(self) -> str:
        return (f"Stacked(transpose={self.transpose}, halves={self.halves}, interleave={self.interleave}, "
                f"stacks={self.stacks!r})")

    def slab_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face slab made of a megatron-core tensor of ``shape``."""
        return (*shape[:-2], shape[-1], shape[-2]) if self.transpose else tuple(shape)

    def core_shape(self, slab: tuple[int, ...]) -> tuple[int, ...]:
        """The megatron-core tensor a Hugging Face slab of shape ``slab`` holds."""
        return self.slab_shape(slab)  # a transpose is its own inverse

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        """The slab (the file's tensor is as many slabs as tensors name it, on a new leading axis)."""
        if not shape or shape[0] % self.halves or (self.transpose and len(shape) != 2):
            raise LayoutError(f"a tensor of {tuple(shape)} is no slab of {self.halves} equal row blocks"
                              + (", 2-D" if self.transpose else ""), culprit=names[0],
                              hint="export a model whose tensors this architecture stacks")
        return [OutTensor(names[0], self.slab_shape(shape))]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        """Export: the slab made of megatron-core tensor ``t`` (contiguous; ``t`` itself when the
        transform moves nothing)."""
        if self.transpose and t.dim() != 2:
            raise ValueError(f"a transposed slab needs a 2-D tensor, not {tuple(t.shape)}")
        rows = t.shape[0] // self.halves
        wide = _WIDE.get(self.halves * t.element_size())
        if self.interleave and self.transpose and wide is not None and t.is_contiguous():
            # slab column r * halves + j is row r of half j: row r of every half side by side (one
            # copy), then transposed as one wide element each (torch transposes 32-bit elements
            # about 3x as fast as 16-bit ones)
            pairs = torch.empty(rows, t.shape[1], self.halves, dtype=t.dtype, device=t.device)
            for j in range(self.halves):
                pairs[..., j] = t[j * rows:(j + 1) * rows]
            slab = pairs.view(wide).view(rows, t.shape[1]).t().contiguous()
            return [slab.view(t.dtype).view(t.shape[1], t.shape[0])]
        out = t
        if self.interleave:  # [j * rows + r] -> [r * halves + j]
            out = t.reshape(self.halves, rows, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        if self.transpose:
            out = out.t()
        return [out.contiguous()]

    def convert_transposed(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        """Export: :meth:`convert`'s slab with its last two axes swapped. Transposed, that is ``t``'s
        own rows (interleaved when the halves are: one copy of whole rows), nothing transposed:
        what MXFP4 encodes, ``[out, in]``."""
        if not self.transpose:
            return super().convert_transposed(t, facts)
        if t.dim() != 2:
            raise ValueError(f"a transposed slab needs a 2-D tensor, not {tuple(t.shape)}")
        if not self.interleave:
            return [t]
        rows = t.shape[0] // self.halves
        return [t.reshape(self.halves, rows, t.shape[1]).transpose(0, 1).reshape(t.shape)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        raise TypeError("a stacked tensor is many megatron-core tensors: read it with fan_out()")

    def fan_out(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> list[LazyTensor]:
        """Import: megatron-core tensor ``i`` as a lazy view of slab ``i`` of ``parts[0]``."""
        whole = parts[0]
        shape = tuple(whole.shape)
        if len(shape) < 2 or (self.transpose and len(shape) != 3) or self.core_shape(shape[1:])[0] % self.halves:
            raise CheckpointFormatError(f"is {shape}: not a stack of {'2-D ' if self.transpose else ''}slabs of "
                                        f"{self.halves} equal row blocks", culprit=names[0],
                                        hint="check the file against config.json")
        return [SlabView(whole, i, self) for i in range(shape[0])]


#: The integer dtype of an interleaved group's bytes (the halves' values of one row side by side).
_WIDE = {4: torch.int32, 8: torch.int64}


class SlabView(LazyTensor):
    """megatron-core tensor ``index`` of a stacked Hugging Face tensor ``source``.

    A slab that is transposed or interleaved is read whole, once, for all the boxes of it that
    follow: a box of megatron-core rows is then the slab's columns (every row of the slab touched),
    or one half's rows with the other half's between them, so reading each box on its own would
    read the slab again for every box (a mapped slab's pages faulted in and given back block after
    block; an MXFP4 slab decoded twice, once for the gate rows and once for the up rows). A source
    that reads its transpose without transposing (:meth:`~reshard.core.lazy.LazyTensor.transposed`:
    MXFP4's codes are stored ``[out, in]``) is read so; else the slab is read as stored (a view
    where the file is mapped) and a transposed one transposed once into memory, its mapped pages
    given back at once. Each thread holds one such slab: it is given back once every element of
    the tensor has been served, or when the thread reads another slab.

    Any other slab (neither transposed nor interleaved) is read box by box: the rows of the slab
    that hold the box. Memory: the box, and the slab or what ``source`` reads for the box."""

    def __init__(self, source: LazyTensor, index: int, transform: Stacked) -> None:
        self.source, self.index, self.transform = source, index, transform
        self.shape = transform.core_shape(tuple(source.shape[1:]))
        self.dtype = source.dtype
        self.whole = transform.transpose or transform.interleave
        # a transposed slab from a source that reads its transpose as stored: megatron-core's layout
        self.rows_source = source.transposed() if transform.transpose else None

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        t = self.transform
        k, rows = t.halves, self.shape[0] // t.halves
        step = k if t.interleave else 1
        lo, hi = offsets[0], offsets[0] + sizes[0]
        parts = []  # (half, its first row in the box, rows, first Hugging Face row)
        for j in range(k):
            a, b = max(lo, j * rows), min(hi, (j + 1) * rows)
            if a < b:
                r = a - j * rows
                parts.append((j, a - lo, b - a, r * k + j if t.interleave else j * rows + r))
        if out is None:
            out = torch.empty(sizes, dtype=self.dtype)
        if not parts or 0 in sizes:
            return out
        rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))
        if self.whole:
            band = self._band()
            for _, at, n, start in parts:
                out.narrow(0, at, n).copy_(band.rows[start::step][:n][(slice(None), *rest)])
            band.left -= math.prod(sizes)
            if band.left <= 0:
                _bands.band = None
                band.give_back()
            return out
        first = min(p[3] for p in parts)
        last = max(p[3] + p[2] for p in parts)
        got = self.source.read_box((self.index, first, *offsets[1:]), (1, last - first, *sizes[1:]))
        for _, at, n, start in parts:
            out.narrow(0, at, n).copy_(got[0][start - first:start - first + n])
        self.source.release(got)
        return out

    def _band(self) -> _Band:
        """This slab read whole (this thread's, read now unless it holds it already)."""
        held = getattr(_bands, "band", None)
        if held is not None and held.view is self:
            return held
        if held is not None:
            _bands.band = None
            held.give_back()
        if self.rows_source is not None:
            reader = self.rows_source
            got = reader.read_box((self.index, 0, 0), (1, *self.shape))
            hf_rows = got[0]
        else:
            reader = self.source
            got = reader.read_box((self.index, *(0 for _ in self.shape)), (1, *self.source.shape[1:]))
            hf_rows = got[0]
            if self.transform.transpose:  # transposed once, blocked (boxes of its columns copy slowly)
                hf_rows = hf_rows.t().contiguous()
                reader.release(got)
                got = hf_rows
        band = _bands.band = _Band(self, hf_rows, got, reader)
        return band

    def __repr__(self) -> str:
        return f"SlabView({self.source!r}[{self.index}], {self.transform!r})"


class _Band:
    """A slab :class:`SlabView` read whole: its Hugging Face rows in slab order (a transposed
    slab's columns), what ``reader`` returned for it (given back at the end), and the elements of
    the megatron-core tensor not served from it yet."""

    def __init__(self, view: SlabView, rows: torch.Tensor, got: torch.Tensor, reader: LazyTensor) -> None:
        self.view, self.rows, self.got, self.reader = view, rows, got, reader
        self.left = math.prod(view.shape)

    def give_back(self) -> None:
        self.reader.release(self.got)


#: Each thread's slab read whole (:class:`SlabView`): one at a time.
_bands = threading.local()


def stacked_name(key: str, tables: Sequence[NameTable]) -> str | None:
    """The Hugging Face tensor megatron-core tensor ``key`` is a slab of, in the first of ``tables``
    whose rows name it (None: no stacking row names it): the tensors one name stands for are
    written into one file, so a file cut never falls between them."""
    for table in tables:
        for row in table:
            if row.transform is None or row.transform.stacks is None:
                continue
            m = next((m for m in (p.match(key) for p in row.core_patterns) if m), None)
            if m is not None:
                return row.hf[0].format(**m.groupdict())
    return None

