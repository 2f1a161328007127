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
the word embeddings (under the name the family gives it, ``ModelFamily.tied_head_keys``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from reshard.core.checks import check_replicated
from reshard.core.compressed_tensors_out import SCHEMES as CT_SCHEMES
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError
from reshard.core.experts import check_expert_ranks, check_expert_tp, rank_files
from reshard.core.lazy import LazyTensor
from reshard.core.options import ReshardOptions, flag_of
from reshard.core.pipeline_stages import StageLayout
from reshard.core.plan_types import (
    DROPPED_ENTRIES,
    CanonicalParam,
    ModelFacts,
    ParamPlan,
    Plan,
    SourceRead,
    SourceStage,
    TensorDegrees,
    dropped_warning,
)
from reshard.core.rules import STAGE_COPY, Kind, Place, Resolution, Rule, with_layer
from reshard.core.safe_load import refuse_foreign_entries
from reshard.core.source import SourceCheckpoint
from reshard.execution import adapter_merge
from reshard.execution.placement import by_pipeline_rank, place, split_files, target_plan
from reshard.execution.specs import check_quantization, target_specs
from reshard.formats.output import carried_files, output_format
from reshard.formats.registry import get_format
from reshard.models import ModelFamily, claiming_family, resolve_family
from reshard.models.facts import Vocab, decide_version, int_arg
from reshard.models.megatron_gpt import expert_index, experts_per_layer, rank_experts, with_expert

if TYPE_CHECKING:
    from reshard.formats.base import CheckpointFormat


def build_grid_plan(source: SourceCheckpoint, options: ReshardOptions, target_pp: int | None, *,
                    headers_only: bool = False) -> Plan:
    """The plan of a checkpoint whose files form a (stage, TP rank) grid of module dicts
    (DeepSpeed ``mp_rank_XX`` files, Megatron-LM folders) at target PP ``target_pp`` (None: the
    source's stages, or one where the output has none); see
    :func:`reshard.execution.planner.build_plan`, which validates the degrees and picks the planner.

    ``headers_only``: read just the first rank file of each pipeline stage and take it as
    every rank of its stage. The layout (specs, targets, sources) then equals the full plan's
    whenever the full checks pass, so a pipeline can start converting a target as soon as its
    own sources arrive and run the cross-rank checks (``headers_only=False``) alongside —
    publishing nothing until they pass."""
    n, m = source.tp, options.target_tp
    fmt = get_format(source.format)  # reads the files
    out_fmt = output_format(source, options)  # names and writes the outputs
    out_fmt.check_source(source, options)
    if (weights := out_fmt.read_weights(source, options)) != options.weights:
        options = options.model_copy(update={"weights": weights})
    read = adapter_merge.read(fmt, source, options, headers_only=headers_only)
    source = read.source or source  # rows read as the saved args say (stages or expert-parallel ranks)
    tpp = (source.pipeline_ranks if out_fmt.writes_pipeline_stages else 1) if target_pp is None else target_pp
    out_fmt.check_target(tpp)
    version = decide_version(read.shards, read.names, source, options)
    keys = canonical_keys(read)
    built = claiming_family(keys, source.origin).expert_tp(keys)
    tetp = _target_etp(source, options, out_fmt, built)
    d = decide_parameters(read, options, version, source, fmt, tetp)
    stages, params, carried = read.stages, d.params, d.carried
    tied = d.family.decide_tied(read.args, d.naming, params, stages, d.origin, source)
    warnings: list[str] = [d.vocab.warning] if d.vocab.warning else []
    if built is not None and out_fmt.per_rank and options.target_etp is None and built != m:
        warnings.append(f"experts at expert tensor parallelism {built} (TP {m} elsewhere): megatron-core builds "
                        "mixture-of-experts layers with linear biases at that degree only")
    order = {r.key: i for i, r in enumerate(sorted(d.raw + d.carried_raw, key=lambda r: r.order))}
    entries = sorted(params + carried, key=lambda p: order[p.key])  # source order, stage by stage
    source_stages = _source_stages(read.args, d.layers_per_stage, source)
    target_stages = _target_stages(source_stages, options, tpp, out_fmt)
    placed = by_pipeline_rank(place(entries, d.family, d.naming, tied, d.layers_per_stage, target_stages, stages,
                                    warnings, source.origin, source.ep), target_stages)
    if options.quantize == "fp8" and not out_fmt.holds_fp8:
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout has no place for FP8 block-scaled weights",
                          culprit="--quantize fp8", hint="write a Hugging Face folder (--to hf)")
    if options.quantize == "mxfp4" and not out_fmt.holds_mxfp4:
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout has no place for MXFP4 weights",
                          culprit="--quantize mxfp4", hint="write a Hugging Face folder (--to hf)")
    if options.quantize in CT_SCHEMES and not out_fmt.holds_compressed_tensors:
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout has no place for compressed-tensors' "
                          "quantized weights", culprit=f"--quantize {options.quantize}",
                          hint="write a Hugging Face folder (--to hf)")
    if options.quantize == "like-source" and not out_fmt.holds_like_source:
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout has no place for a release's quantized "
                          "weights", culprit="--quantize like-source", hint="write a Hugging Face folder (--to hf)")
    if options.int8:
        check_quantization(params, options, n, m)
    experts = experts_per_layer([p.key for p in params], source.origin, int_arg(read.args, "num_experts"))
    tep = _target_ep(experts, source, options, out_fmt)
    if not experts and options.target_etp is not None:
        raise LayoutError("the model has no experts to split over an expert tensor-parallel degree",
                          culprit="--target-etp", hint="drop --target-etp")
    degrees = TensorDegrees(n, m, source.expert_tp, tetp or m)
    grid = [(s, e, t) for s in range(tpp) for e, t in
            ((e, t) for t, e in rank_files(m, degrees.target_etp, tep))]  # every pair unless ETP < TP
    targets = tuple(target_plan(s, t, rank_experts(placed[s], e, tep, experts), source, options, degrees, tpp,
                                out_fmt.name, rank=i, ep_rank=e, ep=tep) for i, (s, e, t) in enumerate(grid))
    if not out_fmt.per_rank and len(targets) == 1:
        held = {w: _held(fmt, source, options, w, read.module_key) for w in out_fmt.weight_sets(options)}
        targets = split_files(targets[0], source, options, degrees, tpp, out_fmt.name,
                              held or {options.weights: None})
        targets += tuple(replace(target_plan(0, 0, [], source, options, degrees, tpp, out_fmt.name, name=name,
                                             rank=len(targets) + i), bytes_written=size)
                         for i, (name, size) in enumerate(out_fmt.object_targets(source, options).items()))
    kept = out_fmt.kept_entries(source)
    dropped = {k: DROPPED_ENTRIES[k] for k in read.shards[0] if k in DROPPED_ENTRIES and k not in kept}
    ds_config = read.shards[0].get("ds_config")
    copied, lost = carried_files(source, out_fmt)
    warnings = dropped_warning(dropped) + warnings + list(read.warnings) + lost
    facts = d.model_facts(tied, tuple(d.layers_per_stage), target_stages.counts)
    extra = out_fmt.extra_files(source)
    plan = Plan(source=source, options=options, module_key=read.module_key, version=version, params=tuple(params),
                targets=targets, unused_rules=d.resolution.unused_rules, dropped=dropped, facts=facts,
                ds_config=copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings=tuple(warnings), carried=tuple(carried), target_pp=tpp, output_format=out_fmt.name,
                extra_files=extra, copied_files=copied, target_etp=tetp if experts else None,
                source_stages=source_stages,
                target_stages=target_stages)
    return plan


