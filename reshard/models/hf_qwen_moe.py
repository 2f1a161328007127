"""``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` both ways: Qwen2's (or Llama's) and Qwen3's
attention with megatron-core MoE layers — Qwen2-MoE's with one sigmoid-gated shared expert, Qwen3-MoE's
without — dense layers allowed (``mlp_only_layers``, ``decoder_sparse_step``: Megatron-LM's
``moe_layer_freq``), the top-k renormalized as ``norm_topk_prob`` says (false:
``--moe-router-pre-softmax``). Their name tables share the router (``mlp.gate``) and the routed
experts (``mlp.experts.{e}.*_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import LINEAR, GatedSplit, HFArchitecture, NameTable, Same, name_table
from reshard.models.hf_common import CORE_LAYER, EXPERT_FC1, EXPERT_FC2, HF_LAYER, Refuse, not_exact
from reshard.models.hf_llama import LLAMA_NAMES, LlamaLike
from reshard.models.hf_moe import megatron_moe_args, moe_claim
from reshard.models.hf_qwen import QWEN3_NAMES, qwen3_biases

_L, _H = CORE_LAYER, HF_LAYER
#: A megatron-core MoE layer's router and routed experts <-> Qwen-MoE's.
QWEN_ROUTED: NameTable = name_table(
    (_L + "mlp.router.weight", Same(), (_H + "mlp.gate.weight",)),
    (EXPERT_FC1, GatedSplit(), (_H + "mlp.experts.{expert}.gate_proj.weight",
                                _H + "mlp.experts.{expert}.up_proj.weight"), LINEAR),
    (EXPERT_FC2, Same(), (_H + "mlp.experts.{expert}.down_proj.weight",), LINEAR),
)
#: A megatron-core MoE layer's shared expert and its sigmoid gate <-> Qwen's (Qwen2-MoE, Qwen3-Next).
QWEN_SHARED: NameTable = name_table(
    (_L + "mlp.shared_experts.linear_fc1.weight", GatedSplit(),
     (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"), LINEAR),
    (_L + "mlp.shared_experts.linear_fc2.weight", Same(), (_H + "mlp.shared_expert.down_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.gate_weight", Same(), (_H + "mlp.shared_expert_gate.weight",)),
)
#: megatron-core MoE layers <-> Qwen2-MoE's: the routed experts, one shared expert and its sigmoid
#: gate, on top of Llama's names (its dense layers).
QWEN2_MOE_NAMES: NameTable = LLAMA_NAMES + QWEN_ROUTED + QWEN_SHARED
#: megatron-core MoE layers <-> Qwen3-MoE's: Qwen2-MoE's router and experts, no shared expert.
QWEN3_MOE_NAMES: NameTable = QWEN3_NAMES + QWEN_ROUTED


def qwen_moe_args(c: Mapping[str, Any], layers: int, need: Callable[..., int], refuse: Refuse, where: str,
                  shared: bool) -> dict[str, Any]:
    """Megatron-LM's MoE args of a Qwen-MoE ``config.json``: its dense layers (``mlp_only_layers``,
    ``decoder_sparse_step``) as ``moe_layer_freq``, Qwen2-MoE's shared expert (``shared``)."""
    step, dense = need("decoder_sparse_step"), set(c.get("mlp_only_layers") or ())
    if step < 1:
        raise CheckpointFormatError(f"decoder_sparse_step is {step}", culprit=where, hint="check config.json")
    experts, moe_ffn = need("num_experts", "num_local_experts"), need("moe_intermediate_size")  # 5.x: local
    shared_ffn = need("shared_expert_intermediate_size") if shared else None
    freq = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return megatron_moe_args(experts, moe_ffn, shared_ffn, not c["norm_topk_prob"], freq, need, refuse)


