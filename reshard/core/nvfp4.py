"""NVFP4 weights, as compressed-tensors (``nvfp4-pack-quantized``) and NVIDIA's ModelOpt store them:
the codec's arithmetic. Pure: tensors in, tensors out.

A weight ``W`` ``[out, in]`` is two e2m1 codes a byte and one e4m3 scale per 16 values of a row:

==============  ==================================  ==================================  ==================
tensor          compressed-tensors                  ModelOpt                            what
==============  ==================================  ==================================  ==================
codes           ``X.weight_packed`` uint8           ``X.weight`` uint8 ``[out, in/2]``  column ``2j`` in
                ``[out, in/2]``                                                         the low nibble,
                                                                                        ``2j+1`` the high
group scales    ``X.weight_scale`` e4m3             ``X.weight_scale`` e4m3             one per 16 columns
                ``[out, in/16]``                    ``[out, in/16]``
tensor scale    ``X.weight_global_scale`` float32   ``X.weight_scale_2`` float32        ``448*6/amax``
                ``[1]``                             ``[]``                              (CT), ``amax/2688``
                                                                                        (ModelOpt)
==============  ==================================  ==================================  ==================

An e2m1 code is a sign bit (``8``) over an index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.

============  =================================================================================
library       dequantized, as its own code computes it (then cast to the model's dtype)
============  =================================================================================
CT            ``bf16(e2m1 * (bf16(s) / G))``: the scale widened to bf16 and divided by the
              global scale (float32), the product in float32, rounded to bf16 (its
              ``unpack_fp4_from_uint8`` dtype); code 8 is -0.0 (its table times the sign)
ModelOpt      ``dtype(e2m1 * (float32(s) * S2))``: the product in float32, rounded once to the
              model's dtype; code 8 is +0.0 (its table holds 0 there)
============  =================================================================================

Encoding, as compressed-tensors (0.20) compresses a weight ``W`` (dtype ``d``) whose scales a
min-max observer computed (llm-compressor's ``calculate_qparams`` / ``generate_gparam`` path, the
CPU fallback of ``quantize_and_pack_fp4``); ``A``: the absolute maximum over the weights that
share one global scale (a fused q/k/v or gate/up: llm-compressor's fused observers take the max
over the parts, as vLLM needs one scale for the fused matmul):

==========================  ======================================================================
step                        arithmetic (``d``: computed in the weight's dtype, rounded there)
==========================  ======================================================================
global scale ``G``          ``float32(d(2688 / max(A, tiny(d))))``; inf or NaN -> 1.0
group maximum ``m``         ``max |W|`` over each 16 inputs of a row, in ``d``
group scale ``s``           ``e4m3(clamp(G * d(m / 6), -448, 448))`` (the product in float32,
                            rounded to nearest even once); ``s == 0`` -> 0.125 (its e4m3 eps)
scaled value ``x``          ``clamp(float32(W) / (float32(s) / G), -6, 6)``: two float32 roundings
e2m1 code                   ``|x|`` to the nearest of ``0 .. 6`` (ties to the even code: ``0.25
                            -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``,
                            ``3.5 -> 4``, ``5 -> 4``), sign bit ``8`` where ``x < 0`` (so a small
                            negative value is code 8, -0.0; a -0.0 weight is code 0)
packed byte                 column ``2j`` in the low nibble, ``2j+1`` in the high
==========================  ======================================================================
"""

from __future__ import annotations

import torch

#: Values along a row that share one e4m3 scale.
GROUP = 16
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: The largest e4m3 and e2m1 magnitudes: compressed-tensors' global scale maps a tensor's absolute
#: maximum to their product (2688).
E4M3_MAX, E2M1_MAX = 448.0, 6.0
#: What a zero group scale becomes (compressed-tensors' ``eps`` of an e4m3 scale): a quotient's
#: divisor never zero.
ZERO_SCALE = 0.125
#: ``|x|`` rounds up past each bound: ``(bound, inclusive)``, inclusive where the bound is a tie
#: whose even neighbour is the upper one (compressed-tensors' ``cast_to_fp4`` intervals).
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _table(negative_zero: bool) -> torch.Tensor:
    """float32 ``[16]``: code -> e2m1 value (code 8: -0.0 or +0.0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    negative = -magnitudes if negative_zero else torch.cat([magnitudes[:1], -magnitudes[1:]])
    return torch.cat([magnitudes, negative])


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``int64`` codes ``[n, 2w]`` of ``packed`` uint8 ``[n, w]``: low nibble first."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1).long()


def dequantize_ct(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' NVFP4 rows (see the module table): ``packed`` uint8 ``[n, in/2]``,
    ``scale`` e4m3 ``[n, in/16]``, ``global_scale`` the stored tensor (its shape decides the
    division's dtype there, as here)."""
    codes = unpack_rows(packed)
    n, columns = codes.shape
    values = _table(True).to(torch.bfloat16)[codes].view(n, -1, GROUP)
    effective = scale.to(torch.bfloat16).unsqueeze(-1) / global_scale
    return (values.to(effective.dtype) * effective).to(torch.bfloat16).view(n, columns).to(dtype)


