"""FP8 block-scaled weights (DeepSeek-V3's format, which transformers and vLLM load): the codec.

A weight ``W`` of shape ``[M, N]`` is stored as ``float8_e4m3fn`` values ``Q`` and a float32
``<name>_scale_inv`` (for ``x.weight``: ``x.weight_scale_inv``) of shape ``[ceil(M/b0),
ceil(N/b1)]``, one scale per block of ``b0 x b1`` elements; blocks on the last rows and columns
are partial when ``b0`` does not divide ``M`` or ``b1`` does not divide ``N``. The checkpoint's
``config.json`` says so in ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [b0, b1]}``.

==============  ========================================================================
direction       per block ``B`` (rows ``i*b0 ..``, columns ``j*b1 ..``; partial at the edges)
==============  ========================================================================
dequantize      ``W[B] = (Q[B].float() * S[i, j]).to(dtype)`` (DeepSeek's ``weight_dequant``:
                float32 product, one rounding to the model dtype, round-to-nearest-even)
quantize        ``S[i, j] = amax|W[B]| / 448`` (e4m3's largest finite value; 1.0 where that is
                0: an all-zero block stays zero), ``Q[B] = clamp(W[B].float() / S[i, j], -448,
                448)`` cast to e4m3 (round-to-nearest-even); a NaN or an infinity is refused
==============  ========================================================================

Both work one band of ``b0`` rows at a time, so memory is the output plus one band's buffer;
:class:`Fp8BlockDequantized` reads any box of a stored weight from the box of ``Q`` and the
scales covering it, so a converter never holds more than the box it writes.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.lazy import LazyTensor, box_of

E4M3 = torch.float8_e4m3fn
#: ``quantization_config.fmt`` values naming e4m3: DeepSeek's releases write ``e4m3``, MiniMax-M2's
#: the dtype's own name.
E4M3_NAMES = ("e4m3", "float8_e4m3fn")
#: e4m3's largest finite value: a block's largest magnitude maps onto it.
E4M3_MAX = 448.0
#: ``weight_block_size`` when none is asked for (DeepSeek-V3's, vLLM's default).
DEFAULT_BLOCK = (128, 128)
#: The suffix of a weight's scale tensor: ``x.weight`` -> ``x.weight_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
#: Elements gathered per step when dequantizing: the int32 index of a step stays in a core's cache.
_GATHER_ELEMENTS = 1 << 18


def _named(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def scale_name(weight: str) -> str:
    """The name of the scale tensor of ``weight`` (``x.weight`` -> ``x.weight_scale_inv``)."""
    return weight + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, int]:
    """``[ceil(M/b0), ceil(N/b1)]``: one scale per (possibly partial) block of a ``[M, N]`` weight."""
    m, n = shape
    return math.ceil(m / block[0]), math.ceil(n / block[1])


def read_quantization_config(config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The block size of an FP8 block-scaled checkpoint from its ``config.json``; None when the
    checkpoint is not quantized. Any other scheme is refused, named: its weights are not the
    model's weights until its own kernels unpack them."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method != "fp8":
        named = f"quant_method {method!r}" if method else "a quantization_config without quant_method"
        raise CheckpointFormatError(
            f"holds {named}, which reshard does not read", culprit=where,
            hint="reshard reads FP8 block-scaled checkpoints (quant_method 'fp8' with weight_block_size); "
                 "dequantize others with their own tools first")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in E4M3_NAMES:
        raise CheckpointFormatError(f"quantization_config.fmt is {fmt!r}", culprit=where,
                                    hint="reshard reads FP8 e4m3 (float8_e4m3fn) weights only")
    if qc.get("scale_fmt") not in (None, "float32", "fp32"):
        raise CheckpointFormatError(f"quantization_config.scale_fmt is {qc.get('scale_fmt')!r}", culprit=where,
                                    hint="reshard reads float32 block scales (weight_scale_inv) only")
    block = qc.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointFormatError(f"quantization_config.weight_block_size is {block!r}", culprit=where,
                                    hint="an FP8 block-scaled checkpoint names its block as [rows, columns], "
                                         "e.g. [128, 128] (per-tensor FP8 is not read)")
    return int(block[0]), int(block[1])


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    """The ``config.json`` entry of weights quantized by :func:`quantize` (what transformers and
    vLLM read)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def check_scale(name: str, weight_shape: Sequence[int], weight_dtype: torch.dtype, scale_shape_: Sequence[int] | None,
                scale_dtype: torch.dtype | None, block: tuple[int, int], where: str) -> None:
    """Refuse, before any byte is converted, an FP8 weight whose scale is missing, of the wrong
    shape (a transposed or mis-edged grid) or not float32."""
    if weight_dtype != E4M3:
        raise CheckpointFormatError(f"{name} is {_named(weight_dtype)}, not float8_e4m3fn, in an FP8 checkpoint",
                                    culprit=where, hint="quantized weights must be stored as float8_e4m3fn")
    if len(weight_shape) != 2:
        raise CheckpointFormatError(f"{name} is an FP8 weight of shape {list(weight_shape)}", culprit=where,
                                    hint="block scales are defined for 2-D weights only")
    if scale_shape_ is None:
        raise CheckpointFormatError(f"{name} is float8_e4m3fn but {scale_name(name)} is missing", culprit=where,
                                    hint="supply the scale tensors (weight_scale_inv) written with the weights")
    want = scale_shape(weight_shape, block)
    if tuple(scale_shape_) != want:
        raise CheckpointFormatError(
            f"{scale_name(name)} has shape {list(scale_shape_)}, not {list(want)} (ceil of {list(weight_shape)} "
            f"over the {list(block)} blocks)", culprit=where,
            hint="the scales do not belong to this weight or to this weight_block_size")
    if scale_dtype != torch.float32:
        raise CheckpointFormatError(f"{scale_name(name)} is {_named(scale_dtype)}, not float32", culprit=where,
                                    hint="reshard reads float32 block scales only")


