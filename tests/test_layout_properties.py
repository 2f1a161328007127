"""The pure layout math, exhaustively over small cases (in the style of torchao's primitives
tests): for every N -> M, part length, fused parts, atom and vocabulary resize, the pieces of all
target ranks cover every logical row exactly once and in order, and :func:`assemble` equals an
independent slicing of the logical tensor. The checks are shown to catch the plausible wrong
answers (a row misplaced, a part swapped, a head cut).

==========================  ==================================================================
case                        what the target ranks together must hold, per part
==========================  ==================================================================
plain split/merge           rows 0 .. N*L-1 of the logical part, each once, in order
resized (vocabulary)        rows 0 .. keep-1 from the source, then total-keep zero rows
fused parts (QKV v0, fc1)   each part sliced on its own: [part_0 slice; part_1 slice; ...]
atom (heads, groups)        accepted exactly when N*L/atom divides by M
sections (unequal parts)    each section sliced on its own, its atoms whole on every rank
==========================  ==================================================================
"""

from __future__ import annotations

import itertools

import pytest
import torch

from reshard.core.errors import LayoutError
from reshard.core.layouts import (
    FILL,
    PartitionSpec,
    Piece,
    assemble,
    check_divisible,
    part_segments,
    pieces_for_target,
    sectioned,
)

RANKS = range(1, 9)
PART_LENS = (1, 2, 3, 4, 6, 12)


def covered_rows(pieces_by_target: list[list[Piece]], part_len: int) -> list[int]:
    """The logical rows the targets hold, in target order (FILL rows as -1)."""
    rows: list[int] = []
    for pieces in pieces_by_target:
        for pc in pieces:
            rows += [FILL] * pc.length if pc.src == FILL else [pc.src * part_len + r for r in range(pc.start, pc.stop)]
    return rows


