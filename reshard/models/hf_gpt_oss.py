"""``GptOssForCausalLM`` (transformers' ``models/gpt_oss``) both ways, in bf16 or any float dtype:
megatron-core's GPT model with learned attention sinks, MoE layers with linear biases, a clamped gated
activation, YaRN rotary and windows on some layers (:mod:`reshard.models.gpt_oss` is its
megatron-core side).

============================================  ==============================================  ===========
Hugging Face (``model.layers.{l}.``)          megatron-core (``decoder.layers.{l}.``)         transform
============================================  ==============================================  ===========
``self_attn.{q,k,v}_proj.{weight,bias}``      ``self_attention.linear_qkv.{weight,bias}``      QKV, grouped
``self_attn.o_proj.{weight,bias}``            ``self_attention.linear_proj.{weight,bias}``     same
``self_attn.sinks`` ``[heads]``               ``self_attention.core_attention.softmax_offset`` same
``mlp.router.{weight,bias}``                  ``mlp.router.{weight,bias}``                     same
``mlp.experts.gate_up_proj`` ``[E, h, 2f]``   ``mlp.experts.local_experts.{e}.linear_fc1``     transposed,
(columns: gate 0, up 0, gate 1, ...)          ``.weight`` ``[2f, h]`` = ``[gate; up]``         interleaved
``mlp.experts.gate_up_proj_bias`` ``[E, 2f]``  ``...local_experts.{e}.linear_fc1.bias`` ``[2f]``  interleaved
``mlp.experts.down_proj`` ``[E, f, h]``       ``...local_experts.{e}.linear_fc2.weight``       transposed
                                              ``[h, f]``
``mlp.experts.down_proj_bias`` ``[E, h]``     ``...local_experts.{e}.linear_fc2.bias`` ``[h]``  same
============================================  ==============================================  ===========

(the norms, embeddings and head are Llama's; the experts are :mod:`reshard.models.stacked` slabs).

The arithmetic, read from transformers 5.24 and megatron-core 0.16.1:

* attention: a sink logit per head joins each softmax and is dropped after it — megatron-core's
  ``softmax_type="learnable"`` (``SoftmaxOne``); the scale is ``head_dim ** -0.5`` in both;
* windows: ``layer_types`` ``sliding_attention`` layers see the ``sliding_window`` latest tokens,
  megatron-core's ``window_size`` ``(W - 1, 0)`` on the layers ``window_attn_skip_freq`` windows
  (an int ``k``: every ``k``-th layer, counted from 1, attends fully; else one flag per layer);
* experts: ``gate, up = x W[:, 0::2], x W[:, 1::2]`` (+ bias), ``min(gate, L) * sigmoid(1.702
  min(gate, L)) * (clamp(up, -L, L) + 1)`` with ``L = swiglu_limit`` — Megatron-LM's ``--quick-geglu``
  (``quick_gelu`` is ``x sigmoid(1.702 x)``), ``--activation-func-clamp-value L``,
  ``--glu-linear-offset 1``; routing: top-k of the router's logits (with its bias), softmax over them
  (megatron-core's softmax router without ``--moe-router-pre-softmax``);
* rotary: YaRN with ``truncate`` as Megatron-LM's ``--yarn-correction-range-round-to-int`` (the
  release: false), ``factor`` as ``--rotary-scaling-factor``; transformers' attention factor
  ``0.1 ln(factor) + 1`` is megatron-core's concentration factor at ``mscale`` 1, ``mscale_all_dim`` 0.

megatron-core's ``add_bias_linear`` gives the attention output, the router and the experts biases
together, so a config without ``attention_bias`` (whose experts and router still have biases) is
refused; megatron-core builds such MoE layers at expert TP 1 only
(:meth:`~reshard.models.megatron_gpt.MegatronCoreFamily.expert_tp`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.gpt_oss import ACTIVATION_ARGS, SOFTMAX_OFFSET
from reshard.models.hf_architectures import HF_DTYPES, HFArchitecture, HFArchitectureFamily, HFModel, Same, name_table
from reshard.models.hf_common import (
    CORE_LAYER,
    HF_LAYER,
    NORM_EPS_DEFAULT,
    config_int,
    decided_norm,
    has_key,
    import_refusal,
    layer_windows,
    megatron_model,
    not_exact,
)
from reshard.models.hf_llama import LLAMA_NAMES
from reshard.models.hf_moe import megatron_moe_args
from reshard.models.megatron_gpt import experts_per_layer, stack_layer
from reshard.models.stacked import Stacked

_L, _H = CORE_LAYER, HF_LAYER
_E = _L + "mlp.experts."
_EXPERT = (_E + "local_experts.{expert}.linear_fc{n}.{p}", _E + "linear_fc{n}.{p}{expert}")


def _expert(n: int, p: str) -> tuple[str, str]:
    """A routed expert's fc``n`` ``p`` (weight, bias): SequentialMLP's name, then grouped GEMM's."""
    return tuple(t.replace("{n}", str(n)).replace("{p}", p) for t in _EXPERT)  # type: ignore[return-value]


