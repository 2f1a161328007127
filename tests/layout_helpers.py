"""Helpers shared by the modern-layout tests: a writer that uses only the core API, and a
renaming of megatron-core modules to legacy Megatron-LM names (test-only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def convert(src: Path | str, dst: Path, **options: Any) -> Any:
    """Plan and write a conversion with the core API only (what a writer does): every target under
    its planned name, then ``plan.extra_files``. Returns the plan."""
    from reshard.execution.engine import convert_target
    from reshard.execution.plan import ReshardOptions
    from reshard.execution.planner import build_plan

    plan = build_plan(str(src), ReshardOptions(**options))
    for t in plan.targets:
        path = dst / t.name
        path.parent.mkdir(parents=True, exist_ok=True)
        convert_target(plan, t.rank, path)
    for name, text in plan.extra_files.items():
        (dst / name).write_text(text)
    return plan


_PREFIXES = [("embedding.", "language_model.embedding."),
             ("decoder.final_layernorm.", "language_model.encoder.final_norm."),
             ("decoder.layers.", "language_model.encoder.layers."), ("output_layer.", "language_model.output_layer.")]
_INNER = [(".input_layernorm.", ".input_norm."), (".pre_mlp_layernorm.", ".post_attention_norm."),
          (".linear_qkv.", ".query_key_value."), (".linear_proj.", ".dense."), (".linear_fc1.", ".dense_h_to_4h."),
          (".linear_fc2.", ".dense_4h_to_h.")]


def legacy_names(sd: dict, tied: bool = False) -> dict:
    """A megatron-core module under legacy Megatron-LM names (2023 era: ``*_norm``, ``query_key_value``;
    the grouped QKV layout of checkpoint_version 3.0 is the same). Tied heads: ``word_embeddings_for_head``."""
    out = {}
    for k, v in sd.items():
        if k.endswith("_extra_state"):
            continue
        if tied and k == "output_layer.weight":
            out["word_embeddings_for_head.weight"] = v
            continue
        for a, b in _PREFIXES:
            if k.startswith(a):
                k = b + k[len(a):]
                break
        for a, b in _INNER:
            k = k.replace(a, b)
        out[k] = v
    return out


#: What a conversion's Megatron-LM ``args`` say of the optimizer and RNG state it drops (Megatron-LM's
#: ``--no-save-optim`` / ``--no-save-rng``, which its torch_dist loader reads; ``retarget_args``).
UNSAVED_STATE = {"no_save_optim": True, "no_save_rng": True}


def converted_args(args: Any) -> dict[str, Any]:
    """The ``args`` (as a dict) a conversion writes where a checkpoint written at its layout saved
    ``args``: the same, saying that no optimizer or RNG state was saved."""
    return {**vars(args), **UNSAVED_STATE}
