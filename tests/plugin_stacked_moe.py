"""A mixture-of-experts architecture whose experts are *stacked* (GPT-OSS's layout) as a Hugging Face
architecture plug-in, in this one module: each layer's experts are two 3-D tensors, not ``E`` pairs
of matrices. Registered by the tests with
:func:`reshard.models.hf_registry.register_hf_architecture`; nothing of reshard is edited.

Shapes (``E`` experts, ``h`` hidden size, ``f`` an expert's FFN width):

==============================  =====================================  ==============================
Hugging Face tensor             megatron-core tensor ``e``             transform
==============================  =====================================  ==============================
``mlp.experts.gate_up_proj``    ``local_experts.{e}.linear_fc1``       ``Stacked(transpose=True,
``[E, h, 2f]``: column ``2r``   ``[2f, h]`` = ``[gate; up]``           halves=2, interleave=True)``
gate row ``r``, ``2r + 1`` up
``mlp.experts.down_proj``       ``local_experts.{e}.linear_fc2``       ``Stacked(transpose=True)``
``[E, f, h]``                   ``[h, f]``
``mlp.router.weight [E, h]``    ``mlp.router.weight``                  ``Same()``
==============================  =====================================  ==============================

The rest is Llama's (attention, norms, embeddings). Routing is Mixtral's (softmax top-k,
renormalized), so the export is the model reshard decides is Mixtral, under this class's names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.models.hf_architectures import (
    LLAMA_NAMES,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    Same,
    name_table,
)
from reshard.models.hf_import import read_llama_like
from reshard.models.stacked import Stacked

_L, _H = "decoder.layers.{layer}.", "model.layers.{layer}."
_E = _L + "mlp.experts."
#: A routed expert's megatron-core names (SequentialMLP's, then grouped GEMM's): ``{expert}``
#: numbers the slabs; the Hugging Face names lack it.
FC1 = (_E + "local_experts.{expert}.linear_fc1.weight", _E + "linear_fc1.weight{expert}")
FC2 = (_E + "local_experts.{expert}.linear_fc2.weight", _E + "linear_fc2.weight{expert}")
GATE_UP = Stacked(transpose=True, halves=2, interleave=True)
DOWN = Stacked(transpose=True)
NAMES = LLAMA_NAMES + name_table(
    (_L + "mlp.router.weight", Same(), (_H + "mlp.router.weight",)),
    (FC1, GATE_UP, (_H + "mlp.experts.gate_up_proj",)),
    (FC2, DOWN, (_H + "mlp.experts.down_proj",)),
)
_DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
             "mlp_bias": False, "max_position_embeddings": 4096, "num_experts_per_tok": 2}


class StackedMoe(HFArchitectureFamily):
    name = "StackedMoeForCausalLM"
    model_types = ("stacked_moe",)
    names = NAMES

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        """Llama's config, every layer a MoE layer of ``num_local_experts`` SequentialMLP experts of
        width ``intermediate_size`` (EP 1: reshard's ``--target-ep`` deals them out)."""
        c = {**_DEFAULTS, **config}
        model = read_llama_like(self.name, self.names, c, where)
        vars(model.args).update(
            num_experts=c["num_local_experts"], moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=c["intermediate_size"], moe_shared_expert_intermediate_size=None,
            moe_shared_expert_gate=False, moe_router_pre_softmax=False, moe_router_score_function="softmax",
            moe_router_enable_expert_bias=False, moe_layer_freq=1, expert_model_parallel_size=1,
            expert_tensor_parallel_size=1, moe_grouped_gemm=False)
        return model

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        if decided.name != "MixtralForCausalLM":
            return HFArchitectureFamily.export(self, decided)
        config = {**decided.config, "architectures": [self.name], "model_type": self.model_types[0]}
        return HFArchitecture(name=self.name, config=config, names=self.names, notes=decided.notes,
                              reason=f"{decided.reason}, experts stacked")
