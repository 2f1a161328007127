"""Legacy-Megatron-named twins of megatron-core checkpoints (test-only helper).

The map back to legacy names is written out here, independently of reshard's own table
(``reshard.models.megatron_gpt.LEGACY_TO_CORE``), so tests that convert a twin check that table.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import torch

from reshard.core.safe_load import load_shard

#: megatron-core -> legacy Megatron names, written out here independently of reshard's table.
_TOP_TO_LEGACY = {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
                  "embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.weight",
                  "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight",
                  "decoder.final_layernorm.bias": "language_model.encoder.final_layernorm.bias",
                  "output_layer.weight": "language_model.output_layer.weight"}
_LAYER_TO_LEGACY = {"input_layernorm.": "input_layernorm.", "pre_mlp_layernorm.": "post_attention_layernorm.",
                    "self_attention.linear_qkv.": "self_attention.query_key_value.",
                    "self_attention.linear_proj.": "self_attention.dense.",
                    "mlp.linear_fc1.": "mlp.dense_h_to_4h.", "mlp.linear_fc2.": "mlp.dense_4h_to_h."}


def legacy_name(key: str, swap_norms: bool = False) -> str:
    if key in _TOP_TO_LEGACY:
        return _TOP_TO_LEGACY[key]
    _, _, i, rest = key.split(".", 3)
    for core, legacy in _LAYER_TO_LEGACY.items():
        if rest.startswith(core):
            if swap_norms and "layernorm" in core:  # the plausible wrong map
                legacy = "post_attention_layernorm." if core == "input_layernorm." else "input_layernorm."
            return f"language_model.encoder.layers.{i}.{legacy}{rest[len(core):]}"
    raise KeyError(key)


def rewrite_run(src: Path, dst: Path, edit) -> Path:
    """A copy of Megatron-LM run folder ``src`` with every rank file's state dict passed through ``edit``."""
    from reshard.core import foreign

    shutil.copytree(src, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        sd = edit(load_shard(f, mmap=False))
        torch.save(sd, f, pickle_module=foreign.ForeignPickleModule if foreign.contains_foreign(sd) else pickle)
    return dst


def perturbed_norms(sd: dict) -> dict:
    """Layer norms made distinct (megatron-core initializes them all to ones), equally on every rank."""
    for k, v in sd["model"].items():
        if "layernorm" in k and isinstance(v, torch.Tensor):
            g = torch.Generator().manual_seed(sum(map(ord, k)))
            sd["model"][k] = v + torch.rand(v.shape, generator=g, dtype=v.dtype)
    return sd


def as_legacy(swap_norms: bool = False):
    def edit(sd: dict) -> dict:
        sd["model"] = {legacy_name(k, swap_norms): v for k, v in sd["model"].items() if not k.endswith("_extra_state")}
        args = sd["args"]
        del args.transformer_impl
        args.use_legacy_models = True
        return sd
    return edit
