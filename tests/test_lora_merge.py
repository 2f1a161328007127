"""``reshard.core.lora_merge.LoraMerged`` box by box (issue #59): every box bit-equal to PEFT's float32
merge of the whole weight, the base read where it lies in its mapped file, the adapter read once per
weight. tests/test_lora.py proves the same merge against PEFT on Megatron-Bridge's adapters end to
end; here the boxes a target reads (whole rows across fused parts, a row-parallel weight's columns,
bands of every size) are checked one by one, with the reads that make the merge fast or slow."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard.core import lora_merge
from reshard.core.lazy import LazyTensor, RowConcat
from reshard.core.lora_merge import LoraMerged
from reshard.core.safetensors_read import MappedSafetensors

RANK, SCALE = 4, 2.5  # 2.5: not a power of two, so the scale's rounding is the PEFT order's or not


class Counted(LazyTensor):
    """A lazy tensor that counts how it is read (copied boxes, views, views given back)."""

    def __init__(self, inner: LazyTensor, counts: collections.Counter[str], name: str, views: bool = True) -> None:
        self.inner, self.counts, self.name, self.views = inner, counts, name, views
        self.shape, self.dtype = inner.shape, inner.dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        self.counts[f"{self.name} copied"] += 1
        return self.inner.read_box(offsets, sizes, out=out)

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        return self.inner.view_box(offsets, sizes) if self.views else None

    def view_pieces(self, offsets: tuple[int, ...],
                    sizes: tuple[int, ...]) -> list[tuple[LazyTensor, torch.Tensor]] | None:
        got = self.inner.view_pieces(offsets, sizes) if self.views else None
        if got is not None:
            self.counts[f"{self.name} viewed"] += 1
            got = [(self, view) for _, view in got]
        return got

    def release(self, t: torch.Tensor) -> None:
        self.counts[f"{self.name} released"] += 1
        self.inner.release(t)


def peft_merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float = SCALE) -> torch.Tensor:
    """PEFT's merge on a float32 model, cast back: ``W + (B @ A) * scaling``."""
    return (w.float() + (b.float() @ a.float()) * scale).to(w.dtype)


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def weights(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    """A fused base of three parts (q/k/v-like: 24, 8 and 8 rows of 40 columns), its adapter, in one
    safetensors file; bf16 (the merge rounded into it) and float32 (every bit of the float32 merge
    kept: a scale fused into the add is seen)."""
    g = torch.Generator().manual_seed(0)
    t = {name: torch.randn(rows, 40, generator=g).to(request.param) for name, rows in (("q", 24), ("k", 8), ("v", 8))}
    t["a"] = torch.randn(RANK, 40, generator=g)
    t["b"] = torch.randn(40, RANK, generator=g) * 0.1
    save_file(t, str(tmp_path / "w.safetensors"))
    return t


def lazy(tmp_path: Path, counts: collections.Counter[str]) -> LoraMerged:
    f = MappedSafetensors(tmp_path / "w.safetensors")
    base = RowConcat([(f.tensor(n), 0, f.tensor(n).shape[0]) for n in ("q", "k", "v")])
    return LoraMerged(Counted(base, counts, "base"), Counted(f.tensor("a"), counts, "A"),
                      Counted(f.tensor("b"), counts, "B"), SCALE)


def whole(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return peft_merged(torch.cat([weights["q"], weights["k"], weights["v"]]), weights["a"], weights["b"])


@pytest.mark.parametrize("band", [1 << 18, 40, 40 * 3 + 7])  # one band; a row per band; bands across parts
@pytest.mark.parametrize(("offsets", "sizes"), [((0, 0), (40, 40)), ((20, 0), (12, 40)), ((0, 20), (40, 20)),
                                                ((30, 7), (5, 13)), ((3, 30), (20, 10))])
def test_every_box_equals_the_whole_merge(tmp_path: Path, weights: dict[str, torch.Tensor],
                                          monkeypatch: pytest.MonkeyPatch, band: int,
                                          offsets: tuple[int, int], sizes: tuple[int, int]) -> None:
    """Whole rows across the fused parts, rows inside and across parts, a row-parallel box of
    columns, a box of neither: each equals the same box of PEFT's merge of the whole weight, bit
    for bit, whatever the band."""
    monkeypatch.setattr(lora_merge, "CHUNK_ELEMENTS", band)
    got = lazy(tmp_path, collections.Counter()).read_box(offsets, sizes)
    (r0, c0), (nr, nc) = offsets, sizes
    assert torch.equal(got, whole(weights)[r0:r0 + nr, c0:c0 + nc])


@pytest.mark.parametrize("scale", [SCALE, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_tensor_base_of_each_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype, scale: float) -> None:
    """A base held as a tensor (no mapped file), float32 (added as it is) or half (widened first);
    a scale of 1 (``lora_alpha`` = ``r``) as well."""
    w = torch.cat([weights["q"], weights["k"], weights["v"]]).to(dtype)
    m = LoraMerged(w, weights["a"], weights["b"], scale)
    out = torch.empty(16, 40, dtype=dtype)
    assert m.read_box((8, 0), (16, 40), out=out) is out
    assert torch.equal(out, peft_merged(w, weights["a"], weights["b"], scale)[8:24])


def test_whole_rows_are_read_where_they_lie_and_the_adapter_once(tmp_path: Path,
                                                                 weights: dict[str, torch.Tensor]) -> None:
    """A target reading a weight's whole rows box by box: no box of the base is copied (each fused
    part's rows are a view of the mapped file, given back once merged), and A and B are read once
    for the weight, not once per box."""
    counts: collections.Counter[str] = collections.Counter()
    m = lazy(tmp_path, counts)
    boxes = [m.read_box((r, 0), (10, 40)) for r in range(0, 40, 10)]
    assert torch.equal(torch.cat(boxes), whole(weights))
    # rows 20-30 are q's last 4 and k's first 6, rows 30-40 k's last 2 and v: a view per part
    assert counts == {"base viewed": 4, "base released": 6, "A copied": 1, "B copied": 1}


def test_a_thread_holds_one_weights_adapter(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Reading another weight lets go of the first one's adapter (a thread holds one at a time, so a
    model's adapters are never all in memory): the first one's next box reads its adapter again."""
    counts: collections.Counter[str] = collections.Counter()
    first, other = lazy(tmp_path, counts), lazy(tmp_path, collections.Counter())
    first.read_box((0, 0), (8, 40))
    other.read_box((0, 0), (8, 40))
    assert torch.equal(first.read_box((8, 0), (8, 40)), whole(weights)[8:16])
    assert counts["A copied"] == 2 and counts["B copied"] == 2


def test_a_row_parallel_weights_column_boxes(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Boxes of columns (a row-parallel weight cut for TP 2) merge their columns of the rows' views
    (nothing copied out of the base first) and read the adapter once for all of them."""
    counts: collections.Counter[str] = collections.Counter()
    m = lazy(tmp_path, counts)
    left = [m.read_box((r, 0), (20, 20)) for r in (0, 20)]
    right = [m.read_box((r, 20), (20, 20)) for r in (0, 20)]
    assert torch.equal(torch.cat([torch.cat(left), torch.cat(right)], dim=1), whole(weights))
    # rows 0-20 lie in q, rows 20-40 in q, k and v: 4 views a side
    assert counts == {"base viewed": 4, "base released": 8, "A copied": 1, "B copied": 1}


def test_a_base_that_is_no_view_is_copied_box_by_box(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    """A lazy base whose bytes are not where they could be viewed (a remote file, bytes decoded
    on read) is read box by box into a buffer, and merges the same."""
    counts: collections.Counter[str] = collections.Counter()
    m = lazy(tmp_path, counts)
    m.base = Counted(m.base.inner, counts, "base", views=False)
    got = torch.cat([torch.cat([m.read_box((r, c), (20, 20)) for c in (0, 20)], dim=1) for r in (0, 20)])
    assert torch.equal(got, whole(weights))
    assert counts == {"base copied": 4, "A copied": 1, "B copied": 1}


class SplitMidRow(Counted):
    """A mapped base whose views of whole rows come cut inside a row (bytes stored in pieces that
    do not follow rows)."""

    def view_pieces(self, offsets: tuple[int, ...],
                    sizes: tuple[int, ...]) -> list[tuple[LazyTensor, torch.Tensor]] | None:
        got = self.inner.view_pieces(offsets, sizes)
        if got is None:
            return None
        self.counts["base viewed"] += 1
        flat = torch.cat([view.reshape(-1) for _, view in got])  # stands for the stored bytes
        cut = sizes[1] // 2
        return [(self, flat[:cut]), (self, flat[cut:])]


def test_views_cut_inside_a_row_are_given_back_and_the_box_copied(tmp_path: Path,
                                                                  weights: dict[str, torch.Tensor]) -> None:
    """Views that are not whole rows cannot be merged row by row: each is given back, and the box
    is read into a buffer instead, merging the same."""
    counts: collections.Counter[str] = collections.Counter()
    m = lazy(tmp_path, counts)
    m.base = SplitMidRow(m.base.inner, counts, "base")
    assert torch.equal(m.read_box((0, 0), (10, 40)), whole(weights)[:10])
    assert counts == {"base viewed": 1, "base released": 2, "base copied": 1, "A copied": 1, "B copied": 1}


# --- bands merged in one GEMM onto their base (``fused_add_is_exact``) -------------------------------

ROWS, COLS = (48, 24, 24), 160  # a fused q/k/v-like base of 96 rows, wide enough for MIN_COLS


def wide_merge(tmp_path: Path, dtype: torch.dtype, rank: int, scale: float) -> tuple[LoraMerged, torch.Tensor]:
    """A fused base of :data:`ROWS` x :data:`COLS` in a mapped file, merged with a rank-``rank`` adapter,
    and PEFT's merge of the whole weight."""
    g = torch.Generator().manual_seed(rank)
    t = {f"p{i}": torch.randn(rows, COLS, generator=g).to(dtype) for i, rows in enumerate(ROWS)}
    t["a"] = torch.randn(rank, COLS, generator=g) * 0.1
    t["b"] = torch.randn(sum(ROWS), rank, generator=g) * 0.1
    save_file(t, str(tmp_path / "wide.safetensors"))
    f = MappedSafetensors(tmp_path / "wide.safetensors")
    base = RowConcat([(f.tensor(f"p{i}"), 0, rows) for i, rows in enumerate(ROWS)])
    want = peft_merged(torch.cat([t[f"p{i}"] for i in range(len(ROWS))]), t["a"], t["b"], scale)
    return LoraMerged(base, f.tensor("a"), f.tensor("b"), scale), want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rank", [4, 256])  # 256: past MKL's inner block, where the fused GEMM differs
@pytest.mark.parametrize("scale", [1.0, 2.0, 0.5, 2.5])
@pytest.mark.parametrize(("offsets", "sizes"), [((0, 0), (96, 160)), ((0, 80), (96, 80)), ((10, 0), (70, 160)),
                                                ((0, 30), (96, 70))])
def test_bands_of_a_wide_weight_equal_the_whole_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      dtype: torch.dtype, rank: int, scale: float,
                                                      offsets: tuple[int, int], sizes: tuple[int, int]) -> None:
    """Bands with the minimum rows and columns themselves (merged in one GEMM where that is exact)
    and tails of fewer rows (merged unfused) give PEFT's whole merge bit for bit: whole rows, a
    row-parallel weight's half, rows from inside a part, columns at an offset; every scale kind."""
    monkeypatch.setattr(lora_merge, "CHUNK_ELEMENTS", 30 * 160)  # bands of 30 rows (60 of 80 columns)
    m, want = wide_merge(tmp_path, dtype, rank, scale)
    (r0, c0), (nr, nc) = offsets, sizes
    assert torch.equal(m.read_box(offsets, sizes), want[r0:r0 + nr, c0:c0 + nc])


def test_a_fp32_base_into_an_out_of_columns(tmp_path: Path) -> None:
    """A float32 merge written into an ``out`` that is a column slice of a larger buffer (the engine
    gathering one source's columns of a row-parallel weight) goes through the band buffer."""
    m, want = wide_merge(tmp_path, torch.float32, 4, 2.0)
    out = torch.full((96, 200), float("nan"))
    m.read_box((0, 0), (96, 160), out=out[:, 20:180])
    assert torch.equal(out[:, 20:180], want)
    assert out[:, :20].isnan().all() and out[:, 180:].isnan().all()


def test_the_fused_gemm_is_used_where_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power-of-two scale of at least 1 and a small rank: this BLAS (torch's MKL build) sums from
    zero, so the bands are merged in one GEMM each; other scales are never fused."""
    calls: list[tuple[int, ...]] = []
    addmm_ = torch.Tensor.addmm_

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(self.shape))
        return addmm_(self, *args, **kwargs)

    threads = torch.get_num_threads()
    assert all(lora_merge.fused_add_is_exact(20, 160, 4, s, threads) for s in (1.0, 2.0, 4.0))
    assert not any(lora_merge.fused_add_is_exact(20, 160, 4, s, threads) for s in (0.5, 2.5, 3.0))
    monkeypatch.setattr(lora_merge, "CHUNK_ELEMENTS", 20 * 160)
    monkeypatch.setattr(torch.Tensor, "addmm_", counted)
    m, want = wide_merge(tmp_path, torch.bfloat16, 4, 2.0)
    assert torch.equal(m.read_box((0, 0), (96, 160)), want)
    # each fused part's rows (48, 24, 24) in bands of 20: the tails of 8, 4 and 4 rows are unfused
    assert calls == [(20, 160)] * 4


def test_a_blas_that_adds_onto_the_base_first_is_not_fused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMM that starts its sums from ``C`` (a BLAS's small-shape kernel; an inner dimension cut
    in blocks) rounds otherwise: the probe sees it, and the merge stays bit-equal, unfused."""
    def from_c(self: torch.Tensor, b: torch.Tensor, a: torch.Tensor, *, alpha: float = 1.0) -> torch.Tensor:
        for i in range(a.shape[0]):
            self.add_(b[:, i:i + 1] * a[i:i + 1] * alpha)
        return self

    lora_merge.fused_add_is_exact.cache_clear()
    monkeypatch.setattr(torch.Tensor, "addmm_", from_c)
    try:
        assert not lora_merge.fused_add_is_exact(30, 160, 4, 2.0, torch.get_num_threads())
        monkeypatch.setattr(lora_merge, "CHUNK_ELEMENTS", 30 * 160)
        m, want = wide_merge(tmp_path, torch.bfloat16, 4, 2.0)
        assert torch.equal(m.read_box((0, 0), (96, 160)), want)
    finally:
        lora_merge.fused_add_is_exact.cache_clear()  # verdicts of the real BLAS only, for later tests


def test_each_weights_adapter_is_read_into_the_threads_buffers(tmp_path: Path,
                                                               weights: dict[str, torch.Tensor]) -> None:
    """A and B of one weight after another are read into the same memory of this thread (no
    allocation per weight: a megabyte of adapter per weight, allocated and freed, grew the heap
    with the model's layers), and a weight read again after another reads its own adapter back."""
    into: list[int] = []

    class Into(Counted):
        def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                     out: torch.Tensor | None = None) -> torch.Tensor:
            into.append(-1 if out is None else out.untyped_storage().data_ptr())
            return super().read_box(offsets, sizes, out=out)

    counts: collections.Counter[str] = collections.Counter()
    first, want = wide_merge(tmp_path, torch.float32, 4, 2.0)
    other = lazy(tmp_path, collections.Counter())
    for m in (first, other):
        m.a, m.b = Into(m.a, counts, "A"), Into(m.b, counts, "B")
    first.read_box((0, 0), (16, 160))
    other.read_box((0, 0), (8, 40))
    assert torch.equal(first.read_box((16, 0), (32, 160)), want[16:48])
    assert len(into) == 6 and -1 not in into and into[0:2] == into[2:4] == into[4:6]  # A, B of each weight



def test_an_adapter_read_that_fails_midway_leaves_no_stale_adapter(tmp_path: Path,
                                                                  weights: dict[str, torch.Tensor]) -> None:
    """A weight whose B fails to read after its (other) A was read into the thread's buffers, over
    the last weight's A: the error reaches the caller, and the last weight, read again, reads its
    own adapter back instead of merging with the other's A."""
    class Other(Counted):
        def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                     out: torch.Tensor | None = None) -> torch.Tensor:
            return super().read_box(offsets, sizes, out=out).mul_(2)

    class Broken(Counted):
        def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                     out: torch.Tensor | None = None) -> torch.Tensor:
            raise OSError("the adapter's file went away")

    counts: collections.Counter[str] = collections.Counter()
    first, other = lazy(tmp_path, counts), lazy(tmp_path, collections.Counter())
    other.a, other.b = Other(other.a.inner, counts, "other A"), Broken(other.b.inner, counts, "other B")
    first.read_box((0, 0), (8, 40))
    with pytest.raises(OSError, match="went away"):
        other.read_box((0, 0), (8, 40))
    assert torch.equal(first.read_box((8, 0), (8, 40)), whole(weights)[8:16])
    assert counts["A copied"] == 2  # read again
