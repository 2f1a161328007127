"""megatron-core GPT models with multi-token prediction layers after an ordinary (not multi-latent)
attention stack: GLM-4.5 / 4.6 / 4.7 as megatron-core holds them (``mtp.layers.{i}``, each an
``eh_proj``, its norms and a whole decoder layer). The Hugging Face side is
:mod:`reshard.models.hf_glm4_moe`.

megatron-core's GPT rules split every tensor (the MoE layers' router with its ``expert_bias``,
routed and shared experts included); the multi-token prediction layers are split as the decoder's
layers are, and placed on the last pipeline stage (:func:`reshard.models.deepseek.mtp_rules`), as for
DeepSeek-V3. A checkpoint without such layers is megatron-core's GPT family's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ModelFacts
from reshard.core.rules import Rule
from reshard.models.deepseek import MLA_KEY, mtp_family_facts, mtp_layers, mtp_rules
from reshard.models.megatron_gpt import MEGATRON_GPT_RULES, MegatronCoreFamily, holds_mtp_layers, is_megatron_core

#: megatron-core's GPT rules, then its multi-token prediction layers'.
GPT_MTP_RULES: tuple[Rule, ...] = MEGATRON_GPT_RULES + mtp_rules(MEGATRON_GPT_RULES)


class GptWithMtpLayers(MegatronCoreFamily):
    """megatron-core GPT names with multi-token prediction layers (GLM-4.5's): claimed by those
    layers' names beside an attention stack without multi-latent attention (DeepSeek's family
    claims those)."""

    name = "megatron-gpt-mtp"
    rules = GPT_MTP_RULES
    priority = 45
    supported = ("megatron-core GPT names with multi-token prediction layers (mtp.layers.N: enorm, hnorm, eh_proj, "
                 "a decoder layer, final_layernorm), dense or MoE MLP; no MLA")

    def claims(self, keys: Sequence[str]) -> bool:
        return (is_megatron_core(keys) and holds_mtp_layers(keys)
                and not any(MLA_KEY.match(k) for k in keys))

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        """``mtp_layers`` (what an export writes copies of the embeddings and head for), as DeepSeek's."""
        return mtp_family_facts(options, args, params, origin, where)

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """The routing and the multi-token prediction layers the checkpoint holds."""
        return {**super().summary(args, model_facts, experts), "mtp_layers": mtp_layers(model_facts)}
