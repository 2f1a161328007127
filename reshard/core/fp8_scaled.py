"""compressed-tensors' ``float-quantized`` FP8 weights (per tensor, per channel, per group or per
block, as many FP8 releases store them): the codec's arithmetic. Pure: tensors in, tensors out.

A weight ``W`` ``[out, in]`` is stored as ``X.weight`` float8_e4m3fn ``[out, in]`` and
``X.weight_scale`` in the release's scale dtype ``sd`` (bf16 or float32), one of

============  ====================================  ===============================================
strategy      ``weight_scale``                      the scale of element ``(r, c)``
============  ====================================  ===============================================
tensor        ``[1]``                               ``S[0]``
channel       ``[out, 1]``                          ``S[r, 0]``
group         ``[out, in/group]``                   ``S[r, c // group]``
block         ``[ceil(out/b0), ceil(in/b1)]``       ``S[r // b0, c // b1]``
============  ====================================  ===============================================

Dequantized as compressed-tensors' decompressor computes it: ``W = q.to(sd) * scale`` in ``sd``
(the e4m3 value is exact there), then cast to the model's dtype: the same operation on the same
dtypes, so the same bits. (DeepSeek's own FP8 blocks, ``weight_scale_inv`` float32, are
:mod:`reshard.core.fp8_block`.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

E4M3 = torch.float8_e4m3fn


def scale_shape(strategy: str, shape: Sequence[int], group: int | None,
                block: Sequence[int] | None) -> tuple[int, ...]:
    """The ``weight_scale`` shape of a ``[out, in]`` weight under ``strategy``."""
    out, inp = shape
    if strategy == "channel":
        return out, 1
    if strategy == "group":
        return out, inp // int(group or 1)
    if strategy == "block":
        b0, b1 = block or (1, 1)
        return math.ceil(out / b0), math.ceil(inp / b1)
    return (1,)


def band_scales(scale: torch.Tensor, strategy: str, first: int, n: int, columns: int,
                block: Sequence[int] | None) -> torch.Tensor:
    """The scales of rows ``first .. first + n`` as ``[n, g]`` with ``columns`` divided evenly
    into ``g`` runs (``scale`` the whole stored scale tensor, small beside the weight)."""
    if strategy == "tensor":
        return scale.reshape(1, 1).expand(n, 1)
    if strategy in ("channel", "group"):
        return scale[first:first + n]
    b0, b1 = block or (1, 1)
    rows = scale[torch.arange(first, first + n) // b0]  # [n, ceil(in/b1)]
    return rows.repeat_interleave(b1, dim=1)[:, :columns]  # one scale a column


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype`` ``[n, in]`` from e4m3 ``q`` ``[n, in]`` and the band's scales ``[n, g]``
    (:func:`band_scales`): compressed-tensors' ``q.to(sd) * scale`` in the scale's dtype, cast."""
    n, columns = q.shape
    groups = scale.shape[-1]
    x = q.view(n, groups, columns // groups).to(scale.dtype)
    return (x * scale.unsqueeze(-1)).view(n, columns).to(dtype)


#: The largest e4m3 value: the clamp of a code, and what a channel's largest magnitude maps to.
E4M3_MAX = 448.0


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3 [n, in], scale [n, 1])`` of rows ``w`` ``[n, in]``, a scale a row (compressed-tensors'
    ``channel`` strategy), as compressed-tensors computes them (a min-max observer's
    ``calculate_qparams``, then its compressor's ``quantize``), in ``w``'s dtype ``d`` (the
    scale's, as compressed-tensors gives the scale the weight's dtype):

    ==========  ========================================================================================
    step        per row, in ``d``
    ==========  ========================================================================================
    range       ``m = max(|min(amin, 0)|, |max(amax, 0)|)``
    scale       ``s = m / 448``, one rounding to ``d``; a zero ``s`` is ``d``'s ``eps``
    code        ``clamp(x / s, -448, 448)`` (``x / s`` rounded to ``d`` first), cast to e4m3 (nearest,
                halves to even)
    ==========  ========================================================================================

    Rows are independent: a band of rows gives the rows' codes and scales of the whole weight."""
    s = range_scale(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True))
    return quantize_with(w, s), s


def range_scale(amin: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric FP8 scale of a range: ``max(|min(amin, 0)|, |max(amax, 0)|) /
    448`` in the range's dtype, ``eps`` for an all-zero range. A row's range gives its channel
    scale; a whole weight's, the minimum and maximum of its bands', its ``tensor`` scale."""
    m = torch.maximum(torch.clamp(amin, max=0).abs(), torch.clamp(amax, min=0).abs())
    s = m / E4M3_MAX
    return torch.where(s == 0, torch.tensor(torch.finfo(s.dtype).eps, dtype=s.dtype), s)


def tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """The ``tensor`` strategy's one scale ``[1]`` of the whole weight ``w`` (the channel rule
    over all its values): :func:`quantize_with` then makes any band's codes."""
    return range_scale(w.amin().reshape(1), w.amax().reshape(1))


def quantize_with(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``w`` under ``scale`` (broadcast: ``[n, 1]`` or ``[1]``): ``clamp(w / s, -448,
    448)`` in ``w``'s dtype, cast to e4m3 (nearest, halves to even)."""
    return (w / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
