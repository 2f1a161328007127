"""Validation of DeepSpeed's ``zero_optimization`` section, with DeepSpeed's own rules.

Why this exists: a checkpoint's ZeRO stage decides whether the tensors in its model-states
files are real weights (stage 0-2) or empty placeholders (stage 3), and a target config that
DeepSpeed would reject must be caught *before* reshard moves gigabytes. The rules mirror the
installed DeepSpeed release (0.19.8): unknown keys are rejected, ``"auto"`` means "use the
default", aliases (``stage3_prefetch_bucket_size``) and bare names (``prefetch_bucket_size``)
are interchangeable but not combinable, and the deprecated spellings are migrated with a
warning. Unlike DeepSpeed, every problem is reported at once, each with its JSON path, the
value found, what is allowed and — for a misspelt key — the closest valid name.

This module is pure: no I/O except ``run_validate_config`` reading one local file, no
storage or orchestration imports, nothing computed at import time.
"""

from __future__ import annotations

import difflib
import enum
import json
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, Union

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from reshard.core.errors import ConfigError, LayoutError

__all__ = [
    "ZeroStage", "OffloadDevice", "OffloadParamConfig", "OffloadOptimizerConfig", "ZenFlowConfig",
    "LeafModuleConfig", "ZeroOptimizationConfig", "ZeroValidation", "ZeroDecision",
    "ZeroPartitionedCheckpointError", "load_deepspeed_config_text", "validate_zero_section",
    "validate_deepspeed_config", "run_validate_config", "decide_conversion",
]

SECTION = "zero_optimization"
_AUTO = "auto"
_HINT = "correct the listed keys; `reshard validate-config FILE` re-checks a config file"


class ZeroStage(int, enum.Enum):
    """ZeRO stages: what is partitioned across data-parallel ranks."""

    DISABLED = 0          # nothing
    OPTIMIZER_STATES = 1  # optimizer states
    GRADIENTS = 2         # + gradients
    WEIGHTS = 3           # + the weights themselves (model-states tensors become placeholders)


class OffloadDevice(str, enum.Enum):
    """Where offloaded tensors live."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


# --------------------------------------------------------------------------- models


def _strip_auto(data: Any) -> Any:
    """DeepSpeed drops every key whose value is the string "auto" (→ default), one level deep."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if not (isinstance(v, str) and v == _AUTO)}
    return data


