"""transformers' ``DeepseekV3ForCausalLM`` (DeepSeek-V3/R1, Kimi-K2's folders) both ways: megatron-core's
multi-latent attention and DeepSeek MoE (the family of :mod:`reshard.models.deepseek`), its name
table, ``config.json`` <-> Megatron-LM ``args``, and every setting the two libraries compute
differently, refused by name (the facts, with the code lines they were read from:
``docs/deepseek-v3-notes.md``).

Every MLA tensor is the same bytes under another name (rows head-major in both libraries): no
transform but renaming. megatron-core's MLA de-interleaves the rope dims, which is transformers'
``rope_interleave=True``: the default, and the only one read.

Multi-token prediction layers: the folder holds them as decoder layers after the model's own
(``model.layers.{num_hidden_layers + i}``), which a table's templates cannot count; the table names
them ``model.mtp_layers.{i}`` (:data:`MTP_HF`), renamed both ways by this architecture's hooks
(:meth:`DeepseekV3.folder_name`, :meth:`DeepseekV3.table_name`). Each also holds copies of the
shared embedding and output layer (:class:`SharedCopies`; not imported).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.deepseek import MLA_KEY, mtp_layer_count, mtp_layers
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    GatedSplit,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    OutTensor,
    Run,
    Same,
    VocabRows,
    name_table,
)
from reshard.models.hf_common import (
    CORE_LAYER,
    EXPERT_FC1,
    EXPERT_FC2,
    EXTRA_STATE,
    HF_LAYER,
    NOT_EXPORTED_FLAGS,
    rope_from_hf,
    rope_to_hf,
)
from reshard.models.megatron_gpt import MTP_LAYERS, experts_per_layer, stack_layer

#: Multi-token prediction layer ``i`` in the table (the folder's ``model.layers.{num_hidden_layers + i}``).
MTP_HF = "model.mtp_layers."
#: The copies of the shared embedding and output layer in each multi-token prediction layer (table names).
MTP_SHARED_COPIES = re.compile(r"^model\.mtp_layers\.\d+\.(?:embed_tokens|shared_head\.head)\.weight$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_NAME = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def mtp_to_hf(name: str, num_layers: int) -> str:
    """A table's ``model.mtp_layers.{i}.`` name as the folder's ``model.layers.{num_layers + i}.``."""
    return _MTP_NAME.sub(lambda m: f"model.layers.{num_layers + int(m.group(1))}.", name, count=1)


def hf_to_mtp(name: str, num_layers: int) -> str:
    """A folder's layer beyond the model's ``num_layers`` under the table's ``model.mtp_layers.`` name."""
    m = _HF_LAYER.match(name)
    if m is None or int(m.group(1)) < num_layers:
        return name
    return f"{MTP_HF}{int(m.group(1)) - num_layers}.{name[m.end():]}"


_L, _H = CORE_LAYER, HF_LAYER
_A, _HA = _L + "self_attention.", _H + "self_attn."


class SharedCopies(VocabRows):
    """The word embeddings or the output layer, and DeepSeek's copy of it in every multi-token
    prediction layer (``model.layers.{L + i}.embed_tokens`` / ``shared_head.head``, which vLLM's
    MTP reads): the same rows, written once per copy. Import reads the first; the copies are the
    same tensor (:data:`MTP_SHARED_COPIES`)."""

    def __init__(self, copy: str) -> None:
        self.copy = copy

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        first = super().outputs(names, shape, facts)[0]
        return [first] + [OutTensor(mtp_to_hf(f"{MTP_HF}{i}.{self.copy}", facts.num_layers), first.shape)
                          for i in range(mtp_layers(facts))]

    def copies(self, keys: Collection[str]) -> int:
        return 1 + mtp_layer_count(keys)

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        run = super().runs(shape, itemsize, facts)[0]
        return [dataclasses.replace(run, out=i) for i in range(1 + mtp_layers(facts))]


