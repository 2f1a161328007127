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

Each layer file is planned as one row of the source grid (see :mod:`reshard.core.source`), its keys
read under the legacy Megatron names the rule table knows (``language_model.embedding.*``,
``language_model.encoder.layers.N.*``, ``language_model.encoder.final_layernorm.*``,
``language_model.output_layer.weight``), so partitioning, checks and facts are those of every other
layout. Output: the same layer files at the target TP (same layer indices: they do not depend on
PP) and ``TP x PP`` rank files; a PP change only changes the rank files, which DeepSpeed's loader
reads per stage. DeepSpeed's own reader (``checkpoint/deepspeed_checkpoint.py``) splits transformer
layers evenly over stages; reshard likewise refuses a target PP that does not divide them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from reshard.core.checks import check_replicated, check_same_keys
from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.facts import bool_arg, decide_groups, decide_version, head_facts, int_arg
from reshard.core.layouts import source_ranks_for_target
from reshard.core.options import ReshardOptions
from reshard.core.placement import target_ranks_needed, target_size
from reshard.core.plan import collect
from reshard.core.plan_types import (DROPPED_ENTRIES, LAYER_FILE, PIPE_RANK_FILE, ModelFacts, ParamPlan, Plan,
                                     SourceStage, TargetParam, TargetPlan, dropped_warning)
from reshard.core.safe_load import load_shard
from reshard.core.source import DEEPSPEED_PIPE, SourceCheckpoint, choose_module_key, layer_file_name, rank_file_name
from reshard.core.specs import target_specs
from reshard.models import resolve_family

#: Layer roles, told apart by their keys.
EMBEDDING, TRANSFORMER, FINAL_NORM, LM_HEAD = "embedding", "transformer", "final norm", "lm_head"
#: Legacy Megatron prefix each role's keys are read under (transformer layers are numbered per file).
_PREFIX = {EMBEDDING: "language_model.embedding.", TRANSFORMER: "language_model.encoder.layers.0.",
           FINAL_NORM: "language_model.encoder.final_layernorm."}
_LM_HEAD_KEY, _OUTPUT_KEY = "lm_head.weight", "language_model.output_layer.weight"
#: ``checkpoint_parallel_dimensions`` (DeepSpeed ``checkpoint/constants.py``).
PARALLEL_DIMS, PP_DEGREE, TP_DEGREE = "checkpoint_parallel_dimensions", "pp_degree", "tp_degree"


