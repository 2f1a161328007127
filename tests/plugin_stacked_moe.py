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
``mlp.experts.gate_up_proj_bias  ``local_experts.{e}.linear_fc1.bias``   ``Stacked(halves=2,
[E, 2f]``: gate 0, up 0, ...    ``[2f]`` = ``[gate; up]``              interleave=True)``
``mlp.experts.down_proj_bias``  ``local_experts.{e}.linear_fc2.bias``   ``Stacked()``
``[E, h]``                      ``[h]``
``mlp.router.weight [E, h]``    ``mlp.router.weight``                  ``Same()``
==============================  =====================================  ==============================

The rest is Llama's (attention, norms, embeddings; with GPT-OSS's biases on every linear layer
when ``attention_bias`` is set, which megatron-core's ``--add-bias-linear`` computes). Routing is
Mixtral's (softmax top-k, renormalized): the export is the model reshard decides is Mixtral under
this class's names (``--hf-architecture``), or, with biases, claimed by :meth:`StackedMoe.decide`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import HFArchitecture, HFArchitectureFamily, HFModel, Same, name_table
from reshard.models.hf_llama import LLAMA_NAMES, read_llama_like
from reshard.models.hf_mixtral import MIXTRAL
from reshard.models.stacked import Stacked

_L, _H = "decoder.layers.{layer}.", "model.layers.{layer}."
_E = _L + "mlp.experts."
#: A routed expert's megatron-core names (SequentialMLP's, then grouped GEMM's): ``{expert}``
#: numbers the slabs; the Hugging Face names lack it.
FC1 = (_E + "local_experts.{expert}.linear_fc1.weight", _E + "linear_fc1.weight{expert}")
FC2 = (_E + "local_experts.{expert}.linear_fc2.weight", _E + "linear_fc2.weight{expert}")
FC1_BIAS = (_E + "local_experts.{expert}.linear_fc1.bias", _E + "linear_fc1.bias{expert}")
FC2_BIAS = (_E + "local_experts.{expert}.linear_fc2.bias", _E + "linear_fc2.bias{expert}")
GATE_UP = Stacked(transpose=True, halves=2, interleave=True)
DOWN = Stacked(transpose=True)
NAMES = LLAMA_NAMES + name_table(
    (_L + "mlp.router.weight", Same(), (_H + "mlp.router.weight",)),
    (FC1, GATE_UP, (_H + "mlp.experts.gate_up_proj",)),
    (FC2, DOWN, (_H + "mlp.experts.down_proj",)),
    (FC1_BIAS, Stacked(halves=2, interleave=True), (_H + "mlp.experts.gate_up_proj_bias",)),
    (FC2_BIAS, Stacked(), (_H + "mlp.experts.down_proj_bias",)),
)
_EXPERT_BIAS = re.compile(r"\.mlp\.experts\..*linear_fc[12]\.bias\d*$")
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

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model with biases on its experts (which no built-in class holds): Mixtral's decision for
        its weights, with GPT-OSS's biases on every linear layer; None for any other model."""
        if not any(_EXPERT_BIAS.search(k) for k in keys):
            return None
        weights = {k for k in keys if not re.search(r"\.bias\d*$", k)}
        decided = MIXTRAL.decide(args, facts, weights, dtype, widths)
        if decided is None or decided.name != "MixtralForCausalLM" or not all(
                any(k.endswith(end) for k in keys) for end in ("linear_qkv.bias", "linear_proj.bias")):
            return None
        out = self.export(decided)
        return dataclasses.replace(out, config={**out.config, "attention_bias": True, "mlp_bias": True},
                                   reason=f"{out.reason}, biases on every linear layer")

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        if decided.name != "MixtralForCausalLM":
            return HFArchitectureFamily.export(self, decided)
        config = {**decided.config, "architectures": [self.name], "model_type": self.model_types[0]}
        return HFArchitecture(name=self.name, config=config, names=self.names, notes=decided.notes,
                              reason=f"{decided.reason}, experts stacked")
