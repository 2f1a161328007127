"""compressed-tensors' ``pack-quantized`` integer weights (W4A16 as Kimi-K2-Thinking and K2.5 ship
it, and other sub-byte INT widths): the codec's arithmetic. Pure: tensors in, tensors out.

A weight ``W`` ``[out, in]`` quantized to ``b``-bit integers (``b`` dividing 32) is stored as

=======================  ===============================  ==========================================
tensor                   shape, dtype                     what
=======================  ===============================  ==========================================
``X.weight_packed``      ``[out, in*b/32]`` int32         ``32/b`` codes a word, element ``k`` of a
                                                          row at bits ``k*b % 32`` of word
                                                          ``k*b // 32`` (least significant first),
                                                          each stored as ``q + 2**(b-1)``
``X.weight_scale``       ``[out, in/group]`` (group),     the scale, in the release's dtype (bf16)
                         ``[out, 1]`` (channel), ``[1]``
                         (tensor)
``X.weight_zero_point``  ``[out*b/32, in/group]`` int32   asymmetric only: the zero points, packed
                                                          the same way along ``out`` (axis 0)
``X.weight_shape``       ``[2]`` int                      ``[out, in]``
``X.weight_g_idx``       ``[in]`` int32                   activation order: column ``k``'s group
=======================  ===============================  ==========================================

Dequantized as compressed-tensors' decompressor computes it (``unpack_from_int32`` then
``dequantize``), in the scale's dtype ``sd``: ``W = (q.to(sd) - zp.to(sd)) * scale``, a group's
scale (and zero point) shared by ``group`` consecutive columns of a row, then cast to the model's
dtype. The same operations on the same dtypes give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Bits of the word codes are packed into.
WORD_BITS = 32


def offset(num_bits: int) -> int:
    """What a stored code adds to the signed value: ``2**(b-1)`` (an int4 ``-8..7`` as ``0..15``)."""
    return 1 << (num_bits - 1)


def packed_width(columns: int, num_bits: int) -> int:
    """Words a row of ``columns`` ``num_bits``-bit codes takes."""
    return -(-columns * num_bits // WORD_BITS)


def unpack_rows(words: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """``int8`` ``[n, columns]``: the signed codes of ``words`` int32 ``[n, w]`` (see the module
    table), least significant code first."""
    per = WORD_BITS // num_bits
    shifts = torch.arange(0, WORD_BITS, num_bits, dtype=torch.int32, device=words.device)
    codes = torch.bitwise_right_shift(words.unsqueeze(-1), shifts).bitwise_and_((1 << num_bits) - 1)
    codes = codes.view(words.shape[0], words.shape[1] * per)[:, :columns]
    return codes.sub_(offset(num_bits)).to(torch.int8)


def unpack_columns(words: torch.Tensor, num_bits: int, rows: int, first: int, n: int) -> torch.Tensor:
    """``int8`` ``[n, g]``: rows ``first .. first + n`` of a tensor ``[rows, g]`` packed along its
    rows (axis 0, as the zero points are), given ``words`` int32: the word rows covering them,
    from word row ``first * b // 32``."""
    codes = unpack_rows(words.t().contiguous(), num_bits, words.shape[0] * (WORD_BITS // num_bits)).t()
    skip = first - (first * num_bits // WORD_BITS) * (WORD_BITS // num_bits)
    return codes[skip:skip + n]


def zero_point_words(first: int, n: int, num_bits: int) -> tuple[int, int]:
    """``(first word row, word rows)`` of zero points packed along axis 0 covering rows
    ``first .. first + n``."""
    per = WORD_BITS // num_bits
    lo, hi = first // per, -(-(first + n) // per)
    return lo, hi - lo


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """``dtype`` ``[n, in]`` from signed ``codes`` int8 ``[n, in]`` and a band's ``scale`` (and
    ``zero_point``) ``[n, g]`` (``g`` groups of ``in/g`` columns; 1 for channel and tensor
    scales, broadcast): compressed-tensors' ``(q.to(sd) - zp.to(sd)) * scale`` in the scale's
    dtype ``sd``, then cast."""
    n, columns = codes.shape
    groups = scale.shape[-1]
    x = codes.view(n, groups, columns // groups).to(scale.dtype)
    if zero_point is not None:
        x = x - zero_point.to(scale.dtype).unsqueeze(-1)
    return (x * scale.unsqueeze(-1)).view(n, columns).to(dtype)


def identity_groups(g_idx: torch.Tensor, group: int) -> bool:
    """Is ``g_idx`` the plain order (column ``k`` in group ``k // group``), which the layout
    already says?"""
    k = torch.arange(g_idx.shape[0], dtype=torch.int64)
    return bool(torch.equal(g_idx.to(torch.int64), k // group))


def scale_shape(strategy: str, shape: Sequence[int], group: int | None) -> tuple[int, ...]:
    """The ``weight_scale`` shape of a ``[out, in]`` weight under ``strategy``."""
    out, inp = shape
    if strategy == "group":
        return out, inp // int(group or 1)
    if strategy == "channel":
        return out, 1
    return (1,)


# --- the encode side (``--quantize w4a16``) ------------------------------------------------------


def quantize_symmetric(w: torch.Tensor, num_bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [n, in], scale [n, in/group])`` of rows ``w`` ``[n, in]`` (``in`` a multiple
    of ``group``), symmetric, as compressed-tensors computes them (a min-max observer's
    ``calculate_qparams``, then its compressor's ``quantize``), every step in ``w``'s dtype ``d``
    (the scale's, as compressed-tensors gives the scale the weight's dtype):

    ====================  ==========================================================================
    step                  per group of ``group`` consecutive columns of a row, in ``d``
    ====================  ==========================================================================
    range                 ``m = max(|min(amin, 0)|, |max(amax, 0)|)``
    scale                 ``s = m / ((2**b - 1) / 2)`` (``/ 7.5`` for int4), one rounding to ``d``;
                          a zero ``s`` is ``d``'s ``eps`` (compressed-tensors' guard)
    code                  ``round(clamp(x / s, -2**(b-1), 2**(b-1) - 1))``, ``x / s`` rounded to
                          ``d`` first, halves to even
    ====================  ==========================================================================

    Rows are independent: a band of rows gives the rows' codes and scales of the whole weight."""
    n, columns = w.shape
    x = w.view(n, columns // group, group)
    lo = torch.clamp(x.amin(-1), max=0)
    hi = torch.clamp(x.amax(-1), min=0)
    s = torch.maximum(lo.abs(), hi.abs()) / (((1 << num_bits) - 1) / 2)
    s = torch.where(s == 0, torch.tensor(torch.finfo(s.dtype).eps, dtype=s.dtype), s)
    lim = offset(num_bits)
    q = (x / s.unsqueeze(-1)).clamp_(-lim, lim - 1).round_()
    return q.to(torch.int8).view(n, columns), s


def pack_rows(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int32 ``[n, in*b/32]`` from signed ``codes`` int8 ``[n, in]`` (``in*b`` a multiple of 32):
    the module table's packing, the inverse of :func:`unpack_rows` (each code ``+ 2**(b-1)``,
    least significant first; a word's top bit is its sign, as two's complement gives it: torch
    shifts a signed word as its unsigned bits). One shift and OR per code of a word, in int32."""
    n, columns = codes.shape
    per = WORD_BITS // num_bits
    fields = (codes.to(torch.int32) + offset(num_bits)).view(n, columns // per, per)
    words = fields[..., 0].clone()
    for k in range(1, per):
        words.bitwise_or_(torch.bitwise_left_shift(fields[..., k], k * num_bits))
    return words