def _cases(n: int, m: int):
    """(part_len, keep, total) of the plain, padded and re-padded cases valid at N -> M."""
    for part_len in PART_LENS:
        src_total = n * part_len
        if src_total % m == 0:
            yield part_len, None, None
        for extra in (0, 1, 3):  # a multiple of M, as check_divisible requires
            total = m * ((src_total + m - 1) // m + extra)
            yield part_len, src_total, total  # padding: all source rows kept, zeros appended
        for keep in {1, src_total // 2, src_total - 1} - {0}:
            yield part_len, keep, m * ((keep + m - 1) // m)  # re-padding after trimming to a true size


@pytest.mark.parametrize("n,m", list(itertools.product(RANKS, RANKS)), ids=lambda v: str(v))
def test_every_row_lands_exactly_once_in_order(n, m):
    for part_len, keep, total in _cases(n, m):
        pieces = [pieces_for_target(part_len, n, m, t, keep, total) for t in range(m)]
        src_total = n * part_len
        total_rows = src_total if total is None else total
        kept = min(src_total, total_rows) if keep is None else keep
        case = (part_len, keep, total)
        assert covered_rows(pieces, part_len) == list(range(kept)) + [FILL] * (total_rows - kept), case
        for ps in pieces:
            assert sum(p.length for p in ps) == total_rows // m, case  # equal target ranks
            assert all(0 <= p.start < p.stop <= part_len for p in ps if p.src != FILL), case


def _logical(sources: list[torch.Tensor], spec: PartitionSpec) -> list[torch.Tensor]:
    """Independent reference: each fused part's full tensor (that part of every source rank, concatenated)."""
    return [torch.cat([s.chunk(spec.parts, dim=spec.dim)[p] for s in sources], dim=spec.dim)
            for p in range(spec.parts)]


def _reference(sources: list[torch.Tensor], spec: PartitionSpec, m: int, t: int) -> torch.Tensor:
    out = []
    for full in _logical(sources, spec):
        total = full.shape[spec.dim] if spec.total is None else spec.total
        keep = min(full.shape[spec.dim], total) if spec.keep is None else spec.keep
        shape = list(full.shape)
        shape[spec.dim] = total - keep
        padded = torch.cat([full.narrow(spec.dim, 0, keep), full.new_zeros(shape)], dim=spec.dim)
        step = total // m
        out.append(padded.narrow(spec.dim, t * step, step))
    return torch.cat(out, dim=spec.dim)


SPECS = [PartitionSpec(dim=0), PartitionSpec(dim=1), PartitionSpec(dim=0, parts=2), PartitionSpec(dim=0, parts=3),
         PartitionSpec(dim=1, atom=2), PartitionSpec(dim=0, atom=3)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"dim{s.dim}-parts{s.parts}-atom{s.atom}")
def test_assemble_equals_slicing_the_logical_tensor(spec):
    gen = torch.Generator().manual_seed(0)
    refused = 0
    for n, m, units in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 3, 4, 6, 8), (1, 2, 3)):
        rank_len = spec.parts * spec.atom * units  # ``units`` atoms per part on each source rank
        if (n * units) % m:
            refused += 1
            with pytest.raises(LayoutError):
                check_divisible(spec, rank_len, n, m, "w")
            continue
        check_divisible(spec, rank_len, n, m, "w")
        shape = [rank_len, 5] if spec.dim == 0 else [5, rank_len]
        sources = [torch.randn(*shape, generator=gen) for _ in range(n)]
        for t in range(m):
            got = assemble(spec, dict(enumerate(sources)), n, m, t)
            assert torch.equal(got, _reference(sources, spec, m, t)), (n, m, units, t)
    assert refused  # the refusal branch is exercised too


def test_assemble_resized_vocabulary_equals_slicing_the_padded_tensor():
    gen = torch.Generator().manual_seed(1)
    for n, m, keep in [(4, 2, 224), (4, 3, 224), (2, 8, 200), (8, 1, 1000), (3, 2, 90)]:
        rows = {4: 224, 2: 208, 8: 1024, 3: 96}[n]
        total = m * ((keep + 8 * m - 1) // (8 * m)) * 8
        spec = PartitionSpec(dim=0, keep=keep, total=total)
        check_divisible(spec, rows // n, n, m, "emb")
        sources = [torch.randn(rows // n, 4, generator=gen) for _ in range(n)]
        for t in range(m):
            assert torch.equal(assemble(spec, dict(enumerate(sources)), n, m, t), _reference(sources, spec, m, t))


# --- the checks catch the plausible wrong answers -------------------------------------------------

def test_coverage_check_catches_a_misplaced_row():
    right = [pieces_for_target(4, 2, 2, t) for t in range(2)]
    assert covered_rows(right, 4) == list(range(8))
    swapped = [right[1], right[0]]  # targets in the wrong order
    shifted = [[Piece(0, 1, 4)], right[1] + [Piece(0, 0, 1)]]  # one row moved to the wrong target
    for wrong in (swapped, shifted):
        assert covered_rows(wrong, 4) != list(range(8))


def test_reference_catches_parts_sliced_as_one_tensor():
    """Gated fc1 [W; V] at 2 -> 1: slicing the rank tensor as a whole would interleave gate and up."""
    spec = PartitionSpec(dim=0, parts=2)
    w = [torch.arange(4.0).reshape(4, 1) + 10 * r for r in range(2)]  # rank r: [W_r (2 rows); V_r (2 rows)]
    whole = torch.cat(w)  # the wrong answer: [W_0; V_0; W_1; V_1]
    right = assemble(spec, dict(enumerate(w)), 2, 1, 0)
    assert torch.equal(right, _reference(w, spec, 1, 0))
    assert not torch.equal(whole, right)
    assert right.flatten().tolist() == [0, 1, 10, 11, 2, 3, 12, 13]  # [W_0; W_1; V_0; V_1]


def test_divisibility_refuses_a_cut_head():
    spec = PartitionSpec(dim=0, atom=3)  # 3 rows per head
    check_divisible(spec, 6, 2, 4, "qkv")  # 4 heads over 4 ranks
    with pytest.raises(LayoutError, match="4 heads .* 3 target ranks"):
        check_divisible(spec, 6, 2, 3, "qkv")


# --- fused sections of unequal widths ---------------------------------------------------------------

def _sectioned_reference(sources: list[torch.Tensor], sections: tuple[int, ...], m: int, t: int) -> torch.Tensor:
    """Independent reference: each section's full tensor (that section of every source rank), sliced."""
    out = []
    for i, rows in enumerate(sections):
        first = sum(sections[:i])
        full = torch.cat([s[first:first + rows] for s in sources])
        step = full.shape[0] // m
        out.append(full[t * step:(t + 1) * step])
    return torch.cat(out)


@pytest.mark.parametrize("units", [(1, 1, 1), (2, 2, 1, 1, 4), (3, 1, 2)], ids=str)
def test_sections_are_each_split_on_their_own(units):
    """A Mamba-like ``[z; x; B; C; dt]``: every N -> M of whole units, against slicing each section."""
    gen = torch.Generator().manual_seed(2)
    atoms = (2,) * len(units)
    refused = 0
    for n, m in itertools.product((1, 2, 3, 4, 6), (1, 2, 3, 4, 6)):
        total = [u * 6 for u in units]  # whole-model units of each section
        if any(u % n for u in total):
            continue
        sections = tuple(u // n * 2 for u in total)  # rows of each section on one source rank
        spec = sectioned(0, sections, atoms)
        if any((u // n * n) % m for u in total):
            refused += 1
            with pytest.raises(LayoutError, match="fused section"):
                check_divisible(spec, sum(sections), n, m, "in_proj")
            continue
        check_divisible(spec, sum(sections), n, m, "in_proj")
        sources = [torch.randn(sum(sections), 3, generator=gen) for _ in range(n)]
        for t in range(m):
            want = _sectioned_reference(sources, sections, m, t)
            assert torch.equal(assemble(spec, dict(enumerate(sources)), n, m, t), want), (n, m, t)
            segs = part_segments(spec, sum(sections), n, m, t)
            got = torch.cat([sources[s][start:start + rows] for s, start, rows in segs])
            assert torch.equal(got, want), (n, m, t)
    assert refused


def test_sections_catch_a_plain_row_split_and_equal_parts():
    """The wrong answers a sectioned tensor invites at 2 -> 1: the rank tensors concatenated as one
    plain split, or cut as equal parts (as a gated fc1 is)."""
    sections = (2, 1)  # rank r: [x_r (2 rows); dt_r (1 row)]
    w = [torch.tensor([[0.0], [1.0], [2.0]]) + 10 * r for r in range(2)]
    right = assemble(sectioned(0, sections), dict(enumerate(w)), 2, 1, 0)
    assert right.flatten().tolist() == [0, 1, 10, 11, 2, 12]  # [x_0; x_1; dt_0; dt_1]
    assert not torch.equal(right, torch.cat(w))
    with pytest.raises(LayoutError, match="not divisible into 2 fused parts"):
        check_divisible(PartitionSpec(dim=0, parts=2), 3, 2, 1, "in_proj")


def test_sections_refuse_a_cut_unit_and_a_wrong_sum():
    check_divisible(sectioned(0, (4, 2), (2, 1)), 6, 1, 2, "conv1d")  # 2 and 2 units over 2 ranks
    with pytest.raises(LayoutError, match="fused section 1: 1 units of 2 rows cannot be divided evenly over 2"):
        check_divisible(sectioned(0, (4, 2), (2, 2)), 6, 1, 2, "conv1d")  # one unit of B over 2 ranks
    with pytest.raises(LayoutError, match="not a whole number of units of 4"):
        check_divisible(sectioned(0, (4, 2), (2, 4)), 6, 1, 1, "conv1d")
    with pytest.raises(LayoutError, match="add up to 5"):
        check_divisible(sectioned(0, (4, 1)), 6, 1, 1, "conv1d")
