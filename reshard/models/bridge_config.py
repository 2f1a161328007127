"""Megatron-Bridge's ``run_config.yaml`` for a checkpoint reshard writes (torch_dist), so that
Megatron-Bridge loads it (``AutoBridge.export_ckpt``, ``load_megatron_model``).

Why: Megatron-Bridge 0.6 builds the model of a checkpoint from the ``run_config.yaml`` in its
iteration folder; without one it takes Megatron-LM's saved ``args`` and then needs a model type that
``export_ckpt`` never passes (``build_and_load_model``: "model type None not supported"), so it
loads no Megatron-LM checkpoint at all. The file's ``model`` section is the provider Megatron-Bridge
instantiates: ``GPTModelProvider`` (``MLAModelProvider`` for multi-latent attention) with the
model's fields, which are megatron-core's ``TransformerConfig`` names (the table both ways is
:mod:`reshard.models.given_facts`: ``BRIDGE_SAME``, ``BRIDGE_RENAMED``), its activation and dtypes as
the object references Megatron-Bridge writes (``{_target_: torch.bfloat16, _call_: false}``), the
layer spec of the checkpoint's names (``args.transformer_impl``: megatron-core's block spec, local or
Transformer Engine's, which builds dense, MoE and MLA layers alike), and the vocabulary as stored
(the padded rows, ``should_pad_vocab`` off). Every other field is left to Megatron-Bridge's defaults.
"""

from __future__ import annotations

from typing import Any

import torch
import yaml

from reshard.models.facts import saved_arg
from reshard.models.given_facts import BRIDGE_MLA_ONLY, BRIDGE_RENAMED, BRIDGE_SAME, NOT_BRIDGE_FIELDS, RUN_CONFIG

__all__ = ["RUN_CONFIG", "model_section", "run_config"]
#: Megatron-Bridge's providers (``megatron.bridge.models``)
GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
MLA_PROVIDER = "megatron.bridge.models.mla_provider.MLAModelProvider"
#: megatron-core's layer spec for a whole decoder (dense, MoE and MLA layers as the config says)
BLOCK_SPEC = "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec"


def _ref(target: str) -> dict[str, Any]:
    """An object reference as Megatron-Bridge's config serializer writes one (not called on load)."""
    return {"_target_": target, "_call_": False}


def activation(args: Any) -> str:
    """The MLP's activation: SwiGLU's SiLU, Megatron-LM's ``--openai-gelu`` (GELU's tanh form), else GELU."""
    if getattr(args, "swiglu", False):
        return "torch.nn.functional.silu"
    if getattr(args, "openai_gelu", False):
        return "megatron.core.transformer.utils.openai_gelu"
    return "torch.nn.functional.gelu"


def model_section(args: Any) -> dict[str, Any]:
    """The ``model`` section for the model Megatron-LM's ``args`` describe (see the module docstring)."""
    mla = bool(getattr(args, "multi_latent_attention", False))
    model: dict[str, Any] = {"_target_": MLA_PROVIDER if mla else GPT_PROVIDER}
    for field in BRIDGE_SAME:
        if field in NOT_BRIDGE_FIELDS or (field in BRIDGE_MLA_ONLY and not mla):
            continue
        value = saved_arg(args, field)
        if value is not None:
            model[field] = list(value) if isinstance(value, tuple) else value
    for field, (name, convert) in BRIDGE_RENAMED.items():
        value = saved_arg(args, name)
        if value is not None:
            model[field] = convert(value)
    heads = getattr(args, "num_attention_heads", None)
    model["num_query_groups"] = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    model["seq_length"] = getattr(args, "seq_length", None) or getattr(args, "max_position_embeddings", None)
    padded = getattr(args, "padded_vocab_size", None)
    if padded:  # the rows the checkpoint holds: built as they are
        model.update(vocab_size=padded, should_pad_vocab=False)
    model["activation_func"] = _ref(activation(args))
    dtype = getattr(args, "params_dtype", None)
    if isinstance(dtype, torch.dtype):
        model["params_dtype"] = _ref(str(dtype))
    model.update(bf16=bool(getattr(args, "bf16", False)), fp16=bool(getattr(args, "fp16", False)))
    model["transformer_layer_spec"] = {
        "_target_": BLOCK_SPEC, "_partial_": True, "_args_": [],
        "use_transformer_engine": (getattr(args, "transformer_impl", None) or "transformer_engine") != "local",
        "normalization": getattr(args, "normalization", None)}
    return model


def run_config(args: Any) -> str:
    """The text of ``run_config.yaml`` for a checkpoint whose Megatron-LM ``args`` are ``args``."""
    return yaml.safe_dump({"model": model_section(args)}, sort_keys=False)