def dequantize_modelopt(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's NVFP4 rows (see the module table): ``packed`` uint8 ``[n, in/2]``, ``scale``
    e4m3 ``[n, in/16]``, ``scale_2`` float32."""
    codes = unpack_rows(packed)
    n, columns = codes.shape
    values = _table(False)[codes].view(n, -1, GROUP)
    per_block = scale.to(torch.float32) * scale_2
    return (values * per_block.unsqueeze(-1)).view(n, columns).to(dtype)


def absmax(w: torch.Tensor) -> torch.Tensor:
    """0-dim, in ``w``'s dtype: the largest ``|w|`` (0 for an empty ``w``). A fused tensor's is the
    :func:`torch.maximum` of its parts' or bands', which is how a global scale is found band by band."""
    return w.abs().amax() if w.numel() else torch.zeros((), dtype=w.dtype)


def global_scale_ct(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` (float32 ``[1]``) of weights whose absolute
    maximum is ``amax`` (0-dim, the weights' dtype: the quotient is rounded there first, as
    ``generate_gparam`` computes it from a min-max observer's statistics); see the module table."""
    bounded = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * E2M1_MAX / bounded, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def quantize_ct(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)``: rows ``w`` ``[n, in]`` (float, finite, ``in`` a multiple of
    :data:`GROUP`) as compressed-tensors' ``nvfp4-pack-quantized`` stores them under
    ``global_scale`` (:func:`global_scale_ct`): ``packed`` uint8 ``[n, in/2]``, ``scale`` e4m3
    ``[n, in/16]``; each row alone, so any band of rows gives the rows of the whole weight's."""
    n, columns = w.shape
    groups = w.reshape(n, columns // GROUP, GROUP)  # [n, in/16, 16]
    step = groups.abs().amax(-1) / torch.tensor(E2M1_MAX, dtype=w.dtype)  # [n, in/16], in w's dtype
    scale = torch.clamp(global_scale * step, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(ZERO_SCALE), scale)
    x = groups.to(torch.float32) / (scale / global_scale).unsqueeze(-1)
    a = torch.clamp(x, -E2M1_MAX, E2M1_MAX).abs_()
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    for bound, inclusive in _BOUNDS:
        codes += (a >= bound) if inclusive else (a > bound)
    codes |= (x < 0).to(torch.uint8) << 3
    return pack_rows(codes.view(n, columns)), scale.to(torch.float8_e4m3fn)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, w]`` of 4-bit ``codes`` ``[n, 2w]``: column ``2j`` in the low nibble (the
    inverse of :func:`unpack_rows`)."""
    pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


#: The smallest group scale ModelOpt casts to e4m3 (its ``_cast_per_block_scale_to_fp8`` clamps to
#: ``[2**-9, 448]``: no group scale underflows to 0).
MODELOPT_MIN_SCALE = 2.0 ** -9


def scale_2_modelopt(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2`` (float32, 0-dim) of weights whose absolute maximum is ``amax``
    (0-dim, the weights' dtype; a fused q/k/v's or gate/up's: the maximum over the parts, as its
    export's ``preprocess_linear_fusion`` unifies their amax): ``float32(amax) / 2688``, as
    ``NVFP4QTensor.get_weights_scaling_factor_2`` computes it."""
    return amax.to(torch.float32).reshape(()) / (E2M1_MAX * E4M3_MAX)


def quantize_modelopt(w: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)``: rows ``w`` ``[n, in]`` (float, finite, ``in`` a multiple of
    :data:`GROUP`) as ModelOpt 0.47's ``NVFP4QTensor.quantize`` stores them under ``scale_2``
    (:func:`scale_2_modelopt`), each row alone:

    ===================  ==========================================================================
    step                 arithmetic (ModelOpt's ``get_weights_scaling_factor``, ``quantize``)
    ===================  ==========================================================================
    group maximum ``m``  ``max |W|`` over each 16 inputs of a row, in ``W``'s dtype, then float32
    group scale ``s``    ``e4m3(clamp(m / (6 * S2), 2**-9, 448))`` (float32 quotient; ``m / ..``
                         == 0 -> 1.0 before the clamp)
    scaled value ``x``   ``float32(W) / (float32(s) * S2)``
    e2m1 code            ``|x|`` counted past ``0.25 .. 5`` (``searchsorted``), plus one on
                         ``0.75``, ``1.75``, ``3.5`` (ties to the even code, as
                         compressed-tensors'); sign bit ``8`` where ``x < 0``
    packed byte          column ``2j`` in the low nibble, ``2j+1`` in the high
    ===================  ==========================================================================
    """
    n, columns = w.shape
    groups = w.reshape(n, columns // GROUP, GROUP)
    step = groups.abs().amax(-1).to(torch.float32) / (E2M1_MAX * scale_2)
    step = torch.where(step == 0, torch.ones((), dtype=torch.float32), step)
    scale = step.clamp(min=MODELOPT_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    x = groups / (scale.to(torch.float32) * scale_2).unsqueeze(-1)
    a = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    for bound, inclusive in _BOUNDS:
        codes += (a >= bound) if inclusive else (a > bound)
    codes |= (x < 0).to(torch.uint8) << 3
    return pack_rows(codes.view(n, columns)), scale