#: The word embeddings and the output layer, with their copies in each multi-token prediction layer.
SHARED_COPIES_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", SharedCopies("embed_tokens.weight"), ("model.embed_tokens.weight",)),
    ("output_layer.weight", SharedCopies("shared_head.head.weight"), ("lm_head.weight",)),
)
#: A megatron-core MoE layer with a sigmoid router's expert bias (``e_score_correction_bias``), routed
#: experts and a shared expert <-> DeepSeek MoE's names (GLM-4.5 names its MoE layers alike).
DEEPSEEK_MOE_NAMES: NameTable = name_table(
    (_L + "mlp.router.weight", Same(), (_H + "mlp.gate.weight",)),
    (_L + "mlp.router.expert_bias", Same(), (_H + "mlp.gate.e_score_correction_bias",)),
    (EXPERT_FC1, GatedSplit(), (_H + "mlp.experts.{expert}.gate_proj.weight",
                                _H + "mlp.experts.{expert}.up_proj.weight"), LINEAR),
    (EXPERT_FC2, Same(), (_H + "mlp.experts.{expert}.down_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.linear_fc1.weight", GatedSplit(),
     (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), LINEAR),
    (_L + "mlp.shared_experts.linear_fc2.weight", Same(), (_H + "mlp.shared_experts.down_proj.weight",), LINEAR),
)

#: megatron-core (local spec) <-> transformers' DeepseekV3ForCausalLM; every linear weight is FP8
#: in DeepSeek's own release (``LINEAR``), the router, norms, embeddings and head are not.
_DECODER_NAMES: NameTable = SHARED_COPIES_NAMES + name_table(
    (_L + "input_layernorm.weight", Same(), (_H + "input_layernorm.weight",)),
    (_A + "linear_q_down_proj.weight", Same(), (_HA + "q_a_proj.weight",), LINEAR),
    ((_A + "q_layernorm.weight", _A + "linear_q_up_proj.layer_norm_weight"), Same(), (_HA + "q_a_layernorm.weight",)),
    (_A + "linear_q_up_proj.weight", Same(), (_HA + "q_b_proj.weight",), LINEAR),
    (_A + "linear_q_proj.weight", Same(), (_HA + "q_proj.weight",), LINEAR),
    (_A + "linear_kv_down_proj.weight", Same(), (_HA + "kv_a_proj_with_mqa.weight",), LINEAR),
    ((_A + "kv_layernorm.weight", _A + "linear_kv_up_proj.layer_norm_weight"), Same(),
     (_HA + "kv_a_layernorm.weight",)),
    (_A + "linear_kv_up_proj.weight", Same(), (_HA + "kv_b_proj.weight",), LINEAR),
    (_A + "linear_proj.weight", Same(), (_HA + "o_proj.weight",), LINEAR),
    ((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"), Same(),
     (_H + "post_attention_layernorm.weight",)),
    (_L + "mlp.linear_fc1.weight", GatedSplit(), (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), LINEAR),
    (_L + "mlp.linear_fc2.weight", Same(), (_H + "mlp.down_proj.weight",), LINEAR),
    ("decoder.final_layernorm.weight", Same(), ("model.norm.weight",)),
    (EXTRA_STATE, None, ()),
) + DEEPSEEK_MOE_NAMES

_M, _HM = MTP_LAYERS + "{layer}.", MTP_HF + "{layer}."


def mtp_names(table: NameTable) -> NameTable:
    """Multi-token prediction layer ``i``: megatron-core's ``mtp.layers.{i}`` <-> the folder's
    ``model.layers.{num_hidden_layers + i}`` (in the table as ``model.mtp_layers.{i}``, see
    :data:`MTP_HF`): its norms, ``eh_proj`` and a decoder layer
    under the decoder layer's own names; ``final_layernorm`` is ``shared_head.norm``."""
    own = name_table((_M + "enorm.weight", Same(), (_HM + "enorm.weight",)),
                     (_M + "hnorm.weight", Same(), (_HM + "hnorm.weight",)),
                     (_M + "eh_proj.weight", Same(), (_HM + "eh_proj.weight",)),
                     (_M + "final_layernorm.weight", Same(), (_HM + "shared_head.norm.weight",)))
    layer = tuple(dataclasses.replace(
        row, core=tuple(_M + "transformer_layer." + c[len(_L):] for c in row.core),
        hf=tuple(_HM + h[len(_H):] for h in row.hf)) for row in table if row.core[0].startswith(_L))
    return own + layer


#: The whole table: the multi-token prediction layers', then the decoder's.
DEEPSEEK_V3_NAMES: NameTable = mtp_names(_DECODER_NAMES) + _DECODER_NAMES

#: transformers' DeepseekV3Config defaults for what a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "rope_interleave": True, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
}
#: The epsilon transformers fixes for the two latent norms (``q_a_layernorm``, ``kv_a_layernorm``);
#: megatron-core has one epsilon for every norm, so only models whose ``rms_norm_eps`` is this are exact.
LATENT_NORM_EPS = 1e-6


class CarriesMtpLayers(HFArchitectureFamily):
    """A class whose releases carry multi-token prediction layers as DeepSeek-V3's do (DeepSeek-V3,
    GLM-4.5): decoder layers after the model's own in the folder, ``mtp.layers.{i}`` in megatron-core
    (the table's :data:`MTP_HF` names, renamed both ways here; the copies of the embeddings and head
    in each are written, never imported)."""

    #: The model transformers saves without the layers (for the import's warning).
    saved_without = "the model"

    # -- multi-token prediction layers' names (see the module docstring) --------------------------
    def folder_name(self, name: str, facts: ModelFacts) -> str:
        return mtp_to_hf(name, facts.num_layers)

    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        name = hf_to_mtp(name, facts.num_layers)
        return None if MTP_SHARED_COPIES.match(name) else name

    def args_from_weights(self, module: Mapping[str, Any], model: HFModel) -> dict[str, Any]:
        """``mtp_num_layers``: the multi-token prediction layers the folder holds (its config's count
        may be a default); a layer beyond ``num_hidden_layers`` is one only with its own modules."""
        mtp = {int(k.split(".")[2]) for k in module if k.startswith(MTP_LAYERS)}
        for i in sorted(mtp):
            if f"{MTP_LAYERS}{i}.eh_proj.weight" not in module or i >= len(mtp):
                where = f"model.layers.{model.facts.num_layers + i}"
                raise CheckpointFormatError(f"{where} is beyond num_hidden_layers {model.facts.num_layers} but no "
                                            "multi-token prediction layer (no eh_proj, or one missing before it)",
                                            culprit=where, hint="check num_hidden_layers in config.json")
        return {"mtp_num_layers": len(mtp)} if mtp else {}

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """``num_nextn_predict_layers`` beyond the multi-token prediction layers the folder holds:
        transformers declares the releases' MTP layer but saves no weights for it (its model has
        none). The output says what it holds (fewer layers: vLLM's MTP speculative decoding would
        look for weights that are not there), and this says why it changed."""
        declared = config.get("num_nextn_predict_layers")
        held = int(getattr(args, "mtp_num_layers", None) or 0)
        if not isinstance(declared, int) or declared <= held:
            return []
        return [f"num_nextn_predict_layers {declared} -> {held}: config.json declares {declared} multi-token "
                f"prediction layer{'s' if declared > 1 else ''} but the folder holds the weights of "
                f"{held or 'none'} (transformers saves {self.saved_without} without them)"]


class DeepseekV3(CarriesMtpLayers):
    """transformers' ``DeepseekV3ForCausalLM`` (also Kimi-K2's folders): megatron-core MLA + DeepSeek
    MoE, both ways, exactly or refused naming the setting."""

    name = "DeepseekV3ForCausalLM"
    priority = 0
    model_types = ("deepseek_v3", "kimi_k2")
    names = DEEPSEEK_V3_NAMES
    saved_without = "DeepSeek-V3"

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}

        def refuse(what: str) -> LayoutError:
            return LayoutError(f"megatron-core does not compute this {self.name} exactly: {what}", culprit=where,
                               hint="only models Megatron-LM reproduces exactly are imported")

        def need(key: str) -> int:
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool):
                raise CheckpointFormatError(f"has no integer {key}", culprit=where, hint="check config.json")
            return int(c[key])

        if c["hidden_act"] != "silu":
            raise refuse(f"activation {c['hidden_act']} (Megatron's SwiGLU is silu)")
        if c["attention_bias"]:
            raise refuse("attention_bias (megatron-core's MLA projections have no biases)")
        if not c["rope_interleave"]:
            raise refuse("rope_interleave false (megatron-core's MLA rotates interleaved rope dims)")
        eps = float(c["rms_norm_eps"])
        if eps != LATENT_NORM_EPS:
            raise refuse(f"rms_norm_eps {eps:g} (transformers' latent norms use {LATENT_NORM_EPS:g} whatever it "
                         "says; megatron-core has one epsilon)")
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            raise refuse(f"scoring_func {c['scoring_func']} (transformers' DeepseekV3 routes on sigmoid scores)")
        layers, heads, hidden = need("num_hidden_layers"), need("num_attention_heads"), need("hidden_size")
        topk, experts = need("num_experts_per_tok"), need("n_routed_experts")
        groups, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
        if groups > 1 and topk // topk_group != 2:
            raise refuse(f"group routing with num_experts_per_tok {topk} and topk_group {topk_group} (transformers "
                         "scores a group by its top 2 experts, megatron-core by its top k / topk_group)")
        if experts % groups or (groups > 1 and experts // groups < 2):
            raise CheckpointFormatError(f"{experts} experts in {groups} groups (transformers scores a group by its top "
                                        "2 experts)", culprit=where, hint="check n_routed_experts and n_group")
        if topk > topk_group * experts // groups:
            raise CheckpointFormatError(f"num_experts_per_tok {topk} exceeds the experts of {topk_group} groups",
                                        culprit=where, hint="check num_experts_per_tok, n_group and topk_group")
        if topk > 1 and not c["norm_topk_prob"]:
            raise refuse("norm_topk_prob false with more than one expert per token (megatron-core renormalizes)")
        if topk == 1 and c["norm_topk_prob"]:
            raise refuse("norm_topk_prob with one expert per token (megatron-core keeps the raw sigmoid score)")
        shared = int(c["n_shared_experts"] or 0)
        if shared < 1:
            raise refuse("no shared expert")
        dense = int(c["first_k_dense_replace"] or 0)
        if not 0 <= dense < layers:
            raise refuse(f"first_k_dense_replace {dense} of {layers} layers (no MoE layer left)")
        moe_ffn = need("moe_intermediate_size")
        q_lora = c.get("q_lora_rank")
        v_dim = need("v_head_dim")
        rope = rope_from_hf(c, refuse)
        max_pos = need("max_position_embeddings")
        vocab = need("vocab_size")
        tied = bool(c["tie_word_embeddings"])
        scaling = float(c["routed_scaling_factor"] or 1.0)
        args = argparse.Namespace(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=need("intermediate_size"),
            # kv_channels as Megatron-LM and Megatron-Bridge leave it (hidden / heads): MLA's widths are its own
            num_attention_heads=heads, kv_channels=hidden // heads, group_query_attention=False,
            multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=need("kv_lora_rank"),
            qk_head_dim=need("qk_nope_head_dim"), qk_pos_emb_head_dim=need("qk_rope_head_dim"), v_head_dim=v_dim,
            qk_layernorm=True, normalization="RMSNorm", norm_epsilon=eps, swiglu=True,
            position_embedding_type="rope", rotary_percent=1.0, rotary_interleaved=False,
            **rope, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=not tied,
            vocab_size=vocab, padded_vocab_size=vocab, max_position_embeddings=max_pos, seq_length=max_pos,
            num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=moe_ffn * shared, moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=topk_group if groups > 1 else None,
            # pre-softmax as Megatron-Bridge's DeepSeek-V3 records it (with sigmoid scores megatron-core reads it not)
            moe_router_topk_scaling_factor=scaling, moe_router_pre_softmax=True,
            moe_router_load_balancing_type="none", moe_layer_freq=[0] * dense + [1] * (layers - dense),
            expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False,
            mtp_num_layers=None, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            transformer_impl="local", use_legacy_models=False, ckpt_format="torch")
        facts = ModelFacts(naming="megatron-core", num_layers=layers, hidden=hidden, heads=heads, query_groups=heads,
                           head_dim=v_dim, swiglu=True, tied_embeddings=tied, vocab_size=vocab,
                           padded_vocab_source=vocab, padded_vocab_target=None, make_vocab_size_divisible_by=None,
                           source_pp_layers=(layers,), target_pp_layers=(layers,))
        return HFModel(self.name, args, facts, self.names)

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        if not any(MLA_KEY.match(k) for k in keys):
            return None

        def refuse(what: str) -> LayoutError:
            return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                               hint="keep it in a Megatron layout (DeepseekV3ForCausalLM needs DeepSeek's settings)")

        def has(pattern: str) -> bool:
            return any(re.search(pattern, k) for k in keys)

        for flag, what in (*NOT_EXPORTED_FLAGS, ("add_bias_linear", "linear biases"),
                           ("moe_shared_expert_gate", "a gated shared expert"),
                           ("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter")):
            if saved_arg(args, flag, default=False):
                raise refuse(f"{what} ({flag})")
        if saved_arg(args, "position_embedding_type", default="rope") not in ("rope", "none"):
            raise refuse(f"position embedding {saved_arg(args, 'position_embedding_type')} "
                         "(MLA rotates its own rope dims)")
        if float(saved_arg(args, "rotary_percent", default=1.0)) != 1.0:
            raise refuse(f"rotary_percent {saved_arg(args, 'rotary_percent')} (the whole rope head must rotate)")
        if saved_arg(args, "normalization") != "RMSNorm":
            raise refuse(f"normalization {saved_arg(args, 'normalization')} (DeepseekV3 uses RMSNorm)")
        if not facts.swiglu:
            raise refuse("the MLP is not SwiGLU")
        eps = float(saved_arg(args, "norm_epsilon", default=1e-5))
        if eps != LATENT_NORM_EPS:
            raise refuse(f"norm epsilon {eps:g} (transformers fixes the latent norms' at {LATENT_NORM_EPS:g})")
        if not has(r"\.self_attention\.(?:kv_layernorm\.weight|linear_kv_up_proj\.layer_norm_weight)$"):
            raise refuse("MLA without latent norms (qk_layernorm false)")
        if not has(r"\.mlp\.router\.weight$"):
            raise refuse("no MoE layer (DeepseekV3's layers after first_k_dense_replace are MoE)")
        if saved_arg(args, "moe_router_score_function", default="softmax") != "sigmoid":
            raise refuse("router scores by softmax (DeepseekV3 routes on sigmoid scores)")
        if not has(r"\.mlp\.router\.expert_bias$"):
            raise refuse("a router without expert bias (DeepseekV3 has e_score_correction_bias)")
        if has(r"\.mlp\.router\.bias$"):
            raise refuse("a router bias")
        if not has(r"\.mlp\.shared_experts\.linear_fc1\.weight$"):
            raise refuse("MoE layers without a shared expert")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise refuse("the router's top-k is unknown (the saved args lack moe_router_topk)")
        groups, group_topk = saved_arg(args, "moe_router_num_groups"), saved_arg(args, "moe_router_group_topk")
        if not (groups and groups > 1 and group_topk):  # megatron-core routes over every expert then
            groups = group_topk = None
        if groups and topk // group_topk != 2:
            raise refuse(f"group routing with top-k {topk} and group top-k {group_topk} (transformers scores a "
                         "group by its top 2 experts)")
        moe_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.router.weight")}
        dense = sorted(set(range(facts.num_layers)) - moe_layers)
        if dense != list(range(len(dense))):
            raise refuse(f"dense layers {dense} (DeepseekV3's dense layers are the first ones)")
        moe_ffn, shared_ffn = widths.get("expert"), widths.get("shared")
        if not moe_ffn or not shared_ffn or shared_ffn % moe_ffn:
            raise refuse(f"a shared expert of width {shared_ffn}, not a multiple of the routed experts' {moe_ffn} "
                         "(DeepseekV3's is n_shared_experts x moe_intermediate_size)")
        mtp = mtp_layers(facts)
        if mtp and facts.tied_embeddings:
            raise refuse("tied embeddings with multi-token prediction layers (DeepSeek's MTP layers hold a copy of "
                         "an untied head)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        rope = rope_to_hf(args, refuse)
        q_lora = saved_arg(args, "q_lora_rank") if has(r"\.linear_q_down_proj\.weight$") else None
        heads, v_dim = facts.heads, saved_arg(args, "v_head_dim")
        vocab = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
        max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
        scaling = saved_arg(args, "moe_router_topk_scaling_factor")
        config: dict[str, Any] = {
            "architectures": [self.name], "model_type": "deepseek_v3", "vocab_size": vocab,
            "hidden_size": facts.hidden, "intermediate_size": widths.get("dense") or moe_ffn,
            "moe_intermediate_size": moe_ffn, "num_hidden_layers": facts.num_layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "n_shared_experts": shared_ffn // moe_ffn, "n_routed_experts": experts,
            "routed_scaling_factor": float(scaling) if scaling else 1.0,
            "kv_lora_rank": saved_arg(args, "kv_lora_rank"),
            "q_lora_rank": q_lora, "qk_rope_head_dim": saved_arg(args, "qk_pos_emb_head_dim"), "v_head_dim": v_dim,
            "qk_nope_head_dim": saved_arg(args, "qk_head_dim"), "n_group": groups or 1,
            "topk_group": group_topk or 1, "num_experts_per_tok": topk,
            "first_k_dense_replace": len(dense), "norm_topk_prob": topk > 1, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": eps,
            "rope_parameters": rope, "rope_theta": rope["rope_theta"], "rope_interleave": True, "attention_bias": False,
            "tie_word_embeddings": bool(facts.tied_embeddings),
            "num_nextn_predict_layers": mtp,
            "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None, "use_cache": True,
        }
        if isinstance(max_pos, int):
            config["max_position_embeddings"] = max_pos
        if rope["rope_type"] == "yarn":  # also as transformers 4 and DeepSeek's own config.json say it
            config["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope.items() if k != "rope_theta"}}
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim")
                   if not isinstance(config[k], int)]
        if missing or (has(r"\.linear_q_down_proj\.weight$") and not isinstance(q_lora, int)):
            raise refuse(f"the MLA dims are unknown (the saved args lack {', '.join(missing) or 'q_lora_rank'})")
        notes = ("router logits in float32 (transformers' DeepseekV3 keeps its gate in float32)",)
        return HFArchitecture(name=self.name, config=config, names=self.names, notes=notes,
                              reason=f"multi-latent attention, RMSNorm, SwiGLU, {experts} sigmoid-routed experts with "
                                     f"expert bias and a shared expert, top-{topk}"
                                     + (f" in {group_topk} of {groups} groups" if groups else ""))


DEEPSEEK_V3 = DeepseekV3()
