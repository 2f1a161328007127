"""Resolve a source checkpoint and options into a validated plan before any byte is written.

Everything that can be wrong with the input is found here: rank files, module key, version,
key sets, shapes and dtypes across ranks, replicated tensors that differ, unknown parameter
names, head counts and dimensions that do not divide. The engine then only executes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.errors import (CheckpointFormatError, InconsistentShardsError, LayoutError,
                                 MissingModelFactError)
from reshard.core.layouts import PartitionSpec, check_divisible, pieces_for_target, source_ranks_for_target
from reshard.core.rules import LEGACY_GPT_RULES, Kind, QuantSlot, Rule, layer_index, resolve
from reshard.core.safe_load import load_shard
from reshard.core.source import AUTO, SourceCheckpoint, choose_module_key, locate, parse_version, rank_file_name

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


@dataclass(frozen=True)
class ReshardOptions:
    """What the user asked for. Only these affect the output bytes (besides the source)."""

    target_tp: int
    version: float | None = None
    module_key: str = AUTO
    num_heads: int | None = None
    quantize: bool = False
    bits: int = 8
    groups: int = 64
    mlp_extra_grouping: bool = True

    def to_record(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ParamPlan:
    """One module parameter: its rule, per-source-rank shape, and partition spec."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: PartitionSpec | None
    layer: int | None

    @property
    def quant_slot(self) -> QuantSlot | None:
        return self.rule.quant


@dataclass(frozen=True)
class TargetPlan:
    """One output file: its rank, its path relative to the destination, which source ranks
    feed it and the bytes it moves. Writers iterate these; they never build names themselves."""

    rank: int
    name: str
    sources: tuple[int, ...]
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class Plan:
    source: SourceCheckpoint
    options: ReshardOptions
    module_key: str
    version: float
    num_heads: int | None
    hidden: int | None
    params: tuple[ParamPlan, ...]
    targets: tuple[TargetPlan, ...]
    unused_rules: tuple[str, ...]
    dropped: dict[str, str]
    ds_config: dict[str, Any] | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def source_tp(self) -> int:
        return self.source.tp

    @property
    def target_tp(self) -> int:
        return self.options.target_tp

    @property
    def peak_memory_estimate(self) -> int:
        """Bytes held at once by the engine: one target rank's tensors plus one source tensor."""
        largest_src = max((_nbytes(p.shape, p.dtype) for p in self.params), default=0)
        return max((t.bytes_written for t in self.targets), default=0) + largest_src


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return _elems(shape) * dtype.itemsize


