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
"""

from __future__ import annotations

import torch

#: Values along a row that share one e4m3 scale.
GROUP = 16
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


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
