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

Back (``--to megatron-peft``, :func:`peft_import`): the same name table read the other way. Each
Hugging Face module's adapter goes to the megatron-core layer whose base weight its base weight is
part of (the table's rows); B is fused as the base weight is (the row's own ``gather``: QKV per query
group, fc1 ``[gate; up]``) and A, which the fused layer holds once, must be the same tensor, bit for
bit, in every part: otherwise the adapter is not one Megatron-Bridge's LoRA can hold, and is refused.
A fused layer adapted in some parts only (q_proj alone) is refused too: padding the other parts' B
with zeros would compute the same model, but it is another adapter (k and v become trainable, the
target modules change), so it is not written silently. Under TP each rank saves the boxes of the
global tensors that :func:`tp_boxes` gives (the table above: B's rows always split, A's rows of r
for a column-parallel layer, A's columns for a row-parallel one).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import (
    ByteTransform,
    HFArchitecture,
    HFModel,
    OutTensor,
    Run,
    export_of,
)
from reshard.models.hf_common import EXPERT_FC1, EXPERT_FC2
from reshard.models.megatron_gpt import LAYERS

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


# -- back: a Hugging Face PEFT adapter as Megatron-Bridge's ------------------------------------------

#: The layers Megatron-Bridge's LoRA wraps, as its ``target_modules`` lists its defaults (the order
#: ``run_config.yaml`` records them in).
BRIDGE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: Each wrapped layer's place in a transformer layer, in megatron-core's module order: a layer's
#: ``linear_proj`` is registered before its ``linear_qkv`` (Attention's constructor makes the
#: projection, SelfAttention's then adds the QKV), and its sharded state dict, so each rank's
#: ``.distcp`` file, lists the adapters in this order, A (``linear_in``) before B (``linear_out``).
MODULE_ORDER = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
#: The wrapped layers whose base weight is column-parallel (A: ``ColumnParallelLinear(in, r)``, its
#: rows of r split over TP); the others are row-parallel (A: ``RowParallelLinear(in, r)``, its
#: columns split as the base's input). B is ``ColumnParallelLinear(r, out)`` in both: rows split.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
#: PEFT's name of an adapter weight: the Hugging Face module (of the causal LM) and A or B.
PEFT_WEIGHT = re.compile(r"^" + re.escape(PEFT_PREFIX) + r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
#: ``adapter_config.json`` fields whose value, other than the plain one, means another arithmetic than
#: ``W + alpha / r * B A`` on the adapted linear layers, or weights beside them: (field, plain, why).
PEFT_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA's magnitude vector rescales the adapted weight"),
    ("use_rslora", False, "rsLoRA scales the update by alpha / sqrt(r), Megatron-Bridge's LoRA by alpha / r"),
    ("fan_in_fan_out", False, "its weights are stored transposed ([in, out] layers)"),
    ("bias", "none", "biases are trained beside the adapters"),
    ("lora_bias", False, "its B has a bias"),
    ("modules_to_save", None, "whole modules are trained beside the adapters"),
    ("layers_to_transform", None, "some layers only are adapted"),
    ("target_parameters", None, "parameters (3-D expert tensors) are adapted, not linear layers"),
    ("trainable_token_indices", None, "token embeddings are trained beside the adapters"),
    ("layer_replication", None, "layers are replicated, sharing adapters"),
    ("use_qalora", False, "QA-LoRA pools the input in groups before A"),
    ("alora_invocation_tokens", None, "activated LoRA adapts the tokens after its invocation only"),
)