class _DSModel(BaseModel):
    """Base: strict about keys (like DeepSpeed), lax about scalar spellings (also like DeepSpeed)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=True,
                              validate_default=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _prepare_input(cls, data: Any) -> Any:
        return cls._prepare(data)

    @classmethod
    def _prepare(cls, data: Any) -> Any:
        return _strip_auto(data)


class OffloadParamConfig(_DSModel):
    """``offload_param``: where ZeRO-3 keeps parameters between uses."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: Path | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class OffloadOptimizerConfig(_DSModel):
    """``offload_optimizer``: optimizer states (and the step) on CPU or NVMe."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: Path | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        """True when either NVMe read or write pipelining is on."""
        return bool(self.pipeline_read or self.pipeline_write)


class ZenFlowConfig(_DSModel):
    """``zenflow``: selective (top-k) gradient updates with CPU-side optimizer steps."""

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: str = "auto"
    select_interval: str | int = "auto"
    update_interval: str | int = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    # Filled in by DeepSpeed at run time; accepted but never part of the normalized output.
    steps_per_epoch: int | None = Field(None, exclude=True)

    @field_validator("select_strategy")
    @classmethod
    def _strategy(cls, value: str) -> str:
        if value not in ("auto", "step", "epoch"):
            raise ValueError('must be "auto", "step" or "epoch"')
        return value

    @field_validator("select_interval", "update_interval")
    @classmethod
    def _interval(cls, value: str | int, info: ValidationInfo) -> str | int:
        if isinstance(value, str) and value != "auto":
            raise ValueError('a string here must be "auto"; otherwise give a whole number')
        if info.field_name == "update_interval" and isinstance(value, int) and value < 1:
            raise ValueError("a number here must be at least 1")
        return value


_DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(_DSModel):
    """``leaf_module``: modules ZeRO-3 fetches as one unit (no per-submodule hooks)."""

    classes: list[str] = Field(default_factory=lambda: list(_DEFAULT_LEAF_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @classmethod
    def _prepare(cls, data: Any) -> Any:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ValueError("leaf_module must be a JSON object with classes/names/name_suffixes")
        data = _strip_auto(data)
        # A single string is shorthand for a one-element list.
        return {k: ([v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v)
                for k, v in data.items()}

    @model_validator(mode="after")
    def _dedupe(self) -> LeafModuleConfig:
        for name in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, name, list(dict.fromkeys(str(x) for x in getattr(self, name))))
        return self


class ZeroOptimizationConfig(_DSModel):
    """The ``zero_optimization`` section, field for field as DeepSpeed 0.19.8 defines it.

    Validating a dict directly migrates deprecated keys (with a ``UserWarning``); use
    :func:`validate_zero_section` to get every problem at once and the deprecation messages.
    """

    stage: ZeroStage = ZeroStage.DISABLED
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool | None = None  # null/absent → (stage == 3), resolved below
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: ZenFlowConfig | None = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @classmethod
    def _prepare(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data, notes, problems = _migrate_deprecated(_strip_auto(data), "")
        if problems:
            raise ValueError("; ".join(problems))
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=4)
        return data

    @model_validator(mode="after")
    def _resolve_and_cross_check(self, info: ValidationInfo) -> ZeroOptimizationConfig:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == ZeroStage.WEIGHTS)
        if not (info.context or {}).get("reshard_defer_cross_checks"):
            ratio = self.offload_optimizer.ratio if self.offload_optimizer is not None else None
            problems = _cross_field_problems(self.stage, ratio, self.compute_grad_norm, "")
            if problems:
                raise ValueError("; ".join(problems))
        return self


# --------------------------------------------------------------------------- rule tables

# Deprecated key → (replacement field, how the old value becomes the new one). ``None`` as the
# replacement means: warn only (DeepSpeed keeps the value but nothing reads it).
_DEPRECATED: dict[str, tuple[str | None, Any]] = {
    "cpu_offload_param": ("offload_param", lambda v: {"device": "cpu"} if v else None),
    "cpu_offload_use_pin_memory": (None, None),
    "cpu_offload": ("offload_optimizer", lambda v: {"device": "cpu"} if v else None),
    "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", lambda v: v),
}
# The old keys are typed like this in DeepSpeed (the last one does not accept null).
_DEPRECATED_TYPES: dict[str, Any] = {
    "cpu_offload_param": bool | None, "cpu_offload_use_pin_memory": bool | None,
    "cpu_offload": bool | None, "stage3_gather_fp16_weights_on_model_save": bool,
}

# Keys DeepSpeed 0.19.8 refuses with a dedicated message (features it deleted).
_REMOVED: dict[str, str] = {
    "mics_shard_size": "MiCS ZeRO-3 sharding was removed from DeepSpeed",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed from DeepSpeed",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed from DeepSpeed (plain ZeRO++ quantized gradients remain)",
}

# Top-level DeepSpeed keys: their presence marks a dict as a whole config, not a ZeRO section.
_TOP_LEVEL_HINTS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "fp16", "bf16", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
    "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "allgather_size", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "data_types", "checkpoint", "aio", "pipeline", "tensor_parallel",
})


def _field_for_key(model: type[BaseModel], key: str) -> tuple[str, Any] | None:
    """(field name, FieldInfo) for a key given by bare name or alias."""
    for name, info in model.model_fields.items():
        if key == name or (info.alias and key == info.alias):
            return name, info
    return None


def _valid_keys(model: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        if info.alias:
            keys.append(info.alias)
        keys.append(name)
    if model is ZeroOptimizationConfig:
        keys.extend(_DEPRECATED)
    return keys


def _is_zero_key(key: str) -> bool:
    return key in _valid_keys(ZeroOptimizationConfig) or key in _REMOVED


# --------------------------------------------------------------------------- message helpers


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _suggest(key: str, candidates: list[str]) -> str | None:
    lowered = {c.lower(): c for c in candidates}
    if key.lower() in lowered:
        return lowered[key.lower()]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    return close[0] if close else None


def _unknown_key_problem(path: str, key: str, value: Any, model: type[BaseModel]) -> str:
    candidates = _valid_keys(model)
    best = _suggest(key, candidates)
    text = f"{_join(path, key)} = {_show(value)}: unknown key"
    if best:
        return f"{text}; did you mean '{best}'?"
    if len(candidates) <= 16:
        return f"{text}; allowed keys: {', '.join(candidates)}"
    return f"{text}; no similar key exists in DeepSpeed's {model.__name__.replace('Config', '')} settings"


def _bounds(info: Any) -> str:
    ge = gt = le = lt = None
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            ge = item.ge
        elif isinstance(item, annotated_types.Gt):
            gt = item.gt
        elif isinstance(item, annotated_types.Le):
            le = item.le
        elif isinstance(item, annotated_types.Lt):
            lt = item.lt
    if ge is not None and le is not None:
        return f" from {ge:g} to {le:g}"
    parts = []
    if ge is not None:
        parts.append(f">= {ge:g}")
    if gt is not None:
        parts.append(f"> {gt:g}")
    if le is not None:
        parts.append(f"<= {le:g}")
    if lt is not None:
        parts.append(f"< {lt:g}")
    return (" " + " and ".join(parts)) if parts else ""


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != len(typing.get_args(annotation)):
            # the remaining members, a list known only at run time: ``X | Y`` cannot spell that
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return annotation, False


def _describe(info: Any) -> str:
    """What a field accepts, in words a config author understands."""
    base, optional = _unwrap_optional(info.annotation)
    if base is bool:
        text = "true or false"
    elif base is int:
        text = f"a whole number{_bounds(info)} (5e8 is fine, 5.5 is not)"
    elif base is float:
        text = f"a number{_bounds(info)}"
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        text = "one of " + ", ".join(_show(m.value) for m in base)
    elif base is Path:
        text = "a filesystem path string"
    elif isinstance(base, type) and issubclass(base, BaseModel):
        text = "a JSON object"
    elif typing.get_origin(base) is list:
        text = "a list of strings (or one string)"
    elif typing.get_origin(base) in (Union, types.UnionType):
        text = '"auto" or a whole number'
    elif base is str:
        text = "a string"
    else:  # pragma: no cover - every field type is listed above
        text = str(base)
    if optional:
        text = text.replace("true or false", "true, false") + " or null"
    return text


def _loc_target(model: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, Any]:
    """Walk an error location: (model holding the last key, FieldInfo of the last key or None)."""
    current: type[BaseModel] | None = model
    info = None
    for i, part in enumerate(loc):
        if current is None or not isinstance(part, str):
            return None, None
        found = _field_for_key(current, part)
        if found is None:
            return (current, None) if i == len(loc) - 1 else (None, None)
        info = found[1]
        if i == len(loc) - 1:
            return current, info
        base, _ = _unwrap_optional(info.annotation)
        current = base if isinstance(base, type) and issubclass(base, BaseModel) else None
    return current, info


def _pydantic_problems(err: ValidationError, model: type[BaseModel], path: str) -> list[str]:
    problems = []
    for item in err.errors(include_url=False):
        loc = tuple(part for part in item["loc"] if part not in ("function-after", "function-before"))
        where = path
        for part in loc:
            where = _join(where, part)
        value = item.get("input")
        if item["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            owner, _ = _loc_target(model, loc[:-1] + ("__missing__",))
            parent = path
            for part in loc[:-1]:
                parent = _join(parent, part)
            problems.append(_unknown_key_problem(parent, loc[-1], value, owner or model))
            continue
        msg = item["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
        _, info = _loc_target(model, loc) if loc else (None, None)
        # Our own rule messages (value_error) already say what is allowed.
        allowed = f"; allowed: {_describe(info)}" if info is not None and item["type"] != "value_error" else ""
        if not loc or (info is not None and _describe(info).startswith("a JSON object")
                       and item["type"] not in ("model_type", "dict_type")):
            problems.append(f"{where}: {msg}")  # a rule about the object as a whole
        else:
            problems.append(f"{where} = {_show(value)}: {msg}{allowed}")
    return problems


def _cross_field_problems(stage: Any, ratio: float | None, compute_grad_norm: Any, path: str) -> list[str]:
    """DeepSpeed's cross-field rules (it stops at the first; we list all)."""
    problems = []
    if ratio is not None and stage is not None and ratio < 1.0 and int(stage) != ZeroStage.WEIGHTS:
        problems.append(
            f"{_join(_join(path, 'offload_optimizer'), 'ratio')} = {_show(ratio)}: partial optimizer offload "
            f"(ratio < 1) is only supported with ZeRO stage 3, but stage is {int(stage)}; "
            "allowed: ratio 1.0 (or leave it out) for stages 0-2, or set stage to 3")
    if compute_grad_norm is False and stage is not None and int(stage) not in (1, 2):
        problems.append(
            f"{_join(path, 'compute_grad_norm')} = false: only supported with ZeRO stage 1 or 2, "
            f"but stage is {int(stage)}; allowed: true (or leave it out), or use stage 1/2")
    return problems


