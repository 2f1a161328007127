"""A LoRA adapter merged into its base weight, read box by box: ``W + scale * B @ A``.

Why here: the merge is arithmetic on tensors, the same for every format and family. It is done in
float32 and cast once to the base weight's dtype (as PEFT's ``merge_and_unload`` on a float32 model
computes it), for the box a target reads only: memory is the box, a band's float32 buffers and the
adapter of the one weight being read (the adapter may be lazy, so a model's adapters are never held
whole), never the merged model.

=======================  ==============================================================
tensor                   shape
=======================  ==============================================================
``base`` (W)             ``[out, in]``
``a`` (LoRA's A)         ``[r, in]``, float32 while its weight is read
``b`` (LoRA's B)         ``[out, r]``, float32 while its weight is read
box (offsets, sizes)     rows ``o0 .. o0+s0`` of W and of B; columns ``o1 .. o1+s1`` of W and of A
band                     about :data:`CHUNK_ELEMENTS` of a box's rows, merged at once
band's ``B @ A``         the band's rows and columns, and neighbours' up to
                         :data:`MIN_ROWS` x :data:`MIN_COLS` (whole-weight bits)
=======================  ==============================================================

Where the time goes (issue 59; docs/performance.md): the rank-``r`` GEMM and the passes over a
band, all in the core's cache; what made a merge slow besides was memory, not arithmetic. So nothing
here allocates per box or band: the float32 band and the base's float32 copy are buffers kept per
thread, the base is read where it lies (each fused part's rows a view of its mapped file, not
gathered into a fresh copy), and the adapter's float32 A and B are read once per weight, not once
per box. Where it gives the same bits (:func:`fused_add_is_exact`: a power-of-two scale, a BLAS
that adds its sums to the base once), a band is three passes: the base widened, one GEMM onto it
(``addmm_``), the cast back; else five (GEMM, scale, widen, add, cast).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any

import torch

from reshard.core.lazy import LazyTensor, box_of

#: Elements of a band of rows merged at once: 1 MiB of float32, so the band's ``B @ A`` is still in
#: the core's cache when the base is added to it.
CHUNK_ELEMENTS = 1 << 18

#: The fewest rows and columns a band's ``B @ A`` is taken over. A BLAS picks another kernel, which
#: sums in another order, for a product of few rows or columns (MKL on an AVX2 CPU: under 4 rows or
#: 12 columns): its bits would then differ from the whole weight's product, PEFT's.
MIN_ROWS, MIN_COLS = 16, 64

#: The largest buffer a thread keeps (bytes); a bigger box (a caller reading a whole weight at once)
#: gets a buffer of its own, freed with it.
KEPT_BYTES = 16 * CHUNK_ELEMENTS

#: Per thread: the buffers of :func:`_kept` and the adapter of the weight it read last.
_per_thread = threading.local()


def _kept(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's buffer ``name`` as a ``dtype`` tensor of ``shape``, kept from band to band and
    from box to box (a fresh megabyte per band is fresh pages to fault in and give back); one of
    its own above :data:`KEPT_BYTES`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > KEPT_BYTES:
        return torch.empty(shape, dtype=dtype)
    buf = getattr(_per_thread, name, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        setattr(_per_thread, name, buf)
    return buf[:nbytes].view(dtype).view(shape)


def _float32(name: str, t: Any) -> torch.Tensor:
    """All of ``t`` (a tensor or a lazy one) in float32; a lazy one read into this thread's kept
    buffer ``name`` (through ``name``-raw when it is stored in another dtype)."""
    if not isinstance(t, LazyTensor):
        return t.to(torch.float32)
    shape = tuple(t.shape)
    wide = _kept(name, shape)
    if t.dtype == torch.float32:
        return t.read_box((0,) * len(shape), shape, out=wide)
    return wide.copy_(t.read_box((0,) * len(shape), shape, out=_kept(f"{name}-raw", shape, t.dtype)))


@functools.lru_cache(maxsize=1024)
def fused_add_is_exact(rows: int, cols: int, rank: int, scale: float, threads: int) -> bool:
    """Whether ``C.addmm_(B, A, alpha=scale)`` (``C`` ``[rows, cols]`` float32, ``B`` ``[rows, rank]``,
    ``A`` ``[rank, cols]``) equals ``C + (B @ A) * scale`` bit for bit, as this process's BLAS
    computes both at ``threads`` intra-op threads (torch's count where it is asked).

    Why: the fused GEMM saves a band two of its passes (the product's zeroing by the BLAS and the
    add), about a quarter of a merge's arithmetic. It is exact only where (a) ``scale`` is a power
    of two of at least 1, so ``scale * (B @ A)`` is exact, and (b) the BLAS sums the rank's
    products from zero and adds ``C`` once, as the unfused product then add do. (b) is the BLAS's
    choice by shape: MKL's kernels for the larger shapes do, its small-shape kernels start from
    ``C``, and a rank past its block of the inner dimension (from 256 here, on an AVX2 CPU) adds ``C``
    to the first block's sums. So (b) is seen, not assumed: seeded random operands of the very shape are
    multiplied both ways once per process and shape (where the orders differ, thousands of sums
    do); anything else is merged unfused."""
    if not (scale >= 1.0 and math.frexp(scale)[0] == 0.5):
        return False
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rank, cols, generator=g)
    b = torch.randn(rows, rank, generator=g)
    c = torch.randn(rows, cols, generator=g)
    want = torch.matmul(b, a)
    if scale != 1.0:
        want.mul_(scale)
    want.add_(c)
    return torch.equal(c.addmm_(b, a, alpha=scale), want)


class LoraMerged(LazyTensor):
    """``base`` (a tensor or a lazy one, ``[out, in]``) with ``scale * b @ a`` added, in float32, cast
    once; ``a`` and ``b`` tensors or lazy ones."""

    def __init__(self, base: Any, a: Any, b: Any, scale: float) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = tuple(base.shape)
        self.dtype = base.dtype

    def _adapter_for(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B in float32 (``(in + out) * r`` elements, a small part of the weight's): read at
        the weight's first box on this thread, into this thread's kept buffers, and kept while the
        thread reads the weight's boxes. The next weight's are read into the same buffers, so a
        thread holds one weight's adapter at a time, and a model's adapters of every size are no
        fresh allocations to fragment the heap (a megabyte per weight grew it with the layers)."""
        held = getattr(_per_thread, "adapter", None)
        if held is not None and held[0]() is self:
            return held[1], held[2]
        _per_thread.adapter = None  # first: a read that fails midway leaves no stale A and B held
        a, b = _float32("lora_a", self.a), _float32("lora_b", self.b)
        _per_thread.adapter = (weakref.ref(self), a, b)
        return a, b

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        (r0, c0), (nr, nc) = offsets, sizes
        dst = torch.empty(sizes, dtype=self.dtype) if out is None else out
        width = self.shape[1]
        # the box's rows, whole, where they lie (each fused part's run of rows a view of its mapped
        # file); a box of columns (a row-parallel weight cut by TP) merges its columns of them
        pieces = self.base.view_pieces((r0, 0), (nr, width)) if isinstance(self.base, LazyTensor) and nr else None
        if pieces is not None and any(view.numel() % max(width, 1) for _, view in pieces):  # not whole rows
            for owner, view in pieces:
                owner.release(view)
            pieces = None
        if pieces is None:  # not where it lies (a tensor, a remote file): one copy, in a kept buffer when lazy
            w = self.base.read_box(offsets, sizes, out=_kept("gathered", sizes, self.dtype)) \
                if isinstance(self.base, LazyTensor) else box_of(self.base, offsets, sizes)
            self._merge_rows(w, r0, c0, dst)
            return dst
        at = 0
        for owner, view in pieces:
            rows = view.numel() // max(width, 1)
            self._merge_rows(view.view(rows, width)[:, c0:c0 + nc], r0 + at, c0, dst[at:at + rows])
            owner.release(view)  # read: the mapped file's pages are given back
            at += rows
        return dst

    def _merge_rows(self, w: torch.Tensor, r0: int, c0: int, dst: torch.Tensor) -> None:
        """``dst = W + scale * B @ A`` for ``w``, the weight's rows from ``r0`` and columns from
        ``c0``, a band at a time. Each band's product is taken over at least :data:`MIN_ROWS` rows
        and :data:`MIN_COLS` columns of the weight (its neighbours' where the band has fewer), so
        its sums are those of the whole weight's product. A band that has them itself is merged in
        one GEMM onto its widened base where that is bit for bit the same (:func:`fused_add_is_exact`)."""
        a, b = self._adapter_for()
        (out_rows, in_cols), (nr, nc) = self.shape, w.shape
        q = max(nc, min(MIN_COLS, in_cols))  # the product's columns: [k, k + q) holds [c0, c0 + nc)
        k = min(c0, in_cols - q)
        a_q = a[:, k:k + q]
        step = max(1, min(nr, CHUNK_ELEMENTS // max(q, 1)))
        m_most = max(step, min(MIN_ROWS, out_rows))
        band = _kept("band", (m_most * q,))
        wide = _kept("base", (step, nc))
        in_place = dst.dtype == torch.float32 and dst.is_contiguous()  # fused into dst itself
        rank, scale, threads = a.shape[0], float(self.scale), torch.get_num_threads()
        for i in range(0, nr, step):
            n = min(step, nr - i)
            if q == nc and n >= min(MIN_ROWS, out_rows) and fused_add_is_exact(n, nc, rank, scale, threads):
                acc = dst[i:i + n] if in_place else wide[:n]
                acc.copy_(w[i:i + n])  # exact: W as W.float()
                acc.addmm_(b[r0 + i:r0 + i + n], a_q, alpha=scale)  # W + (B A) * scale in one pass
                if not in_place:
                    dst[i:i + n].copy_(acc)  # rounded once into the base's dtype
                continue
            m = max(n, min(MIN_ROWS, out_rows))  # the product's rows: [j, j + m) holds this band's
            j = min(r0 + i, out_rows - m)
            product = torch.matmul(b[j:j + m], a_q, out=band[:m * q].view(m, q))
            delta = product[r0 + i - j:r0 + i - j + n, c0 - k:c0 - k + nc]
            if scale != 1.0:  # x * 1.0 is x: a pass saved where alpha = r (Megatron-Bridge's default)
                delta.mul_(scale)  # (B A) * scale, then + W: PEFT's order (get_delta_weight, then +=)
            base = w[i:i + n] if w.dtype == torch.float32 else wide[:n].copy_(w[i:i + n])  # exact: W as W.float()
            delta.add_(base)
            dst[i:i + n].copy_(delta)  # rounded once into the base's dtype

    def __repr__(self) -> str:
        return f"LoraMerged({self.shape}, {self.dtype}, r={self.a.shape[0]}, scale={self.scale})"

