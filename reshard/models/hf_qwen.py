"""``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` both ways: Llama's arithmetic with biases on the
fused QKV only (Qwen2, megatron-core's ``--add-qkv-bias``), or with query/key RMSNorm per head
(Qwen3, ``--qk-layernorm``; biases on the attention layers, all four, or none). Qwen2's name table is
Llama's; Qwen3's adds the query/key norms. Qwen's sliding-window attention (``use_sliding_window``)
is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import HFArchitecture, NameTable, Same, name_table
from reshard.models.hf_common import CORE_LAYER, HF_LAYER, Refuse, not_exact
from reshard.models.hf_llama import LLAMA_NAMES, LlamaLike, llama_shape

#: Qwen3's query/key layer norms (RMSNorm over each head's dims, before the rotary embedding), on
#: top of Llama's names.
QWEN3_NAMES: NameTable = LLAMA_NAMES + name_table(
    (CORE_LAYER + "self_attention.q_layernorm.weight", Same(), (HF_LAYER + "self_attn.q_norm.weight",)),
    (CORE_LAYER + "self_attention.k_layernorm.weight", Same(), (HF_LAYER + "self_attn.k_norm.weight",)),
)


class Qwen2(LlamaLike):
    name = "Qwen2ForCausalLM"
    model_types = ("qwen2",)
    names = LLAMA_NAMES
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                "use_sliding_window": False, "max_position_embeddings": 32768}

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        return True, False

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A dense model without query/key norms, with biases on the fused QKV alone."""
        shape = llama_shape(args, facts, keys, dtype, widths)
        if shape is None or shape.moe or shape.qk_norm or not (shape.qkv_bias and not shape.proj_bias
                                                               and not shape.mlp_bias):
            return None
        if facts.head_dim * facts.heads != facts.hidden:
            raise not_exact("head dim x heads differs from the hidden size, which Qwen2 assumes")
        config = {k: v for k, v in shape.config.items() if k != "head_dim"}
        return HFArchitecture(name=self.name, config={"architectures": [self.name], "model_type": "qwen2", **config},
                              reason="RMSNorm, SwiGLU, rotary, biases on the fused QKV only", notes=shape.notes,
                              names=self.names)


def qwen3_biases(c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
    """Qwen3's and Qwen3-MoE's import: no biases (transformers' ``attention_bias`` puts them on the
    attention layers alone, which Megatron-LM has on all linear layers or on QKV alone)."""
    if c["attention_bias"]:
        raise refuse("biases on the attention layers but not the MLP (Megatron has them on all linear "
                     "layers or on QKV alone)")
    return False, False


class Qwen3(LlamaLike):
    name = "Qwen3ForCausalLM"
    model_types = ("qwen3",)
    names = QWEN3_NAMES
    qk_norm = True
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                "use_sliding_window": False, "max_position_embeddings": 32768, "head_dim": 128}

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        return qwen3_biases(c, refuse)

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A dense model with query/key norms (the biases are checked by :func:`llama_shape`)."""
        shape = llama_shape(args, facts, keys, dtype, widths)
        if shape is None or shape.moe or not shape.qk_norm:
            return None
        return HFArchitecture(name=self.name, notes=shape.notes, names=self.names,
                              config={"architectures": [self.name], "model_type": "qwen3", **shape.config,
                                      "attention_bias": shape.qkv_bias, "use_sliding_window": False},
                              reason="RMSNorm, SwiGLU, rotary, query/key RMSNorm per head" +
                                     (", biases on the attention layers" if shape.qkv_bias else ", no linear biases"))


QWEN2 = Qwen2()
QWEN3 = Qwen3()