def _try_field(model: type[BaseModel], name: str, raw: Any) -> tuple[bool, Any]:
    info = model.model_fields[name]
    annotation = typing.Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    try:
        return True, TypeAdapter(annotation).validate_python(raw)
    except ValidationError:
        return False, None


def _migrate_deprecated(data: dict, path: str) -> tuple[dict, list[str], list[str]]:
    """Replace deprecated keys by their successors. Returns (data, deprecation notes, problems)."""
    data = dict(data)
    notes: list[str] = []
    problems: list[str] = []
    for old, (new, convert) in _DEPRECATED.items():
        if old not in data:
            continue
        value = data.pop(old)
        old_path = _join(path, old)
        try:
            value = TypeAdapter(_DEPRECATED_TYPES[old]).validate_python(value)
        except ValidationError as exc:
            allowed = "true or false" if _DEPRECATED_TYPES[old] is bool else "true, false or null"
            problems.append(f"{old_path} = {_show(value)}: {exc.errors()[0]['msg']}; allowed: {allowed}")
            continue
        if new is None:
            notes.append(f"{old_path} is deprecated and has no effect; remove it and set pin_memory "
                         "inside offload_param / offload_optimizer instead")
            continue
        info = ZeroOptimizationConfig.model_fields[new]
        given = [k for k in (new, info.alias) if k and k in data]
        if given:
            problems.append(f"{old_path} = {_show(value)}: deprecated spelling of {_join(path, given[0])}, "
                            f"and both are set; allowed: only {_join(path, new)} (remove {old})")
            continue
        data[new] = convert(value)
        notes.append(f"{old_path} is deprecated; use {_join(path, new)} "
                     f"(migrated: {new} = {_show(data[new])})")
    return data, notes, problems


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ZeroValidation:
    """A valid ZeRO section: every field with its effective value, plus what was deprecated."""

    normalized: dict[str, Any]
    deprecations: list[str]
    model: ZeroOptimizationConfig
    warnings: list[str] = field(default_factory=list)

    @property
    def stage(self) -> int:
        """The effective ZeRO stage (0-3)."""
        return int(self.model.stage)