def dequantize_box(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], offsets: tuple[int, int],
                   dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The box ``q`` (at ``offsets`` of the whole weight) dequantized by ``scale`` (the scale rows
    and columns covering the box; its first row/column is block ``r0 // b0`` / ``c0 // b1``) into
    ``out`` (or a new tensor).

    Why a table: an e4m3 code has 256 values, so within one block ``(q.float() * s).to(dtype)``
    is a function of the code alone. Each band of rows within one block row builds that function
    for its blocks, ``table[j * 256 + code] = (value(code) * S[i, j]).to(dtype)`` (the float32
    product, one rounding: DeepSeek's formula, NaN codes included), and gathers from it: one
    widening of the codes to int32 and one gather per element, instead of torch's
    element-by-element e4m3 conversion, which is several times slower on a CPU.

    ============  ====================  ==========================================================
    tensor        shape                 what
    ============  ====================  ==========================================================
    ``codes``     ``[m, n]`` uint8      ``q``'s bits
    ``base``      ``[n]`` int32         ``256 *`` the box-relative block column of each column
    ``table``     ``[g * 256]`` dtype   one band's outputs for every (block column, code)
    ``index``     ``[k, n]`` int32      ``codes + base`` for ``k`` rows (bounded: ``_GATHER_ELEMENTS``)
    ============  ====================  ==========================================================
    """
    m, n = q.shape
    r0, c0 = offsets
    out = torch.empty((m, n), dtype=dtype, device=q.device) if out is None else out
    if not m or not n:
        return out
    b0, b1 = block
    first = r0 // b0
    lead = c0 % b1
    groups = (lead + n - 1) // b1 + 1  # block columns the box touches
    codes = q.view(torch.uint8)
    values = torch.arange(256, dtype=torch.uint8, device=q.device).view(E4M3).float()
    base = (torch.arange(lead, lead + n, dtype=torch.int32, device=q.device) // b1) * 256
    step = max(1, _GATHER_ELEMENTS // n)
    index = torch.empty((min(step, m), n), dtype=torch.int32, device=q.device)
    r = 0
    while r < m:
        band = min(m - r, b0 - (r0 + r) % b0)  # to the end of this block row
        row = scale[(r0 + r) // b0 - first, :groups].float()
        table = (row.unsqueeze(1) * values).to(dtype).view(-1)
        for k0 in range(r, r + band, step):
            k = min(step, r + band - k0)
            idx = index[:k]
            idx.copy_(codes[k0:k0 + k])  # widened, then offset: two vectorized passes (a mixed-dtype add is not)
            idx.add_(base)
            dst = out[k0:k0 + k]
            if dst.is_contiguous():
                torch.index_select(table, 0, idx.view(-1), out=dst.view(-1))
            else:  # a box of a larger buffer
                dst.copy_(table.index_select(0, idx.view(-1)).view(k, n))
        r += band
    return out


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A whole FP8 weight as ``dtype`` (see the module table)."""
    return dequantize_box(q, scale_inv, block, (0, 0), dtype)


class NonFiniteWeightError(ValueError):
    """A weight holds a NaN or an infinity, which no FP8 (or MXFP4: :mod:`reshard.core.mxfp4`)
    scale can encode (the checkpoint's fault, not the caller's): in rows ``first .. last`` of what
    was given to ``codec``."""

    def __init__(self, first: int, last: int, codec: str) -> None:
        self.first, self.last, self.codec = first, last, codec
        where = f"row {first} holds" if first == last else f"rows {first}..{last} hold"
        super().__init__(f"{where} a NaN or an infinity, which {codec} cannot scale")

    def moved(self, rows: int) -> NonFiniteWeightError:
        """The same error for a band that starts ``rows`` into the weight: its rows in the weight."""
        return NonFiniteWeightError(self.first + rows, self.last + rows, self.codec)


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, *,
             workers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q float8_e4m3fn [M, N], S float32 [ceil(M/b0), ceil(N/b1)])`` of a 2-D weight (see the
    module table), one band of ``b0`` rows at a time, its band-sized buffers made once per worker.

    ``workers``: threads that share the bands, each a run of whole bands with buffers of its own
    (the bytes are the same for any count; a refusal names the first bad band in row order). Each
    band is a block row, so no two workers touch one block. For a CPU whose torch runs one intra-op
    thread: torch's own pool would spin between ops, these threads wait without spinning.

    Why each step is as it is (the cast to e4m3, torch's element-by-element conversion, is the
    largest cost, and no faster exact form of it in torch is known here; the other steps are kept
    to one vectorized pass each):

    - A block's largest magnitude is taken on the bits: a float's magnitude is its bits with the
      sign cleared, ordered as integers (NaN and infinity above every finite value), so one
      ``bitwise_and`` into an integer buffer and a column ``amax`` give each column's largest
      magnitude exactly, 3-4x faster on a CPU than ``abs`` and a float ``amax``.
    - The band is widened once into a float32 buffer kept across bands, divided in place and cast
      as it is stored.
    - The clamp to +-448 is applied only to a band with a subnormal scale. With a normal scale
      ``S = amax / 448`` rounds with a relative error under ``2**-24``, so ``|W / S| <= 448 * (1 +
      2**-23)``, which the cast rounds to 448 anyway: clamping cannot change a code. A subnormal
      scale (amax below about ``5e-36``) has fewer bits, and then it can.
    """
    _check_weight(w)
    m, n = w.shape
    gm, gn = scale_shape(w.shape, block)
    q = torch.empty((m, n), dtype=E4M3, device=w.device)
    s = torch.empty((gm, gn), dtype=torch.float32, device=w.device)
    if m and n:
        _quantize_rows(w, q, s, block, 0, gm, workers)
    return q, s


def quantize_chunks(w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, *,
                    chunk_rows: int, workers: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
    """:func:`quantize`'s codes ``chunk_rows`` rows at a time, each chunk yielded as ``(its first
    row, its Q rows)`` as soon as it is made, for a writer that streams them out instead of holding
    the whole ``Q``; the scales go into ``scales`` (the caller's float32 ``[ceil(M/b0),
    ceil(N/b1)]``), complete after the last chunk. ``chunk_rows`` is a multiple of ``b0``: a chunk
    is whole block rows, so its codes and scales are those of the whole weight's."""
    _check_weight(w)
    m, n = w.shape
    b0 = block[0]
    if chunk_rows <= 0 or chunk_rows % b0:
        raise ValueError(f"chunk_rows {chunk_rows} is not a positive multiple of the block's {b0} rows")
    if tuple(scales.shape) != scale_shape(w.shape, block) or scales.dtype != torch.float32:
        raise ValueError(f"scales are {scales.dtype} {list(scales.shape)}, not float32 "
                         f"{list(scale_shape(w.shape, block))}")
    if not n:
        return
    for r in range(0, m, chunk_rows):
        q = torch.empty((min(chunk_rows, m - r), n), dtype=E4M3, device=w.device)
        _quantize_rows(w, q, scales, block, r // b0, math.ceil((r + q.shape[0]) / b0), workers)
        yield r, q


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, not {list(w.shape)}")
    if w.dtype not in _MAGNITUDE_BITS:
        raise ValueError(f"FP8 block quantization takes a floating-point weight, not {w.dtype}")


def _quantize_rows(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], first: int,
                   stop: int, workers: int) -> None:
    """Bands ``first .. stop - 1`` of ``w`` into ``q`` (whose row 0 is band ``first``'s first row)
    and ``s``, shared among ``workers`` threads, each a run of bands."""
    workers = max(1, min(workers, stop - first))
    if workers == 1:
        _quantize_bands(w, q, s, block, first, stop, first * block[0])
        return
    cuts = [first + (stop - first) * k // workers for k in range(workers + 1)]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reshard-fp8") as pool:
        done = [pool.submit(_quantize_bands, w, q, s, block, a, b, first * block[0])
                for a, b in zip(cuts, cuts[1:])]
    for f in done:  # the first failing band in row order is the one reported
        f.result()


def _quantize_bands(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], first: int,
                    stop: int, q0: int) -> None:
    """Bands ``first .. stop - 1`` of :func:`quantize` (its steps are explained there) into ``q``,
    whose row 0 is row ``q0`` of ``w`` (a chunk's first row)."""
    m, n = w.shape
    b0, b1 = block
    gn = s.shape[1]
    pad = gn * b1 - n
    bits = _MAGNITUDE_BITS[w.dtype]
    magnitude = torch.iinfo(bits).max  # every bit but the sign's
    wide = torch.empty((min(b0, m - first * b0), n), dtype=torch.float32, device=w.device)
    mags = torch.empty((min(b0, m - first * b0), n), dtype=bits, device=w.device)
    # the scale's divisor is a tensor, not the number 448: CUDA multiplies by the reciprocal when the
    # divisor is a Python number (one bit off in about half the blocks, seen on an H100), so the
    # device path would write other scales, and other codes at the rounding ties, than the CPU
    e4m3_max = torch.full((gn,), E4M3_MAX, dtype=torch.float32, device=w.device)
    for i in range(first, stop):
        x = w[i * b0:(i + 1) * b0]
        rows = x.shape[0]
        # [n]: each column's largest magnitude, back in w's dtype
        top = torch.bitwise_and(x.view(bits), magnitude, out=mags[:rows]).amax(dim=0).view(w.dtype)
        if pad:
            top = torch.nn.functional.pad(top, (0, pad))
        amax = top.view(gn, b1).amax(dim=1).float()
        if not torch.isfinite(amax).all():
            raise NonFiniteWeightError(i * b0, i * b0 + rows - 1, "FP8")
        si = amax / e4m3_max
        si = torch.where(si > 0, si, torch.ones_like(si))  # an all-zero block (or one too small to scale) keeps 1
        s[i] = si
        band = wide[:rows]
        band.copy_(x)
        band.div_(si.repeat_interleave(b1)[:n])
        if si.amin() < _FLOAT32_TINY:
            band.clamp_(-E4M3_MAX, E4M3_MAX)
        q[i * b0 - q0:(i + 1) * b0 - q0].copy_(band)