def _source_stages(args: Any, layers: list[int], source: SourceCheckpoint) -> StageLayout:
    """The source's pipeline stages: the layers its files hold per model chunk, which must be
    what its saved Megatron-LM ``args`` make megatron-core build (uneven first/last stages, the
    embedding/loss accounting, a layout string, virtual stages); without such args, as the files
    hold them."""
    ranks, chunks = source.pipeline_ranks, source.chunks
    num_layers = int_arg(args, "num_layers")
    if args is None or num_layers is None or len(layers) != source.pp or \
            int_arg(args, "pipeline_model_parallel_size") not in (None, ranks):  # torch_dist: stages of its run
        return StageLayout(ranks, chunks, tuple(layers), where=source.origin)
    saved = StageLayout.from_args(args, num_layers, ranks, f"{source.origin} (saved args)")
    if saved.vpp != chunks:
        raise CheckpointFormatError(f"the saved args say {saved.vpp} virtual pipeline stage(s) but the files hold "
                                    f"{chunks} model chunk(s)", culprit=source.origin,
                                    hint="the saved args do not describe these files")
    if saved.counts != tuple(layers):
        at = next(s for s, (a, b) in enumerate(zip(saved.counts, layers)) if a != b)
        p, v = saved.chunk(at)
        chunk = f"model chunk (pipeline rank {p}, virtual stage {v})" if chunks > 1 else f"pipeline stage {p}"
        raise CheckpointFormatError(f"{chunk} holds {layers[at]} layers; the saved args ({saved.describe()}) give "
                                    f"it {saved.counts[at]}", culprit=source.origin,
                                    hint="the saved args do not describe these files (a stage file from another "
                                         "layout?)")
    return saved


