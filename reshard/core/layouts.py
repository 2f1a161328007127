"""Pure tensor math for moving a partitioned parameter from N ranks to M ranks.

Every tensor-parallel parameter is described by a :class:`PartitionSpec`: the dimension it is
split on, how many fused sub-tensors (``parts``) it packs along that dimension, and the size
of the indivisible unit (``atom``, e.g. one attention head's rows) inside each part.

The *logical* full tensor of a parameter is, for each part, the concatenation of that part
over the source ranks. Target rank ``t`` owns the ``t``-th of ``M`` equal slices of every part.

Shape table (rank tensor along ``dim``; ``L`` = rows per part per source rank):

====================  ======  =====================  ===============================
parameter             parts   per-rank layout        atom
====================  ======  =====================  ===============================
plain column/row      1       ``[L]``                1 (or ``hn`` for head dims)
QKV version 0         3       ``[Q(L); K(L); V(L)]`` ``hn``
QKV version 1.0       1       ``[np, hn, 3]``        ``3*hn``
QKV version 2.0/3.0   1       ``[np, 3, hn]``        ``3*hn``
====================  ======  =====================  ===============================

Target rank ``t`` of part ``p`` = ``full_p[t*N*L/M : (t+1)*N*L/M]``; the ranges are cut into
*pieces*, one per source rank they touch, so a target only reads the source ranks it needs.
Any ``N -> M`` works this way (8 -> 6, 4 -> 3, ...), as long as every part divides into ``M``
whole atoms.

More rows of the table (``G`` query groups, ``q = heads/G``, ``F`` = FFN width per rank):

=======================  ======  ===============================  ====================
parameter                parts   per-rank layout                  atom
=======================  ======  ===============================  ====================
grouped QKV (core, GQA)  1       ``[G_r, (q + 2), hn]``           ``(q + 2)*hn``
attention proj (GQA)     1       ``[h, G_r*q*hn]`` (dim 1)        ``q*hn``
gated fc1 (SwiGLU)       2       ``[W(F); V(F)]`` gate; up        1
vocab rows (padded)      1       ``[V_pad/N]``                    1, resized (below)
=======================  ======  ===============================  ====================

*Sections*: a fused tensor whose parts differ in width (a state-space mixer's input projection
``[z; x; B; C; dt]``, each split over TP on its own) gives ``sections``, the rows of each part on
one source rank, and ``atoms``, each part's indivisible unit; every other rule of the table holds
per part (target rank ``t`` owns the ``t``-th of ``M`` slices of each part, parts in order):

=========================  ======  ==================================  ========================
parameter                  parts   per-rank layout                     atoms
=========================  ======  ==================================  ========================
sectioned (unequal parts)  k       ``[S_1(L_1); ...; S_k(L_k)]``       one per section
=========================  ======  ==================================  ========================

*Resizing* (vocabulary padding): a spec may give ``total`` — the target's logical rows per part
— and ``keep`` — how many leading logical rows are real (the true vocabulary). Target rows
``< keep`` come from the source; the rest are zero-filled (pieces with ``src == FILL``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from reshard.core.errors import LayoutError

#: ``Piece.src`` of rows that no source holds (vocabulary re-padding): zero-filled.
FILL = -1


@dataclass(frozen=True)
class PartitionSpec:
    """How one parameter is split across tensor-parallel ranks (``keep``/``total``, ``sections`` and
    ``atoms``: see the module doc; with ``sections``, ``parts`` is their count)."""

    dim: int
    parts: int = 1
    atom: int = 1
    keep: int | None = None
    total: int | None = None
    sections: tuple[int, ...] | None = None
    atoms: tuple[int, ...] | None = None

    def part_lengths(self, rank_len: int) -> tuple[int, ...]:
        """Rows of each fused part on one source rank holding ``rank_len`` rows along ``dim``."""
        if self.sections is not None:
            return self.sections
        return (rank_len // self.parts,) * self.parts

    def part_atoms(self) -> tuple[int, ...]:
        """Each fused part's indivisible unit."""
        return self.atoms if self.atoms is not None else (self.atom,) * self.parts


