"""The engine gathers a lazily read tensor that is no one region of a mapped file in blocks of at
most ``GATHER_BYTES`` (not whole: a ZeRO parameter cut by a partition boundary, a row-parallel
weight), bytes unchanged; sources that convert the whole tensor for any box are read once; scratch
buffers are kept per thread, and dropped when a target fails."""

from __future__ import annotations

import pytest
import torch

from reshard.core.layouts import PartitionSpec
from reshard.core.lazy import Converted, LazyTensor
from reshard.core.zero_master import FlatSlice
from reshard.execution import engine


class _Recording(engine.ScratchBuffers):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def take(self, nbytes: int) -> torch.Tensor:
        self.largest = max(self.largest, nbytes)
        return super().take(nbytes)


def _straddling(t: torch.Tensor, cut: int) -> FlatSlice:
    """``t`` as a FlatSlice over two partitions split at flat element ``cut`` (no view of it exists)."""
    flat = t.reshape(-1)
    return FlatSlice([(flat[:cut].clone(), 0, cut), (flat[cut:].clone(), 0, flat.numel() - cut)], tuple(t.shape))


@pytest.mark.parametrize("dim", [0, 1])
def test_gathered_in_blocks_bytes_unchanged(monkeypatch, dim):
    monkeypatch.setattr(engine, "GATHER_BYTES", 256)  # 16 fp32 rows of 4 (dim 1: of 8) per block
    a, b = torch.randn(40, 4), torch.randn(40, 4)
    if dim == 1:
        a, b = a.reshape(20, 8), b.reshape(20, 8)
    sources = {0: _straddling(a, 37), 1: _straddling(b, 101)}
    pool = _Recording()
    got = engine.pending_lazy_assembled(PartitionSpec(dim=dim), sources, 2, 1, 0, "w", "here", pool).materialize()
    assert torch.equal(got, torch.cat([a, b], dim=dim))
    assert pool.largest <= 256  # whole, it would be 1280 bytes


class _Counting(LazyTensor):
    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype, self.reads = t, tuple(t.shape), t.dtype, 0

    def read_box(self, offsets, sizes, out=None):
        self.reads += 1
        box = self.t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return box.contiguous() if out is None else out.copy_(box)


def test_a_source_that_converts_the_whole_tensor_is_read_once(monkeypatch):
    monkeypatch.setattr(engine, "GATHER_BYTES", 64)
    raw = [_Counting(torch.randn(16, 10)) for _ in range(2)]
    sources = {i: Converted(r, lambda x: x.t().contiguous(), (10, 16)) for i, r in enumerate(raw)}
    got = engine.pending_lazy_assembled(PartitionSpec(dim=1), sources, 2, 1, 0, "w", "here", None).materialize()
    assert torch.equal(got, torch.cat([r.t.t() for r in raw], dim=1))
    assert [r.reads for r in raw] == [1, 1]  # one block: each read converts the whole tensor


def test_scratch_buffers_are_kept_per_thread_and_dropped_when_a_target_fails(sample_factory, tmp_path, monkeypatch):
    from reshard.core.options import ReshardOptions
    from reshard.execution.planner import build_plan
    from reshard.formats.registry import get_format

    first = engine.thread_scratch()
    assert engine.thread_scratch() is first  # the next target reuses them
    plan = build_plan(str(sample_factory(2)), ReshardOptions(target_tp=1))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(get_format(plan.output_format)), "write", broken)
    with pytest.raises(OSError):
        engine.convert_target(plan, 0, tmp_path / "out.pt")
    assert engine.thread_scratch() is not first


class _Mapped(LazyTensor):
    """A tensor whose boxes of whole rows are views (as of a mapped file), recording what is given back."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype, self.released = t, tuple(t.shape), t.dtype, []

    def view_box(self, offsets, sizes):
        box = self.t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return box if box.is_contiguous() else None

    def read_box(self, offsets, sizes, out=None):
        box = self.t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return box.contiguous() if out is None else out.copy_(box)

    def release(self, t):
        self.released.append(t.data_ptr())


def test_a_fused_qkv_is_written_from_its_parts_mappings_not_gathered():
    """Q, K and V fused per query group (a RowConcat of runs of each) -> TP 2: each target's rows
    are written as views of the three tensors, nothing gathered into scratch buffers, bytes as
    the concatenation; each piece is given back to the tensor it came from."""
    from reshard.core.lazy import RowConcat

    groups, q_rows, kv_rows, cols = 4, 6, 2, 5
    q, k, v = (_Mapped(torch.randn(groups * n, cols)) for n in (q_rows, kv_rows, kv_rows))
    fused = RowConcat([seg for g in range(groups)
                       for seg in ((q, g * q_rows, q_rows), (k, g * kv_rows, kv_rows), (v, g * kv_rows, kv_rows))])
    want = torch.cat([x.t[g * n:(g + 1) * n] for g in range(groups)
                      for x, n in ((q, q_rows), (k, kv_rows), (v, kv_rows))])
    half = want.shape[0] // 2
    for tgt in range(2):
        pool = _Recording()
        got = engine.pending_lazy_assembled(PartitionSpec(dim=0), {0: fused}, 1, 2, tgt, "qkv", "here",
                                            pool).materialize()
        assert torch.equal(got, want[tgt * half:(tgt + 1) * half])
        assert pool.largest == 0  # written from the views
    starts = {x: {x.t[r].data_ptr() for r in range(0, x.shape[0], n)}
              for x, n in ((q, q_rows), (k, kv_rows), (v, kv_rows))}
    for x in (q, k, v):
        assert sorted(x.released) == sorted(starts[x])  # every run of x given back to x, and only those