class Qwen2Moe(LlamaLike):
    name = "Qwen2MoeForCausalLM"
    model_types = ("qwen2_moe",)
    names = QWEN2_MOE_NAMES
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
                "max_position_embeddings": 32768, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "norm_topk_prob": False, "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "intermediate_size": 5632}

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        return bool(c["qkv_bias"]), False

    def moe_args(self, c: Mapping[str, Any], layers: int, need: Callable[..., int], refuse: Refuse,
                 where: str) -> dict[str, Any]:
        return qwen_moe_args(c, layers, need, refuse, where, shared=True)

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A MoE model without query/key norms whose MoE layers have a shared expert."""
        claimed = moe_claim(args, facts, keys, dtype, widths, qk_norm=False)
        if claimed is None:
            return None
        shape, moe = claimed
        if not moe.shared:
            return None
        if not any(k.endswith(".mlp.shared_experts.gate_weight") for k in keys):
            raise not_exact("shared experts without a gate (Qwen2-MoE gates its shared expert by a sigmoid)")
        if facts.head_dim * facts.heads != facts.hidden:
            raise not_exact("head dim x heads differs from the hidden size, which Qwen2-MoE assumes")
        config = {k: v for k, v in shape.config.items() if k != "head_dim"}
        moe_ffn = widths.get("expert")
        return HFArchitecture(
            name=self.name, notes=shape.notes, names=self.names,
            config={"architectures": [self.name], "model_type": "qwen2_moe", **config,
                    "intermediate_size": widths.get("dense") or moe_ffn, "moe_intermediate_size": moe_ffn,
                    "shared_expert_intermediate_size": widths.get("shared"), "num_experts": moe.experts,
                    "norm_topk_prob": not moe.pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": moe.dense,
                    "qkv_bias": shape.qkv_bias, "use_sliding_window": False, **moe.routing},
            reason=f"RMSNorm, SwiGLU, rotary, {moe.experts} experts and a gated shared expert per MoE layer, "
                   f"top-{moe.topk} of softmax{'' if moe.pre_softmax else ' renormalized'}"
                   + (", QKV bias" if shape.qkv_bias else ""))


class Qwen3Moe(LlamaLike):
    name = "Qwen3MoeForCausalLM"
    model_types = ("qwen3_moe",)
    names = QWEN3_MOE_NAMES
    qk_norm = True
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                "use_sliding_window": False, "max_position_embeddings": 32768, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": False, "num_local_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "intermediate_size": 6144}

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        return qwen3_biases(c, refuse)

    def moe_args(self, c: Mapping[str, Any], layers: int, need: Callable[..., int], refuse: Refuse,
                 where: str) -> dict[str, Any]:
        return qwen_moe_args(c, layers, need, refuse, where, shared=False)

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A MoE model with query/key norms (and no shared expert)."""
        claimed = moe_claim(args, facts, keys, dtype, widths, qk_norm=True)
        if claimed is None:
            return None
        shape, moe = claimed
        if moe.shared:
            raise not_exact("query/key layer norms with shared experts (Qwen3-MoE has no shared expert)")
        moe_ffn = widths.get("expert")
        return HFArchitecture(
            name=self.name, notes=shape.notes, names=self.names,
            config={"architectures": [self.name], "model_type": "qwen3_moe", **shape.config,
                    "intermediate_size": widths.get("dense") or moe_ffn, "moe_intermediate_size": moe_ffn,
                    "num_experts": moe.experts, "norm_topk_prob": not moe.pre_softmax, "decoder_sparse_step": 1,
                    "mlp_only_layers": moe.dense, "attention_bias": shape.qkv_bias, "use_sliding_window": False,
                    **moe.routing},
            reason=f"RMSNorm, SwiGLU, rotary, query/key RMSNorm per head, {moe.experts} experts per MoE layer, "
                   f"top-{moe.topk} of softmax{'' if moe.pre_softmax else ' renormalized'}"
                   + (", attention biases" if shape.qkv_bias else ""))


QWEN2_MOE = Qwen2Moe()
QWEN3_MOE = Qwen3Moe()
