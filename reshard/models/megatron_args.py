"""Megatron-LM's ``args``, complete: the ``args`` reshard makes (a Hugging Face import, facts given by
``run_config.yaml`` or ``--model-config`` for a checkpoint that saved none) hold every key Megatron-LM's
own ``parse_args`` + ``validate_args`` leave for that model, as a checkpoint ``pretrain_gpt.py`` saved
would.

Why: the tools that read a checkpoint's ``args`` read them whole. Megatron-LM's
``--use-checkpoint-args`` takes its model from them, and Megatron-Bridge builds megatron-core's
``TransformerConfig`` from them (``mlm_compat``), reading attribute after attribute
(``multi_latent_attention``, ``heterogeneous_layers_config_path``, ``no_persist_layer_norm``...):
a partial ``args`` stops them at the first one missing.

The keys and their defaults are megatron-core 0.19's, generated from its parser, never written by
hand: ``megatron_args.json`` beside this module (``make realtools-args`` in the side environment,
``tests/realtools/args_snapshots.py --defaults``), the ``args`` of the smallest command line
Megatron-LM takes less the keys that command line sets (the model's: reshard always takes those from
the model). The keys whose value ``validate_args`` derives from the model's own (which fusions apply,
the experts' width, the 0.19 spelling of a fact saved under its older name) are derived here as it
derives them (:func:`derived`). A key whose value megatron-core 0.16 cannot unpickle (an enum 0.18
added) is left out, so the outputs still load there; the loader's default then applies.

Enum members are written as the inert stand-ins of :mod:`reshard.core.foreign` (pickled under
megatron-core's class names, so they load as the real enums), dtypes as torch dtypes.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch

from reshard.core.foreign import STAND_INS
from reshard.models.facts import ARG_SPELLINGS, saved_arg

#: The generated table (see the module docstring).
TABLE = Path(__file__).with_name("megatron_args.json")


@functools.cache
def table() -> dict[str, Any]:
    """The generated table: ``defaults`` (key -> encoded value), ``model_keys``, ``left_out``."""
    return json.loads(TABLE.read_text(encoding="utf-8"))


def decode(value: Any) -> Any:
    """An ``args`` value from its JSON form: tagged enum members, dtypes and tuples, lists, plain values."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__enum__" in value:
            return STAND_INS[value["__enum__"]](value["value"])
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}
    return value


def default(name: str) -> Any:
    """Megatron-LM's value of ``name`` when a command line does not set it (a fresh object each call)."""
    return decode(table()["defaults"][name])


def parser_default(name: str) -> Any:
    """The parser's own default of ``name`` where ``validate_args`` changes it for some models."""
    return decode(table()["parser_defaults"][name])


def derived(args: Any) -> dict[str, Any]:
    """The values ``validate_args`` derives from the model's own ``args`` (for the keys ``args`` lacks):
    a fact saved under its older name in 0.19's spelling (``ARG_SPELLINGS``); the encoder's layers and
    sequence (the model's); the QKV bias every linear bias implies, and the GELU bias fusion a model
    without biases turns off; the rotary fusion only a rotary model keeps; gradients reduced in fp32
    for bf16; the experts' width defaulting to the MLP's; one query group without grouped-query
    attention; and from the layout, the expert TP (the TP unless set) and the transformer's pipeline
    size."""
    out: dict[str, Any] = {}
    for names in ARG_SPELLINGS.values():
        value = saved_arg(args, names[0])
        if value is not None:
            out.update(dict.fromkeys(names, value))
    out.update(encoder_num_layers=getattr(args, "num_layers", None),
               encoder_seq_length=getattr(args, "seq_length", None))
    if getattr(args, "add_bias_linear", default("add_bias_linear")):
        out["add_qkv_bias"] = True
    else:
        out.update(add_qkv_bias=parser_default("add_qkv_bias"), bias_gelu_fusion=False)
    rope = getattr(args, "position_embedding_type", default("position_embedding_type")) == "rope"
    out["apply_rope_fusion"] = parser_default("apply_rope_fusion") if rope else False
    if getattr(args, "bf16", False):
        out["accumulate_allreduce_grads_in_fp32"] = True
    if getattr(args, "num_experts", None) and getattr(args, "ffn_hidden_size", None):
        out["moe_ffn_hidden_size"] = args.ffn_hidden_size
    if not getattr(args, "group_query_attention", False):
        out["num_query_groups"] = default("num_query_groups")
    # the layout's (no world: a converted checkpoint has no job; Megatron-LM's defaults stand)
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    out.update(expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None) or tp,
               transformer_pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", None) or 1)
    return out


#: Keys never defaulted: the layer implementation the checkpoint's names follow is its own record (saved
#: ``args``, Megatron-Bridge's layer spec, an import's choice); Megatron-LM's default (Transformer Engine)
#: would claim names an output may not have (megatron-core's local spec keeps MLA's latent norms apart).
NOT_DEFAULTED = ("transformer_impl",)


class MadeArgs(argparse.Namespace):
    """``args`` reshard makes from what it knows of a model (a Hugging Face ``config.json``, a
    ``run_config.yaml``): those facts only, until written (:func:`complete`)."""


def complete(args: Any) -> argparse.Namespace:
    """A plain ``Namespace`` (what Megatron-LM unpickles) of ``args`` holding every key of Megatron-LM's
    ``args``: the keys it holds kept, the others derived from them (:func:`derived`) or Megatron-LM's
    defaults."""
    new = argparse.Namespace(**vars(args))
    have = vars(new)
    rules = derived(args)
    for name in table()["defaults"]:
        if name not in have and name not in NOT_DEFAULTED:
            setattr(new, name, copy.deepcopy(rules[name]) if name in rules else default(name))
    return new
