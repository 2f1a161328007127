"""Execute a validated plan: build one target rank's state dict and save it.

Each target rank reads only the source shards it needs (memory-mapped), so target ranks are
independent units of work — the Prefect layer runs one task per target rank on top of
:func:`convert_target`.
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
from reshard.core.layouts import Piece, assemble
from reshard.core.plan import ParamPlan, Plan, quant_groups_for
from reshard.core.quantize import QUANT_KEY, combine_piece_scales, quantize_groups, scale_table
from reshard.core.rules import QUANT_SLOT_ORDER
from reshard.core.safe_load import load_shard

#: ``args`` attributes that name the tensor-parallel degree; updated in the output.
TP_ARG_NAMES: tuple[str, ...] = ("tensor_model_parallel_size", "model_parallel_size")


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
    """Target rank ``tgt``'s full state dict (module tensors own their storage)."""
    device = device or torch.device("cpu")
    tp = plan.targets[tgt]
    shards = {s: load_shard(plan.source.files[s]) for s in tp.sources}
    first = shards[tp.sources[0]]
    modules = {s: sd[plan.module_key] for s, sd in shards.items()}
    n, m, opts = plan.source_tp, plan.target_tp, plan.options

    module: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    slot_scales: dict[tuple[int, str], torch.Tensor] = {}
    try:
        for p in plan.params:
            if p.spec is None:
                module[p.key] = _owned(modules[tp.sources[0]][p.key])
                continue
            srcs = {s: modules[s][p.key] for s in tp.sources}
            if opts.quantize and p.quant_slot is not None:
                module[p.key], scales = _assemble_quantized(p, srcs, n, m, tgt, plan, device)
                slot_scales[(p.layer, p.quant_slot.value)] = scales
            else:
                module[p.key] = assemble(p.spec, srcs, n, m, tgt)
    except RuntimeError as exc:  # a tensor's bytes could not be read (truncated member)
        raise CorruptCheckpointError(f"cannot read tensor data: {str(exc).splitlines()[0][:200]}",
                                     culprit=str(plan.source.files[tp.sources[0]]),
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
        out["args"] = _retarget_args(out["args"], m)
    if opts.quantize:
        out[QUANT_KEY] = _quant_record(slot_scales, plan, len(tp.sources))
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


def _retarget_args(args: Any, m: int) -> Any:
    new = copy.copy(args)
    for name in TP_ARG_NAMES:
        if hasattr(new, name):
            setattr(new, name, m)
    return new


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: saving a view would write its whole base storage."""
    return t.clone(memory_format=torch.contiguous_format)


def convert_target(plan: Plan, tgt: int, out_path: str | os.PathLike[str],
                   device: torch.device | None = None) -> TargetResult:
    """Build target rank ``tgt`` and write it to ``out_path`` with ``torch.save``."""
    t0 = time.perf_counter()
    sd = build_target(plan, tgt, device)
    out_path = Path(out_path)
    torch.save(sd, out_path)
    return TargetResult(tgt, str(out_path), out_path.stat().st_size, plan.targets[tgt].sources,
                        time.perf_counter() - t0)
