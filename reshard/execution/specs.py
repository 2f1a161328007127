"""Partition specs: for each parameter of the rule table, how it is split over the target TP
(fused parts, indivisible atoms such as heads or query groups, vocabulary resizing), with every
divisibility check — and, when a target TP is refused, the target TPs that satisfy every tensor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.core.errors import CheckpointFormatError, LayoutError, MissingModelFactError, ReshardError
from reshard.core.layouts import PartitionSpec, check_divisible, pieces_for_target, sectioned
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ParamPlan, elems
from reshard.core.rules import Kind, QKVLayout, Rule
from reshard.models.facts import Vocab

if TYPE_CHECKING:
    from reshard.models.base import ModelFamily

#: Largest target TP tried when listing the ones that would work (a hint, not a limit).
MAX_SUGGESTED_TP = 256


def target_specs(raw: list[CanonicalParam], options: ReshardOptions, args: Any, version: float, heads: int | None,
                 groups: int | None, head_dim: int | None, n: int, m: int, origin: dict[str, str], where: str,
                 family: ModelFamily, padded_for: int | None = None, default_divisor: int | None = None,
                 experts: tuple[int, int | None] | None = None) -> tuple[bool | None, Vocab, list[ParamPlan]]:
    """The facts and partition specs that depend on the target TP ``m``: gated MLP, vocabulary
    padding, and every parameter's spec. A target TP that some tensor cannot be divided over is
    refused with the target TPs that satisfy *every* tensor at once (heads, query groups, FFN
    width, vocabulary rows), so following the hint cannot fail on the next constraint.
    ``experts``: the routed experts' (source, target) TP (see
    :class:`~reshard.core.plan_types.TensorDegrees`; target None: the target TP)."""
    ne, me = experts or (n, None)

    def at(tm: int, facts_origin: dict[str, str]) -> tuple[bool | None, Vocab, list[ParamPlan]]:
        swiglu = family.decide_swiglu(options, args, raw, n, tm, facts_origin, where)
        vocab = family.decide_vocab(options, args, raw, n, tm, facts_origin, where, padded_for, default_divisor)
        def sections(r: CanonicalParam, rank_rows: int, src: int) -> tuple[tuple[int, int], ...]:
            return family.split_sections(r.rule, r.key, rank_rows, src, args)

        ctx = _SpecContext(version, heads, groups, head_dim, swiglu, n, tm, sections)
        expert_ctx = _SpecContext(version, heads, groups, head_dim, swiglu, ne, me or tm, sections)
        return swiglu, vocab, [r.planned(_spec_for(r, ctx, vocab) if not r.rule.expert else
                                         _expert_spec(r, expert_ctx, vocab, me is not None)) for r in raw]

    try:
        return at(m, origin)
    except MissingModelFactError:
        raise
    except LayoutError as err:
        valid = []
        for tm in range(1, MAX_SUGGESTED_TP + 1):
            if me is not None and tm % me:  # the experts' own TP must divide the target TP
                continue
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


def _expert_spec(r: CanonicalParam, c: _SpecContext, vocab: Vocab, own_degree: bool) -> PartitionSpec | None:
    """A routed expert's spec at the expert TP; when that is a degree of its own (not the target
    TP), a split it cannot make names ``--target-etp``, since no target TP would fix it."""
    try:
        return _spec_for(r, c, vocab)
    except LayoutError as err:
        if not own_degree or isinstance(err, MissingModelFactError):
            raise
        raise LayoutError(f"{err.message} (the routed experts' tensor parallelism {c.m})", culprit="--target-etp",
                          hint=f"choose an expert TP that divides the experts' rows ({r.key})") from None


@dataclass(frozen=True)
class _SpecContext:
    version: float
    heads: int | None
    groups: int | None
    hn: int | None
    swiglu: bool | None
    n: int
    m: int
    #: the family's sizes of a sectioned parameter's fused sections (``ModelFamily.split_sections``)
    sections: Callable[[CanonicalParam, int, int], tuple[tuple[int, int], ...]]


def _spec_for(r: CanonicalParam, c: _SpecContext, vocab: Vocab) -> PartitionSpec | None:
    """Partition spec of one parameter, with every divisibility check done here."""
    rule, shape, key = r.rule, r.shape, r.key
    if rule.kind in (Kind.REPLICATED, Kind.CARRIED):
        return None
    dim = rule.dim
    if len(shape) <= dim:
        raise CheckpointFormatError(f"rank-{len(shape)} tensor cannot be split on dim {dim}", culprit=key)
    if rule.sections is not None:
        sized = c.sections(r, shape[dim], c.n)
        spec = sectioned(dim, tuple(rows for rows, _ in sized), tuple(atom for _, atom in sized))
        check_divisible(spec, shape[dim], c.n, c.m, key)
        return spec
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
            hint=("pass --num-heads H" if what == "head count" else "pass --num-query-groups G")
            + ", or the model's config.json with --model-config")


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
    """Atom of the attention output projection's input dim: one query group's heads. Its columns
    are the heads' alone, so a head width the family left unknown is theirs over the heads."""
    if c.heads is None:
        _unknown_heads(key, c, "head count")
        return 1
    hn = c.hn
    if hn is None and rank_cols * c.n % c.heads == 0:
        hn = rank_cols * c.n // c.heads
    if hn is None or rank_cols * c.n != c.heads * hn:
        heads = f"{c.heads} heads of {hn} rows" if hn else f"{c.heads} equal heads"
        raise LayoutError(f"{rank_cols} rows on each of {c.n} ranks do not hold {heads}", culprit=key,
                          hint="check --num-heads and --version")
    groups = c.groups if c.groups is not None else (c.heads if c.n % c.m == 0 else None)
    if groups is None:
        _unknown_heads(key, c, "number of query groups")
        return hn
    _check_groups_divide(key, c, groups)
    return (c.heads // groups) * hn


def quant_groups_for(p: ParamPlan, options: ReshardOptions) -> int:
    """Groups per piece: DeepSpeed doubles them for MLP weights with extra grouping."""
    return options.groups * (2 if options.mlp_extra_grouping and p.rule.mlp else 1)


def check_quantization(plans: list[ParamPlan], options: ReshardOptions, n: int, m: int) -> None:
    for p in plans:  # bits and groups themselves: checked by ReshardOptions
        if p.quant_slot is None:
            continue
        if p.layer is None:
            raise CheckpointFormatError("quantized weight outside a numbered layer", culprit=p.key)
        g = quant_groups_for(p, options)
        row_elems = elems(p.shape) // p.shape[p.spec.dim]
        if p.spec.sections is not None:
            raise LayoutError("a tensor of fused sections of unequal widths cannot be quantized per piece",
                              culprit=p.key, hint="leave out --quantize for this model")
        part_len = p.shape[p.spec.dim] // p.spec.parts
        for t in range(m):
            for pc in pieces_for_target(part_len, n, m, t):
                numel = pc.length * p.spec.parts * row_elems
                if numel % g:
                    raise LayoutError(f"a {numel}-element piece cannot be quantized in {g} equal groups",
                                      culprit=p.key, hint="choose --groups dividing every weight piece")