#: float dtype -> the signed integer dtype of its bits; the integer's largest value is the mask that
#: clears the sign, leaving the bits that order magnitudes.
_MAGNITUDE_BITS: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
#: float32's smallest normal value: a scale below it is subnormal (see :func:`quantize`).
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def dequantized_tensors(tensors: Mapping[str, Any], block: tuple[int, int] | None, dtype: torch.dtype,
                        where: str) -> dict[str, Any]:
    """A checkpoint's tensors with every FP8 weight read as ``dtype`` (lazily, box by box) and its
    scale gone: what the model computes with. ``block``: the checkpoint's ``weight_block_size``
    (None: it declares no quantization, so an FP8 tensor in it is refused — a bare cast would give
    a model that computes something else). Every FP8 weight and every scale is checked
    (:func:`check_scale`) before anything is read; a scale without its weight is refused too."""
    scales = {k for k in tensors if k.endswith(SCALE_SUFFIX)}
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        if key in scales:
            if key[:-len(SCALE_SUFFIX)] not in tensors:
                raise CheckpointFormatError(f"{key} scales no weight ({key[:-len(SCALE_SUFFIX)]} is absent)",
                                            culprit=where, hint="the files do not belong together; re-copy the folder")
            continue
        if t.dtype != E4M3:
            if scale_name(key) in scales:
                raise CheckpointFormatError(f"{key} is {_named(t.dtype)} but has a block scale ({scale_name(key)})",
                                            culprit=where, hint="a scaled weight must be stored as float8_e4m3fn")
            out[key] = t
            continue
        if block is None:
            raise CheckpointFormatError(f"{key} is float8_e4m3fn but config.json declares no quantization_config",
                                        culprit=where, hint="an FP8 checkpoint names its block scaling in "
                                        "quantization_config (quant_method 'fp8', weight_block_size)")
        scale = tensors.get(scale_name(key))
        check_scale(key, t.shape, t.dtype, None if scale is None else scale.shape,
                    None if scale is None else scale.dtype, block, where)
        out[key] = Fp8BlockDequantized(t, scale, block, dtype)
    return out