class ZeroPartitionedCheckpointError(LayoutError):
    """The source was saved with ZeRO-3: its model-states tensors are partition placeholders."""


@dataclass(frozen=True)
class ZeroDecision:
    """Whether model-states weights can be resharded, and what the target config says.

    ``verify_full_tensors`` is set for ZeRO-3 sources saved with
    ``gather_16bit_weights_on_model_save``: that flag makes DeepSpeed write a consolidated
    16-bit file, so the pipeline must still confirm that the tensors it reads are not the
    empty per-rank placeholders.
    """

    source_stage: int
    source_gathered_16bit: bool
    verify_full_tensors: bool
    target: ZeroValidation | None
    notes: tuple[str, ...] = ()

    @property
    def target_stage(self) -> int | None:
        """The target's ZeRO stage, or None when no target config was given."""
        return None if self.target is None else self.target.stage


# --------------------------------------------------------------------------- public API


def _raise(problems: list[str], path: str, source: str | None) -> typing.NoReturn:
    count = len(problems)
    noun = "problem" if count == 1 else "problems"
    raise ConfigError(f"{count} {noun} in {path or 'ZeRO config'}: " + "; ".join(problems),
                      problems=problems, culprit=source, hint=_HINT)


def load_deepspeed_config_text(text: str, source: str) -> dict:
    """Parse a DeepSpeed JSON config, refusing duplicate keys (JSON would silently keep the last)."""

    class _Obj(dict):
        __slots__ = ("duplicates",)

    def hook(pairs: list[tuple[str, Any]]) -> dict:
        obj = _Obj()
        obj.duplicates = []
        for key, value in pairs:
            if key in obj:
                obj.duplicates.append(key)
            obj[key] = value
        return obj

    try:
        parsed = json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                          problems=[f"line {exc.lineno} column {exc.colno}: {exc.msg}"], culprit=source,
                          hint="reshard reads strict JSON: no comments or trailing commas") from None

    duplicates: list[str] = []

    def plain(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            for key in getattr(node, "duplicates", ()):
                duplicates.append(_join(path, key))
            return {k: plain(v, _join(path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [plain(v, _join(path, i)) for i, v in enumerate(node)]
        return node

    result = plain(parsed, "")
    if duplicates:
        unique = list(dict.fromkeys(duplicates))
        problems = [f"{p}: key appears more than once (DeepSpeed rejects duplicate keys)" for p in unique]
        raise ConfigError(f"duplicate JSON key{'s' if len(unique) > 1 else ''}: {', '.join(unique)}",
                          problems=problems, culprit=source, hint="keep one occurrence of each key")
    if not isinstance(result, dict):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, found {type(result).__name__}",
                          problems=["<root>: not a JSON object"], culprit=source,
                          hint='wrap the settings in { ... }')
    return result


def validate_zero_section(section: dict | bool | None, path: str = SECTION, *,
                          root: dict | None = None, source: str | None = None) -> ZeroValidation:
    """Validate one ``zero_optimization`` value exactly as DeepSpeed would, reporting all problems.

    ``section`` is the value of the key (``None`` = key absent → all defaults; ``true/false`` =
    DeepSpeed's deprecated boolean form, which reads ``allgather_size`` from ``root``, the
    whole config). Raises :class:`ConfigError` listing every problem.
    """
    notes: list[str] = []
    problems: list[str] = []
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    if section is None:
        data: dict = {}
    elif isinstance(section, bool):
        notes.append(f"{path} = {_show(section)} is DeepSpeed's deprecated boolean form; write "
                     f'{{"stage": {1 if section else 0}}} instead')
        data = {"stage": 1 if section else 0}
        if section:
            raw = (root or {}).get("allgather_size", 500_000_000)
            if not (isinstance(raw, str) and raw == _AUTO):
                ok, value = _try_field(ZeroOptimizationConfig, "allgather_bucket_size", raw)
                if ok:
                    data["allgather_bucket_size"] = value
                else:
                    info = ZeroOptimizationConfig.model_fields["allgather_bucket_size"]
                    problems.append(f"{_join(parent, 'allgather_size')} = {_show(raw)}: used as "
                                    f"{path}.allgather_bucket_size by the boolean form; allowed: {_describe(info)}")
    elif isinstance(section, dict):
        data = _strip_auto(section)
    else:
        _raise([f"{path} = {_show(section)}: not a JSON object; allowed: an object of ZeRO settings, "
                "or true/false (deprecated)"], path, source)

    for key in [k for k in data if k in _REMOVED]:
        problems.append(f"{_join(path, key)} = {_show(data.pop(key))}: {_REMOVED[key]}; allowed: remove this key")
    for name, info in ZeroOptimizationConfig.model_fields.items():
        if info.alias and info.alias in data and name in data:
            problems.append(f"{_join(path, name)} = {_show(data[name])} and {_join(path, info.alias)} = "
                            f"{_show(data[info.alias])}: the same setting under two names; allowed: only one of them")
            data.pop(name)
    data, dep_notes, dep_problems = _migrate_deprecated(data, path)
    notes.extend(dep_notes)
    problems.extend(dep_problems)

    model: ZeroOptimizationConfig | None = None
    context = {"reshard_defer_cross_checks": True}
    try:
        model = ZeroOptimizationConfig.model_validate(data, context=context)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, ZeroOptimizationConfig, path))

    if model is not None:
        stage, ratio, cgn = model.stage, (model.offload_optimizer.ratio if model.offload_optimizer else None), \
            model.compute_grad_norm
    else:  # judge the cross-field rules on whichever of their inputs are valid on their own
        ok, stage = _try_field(ZeroOptimizationConfig, "stage", data.get("stage", 0))
        stage = stage if ok else None
        ratio = None
        offload = data.get("offload_optimizer")
        if isinstance(offload, dict):
            offload = _strip_auto(offload)
            if "ratio" in offload:
                ok, ratio = _try_field(OffloadOptimizerConfig, "ratio", offload["ratio"])
                ratio = ratio if ok and 0.0 <= ratio <= 1.0 else None
        ok, cgn = _try_field(ZeroOptimizationConfig, "compute_grad_norm", data.get("compute_grad_norm", True))
        cgn = cgn if ok else None
    problems.extend(_cross_field_problems(stage, ratio, cgn, path))

    if problems or model is None:
        _raise(problems, path, source)
    if model.elastic_checkpoint and model.stage == ZeroStage.WEIGHTS:
        notes.append(f"{_join(path, 'elastic_checkpoint')} = true: ZeRO-3 elastic checkpointing is no longer "
                     "supported by DeepSpeed (use Universal Checkpointing)")
    normalized = model.model_dump(mode="json")
    return ZeroValidation(normalized=normalized, deprecations=notes, model=model)


def _split_config(config: dict) -> tuple[bool, Any]:
    """(is the ZeRO key present, ZeRO value) for a whole config or a bare ZeRO section."""
    if SECTION in config:
        return True, config[SECTION]
    if any(_is_zero_key(k) for k in config):
        return True, config  # a bare section
    if config and not set(config) & _TOP_LEVEL_HINTS:
        return True, config  # unrecognised keys only: judge it as a section so they get reported
    return False, None


def validate_deepspeed_config(config: dict, *, source: str | None = None) -> ZeroValidation:
    """Validate the ZeRO part of a whole DeepSpeed config (other sections are not checked)."""
    if not isinstance(config, dict):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, found {type(config).__name__}",
                          problems=["<root>: not a JSON object"], culprit=source, hint="wrap the settings in { ... }")
    extra: list[str] = []
    if SECTION in config:
        section = config[SECTION]
        if section is None or not isinstance(section, (dict, bool)):
            _raise([f"{SECTION} = {_show(section)}: DeepSpeed cannot read this (it needs an object); "
                    "allowed: an object of ZeRO settings, or true/false (deprecated)"], SECTION, source)
    else:
        section = None
        for key in config:
            if key != SECTION and _suggest(key, [SECTION]) == SECTION:
                extra.append(f"{key}: not a DeepSpeed key; did you mean '{SECTION}'? "
                             "(DeepSpeed ignores it, so ZeRO is off)")
    result = validate_zero_section(section, SECTION, root=config, source=source)
    return ZeroValidation(result.normalized, result.deprecations, result.model, result.warnings + extra)