def sectioned(dim: int, sections: tuple[int, ...], atoms: tuple[int, ...] | None = None) -> PartitionSpec:
    """The spec of a fused tensor of unequal parts: ``sections`` rows of each on one source rank,
    each part split over the target ranks on its own (``atoms``: each part's unit, default 1)."""
    if not sections or (atoms is not None and len(atoms) != len(sections)):
        raise ValueError(f"sections {sections} need one atom each, got {atoms}")
    return PartitionSpec(dim=dim, parts=len(sections), sections=tuple(sections),
                         atoms=tuple(atoms) if atoms is not None else (1,) * len(sections))


def part_segments(spec: PartitionSpec, rank_len: int, n_src: int, n_tgt: int, tgt: int) -> list[tuple[int, int, int]]:
    """``(source rank or FILL, first row in the source, rows)`` along ``spec.dim`` for target ``tgt``,
    in output order (parts outer, pieces inner — as :func:`assemble` concatenates them)."""
    segs = []
    first = 0
    for part_len in spec.part_lengths(rank_len):
        for pc in pieces_for_target(part_len, n_src, n_tgt, tgt, spec.keep, spec.total):
            segs.append((pc.src, first + pc.start, pc.length))
        first += part_len
    return segs


@dataclass(frozen=True)
class Piece:
    """What source rank ``src`` contributes to one target rank: rows ``[start, stop)`` of
    each of its parts along the partition dim (``src == FILL``: ``stop - start`` zero rows)."""

    src: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def source_ranks_for_target(n_src: int, n_tgt: int, tgt: int) -> list[int]:
    """Source ranks whose slice overlaps target rank ``tgt``'s slice (in rank units)."""
    lo, hi = tgt * n_src, (tgt + 1) * n_src  # target range scaled by n_tgt
    return [s for s in range(n_src) if s * n_tgt < hi and (s + 1) * n_tgt > lo]