class Fp8BlockDequantized(LazyTensor):
    """A stored FP8 weight read as the model's ``dtype``: each box is dequantized from the box of
    ``q`` and the scales covering it (memory: the box, never the whole weight)."""

    def __init__(self, q: torch.Tensor | LazyTensor, scale: torch.Tensor | LazyTensor, block: tuple[int, int],
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.q, self.scale, self.block = q, scale, block
        self.shape, self.dtype = tuple(q.shape), dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (m, n) = offsets, sizes
        b0, b1 = self.block
        s_off = (r0 // b0, c0 // b1)
        s_size = ((r0 + m - 1) // b0 - s_off[0] + 1, (c0 + n - 1) // b1 - s_off[1] + 1) if m and n else (0, 0)
        if out is not None and out.dtype != self.dtype:
            raise ValueError(f"out is {out.dtype}, the dequantized weight {self.dtype}")
        scale = box_of(self.scale, s_off, s_size)
        # whole rows of a mapped file: decoded where they lie, then their pages given back (no copy
        # of the codes first; any other box, or a remote tensor, is copied out as lazy.box_of says)
        view = self.q.view_box((r0, c0), (m, n)) if isinstance(self.q, LazyTensor) else None
        if view is None:
            return dequantize_box(box_of(self.q, (r0, c0), (m, n)), scale, self.block, (r0, c0), self.dtype, out)
        got = dequantize_box(view, scale, self.block, (r0, c0), self.dtype, out)
        self.q.release(view)
        return got

    def __repr__(self) -> str:
        return f"Fp8BlockDequantized({self.q!r}, block={list(self.block)}, dtype={self.dtype})"