def run_validate_config(path: str, as_json: bool, out: TextIO | None = None) -> int:
    """``reshard validate-config FILE [--json]``: check a DeepSpeed config before a job uses it.

    Prints the normalized ZeRO section and any deprecations; returns 0. Invalid input raises
    :class:`ConfigError` (the CLI prints one line and exits 2). ``out`` defaults to the
    current ``sys.stdout`` (looked up at call time, so redirection works).
    """
    out = sys.stdout if out is None else out
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the config file: {exc.strerror or exc}", problems=[str(exc)],
                          culprit=path, hint="check the path and that the file is UTF-8 JSON") from None
    result = validate_deepspeed_config(load_deepspeed_config_text(text, path), source=path)
    if as_json:
        json.dump({"valid": True, "source": path, "stage": result.stage, SECTION: result.normalized,
                   "deprecations": result.deprecations, "warnings": result.warnings}, out, indent=2)
        out.write("\n")
        return 0
    out.write(f"{path}: valid ZeRO config (stage {result.stage})\n")
    for note in result.deprecations:
        out.write(f"deprecated: {note}\n")
    for note in result.warnings:
        out.write(f"warning: {note}\n")
    out.write(f"{SECTION}:\n")
    for key, value in result.normalized.items():
        out.write(f"  {key}: {json.dumps(value)}\n")
    return 0


