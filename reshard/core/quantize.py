"""Symmetric int8 group quantization with DeepSpeed ``WeightQuantization`` semantics.

Per group of a flattened weight (``B`` bits)::

    s = 2**B / (2 * max|x| + 1e-5)          (float32)
    q = clamp(round(x * s), -2**(B-1), 2**(B-1) - 1)   stored as int8
    stored scale = 1 / s                    (dequantize: x ~= q * stored_scale)

Vectorized over all groups at once (no Python loop over groups); the arithmetic is the same
float32 operation sequence DeepSpeed uses, so results match it bit for bit.

*Pieces.* A target tensor is assembled from pieces, one per source rank it draws from (see
``layouts.py``). Each piece is quantized on its own in ``G`` groups (``2G`` for MLP weights
with extra grouping), in source element order, before placement. Scale layout of one weight
on a target rank, ``k`` pieces:

=================  ==========================  ================================
partition          scale order                 matches DeepSpeed merge
=================  ==========================  ================================
column / qkv       piece-major: ``[p0 g0..gG-1, p1 g0.., ...]``   ``cat(dim=0)``
row                group-major: ``[g0 p0..pk-1, g1 p0.., ...]``   ``cat(dim=1)``
=================  ==========================  ================================

The file's scale table is ``[layers, 4, width]``: rows ``[qkv, dense, h_to_4h, 4h_to_h]``,
each zero-padded on the right to the widest row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reshard.core.errors import LayoutError

#: Key under which a quantized output shard stores its scales and settings.
QUANT_KEY = "reshard_quantization"


def quantize_groups(x: torch.Tensor, bits: int, groups: int, key: str = "tensor"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in ``groups`` equal groups of its flattened elements.

    Returns ``(q, s)``: ``q`` int8 with ``x``'s shape on ``x``'s device, ``s`` float32 ``[groups]``
    (the multiplier, not yet inverted).
    """
    if not 1 <= bits <= 8:
        raise LayoutError(f"--bits {bits} does not fit int8", culprit=key, hint="use 1..8 bits")
    if x.numel() % groups:
        raise LayoutError(f"{x.numel()} elements do not split into {groups} equal groups",
                          culprit=key, hint="choose --groups dividing every quantized weight piece")
    flat = x.float().reshape(groups, -1)
    mx = torch.maximum(flat.amax(dim=1), flat.amin(dim=1).abs())
    s = float(1 << bits) / (2 * mx + 1e-5)
    q = (flat * s.unsqueeze(1)).round().clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return q.to(torch.int8).reshape(x.shape), s


def combine_piece_scales(piece_scales: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Join per-piece multipliers into the stored (inverted) scale vector of one weight."""
    if dim == 0:
        s = torch.cat(list(piece_scales))
    else:
        s = torch.stack(list(piece_scales), dim=1).reshape(-1)
    return 1 / s


def scale_table(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Stack per-layer ``[qkv, dense, h_to_4h, 4h_to_h]`` scale vectors into ``[L, 4, width]``."""
    width = max(v.numel() for row in layers for v in row)
    out = torch.zeros((len(layers), 4, width), dtype=torch.float32)
    for li, row in enumerate(layers):
        for si, v in enumerate(row):
            out[li, si, : v.numel()] = v.to(out.device)
    return out


def dequantize_piece(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_groups` for one piece: ``q * stored_scale`` per group."""
    g = scales.numel()
    return (q.float().reshape(g, -1) * scales.unsqueeze(1)).reshape(q.shape)