def peft_settings(config: Mapping[str, Any], where: str) -> LoraSettings:
    """The LoRA settings of a Hugging Face PEFT ``adapter_config.json`` that Megatron-Bridge's LoRA
    computes alike (``targets`` left empty: the tensors decide them, :func:`peft_import`); refused in
    one line: another PEFT type, DoRA, rsLoRA, a rank or alpha pattern that differs from ``r`` /
    ``lora_alpha`` (Megatron-Bridge's LoRA has one rank and one alpha), and every field of
    :data:`PEFT_REFUSED`."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise LayoutError(f"the adapter is PEFT's {kind} (Megatron-Bridge's LoRA holds a LoRA adapter only)",
                          culprit=where, hint="convert a LoRA adapter (peft_type LORA)")
    for name, plain, why in PEFT_REFUSED:
        value = config.get(name)
        if value not in (None, plain) and value not in ([], {}):
            raise LayoutError(f"{name} is {value!r}: {why}, which Megatron-Bridge's LoRA does not compute",
                              culprit=where, hint="convert a plain LoRA adapter, or merge it into the base with peft")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)) \
            or isinstance(alpha, bool):
        raise LayoutError(f"r {r!r} / lora_alpha {alpha!r} are no rank and alpha", culprit=where,
                          hint="re-save the adapter with peft's save_pretrained")
    for field, plain in (("rank_pattern", r), ("alpha_pattern", alpha)):
        pattern = config.get(field) or {}
        other = next(((k, v) for k, v in dict(pattern).items() if v != plain), None)
        if other is not None:
            raise LayoutError(f"{field} gives {other[0]} {other[1]!r} beside {plain!r}: Megatron-Bridge's LoRA has one "
                              "rank and one alpha", culprit=where, hint="convert an adapter of one rank and alpha")
    return LoraSettings(r=r, alpha=float(alpha), dropout=float(config.get("lora_dropout") or 0.0), targets=())


def peft_section(lora: LoraSettings, targets: Sequence[str]) -> dict[str, Any]:
    """``run_config.yaml``'s ``peft`` section for ``lora`` wrapping ``targets``, as Megatron-Bridge
    0.6.2's ``save_checkpoint`` records its ``LoRA`` (every field, the others at their defaults;
    :func:`lora_settings` reads it back); ``alpha`` an integer where it is one, as LoRA holds it."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {"_target_": BRIDGE_LORA, "a2a_experimental": False, "alpha": alpha, "canonical_mapping": {},
            "dim": lora.r, "dropout": lora.dropout, "dropout_position": "pre", "exclude_modules": [],
            "experts_shared_outer_loras": False, "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
            "lora_dtype": None, "normalize_moe_lora": False, "params_to_save": set(),
            "sequence_parallel_input_regather": False, "share_expert_adapters": True,
            "target_modules": [t for t in BRIDGE_TARGETS if t in targets]}


def _base_shape(layer: str, facts: ModelFacts, ffn: int) -> tuple[int, int]:
    """The base weight ``[out, in]`` of a wrapped layer (what an adapter's ``B @ A`` must be).

    ===============  ====================================  =====================
    layer            out                                   in
    ===============  ====================================  =====================
    ``linear_qkv``   (heads + 2 query groups) * head_dim   hidden
    ``linear_proj``  hidden                                heads * head_dim
    ``linear_fc1``   ffn (2 ffn gated: ``[gate; up]``)     hidden
    ``linear_fc2``   hidden                                ffn
    ===============  ====================================  =====================
    """
    heads, groups, d, h = facts.heads or 0, facts.query_groups or 0, facts.head_dim or 0, facts.hidden or 0
    return {"linear_qkv": ((heads + 2 * groups) * d, h), "linear_proj": (h, heads * d),
            "linear_fc1": (ffn * (2 if facts.swiglu else 1), h), "linear_fc2": (h, ffn)}[layer]


def wrapped_layer(key: str) -> str:
    """The wrapped layer (``linear_qkv``, ...) of a base weight key
    (``decoder.layers.0.self_attention.linear_qkv.weight``)."""
    return key.rsplit(".", 2)[-2]