def _source_facts(ds_config: Any) -> tuple[int, bool, list[str]]:
    """Stage and gather flag of the config saved in a checkpoint; lenient about everything else.

    The saved config was accepted by whatever DeepSpeed wrote the checkpoint (maybe another
    release), so only the two facts reshard depends on must be readable; other problems
    become notes.
    """
    where = f"ds_config.{SECTION}"
    if ds_config is None:
        return 0, False, ["no ds_config in the checkpoint: treated as ZeRO disabled (stage 0)"]
    if not isinstance(ds_config, dict):
        raise ConfigError(f"the checkpoint's ds_config is a {type(ds_config).__name__}, not a config object; "
                          "its ZeRO stage cannot be determined", problems=[f"ds_config = {_show(ds_config)}"],
                          culprit="ds_config", hint="pass the training run's DeepSpeed config explicitly")
    present, section = _split_config(ds_config)
    if not present:
        return 0, False, []
    if isinstance(section, bool):
        return (1 if section else 0), False, []
    if not isinstance(section, dict):
        raise ConfigError(f"{where} = {_show(section)} is not an object; the ZeRO stage cannot be determined",
                          problems=[f"{where} = {_show(section)}"], culprit=where,
                          hint="pass the training run's DeepSpeed config explicitly")
    data = _strip_auto(section)
    ok, stage = _try_field(ZeroOptimizationConfig, "stage", data.get("stage", 0))
    if not ok:
        raise ConfigError(f"{where}.stage = {_show(data.get('stage'))} is not a ZeRO stage (0-3); refusing to "
                          "guess whether the weights are partitioned", problems=[f"{where}.stage"],
                          culprit=f"{where}.stage", hint="pass the training run's DeepSpeed config explicitly")
    gathered = False
    for key in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        if key in data:
            ok, flag = _try_field(ZeroOptimizationConfig, "gather_16bit_weights_on_model_save", data[key])
            gathered = gathered or (ok and bool(flag))
    notes = []
    try:
        validate_zero_section(section, where)
    except ConfigError as exc:
        notes.append("the checkpoint's ZeRO config does not pass DeepSpeed 0.19.8's rules (tolerated: it was "
                     "written by the DeepSpeed that saved it): " + "; ".join(exc.problems))
    return int(stage), gathered, notes


