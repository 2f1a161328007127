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
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.errors import (CheckpointFormatError, InconsistentShardsError, LayoutError,
                                 MissingModelFactError, ReshardError)
from reshard.core.pages import PageDropper
from reshard.core.layouts import (FILL, PartitionSpec, check_divisible, pieces_for_target,
                                  source_ranks_for_target)
from reshard.core.options import ReshardOptions
from reshard.core.rules import (MEGATRON_GPT_RULES, Kind, Place, QKVLayout, QuantSlot, Rule, is_megatron_core,
                                layer_index, resolve, with_layer)
from reshard.core.source import DEEPSPEED, SourceCheckpoint, choose_module_key, parse_version
from reshard.formats.registry import get_format

#: Top-level entries that are wrong after a reshard; dropped with the reason reported.
DROPPED_ENTRIES: dict[str, str] = {
    "optimizer": "optimizer state is partitioned for the old layout",
    "optimizer_state_dict": "optimizer state is partitioned for the old layout",
    "lr_scheduler": "scheduler state belongs with the dropped optimizer",
    "opt_param_scheduler": "scheduler state belongs with the dropped optimizer",
    "rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "random_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "np_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "torch_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "cuda_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "rng_tracker_states": "per-rank RNG state has no meaning at a new TP degree",
    "param_shapes": "per-rank ZeRO parameter shapes describe the old layout",
}

#: Names of the last stage's tied copy of the word embeddings, per naming family.
TIED_HEAD_KEYS: dict[str, str] = {"megatron-core": "output_layer.weight", "legacy": "word_embeddings_for_head.weight"}
_OUTPUT_KEYS = ("output_layer.weight", "language_model.output_layer.weight")


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """The model facts the layout depends on, and where each came from (``origin``:
    fact -> ``args`` / ``--flag`` / ``shapes`` / ``tensors``). None: unknown (and not needed)."""

    naming: str
    num_layers: int
    hidden: int | None
    heads: int | None
    query_groups: int | None
    head_dim: int | None
    swiglu: bool | None
    tied_embeddings: bool | None
    vocab_size: int | None
    padded_vocab_source: int | None
    padded_vocab_target: int | None
    make_vocab_size_divisible_by: int | None
    source_pp_layers: tuple[int, ...]
    target_pp_layers: tuple[int, ...]
    origin: Mapping[str, str] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        rec = {k: v for k, v in self.__dict__.items() if k != "origin"}
        rec["source_pp_layers"] = list(self.source_pp_layers)
        rec["target_pp_layers"] = list(self.target_pp_layers)
        rec["origin"] = dict(self.origin)
        return rec


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """One logical module entry: its rule, per-source-rank shape, and partition spec.

    ``key`` is the logical name (global layer numbers); ``stage``/``src_key`` say where the
    source holds it. Carried non-tensor entries (``_extra_state``) have ``dtype`` None."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    spec: PartitionSpec | None
    layer: int | None
    stage: int = 0
    src_key: str = ""

    @property
    def quant_slot(self) -> QuantSlot | None:
        return self.rule.quant


@dataclass(frozen=True, kw_only=True)
class TargetParam:
    """One entry of a target's module: its name there and the logical parameter it holds."""

    out_key: str
    param: ParamPlan


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    """One output file: its index in ``Plan.targets`` (``rank``), its path relative to the
    destination, which source files feed it (indices into ``source.files``; for PP = 1 these
    are the source TP ranks) and the bytes it moves. Writers iterate these; they never build
    names themselves.

    ``tp_rank``/``pp_rank``: its place in the target grid; ``base_rank``: the source TP rank
    that replicated tensors and top-level entries are taken from; ``params``: its module.
    ``kind``: what the file holds (:data:`RANK_FILE`, or for DeepSpeed pipelines
    :data:`LAYER_FILE` / :data:`PIPE_RANK_FILE`; see :mod:`reshard.core.ds_pipe`)."""

    rank: int
    name: str
    sources: tuple[int, ...]
    bytes_read: int
    bytes_written: int
    tp_rank: int = 0
    pp_rank: int = 0
    base_rank: int = 0
    params: tuple[TargetParam, ...] = ()
    kind: str = "rank"


