"""The entry point of planning: locate the source and hand the
checkpoint to the planner of its file layout — the (stage, TP rank) grid of module dicts
(:mod:`reshard.execution.plan`) or DeepSpeed's pipeline layer files (:mod:`reshard.execution.ds_pipe`).
Both planners share the rule table, the model-fact deciders and the engine; keeping the choice
here keeps them free of each other (no import cycle)."""

from __future__ import annotations

from dataclasses import replace

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions, flag_of
from reshard.core.plan_types import Plan
from reshard.core.source import DEEPSPEED_PIPE, SourceCheckpoint
from reshard.execution.ds_pipe import build_pipe_plan
from reshard.execution.engine import target_state
from reshard.execution.plan import build_grid_plan
from reshard.formats import locate
from reshard.formats.output import output_format


def build_plan(src: str | SourceCheckpoint, options: ReshardOptions, *, headers_only: bool = False) -> Plan:
    """Validate the source fully against ``options`` and decide every tensor's fate (reads shard metadata, and
    replicated tensors to check they agree) before any byte is written.

    ``headers_only`` (grid layouts): plan from the first rank file of each pipeline stage, so
    conversions can start before every shard is fetched; see
    :func:`reshard.execution.plan.build_grid_plan`."""
    source = src if isinstance(src, SourceCheckpoint) else locate(src)
    out = output_format(source, options)
    if options.target_tp is None:
        if out.per_rank:
            raise LayoutError(f"needs a target tensor-parallel degree to write the {out.title or out.name} layout",
                              culprit="--target-tp", hint="pass --target-tp M")
        options = options.model_copy(update={"target_tp": 1})  # global tensors: the TP 1 layout
    elif not out.per_rank and options.target_tp != 1:
        raise LayoutError(f"the {out.title or out.name} layout holds global tensors, loadable at any TP; it has no "
                          f"tensor-parallel degree", culprit="--target-tp", hint="drop --target-tp")
    if source.format == DEEPSPEED_PIPE:  # layer files: their own planner, same rules and engine
        if out.name != DEEPSPEED_PIPE:  # that planner writes layer files only
            raise LayoutError(f"DeepSpeed pipeline layer files are written back only as layer files, not in the "
                              f"{out.title or out.name} layout", culprit="--to",
                              hint="drop --to, or convert Megatron-LM per-rank files instead")
        for field in ("target_vpp", "target_first_stage_layers", "target_last_stage_layers", "target_pipeline_layout"):
            if getattr(options, field) is not None and (field != "target_vpp" or options.target_vpp != 1):
                raise LayoutError("DeepSpeed pipeline layer files have no virtual or uneven stages (each layer is a "
                                  "file of its own)", culprit=flag_of(field), hint=f"drop {flag_of(field)}")
        plan = build_pipe_plan(source, options, source.pp if options.target_pp is None else options.target_pp)
    else:
        plan = build_grid_plan(source, options, options.target_pp, headers_only=headers_only)
    plan = replace(plan, state_reader=target_state)
    out.check_plan(plan)  # the output format's own refusals, with what it would write at hand
    if not headers_only:  # values at hand: what writing them tells the user
        plan = replace(plan, warnings=(*plan.warnings, *out.plan_warnings(plan)))
    return plan