def build_pipe_plan(source: SourceCheckpoint, options: ReshardOptions, tpp: int) -> Plan:
    """Validate a DeepSpeed pipeline folder fully and plan its layer and rank files at (TP, PP)."""
    n, m, spp = source.tp, options.target_tp, source.pp
    if options.quantize:
        raise LayoutError("--quantize is not supported for DeepSpeed pipeline layer files", culprit="--quantize",
                          hint="quantize a non-pipeline (mp_rank_XX_model_states) checkpoint")
    rank_names = [str(f) for f in source.files[:spp * n]]
    shards = [load_shard(f) for f in source.files[:spp * n]]
    module_key = _check_rank_files(shards, rank_names, options)
    args = shards[0].get("args")
    _check_degrees(shards, rank_names, args, source)
    version = decide_version(shards, rank_names, source, options)

    stages, roles = _layer_stages(source)
    all_keys = list(dict.fromkeys(k for st in stages for k in st.modules[0]))
    _family, resolution = resolve_family(all_keys, source=source.origin)
    raw, carried_raw, per_group = collect(stages, resolution.by_key, source)
    num_layers = sum(per_group)
    saved_layers = int_arg(args, "num_layers")
    if saved_layers is not None and saved_layers != num_layers:
        raise CheckpointFormatError(f"args.num_layers is {saved_layers} but the layer files hold {num_layers} "
                                    f"transformer layers", culprit=source.origin, hint="copy the missing layer files")
    if tpp != spp and (num_layers == 0 or num_layers % tpp):
        raise LayoutError(f"{num_layers} layers cannot be split evenly over {tpp} pipeline stages",
                          culprit=source.origin, hint=f"choose a target PP that divides {num_layers}")

    origin: dict[str, str] = {}
    hidden, heads, head_dim = head_facts(options, args, raw, origin, source.origin)
    groups = decide_groups(options, args, heads, raw, head_dim, n, origin, source.origin)
    swiglu, vocab, params = target_specs(raw, options, args, version, heads, groups, head_dim, n, m, origin,
                                         source.origin)
    carried = [r.planned(None) for r in carried_raw]
    # from here on a parameter is found in its layer file under the file's own key
    params = [_with_file_key(p, stages, spp) for p in params]
    carried = [_with_file_key(p, stages, spp) for p in carried]
    check_replicated(params, _grid_rows(stages, spp))
    tied = _decide_tied(args, roles, origin, source)

    targets = _rank_targets(source, options, tpp) + _layer_targets(source, options, params + carried, roles,
                                                                   per_group, tpp)
    targets = [dataclasses.replace(t, rank=i) for i, t in enumerate(targets)]
    dropped = {k: DROPPED_ENTRIES[k] for k in shards[0] if k in DROPPED_ENTRIES}
    warnings = dropped_warning(dropped) + ([vocab.warning] if vocab.warning else [])
    ds_config = shards[0].get("ds_config")
    facts = ModelFacts(naming="legacy", num_layers=num_layers, hidden=hidden, heads=heads, query_groups=groups,
                       head_dim=head_dim, swiglu=swiglu, tied_embeddings=tied, vocab_size=vocab.true,
                       padded_vocab_source=vocab.source_rows, padded_vocab_target=vocab.target_rows,
                       make_vocab_size_divisible_by=vocab.divisible_by,
                       source_pp_layers=_even_split(num_layers, spp), target_pp_layers=_even_split(num_layers, tpp),
                       origin=dict(origin))
    return Plan(source=source, options=options, module_key=module_key, version=version, params=tuple(params),
                targets=tuple(targets), unused_rules=resolution.unused_rules, dropped=dropped, facts=facts,
                ds_config=copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings=tuple(warnings), carried=tuple(carried), target_pp=tpp, output_format=DEEPSPEED_PIPE)


# --- reading ----------------------------------------------------------------------------------------


def _check_rank_files(shards: list[dict[str, Any]], names: list[str], options: ReshardOptions) -> str:
    """The rank files' module key; in pipeline mode the engine saves ``module`` as None."""
    module_key = choose_module_key(shards[0], options.module_key, names[0])
    for sd, name in zip(shards, names):
        if sd.get(module_key, None) is not None:
            raise CheckpointFormatError(f"{module_key!r} holds weights beside pipeline layer files", culprit=name,
                                        hint="a DeepSpeed pipeline checkpoint keeps its weights in the layer files; "
                                             "remove the stray layer_* files or the stray rank files")
        if module_key not in sd:
            raise CheckpointFormatError(f"has no {module_key!r} entry as rank 0 has", culprit=name,
                                        hint="all rank files must come from one checkpoint")
    return module_key


def _check_degrees(shards: list[dict[str, Any]], names: list[str], args: Any, source: SourceCheckpoint) -> None:
    """Saved TP/PP (``checkpoint_parallel_dimensions``, Megatron args, ``mp_world_size``) must be the
    ones the files show: fewer files means a partial copy."""
    n, pp = source.tp, source.pp
    for sd, name in zip(shards, names):
        dims = sd.get(PARALLEL_DIMS)
        if isinstance(dims, dict) and (dims.get(PP_DEGREE), dims.get(TP_DEGREE)) != (pp, n):
            raise CheckpointFormatError(f"{PARALLEL_DIMS} says PP {dims.get(PP_DEGREE)} x TP {dims.get(TP_DEGREE)} "
                                        f"but the folder holds PP {pp} x TP {n}", culprit=name,
                                        hint="supply every layer and rank file of the checkpoint")
        mws = sd.get("mp_world_size")
        if mws is not None and mws not in (n, n * pp):
            raise CheckpointFormatError(f"saved mp_world_size is {mws} but the folder holds PP {pp} x TP {n}",
                                        culprit=name, hint="supply every layer and rank file of the checkpoint")
    for attr, found, what in (("tensor_model_parallel_size", n, "tensor-parallel ranks"),
                              ("pipeline_model_parallel_size", pp, "pipeline stages")):
        saved = int_arg(args, attr)
        if saved is not None and saved != found:
            raise CheckpointFormatError(f"args.{attr} is {saved} but {found} {what} were found", culprit=names[0],
                                        hint="supply every layer and rank file of the checkpoint")