def _target_stages(source: StageLayout, options: ReshardOptions, pp: int, out_fmt: CheckpointFormat
                   ) -> StageLayout:
    """The output's pipeline stages: the source's when it keeps the pipeline ranks and nothing else
    is asked; else from ``--target-vpp`` (default: the source's at the same PP, else 1) and the
    uneven-stage flags (default at the same PP: the source's uneven first/last stages or
    accounting), as megatron-core builds them."""
    vpp, first, last = options.target_vpp, options.target_first_stage_layers, options.target_last_stage_layers
    layout = options.target_pipeline_layout
    given = [flag_of(n) for n, v in (("target_vpp", vpp), ("target_first_stage_layers", first),
                                     ("target_last_stage_layers", last), ("target_pipeline_layout", layout))
             if v is not None]
    if not out_fmt.writes_pipeline_stages and any(f != flag_of("target_vpp") or vpp != 1 for f in given):
        flag = next(f for f in given if f != flag_of("target_vpp") or vpp != 1)
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout has no pipeline stages", culprit=flag,
                          hint=f"drop {flag}")
    if layout is not None and "m" in layout:
        raise LayoutError(f"pipeline layout {layout!r} places layers beside the stack (m)",
                          culprit=flag_of("target_pipeline_layout"),
                          hint="write it without m: reshard places the layers beside the stack itself (on the last "
                               "stage)")
    if pp == 1 and (first is not None or last is not None):
        flag = flag_of("target_first_stage_layers" if first is not None else "target_last_stage_layers")
        raise LayoutError("uneven first/last stages need more than one pipeline rank", culprit=flag,
                          hint=f"drop {flag}, or pass --target-pp")
    if pp == source.pp and vpp in (None, source.vpp) and first is None and last is None and layout is None:
        return source
    emb = loss = False
    if pp == source.pp and first is None and last is None and layout is None:  # only the virtual stages change
        if source.layout:
            raise LayoutError(f"the source's stages are a layout string ({source.layout!r}), which another number "
                              f"of virtual stages cannot keep", culprit=flag_of("target_vpp"),
                              hint="give the output's stages with --target-pipeline-layout")
        first, last, emb, loss = source.first, source.last, source.account_embedding, source.account_loss
    if vpp is None and layout is None:
        vpp = source.vpp if pp == source.pp else 1
    where = next((flag_of(n) for n, v in (("target_pipeline_layout", layout), ("target_first_stage_layers", first),
                                           ("target_last_stage_layers", last), ("target_vpp", options.target_vpp))
                  if v is not None and flag_of(n) in given), "--target-pp")
    return StageLayout.build(source.num_layers, pp, vpp or 1, first=first, last=last, account_embedding=emb,
                             account_loss=loss, layout=layout, where=where)


