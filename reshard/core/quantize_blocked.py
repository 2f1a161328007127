"""Cache-blocked CPU version of :func:`reshard.core.quantize.quantize_groups` — same results, bit for bit.

``quantize_groups`` is one vectorized expression over the whole weight: ``x.float()``, ``amax``,
``amin``, multiply, round, clamp, cast — six full-size float32 temporaries. On a CPU that is
memory-bound, and every temporary is a fresh allocation whose pages the kernel must fault in
and zero (expensive in VMs). For large weights it ends up no faster than DeepSpeed's loop over
groups. This version makes the same float32 operations in the same order, on blocks of whole
groups that stay in cache, in one reused buffer. Per block: ``x.float()`` into the buffer,
per-group ``amax`` and ``amin`` (separate reductions: torch's fused ``aminmax`` and half-precision
reductions are several times slower on CPU), the scale exactly as DeepSpeed computes it
(``2**B / (2 * max|x| + 1e-5)`` in float32), then in place ``mul_``, ``round_`` (half to even),
``clamp_``, and the cast into the int8 output.

On other devices (CUDA) the vectorized original is used as is.
"""

from __future__ import annotations

import torch

from reshard.core.quantize import quantize_groups

#: input dtypes taken by the blocked path (others: the reference, unchanged)
_EXACT = (torch.float16, torch.bfloat16, torch.float32)
#: float32 bytes per block (a few MiB: whole groups, in cache, few kernel launches)
BLOCK_BYTES = 4 << 20


def quantize_groups_blocked(x: torch.Tensor, bits: int, groups: int, key: str = "tensor"
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reshard.core.quantize.quantize_groups`, blocked: ``(q int8 shaped like x, s float32 [groups])``."""
    if (x.device.type != "cpu" or x.dtype not in _EXACT or not 1 <= bits <= 8 or groups < 1
            or x.numel() == 0 or x.numel() % groups):
        return quantize_groups(x, bits, groups, key)  # its errors and its device handling
    flat = x.reshape(groups, -1)
    n = flat.shape[1]
    out = torch.empty((groups, n), dtype=torch.int8)
    s = torch.empty(groups, dtype=torch.float32)
    per = max(1, BLOCK_BYTES // (4 * n))
    buf = torch.empty((min(per, groups), n), dtype=torch.float32)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for g0 in range(0, groups, per):
        k = min(per, groups - g0)
        b = buf[:k]
        b.copy_(flat[g0:g0 + k])  # x.float()
        mx = torch.maximum(b.amax(dim=1), b.amin(dim=1).abs())
        sb = float(1 << bits) / (2 * mx + 1e-5)
        s[g0:g0 + k] = sb
        b.mul_(sb.unsqueeze(1)).round_().clamp_(lo, hi)
        out[g0:g0 + k].copy_(b)
    return out.reshape(x.shape), s