def peft_import(tensors: Mapping[str, Any], model: HFModel, r: int, ffn: int) -> dict[str, tuple[Any, Any]]:
    """Megatron-Bridge's adapters from a Hugging Face PEFT adapter's ``tensors`` (PEFT name -> lazy
    tensor) for the base ``model`` (its ``config.json`` read): megatron-core base weight key ->
    ``(A, B)``, every layer of the model, in megatron-core's order (see the module docstring for the
    fusion and its refusals). Each B is the row's lazy ``gather`` of its parts (read box by box when
    written); each A is read here, to be compared."""
    facts, family, table = model.facts, model.family, model.names
    found: dict[tuple[int, tuple[tuple[str, str], ...]], dict[str, dict[int, str]]] = {}
    for name in sorted(tensors):
        m = PEFT_WEIGHT.match(name)
        if m is None:
            raise LayoutError(f"{name} is no LoRA A or B weight of a linear layer", culprit=name,
                              hint="convert a plain LoRA adapter of linear layers (no DoRA magnitudes, no "
                                   "embedding adapters, no biases)")
        hf = m["module"] + ".weight"
        hf = family.table_name(hf, facts) if family is not None else hf
        hit = next(((i, j, mm) for i, row in enumerate(table) if row.transform is not None and hf is not None
                    for j, mm in enumerate(p.match(hf) for p in row.hf_patterns) if mm), None)
        row = table[hit[0]] if hit is not None else None
        if row is None or hit is None or not isinstance(row.transform, ByteTransform) or \
                row.transform.stacks is not None or wrapped_layer(row.core[0]) not in BRIDGE_TARGETS:
            raise LayoutError(f"{m['module']} is no layer Megatron-Bridge's LoRA wraps in {model.architecture} "
                              f"({', '.join(BRIDGE_TARGETS)})", culprit=name,
                              hint="convert an adapter of the attention and MLP projections")
        i, j, mm = hit
        found.setdefault((i, tuple(sorted(mm.groupdict().items()))), {}).setdefault(m["side"], {})[j] = name
    pairs: dict[str, tuple[Any, Any]] = {}
    for (i, fields), sides in found.items():
        row = table[i]
        key = row.core[0].format(**dict(fields))
        parts = [PEFT_PREFIX + n.format(**dict(fields))[: -len("weight")] for n in row.hf]
        layer = wrapped_layer(key)
        for side in ("A", "B"):
            held = sides.get(side, {})
            missing = [p + f"lora_{side}.weight" for j, p in enumerate(parts) if j not in held]
            if missing:
                have = ", ".join(sorted(held.values())) or "its other side"
                raise LayoutError(f"{missing[0]} is missing beside {have}: Megatron-Bridge's LoRA adapts {layer} as "
                                  f"one layer ({len(parts)} Hugging Face modules)", culprit=missing[0],
                                  hint="adapt every part of the fused layer (q_proj, k_proj and v_proj; gate_proj "
                                       "and up_proj) with one shared A")
        a_names = [sides["A"][j] for j in range(len(parts))]
        a_parts = [tensors[n] for n in a_names]
        a = a_parts[0].materialize() if hasattr(a_parts[0], "materialize") else a_parts[0]
        for n, other in zip(a_names[1:], a_parts[1:], strict=True):
            o = other.materialize() if hasattr(other, "materialize") else other
            if o.dtype != a.dtype or o.shape != a.shape or not torch.equal(o.view(torch.uint8), a.view(torch.uint8)):
                raise LayoutError(f"LoRA A of {n[len(PEFT_PREFIX):-len('.lora_A.weight')]} differs from "
                                  f"{a_names[0][len(PEFT_PREFIX):-len('.lora_A.weight')]}'s: Megatron-Bridge's {layer} "
                                  "adapter holds one A for its fused parts", culprit=n,
                                  hint="merge the adapter into the base with peft (merge_and_unload), or train one "
                                       "with A shared")
        b_names = tuple(sides["B"][j] for j in range(len(parts)))
        b = row.transform.gather(b_names, [tensors[n] for n in b_names], facts)
        want = _base_shape(layer, facts, ffn)
        if tuple(a.shape) != (r, want[1]) or tuple(b.shape) != (want[0], r) or a.dtype != b.dtype:
            raise LayoutError(f"LoRA B @ A of {key} is {tuple(b.shape)} @ {tuple(a.shape)} ({b.dtype}, {a.dtype}); the "
                              f"base's weight is {want[0]} x {want[1]} and r is {r}", culprit=a_names[0],
                              hint="give the config.json of the base the adapter was trained on (--model-config)")
        pairs[key] = (a, b)
    layers = facts.num_layers or 0
    adapted = sorted({wrapped_layer(k) for k in pairs}, key=BRIDGE_TARGETS.index)
    for n in range(layers):
        for place in MODULE_ORDER:
            if wrapped_layer(place + ".weight") in adapted and f"decoder.layers.{n}.{place}.weight" not in pairs:
                raise LayoutError(f"layer {n} has no adapter on {place} (the others have): Megatron-Bridge's LoRA "
                                  "adapts every layer", culprit=f"decoder.layers.{n}.{place}",
                                  hint="convert an adapter of every layer")
    extra = sorted(k for k in pairs if int(k.split(".")[2]) >= layers)
    if extra:
        raise LayoutError(f"the adapter wraps {extra[0]}; the base has {layers} layers", culprit=extra[0],
                          hint="give the config.json of the base the adapter was trained on (--model-config)")
    dtypes = {t.dtype for ab in pairs.values() for t in ab}
    if len(dtypes) > 1:
        raise CheckpointFormatError(f"holds adapters of {', '.join(sorted(map(str, dtypes)))}: Megatron-Bridge's "
                                    "adapters have the model's one dtype", culprit="adapter_model.safetensors",
                                    hint="cast the adapter to one dtype")
    return {f"decoder.layers.{n}.{place}.weight": pairs[f"decoder.layers.{n}.{place}.weight"]
            for n in range(layers) for place in MODULE_ORDER if f"decoder.layers.{n}.{place}.weight" in pairs}