def _target_ep(experts: dict[int | None, int], source: SourceCheckpoint, options: ReshardOptions,
               out_fmt: CheckpointFormat) -> int:
    """The output's expert-parallel degree: ``--target-ep``, else the source's (1 in a layout of
    global tensors); refused where the output cannot hold experts, they do not divide, or
    ``--quantize`` would leave them out."""
    if experts and not out_fmt.holds_experts:
        raise LayoutError(f"this is a mixture-of-experts model; the {out_fmt.title or out_fmt.name} layout cannot "
                          f"hold its experts here", culprit=source.origin,
                          hint="write Megatron-LM per-rank files (--to megatron)")
    if experts and options.int8:
        raise LayoutError("int8 quantization covers a dense layer's four weights (DeepSpeed's scheme); it has no "
                          "place for experts", culprit="--quantize",
                          hint="drop --quantize for a mixture-of-experts model")
    default = source.ep if out_fmt.per_rank else 1
    tep = default if options.target_ep is None else options.target_ep
    if tep != 1 and not experts:
        raise LayoutError(f"the model has no experts to place on {tep} expert-parallel ranks", culprit="--target-ep",
                          hint="drop --target-ep (or pass 1)")
    if tep != 1 and not out_fmt.per_rank:
        raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout holds global tensors; it has no "
                          f"expert-parallel degree", culprit="--target-ep", hint="drop --target-ep")
    check_expert_ranks(experts, tep, "--target-ep")
    return tep


def _target_etp(source: SourceCheckpoint, options: ReshardOptions, out_fmt: CheckpointFormat,
                built: int | None = None) -> int | None:
    """The output's expert TP: ``--target-etp``, else the one the model is built at (``built``, the
    family's :meth:`~reshard.models.base.ModelFamily.expert_tp`; another ``--target-etp`` is refused),
    else the source's when it splits its experts apart from its TP, else None (the target TP). A
    layout of global tensors has none; a per-rank one holds an expert TP dividing the TP
    (:func:`~reshard.core.experts.check_expert_tp`)."""
    m = options.target_tp
    if built is not None and options.target_etp not in (None, built):
        raise LayoutError(f"megatron-core builds this model's experts at expert tensor parallelism {built} only "
                          f"(mixture-of-experts layers with linear biases), not {options.target_etp}",
                          culprit="--target-etp", hint=f"pass --target-etp {built}, or drop it ({built} is the "
                                                       "default for this model)")
    if not out_fmt.per_rank:
        if options.target_etp not in (None, 1):
            raise LayoutError(f"the {out_fmt.title or out_fmt.name} layout holds global tensors; it has no expert "
                              f"tensor-parallel degree", culprit="--target-etp", hint="drop --target-etp")
        return None
    tetp = options.target_etp if built is None else built
    if tetp is None and source.expert_tp != source.tp:
        tetp = source.expert_tp
        check_expert_tp(tetp, m, "--target-tp", f"pass --target-etp (a divisor of {m}) or a target TP that "
                                                f"{tetp} divides")
    if tetp is not None:
        check_expert_tp(tetp, m, "--target-etp", f"choose --target-etp among the divisors of the target TP {m}")
    return None if tetp == m else tetp


def _held(fmt: CheckpointFormat, source: SourceCheckpoint, options: ReshardOptions, weights: str, module_key: str
          ) -> dict[tuple[int, str], torch.dtype] | None:
    """The ``(stage, file key)`` of the tensors the source's module holds when read as ``weights``,
    with their dtype (Adam moments exist for trained parameters only, in fp32; None: all, as
    planned). Read from the first file of each stage, lazily."""
    if weights == options.weights:
        return None
    other = options.model_copy(update={"weights": weights})
    return {(s, key): value.dtype for s in range(source.rows)
            for key, value in adapter_merge.opened(fmt, source, other, s * source.tp)[module_key].items()
            if isinstance(value, (torch.Tensor, LazyTensor))}