#: ``TargetPlan.kind``: top-level entries with the module under ``module_key``.
RANK_FILE = "rank"
#: A DeepSpeed pipeline layer file: the layer's module state dict itself, nothing around it.
LAYER_FILE = "layer"
#: A DeepSpeed pipeline ``mp_rank`` file: top-level entries, ``module`` None (weights are in layer files).
PIPE_RANK_FILE = "pipe-rank"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated conversion. ``extra_files``: small text files the writer must also write
    (relative name -> content), e.g. Megatron's ``latest_checkpointed_iteration.txt``.
    ``params``: logical tensors; ``carried``: opaque non-tensor module entries."""

    source: SourceCheckpoint
    options: ReshardOptions
    module_key: str
    version: float
    params: tuple[ParamPlan, ...]
    targets: tuple[TargetPlan, ...]
    unused_rules: tuple[str, ...]
    dropped: dict[str, str]
    facts: ModelFacts
    ds_config: dict[str, Any] | None = None
    warnings: tuple[str, ...] = field(default=())
    carried: tuple[ParamPlan, ...] = ()
    target_pp: int = 1
    output_format: str = DEEPSPEED
    extra_files: Mapping[str, str] = field(default_factory=dict)

    @property
    def source_tp(self) -> int:
        return self.source.tp

    @property
    def source_pp(self) -> int:
        return self.source.pp

    @property
    def target_tp(self) -> int:
        return self.options.target_tp

    @property
    def peak_memory_estimate(self) -> int:
        """Bytes held at once by the engine: one target rank's tensors plus one source tensor."""
        largest_src = max((_nbytes(p.shape, p.dtype) for p in self.params), default=0)
        return max((t.bytes_written for t in self.targets), default=0) + largest_src


def dropped_warning(dropped: Mapping[str, str]) -> list[str]:
    """One line for the top-level entries left out (the reason per entry is in ``Plan.dropped``)."""
    if not dropped:
        return []
    return [f"dropped training state that belongs to the old layout: {', '.join(dropped)} "
            f"(the output holds the model and its args)"]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else _elems(shape) * dtype.itemsize


def _int_attr(args: Any, name: str) -> int | None:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _bool_attr(args: Any, name: str) -> bool | None:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, bool) else None


