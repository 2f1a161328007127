"""Plan a DeepSpeed pipeline-parallel checkpoint (``PipelineModule``, Megatron-DeepSpeed ``GPTModelPipe``).

On disk (DeepSpeed ``runtime/pipe/module.py`` ``save_state_dict`` / ``ckpt_layer_path``,
``runtime/engine.py`` ``_save_checkpoint`` / ``_get_ckpt_name``):

* ``layer_LL-model_TT-model_states.pt``: ``torch.save(layer.state_dict())`` of pipeline layer ``LL``
  (its index in the whole layer list, whichever stage ran it) on tensor-parallel rank ``TT``. Only
  layers with a ``state_dict`` get a file: functions in the layer list and the tied output head
  (a ``TiedLayerSpec`` with ``forward_fn``) have none, so indices may have gaps (Megatron-DeepSpeed:
  ``layer_01`` embedding, ``layer_02``.. transformer layers, then the final norm, and ``lm_head`` when
  the output is untied).
* ``mp_rank_KK_model_states.pt``, ``KK = stage * TP + TT``: the engine's top-level entries
  (``args``, ``iteration``, ``checkpoint_version``, ``mp_world_size``, ...) with ``module`` None.

Each layer file is one row of the source grid (see :mod:`reshard.core.source`); the format
(:mod:`reshard.formats.deepspeed_pipeline`) reads it and names its keys canonically, by the layer's
role, with the legacy Megatron names the rule table knows, so partitioning, checks and facts are
those of every other layout (:func:`reshard.execution.plan.decide_parameters`). Output: the same
layer files at the target TP (same layer indices: they do not depend on PP) and ``TP x PP`` rank
files; a PP change only changes the rank files, which DeepSpeed's loader
reads per stage. DeepSpeed's own reader (``checkpoint/deepspeed_checkpoint.py``) splits transformer
layers evenly over stages; reshard likewise refuses a target PP that does not divide them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.layouts import source_ranks_for_target
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import (
    DROPPED_ENTRIES,
    LAYER_FILE,
    PIPE_RANK_FILE,
    ParamPlan,
    Plan,
    TargetParam,
    TargetPlan,
    dropped_warning,
)
from reshard.core.source import DEEPSPEED_PIPE, SourceCheckpoint, layer_file_name, rank_file_name
from reshard.execution import adapter_merge
from reshard.execution.placement import target_ranks_needed, target_size
from reshard.execution.plan import decide_parameters
from reshard.formats.deepspeed_pipeline import EMBEDDING, LM_HEAD, PARALLEL_DIMS, PP_DEGREE, TP_DEGREE, TRANSFORMER
from reshard.formats.registry import get_format
from reshard.models.facts import bool_arg, decide_version


def build_pipe_plan(source: SourceCheckpoint, options: ReshardOptions, tpp: int) -> Plan:
    """Validate a DeepSpeed pipeline folder fully and plan its layer and rank files at (TP, PP)."""
    spp = source.pp
    if options.quantize:
        raise LayoutError("--quantize is not supported for DeepSpeed pipeline layer files", culprit="--quantize",
                          hint="quantize a non-pipeline (mp_rank_XX_model_states) checkpoint")
    fmt = get_format(source.format)
    read = adapter_merge.read(fmt, source, options)  # rank rows (empty), then one row per layer file, keys canonical
    version = decide_version(read.shards, read.names, source, options)
    d = decide_parameters(read, options, version, source, fmt)
    num_layers = sum(d.layers_per_stage)
    if tpp != spp and (num_layers == 0 or num_layers % tpp):
        raise LayoutError(f"{num_layers} layers cannot be split evenly over {tpp} pipeline stages",
                          culprit=source.origin, hint=f"choose a target PP that divides {num_layers}")
    roles = [st.role or "" for st in read.module_rows]
    tied = _decide_tied(read.args, roles, d.origin, source)
    targets = _rank_targets(source, options, tpp) + _layer_targets(source, options, d.params + d.carried, roles,
                                                                   d.layers_per_stage, tpp)
    targets = [dataclasses.replace(t, rank=i) for i, t in enumerate(targets)]
    dropped = {k: DROPPED_ENTRIES[k] for k in read.shards[0] if k in DROPPED_ENTRIES}
    warnings = dropped_warning(dropped) + ([d.vocab.warning] if d.vocab.warning else [])
    ds_config = read.shards[0].get("ds_config")
    facts = d.model_facts(tied, _even_split(num_layers, spp), _even_split(num_layers, tpp))
    return Plan(source=source, options=options, module_key=read.module_key, version=version,
                params=tuple(d.params), targets=tuple(targets), unused_rules=d.resolution.unused_rules,
                dropped=dropped, facts=facts,
                ds_config=copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings=tuple(warnings), carried=tuple(d.carried), target_pp=tpp, output_format=DEEPSPEED_PIPE)


def _decide_tied(args: Any, roles: list[str], origin: dict[str, str], source: SourceCheckpoint) -> bool:
    """Tied embeddings keep no head file (the tied ``EmbeddingPipe`` runs through ``forward_fn``);
    an untied head is ``LMHeadPipe`` (``lm_head.weight``)."""
    untie = bool_arg(args, "untie_embeddings_and_output_weights")
    has_head = LM_HEAD in roles
    if untie is not None and untie != has_head:
        raise CheckpointFormatError(f"args.untie_embeddings_and_output_weights={untie} but the layer files "
                                    f"{'hold' if has_head else 'hold no'} lm_head", culprit=source.origin,
                                    hint="the args do not belong to these layer files")
    origin["tied_embeddings"] = "args" if untie is not None else "structure (lm_head layer file or not)"
    return not has_head


def _even_split(layers: int, pp: int) -> tuple[int, ...]:
    """Transformer layers per stage as DeepSpeed's reader assumes them (even); the total if uneven."""
    return (layers // pp,) * pp if layers % pp == 0 else (layers,)


# --- writing -----------------------------------------------------------------------------------------


def _layer_targets(source: SourceCheckpoint, options: ReshardOptions, entries: list[ParamPlan], roles: list[str],
                   per_group: list[int], tpp: int) -> list[TargetPlan]:
    """One target per (layer file, target TP rank): the same layer index, the layer's own keys."""
    n, m, spp = source.tp, options.target_tp, source.pp
    num_layers, seen, out = sum(per_group), 0, []
    for g, layer in enumerate(source.layer_ids):
        mine = [p for p in entries if p.stage == spp + g]
        stage = 0 if roles[g] == EMBEDDING else tpp - 1 if roles[g] != TRANSFORMER else seen * tpp // num_layers
        seen += per_group[g]
        for t in range(m):
            base = source_ranks_for_target(n, m, t)[0]
            files = {source.index(spp + g, base)}
            for p in mine:
                files.update(source.index(p.stage, r) for r in target_ranks_needed(p, n, m, t))
            srcs = tuple(sorted(files))
            out.append(TargetPlan(rank=0, name=layer_file_name(layer, t), sources=srcs,
                                  bytes_read=sum(source.files[i].stat().st_size for i in srcs),
                                  bytes_written=sum(target_size(p, n, m, False) for p in mine), tp_rank=t,
                                  pp_rank=stage, base_rank=base,
                                  params=tuple(TargetParam(out_key=p.src_key, param=p) for p in mine),
                                  kind=LAYER_FILE))
    return out


def _rank_targets(source: SourceCheckpoint, options: ReshardOptions, tpp: int) -> list[TargetPlan]:
    """One ``mp_rank`` file per (target stage, TP rank), from the same source stage (the last one
    for stages the source lacks) and the base source TP rank."""
    n, m, spp = source.tp, options.target_tp, source.pp
    out = []
    for s in range(tpp):
        for t in range(m):
            base = source_ranks_for_target(n, m, t)[0]
            i = source.index(min(s, spp - 1), base)
            size = source.files[i].stat().st_size
            out.append(TargetPlan(rank=0, name=rank_file_name(s * m + t), sources=(i,), bytes_read=size,
                                  bytes_written=size, tp_rank=t, pp_rank=s, base_rank=base, kind=PIPE_RANK_FILE))
    return out


def retarget_rank_file(out: dict[str, Any], plan: Plan, saved_mp_world_size: Any) -> None:
    """A rank file's model-parallel bookkeeping at the target degrees: ``mp_world_size`` (DeepSpeed's
    pipeline engine saves the model-parallel group of its grid, TP x PP, or TP with Megatron's mpu)
    and ``checkpoint_parallel_dimensions``."""
    n, spp, m, tpp = plan.source_tp, plan.source_pp, plan.target_tp, plan.target_pp
    if saved_mp_world_size is not None:
        out["mp_world_size"] = m * tpp if saved_mp_world_size == n * spp else m
    dims = out.get(PARALLEL_DIMS)
    if isinstance(dims, dict):
        out[PARALLEL_DIMS] = dict(dims, **{PP_DEGREE: tpp, TP_DEGREE: m})