@dataclass(frozen=True, kw_only=True)
class DecidedParams:
    """What both planners decide alike from a :class:`SourceRead`: the model family and its naming,
    the canonical parameters (tensors and carried entries), layers per row, the model facts the
    partitioning needs (with ``origin``), and each tensor's partition spec (``params``)."""

    family: ModelFamily
    naming: str
    resolution: Resolution
    raw: list[CanonicalParam]
    carried_raw: list[CanonicalParam]
    layers_per_stage: list[int]
    origin: dict[str, str]
    hidden: int | None
    heads: int | None
    head_dim: int | None
    groups: int | None
    swiglu: bool | None
    vocab: Vocab
    params: list[ParamPlan]
    family_facts: dict[str, Any]

    @property
    def carried(self) -> list[ParamPlan]:
        """The carried entries as plan entries (no partition spec)."""
        return [r.planned(None) for r in self.carried_raw]

    def model_facts(self, tied: bool | None, source_layers: tuple[int, ...], target_layers: tuple[int, ...]
                    ) -> ModelFacts:
        v = self.vocab
        return ModelFacts(naming=self.naming, num_layers=sum(self.layers_per_stage), hidden=self.hidden,
                          heads=self.heads, query_groups=self.groups, head_dim=self.head_dim, swiglu=self.swiglu,
                          tied_embeddings=tied, vocab_size=v.true, padded_vocab_source=v.source_rows,
                          padded_vocab_target=v.target_rows, make_vocab_size_divisible_by=v.divisible_by,
                          source_pp_layers=source_layers, target_pp_layers=target_layers, origin=dict(self.origin),
                          family_facts=dict(self.family_facts))


def canonical_keys(read: SourceRead) -> list[str]:
    """Every canonical parameter name of the rows ``read`` holds, in their order, once."""
    return list(dict.fromkeys(st.canonical_name(k) for st in read.module_rows for k in st.modules[0]))


def decide_parameters(read: SourceRead, options: ReshardOptions, version: float, source: SourceCheckpoint,
                      fmt: CheckpointFormat, target_etp: int | None = None) -> DecidedParams:
    """Resolve the canonical names against the family that claims them, collect the canonical
    parameters, decide the model facts through the family's deciders, give every tensor its
    partition spec at the target TP (a routed expert's at the target expert TP, ``target_etp``; None:
    the target TP) and check the replicated tensors agree across ranks."""
    n, m, args = source.tp, options.target_tp, read.args
    rows = read.module_rows
    for st in rows:
        for name, module in zip(st.names, st.modules):
            refuse_foreign_entries(module, name)
    all_keys = canonical_keys(read)
    family, resolution = resolve_family(all_keys, source=source.origin)
    raw, carried_raw, layers_per_stage = collect(rows, resolution.by_key, source, family)
    num_layers = sum(layers_per_stage)
    saved_layers = int_arg(args, "num_layers")
    if saved_layers is not None and saved_layers != num_layers:
        raise CheckpointFormatError(f"args.num_layers is {saved_layers} but the files hold {num_layers} transformer "
                                    f"layers", culprit=source.origin,
                                    hint="supply every file of the checkpoint (a pipeline stage or layer file is "
                                         "missing)")
    origin: dict[str, str] = {}
    hidden, heads, head_dim = family.decide_heads(options, args, raw, origin, source.origin)
    groups = family.decide_groups(options, args, heads, raw, head_dim, n, origin, source.origin)
    own = family.decide_family_facts(options, args, raw, origin, source.origin)
    swiglu, vocab, params = target_specs(raw, options, args, version, heads, groups, head_dim, n, m, origin,
                                         source.origin, family, fmt.padding_tp(args, source), fmt.vocab_divisor,
                                         experts=(source.expert_tp, target_etp))
    check_replicated(params, read.stages, source.expert_tp)
    return DecidedParams(family=family, naming=family.naming(all_keys), resolution=resolution, raw=raw,
                         carried_raw=carried_raw, layers_per_stage=layers_per_stage, origin=origin, hidden=hidden,
                         heads=heads, head_dim=head_dim, groups=groups, swiglu=swiglu, vocab=vocab, params=params,
                         family_facts=own)


