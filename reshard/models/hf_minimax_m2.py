"""transformers' ``MiniMaxM2ForCausalLM`` (MiniMax-M2; ``models/minimax_m2``), Hugging Face ->
Hugging Face only: bf16 <-> FP8 block releases (``--to hf``, ``--quantize fp8``).

The arithmetic, read from transformers 5.24:

* attention: Llama's projections without biases, partial rotary (``rope_parameters``'
  ``partial_rotary_factor``, else the releases' ``rotary_dim / head_dim``), halves not interleaved;
  ``q_norm`` and ``k_norm`` are one RMSNorm over the *whole* projection, ``[heads x head_dim]``
  (``[kv_heads x head_dim]``), before the heads are split;
* every layer MoE: a router ``block_sparse_moe.gate`` whose float32 logits go through a sigmoid,
  top-k chosen on the scores plus ``e_score_correction_bias``, weighted by the scores without it,
  always renormalized; experts ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
  (down) as saved (transformers 5 fuses them into ``gate_up_proj`` in memory and splits them back
  when saving); no shared expert.

megatron-core 0.16.1 cannot compute the norm: ``qk_layernorm`` builds ``q_layernorm`` /
``k_layernorm`` of ``hidden_size_per_attention_head`` and applies them to each head's
``[..., heads, head_dim]`` (``transformer/attention.py``), and ``qk_l2_norm`` has no weights; a
norm over all heads would also need their variance across tensor-parallel ranks. So a MiniMax-M2
folder is read under megatron-core names (the whole-width norms as ``q_layernorm`` /
``k_layernorm``) only to be written back as a Hugging Face folder: :attr:`MiniMaxM2.hf_only`
names the norm the ``hf`` format refuses any other output for, and :meth:`MiniMaxM2.decide`
refuses a megatron-core model of MiniMax-M2's kind (its per-head norm is not MiniMax-M2's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    GatedSplit,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    Same,
    name_table,
)
from reshard.models.hf_common import (
    CORE_LAYER,
    EXPERT_FC1,
    EXPERT_FC2,
    HF_LAYER,
    config_int,
    has_key,
    megatron_model,
    not_exact,
    rope_of,
)
from reshard.models.hf_qwen import QWEN3_NAMES
from reshard.models.megatron_gpt import experts_per_layer

_L, _H = CORE_LAYER, HF_LAYER + "block_sparse_moe."
#: Llama's attention and norms with the query/key norms under Qwen3's names (here each over the
#: whole projection), every MLP a MoE layer of Mixtral's names with the router's expert bias.
MINIMAX_M2_NAMES: NameTable = tuple(row for row in QWEN3_NAMES if ".mlp.linear_fc" not in row.core[0]) + name_table(
    (_L + "mlp.router.weight", Same(), (_H + "gate.weight",)),
    (_L + "mlp.router.expert_bias", Same(), (_H + "e_score_correction_bias",)),
    (EXPERT_FC1, GatedSplit(), (_H + "experts.{expert}.w1.weight", _H + "experts.{expert}.w3.weight"), LINEAR),
    (EXPERT_FC2, Same(), (_H + "experts.{expert}.w2.weight",), LINEAR),
)

#: Where an import of a MiniMax-M2 folder keeps its ``config.json`` in the ``args``: what the export
#: back writes (and how it tells this model from a megatron-core one, which has no such arg).
CONFIG_ARG = "hf_minimax_m2_config"

#: transformers' MiniMaxM2Config defaults for what a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts_per_tok": 8}
#: transformers' default expert count, under either name (``num_experts`` is its alias).
_EXPERTS = 256
#: The norm megatron-core does not compute, in the words of every refusal.
NORM = ("q_norm / k_norm: one RMSNorm over the whole query/key projection (heads x head_dim), which "
        "megatron-core's qk_layernorm computes per head")


def expert_count(config: Mapping[str, Any]) -> Any:
    """The routed experts ``config.json`` says: ``num_local_experts``, else its alias ``num_experts``,
    else transformers' default."""
    for key in ("num_local_experts", "num_experts"):
        if config.get(key) is not None:
            return config[key]
    return _EXPERTS


