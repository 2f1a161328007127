"""Bands of a fused tensor's outputs made from its bytes as they stream (``reshard.core.row_bands``):
the same rows as cutting the whole outputs, whatever the producer's chunks, each output's buffer
reused band after band."""

from __future__ import annotations

import pytest
import torch

from reshard.core.row_bands import RowBandSink, in_order
from reshard.core.torch_writer import WriterError

H, D, GROUPS, HEADS = 6, 2, 3, 2  # hidden, head dim, query groups, query heads per group
ITEM = 2  # bfloat16


def _qkv_runs() -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """megatron-core's fused QKV ``[G * (q + 2) * d, H]``: per group, q heads' rows of q, then a head
    of k and one of v; as runs ``(src, length, out, dst)`` into q ``[G q d, H]``, k and v ``[G d, H]``."""
    row = H * ITEM
    runs, src = [], 0
    for g in range(GROUPS):
        for out, rows, dst_rows in ((0, HEADS * D, g * HEADS * D), (1, D, g * D), (2, D, g * D)):
            runs.append((src, rows * row, out, dst_rows * row))
            src += rows * row
    return runs, [(GROUPS * HEADS * D, H), (GROUPS * D, H), (GROUPS * D, H)]


def _whole_outputs(t: torch.Tensor, runs, shapes) -> list[torch.Tensor]:
    outs = [torch.empty(s, dtype=t.dtype) for s in shapes]
    src = t.contiguous().view(-1).view(torch.uint8)
    for s, n, o, d in runs:
        outs[o].view(-1).view(torch.uint8)[d:d + n] = src[s:s + n]
    return outs


def _stream(t: torch.Tensor, runs, shapes, band_rows, cuts) -> list[tuple[int, int, torch.Tensor]]:
    got = []
    sink = RowBandSink(runs, shapes, t.dtype, band_rows, lambda i, r, band: got.append((i, r, band.clone())), "qkv")
    data = t.contiguous().view(-1).view(torch.uint8)
    released = []
    for a, b in zip([0, *cuts], [*cuts, data.numel()]):
        sink.write(data[a:b], release=lambda: released.append(1))
    sink.finish(data.numel())
    assert len(released) == len(cuts) + 1  # every chunk given back once its bytes are taken
    return got


@pytest.mark.parametrize("band_rows", [[1, 1, 1], [4, 3, 2], [100, 100, 100]], ids=["row", "uneven", "whole"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bands_are_the_whole_outputs_rows_whatever_the_chunks(band_rows, seed):
    runs, shapes = _qkv_runs()
    t = torch.randn(sum(s[0] for s in shapes), H).to(torch.bfloat16)
    nbytes = t.numel() * ITEM
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, nbytes, (seed * 7 + 3,), generator=g).tolist()))
    want = _whole_outputs(t, runs, shapes)
    got = _stream(t, runs, shapes, band_rows, cuts)
    for i, out in enumerate(want):
        mine = [(r, band) for j, r, band in got if j == i]
        assert [r for r, _ in mine] == list(range(0, out.shape[0], min(band_rows[i], out.shape[0])))
        assert all(band.shape[0] <= band_rows[i] for _, band in mine)
        assert torch.equal(torch.cat([band for _, band in mine]), out)


def test_bytes_no_run_covers_are_dropped():
    """Padding after the outputs (a padded vocabulary's rows) is never handed on."""
    runs = [(0, 4 * H * ITEM, 0, 0)]
    t = torch.randn(6, H).to(torch.bfloat16)  # two rows of padding
    got = _stream(t, runs, [(4, H)], [3], [5, 40])
    assert [(i, r) for i, r, _ in got] == [(0, 0), (0, 3)]
    assert torch.equal(torch.cat([b for *_, b in got]), t[:4])


def test_the_band_buffer_is_reused():
    runs, shapes = _qkv_runs()
    t = torch.randn(sum(s[0] for s in shapes), H).to(torch.bfloat16)
    seen = set()
    sink = RowBandSink(runs, shapes, t.dtype, [2, 2, 2], lambda i, r, band: seen.add((i, band.data_ptr())))
    sink.write(t)
    sink.finish(t.numel() * ITEM)
    assert len(seen) == 3  # one buffer per output, not one per band


def test_runs_that_do_not_fill_outputs_in_order_are_refused():
    row = H * ITEM
    assert in_order(_qkv_runs()[0], [12 * row, 3 * D * row, 3 * D * row])
    assert not in_order([(0, row, 0, row), (row, row, 0, 0)], [2 * row])  # rows out of order
    assert not in_order([(0, row, 0, 0)], [2 * row])  # an output not filled
    assert not in_order([(0, row, 0, 0), (row, row, 0, 0)], [row])  # a byte twice
    with pytest.raises(WriterError, match="do not fill its outputs in order"):
        RowBandSink([(0, row, 0, row), (row, row, 0, 0)], [(2, H)], torch.bfloat16, [1], lambda *a: None, "w")


def test_a_short_producer_is_an_error():
    t = torch.randn(4, H).to(torch.bfloat16)
    sink = RowBandSink([(0, t.numel() * ITEM, 0, 0)], [(4, H)], t.dtype, [3], lambda *a: None, "w")
    sink.write(t[:3])
    with pytest.raises(WriterError, match="producer of w wrote"):
        sink.finish(t.numel() * ITEM)
