"""MXFP4 weights (the OCP Microscaling format's FP4, as GPT-OSS is released and transformers and vLLM
load it): the codec. Pure: tensors in, tensors out, no files.

A weight ``X`` whose model layout is ``[*, in, out]`` (a stacked linear layer's slabs, ``x @ X[e]``)
is stored as two ``uint8`` tensors, ``X_blocks`` and ``X_scales``, over its transpose ``W = X^T``
``[*, out, in]``: every run of :data:`GROUP` (32) values along the input axis shares one scale.
``config.json`` says so: ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert":
[...]}``.

=================  ================================  ==============================================
tensor             shape, dtype                      what
=================  ================================  ==============================================
``W``              ``[*, out, in]`` float            the weight, ``in`` a multiple of 32
``X_blocks``       ``[*, out, in/32, 16]`` uint8     two e2m1 codes a byte: byte ``j`` of group
                                                     ``g`` holds column ``32g + 2j`` in its low
                                                     nibble, ``32g + 2j + 1`` in its high one
``X_scales``       ``[*, out, in/32]`` uint8         e8m0: the group's scale ``2**(s - 127)``
=================  ================================  ==============================================

An e2m1 code is a sign bit (``8``) over a magnitude index ``0..7`` into :data:`E2M1_MAGNITUDES`
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.

==============  ========================================================================
direction       per group ``G`` of 32 values of a row (its scale byte ``s``)
==============  ========================================================================
dequantize      ``W[G] = (E2M1[code] * 2**(s - 127)).to(dtype)``: the product is exact in
                float64 (and float32 except at the extremes of ``s``), rounded once to ``dtype``
                — bit-equal to transformers' ``convert_moe_packed_tensors`` (``torch.ldexp``
                of its bf16 table) for every code and every scale, 255 included (whose
                products overflow bf16 to infinities as there; OCP calls that scale NaN)
quantize        the OCP Microscaling rule: ``amax = max |W[G]|``, ``s = floor(log2(amax)) - 2
                + 127`` (e2m1's largest power of two is ``2**2``), clamped to ``0..254``; an
                all-zero group's scale is 0 (``floor(log2(0))`` clamped: the smallest scale, as
                torchao's MX casts write it); each ``W[G] / 2**(s - 127)`` rounded to the nearest
                e2m1 value, ties to the even code, magnitudes above 6 saturated to 6, the sign
                kept (a negative value rounding to 0 is code 8, -0); a NaN or an infinity is
                refused (:class:`NonFiniteWeightError`)
==============  ========================================================================

Both work a band of rows at a time (:data:`BAND_ELEMENTS`), so memory is the output and one band's
buffers, never a second copy of the whole tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from reshard.core.fp8_block import NonFiniteWeightError
from reshard.core.lazy import LazyTensor, box_of

__all__ = ["BLOCKS_SUFFIX", "E2M1_MAGNITUDES", "GROUP", "METHOD", "NonFiniteWeightError", "SCALES_SUFFIX", "SCALE_BIAS",
           "Mxfp4Dequantized", "Mxfp4Rows", "blocks_shape", "dequantize", "quantize", "scales_shape"]

#: ``quantization_config.quant_method`` of an MXFP4 release (and ``--quantize mxfp4``).
METHOD = "mxfp4"
#: Values along the input axis that share one scale.
GROUP = 32
#: Bytes a group's codes take (two codes a byte).
GROUP_BYTES = GROUP // 2
#: e8m0's bias: a scale byte ``s`` is ``2**(s - SCALE_BIAS)``.
SCALE_BIAS = 127
#: The largest scale byte the quantizer writes (255 is e8m0's NaN).
SCALE_MAX = 254
#: e2m1's magnitudes by index (a code is the sign bit ``8`` over this index).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: e2m1's largest power of two: a group's scale is ``2**(floor(log2(amax)) - E2M1_EMAX)``.
E2M1_EMAX = 2
#: The magnitudes between neighbouring e2m1 values, each with the side its tie rounds to (the even
#: code: 0, 1.0 (code 2), 1.0, 2.0 (code 4), 2.0, 4.0 (code 6), 4.0); above the last, 6.
_MIDPOINTS = ((0.25, "down"), (0.75, "up"), (1.25, "down"), (1.75, "up"), (2.5, "down"), (3.5, "up"), (5.0, "down"))
#: The names of a quantized tensor ``X``'s two stored tensors.
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
#: Elements per band while converting: the band's float32 buffers stay a few MiB.
BAND_ELEMENTS = 1 << 20


def blocks_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``X_blocks``' shape for a weight ``W`` of ``shape`` ``[*, out, in]``."""
    *lead, out, inp = shape
    return (*lead, out, inp // GROUP, GROUP_BYTES)


def scales_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``X_scales``' shape for a weight ``W`` of ``shape`` ``[*, out, in]``."""
    *lead, out, inp = shape
    return (*lead, out, inp // GROUP)


@functools.lru_cache(maxsize=8)
def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """``[256 * 256, 2]`` ``dtype``: row ``s * 256 + byte`` is the byte's two values (low nibble,
    high nibble) under scale ``s``, each the float64 product rounded once to ``dtype``."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    values = torch.cat([magnitudes, -magnitudes])  # codes 0..15
    byte = torch.arange(256)
    pairs = torch.stack([values[byte & 15], values[byte >> 4]], dim=-1)  # [256, 2]
    powers = torch.pow(2.0, torch.arange(256, dtype=torch.float64) - SCALE_BIAS)  # [256]
    return (powers.view(256, 1, 1) * pairs).to(dtype).view(256 * 256, 2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``W`` ``[*, out, in]`` of ``dtype`` from ``blocks`` ``[*, out, in/32, 16]`` and ``scales``
    ``[*, out, in/32]`` (see the module table), into ``out`` (contiguous) when given.

    Why a table: a byte and its group's scale decide both of the byte's values, so one row of a
    ``[65536, 2]`` table (:func:`_pair_table`, 256 KiB in bf16) indexed by ``scale * 256 + byte``
    is one gather per byte for two outputs, with no float arithmetic on the weight itself; the two
    gathered as one integer of twice the width (a 16-bit dtype's pair as an ``int32``)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != GROUP_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)} are no MXFP4 pair")
    *lead, rows, groups, _ = blocks.shape
    width = groups * GROUP
    if out is None:
        out = torch.empty((*lead, rows, width), dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != (*lead, rows, width) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out is {out.dtype} {list(out.shape)}, not a contiguous {dtype} {[*lead, rows, width]}")
    pair = _PAIR_INTS.get(dtype.itemsize)
    table = _pair_table(dtype).to(blocks.device)
    if pair is not None:  # a pair gathered as one integer: several times faster than as a row of two
        table = table.view(pair).view(-1)
    flat_b = blocks.reshape(-1, groups, GROUP_BYTES)
    flat_s = scales.reshape(-1, groups)
    flat_o = out.view(-1, width)
    band = max(1, BAND_ELEMENTS // max(1, width))
    index = torch.empty(min(band, flat_b.shape[0]) * groups * GROUP_BYTES, dtype=torch.int32, device=blocks.device)
    for r in range(0, flat_b.shape[0], band):
        b = flat_b[r:r + band]
        i = torch.add(flat_s[r:r + band].to(torch.int32).mul_(256).unsqueeze(-1), b,
                      out=index[:b.numel()].view(b.shape))
        o = flat_o[r:r + band]
        torch.index_select(table, 0, i.view(-1), out=o.view(pair).view(-1) if pair is not None else o.view(-1, 2))
    return out


#: The integer dtype as wide as two values of an itemsize: a byte's pair of values as one element.
_PAIR_INTS = {1: torch.int16, 2: torch.int32, 4: torch.int64}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 holds every bf16, fp16 and float32 value and power of two exactly; float64 its own."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=4)
def _midpoints(dtype: torch.dtype) -> torch.Tensor:
    """The rounding boundaries as strict lower bounds: a magnitude ``a`` rounds to index
    ``#{b : a > b}``, so a tie that rounds up is stored as the largest value below it."""
    points = []
    for m, side in _MIDPOINTS:
        t = torch.tensor(m, dtype=dtype)
        points.append(torch.nextafter(t, torch.tensor(0.0, dtype=dtype)) if side == "up" else t)
    return torch.stack(points)


def quantize(w: torch.Tensor, *, blocks: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X_blocks, X_scales)`` of a weight ``w`` ``[*, out, in]`` (any strides, ``in`` a multiple
    of 32) by the OCP Microscaling rule (see the module table), a band of rows at a time, into
    ``blocks``/``scales`` when given. A ``w`` whose inputs are not contiguous (a slab stored
    ``[in, out]``, transposed) is copied contiguous first: memory, one more copy of ``w``.

    How, for bfloat16 on a CPU (what releases and fine-tunes hold): from the band's bits, in place,
    one table gather per value (:class:`_Bf16Bands`). Otherwise: per band, the rows copied into a
    float32 buffer; each group's largest magnitude; its
    exponent from ``frexp`` (exact, subnormals included: ``amax = m * 2**e``, ``m`` in
    ``[0.5, 1)``, so ``floor(log2(amax)) = e - 1``); the band multiplied by ``2**-(s - 127)``
    (exact: a power of two, and a value it would make subnormal rounds to code 0 anyway); the
    code looked up by the value's top bits (:func:`_codes_by_bits`; float64 weights: the magnitude
    index counted against the midpoints, :func:`torch.bucketize`, ties placed by
    :data:`_MIDPOINTS`, and the sign bit added), two codes packed a byte."""
    if w.dim() < 2 or w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 quantizes [*, out, in] weights whose in is a multiple of {GROUP}, not "
                         f"{list(w.shape)}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"MXFP4 quantizes floating-point weights, not {w.dtype}")
    *lead, rows, width = w.shape
    groups = width // GROUP
    if blocks is None:
        blocks = torch.empty(blocks_shape(w.shape), dtype=torch.uint8, device=w.device)
    if scales is None:
        scales = torch.empty(scales_shape(w.shape), dtype=torch.uint8, device=w.device)
    if tuple(blocks.shape) != blocks_shape(w.shape) or tuple(scales.shape) != scales_shape(w.shape):
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit {list(w.shape)}")
    compute = _compute_dtype(w.dtype)
    if w.stride(-1) != 1:  # a transposed slab: one blocked copy first, a strided band copy is ~3x slower
        w = w.contiguous()
    flat_w = w.reshape(-1, rows, width) if lead else w.unsqueeze(0)
    flat_b = blocks.view(-1, rows, groups, GROUP_BYTES)
    flat_s = scales.view(-1, rows, groups)
    band = min(rows, max(1, BAND_ELEMENTS // max(1, width)))
    by_bits = _Bf16Bands(band, width, w.device) if w.dtype == torch.bfloat16 and w.device.type == "cpu" else None
    # the band's copy, worked in place (bfloat16 on a CPU is read from its bits and needs none)
    buffer = torch.empty((0 if by_bits else band, width), dtype=compute, device=w.device)
    for i in range(flat_w.shape[0]):
        for r in range(0, rows, band):
            part = flat_w[i, r:r + band]
            n = part.shape[0]
            if by_bits is not None:
                by_bits.quantize(part.reshape(n, groups, GROUP), r, flat_b[i, r:r + n], flat_s[i, r:r + n])
                continue
            x = buffer[:n]
            x.copy_(part)
            codes, s = _quantize_band(x.view(-1, groups, GROUP), r)
            flat_b[i, r:r + n] = codes
            flat_s[i, r:r + n] = s
    return blocks, scales


def _quantize_band(x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [n, groups, 16], scales [n, groups])`` of a band ``x`` ``[n, groups, 32]`` (a copy
    of the weight's rows, in the compute dtype; overwritten)."""
    amax = x.abs().amax(dim=-1)
    _refuse_non_finite(torch.isfinite(amax), first)
    _, e = torch.frexp(amax)
    unbiased = (e.to(torch.int32) - 1 - E2M1_EMAX).clamp_(-SCALE_BIAS, SCALE_MAX - SCALE_BIAS)
    unbiased = torch.where(amax > 0, unbiased, torch.full_like(unbiased, -SCALE_BIAS))
    x.mul_(torch.ldexp(torch.ones_like(amax), -unbiased).unsqueeze(-1))
    if x.dtype == torch.float32:
        codes = _codes_by_bits(x)
    else:
        sign = torch.signbit(x)
        index = torch.bucketize(x.abs_(), _midpoints(x.dtype).to(x.device), right=False)  # #{b : a > b}
        codes = index.to(torch.uint8).add_(sign.to(torch.uint8).mul_(8))
    pairs = codes.view(*codes.shape[:-1], GROUP_BYTES, 2)
    packed = pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4))
    return packed, (unbiased + SCALE_BIAS).to(torch.uint8)