def partial_rotary(c: Mapping[str, Any], head_dim: int) -> float:
    """The rotated share of each head: ``rope_parameters``' ``partial_rotary_factor``, else the
    releases' ``rotary_dim / head_dim`` (as transformers' config reads it), else all of it."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    if c.get("rotary_dim") is not None:
        return float(c["rotary_dim"]) / head_dim
    return rope_of(c)[2]


class MiniMaxM2(HFArchitectureFamily):
    """transformers' ``MiniMaxM2ForCausalLM``: its folders read and written back, bf16 or FP8 blocks;
    no megatron-core layout either way (:data:`NORM`)."""

    name = "MiniMaxM2ForCausalLM"
    #: Before GLM-4.5's class, which claims every sigmoid-routed model with an expert bias: this one's
    #: folders' models and its refusal of a megatron-core model of its kind are this class's word.
    priority = -1
    model_types = ("minimax_m2",)
    names = MINIMAX_M2_NAMES
    hf_only = NORM

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        """The folder's model under megatron-core names, its ``config.json`` kept whole in the
        ``args`` (:data:`CONFIG_ARG`) for the export back: a release's own fields (``rotary_dim``,
        ``auto_map``, what vLLM reads) are no megatron-core fact to rebuild them from."""
        c = {**_DEFAULTS, **config}
        need = config_int(c, where)
        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        head_dim = c.get("head_dim") or hidden // heads
        base, partial = rope_of(c)[0], partial_rotary(c, head_dim)
        experts, topk = expert_count(c), need("num_experts_per_tok")
        if not isinstance(experts, int) or not 0 < topk <= experts:
            raise CheckpointFormatError(f"num_experts_per_tok {topk} of {experts!r} experts", culprit=where,
                                        hint="check num_experts_per_tok and num_local_experts in config.json")
        moe_ffn = need("intermediate_size")
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True,  # act(w1 x) * w3 x
            position_embedding_type="rope", rotary_base=base, rotary_percent=partial, rotary_interleaved=False,
            add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,
            max_position_embeddings=need("max_position_embeddings"), num_experts=experts, moe_router_topk=topk,
            moe_ffn_hidden_size=moe_ffn, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_dtype="fp32", moe_router_pre_softmax=False, moe_router_load_balancing_type="none",
            moe_layer_freq=1, expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False,
            **{CONFIG_ARG: dict(config)})
        return megatron_model(self.name, self.names, vocab=need("vocab_size"), hidden=hidden, layers=layers,
                              heads=heads, groups=need("num_key_value_heads"), head_dim=head_dim, ffn=moe_ffn,
                              tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A MiniMax-M2 folder's model (its ``config.json`` in the ``args``): that ``config.json``,
        the weights' dtype in it; a megatron-core model of MiniMax-M2's kind (query/key norms, sigmoid
        routing with an expert bias, no shared expert) refused naming the norm; None otherwise."""
        has = has_key(keys)
        carried = saved_arg(args, CONFIG_ARG)
        if not isinstance(carried, dict):
            if (has(r"\.self_attention\.linear_qkv\.weight$") and has(r"\.self_attention\.q_layernorm\.weight$")
                    and has(r"\.mlp\.router\.expert_bias$") and not has(r"\.mlp\.shared_experts\.")):
                raise not_exact(f"{self.name} has {NORM} (only MiniMax-M2's own folders are written as it)")
            return None
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        c = {**_DEFAULTS, **carried}
        said = {"num_hidden_layers": (c["num_hidden_layers"], facts.num_layers),
                "hidden_size": (c["hidden_size"], facts.hidden), "num_local_experts": (expert_count(c), experts)}
        wrong = [f"{k} {config} (the weights: {weights})" for k, (config, weights) in said.items() if config != weights]
        if wrong:
            raise not_exact(f"its config.json says {wrong[0]}")
        config = {k: v for k, v in carried.items() if k not in ("quantization_config", "torch_dtype")}
        config["dtype"] = HF_DTYPES.get(dtype, str(dtype))
        return HFArchitecture(name=self.name, config=config, names=self.names,
                              reason=f"the MiniMax-M2 folder's model: {experts} sigmoid-routed experts with expert "
                                     "bias, query/key RMSNorm over all heads")

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        raise LayoutError(f"the model is {decided.name} ({decided.reason}); {self.name} has {NORM}",
                          culprit="--hf-architecture", hint=f"drop --hf-architecture, or give {decided.name}")


MINIMAX_M2 = MiniMaxM2()