def pieces_for_target(part_len: int, n_src: int, n_tgt: int, tgt: int, keep: int | None = None,
                      total: int | None = None) -> list[Piece]:
    """Cut target ``tgt``'s slice of one part into per-source-rank pieces (plus a zero fill).

    ``part_len`` is the part's length on one source rank; the full source part is
    ``n_src*part_len`` long. The target part is ``total`` long (default: the same), of which the
    first ``keep`` rows are copied (default: all that exist) and the rest zero-filled. ``total``
    must divide by ``n_tgt`` (checked by :func:`check_divisible`).
    """
    src_total = n_src * part_len
    total = src_total if total is None else total
    keep = min(src_total, total) if keep is None else keep
    t_len = total // n_tgt
    lo, hi = tgt * t_len, (tgt + 1) * t_len
    pieces = []
    copy_hi = min(hi, keep)
    if lo < copy_hi:
        for s in range(lo // part_len, (copy_hi - 1) // part_len + 1):
            s_lo = max(lo, s * part_len) - s * part_len
            s_hi = min(copy_hi, (s + 1) * part_len) - s * part_len
            pieces.append(Piece(s, s_lo, s_hi))
    fill_lo = max(lo, keep)
    if fill_lo < hi:
        pieces.append(Piece(FILL, 0, hi - fill_lo))
    return pieces


def check_divisible(spec: PartitionSpec, rank_len: int, n_src: int, n_tgt: int, key: str) -> None:
    """Refuse layouts that would cut an atom (a head) or leave unequal ranks."""
    if spec.sections is not None:
        _check_sections(spec, rank_len, n_src, n_tgt, key)
        return
    if rank_len % spec.parts:
        raise LayoutError(f"dim {spec.dim} has {rank_len} rows per rank, not divisible into "
                          f"{spec.parts} fused parts", culprit=key,
                          hint="check the checkpoint version (--version) and model flags")
    part_len = rank_len // spec.parts
    if part_len % spec.atom:
        raise LayoutError(f"{part_len} rows per part on a source rank is not a whole number of "
                          f"units of {spec.atom} rows", culprit=key,
                          hint="check --num-heads / the saved args against the checkpoint")
    if spec.keep is not None and not 0 < spec.keep <= min(n_src * part_len, spec.total or spec.keep):
        raise LayoutError(f"cannot keep {spec.keep} rows of {n_src * part_len} in {spec.total}", culprit=key,
                          hint="check --vocab-size against the checkpoint")
    units = (n_src * part_len if spec.total is None else spec.total) // spec.atom
    if units % n_tgt:
        what = "heads" if spec.atom > 1 else "rows"
        raise LayoutError(f"{units} {what} along dim {spec.dim} cannot be divided evenly over "
                          f"{n_tgt} target ranks", culprit=key,
                          hint=f"choose a target TP that divides {units}")


def _check_sections(spec: PartitionSpec, rank_len: int, n_src: int, n_tgt: int, key: str) -> None:
    """A sectioned spec: the sections fill the rank's rows, and each divides into whole atoms on
    every source and every target rank (no resizing: a sectioned tensor has no vocabulary rows)."""
    sections, atoms = spec.part_lengths(rank_len), spec.part_atoms()
    if sum(sections) != rank_len:
        raise LayoutError(f"dim {spec.dim} has {rank_len} rows per rank, but its fused sections "
                          f"{list(sections)} add up to {sum(sections)}", culprit=key,
                          hint="check the model's saved args against the checkpoint")
    if spec.keep is not None or spec.total is not None:
        raise LayoutError("a tensor of fused sections cannot be resized", culprit=key)
    for i, (rows, atom) in enumerate(zip(sections, atoms)):
        if rows % atom:
            raise LayoutError(f"fused section {i} has {rows} rows per source rank, not a whole number of "
                              f"units of {atom}", culprit=key,
                              hint="check the model's saved args against the checkpoint")
        if (n_src * rows // atom) % n_tgt:
            raise LayoutError(f"fused section {i}: {n_src * rows // atom} units of {atom} rows cannot be "
                              f"divided evenly over {n_tgt} target ranks", culprit=key,
                              hint=f"choose a target TP that divides {n_src * rows // atom}")


def assemble(spec: PartitionSpec, sources: Mapping[int, torch.Tensor], n_src: int, n_tgt: int,
             tgt: int, piece_fn: Callable[[Piece, torch.Tensor], torch.Tensor] | None = None
             ) -> torch.Tensor:
    """Build target rank ``tgt``'s tensor from the source ranks' tensors.

    ``piece_fn`` (optional) transforms each piece before placement — used by quantization,
    which works on one piece at a time. A piece is passed as the concatenation of its parts
    along ``spec.dim`` (source order) and must come back with the same shape.
    Returns a fresh tensor that owns its storage.
    """
    any_src = next(iter(sources.values()))
    lengths = spec.part_lengths(any_src.shape[spec.dim])
    starts = [sum(lengths[:p]) for p in range(spec.parts)]
    # the pieces of every part come from the same source ranks, their lengths in proportion
    cuts = [pieces_for_target(part_len, n_src, n_tgt, tgt, spec.keep, spec.total) for part_len in lengths]
    # per_piece[i][p] = rows of part p contributed by piece i
    per_piece: list[list[torch.Tensor]] = []
    for i, pc in enumerate(cuts[0]):
        if pc.src == FILL:
            shape = list(any_src.shape)
            shape[spec.dim] = pc.length
            per_piece.append([any_src.new_zeros(shape) for _ in range(spec.parts)])
            continue
        src = sources[pc.src]
        chunks = [src.narrow(spec.dim, starts[p] + cuts[p][i].start, cuts[p][i].length) for p in range(spec.parts)]
        if piece_fn is not None:
            whole = chunks[0] if spec.parts == 1 else torch.cat(chunks, dim=spec.dim)
            whole = piece_fn(pc, whole)
            chunks = list(torch.split(whole, [c.shape[spec.dim] for c in chunks], dim=spec.dim))
        per_piece.append(chunks)
    ordered = [per_piece[i][p] for p in range(spec.parts) for i in range(len(cuts[0]))]
    if len(ordered) == 1:
        return ordered[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(ordered, dim=spec.dim)
