"""A LoRA adapter merged into its base weight, read box by box: ``W + scale * B @ A``.

Why here: the merge is arithmetic on tensors, the same for every format and family. It is done in
float32 and cast once to the base weight's dtype (as PEFT's ``merge_and_unload`` on a float32 model
computes it), for the box a target reads only: memory is the box and the adapter's part of it (``r``
rows of A over the box's columns, the box's rows of B, each read when the box is: the adapter may be
lazy, so a model's adapters are never held whole), never the merged model.

=======================  ==============================================================
tensor                   shape
=======================  ==============================================================
``base`` (W)             ``[out, in]``
``a`` (LoRA's A)         ``[r, in]``
``b`` (LoRA's B)         ``[out, r]``
box (offsets, sizes)     rows ``o0 .. o0+s0`` of W and of B; columns ``o1 .. o1+s1`` of W and of A
=======================  ==============================================================
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.core.lazy import LazyTensor, box_of

#: Elements of a band of rows merged at once: 1 MiB of float32, so the band's ``B @ A`` is still in
#: the core's cache when the base is added to it.
CHUNK_ELEMENTS = 1 << 18


class LoraMerged(LazyTensor):
    """``base`` (a tensor or a lazy one, ``[out, in]``) with ``scale * b @ a`` added, in float32, cast
    once; ``a`` and ``b`` tensors or lazy ones."""

    def __init__(self, base: Any, a: Any, b: Any, scale: float) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = tuple(base.shape)
        self.dtype = base.dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (nr, nc) = offsets, sizes
        view = self.base.view_box(offsets, sizes) if isinstance(self.base, LazyTensor) else None
        w = view if view is not None else box_of(self.base, offsets, sizes)
        dst = torch.empty(sizes, dtype=self.dtype) if out is None else out
        rank = self.a.shape[0]
        a = box_of(self.a, (0, c0), (rank, nc)).to(torch.float32)
        b = box_of(self.b, (r0, 0), (nr, rank)).to(torch.float32)
        step = max(1, CHUNK_ELEMENTS // max(nc, 1))
        band = torch.empty((min(step, nr), nc), dtype=torch.float32)  # one float32 temporary, reused
        for i in range(0, nr, step):  # a band of rows at a time
            n = min(step, nr - i)
            delta = torch.matmul(b[i:i + n], a, out=band[:n])
            delta.mul_(self.scale)  # (B A) * scale, then + W: PEFT's order (get_delta_weight, then +=)
            delta.add_(w[i:i + n])  # in float32: W is promoted exactly, as W.float() would be, without its copy
            dst[i:i + n].copy_(delta)  # rounded once into the base's dtype
        if view is not None:  # read: the mapped file's pages are given back
            self.base.release(view)
        return dst

    def __repr__(self) -> str:
        return f"LoraMerged({self.shape}, {self.dtype}, r={self.a.shape[0]}, scale={self.scale})"