def collect(stages: list[SourceStage], by_key: Mapping[str, Rule], source: SourceCheckpoint, family: ModelFamily
            ) -> tuple[list[CanonicalParam], list[CanonicalParam], list[int]]:
    """The canonical parameters of every row (the stack's layers, as ``family`` tells them, renumbered
    globally; each found in its files under the file's own key), shapes and dtypes checked across
    ranks. A stage that keeps its own copy of the first stage's entries (``family.keeps_stage_copy``)
    holds them under :data:`~reshard.core.rules.STAGE_COPY` names, placed last."""
    tensors: list[CanonicalParam] = []
    carried: list[CanonicalParam] = []
    layers_per_stage: list[int] = []
    seen: dict[str, int] = {}
    offsets: dict[int, int] = {}  # pipeline stage -> its first layer's global number
    orders: dict[int, _Order] = {}
    staged = len({st.stage for st in stages}) > 1
    for st in stages:
        if st.stage not in offsets:  # a stage's first row (EP rank 0) numbers its layers and orders its entries
            local = sorted({i for i in (family.layer_index(st.canonical_name(k)) for k in st.modules[0])
                            if i is not None})
            if staged and local != list(range(len(local))):
                raise CheckpointFormatError(f"pipeline stage {st.stage} numbers its layers {local[:8]}, not 0..k-1",
                                            culprit=st.names[0],
                                            hint="each stage's file must number its layers locally")
            offsets[st.stage] = sum(layers_per_stage)
            layers_per_stage.append(len(local) if staged else (max(local) + 1 if local else 0))
            orders[st.stage] = _Order(list(st.modules[0]), sum(len(o.pos) for o in orders.values()), family)
        offset, order = offsets[st.stage], orders[st.stage]
        copies = family.keeps_stage_copy(st.canonical_name(k) for k in st.modules[0])
        for key, v0 in st.modules[0].items():
            name = st.canonical_name(key)
            rule = by_key[name]
            li = family.layer_index(name)
            glob = None if li is None else li + offset
            logical = name if glob is None or not staged else with_layer(name, glob)
            if logical in seen and copies and rule.place is Place.FIRST:
                logical, rule = logical + STAGE_COPY, replace(rule, place=Place.LAST)  # see STAGE_COPY
            if logical in seen:
                raise CheckpointFormatError(f"{logical} is held by rows {seen[logical]} and {st.index} of the grid",
                                            culprit=source.origin,
                                            hint="pipeline stages must hold disjoint parameters (a Megatron-LM "
                                                 "mp_rank_TT_NNN folder is an expert-parallel rank only when the "
                                                 "saved args say expert_model_parallel_size)")
            seen[logical] = st.index
            if rule.kind is Kind.CARRIED:  # opaque per-rank state (TE fp8 meta): never compared
                shape, dtype = (tuple(v0.shape), v0.dtype) if isinstance(v0, torch.Tensor) else ((), None)
                carried.append(CanonicalParam(key=logical, rule=rule, shape=shape, dtype=dtype, layer=glob,
                                              stage=st.index, src_key=key, order=order.of(key, name)))
                continue
            if not isinstance(v0, (torch.Tensor, LazyTensor)):
                raise CheckpointFormatError(f"module entry {key} is a {type(v0).__name__}, not a tensor",
                                            culprit=st.names[0])
            for mod, file in zip(st.modules[1:], st.names[1:]):
                t = mod[key]
                if not isinstance(t, (torch.Tensor, LazyTensor)) or t.shape != v0.shape or t.dtype != v0.dtype:
                    what = (f"{tuple(t.shape)}/{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise InconsistentShardsError(
                        f"{key}: shape/dtype {what} differs from rank 0's {tuple(v0.shape)}/{v0.dtype}",
                        culprit=file, hint="all rank files must come from one checkpoint")
            tensors.append(CanonicalParam(key=logical, rule=rule, shape=tuple(v0.shape), dtype=v0.dtype, layer=glob,
                                          stage=st.index, src_key=key, order=order.of(key, name)))
    return tensors, carried, layers_per_stage


class _Order:
    """Output order of one pipeline stage's entries: its first row's file order, each layer's
    experts (from every EP rank) by global number where that row has its local experts."""

    def __init__(self, keys: list[str], start: int, family: ModelFamily) -> None:
        self.pos = {k: start + i for i, k in enumerate(keys)}
        self.block: dict[int | None, int] = {}
        self.family = family
        for k in keys:
            if expert_index(k) is not None:
                self.block.setdefault(family.layer_index(k), self.pos[k])

    def of(self, key: str, name: str) -> tuple[int, int, int]:
        """The order of file key ``key`` (canonical ``name``)."""
        g = expert_index(name)
        if g is None:
            return (self.pos[key], -1, 0)
        return (self.block[self.family.layer_index(key)], g, self.pos[with_expert(key, 0)])
