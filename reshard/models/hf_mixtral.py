"""``MixtralForCausalLM`` both ways: Llama's attention, every MLP a MoE layer (the router's top-k of
the softmax, renormalized: megatron-core's default), no shared expert, no sliding window. Its name
table is Llama's with ``block_sparse_moe``: router ``gate``, experts' ``w1`` gate, ``w3`` up and
``w2`` down projections.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import LINEAR, GatedSplit, HFArchitecture, NameTable, Same, name_table
from reshard.models.hf_common import CORE_LAYER, EXPERT_FC1, EXPERT_FC2, HF_LAYER, Refuse, not_exact
from reshard.models.hf_llama import LLAMA_NAMES, LlamaLike
from reshard.models.hf_moe import megatron_moe_args, moe_claim

_H = HF_LAYER + "block_sparse_moe."
#: megatron-core MoE layers <-> Mixtral's, on top of Llama's names.
MIXTRAL_NAMES: NameTable = LLAMA_NAMES + name_table(
    (CORE_LAYER + "mlp.router.weight", Same(), (_H + "gate.weight",)),
    (EXPERT_FC1, GatedSplit(), (_H + "experts.{expert}.w1.weight", _H + "experts.{expert}.w3.weight"), LINEAR),
    (EXPERT_FC2, Same(), (_H + "experts.{expert}.w2.weight",), LINEAR),
)


class Mixtral(LlamaLike):
    name = "MixtralForCausalLM"
    model_types = ("mixtral",)
    names = MIXTRAL_NAMES
    defaults = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
                "max_position_embeddings": 131072, "sliding_window": None, "num_local_experts": 8,
                "num_experts_per_tok": 2}

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        return False, False

    def moe_args(self, c: Mapping[str, Any], layers: int, need: Callable[..., int], refuse: Refuse,
                 where: str) -> dict[str, Any]:
        """Every layer MoE, no shared expert, the top-k renormalized (Mixtral always renormalizes)."""
        if c.get("sliding_window") is not None:
            raise refuse("sliding-window attention")
        return megatron_moe_args(need("num_local_experts"), need("intermediate_size"), None, False, [1] * layers,
                                 need, refuse)

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A MoE model without query/key norms or shared experts."""
        claimed = moe_claim(args, facts, keys, dtype, widths, qk_norm=False)
        if claimed is None:
            return None
        shape, moe = claimed
        if moe.shared:
            return None
        if moe.dense:
            raise not_exact(f"dense layers {moe.dense} beside MoE layers without shared experts (Mixtral's layers "
                            "are all MoE; Qwen2-MoE's MoE layers have a shared expert)")
        if moe.pre_softmax:
            raise not_exact("top-k softmax scores not renormalized (--moe-router-pre-softmax; Mixtral renormalizes "
                            "and has no shared expert)")
        if shape.qkv_bias:
            raise not_exact("a QKV bias (Mixtral has none)")
        return HFArchitecture(
            name=self.name, notes=shape.notes, names=self.names,
            config={"architectures": [self.name], "model_type": "mixtral", **shape.config,
                    "intermediate_size": widths.get("expert"), "num_local_experts": moe.experts,
                    "sliding_window": None, **moe.routing},
            reason=f"RMSNorm, SwiGLU, rotary, {moe.experts} experts in every layer, top-{moe.topk} of softmax "
                   "renormalized")


MIXTRAL = Mixtral()
