"""Model families as plug-ins: each a rule table plus what depends on its naming (see
:mod:`reshard.models.base`). Built-in (:mod:`reshard.models.registry`): Megatron GPT (legacy and
megatron-core names, dense or MoE; :mod:`~reshard.models.megatron_gpt`) and DeepSeek-V3-class models
(multi-latent attention, DeepSeek MoE, multi-token prediction; under megatron-core's local spec and
Transformer Engine's; :mod:`~reshard.models.deepseek`) and models with learned attention sinks
(GPT-OSS; :mod:`~reshard.models.gpt_oss`) and megatron-core's hybrid ``MambaModel`` (Nemotron-H;
:mod:`~reshard.models.nemotron_h`). ``resolve_family(keys)`` picks the family
that claims a checkpoint's parameter names and resolves every name to its rule.

Hugging Face architectures are plug-ins of their own (:mod:`reshard.models.hf_registry`), one module
each: Llama, Mistral, Qwen2 and Qwen3, Qwen2-MoE and Qwen3-MoE, Mixtral, GPT-2, DeepSeek-V3/Kimi-K2,
GPT-OSS, Nemotron-H (``hf_llama``, ``hf_mistral``, ``hf_qwen``, ``hf_qwen_moe``, ``hf_mixtral``, ``hf_gpt2``,
``hf_deepseek``, ``hf_gpt_oss``, ``hf_nemotron_h``), written with :mod:`reshard.models.hf_architectures`."""

from __future__ import annotations

from collections.abc import Sequence

from reshard.core.errors import UnknownParameterError
from reshard.core.rules import Resolution, resolve
from reshard.models.base import ModelFamily
from reshard.models.registry import families, register_family, registry, unregister_family

__all__ = ["ModelFamily", "claiming_family", "families", "register_family", "registry", "resolve_family",
           "unregister_family"]


def claiming_family(keys: Sequence[str], source: str = "checkpoint") -> ModelFamily:
    """The first family (in registry order) that claims parameter names ``keys``; names only, no
    rule resolved (:func:`resolve_family` resolves them)."""
    for family in families():
        if family.claims(keys):
            return family
    raise UnknownParameterError(f"no model family claims these parameters ({', '.join(list(keys)[:5])}, ...)",
                                culprit=source, hint=f"registered families: {sorted(registry)}")


def resolve_family(keys: Sequence[str], source: str = "checkpoint") -> tuple[ModelFamily, Resolution]:
    """The family that claims ``keys`` and every key's rule in its table (an unknown key raises
    :class:`~reshard.core.errors.UnknownParameterError` listing them all)."""
    from reshard.models.lora import adapter_parts

    adapters = [k for k in keys if adapter_parts(k) is not None]
    if adapters:  # a PEFT save (Megatron-Bridge's: the adapters alone) is no model to convert
        raise UnknownParameterError(f"holds {len(adapters)} LoRA adapter weight(s) ({adapters[0]}, ...): a LoRA "
                                    "adapter checkpoint, not a model", culprit=source,
                                    hint="--to hf-peft writes it as a Hugging Face PEFT adapter; --merge-adapter "
                                         "merges it into its base's conversion")
    family = claiming_family(keys, source)
    return family, resolve(keys, family.rules, source=source, supported=family.supported)
