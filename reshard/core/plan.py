"""Resolve a source checkpoint and options into a validated plan before any byte is written.

Everything that can be wrong with the input is found here: rank files, module key, version,
key sets, shapes and dtypes across ranks, replicated tensors that differ, unknown parameter
names, model facts that are unknown or contradict each other, head/group counts and dimensions
that do not divide, pipeline stages that do not fit. The engine then only executes.

Model facts (:class:`ModelFacts`) come from the checkpoint's saved Megatron ``args`` when present,
else from the options (CLI flags), else from the tensors themselves where the shapes decide
them exactly (e.g. an fc1 twice as wide as fc2's input is gated). A fact that is needed and
still unknown is refused (:class:`MissingModelFactError`), never guessed.

Pipeline parallelism: parameters are planned under *logical* keys (global layer numbers). A
target stage gets its layers (renumbered from 0), the first stage the embeddings, the last the
final norm and output layer. With tied embeddings and PP > 1 the last stage also holds a copy of
the word embeddings (``output_layer.weight`` / ``word_embeddings_for_head.weight``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.checks import check_replicated, check_same_keys
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError
from reshard.core.facts import decide_groups, decide_tied, decide_version, head_facts, int_arg
from reshard.core.lazy import LazyTensor
from reshard.core.options import ReshardOptions
from reshard.core.placement import place, split_files, target_plan
from reshard.core.plan_types import DROPPED_ENTRIES, ModelFacts, Plan, RawParam, SourceStage, dropped_warning
from reshard.core.rules import Kind, Rule, layer_index, with_layer
from reshard.core.source import SourceCheckpoint, choose_module_key
from reshard.core.specs import check_quantization, target_specs
from reshard.formats.registry import get_format
from reshard.formats.output import output_format
from reshard.models import resolve_family


def build_grid_plan(source: SourceCheckpoint, options: ReshardOptions, tpp: int, *,
                    headers_only: bool = False) -> Plan:
    """The plan of a checkpoint whose files form a (stage, TP rank) grid of module dicts
    (DeepSpeed ``mp_rank_XX`` files, Megatron-LM folders) at target PP ``tpp``; see
    :func:`reshard.core.planner.build_plan`, which validates the degrees and picks the planner.

    ``headers_only``: read just the first rank file of each pipeline stage and take it as
    every rank of its stage. The layout (specs, targets, sources) then equals the full plan's
    whenever the full checks pass, so a pipeline can start converting a target as soon as its
    own sources arrive and run the cross-rank checks (``headers_only=False``) alongside —
    publishing nothing until they pass."""
    n, m = source.tp, options.target_tp
    fmt = get_format(source.format)  # reads the files
    out_fmt = output_format(source, options)  # names and writes the outputs
    out_fmt.check_target(tpp)
    if headers_only:
        heads = [fmt.load(source.stage_files(s)[0]) for s in range(source.pp)]
        shards = [heads[i // n] for i in range(len(source.files))]
    else:
        shards = [fmt.load(f) for f in source.files]
    names = [str(f) for f in source.files]
    module_key, modules = _modules(shards, names, options, n)
    args = shards[0].get("args")
    fmt.check_saved_degrees(args, source)
    stages = [SourceStage(s, list(names[s * n:(s + 1) * n]), modules[s * n:(s + 1) * n]) for s in range(source.pp)]
    for st in stages:
        check_same_keys(st.modules, st.names)
    version = decide_version(shards, names, source, options)

    all_keys = list(dict.fromkeys(k for st in stages for k in st.modules[0]))
    family, resolution = resolve_family(all_keys, source=source.origin)
    naming = family.naming(all_keys)
    raw, carried_raw, layers_per_stage = collect(stages, resolution.by_key, source)
    num_layers = sum(layers_per_stage)
    saved_layers = int_arg(args, "num_layers")
    if saved_layers is not None and saved_layers != num_layers:
        raise CheckpointFormatError(f"args.num_layers is {saved_layers} but the rank files hold {num_layers} layers",
                                    culprit=source.origin, hint="supply every pipeline stage of the checkpoint")

    origin: dict[str, str] = {}
    hidden, num_heads, head_dim = head_facts(options, args, raw, origin, source.origin)
    groups = decide_groups(options, args, num_heads, raw, head_dim, n, origin, source.origin)
    swiglu, vocab, params = target_specs(raw, options, args, version, num_heads, groups, head_dim, n, m, origin,
                                         source.origin, fmt.padding_tp(args, source), fmt.vocab_divisor)
    carried = [r.planned(None) for r in carried_raw]
    check_replicated(params, stages)
    tied = decide_tied(args, naming, params, stages, origin, source)
    warnings: list[str] = [vocab.warning] if vocab.warning else []
    order = {r.key: i for i, r in enumerate(sorted(raw + carried_raw, key=lambda r: r.order))}
    entries = sorted(params + carried, key=lambda p: order[p.key])  # source order, stage by stage
    placed, target_layers = place(entries, naming, tied, layers_per_stage, source.pp, tpp, stages,
                                  warnings, source.origin)
    if options.quantize:
        check_quantization(params, options, n, m)
    targets = tuple(target_plan(s, t, placed[s], source, options, n, m, tpp, out_fmt.name)
                    for s in range(tpp) for t in range(m))
    if not out_fmt.per_rank and len(targets) == 1:
        targets = split_files(targets[0], source, options, n, m, tpp, out_fmt.name)
    dropped = {k: DROPPED_ENTRIES[k] for k in shards[0] if k in DROPPED_ENTRIES}
    ds_config = shards[0].get("ds_config")
    warnings = dropped_warning(dropped) + warnings
    facts = ModelFacts(naming=naming, num_layers=num_layers, hidden=hidden, heads=num_heads, query_groups=groups,
                       head_dim=head_dim, swiglu=swiglu, tied_embeddings=tied, vocab_size=vocab.true,
                       padded_vocab_source=vocab.source_rows, padded_vocab_target=vocab.target_rows,
                       make_vocab_size_divisible_by=vocab.divisible_by, source_pp_layers=tuple(layers_per_stage),
                       target_pp_layers=tuple(target_layers), origin=dict(origin))
    extra = out_fmt.extra_files(source)
    plan = Plan(source=source, options=options, module_key=module_key, version=version, params=tuple(params),
                targets=targets, unused_rules=resolution.unused_rules, dropped=dropped, facts=facts,
                ds_config=copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings=tuple(warnings), carried=tuple(carried), target_pp=tpp, output_format=out_fmt.name,
                extra_files=extra)
    out_fmt.check_plan(plan)
    return plan


def _modules(shards: list[dict[str, Any]], names: list[str], options: ReshardOptions, n: int
             ) -> tuple[str, list[dict[str, Any]]]:
    """The module key and every file's module dict (one key for all; DeepSpeed's mp_world_size checked)."""
    module_key = choose_module_key(shards[0], options.module_key, names[0])
    modules = []
    for sd, name in zip(shards, names):
        if choose_module_key(sd, options.module_key, name) != module_key:
            raise InconsistentShardsError(f"module is not under {module_key!r} as on rank 0", culprit=name)
        mod = sd[module_key]
        if not isinstance(mod, dict):
            raise CheckpointFormatError(f"{module_key!r} is a {type(mod).__name__}, not a state dict",
                                        culprit=name)
        mws = sd.get("mp_world_size")
        if mws is not None and mws != n:
            raise CheckpointFormatError(f"saved mp_world_size is {mws} but {n} rank files were found",
                                        culprit=name, hint="supply all rank files of the checkpoint (and no extra)")
        modules.append(mod)
    return module_key, modules


def collect(stages: list[SourceStage], by_key: Mapping[str, Rule], source: SourceCheckpoint
            ) -> tuple[list[RawParam], list[RawParam], list[int]]:
    """Logical entries of every stage (layers renumbered globally), shapes checked across ranks."""
    tensors: list[RawParam] = []
    carried: list[RawParam] = []
    layers_per_stage: list[int] = []
    seen: dict[str, int] = {}
    offset = 0
    for st in stages:
        local = sorted({i for i in (layer_index(k) for k in st.modules[0]) if i is not None})
        if len(stages) > 1 and local != list(range(len(local))):
            raise CheckpointFormatError(f"pipeline stage {st.index} numbers its layers {local[:8]}, not 0..k-1",
                                        culprit=st.names[0], hint="each stage's file must number its layers locally")
        layers_per_stage.append(len(local) if len(stages) > 1 else (max(local) + 1 if local else 0))
        for key, v0 in st.modules[0].items():
            rule = by_key[key]
            li = layer_index(key)
            glob = None if li is None else li + offset
            logical = key if glob is None or len(stages) == 1 else with_layer(key, glob)
            if logical in seen:
                raise CheckpointFormatError(f"{logical} is held by pipeline stages {seen[logical]} and {st.index}",
                                            culprit=source.origin, hint="stages must hold disjoint parameters")
            seen[logical] = st.index
            if rule.kind is Kind.CARRIED:  # opaque per-rank state (TE fp8 meta): never compared
                shape, dtype = (tuple(v0.shape), v0.dtype) if isinstance(v0, torch.Tensor) else ((), None)
                carried.append(RawParam(logical, rule, shape, dtype, glob, st.index, key, len(seen)))
                continue
            if not isinstance(v0, (torch.Tensor, LazyTensor)):
                raise CheckpointFormatError(f"module entry {key} is a {type(v0).__name__}, not a tensor",
                                            culprit=st.names[0])
            for mod, name in zip(st.modules[1:], st.names[1:]):
                t = mod[key]
                if not isinstance(t, (torch.Tensor, LazyTensor)) or t.shape != v0.shape or t.dtype != v0.dtype:
                    what = (f"{tuple(t.shape)}/{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise InconsistentShardsError(
                        f"{key}: shape/dtype {what} differs from rank 0's {tuple(v0.shape)}/{v0.dtype}",
                        culprit=name, hint="all rank files must come from one checkpoint")
            tensors.append(RawParam(logical, rule, tuple(v0.shape), v0.dtype, glob, st.index, key, len(seen)))
        offset += layers_per_stage[-1]
    return tensors, carried, layers_per_stage
