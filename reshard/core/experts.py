"""Expert parallelism (MoE): the layout arithmetic of Megatron-LM's expert-parallel ranks, free
of parameter names (how a family numbers its experts in names, and which rank holds which expert,
is the family's: :mod:`reshard.models.megatron_gpt`).

Megatron-LM's per-rank layout puts each expert-parallel rank in a folder of its own
(``mp_rank_TT[_PPP]_EEE``); every EP rank of a stage holds the same dense weights and its own
``E / EP`` experts; a target EP rank ``e'`` of ``EP'`` holds the global experts
``e' * E/EP' .. (e'+1) * E/EP' - 1``, renumbered from 0.

Expert tensor parallelism (ETP, ``--expert-tensor-parallel-size``) splits the routed experts'
weights over fewer ranks than the dense TP. Megatron-LM's processes then form two grids over one
stage: process ``s`` is dense TP rank ``s % TP`` and expert TP rank ``s % ETP`` of EP rank
``(s // ETP) % EP``, and it saves its file under its (TP rank, EP rank) alone. So not every pair
has a file (:func:`rank_files`), a file's experts are the expert TP slice ``TP rank % ETP``, and
ETP must divide TP: else processes sharing a file name would hold different slices.
"""

from __future__ import annotations

import math

from reshard.core.errors import LayoutError


def check_expert_ranks(counts: dict[int | None, int], ep: int, where: str) -> None:
    """Every MoE layer's experts must divide evenly over the target's ``ep`` ranks."""
    for layer, experts in counts.items():
        if experts % ep:
            valid = [d for d in range(1, experts + 1) if experts % d == 0]
            raise LayoutError(f"{experts} experts (layer {layer}) cannot be divided over {ep} expert-parallel "
                              f"ranks", culprit=where,
                              hint=f"choose --target-ep among {', '.join(map(str, valid))}")


def rank_files(tp: int, etp: int, ep: int) -> list[tuple[int, int]]:
    """The (TP rank, EP rank) pairs of the files Megatron-LM's per-rank layout has for one stage,
    in (EP rank, TP rank) order: the pairs its processes hold (see the module doc). Every pair when
    the expert TP equals the TP; e.g. TP 2, ETP 1, EP 2: ``(0, 0), (1, 1)``."""
    pairs = {(s % tp, (s // etp) % ep) for s in range(math.lcm(tp, etp * ep))}
    return sorted(pairs, key=lambda pair: (pair[1], pair[0]))


def check_expert_tp(etp: int, tp: int, where: str, hint: str) -> None:
    """An expert TP the per-rank layout can hold: one dividing the TP (see the module doc)."""
    if tp % etp:
        raise LayoutError(f"expert tensor parallelism {etp} does not divide the tensor parallelism {tp}: Megatron-LM's "
                          f"per-rank files would give processes sharing a file different slices of the experts",
                          culprit=where, hint=hint)
