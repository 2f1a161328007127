"""LoRA adapters: Megatron-Bridge's PEFT checkpoints (megatron-core names) as Hugging Face PEFT's.

Megatron-Bridge 0.6.2 wraps each targeted megatron-core linear layer ``M`` (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2`` by default) with an adapter whose two weights are
``M.adapter.linear_in.weight`` (LoRA's A, ``[r, in]``) and ``M.adapter.linear_out.weight`` (LoRA's
B, ``[out, r]``); the layer computes ``W x + (alpha / r) * B A x``. What each weight is under TP is
Megatron-Bridge's ``ParallelLinearAdapter`` (``megatron/bridge/peft/utils.py``), read there:

=========================  ========================================  ========================================
base layer                 A (``linear_in``)                         B (``linear_out``)
=========================  ========================================  ========================================
column-parallel (qkv, fc1) ``ColumnParallelLinear(in, r,             ``ColumnParallelLinear(r, out,
                           gather_output=True)``: rows of r split    gather_output=False)``: its rows split as
                                                                     the base weight's (QKV per query group;
                                                                     fc1's gate/up halves, stored as two
                                                                     halves by ``apply_swiglu_sharded_factory``)
row-parallel (proj, fc2)   ``RowParallelLinear(in, r,                ``ColumnParallelLinear(r, out,
                           input_is_parallel=True)``: its columns    gather_output=True)``: rows of out split
                           split as the base weight's
=========================  ========================================  ========================================

A torch_dist checkpoint holds the global tensors of that sharded state dict, so its adapters are
the same at every TP. Hugging Face PEFT keeps one A and one B per Hugging Face module: the fused
B is split the way the base weight splits into its Hugging Face tensors (the architecture's name
table: QKV per query group into q/k/v, fc1 into gate/up) and A, which the fused layer shares, is
copied to each part. The Hugging Face names are PEFT's: ``base_model.model.<module>.lora_A.weight``.

Routed experts (a MoE base): Megatron-Bridge's ``is_expert_linear`` takes every
``mlp.experts...linear_fc1/2`` but the shared experts'; with ``SequentialMLP`` experts each expert's
linear is its own module, so each expert gets its own ``ParallelLinearAdapter`` (``is_expert``) under
``mlp.experts.local_experts.{e}.linear_fcN.adapter``. Its torch_dist save numbers the experts
globally (the expert axis, as the base weights'), so they go, like the base, to the Hugging Face
checkpoint's per-expert modules (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``), fc1's B
split into gate and up. transformers 5 holds those experts fused (``mlp.experts.gate_up_proj``
``[E, 2f, h]``, ``down_proj`` ``[E, h, f]``); peft 0.21.2 loads per-expert adapter names onto them by
its transformers-v5 conversion (``target_parameters``: A of gate and up concatenated, B
block-diagonal, rank and alpha doubled), as it loads Megatron-Bridge's own export, so the per-expert
names are what is written. The router (``TopKRouter``) is no default target; a shared expert's adapters
are a dense MLP's. Grouped-GEMM experts (Transformer Engine's ``TEGroupedLinear``: one adapter shared
by a rank's experts by default, or ``GroupedExpertLinearAdapter``) need Transformer Engine, so no
checkpoint of them is written here to check against; an adapter key whose base weight a model of the
run's args does not hold is refused (:func:`reshard.adapters.export_hf_peft`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import HFArchitecture, OutTensor, Run, export_of
from reshard.models.hf_common import EXPERT_FC1, EXPERT_FC2

#: An adapter weight: the wrapped module, and A (``in``) or B (``out``).
ADAPTER_KEY = re.compile(r"^(?P<module>.+)\.adapter\.linear_(?P<side>in|out)\.weight$")
#: PEFT's prefix of every tensor name of a causal LM's adapter (``PeftModel`` -> ``LoraModel`` -> the model).
PEFT_PREFIX = "base_model.model."
#: Megatron-Bridge's PEFT class that reshard computes (``run_config.yaml``'s ``peft._target_``).
BRIDGE_LORA = "megatron.bridge.peft.lora.LoRA"


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's hyperparameters: rank, alpha (the update is ``alpha / r * B A``), dropout, the
    megatron-core modules it wraps."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_settings(run_config: Mapping[str, Any], where: str) -> LoraSettings:
    """The ``peft`` section of Megatron-Bridge's ``run_config.yaml``; other PEFT methods (DoRA,
    canonical LoRA) are refused: their weights do not mean ``W + alpha / r * B A``."""
    peft = run_config.get("peft") if isinstance(run_config, Mapping) else None
    if not isinstance(peft, Mapping):
        raise LayoutError("run_config.yaml has no peft section: not a PEFT checkpoint", culprit=where,
                          hint="point at the iteration folder Megatron-Bridge saved with cfg.peft set")
    target = peft.get("_target_")
    if target != BRIDGE_LORA:
        raise LayoutError(f"the adapter is {target} (reshard computes {BRIDGE_LORA} only: DoRA's magnitude and "
                          "canonical LoRA's unfused adapters are another arithmetic)", culprit=where,
                          hint="export it with Megatron-Bridge's export_adapter_ckpt")
    r, alpha = peft.get("dim"), peft.get("alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise LayoutError(f"peft.dim {r!r} / peft.alpha {alpha!r} are no rank and alpha", culprit=where,
                          hint="re-copy run_config.yaml from the training run")
    return LoraSettings(r=r, alpha=float(alpha), dropout=float(peft.get("dropout") or 0.0),
                        targets=tuple(peft.get("target_modules") or ()))


def adapter_parts(key: str) -> tuple[str, str] | None:
    """``(base weight key, "A" or "B")`` of an adapter weight's megatron-core key; None for others."""
    m = ADAPTER_KEY.match(key)
    if m is None:
        return None
    return m["module"] + ".weight", "A" if m["side"] == "in" else "B"


