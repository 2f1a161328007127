"""GPT-OSS on megatron-core's side: a megatron-core GPT model whose attention has learned sinks
(``softmax_type="learnable"``: one ``self_attention.core_attention.softmax_offset`` ``[heads]`` per
layer, the logit of a sink column each head's softmax adds and drops), MoE layers with linear biases,
a clamped gated activation and windows on some layers. The Hugging Face architecture
``GptOssForCausalLM`` (name table, ``config.json`` <-> Megatron-LM ``args``) is
:mod:`reshard.models.hf_gpt_oss`.

What megatron-core 0.16.1 holds and how reshard splits it (``n`` heads, ``E`` experts):

====================================================  ===========  ==========================================
megatron-core                                         shape        split
====================================================  ===========  ==========================================
``self_attention.core_attention.softmax_offset``      ``[n]``      by heads over TP (``DotProductAttention``
                                                                   holds its ``n / TP`` heads' offsets;
                                                                   torch_dist shards it on axis 0)
``mlp.router.weight``, ``mlp.router.bias``            ``[E, h]``,  whole on every rank
                                                      ``[E]``
``mlp.experts.local_experts.{e}.linear_fc1.{w,b}``    ``[2f, h]``  ``[gate; up]``, at expert TP 1 (below)
``mlp.experts.local_experts.{e}.linear_fc2.{w,b}``    ``[h, f]``   at expert TP 1
====================================================  ===========  ==========================================

Everything else is :data:`~reshard.models.megatron_gpt.MEGATRON_GPT_RULES`' (the attention's fused
QKV with biases, norms, embeddings, the output layer). megatron-core builds MoE layers with linear
biases at expert TP 1 only, which :class:`~reshard.models.megatron_gpt.MegatronCoreFamily` says for
every such model (:meth:`~reshard.models.megatron_gpt.MegatronCoreFamily.expert_tp`).

The activation is Megatron-LM's ``--quick-geglu`` (a gated MLP: ``args.swiglu`` stays False; the
gating decider reads it, :func:`reshard.models.facts.decide_swiglu`) with ``--glu-linear-offset 1``
and ``--activation-func-clamp-value 7``: ``quick_gelu(min(gate, 7)) * (clamp(up, -7, 7) + 1)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from reshard.core.plan_types import ModelFacts
from reshard.core.rules import Kind, Rule
from reshard.models.facts import saved_arg
from reshard.models.megatron_gpt import DECODER_LAYER, MEGATRON_GPT_RULES, MegatronCoreFamily

#: The attention's learned sinks of a layer (megatron-core's name).
SOFTMAX_OFFSET = "self_attention.core_attention.softmax_offset"
_OFFSET_KEY = re.compile(DECODER_LAYER + re.escape(SOFTMAX_OFFSET) + "$")

#: The family's table: the sinks split by heads over TP (``[n]``: TP rank ``r`` holds heads
#: ``r n/TP .. (r+1) n/TP - 1``, as it holds their query rows), then megatron-core's GPT rules.
GPT_OSS_RULES: tuple[Rule, ...] = (
    Rule("core.softmax_offset", _OFFSET_KEY.pattern, Kind.COLUMN, family="core"),
) + MEGATRON_GPT_RULES

#: Megatron-LM's ``args`` of the attention and activation that make a GPT-OSS model (beside the MoE,
#: window and rotary ones, and ``activation_func_clamp_value``, its ``swiglu_limit``), with GPT-OSS's
#: values: what an import writes and the export checks.
ACTIVATION_ARGS = {"softmax_type": "learnable", "quick_geglu": True, "glu_linear_offset": 1.0}


class GptOss(MegatronCoreFamily):
    """megatron-core GPT models whose attention has learned sinks (softmax_offset, split by heads over
    TP), GPT-OSS's among them, dense or MoE; every other name as megatron-gpt reads it."""

    name = "gpt-oss"
    rules = GPT_OSS_RULES
    priority = 40
    supported = ("megatron-core GPT names with learned attention sinks (self_attention.core_attention."
                 "softmax_offset), dense or MoE MLP")

    def claims(self, keys: Sequence[str]) -> bool:
        return any(_OFFSET_KEY.match(k) for k in keys)

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """The routing, and the attention and activation args that the saved ``args`` record."""
        recorded = {k: saved_arg(args, k) for k in (*ACTIVATION_ARGS, "activation_func_clamp_value")
                    if saved_arg(args, k) is not None}
        return {**super().summary(args, model_facts, experts), "attention_and_activation": recorded or None}