@dataclass
class _Stage:
    """One source pipeline stage while planning: its files' names and module dicts."""

    index: int
    names: list[str]
    modules: list[dict[str, Any]]


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
    fmt = get_format(source.format)  # reads the files, names and writes the outputs
    fmt.check_target(tpp)
    if headers_only:
        heads = [fmt.load(source.stage_files(s)[0]) for s in range(source.pp)]
        shards = [heads[i // n] for i in range(len(source.files))]
    else:
        shards = [fmt.load(f) for f in source.files]
    names = [str(f) for f in source.files]
    module_key, modules = _modules(shards, names, options, n)
    args = shards[0].get("args")
    fmt.check_saved_degrees(args, source)
    stages = [_Stage(s, list(names[s * n:(s + 1) * n]), modules[s * n:(s + 1) * n]) for s in range(source.pp)]
    for st in stages:
        _check_same_keys(st.modules, st.names)
    version = _decide_version(shards, names, source, options)

    all_keys = list(dict.fromkeys(k for st in stages for k in st.modules[0]))
    resolution = resolve(all_keys, MEGATRON_GPT_RULES, source=source.origin)
    naming = "megatron-core" if is_megatron_core(all_keys) else "legacy"
    raw, carried_raw, layers_per_stage = _collect(stages, resolution.by_key, source)
    num_layers = sum(layers_per_stage)
    saved_layers = _int_attr(args, "num_layers")
    if saved_layers is not None and saved_layers != num_layers:
        raise CheckpointFormatError(f"args.num_layers is {saved_layers} but the rank files hold {num_layers} layers",
                                    culprit=source.origin, hint="supply every pipeline stage of the checkpoint")

    origin: dict[str, str] = {}
    hidden, num_heads, head_dim = _head_facts(options, args, raw, origin, source.origin)
    groups = _decide_groups(options, args, num_heads, raw, head_dim, n, origin, source.origin)
    swiglu, vocab, params = target_specs(raw, options, args, version, num_heads, groups, head_dim, n, m, origin,
                                         source.origin)
    carried = [r.planned(None) for r in carried_raw]
    _check_replicated(params, stages)
    tied = _decide_tied(args, naming, params, stages, origin, source)
    warnings: list[str] = [vocab.warning] if vocab.warning else []
    order = {r.key: i for i, r in enumerate(sorted(raw + carried_raw, key=lambda r: r.order))}
    entries = sorted(params + carried, key=lambda p: order[p.key])  # source order, stage by stage
    placed, target_layers = _place(entries, naming, tied, layers_per_stage, source.pp, tpp, stages,
                                   warnings, source.origin)
    if options.quantize:
        _check_quantization(params, options, n, m)
    targets = tuple(_target_plan(s, t, placed[s], source, options, n, m, tpp) for s in range(tpp) for t in range(m))
    dropped = {k: DROPPED_ENTRIES[k] for k in shards[0] if k in DROPPED_ENTRIES}
    ds_config = shards[0].get("ds_config")
    warnings = dropped_warning(dropped) + warnings
    facts = ModelFacts(naming=naming, num_layers=num_layers, hidden=hidden, heads=num_heads, query_groups=groups,
                       head_dim=head_dim, swiglu=swiglu, tied_embeddings=tied, vocab_size=vocab.true,
                       padded_vocab_source=vocab.source_rows, padded_vocab_target=vocab.target_rows,
                       make_vocab_size_divisible_by=vocab.divisible_by, source_pp_layers=tuple(layers_per_stage),
                       target_pp_layers=tuple(target_layers), origin=dict(origin))
    extra = fmt.extra_files(source)
    return Plan(source=source, options=options, module_key=module_key, version=version, params=tuple(params),
                targets=targets, unused_rules=resolution.unused_rules, dropped=dropped, facts=facts,
                ds_config=copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings=tuple(warnings), carried=tuple(carried), target_pp=tpp, output_format=source.format,
                extra_files=extra)


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


def _head_facts(options: ReshardOptions, args: Any, raw: list[_Raw], origin: dict[str, str], where: str
                ) -> tuple[int | None, int | None, int | None]:
    """(hidden size, attention heads, head dim): args and flags first, hidden from the QKV shape."""
    hidden = _int_attr(args, "hidden_size")
    if hidden is not None:
        origin["hidden"] = "args"
    heads = _decide_heads(options, args, where)
    if heads is not None:
        origin["heads"] = "--num-heads" if options.num_heads is not None else "args"
    for r in raw:
        if r.rule.quant is QuantSlot.QKV and len(r.shape) == 2 and hidden is None:
            hidden = r.shape[1]
            origin["hidden"] = "shapes"
    head_dim = _int_attr(args, "kv_channels")
    if head_dim is not None:
        origin["head_dim"] = "args"
    elif heads is not None and hidden is not None:
        if hidden % heads:
            raise LayoutError(f"hidden size {hidden} is not divisible by {heads} heads", culprit=where,
                              hint="check --num-heads")
        head_dim = hidden // heads
        origin["head_dim"] = "hidden/heads"
    return hidden, heads, head_dim


@dataclass(frozen=True)
class _Raw:
    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    layer: int | None
    stage: int
    src_key: str
    order: int

    def planned(self, spec: PartitionSpec | None) -> ParamPlan:
        """This parameter's plan with its partition spec (None: replicated or carried)."""
        return ParamPlan(key=self.key, rule=self.rule, shape=self.shape, dtype=self.dtype, spec=spec,
                         layer=self.layer, stage=self.stage, src_key=self.src_key)


def _collect(stages: list[_Stage], by_key: Mapping[str, Rule], source: SourceCheckpoint
             ) -> tuple[list[_Raw], list[_Raw], list[int]]:
    """Logical entries of every stage (layers renumbered globally), shapes checked across ranks."""
    tensors: list[_Raw] = []
    carried: list[_Raw] = []
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
                carried.append(_Raw(logical, rule, shape, dtype, glob, st.index, key, len(seen)))
                continue
            if not isinstance(v0, torch.Tensor):
                raise CheckpointFormatError(f"module entry {key} is a {type(v0).__name__}, not a tensor",
                                            culprit=st.names[0])
            for mod, name in zip(st.modules[1:], st.names[1:]):
                t = mod[key]
                if not isinstance(t, torch.Tensor) or t.shape != v0.shape or t.dtype != v0.dtype:
                    what = (f"{tuple(t.shape)}/{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise InconsistentShardsError(
                        f"{key}: shape/dtype {what} differs from rank 0's {tuple(v0.shape)}/{v0.dtype}",
                        culprit=name, hint="all rank files must come from one checkpoint")
            tensors.append(_Raw(logical, rule, tuple(v0.shape), v0.dtype, glob, st.index, key, len(seen)))
        offset += layers_per_stage[-1]
    return tensors, carried, layers_per_stage


def _check_same_keys(modules: list[dict[str, Any]], names: list[str]) -> None:
    ref = set(modules[0])
    for mod, name in zip(modules[1:], names[1:]):
        keys = set(mod)
        if keys != ref:
            missing, extra = sorted(ref - keys), sorted(keys - ref)
            detail = "; ".join(x for x in (f"missing {missing[:5]}" if missing else "",
                                          f"extra {extra[:5]}" if extra else "") if x)
            raise InconsistentShardsError(f"parameter names differ from rank 0: {detail}", culprit=name,
                                          hint="all rank files must come from one checkpoint")


def _decide_version(shards: list[dict[str, Any]], names: list[str], source: SourceCheckpoint,
                    options: ReshardOptions) -> float:
    saved = [parse_version(sd.get("checkpoint_version", 0), name) for sd, name in zip(shards, names)]
    if len(set(saved)) > 1:
        raise InconsistentShardsError(f"ranks disagree on checkpoint_version: {sorted(set(saved))}",
                                      culprit=source.origin, hint="pass --version to state the QKV layout")
    if options.version is not None:
        return parse_version(options.version, "--version")
    if source.descriptor_version is not None:
        return source.descriptor_version
    return saved[0]


def _decide_heads(options: ReshardOptions, args: Any, where: str) -> int | None:
    saved = _int_attr(args, "num_attention_heads")
    if options.num_heads is not None:  # positive: checked by ReshardOptions
        if saved is not None and saved != options.num_heads:
            raise LayoutError(f"--num-heads {options.num_heads} contradicts the saved "
                              f"args.num_attention_heads={saved}", culprit=where,
                              hint="drop --num-heads or correct it")
        return options.num_heads
    return saved


def _qkv_rows(raw: list[_Raw]) -> int | None:
    """Rows of one source rank's QKV weight (all layers agree, checked by shapes per layer)."""
    for r in raw:
        if r.rule.quant is QuantSlot.QKV:
            return r.shape[0]
    return None


def _decide_groups(options: ReshardOptions, args: Any, heads: int | None, raw: list[_Raw], hn: int | None,
                   n: int, origin: dict[str, str], where: str) -> int | None:
    """Query groups: the flag, else args (``group_query_attention``/``num_query_groups``), else MHA
    when the QKV shape holds exactly ``3 * heads`` head rows; None when unknown."""
    saved = None
    gqa = _bool_attr(args, "group_query_attention")
    if gqa is True:
        saved = _int_attr(args, "num_query_groups")
    elif gqa is False:
        saved = heads
    flag = options.num_query_groups
    if flag is not None:
        if saved is not None and saved != flag:
            raise LayoutError(f"--num-query-groups {flag} contradicts the saved args (num_query_groups={saved})",
                              culprit=where, hint="drop --num-query-groups or correct it")
        groups, origin["query_groups"] = flag, "--num-query-groups"
    elif saved is not None:
        groups, origin["query_groups"] = saved, "args"
    else:
        rows = _qkv_rows(raw)
        if heads is not None and hn is not None and rows is not None and rows * n == 3 * heads * hn:
            groups, origin["query_groups"] = heads, "shapes (multi-head: 3 x heads rows)"
        else:
            return None
    if heads is not None and heads % groups:
        raise LayoutError(f"{heads} attention heads do not form {groups} equal query groups", culprit=where,
                          hint="check --num-heads / --num-query-groups")
    return groups


def _decide_swiglu(options: ReshardOptions, args: Any, raw: list[_Raw], n: int, m: int,
                   origin: dict[str, str], where: str) -> bool | None:
    """Whether fc1 is gated ([W; V] per rank): decided exactly by the shapes — a gated fc1 has twice
    the rows fc2 has input columns — and cross-checked against args.swiglu and --swiglu."""
    fc1 = {r.layer: r for r in raw if r.rule.quant is QuantSlot.H_TO_4H}
    fc2 = {r.layer: r for r in raw if r.rule.quant is QuantSlot.FOUR_H_TO_H}
    seen: set[bool] = set()
    for layer, a in fc1.items():
        b = fc2.get(layer)
        if b is None or len(a.shape) != 2 or len(b.shape) != 2:
            continue
        rows, cols = a.shape[0], b.shape[1]
        if rows == 2 * cols:
            seen.add(True)
        elif rows == cols:
            seen.add(False)
        else:
            raise LayoutError(f"fc1 has {rows * n} output rows but fc2 {cols * n} input columns: neither a plain "
                              f"nor a gated (SwiGLU) MLP", culprit=a.key, hint="the checkpoint is inconsistent")
    if len(seen) > 1:
        raise LayoutError("some layers have a gated (SwiGLU) MLP and some do not", culprit=where,
                          hint="reshard needs one MLP kind for all layers")
    shaped = next(iter(seen)) if seen else None
    saved = _bool_attr(args, "swiglu")
    for value, name in ((saved, "args.swiglu"), (options.swiglu, "--swiglu/--no-swiglu")):
        if value is not None and shaped is not None and value != shaped:
            raise LayoutError(f"{name} says {'gated' if value else 'plain'} but fc1/fc2 shapes are "
                              f"{'gated' if shaped else 'plain'}", culprit=where,
                              hint="correct or drop the flag; the tensors decide")
    if options.swiglu is not None and saved is not None and options.swiglu != saved:
        raise LayoutError(f"--{'' if options.swiglu else 'no-'}swiglu contradicts the saved args.swiglu={saved}",
                          culprit=where, hint="drop the flag")
    if shaped is not None:
        origin["swiglu"] = "shapes (fc1 rows vs fc2 columns)"
        return shaped
    if options.swiglu is not None:
        origin["swiglu"] = "--swiglu/--no-swiglu"
        return options.swiglu
    if saved is not None:
        origin["swiglu"] = "args"
        return saved
    if fc1 and n != m:
        key = next(iter(fc1.values())).key
        raise MissingModelFactError(
            f"whether the MLP is gated (SwiGLU) is unknown, and {n} -> {m} ranks moves its gate and "
            f"up halves differently", culprit=key, hint="pass --swiglu or --no-swiglu")
    return None


@dataclass(frozen=True)
class _Vocab:
    """Vocabulary rows: the true size (if known), source and target padded rows, divisor, and the
    warning to give when the target padding is an assumption rather than Megatron's own."""

    true: int | None
    source_rows: int | None
    target_rows: int | None
    divisible_by: int | None
    keep: int | None = None
    warning: str | None = None

    @property
    def resized(self) -> bool:
        return self.source_rows != self.target_rows


def _decide_vocab(options: ReshardOptions, args: Any, raw: list[_Raw], n: int, m: int,
                  origin: dict[str, str], where: str) -> _Vocab:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``; at a new
    TP the padded size may change.

    ====================================  ===============================================================
    what is known                         target rows
    ====================================  ===============================================================
    true size V (flag or args) and D      Megatron's: ceil(V / (D*M)) * D*M; rows past V are zeros
    no divisor D                          the source's rows, unchanged (pre-Megatron-LM checkpoints)
    D, and every V the source's padding   that one padding (exact, no warning)
    allows pads alike at TP M
    D only, source rows a multiple of     the source's rows, kept (every merge); warning: Megatron's
    D*M                                   own padding may be smaller
    D only, otherwise                     zero rows appended up to the next multiple of D*M; warning
    ====================================  ===============================================================

    Megatron-LM saves ``padded_vocab_size`` but, for most tokenizers, not the true size; keeping
    the rows is what its own converter and DeepSpeed do. The warning names the assumption and
    ``--vocab-size V`` for Megatron's exact padding."""
    vocab = [r for r in raw if r.rule.vocab]
    if not vocab:
        return _Vocab(None, None, None, None)
    rows = {r.shape[0] * n for r in vocab}
    if len(rows) > 1:
        raise InconsistentShardsError(f"vocabulary-parallel tensors disagree on the vocabulary rows: {sorted(rows)}",
                                      culprit=where, hint="the checkpoint is inconsistent")
    src_rows = rows.pop()
    saved_padded = _int_attr(args, "padded_vocab_size")
    if saved_padded is not None and saved_padded != src_rows:
        raise CheckpointFormatError(f"args.padded_vocab_size is {saved_padded} but the embeddings hold {src_rows} rows",
                                    culprit=where, hint="the args do not belong to these tensors")
    d = _flag_or_arg(options.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by",
                     _int_attr(args, "make_vocab_size_divisible_by"), "args.make_vocab_size_divisible_by",
                     "make_vocab_size_divisible_by", origin, where)
    true = _flag_or_arg(options.vocab_size, "--vocab-size", _int_attr(args, "vocab_size"), "args.vocab_size",
                        "vocab_size", origin, where)
    if true is not None and true > src_rows:
        raise LayoutError(f"vocabulary size {true} exceeds the {src_rows} embedding rows", culprit=where,
                          hint="check --vocab-size")
    if d is None:
        return _Vocab(true, src_rows, src_rows, None)
    unit_t = d * m
    if true is not None:
        target = math.ceil(true / unit_t) * unit_t
        origin["padded_vocab_target"] = "vocab_size and divisor"
        return _Vocab(true, src_rows, target, d, keep=true if target != src_rows else None)
    if n == m:
        return _Vocab(None, src_rows, src_rows, d)
    # the true sizes this padding allows (all of them if the rows are no multiple of D x N)
    unit_s = d * n
    lo = max(1, src_rows - unit_s + 1) if src_rows % unit_s == 0 else 1
    exact = {math.ceil(v / unit_t) * unit_t for v in (lo, src_rows)}
    target = math.ceil(src_rows / unit_t) * unit_t
    keep = min(src_rows, target) if target != src_rows else None
    if exact == {target}:  # every allowed size pads to the same rows: Megatron's padding, exactly
        origin["padded_vocab_target"] = "padded rows and divisor (unambiguous)"
        return _Vocab(None, src_rows, target, d, keep=keep)
    origin["padded_vocab_target"] = "source rows kept (true vocabulary size unknown)"
    how = (f"kept the {src_rows} vocabulary rows" if target == src_rows else
           f"padded the {src_rows} vocabulary rows with zero rows to {target}")
    warning = (f"{how} at TP {m}, assuming they are a valid padding; the checkpoint does not record the true "
               f"vocabulary size, so Megatron's own padding at TP {m} may be smaller (pass --vocab-size V for "
               f"Megatron's exact padding)")
    return _Vocab(None, src_rows, target, d, keep=keep, warning=warning)


def _flag_or_arg(flag: int | None, flag_name: str, saved: int | None, saved_name: str, fact: str,
                 origin: dict[str, str], where: str) -> int | None:
    if flag is not None:  # positive: checked by ReshardOptions
        if saved is not None and saved != flag:
            raise LayoutError(f"{flag_name} {flag} contradicts the saved {saved_name}={saved}", culprit=where,
                              hint=f"drop {flag_name} or correct it")
        origin[fact] = flag_name
        return flag
    if saved is not None:
        origin[fact] = "args"
    return saved


#: Largest target TP tried when listing the ones that would work (a hint, not a limit).
MAX_SUGGESTED_TP = 256


def target_specs(raw: list[_Raw], options: ReshardOptions, args: Any, version: float, heads: int | None,
                 groups: int | None, head_dim: int | None, n: int, m: int, origin: dict[str, str], where: str
                 ) -> tuple[bool | None, "_Vocab", list[ParamPlan]]:
    """The facts and partition specs that depend on the target TP ``m``: gated MLP, vocabulary
    padding, and every parameter's spec. A target TP that some tensor cannot be divided over is
    refused with the target TPs that satisfy *every* tensor at once (heads, query groups, FFN
    width, vocabulary rows), so following the hint cannot fail on the next constraint."""

    def at(tm: int, facts_origin: dict[str, str]) -> tuple[bool | None, _Vocab, list[ParamPlan]]:
        swiglu = _decide_swiglu(options, args, raw, n, tm, facts_origin, where)
        vocab = _decide_vocab(options, args, raw, n, tm, facts_origin, where)
        ctx = _SpecContext(version, heads, groups, head_dim, swiglu, n, tm)
        return swiglu, vocab, [r.planned(_spec_for(r, ctx, vocab)) for r in raw]

    try:
        return at(m, origin)
    except MissingModelFactError:
        raise
    except LayoutError as err:
        valid = []
        for tm in range(1, MAX_SUGGESTED_TP + 1):
            try:
                at(tm, {})
            except ReshardError:
                continue
            valid.append(tm)
        if valid and m not in valid:
            shown = ", ".join(map(str, valid))
            err.hint = f"choose a target TP among {shown}" if len(valid) > 1 else f"use target TP {shown}"
            err.args = (err.one_line(),)
        raise


@dataclass(frozen=True)
class _SpecContext:
    version: float
    heads: int | None
    groups: int | None
    hn: int | None
    swiglu: bool | None
    n: int
    m: int


def _spec_for(r: _Raw, c: _SpecContext, vocab: _Vocab) -> PartitionSpec | None:
    """Partition spec of one parameter, with every divisibility check done here."""
    rule, shape, key = r.rule, r.shape, r.key
    if rule.kind in (Kind.REPLICATED, Kind.CARRIED):
        return None
    dim = rule.dim
    if len(shape) <= dim:
        raise CheckpointFormatError(f"rank-{len(shape)} tensor cannot be split on dim {dim}", culprit=key)
    parts, atom = 1, 1
    keep = total = None
    if rule.kind is Kind.QKV:
        parts, atom = _qkv_layout(rule, shape[dim], key, c)
    elif rule.head_dim:
        atom = _proj_atom(shape[dim], key, c)
    if rule.gated and c.swiglu:
        parts = 2
    if rule.vocab and vocab.resized:
        keep, total = vocab.keep, vocab.target_rows
    spec = PartitionSpec(dim=dim, parts=parts, atom=atom, keep=keep, total=total)
    check_divisible(spec, shape[dim], c.n, c.m, key)
    return spec


def _unknown_heads(key: str, c: _SpecContext, what: str) -> None:
    """A merge of whole ranks needs no head facts; any cut inside a rank does."""
    if c.n % c.m:
        raise MissingModelFactError(
            f"splitting {c.n} -> {c.m} ranks must not cut an attention head, but the {what} is unknown "
            f"(no args saved)", culprit=key,
            hint="pass --num-heads H" if what == "head count" else "pass --num-query-groups G")


def _check_groups_divide(key: str, c: _SpecContext, groups: int) -> None:
    if groups % c.m:
        if groups == c.heads:
            raise LayoutError(f"{groups} attention heads cannot be divided over {c.m} target ranks", culprit=key,
                              hint=f"choose a target TP that divides {groups}")
        raise LayoutError(f"{groups} query groups ({c.heads} heads) cannot be divided over {c.m} target ranks; "
                          f"a rank must hold whole groups", culprit=key,
                          hint=f"choose a target TP that divides {groups}")


def _qkv_layout(rule: Rule, rank_rows: int, key: str, c: _SpecContext) -> tuple[int, int]:
    """(parts, atom) of a fused QKV tensor; see the shape table in layouts.py."""
    legacy_ungrouped = rule.qkv is QKVLayout.VERSIONED and c.version in (0.0, 1.0)
    parts = 3 if rule.qkv is QKVLayout.VERSIONED and c.version == 0.0 else 1
    if c.heads is None or c.hn is None:
        _unknown_heads(key, c, "head count")
        return parts, 1
    if legacy_ungrouped:
        if c.groups is not None and c.groups != c.heads:
            raise LayoutError(f"checkpoint_version {c.version} stores QKV without query groups, but the model has "
                              f"{c.groups} groups of {c.heads} heads", culprit=key, hint="check --version")
        if rank_rows * c.n != 3 * c.heads * c.hn:
            raise LayoutError(f"{rank_rows} rows on each of {c.n} ranks do not hold {c.heads} heads of "
                              f"{3 * c.hn} rows", culprit=key, hint="check --num-heads and --version")
        _check_groups_divide(key, c, c.heads)
        return parts, c.hn if parts == 3 else 3 * c.hn
    if c.groups is None:
        _unknown_heads(key, c, "number of query groups")
        return parts, 1
    q = c.heads // c.groups
    atom = (q + 2) * c.hn
    if rank_rows * c.n != c.groups * atom:
        if c.groups == c.heads:
            raise LayoutError(f"{rank_rows} rows on each of {c.n} ranks do not hold {c.heads} heads of "
                              f"{3 * c.hn} rows", culprit=key, hint="check --num-heads and --version")
        raise LayoutError(f"{rank_rows} rows on each of {c.n} ranks do not hold {c.groups} query groups of "
                          f"({q} + 2) x {c.hn} rows", culprit=key,
                          hint="check --num-heads / --num-query-groups")
    _check_groups_divide(key, c, c.groups)
    return parts, atom


def _proj_atom(rank_cols: int, key: str, c: _SpecContext) -> int:
    """Atom of the attention output projection's input dim: one query group's heads."""
    if c.heads is None or c.hn is None:
        _unknown_heads(key, c, "head count")
        return 1
    if rank_cols * c.n != c.heads * c.hn:
        raise LayoutError(f"{rank_cols} rows on each of {c.n} ranks do not hold {c.heads} heads of "
                          f"{c.hn} rows", culprit=key, hint="check --num-heads and --version")
    groups = c.groups if c.groups is not None else (c.heads if c.n % c.m == 0 else None)
    if groups is None:
        _unknown_heads(key, c, "number of query groups")
        return c.hn
    _check_groups_divide(key, c, groups)
    return (c.heads // groups) * c.hn


def _check_replicated(params: list[ParamPlan], stages: list[_Stage]) -> None:
    """Replicated tensors must be bit-identical on every rank: report, don't pick rank 0.
    (Pages read are given back at once: peak memory must not grow with the layer count.)"""
    pages = PageDropper(name for st in stages for name in st.names)
    for p in params:
        if p.spec is not None:
            continue
        st = stages[p.stage]
        ref = st.modules[0][p.src_key]
        for mod, name in zip(st.modules[1:], st.names[1:]):
            if not _bit_equal(ref, mod[p.src_key]):
                raise InconsistentShardsError(
                    f"replicated parameter {p.src_key} differs from rank 0", culprit=name,
                    hint="the ranks diverged during training or come from different checkpoints")
            pages.drop_tensor(mod[p.src_key])
        pages.drop_tensor(ref)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:  # a headers-only plan stands one file in for every rank of its stage
        return True
    a, b = a.contiguous(), b.contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _decide_tied(args: Any, naming: str, params: list[ParamPlan], stages: list[_Stage],
                 origin: dict[str, str], source: SourceCheckpoint) -> bool | None:
    """Whether output and input embeddings are one tensor: ``args.untie_embeddings_and_output_weights``,
    else the structure (PP = 1: an output layer exists only when untied; legacy PP > 1: the head
    copy is named ``word_embeddings_for_head``), else a megatron-core last-stage ``output_layer``
    bit-identical to the word embeddings on every rank (tied weights are kept identical)."""
    keys = {p.key: p for p in params}
    emb = next((p for p in params if p.rule.vocab and p.rule.place is Place.FIRST), None)
    out = next((keys[k] for k in _OUTPUT_KEYS if k in keys), None)
    head = keys.get(TIED_HEAD_KEYS["legacy"])
    untie = _bool_attr(args, "untie_embeddings_and_output_weights")
    if emb is None:
        return None
    if untie is not None:
        origin["tied_embeddings"] = "args"
        tied = not untie
        if source.pp == 1 and (out is None) != tied:
            has = "has none" if out is None else f"has {out.key}"
            raise CheckpointFormatError(f"args.untie_embeddings_and_output_weights={untie} but the checkpoint {has}",
                                        culprit=source.origin, hint="the args do not belong to these tensors")
        return tied
    if head is not None:
        origin["tied_embeddings"] = "structure (word_embeddings_for_head)"
        return True
    if source.pp == 1:
        origin["tied_embeddings"] = "structure (output layer present or not)"
        return out is None
    if out is None:
        return None
    first, last = stages[emb.stage], stages[out.stage]
    same = all(_bit_equal(a[emb.src_key], b[out.src_key]) for a, b in zip(first.modules, last.modules))
    origin["tied_embeddings"] = "tensors (last-stage output layer equals the word embeddings)" if same else \
        "tensors (last-stage output layer differs from the word embeddings)"
    return same


def _place(entries: list[ParamPlan], naming: str, tied: bool | None, layers_per_stage: list[int], spp: int,
           tpp: int, stages: list[_Stage], warnings: list[str], where: str
           ) -> tuple[list[list[TargetParam]], list[int]]:
    """Assign every logical entry to a target stage under its output name (local layer numbers).

    Same PP: every entry stays where the source has it, under its source name. Another PP:
    layers split evenly, embeddings to the first stage, final norm and output to the last; the
    tied head copy is dropped when PP becomes 1 (after checking it equals the embeddings) and
    recreated on the last stage when PP grows from 1."""
    placed: list[list[TargetParam]] = [[] for _ in range(tpp)]
    if tpp == spp:
        for p in entries:
            placed[p.stage].append(TargetParam(out_key=p.src_key, param=p))
        return placed, list(layers_per_stage)
    num_layers = sum(layers_per_stage)
    if num_layers % tpp:
        raise LayoutError(f"{num_layers} layers cannot be split evenly over {tpp} pipeline stages", culprit=where,
                          hint=f"choose a target PP that divides {num_layers}")
    per = num_layers // tpp
    emb = next((p for p in entries if p.rule.vocab and p.rule.place is Place.FIRST), None)
    for p in entries:
        is_head = p.rule.tied_head or (tied and spp > 1 and p.key in _OUTPUT_KEYS and naming == "megatron-core")
        if is_head and tpp == 1:
            if emb is not None and p.spec is not None:
                _check_head_equals_embeddings(p, emb, stages)
            warnings.append(f"dropped {p.key}: the tied copy of the word embeddings is not stored at PP 1")
            continue
        if p.rule.place is Place.FIRST:
            placed[0].append(TargetParam(out_key=p.key, param=p))
        elif p.rule.place is Place.LAST:
            placed[tpp - 1].append(TargetParam(out_key=p.key, param=p))
        else:
            layer = p.layer if p.layer is not None else 0
            placed[layer // per].append(TargetParam(out_key=with_layer(p.key, layer % per), param=p))
    if tied and spp == 1 and tpp > 1 and emb is not None:
        head_key = TIED_HEAD_KEYS[naming]
        last = placed[tpp - 1]
        at = next((i for i, tp in enumerate(last) if tp.out_key.startswith("output_layer.")), len(last))
        last.insert(at, TargetParam(out_key=head_key, param=emb))
    return placed, [per] * tpp


def _check_head_equals_embeddings(head: ParamPlan, emb: ParamPlan, stages: list[_Stage]) -> None:
    a, b = stages[emb.stage], stages[head.stage]
    for ma, mb, name in zip(a.modules, b.modules, b.names):
        if not _bit_equal(ma[emb.src_key], mb[head.src_key]):
            raise InconsistentShardsError(
                f"tied {head.src_key} differs from {emb.src_key}", culprit=name,
                hint="the embeddings are not tied; fix args.untie_embeddings_and_output_weights")


def quant_groups_for(p: ParamPlan, options: ReshardOptions) -> int:
    """Groups per piece: DeepSpeed doubles them for MLP weights with extra grouping."""
    return options.groups * (2 if options.mlp_extra_grouping and p.rule.mlp else 1)


def _check_quantization(plans: list[ParamPlan], options: ReshardOptions, n: int, m: int) -> None:
    for p in plans:  # bits and groups themselves: checked by ReshardOptions
        if p.quant_slot is None:
            continue
        if p.layer is None:
            raise CheckpointFormatError("quantized weight outside a numbered layer", culprit=p.key)
        g = quant_groups_for(p, options)
        row_elems = _elems(p.shape) // p.shape[p.spec.dim]
        part_len = p.shape[p.spec.dim] // p.spec.parts
        for t in range(m):
            for pc in pieces_for_target(part_len, n, m, t):
                numel = pc.length * p.spec.parts * row_elems
                if numel % g:
                    raise LayoutError(f"a {numel}-element piece cannot be quantized in {g} equal groups",
                                      culprit=p.key, hint="choose --groups dividing every weight piece")


def _elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def target_ranks_needed(p: ParamPlan, n: int, m: int, t: int) -> list[int]:
    """Source TP ranks whose rows target TP rank ``t`` copies for ``p`` (empty if all zero fill)."""
    if p.spec is None:
        return []
    part_len = p.shape[p.spec.dim] // p.spec.parts
    return sorted({pc.src for pc in pieces_for_target(part_len, n, m, t, p.spec.keep, p.spec.total)
                   if pc.src != FILL})


def _target_size(p: ParamPlan, n: int, m: int, quantize: bool) -> int:
    if p.dtype is None:
        return 0
    if p.spec is None:
        size = _nbytes(p.shape, p.dtype)
    else:
        rows = p.shape[p.spec.dim] * n if p.spec.total is None else p.spec.total * p.spec.parts
        size = _elems(p.shape) // p.shape[p.spec.dim] * (rows // m) * p.dtype.itemsize
    if quantize and p.quant_slot is not None:
        size //= p.dtype.itemsize
    return size


def _target_plan(stage: int, t: int, params: list[TargetParam], source: SourceCheckpoint,
                 options: ReshardOptions, n: int, m: int, tpp: int) -> TargetPlan:
    base = source_ranks_for_target(n, m, t)[0]
    files: set[int] = set()
    for tp in params:
        p = tp.param
        files.add(source.index(p.stage, base))
        files.update(source.index(p.stage, r) for r in target_ranks_needed(p, n, m, t))
    if not files:
        files.add(source.index(0, base))
    srcs = tuple(sorted(files))
    read = sum(source.files[i].stat().st_size for i in srcs)
    written = sum(_target_size(tp.param, n, m, options.quantize) for tp in params)
    name = get_format(source.format).target_name(source, tp_rank=t, pp_rank=stage, pp=tpp)
    return TargetPlan(rank=stage * m + t, name=name, sources=srcs, bytes_read=read, bytes_written=written,
                      tp_rank=t, pp_rank=stage, base_rank=base, params=tuple(params))