def _peft_name(hf_weight: str, side: str) -> str:
    if not hf_weight.endswith(".weight"):
        raise LayoutError(f"{hf_weight} is no linear weight to adapt", culprit=hf_weight,
                          hint="adapt linear layers only")
    return PEFT_PREFIX + hf_weight[: -len("weight")] + f"lora_{side}.weight"


@dataclass(frozen=True)
class PeftExport:
    """One adapter weight's Hugging Face PEFT tensors: ``runs`` move byte ranges of the megatron-core
    tensor into ``outputs`` (B: split as the base weight), or, with ``copies``, each output is the
    whole tensor (A shared by the fused parts)."""

    key: str
    outputs: tuple[OutTensor, ...]
    runs: tuple[Run, ...] = ()
    copies: bool = False


def peft_export(key: str, shape: tuple[int, ...], itemsize: int, facts: ModelFacts,
                architecture: HFArchitecture) -> PeftExport:
    """Where adapter weight ``key`` (of ``shape``) goes in a Hugging Face PEFT adapter of
    ``architecture``: its base weight's row of the name table decides the Hugging Face modules and,
    for B, how the rows split (the base's byte runs, over B's rows)."""
    parts = adapter_parts(key)
    if parts is None:
        raise LayoutError(f"{key} is no LoRA adapter weight", culprit=key,
                          hint="convert an adapter checkpoint (keys ...adapter.linear_in/out.weight)")
    base, side = parts
    out_rows = shape[0] if side == "B" else None
    # the base's split is by rows of [out, *]: B's rows are the base's output rows
    probe = export_of(base, (out_rows if out_rows is not None else _base_rows(base, facts, shape), shape[1]),
                      itemsize, facts, architecture)
    if probe.convert is not None:
        raise LayoutError(f"{architecture.name} stores {base} transposed (a whole-tensor transform): its adapters are "
                          "not exported yet", culprit=key, hint="export the merged model (--merge-adapter)")
    if not probe.outputs:
        raise LayoutError(f"{base} has no counterpart in {architecture.name}", culprit=key,
                          hint="export adapters of linear layers the architecture holds")
    if side == "B":
        return PeftExport(key, tuple(OutTensor(_peft_name(o.name, "B"), o.shape) for o in probe.outputs), probe.runs)
    return PeftExport(key, tuple(OutTensor(_peft_name(o.name, "A"), shape) for o in probe.outputs), copies=True)


