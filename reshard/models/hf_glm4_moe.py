"""transformers' ``Glm4MoeForCausalLM`` (GLM-4.5, 4.6, 4.7; ``models/glm4_moe``) both ways:
megatron-core's GPT model with partial rotary, a QKV bias, optional query/key norms, the first
``first_k_dense_replace`` layers dense and the others MoE layers with a sigmoid router, an expert
bias (``e_score_correction_bias``) and a shared expert; the releases' multi-token prediction layers
carried as DeepSeek-V3's are (:class:`~reshard.models.hf_deepseek.CarriesMtpLayers`; megatron-core's
side: :mod:`reshard.models.glm4_moe`).

The arithmetic, read from transformers 5.24 and megatron-core 0.16.1:

* attention: Llama's names and QKV split; ``attention_bias`` puts biases on q/k/v and none on
  ``o_proj`` (megatron-core's ``add_qkv_bias`` without ``add_bias_linear``); ``use_qk_norm`` is an
  RMSNorm per head before the rotary (``qk_layernorm``);
* partial rotary: both rotate the first ``head_dim x partial_rotary_factor`` dims of each head by
  halves (not interleaved) and pass the rest (``rotary_percent``); transformers' config defaults
  the factor to 0.5 when ``config.json`` omits it;
* router: sigmoid of float32 logits, top-k chosen on the scores plus the expert bias, weighted by
  the scores without it, renormalized (``norm_topk_prob``) and scaled (``routed_scaling_factor``).
  megatron-core renormalizes exactly when top-k > 1 and scales by ``moe_router_topk_scaling_factor``.
  With groups (``n_group``, ``topk_group``) transformers scores a group by the sum of its top 2
  experts, megatron-core by the sum of its top ``topk // group_topk``: the same only where that is
  2, or where every group is kept (``topk_group == n_group``: no group routing); any other is
  refused naming the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.plan_types import ModelFacts
from reshard.models.deepseek import mtp_layers
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import HF_DTYPES, HFArchitecture, HFModel, NameTable
from reshard.models.hf_common import (
    ROPE_BASE_DEFAULT,
    config_int,
    decided_norm,
    has_key,
    import_refusal,
    megatron_model,
    not_exact,
    rope_of,
)
from reshard.models.hf_deepseek import DEEPSEEK_MOE_NAMES, SHARED_COPIES_NAMES, CarriesMtpLayers, mtp_names
from reshard.models.hf_qwen import QWEN3_NAMES
from reshard.models.megatron_gpt import experts_per_layer, stack_layer

_SHARED = {core for row in SHARED_COPIES_NAMES for core in row.core}
#: The decoder: Llama's attention and dense MLP names with Qwen3's query/key norms, DeepSeek's MoE
#: names, the embeddings and head with their copies in each multi-token prediction layer.
_DECODER_NAMES: NameTable = (SHARED_COPIES_NAMES + tuple(row for row in QWEN3_NAMES if row.core[0] not in _SHARED)
                             + DEEPSEEK_MOE_NAMES)
#: The whole table: the multi-token prediction layers', then the decoder's.
GLM4_MOE_NAMES: NameTable = mtp_names(_DECODER_NAMES) + _DECODER_NAMES

#: transformers' Glm4MoeConfig defaults for what a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
    "partial_rotary_factor": 0.5}


def group_routing(topk: int, groups: int, topk_group: int) -> tuple[int, int] | None:
    """megatron-core's ``(moe_router_num_groups, moe_router_group_topk)`` routing as transformers'
    ``n_group`` / ``topk_group`` do, None for no group routing (one group, or every group kept).
    transformers keeps the groups whose top 2 experts sum highest, megatron-core those whose top
    ``topk // group_topk`` do (``moe_utils.group_limited_topk``): :class:`ValueError` where these differ."""
    if groups <= 1 or topk_group >= groups:
        return None
    if topk // topk_group != 2:
        raise ValueError(topk // topk_group)
    return groups, topk_group


class Glm4Moe(CarriesMtpLayers):
    """transformers' ``Glm4MoeForCausalLM``: exactly both ways, or refused naming the setting."""

    name = "Glm4MoeForCausalLM"
    priority = 0
    model_types = ("glm4_moe",)
    names = GLM4_MOE_NAMES
    saved_without = "GLM-4.5"

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}
        refuse, need = import_refusal(self.name, where), config_int(c, where)
        if c["hidden_act"] != "silu":
            raise refuse(f"activation {c['hidden_act']} (Megatron's SwiGLU is silu)")
        base, rope_type, partial = rope_of(c)
        if rope_type != "default":
            raise refuse(f"rotary scaling {rope_type}")
        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        groups = need("num_key_value_heads")
        head_dim = c.get("head_dim") or hidden // heads
        rotary = head_dim * partial
        if not 0 < partial <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise refuse(f"partial_rotary_factor {partial} of head_dim {head_dim} (not an even number of dims)")
        topk, experts = need("num_experts_per_tok"), need("n_routed_experts", "num_local_experts")
        n_group, topk_group = int(c["n_group"] or 1), int(c["topk_group"] or 1)
        if experts % n_group or (n_group > 1 and experts // n_group < 2) or topk_group > n_group:
            raise CheckpointFormatError(f"{experts} experts in {n_group} groups, {topk_group} kept (transformers "
                                        "scores a group by its top 2 experts)", culprit=where,
                                        hint="check n_routed_experts, n_group and topk_group")
        if topk > topk_group * experts // n_group:
            raise CheckpointFormatError(f"num_experts_per_tok {topk} exceeds the experts of {topk_group} groups",
                                        culprit=where, hint="check num_experts_per_tok, n_group and topk_group")
        try:
            routing = group_routing(topk, n_group, topk_group)
        except ValueError:
            raise refuse(f"n_group {n_group}, topk_group {topk_group}, num_experts_per_tok {topk} (transformers "
                         "scores a group by the sum of its top 2 experts, megatron-core by its top "
                         f"num_experts_per_tok / topk_group = {topk // topk_group})") from None
        if topk > 1 and not c["norm_topk_prob"]:
            raise refuse("norm_topk_prob false with more than one expert per token (megatron-core renormalizes)")
        if topk == 1 and c["norm_topk_prob"]:
            raise refuse("norm_topk_prob with one expert per token (megatron-core keeps the raw sigmoid score)")
        shared = int(c["n_shared_experts"] or 0)
        if shared < 1:
            raise refuse("no shared expert (n_shared_experts 0)")
        dense = int(c["first_k_dense_replace"] or 0)
        if not 0 <= dense < layers:
            raise refuse(f"first_k_dense_replace {dense} of {layers} layers (no MoE layer left)")
        moe_ffn = need("moe_intermediate_size")
        scaling = float(c["routed_scaling_factor"] if c["routed_scaling_factor"] is not None else 1.0)
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True,
            position_embedding_type="rope", rotary_base=base, rotary_percent=partial, rotary_interleaved=False,
            add_bias_linear=False, add_qkv_bias=bool(c["attention_bias"]), qk_layernorm=bool(c["use_qk_norm"]),
            max_position_embeddings=need("max_position_embeddings"),
            num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=moe_ffn * shared, moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_num_groups=routing[0] if routing else None,
            moe_router_group_topk=routing[1] if routing else None,
            moe_router_topk_scaling_factor=scaling, moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none", moe_layer_freq=[0] * dense + [1] * (layers - dense),
            expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False, mtp_num_layers=None)
        return megatron_model(self.name, self.names, vocab=need("vocab_size"), hidden=hidden, layers=layers,
                              heads=heads, groups=groups, head_dim=head_dim, ffn=need("intermediate_size"),
                              tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model with ordinary attention whose MoE layers route by sigmoid scores with an expert
        bias (what no other class computes): GLM-4.5's ``config.json``, or the refusal of what it
        does not compute; None for any other model."""
        has = has_key(keys)
        sigmoid = saved_arg(args, "moe_router_score_function", default="softmax") == "sigmoid"
        if not has(r"\.self_attention\.linear_qkv\.weight$") or not has(r"\.mlp\.router\.weight$") or not (
                sigmoid or has(r"\.mlp\.router\.expert_bias$")):
            return None
        if has(r"\.(?:self_attention\.(?:in_proj\.weight|softmax_offset)|mixer\.in_proj\.weight)$"):
            return None  # gated DeltaNet or Mamba layers, attention sinks: the classes claiming those names decide
        norm, qk_norm = decided_norm(args, facts, keys)  # the checks every built-in export starts with
        for flag, what in (("add_bias_linear", "linear biases besides the QKV's"),
                           ("moe_shared_expert_gate", "a gated shared expert"),
                           ("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter")):
            if saved_arg(args, flag, default=False):
                raise not_exact(f"{what} ({flag})")
        if norm != "RMSNorm":
            raise not_exact(f"normalization {norm} (Glm4Moe uses RMSNorm)")
        if not facts.swiglu:
            raise not_exact("the MLP is not SwiGLU")
        if saved_arg(args, "position_embedding_type") != "rope" or has(r"position_embeddings\."):
            raise not_exact(f"position embedding {saved_arg(args, 'position_embedding_type')} (rotary needed)")
        partial = float(saved_arg(args, "rotary_percent", default=1.0))
        rotary = (facts.head_dim or 0) * partial  # decided_norm refused a model whose head dim is unknown
        if rotary != int(rotary) or int(rotary) % 2:
            raise not_exact(f"rotary_percent {partial} of head dim {facts.head_dim} (not an even number of dims)")
        biased = sorted(k for k in keys if k.endswith(".bias") and ".linear_qkv." not in k)
        if biased:
            raise not_exact(f"biases besides the QKV's ({biased[0]}; Glm4Moe has a QKV bias alone)")
        if not sigmoid:
            raise not_exact("a router expert bias with softmax scores (Glm4Moe routes on sigmoid scores)")
        if not has(r"\.mlp\.router\.expert_bias$"):
            raise not_exact("a sigmoid router without expert bias (Glm4Moe has e_score_correction_bias)")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise not_exact("the router's top-k is unknown (the saved args lack moe_router_topk)")
        n_group, topk_group = saved_arg(args, "moe_router_num_groups"), saved_arg(args, "moe_router_group_topk")
        n_group, topk_group = (n_group, topk_group) if n_group and n_group > 1 and topk_group else (1, 1)
        try:
            group_routing(topk, n_group, topk_group)
        except ValueError:
            raise not_exact(f"moe_router_num_groups {n_group}, moe_router_group_topk {topk_group}, moe_router_topk "
                            f"{topk} (megatron-core scores a group by its top {topk // topk_group} experts, "
                            "Glm4Moe by its top 2)") from None
        if topk_group >= n_group:
            n_group = topk_group = 1
        moe_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.router.weight")}
        dense = sorted(set(range(facts.num_layers)) - moe_layers)
        if dense != list(range(len(dense))):
            raise not_exact(f"dense layers {dense} (Glm4Moe's dense layers are the first ones)")
        shared_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.shared_experts.linear_fc1.weight")}
        moe_ffn, shared_ffn = widths.get("expert"), widths.get("shared")
        if shared_layers != moe_layers or not moe_ffn or not shared_ffn or shared_ffn % moe_ffn:
            raise not_exact(f"MoE layers without a shared expert, or one of width {shared_ffn}, not a multiple of the "
                            f"routed experts' {moe_ffn} (Glm4Moe's is n_shared_experts x moe_intermediate_size)")
        mtp = mtp_layers(facts)
        if mtp and facts.tied_embeddings:
            raise not_exact("tied embeddings with multi-token prediction layers (their copies are of an untied head)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        base = float(saved_arg(args, "rotary_base", default=ROPE_BASE_DEFAULT))
        scaling = saved_arg(args, "moe_router_topk_scaling_factor")
        max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
        config: dict[str, Any] = {
            "architectures": [self.name], "model_type": "glm4_moe",
            "vocab_size": facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source,
            "hidden_size": facts.hidden, "intermediate_size": widths.get("dense") or moe_ffn,
            "moe_intermediate_size": moe_ffn, "num_hidden_layers": facts.num_layers,
            "num_attention_heads": facts.heads, "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim,
            "partial_rotary_factor": partial,
            "rope_parameters": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": partial},
            "attention_bias": has(r"\.linear_qkv\.bias$"), "use_qk_norm": qk_norm, "hidden_act": "silu",
            "rms_norm_eps": float(saved_arg(args, "norm_epsilon", default=1e-5)),
            "n_routed_experts": experts, "n_shared_experts": shared_ffn // moe_ffn, "num_experts_per_tok": topk,
            "routed_scaling_factor": float(scaling) if scaling else 1.0, "n_group": n_group,
            "topk_group": topk_group, "norm_topk_prob": topk > 1, "first_k_dense_replace": len(dense),
            "num_nextn_predict_layers": mtp, "tie_word_embeddings": bool(facts.tied_embeddings),
            "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "use_cache": True}
        if isinstance(max_pos, int):
            config["max_position_embeddings"] = max_pos
        notes = ()
        if saved_arg(args, "moe_router_dtype") != "fp32":
            notes = ("router logits in float32 (transformers' Glm4Moe; megatron-core's args do not say "
                     "--moe-router-dtype fp32)",)
        return HFArchitecture(name=self.name, config=config, names=self.names, notes=notes,
                              reason=f"partial rotary ({partial:g}), {experts} sigmoid-routed experts with expert bias "
                                     f"and a shared expert, top-{topk}"
                                     + (f" in {topk_group} of {n_group} groups" if n_group > 1 else ""))


GLM4_MOE = Glm4Moe()
