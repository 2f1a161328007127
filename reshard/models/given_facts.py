"""Model facts a checkpoint does not save, given another way, as the Megatron-LM ``args`` the
planner, the exports and the outputs read.

torch_dist written by mbridge or Megatron-Bridge carries no Megatron-LM ``args`` (``common.pt``
holds the iteration, if anything). Their architecture is elsewhere: the model's Hugging Face
``config.json`` (what mbridge builds the model from; ``--model-config``), Megatron-Bridge's
``run_config.yaml`` in the iteration folder (its ``model`` section: megatron-core's
``TransformerConfig`` field names), and the flags. Each becomes an ``args`` namespace; together
they fill in what the saved ``args`` lack, in this order of precedence: flags, ``--model-config``,
``run_config.yaml``. A given fact that contradicts a saved one is refused, never overridden.

Layout fields (parallel degrees, the checkpoint format, the transformer implementation) are the
checkpoint's own and are never taken from a model description; ``run_config.yaml`` is the
checkpoint's own record, so its layer spec and dtype are read (below). Args made here are
:class:`~reshard.models.megatron_args.MadeArgs`: written complete as Megatron-LM's own.

================================================  ==============================================
Megatron-Bridge ``model`` field                   Megatron-LM ``args``
================================================  ==============================================
``layernorm_epsilon``                             ``norm_epsilon``
``gated_linear_unit``                             ``swiglu``
``share_embeddings_and_output_weights``           ``untie_embeddings_and_output_weights`` (negated)
``num_moe_experts``                               ``num_experts``
``rope_scaling``                                  ``use_rope_scaling``
``seq_length``                                    also ``max_position_embeddings`` (Bridge has none)
``num_query_groups`` equal to the heads           none (Megatron-LM's 1: no grouped-query attention)
``make_vocab_size_divisible_by``                  only with ``should_pad_vocab`` (else Megatron-LM's
                                                  default: Megatron-Bridge padded nothing)
``params_dtype`` (a reference to a torch dtype)    ``params_dtype``, ``bf16``, ``fp16``
``transformer_layer_spec``                        ``transformer_impl`` (``local`` for megatron-core's
                                                  local spec, else ``transformer_engine``)
every other field of :data:`BRIDGE_SAME`          the same name
================================================  ==============================================
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import ConfigError, LayoutError
from reshard.models import megatron_args
from reshard.models.facts import saved_arg

#: ``run_config.yaml`` beside a Megatron-Bridge checkpoint's files (in its iteration folder).
RUN_CONFIG = "run_config.yaml"
#: Megatron-Bridge ``model`` fields under Megatron-LM's own name: its model providers are megatron-core's
#: ``TransformerConfig`` (``MLATransformerConfig`` for DeepSeek's) with the provider's fields, whose
#: names Megatron-LM's args share. Every one a family reads: the dense model's, the MoE router's
#: (DeepSeek's group routing and routed scaling among them), multi-latent attention's widths and its
#: YaRN rotary, the multi-token prediction depth, and the settings an export refuses by name.
BRIDGE_SAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "normalization", "add_bias_linear", "add_qkv_bias", "position_embedding_type",
               "rotary_base", "rotary_percent", "rotary_interleaved", "vocab_size", "make_vocab_size_divisible_by",
               "seq_length", "max_position_embeddings", "qk_layernorm", "qk_l2_norm",
               "apply_residual_connection_post_layernorm", "layernorm_zero_centered_gamma",
               "window_size", "window_attn_skip_freq",
               # mixture of experts
               "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
               "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
               "moe_shared_expert_gate", "moe_grouped_gemm", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor", "moe_expert_capacity_factor", "moe_input_jitter_eps",
               "moe_router_dtype", "moe_router_load_balancing_type",
               # multi-latent attention and its rotary (MLATransformerConfig)
               "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
               "beta_slow", "mscale", "mscale_all_dim",
               "mtp_num_layers")
#: Megatron-Bridge ``model`` fields under another Megatron-LM name: (args name, value map; the map
#: is its own inverse: a number, a flag, or a negated flag).
BRIDGE_RENAMED: dict[str, tuple[str, Any]] = {
    "layernorm_epsilon": ("norm_epsilon", float),
    "gated_linear_unit": ("swiglu", bool),
    "share_embeddings_and_output_weights": ("untie_embeddings_and_output_weights", lambda v: not v),
    "num_moe_experts": ("num_experts", int),
    "rope_scaling": ("use_rope_scaling", bool),  # Llama 3.1's rotary scaling (GPTModelProvider's flag)
}
#: :data:`BRIDGE_SAME` fields of multi-latent attention's provider only (Megatron-Bridge's ``MLAModelProvider``)
BRIDGE_MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                   "rotary_scaling_factor",
                   "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
#: :data:`BRIDGE_SAME` names no Megatron-Bridge provider has (it builds its model for ``seq_length`` positions)
NOT_BRIDGE_FIELDS = ("max_position_embeddings",)
#: ``args`` of the checkpoint's layout, never taken from a model description.
LAYOUT_ARGS = frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                         "expert_tensor_parallel_size", "ckpt_format", "transformer_impl", "use_legacy_models",
                         "padded_vocab_size", "params_dtype", "bf16", "fp16"})
#: The layout fields an output's ``args`` describe (the engine sets them: see ``retarget_args``).
OUTPUT_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size",
                      "ckpt_format")
#: Option fields that are model facts kept in ``args`` (flag -> args name).
FLAG_ARGS = {"normalization": "normalization", "position_embedding_type": "position_embedding_type",
             "rotary_base": "rotary_base", "norm_epsilon": "norm_epsilon"}


def from_hf_config(config: Mapping[str, Any], where: str) -> argparse.Namespace:
    """The model facts of a Hugging Face ``config.json`` (any architecture reshard imports into
    megatron-core: not one whose models it does not compute, ``hf_only``)."""
    from reshard.models.hf_registry import read_config

    model = read_config(config, where)
    if model.family is not None and model.family.hf_only is not None:
        raise LayoutError(f"megatron-core does not compute {model.architecture}: {model.family.hf_only}",
                          culprit=where, hint="give the config.json of the model the checkpoint holds")
    args = model.args
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in LAYOUT_ARGS})


def from_run_config(path: Path) -> argparse.Namespace | None:
    """The model facts of Megatron-Bridge's ``run_config.yaml`` (its ``model`` section); None when
    it has none. Read with a safe YAML loader (plain data, no tags run)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read it as YAML ({str(exc).splitlines()[0][:160]})", culprit=str(path),
                          hint="re-copy it, or move it away and give the facts with --model-config") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        return None
    out: dict[str, Any] = {k: model[k] for k in BRIDGE_SAME if model.get(k) is not None}
    for field, (name, convert) in BRIDGE_RENAMED.items():
        if model.get(field) is not None:
            out[name] = convert(model[field])
    if "num_attention_heads" in out and "num_query_groups" in out:
        out["group_query_attention"] = out["num_query_groups"] != out["num_attention_heads"]
        if not out["group_query_attention"]:
            del out["num_query_groups"]  # Megatron-LM's args keep their default (1) without grouped-query attention
    if "max_position_embeddings" not in out and isinstance(model.get("seq_length"), int):
        out["max_position_embeddings"] = model["seq_length"]  # the positions Megatron-Bridge builds its model for
    if not model.get("should_pad_vocab") and "make_vocab_size_divisible_by" in out:
        # Megatron-Bridge pads the vocabulary only with should_pad_vocab: its rows are then the true
        # vocabulary, and Megatron-LM pads them by its own default divisor (an output's args say so)
        out["make_vocab_size_divisible_by"] = megatron_args.default("make_vocab_size_divisible_by")
    dtype = _dtype(model.get("params_dtype"))
    if dtype is not None:
        out.update(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    impl = transformer_impl(model.get("transformer_layer_spec"))
    if impl is not None:
        out["transformer_impl"] = impl
    return argparse.Namespace(**out)


def transformer_impl(spec: Any) -> str | None:
    """Megatron-LM's ``--transformer-impl`` for the layer spec Megatron-Bridge records (its
    ``transformer_layer_spec``: a function by name, or a partial with ``use_transformer_engine``):
    ``local`` for megatron-core's local spec, ``transformer_engine`` for the others Megatron-Bridge
    has (its default, Transformer Engine's); None when no spec is recorded."""
    if not isinstance(spec, dict) or not isinstance(spec.get("_target_"), str):
        return None
    if "use_transformer_engine" in spec:
        return "transformer_engine" if spec["use_transformer_engine"] else "local"
    return "local" if spec["_target_"].rsplit(".", 1)[-1] == "local_layer_spec" else "transformer_engine"


def _dtype(value: Any) -> torch.dtype | None:
    """A dtype Megatron-Bridge records as an object reference (``{_target_: torch.bfloat16, _call_: false}``)."""
    target = value.get("_target_") if isinstance(value, dict) else None
    if isinstance(target, str) and target in ("torch.float32", "torch.bfloat16", "torch.float16"):
        return getattr(torch, target.split(".")[1])
    return None


def with_flags(args: Any, options: Any, where: str) -> Any:
    """``args`` supplemented by the flags alone (what an export decides from, when the checkpoint
    saved no args and no model description was given)."""
    return supplement(args, [(from_flags(options), "the flags")], where)


def from_flags(options: Any) -> argparse.Namespace:
    """The model facts given as flags that live in ``args`` (the planner reads the others itself)."""
    return argparse.Namespace(**{name: getattr(options, flag) for flag, name in FLAG_ARGS.items()
                                 if getattr(options, flag, None) is not None})


def supplement(saved: Any, given: list[tuple[argparse.Namespace, str]], where: str) -> Any:
    """``saved`` args (or None) with what they lack taken from ``given`` ((facts, where they come
    from), first wins); a given fact that differs from a saved one is refused, naming both."""
    if not any(vars(facts) for facts, _ in given):
        return saved
    # args made from given facts alone hold the layout fields the engine sets for the output, and when
    # written every other key of Megatron-LM's own args (MadeArgs)
    merged = copy.copy(saved) if saved is not None else megatron_args.MadeArgs(**dict.fromkeys(OUTPUT_LAYOUT_ARGS))
    taken: dict[str, str] = {}
    for facts, origin in given:
        for name, value in vars(facts).items():
            have = saved_arg(merged, name)  # saved under any of its names (megatron-core 0.19's included)
            if have is None:
                setattr(merged, name, value)
                taken[name] = origin
            elif not _same(have, value) and name not in taken:
                raise LayoutError(f"{name}={value!r} from {origin} contradicts the checkpoint's saved args "
                                  f"({have!r})", culprit=where,
                                  hint=f"correct it in {origin}, or drop it: the saved args describe the weights")
    return merged


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return bool(a == b)


def given_args(state: dict[str, Any], options: Any, path: Path) -> dict[str, Any]:
    """``state`` (one opened checkpoint file) with its ``args`` supplemented by the flags,
    ``--model-config`` and a ``run_config.yaml`` beside ``path``; unchanged when none gives any.
    A ``run_config.yaml`` is read only where no ``args`` were saved (Megatron-Bridge saves none): beside
    saved ``args`` it describes the checkpoint for Megatron-Bridge alone (reshard's torch_dist outputs
    carry one, its vocabulary the padded rows: :mod:`reshard.models.bridge_config`)."""
    described: list[tuple[argparse.Namespace, str]] = []
    if getattr(options, "hf_model_config", None):
        described.append((from_hf_config(options.hf_model_config, "--model-config"), "--model-config"))
    facts = run_config_facts(path) if state.get("args") is None else None
    if facts is not None:
        described.append((facts, str(run_config_beside(path))))
    if state.get("args") is None and not described:
        return state  # flags alone never invent args for the outputs (an export reads them: with_flags)
    args = supplement(state.get("args"), [(from_flags(options), "the flags"), *described], str(path))
    if args is state.get("args"):
        return state
    return {**state, "args": args}


def run_config_facts(path: Path) -> argparse.Namespace | None:
    """The model facts of the ``run_config.yaml`` beside the checkpoint file ``path`` (None without
    one, or without a ``model`` section)."""
    run_config = run_config_beside(path)
    if run_config is None:
        return None
    stat = run_config.stat()
    return _run_config_facts(str(run_config), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _run_config_facts(path: str, mtime_ns: int, size: int) -> argparse.Namespace | None:
    """:func:`from_run_config`, read once per version of the file (a plan opens every source file)."""
    return from_run_config(Path(path))


def run_config_beside(path: Path) -> Path | None:
    """Megatron-Bridge's ``run_config.yaml`` in the folder of a checkpoint file, or the one above
    (a torch_dist file or a per-rank folder's file)."""
    for folder in (path.parent, path.parent.parent):
        if (folder / RUN_CONFIG).is_file():
            return folder / RUN_CONFIG
    return None