def _base_rows(base: str, facts: ModelFacts, shape: tuple[int, ...]) -> int:
    """The output rows of the base weight an A belongs to (only the row count matters to the name
    table's transforms): the fused QKV's ``(heads + 2 groups) * head_dim``, else anything even."""
    if base.endswith("linear_qkv.weight") and facts.heads and facts.query_groups and facts.head_dim:
        return (facts.heads + 2 * facts.query_groups) * facts.head_dim
    return 2


def target_modules(names: list[str]) -> list[str]:
    """PEFT's ``target_modules``: the module names (last component) the adapter's tensors wrap."""
    out = set()
    for n in names:
        stem = n[len(PEFT_PREFIX):] if n.startswith(PEFT_PREFIX) else n
        out.add(stem.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1])
    return sorted(out)


def moe_layers(args: Any) -> list[bool]:
    """Which decoder layers are MoE layers, as megatron-core reads ``moe_layer_freq``: an integer
    ``f`` makes every layer ``i`` with ``i % f == 0`` one, a list says it per layer; none without
    experts. A pattern string (Megatron-LM's command line form) is refused: the run's config holds
    what the model was built with, an integer or a list."""
    n = args.num_layers
    if not getattr(args, "num_experts", None):
        return [False] * n
    freq = getattr(args, "moe_layer_freq", None)
    freq = 1 if freq is None else freq
    if isinstance(freq, int) and freq > 0:
        return [i % freq == 0 for i in range(n)]
    if isinstance(freq, (list, tuple)) and len(freq) == n and all(f in (0, 1) for f in freq):
        return [bool(f) for f in freq]
    raise LayoutError(f"moe_layer_freq {freq!r} is neither a positive integer nor one 0/1 per layer",
                      culprit="run_config.yaml", hint="give model.moe_layer_freq as the run built the model")


def base_model_keys(args: Any) -> tuple[set[str], dict[str, int]]:
    """The megatron-core keys of the GPT model an adapter checkpoint's ``args`` describe (the
    checkpoint holds none of them), as far as an architecture is decided by them (every layer's
    linear weights and norms, the query/key norms, a MoE layer's router, routed experts
    (``SequentialMLP``'s names, :data:`~reshard.models.hf_common.EXPERT_FC1`) and shared expert, the
    embeddings, the output layer), and the split rows its FFN widths are read from (fc1's rows:
    ``[gate; up]`` under SwiGLU)."""
    a = args
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if getattr(a, "untie_embeddings_and_output_weights", False):
        keys.add("output_layer.weight")
    gated = 2 if getattr(a, "swiglu", False) else 1
    rows: dict[str, int] = {}
    for layer, moe in enumerate(moe_layers(a)):
        p = f"decoder.layers.{layer}."
        keys |= {p + n for n in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                                 "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight")}
        if getattr(a, "qk_layernorm", False):
            keys |= {p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"}
        if not moe:
            keys |= {p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"}
            rows[p + "mlp.linear_fc1.weight"] = a.ffn_hidden_size * gated
            continue
        keys.add(p + "mlp.router.weight")
        for e in range(a.num_experts):
            fc1, fc2 = (names[0].format(layer=layer, expert=e) for names in (EXPERT_FC1, EXPERT_FC2))
            keys |= {fc1, fc2}
            rows[fc1] = (getattr(a, "moe_ffn_hidden_size", None) or a.ffn_hidden_size) * gated
        shared = getattr(a, "moe_shared_expert_intermediate_size", None)
        if shared:
            keys |= {p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"}
            rows[p + "mlp.shared_experts.linear_fc1.weight"] = shared * gated
            if getattr(a, "moe_shared_expert_gate", False):
                keys.add(p + "mlp.shared_experts.gate_weight")
    return keys, rows


__all__ = ["ADAPTER_KEY", "BRIDGE_LORA", "PEFT_PREFIX", "LoraSettings", "PeftExport", "adapter_parts",
           "base_model_keys", "lora_settings", "moe_layers", "peft_export", "target_modules"]