def _refuse_non_finite(amax_finite: torch.Tensor, first: int) -> None:
    """:class:`NonFiniteWeightError` naming the first row of a band whose groups are not all finite."""
    if not amax_finite.all():
        bad = int(torch.nonzero(~amax_finite)[0, 0])
        raise NonFiniteWeightError(first + bad, first + bad, "MXFP4")


#: bfloat16's bits: all but the sign, infinity's (the least of the non-finite magnitudes), and the
#: mantissa's width (below the exponent field).
_BF16_MAGNITUDE, _BF16_INF, _BF16_MANTISSA = 0x7FFF, 0x7F80, 7
#: The largest scale byte a finite bfloat16 group gets: its exponent field is at most 254.
_BF16_SCALE_MAX = 254 - E2M1_EMAX


class _Bf16Bands:
    """Quantizes bfloat16 bands of up to ``n`` rows of ``width`` from their bits, in buffers of its
    own reused band after band (fresh ones per band cost as much again in page faults): the same
    codes and scales as the float32 copy would get (:func:`_quantize_band`), without that copy.

    How: a finite float's magnitude bits order as its magnitude, so a group's ``amax`` is the
    largest of its 15-bit magnitudes (NaN and infinity are the patterns from ``0x7F80`` up), and its
    exponent field ``E`` (``amax`` in ``[2**(E - 127), 2**(E - 126))``, below ``2**-126`` when ``E``
    is 0) gives the scale byte at once: ``E - 127 - 2 + 127``, clamped at 0 (subnormal and zero
    groups included: their ``floor(log2)`` is below -126). A value's code then depends on its 16
    bits and the scale byte alone: one gather from :func:`_bf16_code_table` at ``s * 65536 +
    bits``, sign, ties and subnormals included."""

    def __init__(self, n: int, width: int, device: torch.device) -> None:
        elements = n * width
        self.table = _bf16_code_table(device)
        self.magnitude = torch.empty(elements, dtype=torch.int16, device=device)
        self.amax = torch.empty(elements // GROUP, dtype=torch.int16, device=device)
        self.key = torch.empty(elements, dtype=torch.int32, device=device)
        self.code = torch.empty(elements, dtype=torch.uint8, device=device)
        self.packed = torch.empty(elements // 2, dtype=torch.int16, device=device)

    def quantize(self, x: torch.Tensor, first: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Band ``x`` ``[n, groups, 32]`` (the weight's rows, not copied) into ``codes`` ``[n, groups,
        16]`` and ``scales`` ``[n, groups]``; ``first``: its first row, named by a refusal."""
        n, groups, _ = x.shape
        size = x.numel()
        magnitude = torch.bitwise_and(x.view(torch.int16), _BF16_MAGNITUDE, out=self.magnitude[:size].view(x.shape))
        amax = torch.amax(magnitude, dim=-1, out=self.amax[:n * groups].view(n, groups))
        _refuse_non_finite(amax < _BF16_INF, first)
        s = amax.bitwise_right_shift_(_BF16_MANTISSA).sub_(E2M1_EMAX).clamp_(min=0)
        scales.copy_(s)
        key = self.key[:size].view(x.shape)
        key.copy_(x.view(torch.uint16))  # 0..65535
        key.add_(s.to(torch.int32).bitwise_left_shift_(16).unsqueeze(-1))
        code = torch.index_select(self.table, 0, key.view(-1), out=self.code[:size])
        pairs = code.view(torch.int16)  # little-endian: the even column's code in the low byte
        packed = torch.bitwise_right_shift(pairs, 4, out=self.packed[:size // 2]).bitwise_or_(pairs)
        codes.view(-1).copy_(packed)  # low | high << 4 (| high << 8, dropped): the low byte kept


@functools.lru_cache(maxsize=4)
def _bf16_code_table(device: torch.device) -> torch.Tensor:
    """``[(_BF16_SCALE_MAX + 1) * 65536]`` uint8 (16 MiB): at ``s * 65536 + bits``, the e2m1 code of
    the bfloat16 ``bits`` under scale byte ``s``: the :data:`_MIDPOINTS` rule on the exact float64
    value ``v * 2**(127 - s)`` (NaN and infinity patterns are never looked up)."""
    v = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16).double()
    finite = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    sign = 8 * torch.signbit(v).to(torch.uint8)
    table = torch.empty(_BF16_SCALE_MAX + 1, 1 << 16, dtype=torch.uint8)
    for s in range(0, _BF16_SCALE_MAX + 1, 16):  # 16 scales at a time: their float64 values are 8 MiB
        exponents = SCALE_BIAS - torch.arange(s, min(s + 16, _BF16_SCALE_MAX + 1), dtype=torch.float64)
        scaled = torch.ldexp(finite.unsqueeze(0), exponents.unsqueeze(1))  # exact
        index = torch.bucketize(scaled.abs_(), _midpoints(torch.float64), right=False)
        torch.add(index.to(torch.uint8), sign, out=table[s:s + len(exponents)])
    return table.view(-1).to(device)


#: float32 bits kept by :func:`_codes_by_bits`' key: the sign, the exponent and 3 mantissa bits.
_KEY_SHIFT = 20


@functools.lru_cache(maxsize=4)
def _code_table(device: torch.device) -> torch.Tensor:
    """``[2 * 4096]`` uint8: the e2m1 code of a float32 whose top 12 bits are ``k``, at ``2k + 1``
    when its other bits are all zero (the cell's first value), at ``2k`` otherwise. Every rounding
    midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has at most 3 mantissa bits, so it is the first
    value of a cell and every other value of a cell rounds alike: the table is the
    :data:`_MIDPOINTS` rule itself, tabled."""
    first = (torch.arange(1 << (32 - _KEY_SHIFT), dtype=torch.int64) << _KEY_SHIFT).to(torch.int32)
    bounds = _midpoints(torch.float32)
    codes = []
    for bits in (first | 1, first):  # inside the cell, then its first value
        v = bits.view(torch.float32)
        codes.append(torch.bucketize(v.abs(), bounds, right=False) + 8 * torch.signbit(v))
    return torch.stack(codes, dim=-1).view(-1).to(torch.uint8).to(device)


def _codes_by_bits(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes of float32 ``x`` (scaled, finite), one table gather each (:func:`_code_table`):
    several times faster on a CPU than :func:`torch.bucketize` and the sign, the same codes."""
    bits = x.view(torch.int32)
    key = bits.bitwise_right_shift(_KEY_SHIFT).bitwise_and_((1 << (32 - _KEY_SHIFT)) - 1).bitwise_left_shift_(1)
    key.add_(bits.bitwise_and((1 << _KEY_SHIFT) - 1).eq_(0))
    return torch.index_select(_code_table(x.device), 0, key.view(-1)).view(x.shape)


class Mxfp4Dequantized(LazyTensor):
    """A stored MXFP4 weight read as ``dtype`` in the model's layout ``[*, in, out]`` (the transpose
    of the codes' ``[*, out, in]``, as a bf16 release stores ``X``): each box dequantizes the code
    rows and the groups covering it, a band of rows at a time, into the box (memory: the box and
    one band, never the whole weight). A reader that wants ``[*, out, in]`` reads
    :meth:`transposed`, which decodes into its boxes without transposing."""

    def __init__(self, blocks: torch.Tensor | LazyTensor, scales: torch.Tensor | LazyTensor,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        self.rows = Mxfp4Rows(blocks, scales, dtype)
        *lead, out, inp = self.rows.shape
        self.shape = (*lead, inp, out)

    def transposed(self) -> LazyTensor:
        return self.rows

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and (out.dtype != self.dtype or tuple(out.shape) != tuple(sizes)):
            raise ValueError(f"out is {out.dtype} {list(out.shape)}, the box {self.dtype} {list(sizes)}")
        out = torch.empty(sizes, dtype=self.dtype) if out is None else out
        if 0 in sizes:
            return out
        *lead_off, c0, r0 = offsets
        *lead_n, cols, rows = sizes
        band = max(1, BAND_ELEMENTS // cols)
        ones = (1,) * len(lead_n)
        for i in range(math.prod(lead_n)):
            index = _unflat(i, lead_n)
            at = tuple(o + k for o, k in zip(lead_off, index))
            dst = out[tuple(index)]  # [cols, rows] of the box
            for r in range(r0, r0 + rows, band):
                n = min(band, r0 + rows - r)
                got = self.rows.read_box((*at, r, c0), (*ones, n, cols))
                dst[:, r - r0:r - r0 + n].copy_(got.view(n, cols).t())
        return out

    def __repr__(self) -> str:
        return f"Mxfp4Dequantized({self.blocks!r}, dtype={self.dtype})"


class Mxfp4Rows(LazyTensor):
    """A stored MXFP4 weight read as ``dtype`` in the codes' own layout ``W`` ``[*, out, in]``: a box
    decodes its code rows, a band at a time, straight into it when its columns are whole groups
    (else a band's groups are decoded and its columns copied out). Memory: the box and one band."""

    def __init__(self, blocks: torch.Tensor | LazyTensor, scales: torch.Tensor | LazyTensor,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        *lead, rows, groups, _ = blocks.shape
        self.shape = (*lead, rows, groups * GROUP)

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and (out.dtype != self.dtype or tuple(out.shape) != tuple(sizes)):
            raise ValueError(f"out is {out.dtype} {list(out.shape)}, the box {self.dtype} {list(sizes)}")
        out = torch.empty(sizes, dtype=self.dtype) if out is None else out
        if 0 in sizes:
            return out
        *lead_off, r0, c0 = offsets
        *lead_n, rows, cols = sizes
        g0, g1 = c0 // GROUP, -(-(c0 + cols) // GROUP)
        skip = c0 - g0 * GROUP
        whole_groups = skip == 0 and cols == (g1 - g0) * GROUP
        band = max(1, BAND_ELEMENTS // ((g1 - g0) * GROUP))
        ones = (1,) * len(lead_n)
        for i in range(math.prod(lead_n)):
            index = _unflat(i, lead_n)
            at = tuple(o + k for o, k in zip(lead_off, index))
            dst = out[tuple(index)]  # [rows, cols] of the box
            for r in range(r0, r0 + rows, band):
                n = min(band, r0 + rows - r)
                b = box_of(self.blocks, (*at, r, g0, 0), (*ones, n, g1 - g0, GROUP_BYTES))
                s = box_of(self.scales, (*at, r, g0), (*ones, n, g1 - g0))
                b, s = b.reshape(n, g1 - g0, GROUP_BYTES), s.reshape(n, g1 - g0)
                part = dst[r - r0:r - r0 + n]
                if whole_groups and part.is_contiguous():
                    dequantize(b, s, self.dtype, out=part)
                else:
                    part.copy_(dequantize(b, s, self.dtype)[:, skip:skip + cols])
        return out

    def __repr__(self) -> str:
        return f"Mxfp4Rows({self.blocks!r}, dtype={self.dtype})"


def _unflat(i: int, dims: Sequence[int]) -> list[int]:
    """The index of element ``i`` (row-major) of a tensor of shape ``dims``."""
    index = []
    for d in reversed(dims):
        i, k = divmod(i, d)
        index.append(k)
    return index[::-1]

