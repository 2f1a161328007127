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

from reshard.core.lazy import LazyTensor


def _box(t: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    if isinstance(t, LazyTensor):
        return t.read_box(offsets, sizes)
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


class LoraMerged(LazyTensor):
    """``base`` (a tensor or a lazy one, ``[out, in]``) with ``scale * b @ a`` added, in float32, cast once."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = tuple(base.shape)
        self.dtype = base.dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (nr, nc) = offsets, sizes
        w = _box(self.base, offsets, sizes).to(torch.float32)
        delta = self.b[r0:r0 + nr].to(torch.float32) @ self.a[:, c0:c0 + nc].to(torch.float32)
        merged = (w + self.scale * delta).to(self.dtype)
        if out is None:
            return merged
        out.copy_(merged)
        return out

    def __repr__(self) -> str:
        return f"LoraMerged({self.shape}, {self.dtype}, r={self.a.shape[0]}, scale={self.scale})"
