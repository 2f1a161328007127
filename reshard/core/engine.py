"""Execute a validated plan: build one target file's state dict and save it.

A target is one (pipeline stage, tensor-parallel rank) of the output (``plan.targets``). Each
reads only the source shards it needs (memory-mapped), so targets are independent units of
work — the Prefect layer runs one task per target on top of :func:`convert_target`.

Module entries are written under their target names (layers renumbered per stage); replicated
tensors and carried entries (``_extra_state``) come from the target's base source rank, as do
the top-level entries (``args`` retargeted: TP, PP, padded vocabulary).
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import CorruptCheckpointError
from reshard.core import foreign
from reshard.core.layouts import Piece, assemble, source_ranks_for_target
from reshard.core.plan import ParamPlan, Plan, quant_groups_for
from reshard.core.quantize import QUANT_KEY, combine_piece_scales, quantize_groups, scale_table
from reshard.core.rules import QUANT_SLOT_ORDER
from reshard.core.safe_load import load_shard

#: ``args`` attributes that name the tensor-parallel degree; updated in the output.
TP_ARG_NAMES: tuple[str, ...] = ("tensor_model_parallel_size", "model_parallel_size")
#: ``args`` attributes for uneven pipeline stages; cleared when the PP degree changes.
UNEVEN_PP_ARG_NAMES: tuple[str, ...] = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")


@dataclass(frozen=True)
class TargetResult:
    """Small record of one written target rank (safe to pass between Prefect tasks)."""

    rank: int
    path: str
    size: int
    sources: tuple[int, ...]
    seconds: float


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA when present (or as requested), else CPU — chosen at run time, never at import."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_target(plan: Plan, tgt: int, device: torch.device | None = None) -> dict[str, Any]:
    """Target ``tgt``'s full state dict (``plan.targets[tgt]``; module tensors own their storage)."""
    device = device or torch.device("cpu")
    tp = plan.targets[tgt]
    shards = {i: load_shard(plan.source.files[i]) for i in tp.sources}
    modules = {i: sd[plan.module_key] for i, sd in shards.items()}
    src = plan.source
    n, m, opts = plan.source_tp, plan.target_tp, plan.options
    first = shards[tp.sources[0]]
    for i in tp.sources:  # top-level entries from the base rank of the first stage read
        if i % n == tp.base_rank:
            first = shards[i]
            break

    module: "OrderedDict[str, Any]" = OrderedDict()
    slot_scales: dict[tuple[int, str], torch.Tensor] = {}
    culprit = str(src.files[tp.sources[0]])
    try:
        for entry in tp.params:
            p = entry.param
            if p.spec is None:
                value = modules[src.index(p.stage, tp.base_rank)][p.src_key]
                module[entry.out_key] = _owned(value) if isinstance(value, torch.Tensor) else value
                continue
            srcs = {r: modules[src.index(p.stage, r)][p.src_key] for r in range(n)
                    if src.index(p.stage, r) in modules}
            culprit = str(src.files[src.index(p.stage, min(srcs))])
            if opts.quantize and p.quant_slot is not None:
                module[entry.out_key], scales = _assemble_quantized(p, srcs, n, m, tp.tp_rank, plan, device)
                slot_scales[(p.layer, p.quant_slot.value)] = scales
            else:
                module[entry.out_key] = assemble(p.spec, srcs, n, m, tp.tp_rank)
    except RuntimeError as exc:  # a tensor's bytes could not be read (truncated member)
        raise CorruptCheckpointError(f"cannot read tensor data: {str(exc).splitlines()[0][:200]}",
                                     culprit=culprit,
                                     hint="the shard is truncated or corrupt; re-copy it") from None

    out: dict[str, Any] = {}
    for k, v in first.items():
        if k == plan.module_key:
            out[k] = module
        elif k in plan.dropped:
            continue
        else:
            out[k] = v
    if "mp_world_size" in out:
        out["mp_world_size"] = m
    if "args" in out and out["args"] is not None:
        out["args"] = retarget_args(out["args"], plan)
    if opts.quantize:
        out[QUANT_KEY] = _quant_record(slot_scales, plan, len(source_ranks_for_target(n, m, tp.tp_rank)))
    return out


def _assemble_quantized(p: ParamPlan, srcs: dict[int, torch.Tensor], n: int, m: int, tgt: int,
                        plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    groups = quant_groups_for(p, plan.options)
    piece_scales: list[torch.Tensor] = []

    def quantize_piece(_pc: Piece, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_groups(x.to(device), plan.options.bits, groups, p.key)
        piece_scales.append(s.cpu())
        return q.cpu()

    q = assemble(p.spec, srcs, n, m, tgt, piece_fn=quantize_piece)
    return q, combine_piece_scales(piece_scales, p.spec.dim)


def _quant_record(slot_scales: dict[tuple[int, str], torch.Tensor], plan: Plan, merge_count: int
                  ) -> dict[str, Any]:
    layers = sorted({layer for layer, _ in slot_scales})
    rows = [[slot_scales[(layer, slot.value)] for slot in QUANT_SLOT_ORDER] for layer in layers]
    o = plan.options
    return {
        "scales": scale_table(rows),
        "bits": o.bits,
        "groups": o.groups,
        "mlp_extra_grouping": o.mlp_extra_grouping,
        "merge_count": merge_count,
        "layout": "reshard.quantize.v1: [layers, 4 (qkv, dense, h_to_4h, 4h_to_h), width], stored 1/s",
    }


def retarget_args(args: Any, plan: Plan) -> Any:
    """A copy of the saved Megatron ``args`` describing the output: TP and PP degrees, the padded
    vocabulary; uneven first/last pipeline stage sizes are cleared when PP changes (reshard
    splits layers evenly)."""
    new = copy.copy(args)
    for name in TP_ARG_NAMES:
        if hasattr(new, name):
            setattr(new, name, plan.target_tp)
    if hasattr(new, "pipeline_model_parallel_size"):
        setattr(new, "pipeline_model_parallel_size", plan.target_pp)
    facts = plan.facts
    if facts is not None and hasattr(new, "padded_vocab_size") and facts.padded_vocab_target is not None:
        setattr(new, "padded_vocab_size", facts.padded_vocab_target)
    if plan.target_pp != plan.source_pp:
        for name in UNEVEN_PP_ARG_NAMES:
            if getattr(new, name, None) is not None:
                setattr(new, name, None)
    return new


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: saving a view would write its whole base storage."""
    return t.clone(memory_format=torch.contiguous_format)


def convert_target(plan: Plan, tgt: int, out_path: str | os.PathLike[str],
                   device: torch.device | None = None) -> TargetResult:
    """Build target ``tgt`` (an index into ``plan.targets``) and write it to ``out_path`` with
    ``torch.save`` (foreign stand-ins in carried entries are written back under their real names)."""
    t0 = time.perf_counter()
    sd = build_target(plan, tgt, device)
    out_path = Path(out_path)
    foreign.save(sd, out_path)
    return TargetResult(tgt, str(out_path), out_path.stat().st_size, plan.targets[tgt].sources,
                        time.perf_counter() - t0)