def _layer_stages(source: SourceCheckpoint) -> tuple[list[SourceStage], list[str]]:
    """Every layer file row with its keys under legacy names, and each row's role."""
    n, stages, roles = source.tp, [], []
    for g, layer in enumerate(source.layer_ids):
        idx = [source.layer_file_index(g, r) for r in range(n)]
        names = [str(source.files[i]) for i in idx]
        modules = [_layer_dict(load_shard(source.files[i]), name) for i, name in zip(idx, names)]
        check_same_keys(modules, names)
        role = _role(modules[0], names[0])
        roles.append(role)
        stages.append(SourceStage(source.pp + g, names, [{_legacy_key(k, role): v for k, v in mod.items()}
                                                    for mod in modules]))
    _check_order(roles, source)
    return stages, roles


def _layer_dict(sd: Any, name: str) -> dict[str, Any]:
    if not isinstance(sd, dict) or not sd:
        what = "an empty dict" if isinstance(sd, dict) else f"a {type(sd).__name__}"
        raise CheckpointFormatError(f"holds {what}, not a layer's state dict", culprit=name,
                                    hint="re-copy the layer file")
    return sd


def _role(sd: dict[str, Any], name: str) -> str:
    keys = set(sd)
    if "word_embeddings.weight" in keys:
        return EMBEDDING
    if _LM_HEAD_KEY in keys:
        return LM_HEAD
    if keys <= {"weight", "bias"}:
        return FINAL_NORM
    return TRANSFORMER


def _legacy_key(key: str, role: str) -> str:
    if role == LM_HEAD:
        return _OUTPUT_KEY if key == _LM_HEAD_KEY else "lm_head_pipe." + key  # the latter matches no rule
    return _PREFIX[role] + key


def _check_order(roles: list[str], source: SourceCheckpoint) -> None:
    """GPTModelPipe's order: one embedding, transformer layers, one final norm, at most one lm_head."""
    expected = ([EMBEDDING] + [TRANSFORMER] * roles.count(TRANSFORMER) + [FINAL_NORM]
                + ([LM_HEAD] if LM_HEAD in roles else []))
    if roles != expected:
        at = next((i for i, (a, b) in enumerate(zip(roles, expected)) if a != b), min(len(roles), len(expected)))
        found = f"a {roles[at]} layer ({layer_file_name(source.layer_ids[at], 0)})" if at < len(roles) else \
            "no layer file"
        raise CheckpointFormatError(
            f"layer files hold {roles.count(EMBEDDING)} embedding, {roles.count(TRANSFORMER)} transformer, "
            f"{roles.count(FINAL_NORM)} final-norm layers: found {found} where a {expected[at]} layer "
            f"belongs", culprit=source.origin,
            hint="expected GPTModelPipe's layers: embedding, transformer layers, final norm[, lm_head]; "
                 "copy missing layer files or remove stray ones")


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


def _with_file_key(p: ParamPlan, stages: list[SourceStage], spp: int) -> ParamPlan:
    """The parameter's key in its own layer file (the legacy name was for the rule table)."""
    st = stages[p.stage - spp]
    local = next(k for k, lk in zip(_file_keys(st), st.modules[0]) if lk == p.src_key)
    return dataclasses.replace(p, src_key=local)


def _file_keys(st: SourceStage) -> list[str]:
    """Row ``st``'s keys as saved, in order (the legacy keys were made from them key by key)."""
    out = []
    for lk in st.modules[0]:
        if lk == _OUTPUT_KEY:
            out.append(_LM_HEAD_KEY)
        else:
            prefix = next(v for v in _PREFIX.values() if lk.startswith(v))
            out.append(lk[len(prefix):])
    return out


def _grid_rows(stages: list[SourceStage], spp: int) -> list[SourceStage]:
    """Rows indexed like the source grid (rank-file rows empty), each layer file under its own keys."""
    files = [SourceStage(st.index, st.names, [dict(zip(_file_keys(st), mod.values())) for mod in st.modules])
             for st in stages]
    return [SourceStage(s, [], []) for s in range(spp)] + files


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
