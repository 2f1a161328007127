"""A LoRA adapter merged into its base weight, read box by box: ``W + scale * B @ A``.

Why here: the merge is arithmetic on tensors, the same for every format and family. It is done in
float32 and cast once to the base weight's dtype (as PEFT's ``merge_and_unload`` on a float32 model
computes it), for the box a target reads only: memory is the box and the adapter (``r`` rows of A,
the box's rows of B), never the merged model.

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
    """``base`` (a tensor or a lazy one, ``[out, in]``) with ``scale * b @ a`` added, in float32, cast once."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = tuple(base.shape)
        self.dtype = base.dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (nr, nc) = offsets, sizes
        view = self.base.view_box(offsets, sizes) if isinstance(self.base, LazyTensor) else None
        w = view if view is not None else box_of(self.base, offsets, sizes)
        dst = torch.empty(sizes, dtype=self.dtype) if out is None else out
        a = self.a[:, c0:c0 + nc].to(torch.float32)
        step = max(1, CHUNK_ELEMENTS // max(nc, 1))
        for i in range(0, nr, step):  # a band of rows at a time: float32 temporaries of CHUNK_ELEMENTS
            n = min(step, nr - i)
            delta = self.b[r0 + i:r0 + i + n].to(torch.float32) @ a
            delta.mul_(self.scale)  # (B A) * scale, then + W: PEFT's order (get_delta_weight, then +=)
            # the sum is computed in float32 (W is promoted exactly) and rounded once into dst's dtype:
            # the same bits as adding W.float() and casting, without those two passes over the band
            torch.add(delta, w[i:i + n], out=dst[i:i + n])
        if view is not None:  # read: the mapped file's pages are given back
            self.base.release(view)
        return dst

    def __repr__(self) -> str:
        return f"LoraMerged({self.shape}, {self.dtype}, r={self.a.shape[0]}, scale={self.scale})"