def dist_key(key: str, side: str) -> tuple[str, int]:
    """The torch_dist key of an adapter weight of the base weight ``key`` and its layer: the wrapped
    layer's place under the stacked ``decoder.layers.`` (whose leading axis is the layer), then
    ``adapter.linear_in`` (A) or ``adapter.linear_out`` (B), as Megatron-Bridge's sharded state dict keys it."""
    layer, place = key[len(LAYERS):].split(".", 1)
    return f"{LAYERS}{place.rsplit('.', 1)[0]}.adapter.linear_{'in' if side == 'A' else 'out'}.weight", int(layer)


def tp_boxes(layer: str, side: str, shape: tuple[int, int], tp: int, swiglu: bool
             ) -> list[list[tuple[tuple[int, int], tuple[int, int]]]]:
    """Each TP rank's boxes ``(offsets, sizes)`` of one adapter weight of ``shape`` (A ``[r, in]``
    or B ``[out, r]`` of the wrapped ``layer``), in the order megatron-core's sharded state dict
    saves them: B's rows split (a gated ``linear_fc1``'s B as its two halves, each split, rank ``t``
    holding part ``t`` of each: ``apply_swiglu_sharded_factory``); a column-parallel layer's A split
    by rows (of r), a row-parallel layer's by columns. :func:`check_tp` says when they divide."""
    axis = 1 if side == "A" and layer not in COLUMN_PARALLEL else 0
    halves = 2 if side == "B" and layer == "linear_fc1" and swiglu else 1
    part = shape[axis] // halves
    step = part // tp
    out = []
    for t in range(tp):
        boxes = []
        for h in range(halves):
            off, size = [0, 0], list(shape)
            off[axis], size[axis] = h * part + t * step, step
            boxes.append(((off[0], off[1]), (size[0], size[1])))
        out.append(boxes)
    return out


def check_tp(pairs: Mapping[str, tuple[Any, Any]], tp: int, facts: ModelFacts) -> None:
    """Refuse a TP the adapters (and their base) do not split under: A's rank of a column-parallel
    layer, the split axes of :func:`tp_boxes`, and the QKV's query groups (each rank holds whole
    groups, as the base's QKV is split)."""
    groups = facts.query_groups or 0
    if any(wrapped_layer(k) == "linear_qkv" for k in pairs) and groups % tp:
        raise LayoutError(f"{groups} query groups do not split over TP {tp} (each rank holds whole groups of the QKV)",
                          culprit="--target-tp", hint="a TP that divides the query groups")
    for key, (a, b) in pairs.items():
        layer = wrapped_layer(key)
        for side, t in (("A", a), ("B", b)):
            axis = 1 if side == "A" and layer not in COLUMN_PARALLEL else 0
            halves = 2 if side == "B" and layer == "linear_fc1" and facts.swiglu else 1
            n = t.shape[axis] // halves
            if n % tp:
                what = (f"rank r={n}" if side == "A" and axis == 0 else
                        f"{'input' if side == 'A' else 'output'} of {n}{' per half' if halves == 2 else ''}")
                raise LayoutError(f"LoRA {side}'s {what} of {layer} does not split over TP {tp} (Megatron-Bridge's "
                                  f"{'ColumnParallelLinear(in, r)' if side == 'A' and axis == 0 else 'adapter'} "
                                  "splits it over the TP ranks)", culprit="--target-tp",
                                  hint=f"a TP that divides {n}")


__all__ = ["ADAPTER_KEY", "BRIDGE_LORA", "BRIDGE_TARGETS", "COLUMN_PARALLEL", "MODULE_ORDER", "PEFT_PREFIX",
           "LoraSettings", "PeftExport", "adapter_parts", "base_model_keys", "check_tp", "dist_key", "lora_settings",
           "moe_layers", "peft_export", "peft_import", "peft_section", "peft_settings", "target_modules", "tp_boxes",
           "wrapped_layer"]