#: megatron-core <-> transformers' GPT-OSS names: Llama's attention, norms, embeddings and head, the
#: sinks, the router with its bias, and the experts as stacked slabs (see the module table).
GPT_OSS_NAMES = LLAMA_NAMES + name_table(
    (_L + SOFTMAX_OFFSET, Same(), (_H + "self_attn.sinks",)),
    (_L + "mlp.router.{p}", Same(), (_H + "mlp.router.{p}",)),
    (_expert(1, "weight"), Stacked(transpose=True, halves=2, interleave=True), (_H + "mlp.experts.gate_up_proj",)),
    (_expert(1, "bias"), Stacked(halves=2, interleave=True), (_H + "mlp.experts.gate_up_proj_bias",)),
    (_expert(2, "weight"), Stacked(transpose=True), (_H + "mlp.experts.down_proj",)),
    (_expert(2, "bias"), Stacked(), (_H + "mlp.experts.down_proj_bias",)),
)

#: transformers' ``GptOssConfig`` defaults for what a ``config.json`` may leave out (the shapes are
#: read from the file; a release spells them all).
_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
                             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "sliding_window": 128,
                             "max_position_embeddings": 131072, "rope_theta": 150000.0}
#: transformers' default ``rope_parameters`` of GPT-OSS (YaRN, as the release's ``rope_scaling``).
_DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}
#: The sigmoid gain of transformers' clamped SwiGLU that megatron-core's ``quick_gelu`` fixes.
QUICK_GELU_ALPHA = 1.702
SLIDING, FULL = "sliding_attention", "full_attention"


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale (transformers' ``get_mscale``, megatron-core's ``_yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_args(c: Mapping[str, Any], max_pos: int, where: str, refuse: Any) -> dict[str, Any]:
    """Megatron-LM's position ``args`` for ``config.json``'s rotary (transformers 5's
    ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``; neither: GPT-OSS's default YaRN)."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else c.get("rope_scaling")
    params = dict(_DEFAULT_ROPE if params is None else params)
    base = float(params.get("rope_theta", c["rope_theta"]))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise refuse("a partial rotary factor")
    plain = dict(position_embedding_type="rope", rotary_base=base, rotary_percent=1.0, rotary_interleaved=False)
    if rope_type == "default":
        return plain
    if rope_type != "yarn":
        raise refuse(f"rotary scaling {rope_type} (megatron-core's GPT model has YaRN or none)")
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int):
        raise CheckpointFormatError("has YaRN without an integer original_max_position_embeddings",
                                    culprit=where, hint="check rope_parameters (rope_scaling)")
    factor = float(params.get("factor") or max_pos / original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):  # transformers then scales by the factor alone: megatron-core's ratio at (1, 0)
        mscale, all_dim = 1.0, 0.0
    want = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    if params.get("attention_factor") is not None and float(params["attention_factor"]) != want:
        raise refuse(f"YaRN attention_factor {params['attention_factor']} (megatron-core scales by {want:g})")
    return {**plain, "position_embedding_type": "yarn", "rotary_scaling_factor": factor,
            "yarn_original_max_position_embeddings": original, "yarn_beta_fast": float(params.get("beta_fast") or 32),
            "yarn_beta_slow": float(params.get("beta_slow") or 1), "mscale": float(mscale),
            "mscale_all_dim": float(all_dim), "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}


def _window_args(c: Mapping[str, Any], layers: int, where: str) -> dict[str, Any]:
    """Megatron-LM's ``window_size`` / ``window_attn_skip_freq`` for ``layer_types`` (GPT-OSS's default:
    layers 0, 2, ... sliding) and ``sliding_window``: ``2`` for that default, one flag per layer for
    another pattern, none when no layer slides."""
    types = c.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointFormatError(f"layer_types {types!r} is not {layers} of {SLIDING!r} / {FULL!r}",
                                    culprit=where, hint="check layer_types against num_hidden_layers")
    window = c["sliding_window"]
    windowed = [t == SLIDING for t in types]
    if window is None or not any(windowed):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointFormatError(f"sliding_window {window!r} is not a positive number of tokens", culprit=where,
                                    hint="check config.json")
    every_other = [i % 2 == 0 for i in range(layers)]
    freq: int | list[int] | None = None if all(windowed) else 2 if windowed == every_other else [int(w) for w in
                                                                                                windowed]
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": freq}


class GptOssForCausalLM(HFArchitectureFamily):
    """transformers' ``GptOssForCausalLM``: megatron-core's GPT model with learned sinks, biased MoE
    layers, the clamped gated activation, YaRN and alternating windows, both ways, exactly or refused
    naming the setting."""

    name = "GptOssForCausalLM"
    priority = 0
    model_types = ("gpt_oss",)
    names = GPT_OSS_NAMES

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}
        if c.get("num_experts_per_tok") is None and c.get("experts_per_token") is not None:
            c["num_experts_per_tok"] = c["experts_per_token"]  # the release spells both
        refuse, need = import_refusal(self.name, where), config_int(c, where)
        if not c["attention_bias"]:
            raise refuse("attention without biases (megatron-core's --add-bias-linear, which gives the router and "
                         "the experts their biases, gives the attention output projection one too)")
        if float(c["swiglu_alpha"]) != QUICK_GELU_ALPHA:
            raise refuse(f"swiglu_alpha {c['swiglu_alpha']} (megatron-core's quick_gelu is x sigmoid(1.702 x))")
        limit = c["swiglu_limit"]
        if not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
            raise CheckpointFormatError(f"swiglu_limit {limit!r} is not a positive number", culprit=where,
                                        hint="check config.json")
        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        groups = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        ffn, max_pos = need("intermediate_size"), need("max_position_embeddings")
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=False, **ACTIVATION_ARGS,
            activation_func_clamp_value=float(limit), add_bias_linear=True, add_qkv_bias=True,
            max_position_embeddings=max_pos, qk_layernorm=False, **_rope_args(c, max_pos, where, refuse),
            **_window_args(c, layers, where),
            **megatron_moe_args(need("num_local_experts", "num_experts"), ffn, None, False, [1] * layers, need,
                                refuse))
        model = megatron_model(self.name, self.names, vocab=need("vocab_size"), hidden=hidden, layers=layers,
                               heads=heads, groups=groups, head_dim=head_dim, ffn=ffn,
                               tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)
        return dataclasses.replace(model, facts=dataclasses.replace(model.facts, swiglu=True))  # a gated MLP

    # -- export ---------------------------------------------------------------------------------
    def windows(self, config: Mapping[str, Any], num_layers: int) -> list[int | None]:
        types = config.get("layer_types") or [FULL] * num_layers
        return [config.get("sliding_window") if t == SLIDING else None for t in types]

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model with learned sinks (``softmax_offset``): GPT-OSS's ``config.json``, or the refusal
        of what transformers' GPT-OSS does not compute; None for any other model."""
        if not any(k.endswith(SOFTMAX_OFFSET) for k in keys):
            return None
        norm, qk_norm = decided_norm(args, facts, keys)
        has = has_key(keys)
        if norm != "RMSNorm" or qk_norm:
            raise not_exact(f"learned attention sinks with {norm}{' and query/key norms' if qk_norm else ''} "
                            "(GPT-OSS has RMSNorm alone)")
        for arg, value in ACTIVATION_ARGS.items():
            if saved_arg(args, arg) != value:
                raise not_exact(f"args.{arg} is {saved_arg(args, arg)!r} (GPT-OSS's experts: {value!r})")
        limit = saved_arg(args, "activation_func_clamp_value")
        if not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
            raise not_exact(f"args.activation_func_clamp_value is {limit!r} (GPT-OSS clamps at swiglu_limit)")
        for pattern, what in ((r"linear_qkv\.bias$", "QKV"), (r"linear_proj\.bias$", "attention output"),
                              (r"\.mlp\.router\.bias$", "router"), (r"linear_fc1\.bias\d*$", "experts' fc1"),
                              (r"linear_fc2\.bias\d*$", "experts' fc2")):
            if not has(pattern):
                raise not_exact(f"no {what} bias (GPT-OSS has biases on every linear layer)")
        routed = self._routing(args, facts, keys)
        config = {
            "architectures": [self.name], "model_type": "gpt_oss",
            "vocab_size": facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source,
            "hidden_size": facts.hidden, "intermediate_size": widths.get("expert"),
            "num_hidden_layers": facts.num_layers, "num_attention_heads": facts.heads,
            "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim, "hidden_act": "silu",
            "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": float(limit),
            "rms_norm_eps": float(saved_arg(args, "norm_epsilon", default=NORM_EPS_DEFAULT)),
            "tie_word_embeddings": bool(facts.tied_embeddings), "dtype": HF_DTYPES.get(dtype, str(dtype)),
            "max_position_embeddings": saved_arg(args, "max_position_embeddings", "seq_length"),
            "rope_parameters": self._rope(args), **self._layer_types(args, facts.num_layers), **routed,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        }
        return HFArchitecture(name=self.name, config=config, names=self.names,
                              reason=f"learned attention sinks, {config['num_local_experts']} experts with biases "
                                     f"in every layer, top-{config['num_experts_per_tok']} of the router's logits, "
                                     f"the clamped gated activation (limit {float(limit):g})")

    @staticmethod
    def _routing(args: Any, facts: ModelFacts, keys: set[str]) -> dict[str, Any]:
        """``config.json``'s routing entries, or the refusal of routing transformers' GPT-OSS does not do."""
        if saved_arg(args, "moe_router_score_function", default="softmax") != "softmax":
            raise not_exact("router scores not by softmax (GPT-OSS routes on the softmax of the top-k logits)")
        if saved_arg(args, "moe_router_pre_softmax", default=False):
            raise not_exact("the softmax over all experts before the top-k (GPT-OSS: over the top-k logits)")
        for flag, what in (("moe_router_enable_expert_bias", "a router expert bias"),
                           ("moe_router_num_groups", "group-limited routing"),
                           ("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter")):
            if saved_arg(args, flag):
                raise not_exact(f"{what} ({flag})")
        if saved_arg(args, "moe_router_topk_scaling_factor", default=1.0) not in (None, 1.0):
            raise not_exact("scaled routing weights (moe_router_topk_scaling_factor)")
        if any(".mlp.shared_experts." in k for k in keys):
            raise not_exact("shared experts (GPT-OSS has none)")
        moe_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.router.weight")}
        if moe_layers != set(range(facts.num_layers)):
            raise not_exact(f"dense layers {sorted(set(range(facts.num_layers)) - moe_layers)} (GPT-OSS's layers are "
                            "all MoE)")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise not_exact("the router's top-k is unknown (the saved args lack moe_router_topk)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        return {"num_local_experts": experts, "num_experts_per_tok": topk, "experts_per_token": topk,
                "output_router_logits": False, "router_aux_loss_coef": 0.0}

    @staticmethod
    def _rope(args: Any) -> dict[str, Any]:
        """transformers' ``rope_parameters`` for the args' rotary (YaRN or plain)."""
        base = float(saved_arg(args, "rotary_base", default=10000.0))
        kind = saved_arg(args, "position_embedding_type")
        if kind == "rope":
            return {"rope_type": "default", "rope_theta": base}
        if kind != "yarn":
            raise not_exact(f"position embedding {kind or 'unknown'} (GPT-OSS rotates with YaRN or plain rope)")
        if float(saved_arg(args, "rotary_percent", default=1.0)) != 1.0:
            raise not_exact("rotary_percent below 1 (GPT-OSS rotates the whole head)")
        factor = float(saved_arg(args, "rotary_scaling_factor", default=1.0))
        mscale = float(saved_arg(args, "mscale", default=1.0))
        all_dim = float(saved_arg(args, "mscale_all_dim", default=0.0))
        original = saved_arg(args, "yarn_original_max_position_embeddings")
        if not isinstance(original, int):
            raise not_exact("YaRN without args.yarn_original_max_position_embeddings")
        out = {"rope_type": "yarn", "rope_theta": base, "factor": factor, "original_max_position_embeddings": original,
               "beta_fast": float(saved_arg(args, "yarn_beta_fast", default=32.0)),
               "beta_slow": float(saved_arg(args, "yarn_beta_slow", default=1.0)),
               # megatron-core's YaRN rounds its correction range only when this is truthy (None: it does not)
               "truncate": bool(saved_arg(args, "yarn_correction_range_round_to_int"))}
        if all_dim and mscale:
            out.update(mscale=mscale, mscale_all_dim=all_dim)
        elif mscale != 1.0:
            out["attention_factor"] = _yarn_mscale(factor, mscale)
        return out

    @staticmethod
    def _layer_types(args: Any, layers: int) -> dict[str, Any]:
        """``layer_types`` and ``sliding_window`` for the args' windows (one window size for all)."""
        windows = layer_windows(args, layers)
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            raise not_exact(f"windows of {sorted(sizes)} tokens (GPT-OSS has one sliding_window)")
        return {"layer_types": [FULL if w is None else SLIDING for w in windows],
                "sliding_window": next(iter(sizes), None)}


GPT_OSS = GptOssForCausalLM()
