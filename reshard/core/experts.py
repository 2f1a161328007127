"""Expert parallelism (MoE): how per-rank files number their experts and how a target layout
deals them out. Pure functions over names and plan records; the rule table says how each expert
tensor is split over TP (like a dense MLP's), this module only says *which rank* holds an expert.

Megatron-LM's per-rank layout puts each expert-parallel rank in a folder of its own
(``mp_rank_TT[_PPP]_EEE``); every EP rank of a stage holds the same dense weights and its own
``E / EP`` experts, numbered locally:

=====================  ==============================  ==============================
EP rank ``e``           file key (local number ``i``)    canonical key (global number)
=====================  ==============================  ==============================
``0 .. EP-1``           ``...local_experts.{i}.<rest>``  ``...local_experts.{e*E/EP+i}.<rest>``
``0 .. EP-1``           ``...linear_fc1.weight{i}``      ``...linear_fc1.weight{e*E/EP+i}``
=====================  ==============================  ==============================

The planner sees one parameter per global expert; a target EP rank ``e'`` of ``EP'`` holds the
global experts ``e' * E/EP' .. (e'+1) * E/EP' - 1``, renumbered from 0.

Expert tensor parallelism (ETP, ``--expert-tensor-parallel-size``) splits the routed experts'
weights over fewer ranks than the dense TP. Megatron-LM's processes then form two grids over one
stage: process ``s`` is dense TP rank ``s % TP`` and expert TP rank ``s % ETP`` of EP rank
``(s // ETP) % EP``, and it saves its file under its (TP rank, EP rank) alone. So not every pair
has a file (:func:`rank_files`), a file's experts are the expert TP slice ``TP rank % ETP``, and
ETP must divide TP: else processes sharing a file name would hold different slices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError
from reshard.core.plan_types import SourceStage, TargetParam
from reshard.core.rules import expert_index, layer_index, with_expert


def local_experts(keys: Sequence[str], where: str) -> int:
    """Experts per MoE layer in one rank file (0: no MoE layer), numbered locally 0..L-1."""
    counts = experts_per_layer(keys, where, hint="each rank file must number its experts locally, from 0")
    return next(iter(counts.values()), 0)


def expert_rows(stages: list[SourceStage]) -> list[SourceStage]:
    """The grid's rows with their experts under global numbers: the EP ranks of a stage must hold
    the same keys (same dense weights, same count of local experts); the rows after a stage's first
    keep only their experts (the dense weights are taken from EP rank 0)."""
    first: dict[int, SourceStage] = {}
    out = []
    for st in stages:
        keys = list(st.modules[0])
        head = first.setdefault(st.stage, st)
        if set(keys) != set(head.modules[0]):
            diff = sorted(set(keys) ^ set(head.modules[0]))
            raise InconsistentShardsError(
                f"expert-parallel rank {st.expert_rank} holds other parameters than rank {head.expert_rank} "
                f"({len(diff)} differ, e.g. {diff[0]})", culprit=st.names[0],
                hint="all expert-parallel rank folders must come from one checkpoint (same experts per rank)")
        per_rank = local_experts(keys, st.names[0])
        base = st.expert_rank * per_rank
        canonical = dict(st.canonical)
        for key in keys:
            i = expert_index(key)
            if i is not None:
                canonical[key] = with_expert(st.canonical_name(key), base + i)
        modules = st.modules if st is head else [
            {k: v for k, v in mod.items() if expert_index(k) is not None} for mod in st.modules]
        out.append(replace(st, canonical=canonical, modules=modules))
    return out


def experts_per_layer(keys: Iterable[str], where: str, saved: int | None = None,
                      hint: str = "supply every expert (every expert-parallel rank folder)") -> dict[int | None, int]:
    """Experts per MoE layer (layer -> count) among parameter names ``keys``: numbered 0..E-1, as
    many in every MoE layer, and as many as the saved ``args.num_experts`` (``saved``) says — a
    target EP rank's share is a run of numbers, so a gap would silently lose an expert."""
    found: dict[int | None, set[int]] = {}
    for key in keys:
        g = expert_index(key)
        if g is not None:
            found.setdefault(layer_index(key), set()).add(g)
    for layer, gs in found.items():
        if sorted(gs) != list(range(len(gs))):
            missing = sorted(set(range(max(gs) + 1)) - gs)
            raise CheckpointFormatError(f"layer {layer} holds experts numbered {sorted(gs)[:8]}..., missing "
                                        f"{missing[:8]}", culprit=where, hint=hint)
    counts = {layer: len(gs) for layer, gs in found.items()}
    if len(set(counts.values())) > 1 or (counts and saved is not None and saved not in counts.values()):
        what = ", ".join(f"layer {layer}: {n}" for layer, n in sorted(counts.items(), key=lambda kv: kv[0] or 0))
        raise CheckpointFormatError(f"MoE layers hold different numbers of experts ({what})" if saved is None else
                                    f"args.num_experts is {saved} but the MoE layers hold {what}", culprit=where,
                                    hint=hint)
    return counts


def check_expert_ranks(counts: dict[int | None, int], ep: int, where: str) -> None:
    """Every MoE layer's experts must divide evenly over the target's ``ep`` ranks."""
    for layer, experts in counts.items():
        if experts % ep:
            valid = [d for d in range(1, experts + 1) if experts % d == 0]
            raise LayoutError(f"{experts} experts (layer {layer}) cannot be divided over {ep} expert-parallel "
                              f"ranks", culprit=where,
                              hint=f"choose --target-ep among {', '.join(map(str, valid))}")


def rank_experts(entries: Sequence[TargetParam], rank: int, ep: int, counts: dict[int | None, int]
                 ) -> list[TargetParam]:
    """What target expert-parallel rank ``rank`` of ``ep`` holds of a stage's ``entries``: every
    entry of no single expert, and its own experts renumbered from 0 under their output names."""
    out = []
    for tp in entries:
        g = expert_index(tp.param.key)
        if g is None:
            out.append(tp)
            continue
        per_rank = counts[tp.param.layer] // ep
        if g // per_rank == rank:
            out.append(replace(tp, out_key=with_expert(tp.out_key, g % per_rank)))
    return out


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
