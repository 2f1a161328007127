"""``NemotronHForCausalLM`` (transformers' ``models/nemotron_h``) both ways: megatron-core's hybrid
``MambaModel`` (:mod:`reshard.models.nemotron_h` is its megatron-core side): Mamba-2, attention,
squared-ReLU MLP and MoE layers.

=================================================  ===============================================  =========
Hugging Face (``backbone.layers.{l}.``)            megatron-core (``decoder.layers.{l}.``)          transform
=================================================  ===============================================  =========
``mixer.in_proj.weight`` ``[z; x; B; C; dt]``      ``mixer.in_proj.weight`` (same order)            same
``mixer.conv1d.{weight,bias}`` ``[x; B; C]``       ``mixer.conv1d.{weight,bias}``                   same
``mixer.{A_log,D,dt_bias,norm.weight}``            ``mixer.{A_log,D,dt_bias,norm.weight}``          same
``mixer.out_proj.weight``                          ``mixer.out_proj.weight``                        same
``norm.weight`` of a Mamba layer                   ``mixer.in_proj.layer_norm_weight``              same
``norm.weight`` of an attention layer              ``self_attention.linear_qkv.layer_norm_weight``  same
``mixer.{q,k,v}_proj.weight``                      ``self_attention.linear_qkv.weight``             QKV
``mixer.o_proj.weight``                            ``self_attention.linear_proj.weight``            same
``norm.weight`` of an MLP layer                    ``mlp.linear_fc1.layer_norm_weight``             same
``mixer.up_proj.weight``, ``mixer.down_proj``      ``mlp.linear_fc1.weight``, ``mlp.linear_fc2``    same
``norm.weight`` of an MoE layer                    ``pre_mlp_layernorm.weight``                     same
``mixer.gate.weight`` (float32)                    ``mlp.router.weight`` (float32)                  same
``mixer.gate.e_score_correction_bias``             ``mlp.router.expert_bias``                       same
``mixer.experts.{e}.{up,down}_proj.weight``        ``mlp.experts.linear_fc{1,2}.weight{e}``         same
``mixer.shared_experts.{up,down}_proj.weight``     ``mlp.shared_experts.linear_fc{1,2}.weight``     same
``backbone.embeddings.weight``                     ``embedding.word_embeddings.weight``             vocab
``backbone.norm_f.weight``                         ``decoder.final_norm.weight``                    same
``lm_head.weight``                                 ``output_layer.weight``                          vocab
=================================================  ===============================================  =========

A layer's ``norm.weight`` is one Hugging Face name for four megatron-core ones: the table spells it
per layer kind (``norm.weight#M`` ...) and :meth:`NemotronHForCausalLM.table_name` /
:meth:`~NemotronHForCausalLM.folder_name` read and write the folder's name by the layer pattern
(the model fact ``hybrid_override_pattern``). transformers 5 loads a folder whose names start with
``model.`` the same (its conversion mapping renames ``backbone.``); ``save_pretrained`` writes
``backbone.``, which the export writes.

The arithmetic, read from transformers 5.24 (``modeling_nemotron_h.py``) and megatron-core 0.16.1
(``ssm/mamba_mixer.py``, ``ssm/mamba_block.py``):

* each layer is ``x + mixer(RMSNorm(x))``; attention has no rotary embedding (megatron-core's
  ``position_embedding_type`` ``none``), MLPs are ``down(relu(up(x))^2)`` (Megatron-LM's
  ``--squared-relu``), no linear biases;
* MoE layers: sigmoid scores of the router's logits (float32), the top-k chosen by score + expert
  bias, the chosen scores normalised when k > 1 and scaled by ``routed_scaling_factor``, squared-ReLU
  experts, plus one ungated shared expert — megatron-core's ``moe_router_score_function`` sigmoid
  with ``moe_router_enable_expert_bias``; the stack spec's experts are grouped
  (``linear_fc1.weight{e}``, the name the import writes; SequentialMLP's ``local_experts.{e}`` read);
* the mixer: ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)``, the SSD scan over heads with B and
  C shared by the ``n / g`` heads of a group, ``+ D x``, then the gated norm ``RMSNorm_g(y silu(z))``
  normalised per group of ``d / g`` channels, then ``out_proj``. megatron-core fixes the conv kernel
  (4), SiLU, no mixer biases and the gated norm's epsilon (1e-5), which transformers takes from
  ``layer_norm_epsilon``: a config that differs is refused, naming the field;
* transformers 5.24 clamps the step ``softplus(dt + dt_bias)`` from below at ``time_step_min``
  (0.001 in every release; ``time_step_limit`` is not read), megatron-core's scan clamps nothing
  (``mamba_chunk_scan_combined``'s default ``dt_limit`` ``(0, inf)``). The export writes
  ``time_step_min`` 0, so transformers computes megatron-core's arithmetic exactly; the import of a
  folder with a positive ``time_step_min`` warns (the two agree wherever every step is above it)
  rather than refusing every release.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    QKVSplit,
    Same,
    VocabRows,
    name_table,
)
from reshard.models.hf_common import EXTRA_STATE, config_int, has_key, import_refusal, megatron_model, not_exact
from reshard.models.megatron_gpt import core_module, experts_per_layer
from reshard.models.nemotron_h import (
    ATTENTION,
    CONV_KERNEL,
    MAMBA,
    MIXER_NORM_EPS,
    MLP,
    MOE,
    PATTERN_FACT,
    hybrid_pattern,
    layer_kind,
    mixer_dims,
)

_L, _H = "decoder.layers.{layer}.", "backbone.layers.{layer}."
#: A grouped expert's weight (``...mlp.experts.linear_fc1.weight{e}``): its linear layer's prefix.
_GROUPED_WEIGHT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.)weight\d+$")
#: The folder's name of every layer's pre-norm, and the table's spelling of it per layer kind.
_NORM = "norm.weight"
_KIND_MARK = "#"

#: megatron-core <-> transformers' Nemotron-H names (see the module table).
NEMOTRON_H_NAMES = name_table(
    ("embedding.word_embeddings.weight", VocabRows(), ("backbone.embeddings.weight",)),
    (_L + "mixer.in_proj.layer_norm_weight", Same(), (_H + _NORM + _KIND_MARK + MAMBA,)),
    (_L + "mixer.in_proj.weight", Same(), (_H + "mixer.in_proj.weight",), LINEAR),
    (_L + "mixer.conv1d.{p}", Same(), (_H + "mixer.conv1d.{p}",)),
    (_L + "mixer.A_log", Same(), (_H + "mixer.A_log",)),
    (_L + "mixer.D", Same(), (_H + "mixer.D",)),
    (_L + "mixer.dt_bias", Same(), (_H + "mixer.dt_bias",)),
    (_L + "mixer.norm.weight", Same(), (_H + "mixer.norm.weight",)),
    (_L + "mixer.out_proj.weight", Same(), (_H + "mixer.out_proj.weight",), LINEAR),
    (_L + "self_attention.linear_qkv.layer_norm_weight", Same(), (_H + _NORM + _KIND_MARK + ATTENTION,)),
    (_L + "self_attention.linear_qkv.weight", QKVSplit(),
     (_H + "mixer.q_proj.weight", _H + "mixer.k_proj.weight", _H + "mixer.v_proj.weight"), LINEAR),
    (_L + "self_attention.linear_proj.weight", Same(), (_H + "mixer.o_proj.weight",), LINEAR),
    (_L + "mlp.linear_fc1.layer_norm_weight", Same(), (_H + _NORM + _KIND_MARK + MLP,)),
    (_L + "mlp.linear_fc1.weight", Same(), (_H + "mixer.up_proj.weight",), LINEAR),
    (_L + "mlp.linear_fc2.weight", Same(), (_H + "mixer.down_proj.weight",), LINEAR),
    (_L + "pre_mlp_layernorm.weight", Same(), (_H + _NORM + _KIND_MARK + MOE,)),
    (_L + "mlp.router.weight", Same(), (_H + "mixer.gate.weight",)),
    (_L + "mlp.router.expert_bias", Same(), (_H + "mixer.gate.e_score_correction_bias",)),
    ((_L + "mlp.experts.linear_fc1.weight{expert}", _L + "mlp.experts.local_experts.{expert}.linear_fc1.weight"),
     Same(), (_H + "mixer.experts.{expert}.up_proj.weight",), LINEAR),
    ((_L + "mlp.experts.linear_fc2.weight{expert}", _L + "mlp.experts.local_experts.{expert}.linear_fc2.weight"),
     Same(), (_H + "mixer.experts.{expert}.down_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.linear_fc1.weight", Same(), (_H + "mixer.shared_experts.up_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.linear_fc2.weight", Same(), (_H + "mixer.shared_experts.down_proj.weight",), LINEAR),
    ("decoder.final_norm.weight", Same(), ("backbone.norm_f.weight",)),
    ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
    (EXTRA_STATE, None, ()),
)

#: The ``config.json`` layer kinds (``layers_block_type``, legacy spellings included) as megatron-core's
#: ``hybrid_override_pattern`` symbols, and back (transformers' current spelling).
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
          "mlp": MLP, "moe": MOE}
_KIND_NAMES = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}
_HF_KIND_NAMES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", MOE: "moe"}
#: Megatron-LM's ``--spec`` of megatron-core's hybrid stack.
STACK_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]

#: transformers' ``NemotronHConfig`` defaults for what a ``config.json`` may leave out.
_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "use_bias": False,
    "mamba_proj_bias": False, "use_conv_bias": True, "conv_kernel": 4, "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "sliding_window": None,
    "num_nextn_predict_layers": 0, "moe_latent_size": None, "max_position_embeddings": 4096}


def config_pattern(c: Mapping[str, Any], where: str) -> str:
    """The layer pattern of a ``config.json``: ``layers_block_type`` (a list of kinds), else the older
    ``hybrid_override_pattern`` string; checked against ``num_hidden_layers`` where it is given."""
    kinds = c.get("layers_block_type") or c.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or any(k not in _KINDS for k in kinds):
            raise CheckpointFormatError(f"layers_block_type {kinds!r} is not a list of {sorted(_KINDS)}",
                                        culprit=where, hint="check config.json")
        pattern = "".join(_KINDS[k] for k in kinds)
    else:
        pattern = c.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_KIND_NAMES):
            raise CheckpointFormatError(f"has no layer pattern (layers_block_type or hybrid_override_pattern "
                                        f"of {''.join(_KIND_NAMES)}): {pattern!r}", culprit=where,
                                        hint="check config.json")
    layers = c.get("num_hidden_layers")
    if isinstance(layers, int) and layers != len(pattern):
        raise CheckpointFormatError(f"num_hidden_layers {layers} but the layer pattern {pattern!r} has "
                                    f"{len(pattern)}", culprit=where, hint="check config.json")
    return pattern


def _moe_args(c: Mapping[str, Any], need: Any, refuse: Any) -> dict[str, Any]:
    """Megatron-LM's MoE ``args`` of Nemotron-H's MoE layers: sigmoid scores, the expert bias
    (``e_score_correction_bias``) choosing the top-k, the chosen scores normalised when k > 1 (what
    megatron-core does; transformers when ``norm_topk_prob``), scaled by ``routed_scaling_factor``;
    squared-ReLU experts and one ungated shared expert (transformers builds one whatever
    ``n_shared_experts`` says), grouped experts as the stack spec builds them."""
    topk = need("num_experts_per_tok")
    if bool(c.get("norm_topk_prob", True)) != (topk > 1):
        raise refuse(f"norm_topk_prob {c.get('norm_topk_prob')!r} with top-{topk} (megatron-core normalises the "
                     "chosen sigmoid scores exactly when it picks more than one)")
    if c.get("n_group", 1) != 1:
        raise refuse(f"n_group {c.get('n_group')!r} (transformers scores a group by its top 2, megatron-core by its "
                     "top k / topk_group: equal only by chance)")
    return dict(num_experts=need("n_routed_experts", "num_local_experts"), moe_router_topk=topk,
                moe_ffn_hidden_size=need("moe_intermediate_size"),
                moe_shared_expert_intermediate_size=need("moe_shared_expert_intermediate_size"),
                moe_shared_expert_gate=False, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor", 1.0)), moe_router_dtype="fp32",
                moe_grouped_gemm=True, expert_model_parallel_size=1, expert_tensor_parallel_size=1)


class NemotronHForCausalLM(HFArchitectureFamily):
    """transformers' ``NemotronHForCausalLM``: megatron-core's hybrid ``MambaModel`` with Mamba-2,
    attention and squared-ReLU MLP layers, both ways, exactly or refused naming the setting."""

    name = "NemotronHForCausalLM"
    priority = 0
    model_types = ("nemotron_h",)
    names = NEMOTRON_H_NAMES

    # -- naming: one folder name per layer's norm, four table names ----------------------------
    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        if name.startswith("model."):  # transformers 5's in-memory prefix (its loader renames backbone.)
            name = "backbone." + name[len("model."):]
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["backbone", "layers"] and ".".join(parts[3:]) == _NORM:
            pattern = facts.family_facts.get(PATTERN_FACT, "")
            layer = int(parts[2])
            if layer < len(pattern):
                return name + _KIND_MARK + pattern[layer]
        return name

    def folder_name(self, name: str, facts: ModelFacts) -> str:
        return name.split(_KIND_MARK, 1)[0]

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}
        refuse, need = import_refusal(self.name, where), config_int(c, where)
        pattern = config_pattern(c, where)
        for field, want, what in (
                ("conv_kernel", CONV_KERNEL, "megatron-core's causal conv has kernel 4"),
                ("mamba_hidden_act", "silu", "megatron-core's mixer activation is SiLU"),
                ("use_conv_bias", True, "megatron-core's causal conv has a bias"),
                ("use_bias", False, "megatron-core's mixer has no linear biases"),
                ("mamba_proj_bias", False, "megatron-core's mixer has no linear biases"),
                ("attention_bias", False, "megatron-core's hybrid stack is built without linear biases here"),
                ("mlp_bias", False, "megatron-core's hybrid stack is built without linear biases here"),
                ("mlp_hidden_act", "relu2", "megatron-core's MLP is squared ReLU (--squared-relu)"),
                ("residual_in_fp32", False, "megatron-core's hybrid layers add the residual in the model's dtype"),
                ("sliding_window", None, "megatron-core's hybrid attention attends fully"),
                ("num_nextn_predict_layers", 0, "multi-token prediction layers are not imported"),
                ("moe_latent_size", None, "no latent MoE projection")):
            if c.get(field) != want:
                raise refuse(f"{field} {c.get(field)!r} ({what})")
        eps = float(c["layer_norm_epsilon"])
        if MAMBA in pattern and eps != MIXER_NORM_EPS:
            raise refuse(f"layer_norm_epsilon {eps:g} (transformers' mixer norm takes it; megatron-core's is fixed "
                         f"at {MIXER_NORM_EPS:g})")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        mheads, mhead_dim, groups, state = (need(k) for k in ("mamba_num_heads", "mamba_head_dim", "n_groups",
                                                              "ssm_state_size"))
        if mheads % groups:
            raise refuse(f"mamba_num_heads {mheads} in n_groups {groups} (megatron-core needs whole heads per group)")
        kv = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        max_pos = need("max_position_embeddings")
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=eps, swiglu=False, squared_relu=True, add_bias_linear=False,
            add_qkv_bias=False, qk_layernorm=False, position_embedding_type="none", max_position_embeddings=max_pos,
            is_hybrid_model=True, hybrid_override_pattern=pattern, hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0,
            mamba_state_dim=state, mamba_head_dim=mhead_dim, mamba_num_groups=groups, mamba_num_heads=mheads,
            spec=list(STACK_SPEC), **(_moe_args(c, need, refuse) if MOE in pattern else {}))
        model = megatron_model(self.name, self.names, vocab=need("vocab_size"), hidden=hidden, layers=len(pattern),
                               heads=heads, groups=kv, head_dim=head_dim,
                               ffn=need("intermediate_size") if MLP in pattern else int(c.get("intermediate_size")
                                                                                        or 4 * hidden),
                               tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)
        args = argparse.Namespace(**{**vars(model.args), "transformer_impl": "transformer_engine"})
        facts = dataclasses.replace(model.facts, family_facts={PATTERN_FACT: pattern})
        return HFModel(model.architecture, args, facts, model.names, model.base_prefix)

    def args_from_weights(self, module: Mapping[str, Any], model: HFModel) -> dict[str, Any]:
        """None; refuses weights whose layers are of other kinds than the pattern says."""
        pattern = model.facts.family_facts.get(PATTERN_FACT, "")
        keys = list(module)
        for layer, want in enumerate(pattern):
            got = layer_kind(keys, layer)
            if got != want:
                raise CheckpointFormatError(f"layer {layer} holds {_KIND_NAMES.get(got or '', 'nothing')} weights, "
                                            f"the layer pattern {pattern!r} says {_KIND_NAMES[want]}",
                                            culprit="config.json", hint="the weights and config.json do not "
                                                                        "belong together")
        return {}

    def core_module(self, module: Mapping[str, Any]) -> dict[str, Any]:
        """A GPT model's order and extra states, and the ``None`` extra states megatron-core's own
        per-rank state dict holds beside them: the mixer's linear layers' (``in_proj``, ``out_proj``) and
        the grouped experts' (Transformer Engine's ``GroupedLinear`` keeps one, ``linear_fc1._extra_state``,
        for all its experts)."""
        out = dict(module)
        for key in module:
            if key.endswith((".mixer.in_proj.weight", ".mixer.out_proj.weight")):
                out.setdefault(key[:-len("weight")] + "_extra_state", None)
            elif (m := _GROUPED_WEIGHT.match(key)) is not None:
                out.setdefault(m.group(1) + "_extra_state", None)
        return core_module(out)

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """transformers' clamp of the mixer's step at ``time_step_min``, which megatron-core does not do."""
        floor = config.get("time_step_min", 0.001)
        if MAMBA in (hybrid_pattern(args) or "") and isinstance(floor, (int, float)) and floor > 0:
            return [f"config.json's time_step_min {floor:g}: transformers clamps the mixer's steps "
                    f"softplus(dt + dt_bias) from below there, megatron-core does not; the two compute alike "
                    f"where every step is above it"]
        return []

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A hybrid ``MambaModel`` (``decoder.final_norm``, Mamba mixers): Nemotron-H's ``config.json``,
        or the refusal of what transformers' Nemotron-H does not compute; None for any other model."""
        if "decoder.final_norm.weight" not in keys and not any(".mixer.A_log" in k for k in keys):
            return None
        ordered = sorted(keys)
        pattern = "".join(layer_kind(ordered, i) or "?" for i in range(facts.num_layers))
        saved = hybrid_pattern(args)
        if saved is not None and saved != pattern:
            raise not_exact(f"args.hybrid_override_pattern {saved!r} but the layers hold {pattern!r}")
        if "?" in pattern:
            raise not_exact(f"layer pattern {pattern!r} (a layer of none of Nemotron-H's kinds)")
        has = has_key(keys)
        if has(r"\.(?:linear_proj|linear_qkv|linear_fc[12]|in_proj|out_proj)\.bias$"):
            raise not_exact("linear biases (Nemotron-H has none)")
        if saved_arg(args, "normalization") != "RMSNorm":
            raise not_exact(f"normalization {saved_arg(args, 'normalization')!r} (Nemotron-H has RMSNorm)")
        if has(r"\.(q_layernorm|k_layernorm)\.weight$"):
            raise not_exact("query/key norms (Nemotron-H has none)")
        if ATTENTION in pattern and saved_arg(args, "position_embedding_type") != "none":
            raise not_exact(f"position_embedding_type {saved_arg(args, 'position_embedding_type')!r} (Nemotron-H's "
                            "attention has no position embedding)")
        if (MLP in pattern or MOE in pattern) and (saved_arg(args, "swiglu") or not saved_arg(args, "squared_relu")):
            raise not_exact("an MLP activation other than squared ReLU (args.squared_relu)")
        eps = float(saved_arg(args, "norm_epsilon", default=1e-5))
        if MAMBA in pattern and eps != MIXER_NORM_EPS:
            raise not_exact(f"norm_epsilon {eps:g} (transformers' mixer norm takes layer_norm_epsilon, megatron-core's "
                            f"is {MIXER_NORM_EPS:g})")
        d, gs, mheads = mixer_dims(args, "--to hf")
        head_dim = saved_arg(args, "mamba_head_dim")
        hidden = facts.hidden or 0
        config = {
            "architectures": [self.name], "model_type": "nemotron_h",
            "vocab_size": facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source,
            "hidden_size": hidden, "num_hidden_layers": facts.num_layers,
            "layers_block_type": [_HF_KIND_NAMES[k] for k in pattern], "hybrid_override_pattern": pattern,
            "num_attention_heads": facts.heads, "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim,
            "intermediate_size": widths.get("dense") or saved_arg(args, "ffn_hidden_size"), "mlp_hidden_act": "relu2",
            "attention_bias": False, "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False,
            "layer_norm_epsilon": eps,
            "ssm_state_size": saved_arg(args, "mamba_state_dim"), "mamba_num_heads": mheads,
            "mamba_head_dim": head_dim, "n_groups": gs // saved_arg(args, "mamba_state_dim"),
            "expand": d // hidden if hidden and d % hidden == 0 else 2, "conv_kernel": CONV_KERNEL,
            "use_conv_bias": True, "mamba_hidden_act": "silu", "residual_in_fp32": False,
            "tie_word_embeddings": bool(facts.tied_embeddings), "dtype": HF_DTYPES.get(dtype, str(dtype)),
            "max_position_embeddings": saved_arg(args, "max_position_embeddings", "seq_length"),
            "time_step_min": 0.0,  # megatron-core clamps no step (transformers' default time_step_limit: none)
            "num_nextn_predict_layers": 0, "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            **(self._routing(args, keys, widths) if MOE in pattern else {}),
        }
        return HFArchitecture(name=self.name, config=config, names=self.names,
                              reason=f"a hybrid stack of Mamba-2, attention, squared-ReLU MLP and MoE layers "
                                     f"({pattern})")

    @staticmethod
    def _routing(args: Any, keys: set[str], widths: Mapping[str, int]) -> dict[str, Any]:
        """``config.json``'s MoE entries, or the refusal of routing transformers' Nemotron-H does not do
        (it scores by sigmoid, chooses by the expert bias, normalises the chosen scores when it picks
        more than one, and adds one ungated shared expert)."""
        has = has_key(keys)
        if saved_arg(args, "moe_router_score_function", default="softmax") != "sigmoid":
            raise not_exact("router scores not by sigmoid (Nemotron-H's router is sigmoid with an expert bias)")
        if not has(r"\.mlp\.router\.expert_bias$"):
            raise not_exact("no router expert bias (Nemotron-H chooses experts by e_score_correction_bias)")
        if not has(r"\.mlp\.shared_experts\.linear_fc1\.weight$") or has(r"\.shared_experts\.gate_weight$"):
            raise not_exact("MoE layers without one ungated shared expert (Nemotron-H's have one)")
        if saved_arg(args, "moe_router_num_groups") not in (None, 1):
            raise not_exact("group-limited routing (moe_router_num_groups)")
        for flag, what in (("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter"), ("moe_latent_size", "a latent MoE")):
            if saved_arg(args, flag):
                raise not_exact(f"{what} ({flag})")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise not_exact("the router's top-k is unknown (the saved args lack moe_router_topk)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        return {"n_routed_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": widths.get("expert"),
                "moe_shared_expert_intermediate_size": widths.get("shared"), "n_shared_experts": 1,
                "norm_topk_prob": topk > 1, "n_group": 1, "topk_group": 1, "moe_latent_size": None,
                "routed_scaling_factor": float(saved_arg(args, "moe_router_topk_scaling_factor") or 1.0)}


NEMOTRON_H = NemotronHForCausalLM()
