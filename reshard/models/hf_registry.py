"""Hugging Face architectures as plug-ins: one object per ``transformers`` class, owning all that
reshard knows of it — its name table both ways (:attr:`HFArchitectureFamily.names`), how its
``config.json`` reads as Megatron-LM's ``args`` and model facts (:meth:`~HFArchitectureFamily.read_config`,
import), and how a megatron-core model is written as it (:meth:`~HFArchitectureFamily.export`, for
``--to hf --hf-architecture NAME``).

A new architecture is one module: a subclass registered with :func:`register_hf_architecture` or
through the entry-point group ``reshard.hf_architectures``. The ``hf`` format, the import of
``--model-config`` and the export ask this registry; none of them names an architecture. The
built-ins (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-2) are instances of
one class over the data of :mod:`reshard.models.hf_architectures` and :mod:`reshard.models.hf_import`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import (
    TOKEN_IDS_ARG,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    decide_architecture,
    sliding_window,
    token_ids,
)
from reshard.plugins import PluginRegistry

#: Built-in architectures, as "module:instance" (imported on first use).
BUILTIN: tuple[str, ...] = tuple(f"reshard.models.hf_import:{name}" for name in (
    "LLAMA", "MISTRAL", "QWEN2", "QWEN3", "MIXTRAL", "QWEN2_MOE", "QWEN3_MOE", "GPT2")) + (
    "reshard.models.deepseek:DEEPSEEK_V3",)
ENTRY_POINT_GROUP = "reshard.hf_architectures"

_ARCHITECTURES: PluginRegistry[HFArchitectureFamily] = PluginRegistry(
    "Hugging Face architecture", HFArchitectureFamily, BUILTIN, ENTRY_POINT_GROUP)
#: Read-only view of the registered architectures (transformers class name -> architecture).
registry: Mapping[str, HFArchitectureFamily] = _ARCHITECTURES.view


def register_hf_architecture(item: HFArchitectureFamily | type[HFArchitectureFamily], *,
                             clobber: bool = False) -> HFArchitectureFamily:
    """Register an architecture (an instance or a class); a second one of the same name raises unless ``clobber``."""
    return _ARCHITECTURES.register(item, clobber=clobber)


def unregister_hf_architecture(name: str) -> None:
    """Remove a registered architecture (tests, reloads); unknown names are ignored."""
    _ARCHITECTURES.unregister(name)


def hf_architectures() -> list[HFArchitectureFamily]:
    """Every registered architecture, built-ins first."""
    return _ARCHITECTURES.all()


def hf_architecture(name: str, culprit: str = "--hf-architecture") -> HFArchitectureFamily:
    """The registered architecture called ``name``; :class:`LayoutError` listing them otherwise."""
    known = {a.name: a for a in hf_architectures()}
    if name not in known:
        raise LayoutError(f"{name!r} is not a Hugging Face architecture reshard knows", culprit=culprit,
                          hint=f"choose one of {', '.join(sorted(known))} (or register a plug-in)")
    return known[name]


def read_config(config: Mapping[str, Any], where: str) -> HFModel:
    """The megatron-core model a Hugging Face ``config.json`` describes, by the architecture it names
    (``architectures``, else ``model_type``); :class:`LayoutError` for one no registered architecture
    imports, or naming the first thing megatron-core does not compute exactly."""
    archs = config.get("architectures") or []
    importable = [a for a in hf_architectures() if a.imports]
    if not archs:  # saved from a config class alone: transformers' Auto classes go by model_type
        archs = [a.name for a in importable if config.get("model_type") in a.model_types][:1]
    found = next((a for a in importable if len(archs) == 1 and a.name == archs[0]), None)
    if found is None:
        raise LayoutError(f"architecture {archs or 'unknown'} is not imported", culprit=where,
                          hint=f"reshard imports {', '.join(sorted(a.name for a in importable))}")
    model = found.read_config(config, where)
    ids = token_ids(config, where)
    if ids:  # no weight depends on them: kept for the export (see TOKEN_IDS_ARG)
        setattr(model.args, TOKEN_IDS_ARG, ids)
    return model


def decide_export(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                  widths: Mapping[str, int]) -> HFArchitecture:
    """The architecture that computes a megatron-core model exactly: the one registered class that
    claims it (:meth:`~HFArchitectureFamily.decide`: DeepSeek's multi-latent attention, Mistral's
    sliding window), else the built-in decision (:func:`~reshard.models.hf_architectures.decide_architecture`).
    A window in the args (:func:`~reshard.models.hf_architectures.sliding_window`) that the decided
    ``config.json`` does not state as its ``sliding_window`` is refused: transformers would attend
    past it."""
    window = sliding_window(args, facts.num_layers)
    decided = next((d for d in (arch.decide(args, facts, keys, dtype, widths) for arch in hf_architectures())
                    if d is not None), None)
    if decided is None:
        decided = decide_architecture(args, facts, keys, dtype, widths.get("dense"), widths.get("expert"),
                                      widths.get("shared"))
    if decided.config.get("sliding_window") != window:
        raise LayoutError(f"no Hugging Face architecture computes this model exactly: a sliding window of {window} "
                          f"tokens on every layer in {decided.name}'s model ({decided.reason})", culprit="--to hf",
                          hint="keep it in a Megatron layout (MistralForCausalLM, Llama's arithmetic without biases, "
                               "has the one window exported)")
    return decided


def export_as(decided: HFArchitecture, name: str | None) -> HFArchitecture:
    """What ``--to hf`` writes: the architecture reshard decided computes the model (``decided``),
    or, under ``--hf-architecture name``, that architecture's own version of it (or its refusal; also
    when its version would drop or change the decided ``sliding_window``)."""
    if name is None or name == decided.name:
        return decided
    out = hf_architecture(name).export(decided)
    window = decided.config.get("sliding_window")
    if out.config.get("sliding_window") != window:
        raise LayoutError(f"the model is {decided.name} ({decided.reason}); {name}'s config.json does not keep its "
                          f"sliding window of {window} tokens", culprit="--hf-architecture",
                          hint=f"drop --hf-architecture, or give {decided.name}")
    return out
