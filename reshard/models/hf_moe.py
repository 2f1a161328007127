"""What the mixture-of-experts architectures with Llama's attention share (Mixtral, Qwen2-MoE,
Qwen3-MoE; not DeepSeek's, whose routing is its own): the routing an export checks before the
classes tell the model apart, and Megatron-LM's MoE ``args`` an import writes (megatron-core's
SequentialMLP experts at TP 1, EP 1: reshard's ``--target-ep`` deals them out; the router's top-k
of the softmax, renormalized unless ``--moe-router-pre-softmax``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_common import Refuse, asked_in_turn, not_exact
from reshard.models.hf_llama import LlamaShape, llama_shape
from reshard.models.megatron_gpt import experts_per_layer, stack_layer


@dataclass(frozen=True)
class MoEShape:
    """A Llama-like model's MoE layers as an export sees them: the router's top-k, the experts per
    MoE layer, the dense layers, whether MoE layers have a shared expert, whether the top-k scores
    are left unnormalized (``--moe-router-pre-softmax``), and the routing entries of ``config.json``."""

    topk: int
    experts: int
    dense: list[int]
    shared: bool
    pre_softmax: bool
    routing: dict[str, Any]


@asked_in_turn
def moe_shape(args: Any, facts: ModelFacts, keys: set[str], shape: LlamaShape) -> MoEShape:
    """The MoE layers of a Llama-like model (``shape.moe``), or the refusal of a routing none of
    Mixtral, Qwen2-MoE and Qwen3-MoE computes (sigmoid scores, expert bias, groups, capacity,
    scaling) — the same whichever of them asks."""
    if (shape.proj_bias and not shape.qk_norm) or shape.mlp_bias:
        raise not_exact("linear biases besides the QKV's in a mixture-of-experts model")
    score = saved_arg(args, "moe_router_score_function", default="softmax")
    if score != "softmax":
        raise not_exact(f"router scores by {score} (Mixtral and Qwen2-MoE route on softmax scores)")
    expert_bias = saved_arg(args, "moe_router_enable_expert_bias", default=False)
    if any(k.endswith(".mlp.router.expert_bias") for k in keys) or expert_bias:
        raise not_exact("a router expert bias (aux-loss-free load balancing)")
    for flag, what in (("moe_router_num_groups", "group-limited routing"), ("moe_expert_capacity_factor",
                                                                           "token dropping (expert capacity)"),
                       ("moe_input_jitter_eps", "router input jitter")):
        if saved_arg(args, flag):
            raise not_exact(f"{what} ({flag})")
    if saved_arg(args, "moe_router_topk_scaling_factor", default=1.0) != 1.0:
        raise not_exact("scaled routing weights (moe_router_topk_scaling_factor)")
    topk = saved_arg(args, "moe_router_topk")
    if not isinstance(topk, int):
        raise not_exact("the router's top-k is unknown (the saved args lack moe_router_topk)")
    experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
    moe_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.router.weight")}
    dense = sorted(set(range(facts.num_layers)) - moe_layers)
    shared = any(k.endswith(".mlp.shared_experts.linear_fc1.weight") for k in keys)
    pre_softmax = bool(saved_arg(args, "moe_router_pre_softmax", default=False))
    routing = {"num_experts_per_tok": topk, "output_router_logits": False, "router_aux_loss_coef": 0.0}
    return MoEShape(topk, experts, dense, shared, pre_softmax, routing)


def megatron_moe_args(experts: int, moe_ffn: int, shared: int | None, pre_softmax: bool, freq: list[int],
                      need: Callable[..., int], refuse: Refuse) -> dict[str, Any]:
    """Megatron-LM's MoE args of an imported ``config.json``: ``experts`` per MoE layer of width
    ``moe_ffn``, a sigmoid-gated shared expert of width ``shared`` (None: none), ``freq`` one flag per
    layer (1: MoE), the top-k read by ``need``."""
    if experts < 1 or not any(freq):
        raise refuse("no MoE layer")
    return dict(num_experts=experts, moe_router_topk=need("num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None,
                moe_router_pre_softmax=pre_softmax, moe_router_score_function="softmax",
                moe_router_enable_expert_bias=False, moe_layer_freq=1 if all(freq) else freq,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False)


def moe_claim(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype, widths: Mapping[str, int],
              qk_norm: bool) -> tuple[LlamaShape, MoEShape] | None:
    """The shapes of a Llama-like MoE model with (or without) query/key norms, as ``qk_norm`` says;
    None for any other model. Each MoE class's ``decide`` starts here, then claims by its own marks."""
    shape = llama_shape(args, facts, keys, dtype, widths)
    if shape is None or not shape.moe or shape.qk_norm != qk_norm:
        return None
    return shape, moe_shape(args, facts, keys, shape)
