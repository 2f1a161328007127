"""Pipeline placement and output files: which target stage (model chunk) holds each parameter
(layers renumbered per stage, embeddings first, final norm and output layer last, the tied head
copy on the last stage), which pipeline rank's files hold each chunk, which source files each
output reads, its bytes, and its name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from reshard.core.checks import check_copy_equals
from reshard.core.errors import LayoutError
from reshard.core.layouts import FILL, part_segments, source_ranks_for_target
from reshard.core.options import ReshardOptions
from reshard.core.pipeline_stages import StageLayout
from reshard.core.plan_types import ParamPlan, SourceStage, TargetParam, TargetPlan, TensorDegrees, elems, nbytes
from reshard.core.rules import STAGE_COPY, Place, with_layer
from reshard.core.source import SourceCheckpoint
from reshard.formats.registry import get_format
from reshard.models import ModelFamily


def place(entries: list[ParamPlan], family: ModelFamily, naming: str, tied: bool | None,
          source_layers: Sequence[int], target: StageLayout, stages: list[SourceStage], warnings: list[str],
          where: str, ep: int = 1) -> list[list[TargetParam]]:
    """Assign every logical entry to a target stage (a model chunk, see
    :mod:`reshard.core.pipeline_stages`) under its output name (local layer numbers).

    Stages of the source's sizes (``source_layers``: layers per source stage): every entry stays
    where the source has it, under its source name. Else: each layer to the stage ``target``
    gives it, embeddings to the first stage, final norm and output to the last; the tied head
    copy is dropped when the target has one stage (after checking it equals the embeddings) and
    recreated on the last stage when the source had one. So are the stage copies of the first
    stage's entries that the family keeps on the stage of its layers beside the stack (the last),
    first in that stage (:data:`~reshard.core.rules.STAGE_COPY`,
    :meth:`~reshard.models.base.ModelFamily.keeps_stage_copy`). (``ep``: the source's expert-parallel
    rows per stage; which target EP rank holds an expert is decided per target, see
    :func:`reshard.models.megatron_gpt.rank_experts`.)"""
    spp, tpp = len(source_layers), target.stages
    placed: list[list[TargetParam]] = [[] for _ in range(tpp)]
    if tuple(source_layers) == target.counts:
        for p in entries:
            placed[p.stage // ep].append(TargetParam(out_key=p.src_key, param=p))
        return placed
    emb = next((p for p in entries if p.rule.vocab and p.rule.place is Place.FIRST), None)
    copy, copy_of = family.stage_copy_words
    stage_copies: list[TargetParam] = []
    for p in entries:
        if p.key.endswith(STAGE_COPY):  # a later stage's copy of a first-stage entry: at the last stage's front
            original = next(e for e in entries if e.key == p.key.removesuffix(STAGE_COPY))
            if tpp == 1:
                check_copy_equals(p, original, stages, copy,
                                  "the pipeline stages' embeddings must be equal, as megatron-core keeps them")
                warnings.append(f"dropped {p.src_key} of the last pipeline stage: {copy_of} is not stored at PP 1")
            else:
                stage_copies.append(TargetParam(out_key=original.key, param=p))
            continue
        is_head = p.rule.tied_head or (tied and spp > 1 and p.key == family.tied_head_keys.get(naming)
                                       and p.key in family.output_keys)
        if is_head and tpp == 1:
            if emb is not None and p.spec is not None:
                check_copy_equals(p, emb, stages, "tied", "the embeddings are not tied; fix "
                                  "args.untie_embeddings_and_output_weights")
            warnings.append(f"dropped {p.key}: the tied copy of the word embeddings is not stored at PP 1")
            continue
        if p.rule.place is Place.FIRST:
            placed[0].append(TargetParam(out_key=p.key, param=p))
        elif p.rule.place is Place.LAST:
            placed[tpp - 1].append(TargetParam(out_key=p.key, param=p))
        else:
            stage, local = target.stage_of(p.layer if p.layer is not None else 0)
            placed[stage].append(TargetParam(out_key=with_layer(p.key, local), param=p))
    if tpp > 1 and not stage_copies and family.keeps_stage_copy(p.key for p in entries):  # from the first stage's
        stage_copies = [TargetParam(out_key=p.key, param=p) for p in entries if p.rule.place is Place.FIRST]
    placed[tpp - 1][:0] = stage_copies  # first on the stage that keeps them, as megatron-core builds it
    if tied and spp == 1 and tpp > 1 and emb is not None:
        head_key = family.tied_head_keys.get(naming)
        if head_key is None:
            raise LayoutError(f"the {family.name} family names no copy of tied embeddings for the last pipeline "
                              f"stage under {naming} names", culprit=where,
                              hint="keep the pipeline stages (drop --target-pp), or give the family tied_head_keys")
        last = placed[tpp - 1]
        module = head_key.rsplit(".", 1)[0] + "."  # before the entries of the head's module (its extra state)
        at = next((i for i, tp in enumerate(last) if tp.out_key.startswith(module)), len(last))
        last.insert(at, TargetParam(out_key=head_key, param=emb))
    return placed


def by_pipeline_rank(placed: list[list[TargetParam]], target: StageLayout) -> list[list[TargetParam]]:
    """The entries of each target pipeline rank's files: its chunks' (``placed``: per stage) in
    virtual-stage order, each entry marked with its chunk."""
    return [[replace(tp, chunk=v) if v else tp for v in range(target.vpp) for tp in placed[v * target.pp + p]]
            for p in range(target.pp)]


def target_ranks_needed(p: ParamPlan, n: int, m: int, t: int) -> list[int]:
    """Source TP ranks whose rows target TP rank ``t`` copies for ``p`` (empty if all zero fill)."""
    if p.spec is None:
        return []
    return sorted({src for src, _, _ in part_segments(p.spec, p.shape[p.spec.dim], n, m, t) if src != FILL})


def target_size(p: ParamPlan, n: int, m: int, quantize: bool) -> int:
    if p.dtype is None:
        return 0
    if p.spec is None:
        size = nbytes(p.shape, p.dtype)
    else:
        rows = p.shape[p.spec.dim] * n if p.spec.total is None else p.spec.total * p.spec.parts
        size = elems(p.shape) // p.shape[p.spec.dim] * (rows // m) * p.dtype.itemsize
    if quantize and p.quant_slot is not None:
        size //= p.dtype.itemsize
    return size


def target_plan(stage: int, t: int, params: list[TargetParam], source: SourceCheckpoint,
                options: ReshardOptions, degrees: TensorDegrees, tpp: int, output_format: str, *,
                name: str | None = None, rank: int | None = None, weights: str | None = None, ep_rank: int = 0,
                ep: int = 1) -> TargetPlan:
    """Output file (stage, EP rank ``ep_rank``, TP rank ``t``) holding ``params``: the source files
    it reads (each parameter's pieces at its own degrees, see :class:`TensorDegrees`), its bytes and name."""
    base = source_ranks_for_target(degrees.tp, degrees.target_tp, t)[0]
    files: set[int] = set()
    for tp in params:
        p = tp.param
        n, m = degrees.of(p.rule)
        slice_ = degrees.rank(p.rule, t)
        files.add(source.index(p.stage, source_ranks_for_target(n, m, slice_)[0]))
        files.update(source.index(p.stage, r) for r in target_ranks_needed(p, n, m, slice_))
    if not files:
        files.add(source.index(0, base))
    srcs = tuple(sorted(files))
    read = sum(f.stat().st_size for f in {source.files[i] for i in srcs}) + sum(f.stat().st_size for f in source.aux)
    fmt = get_format(output_format)
    keys = frozenset(tp.out_key for tp in params)
    written = sum(fmt.stored_bytes(tp.out_key, target_size(tp.param, *degrees.of(tp.param.rule), options.int8),
                                   tp.param.dtype, options, keys) for tp in params)
    if name is None:
        experts = {"ep_rank": ep_rank, "ep": ep} if ep > 1 else {}
        name = fmt.target_name(source, tp_rank=t, pp_rank=stage, pp=tpp, **experts)
    return TargetPlan(rank=stage * degrees.target_tp + t if rank is None else rank, name=name, sources=srcs,
                      bytes_read=read, bytes_written=written, tp_rank=t, pp_rank=stage, ep_rank=ep_rank,
                      base_rank=base, params=tuple(params), weights=weights)


def split_files(target: TargetPlan, source: SourceCheckpoint, options: ReshardOptions, degrees: TensorDegrees,
                tpp: int, output_format: str, held: Mapping[str, Mapping[tuple[int, str], torch.dtype] | None]
                ) -> tuple[TargetPlan, ...]:
    """The one target of a layout of global tensors, as the files its format cuts it into
    (:meth:`~reshard.formats.base.CheckpointFormat.split`), for each set of weights it is written
    from (``held``: weights -> the ``(stage, file key)`` of the parameters they hold and their dtype
    there, None: all, as planned):
    each file a target of its own, so every writer, the flow's per-target caching and the manifest
    handle them unchanged."""
    fmt = get_format(output_format)
    out: list[TargetPlan] = []
    for weights, dtypes in held.items():
        params = list(target.params) if dtypes is None else [
            replace(tp, param=replace(tp.param, dtype=dtypes[at])) for tp in target.params
            if (at := (tp.param.stage, tp.param.src_key)) in dtypes]
        keys = frozenset(tp.out_key for tp in target.params)  # the whole model: a layout of global tensors
        sizes = [fmt.stored_bytes(tp.out_key, target_size(tp.param, *degrees.of(tp.param.rule), options.int8),
                                  tp.param.dtype, options, keys) for tp in params]
        files = fmt.split(target.name, [tp.out_key for tp in params], sizes, options, weights)
        if len(held) == 1 and dtypes is None and files == [(target.name, 0, len(params))]:
            return (target,)
        own = None if weights == options.weights else weights
        out += [target_plan(target.pp_rank, target.tp_rank, params[a:b], source, options, degrees, tpp, output_format,
                            name=name, rank=len(out) + i, weights=own)
                for i, (name, a, b) in enumerate(files)]
    return tuple(out)