def _int_attr(args: Any, name: str) -> int | None:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def build_plan(src: str | SourceCheckpoint, options: ReshardOptions) -> Plan:
    """Validate the source fully and decide every tensor's fate (reads shard metadata,
    and replicated tensors to check they agree)."""
    source = src if isinstance(src, SourceCheckpoint) else locate(src)
    n, m = source.tp, options.target_tp
    if not isinstance(m, int) or m < 1:
        raise LayoutError(f"target TP {m!r} must be a positive integer", culprit="--target-tp")
    shards = [load_shard(f) for f in source.files]
    names = [str(f) for f in source.files]

    module_key = choose_module_key(shards[0], options.module_key, names[0])
    modules = []
    for sd, name in zip(shards, names):
        if choose_module_key(sd, options.module_key, name) != module_key:
            raise InconsistentShardsError(f"module is not under {module_key!r} as on rank 0", culprit=name)
        mod = sd[module_key]
        if not isinstance(mod, dict):
            raise CheckpointFormatError(f"{module_key!r} is a {type(mod).__name__}, not a state dict",
                                        culprit=name)
        bad = [k for k, v in mod.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointFormatError(f"module entries that are not tensors: {bad[:5]}", culprit=name)
        mws = sd.get("mp_world_size")
        if mws is not None and mws != n:
            raise CheckpointFormatError(f"saved mp_world_size is {mws} but {n} rank files were found",
                                        culprit=name, hint="supply all rank files of the checkpoint (and no extra)")
        modules.append(mod)

    _check_same_keys(modules, names)
    version = _decide_version(shards, names, source, options)
    args = shards[0].get("args")
    resolution = resolve(modules[0].keys(), LEGACY_GPT_RULES, source=source.origin)

    hidden = _int_attr(args, "hidden_size")
    num_heads = _decide_heads(options, args, source.origin)
    params = []
    for key, t0 in modules[0].items():
        for mod, name in zip(modules[1:], names[1:]):
            t = mod[key]
            if t.shape != t0.shape or t.dtype != t0.dtype:
                raise InconsistentShardsError(
                    f"{key}: shape/dtype {tuple(t.shape)}/{t.dtype} differs from rank 0's "
                    f"{tuple(t0.shape)}/{t0.dtype}", culprit=name, hint="all rank files must come from one checkpoint")
        rule = resolution.by_key[key]
        if rule.kind is Kind.QKV and rule.quant is QuantSlot.QKV and t0.dim() == 2 and hidden is None:
            hidden = int(t0.shape[1])
        params.append((key, rule, tuple(t0.shape), t0.dtype))

    plans = [ParamPlan(key, rule, shape, dtype, _spec_for(rule, shape, key, version, num_heads, hidden, n, m),
                       layer_index(key)) for key, rule, shape, dtype in params]
    _check_replicated(plans, modules, names)
    if options.quantize:
        _check_quantization(plans, options, n, m)
    targets = tuple(_target_plan(t, plans, source, options, n, m) for t in range(m))
    dropped = {k: DROPPED_ENTRIES[k] for k in shards[0] if k in DROPPED_ENTRIES}
    ds_config = shards[0].get("ds_config")
    warnings = tuple(f"dropped {k!r}: {why}" for k, why in dropped.items())
    return Plan(source, options, module_key, version, num_heads, hidden, tuple(plans), targets,
                resolution.unused_rules, dropped, copy.deepcopy(ds_config) if isinstance(ds_config, dict) else None,
                warnings)


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
    if options.num_heads is not None:
        if options.num_heads < 1:
            raise LayoutError(f"--num-heads {options.num_heads} must be positive", culprit="--num-heads")
        if saved is not None and saved != options.num_heads:
            raise LayoutError(f"--num-heads {options.num_heads} contradicts the saved "
                              f"args.num_attention_heads={saved}", culprit=where,
                              hint="drop --num-heads or correct it")
        return options.num_heads
    return saved


def _spec_for(rule: Rule, shape: tuple[int, ...], key: str, version: float, heads: int | None,
              hidden: int | None, n: int, m: int) -> PartitionSpec | None:
    """Partition spec of one parameter, with every divisibility check done here."""
    if rule.kind is Kind.REPLICATED:
        return None
    dim = rule.dim
    if len(shape) <= dim:
        raise CheckpointFormatError(f"rank-{len(shape)} tensor cannot be split on dim {dim}", culprit=key)
    parts = 3 if (rule.kind is Kind.QKV and version == 0.0) else 1
    atom = 1
    if rule.head_dim:
        if heads is None:
            if n % m:
                raise MissingModelFactError(
                    f"splitting {n} -> {m} ranks must not cut an attention head, but the head count "
                    f"is unknown (no args.num_attention_heads saved)", culprit=key,
                    hint="pass --num-heads H")
        else:
            if hidden is None or hidden % heads:
                raise LayoutError(f"hidden size {hidden} is not divisible by {heads} heads", culprit=key,
                                  hint="check --num-heads")
            hn = hidden // heads
            per_head = 3 * hn if rule.kind is Kind.QKV else hn
            if shape[dim] * n != heads * per_head:
                raise LayoutError(f"{shape[dim]} rows on each of {n} ranks do not hold {heads} heads of "
                                  f"{per_head} rows", culprit=key, hint="check --num-heads and --version")
            if heads % m:
                raise LayoutError(f"{heads} attention heads cannot be divided over {m} target ranks",
                                  culprit=key, hint=f"choose a target TP that divides {heads}")
            atom = hn if rule.kind is not Kind.QKV or parts == 3 else 3 * hn
    spec = PartitionSpec(dim=dim, parts=parts, atom=atom)
    check_divisible(spec, shape[dim], n, m, key)
    return spec


def _check_replicated(plans: list[ParamPlan], modules: list[dict[str, Any]], names: list[str]) -> None:
    """Replicated tensors must be bit-identical on every rank: report, don't pick rank 0."""
    for p in plans:
        if p.spec is not None:
            continue
        ref = modules[0][p.key]
        for mod, name in zip(modules[1:], names[1:]):
            if not _bit_equal(ref, mod[p.key]):
                raise InconsistentShardsError(
                    f"replicated parameter {p.key} differs from rank 0", culprit=name,
                    hint="the ranks diverged during training or come from different checkpoints")


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def quant_groups_for(p: ParamPlan, options: ReshardOptions) -> int:
    """Groups per piece: DeepSpeed doubles them for MLP weights with extra grouping."""
    return options.groups * (2 if options.mlp_extra_grouping and p.rule.mlp else 1)


def _check_quantization(plans: list[ParamPlan], options: ReshardOptions, n: int, m: int) -> None:
    if not 1 <= options.bits <= 8:
        raise LayoutError(f"--bits {options.bits} does not fit int8", culprit="--bits", hint="use 1..8")
    if options.groups < 1:
        raise LayoutError(f"--groups {options.groups} must be positive", culprit="--groups")
    for p in plans:
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


def _target_plan(t: int, plans: list[ParamPlan], source: SourceCheckpoint, options: ReshardOptions,
                 n: int, m: int) -> TargetPlan:
    srcs = tuple(source_ranks_for_target(n, m, t))
    read = sum(f.stat().st_size for i, f in enumerate(source.files) if i in srcs)
    written = 0
    for p in plans:
        full = _nbytes(p.shape, p.dtype)
        size = full if p.spec is None else full * n // m
        if options.quantize and p.quant_slot is not None:
            size = size // p.dtype.itemsize
        written += size
    return TargetPlan(t, rank_file_name(t), srcs, read, written)