def decide_conversion(ds_config: dict | None, target_config: dict | None = None, *,
                      allow_zero3_target: bool = False, weights_elsewhere: str | None = None) -> ZeroDecision:
    """Decide, before any transfer, whether the source's model states hold real weights.

    ``ds_config`` is the config DeepSpeed saved in the model-states dict (whole config or bare
    ZeRO section); ``target_config`` is the config the resharded checkpoint will be loaded
    with. Stage 0-2 sources are fine; stage 3 is refused (the tensors are placeholders) unless
    it was saved with ``gather_16bit_weights_on_model_save``, or the weights the conversion reads
    are not the placeholders (``weights_elsewhere`` says where they are: the optimizer's fp32
    master weights under ``--weights master``, or whole module tensors of a checkpoint converted
    since). An invalid target config, or one that cannot load a model-states checkpoint, raises
    :class:`ConfigError`.
    """
    stage, gathered, notes = _source_facts(ds_config)
    verify = False
    if stage == ZeroStage.WEIGHTS and weights_elsewhere:
        notes.append(f"ZeRO-3 config: accepted, {weights_elsewhere}")
    elif stage == ZeroStage.WEIGHTS:
        if not gathered:
            raise ZeroPartitionedCheckpointError(
                "the source checkpoint was saved with ZeRO stage 3, so the tensors in its "
                "mp_rank_*_model_states.pt files are empty placeholders: the real weights are partitioned "
                "across the data-parallel ranks in zero_pp_rank_*_optim_states.pt files, and "
                "gather_16bit_weights_on_model_save was off; reshard refuses rather than write empty weights",
                culprit=f"ds_config.{SECTION}.stage",
                hint="pass --weights master to convert the optimizer's fp32 master weights (as DeepSpeed's "
                     "zero_to_fp32.py would consolidate them), or re-save from training with "
                     f"{SECTION}.gather_16bit_weights_on_model_save=true")
        verify = True
        notes.append("ZeRO-3 source saved with gather_16bit_weights_on_model_save: accepted, but every "
                     "model-states tensor must be checked to be non-empty before it is used")
    target = None
    if target_config is not None:
        if not isinstance(target_config, dict):
            raise ConfigError(f"the target config must be an object, found {type(target_config).__name__}",
                              problems=[f"<target> = {_show(target_config)}"], culprit="target config",
                              hint="pass a DeepSpeed config dict")
        present, section = _split_config(target_config)
        if SECTION in target_config:
            target = validate_deepspeed_config(target_config, source="target config")
        else:
            target = validate_zero_section(section if present else None, SECTION, root=target_config,
                                           source="target config")
        if target.stage == ZeroStage.WEIGHTS and not allow_zero3_target:
            _raise([f"{SECTION}.stage = 3: a ZeRO-3 engine restores weights from zero_pp_rank_* partition "
                    "files (engine.load_checkpoint → get_fp32_state_dict_from_zero_checkpoint), which a "
                    "resharded model-states checkpoint does not contain; allowed: stage 0, 1 or 2 for the "
                    "target"], SECTION, "target config")
    return ZeroDecision(source_stage=int(stage), source_gathered_16bit=gathered, verify_full_tensors=verify,
                        target=target, notes=tuple(notes))
