"""Hugging Face architectures as plug-ins: one object per ``transformers`` class, owning all that
reshard knows of it — its name table both ways (:attr:`HFArchitectureFamily.names`), how its
``config.json`` reads as Megatron-LM's ``args`` and model facts (:meth:`~HFArchitectureFamily.read_config`,
import), which megatron-core models it computes exactly and its ``config.json`` for them
(:meth:`~HFArchitectureFamily.decide`, export), and how it writes a model another class was decided
for (:meth:`~HFArchitectureFamily.export`, for ``--to hf --hf-architecture NAME``).

A new architecture is one module: a subclass registered with :func:`register_hf_architecture` or
through the entry-point group ``reshard.hf_architectures``. The ``hf`` format, the import of
``--model-config`` and the export ask this registry (:func:`read_config`, :func:`decide_export`,
:func:`export_as`); none of them names an architecture. The built-ins, one module each (the
toolkit they are written with is :mod:`reshard.models.hf_architectures`; what several share,
:mod:`reshard.models.hf_common`):

=======================  ==============================  =============================================
architecture             module                          megatron-core model
=======================  ==============================  =============================================
``LlamaForCausalLM``     :mod:`~reshard.models.hf_llama`    RMSNorm, SwiGLU, whole-head rotary, no linear
                                                         biases or biases on every linear layer
``MistralForCausalLM``   :mod:`~reshard.models.hf_mistral`  Llama's without biases, a sliding window on
                                                         every layer
``Qwen2ForCausalLM``     :mod:`~reshard.models.hf_qwen`     Llama's with biases on the fused QKV only
``Qwen3ForCausalLM``     :mod:`~reshard.models.hf_qwen`     Llama's with query/key RMSNorm per head
``MixtralForCausalLM``   :mod:`~reshard.models.hf_mixtral`  Llama's, every MLP a MoE layer, no shared
                                                         expert
``Qwen2MoeForCausalLM``  :mod:`~reshard.models.hf_qwen_moe` MoE layers with a sigmoid-gated shared expert
``Qwen3MoeForCausalLM``  :mod:`~reshard.models.hf_qwen_moe` Qwen3's, MoE layers without a shared expert
``GPT2LMHeadModel``      :mod:`~reshard.models.hf_gpt2`     LayerNorm, GELU, learned positions, biases
``DeepseekV3ForCausalLM`` :mod:`~reshard.models.hf_deepseek` multi-latent attention, DeepSeek MoE, MTP
``GptOssForCausalLM``    :mod:`~reshard.models.hf_gpt_oss`  learned attention sinks, MoE with biases, clamped
                                                         gated activation, YaRN, alternating windows
``Qwen3NextForCausalLM``  :mod:`~reshard.models.hf_qwen3_next` gated DeltaNet and gated attention layers,
                                                         MoE with a gated shared expert
``Qwen3_5ForCausalLM``    :mod:`~reshard.models.hf_qwen3_next` the same layers, dense MLPs (text model)
``Qwen3_5MoeForCausalLM`` :mod:`~reshard.models.hf_qwen3_next` the same layers, every MLP MoE (text model)
``NemotronHForCausalLM`` :mod:`~reshard.models.hf_nemotron_h` hybrid ``MambaModel``: Mamba-2, attention without
                                                         rotary, squared-ReLU MLP layers
``Glm4MoeForCausalLM``    :mod:`~reshard.models.hf_glm4_moe`  partial rotary, QKV bias, sigmoid-routed MoE with
                                                         expert bias and a shared expert, MTP
``MiniMaxM2ForCausalLM``  :mod:`~reshard.models.hf_minimax_m2` none: q/k RMSNorm over all heads; Hugging Face
                                                         folders to Hugging Face folders only (bf16, FP8)
=======================  ==============================  =============================================

Anything else is refused with what differs — never an approximate export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import TOKEN_IDS_ARG, HFArchitecture, HFArchitectureFamily, HFModel, token_ids
from reshard.models.hf_common import layer_windows, not_exact, sliding_window
from reshard.plugins import PluginRegistry

#: Built-in architectures, as "module:instance" (imported on first use).
BUILTIN: tuple[str, ...] = (
    "reshard.models.hf_llama:LLAMA", "reshard.models.hf_mistral:MISTRAL", "reshard.models.hf_qwen:QWEN2",
    "reshard.models.hf_qwen:QWEN3", "reshard.models.hf_mixtral:MIXTRAL", "reshard.models.hf_qwen_moe:QWEN2_MOE",
    "reshard.models.hf_qwen_moe:QWEN3_MOE", "reshard.models.hf_gpt2:GPT2", "reshard.models.hf_deepseek:DEEPSEEK_V3",
    "reshard.models.hf_gpt_oss:GPT_OSS", "reshard.models.hf_qwen3_next:QWEN3_NEXT",
    "reshard.models.hf_qwen3_next:QWEN3_5", "reshard.models.hf_qwen3_next:QWEN3_5_MOE",
    "reshard.models.hf_qwen3_5_vl:QWEN3_5_VL", "reshard.models.hf_qwen3_5_vl:QWEN3_5_MOE_VL",
    "reshard.models.hf_nemotron_h:NEMOTRON_H", "reshard.models.hf_minimax_m2:MINIMAX_M2",
    "reshard.models.hf_glm4_moe:GLM4_MOE")
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
    own = found.imported_config(config, where)
    model = dataclasses.replace(found.read_config(own, where), family=found)
    ids = token_ids(own, where)
    if ids:  # no weight depends on them: kept for the export (see TOKEN_IDS_ARG)
        setattr(model.args, TOKEN_IDS_ARG, ids)
    return model


def decide_export(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                  widths: Mapping[str, int]) -> HFArchitecture:
    """The architecture that computes a megatron-core model exactly: the first registered class that
    claims it (:meth:`~HFArchitectureFamily.decide`), asking the classes that claim a model only they
    compute (DeepSeek's multi-latent attention, Mistral's sliding window) before those that claim one
    by its shape (:attr:`~HFArchitectureFamily.fallback`: Llama's arithmetic and its kin, GPT-2); a
    claiming class's refusal is the answer. A window in the args
    (:func:`~reshard.models.hf_common.sliding_window`) that the decided ``config.json`` does not
    state (:meth:`~HFArchitectureFamily.windows`: its ``sliding_window``, per layer) is refused:
    transformers would attend past it."""
    windows = layer_windows(args, facts.num_layers)
    archs = hf_architectures()
    asked = (arch for fallback in (False, True) for arch in archs if arch.fallback == fallback)
    found = next(((arch, d) for arch, d in ((a, a.decide(args, facts, keys, dtype, widths)) for a in asked)
                  if d is not None), None)
    if found is None:
        raise not_exact("no registered architecture claims it")
    decided = dataclasses.replace(found[1], family=found[0])
    if found[0].windows(decided.config, facts.num_layers) != windows:
        window = sliding_window(args, facts.num_layers)  # windows on some layers only: refused as such
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
    arch = hf_architecture(name)
    out = dataclasses.replace(arch.export(decided), family=arch)
    window = decided.config.get("sliding_window")
    if out.config.get("sliding_window") != window:
        raise LayoutError(f"the model is {decided.name} ({decided.reason}); {name}'s config.json does not keep its "
                          f"sliding window of {window} tokens", culprit="--hf-architecture",
                          hint=f"drop --hf-architecture, or give {decided.name}")
    return out
