"""Megatron GPT models — legacy Megatron / DeepSpeed names (``transformer.*``,
``language_model.encoder.*``) and megatron-core names (``embedding.*``, ``decoder.layers.N.*``,
``output_layer.*``), dense MLP (optionally SwiGLU) or megatron-core MoE layers (router, routed
and shared experts), MHA or GQA: one rule table.

This family decides its model facts (heads, query groups, gating, vocabulary padding, tied
embeddings) with the default, Megatron-LM deciders of :class:`~reshard.models.base.ModelFamily`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError
from reshard.core.plan_types import SourceStage, TargetParam
from reshard.core.rules import Kind, Place, QKVLayout, QuantSlot, Rule, layer_index
from reshard.models.base import ModelFamily

# --- legacy Megatron / DeepSpeed names (transformer.* / language_model.encoder.*) ---------------
_L = r"^(?:transformer|language_model\.encoder)\.layers\.\d+\."
_ATT = r"(?:self_)?attention\."
_EMB = r"^(?:language_model\.embedding\.|embedding\.)?"
_LEG_FINAL = r"^(?:transformer|language_model\.encoder)\."
# --- megatron-core names (embedding.*, decoder.layers.N.*, output_layer.*) ----------------------
#: How every parameter name of a decoder layer starts (the rules of a layer's modules extend it).
DECODER_LAYER = r"^decoder\.layers\.\d+\."
_D = DECODER_LAYER
_LN = r"(?:weight|bias)$"
#: An expert's fc1/fc2 (completed by ``1\.weight|linear_fc1\.weight\d+)$`` and the like).
_EXPERT = r"mlp\.experts\.(?:local_experts\.\d+\.linear_fc"

_V, _G = QKVLayout.VERSIONED, QKVLayout.GROUPED
_FIRST, _LAST = Place.FIRST, Place.LAST


def _core(name: str, pattern: str, kind: Kind, quant: QuantSlot | None = None, **kw: object) -> Rule:
    """A megatron-core rule (``core.`` name prefix, ``core`` family)."""
    return Rule("core." + name, pattern, kind, quant, family="core", **kw)  # type: ignore[arg-type]


#: Every supported name, legacy eras and megatron-core, in one ordered table.
MEGATRON_GPT_RULES: tuple[Rule, ...] = (
    # legacy transformer layers
    Rule("qkv.weight", _L + _ATT + r"query_key_value\.weight$", Kind.QKV, QuantSlot.QKV, head_dim=True, qkv=_V),
    Rule("qkv.bias", _L + _ATT + r"query_key_value\.bias$", Kind.QKV, head_dim=True, qkv=_V),
    Rule("attn.dense.weight", _L + _ATT + r"dense\.weight$", Kind.ROW, QuantSlot.DENSE, head_dim=True),
    Rule("attn.dense.bias", _L + _ATT + r"dense\.bias$", Kind.REPLICATED),
    Rule("mlp.h_to_4h.weight", _L + r"mlp\.dense_h_to_4h\.weight$", Kind.COLUMN, QuantSlot.H_TO_4H, mlp=True,
         gated=True),
    Rule("mlp.h_to_4h.bias", _L + r"mlp\.dense_h_to_4h\.bias$", Kind.COLUMN, gated=True),
    Rule("mlp.4h_to_h.weight", _L + r"mlp\.dense_4h_to_h\.weight$", Kind.ROW, QuantSlot.FOUR_H_TO_H, mlp=True),
    Rule("mlp.4h_to_h.bias", _L + r"mlp\.dense_4h_to_h\.bias$", Kind.REPLICATED),
    Rule("layernorms", _L + r"(?:input_layernorm|post_attention_layernorm|input_norm|post_attention_norm)\."
         + _LN, Kind.REPLICATED),
    Rule("final_layernorm", _LEG_FINAL + r"(?:final_layernorm|final_norm)\." + _LN, Kind.REPLICATED, place=_LAST),
    Rule("word_embeddings", _EMB + r"word_embeddings\.weight$", Kind.COLUMN, vocab=True, place=_FIRST,
         family="shared"),
    Rule("position_embeddings", _EMB + r"position_embeddings\.weight$", Kind.REPLICATED, place=_FIRST,
         family="shared"),
    Rule("final_linear", r"^(?:transformer\.|language_model\.)?final_linear\.weight$", Kind.COLUMN, vocab=True,
         place=_LAST),
    Rule("output_layer", r"^language_model\.output_layer\.weight$", Kind.COLUMN, vocab=True, place=_LAST,
         optional=True),
    Rule("word_embeddings_for_head", r"^word_embeddings_for_head\.weight$", Kind.COLUMN, vocab=True,
         place=_LAST, tied_head=True, optional=True),
    # megatron-core transformer layers
    _core("linear_qkv.weight", _D + r"self_attention\.linear_qkv\.weight$", Kind.QKV, QuantSlot.QKV,
          head_dim=True, qkv=_G),
    _core("linear_qkv.bias", _D + r"self_attention\.linear_qkv\.bias$", Kind.QKV, head_dim=True, qkv=_G,
          optional=True),
    _core("linear_proj.weight", _D + r"self_attention\.linear_proj\.weight$", Kind.ROW, QuantSlot.DENSE,
          head_dim=True),
    _core("linear_proj.bias", _D + r"self_attention\.linear_proj\.bias$", Kind.REPLICATED, optional=True),
    _core("linear_fc1.weight", _D + r"mlp\.linear_fc1\.weight$", Kind.COLUMN, QuantSlot.H_TO_4H, mlp=True,
          gated=True),
    _core("linear_fc1.bias", _D + r"mlp\.linear_fc1\.bias$", Kind.COLUMN, gated=True, optional=True),
    _core("linear_fc2.weight", _D + r"mlp\.linear_fc2\.weight$", Kind.ROW, QuantSlot.FOUR_H_TO_H, mlp=True),
    _core("linear_fc2.bias", _D + r"mlp\.linear_fc2\.bias$", Kind.REPLICATED, optional=True),
    # megatron-core MoE layers: the router, routed experts (SequentialMLP's local_experts.{i}.linear_fc*
    # or grouped GEMM's linear_fc*.weight{i}; numbered globally here, see expert_index) and
    # shared experts; expert weights split over TP like a dense MLP's (expert TP = TP)
    _core("router", _D + r"mlp\.router\.(?:weight|bias|expert_bias)$", Kind.REPLICATED, optional=True),
    _core("experts.linear_fc1.weight", _D + _EXPERT + r"1\.weight|linear_fc1\.weight\d+)$", Kind.COLUMN,
          mlp=True, gated=True, optional=True, expert=True),
    _core("experts.linear_fc1.bias", _D + _EXPERT + r"1\.bias|linear_fc1\.bias\d+)$", Kind.COLUMN, gated=True,
          optional=True, expert=True),
    _core("experts.linear_fc2.weight", _D + _EXPERT + r"2\.weight|linear_fc2\.weight\d+)$", Kind.ROW, mlp=True,
          optional=True, expert=True),
    _core("experts.linear_fc2.bias", _D + _EXPERT + r"2\.bias|linear_fc2\.bias\d+)$", Kind.REPLICATED,
          optional=True, expert=True),
    _core("shared_experts.linear_fc1.weight", _D + r"mlp\.shared_experts\.linear_fc1\.weight$", Kind.COLUMN,
          mlp=True, gated=True, optional=True),
    _core("shared_experts.linear_fc1.bias", _D + r"mlp\.shared_experts\.linear_fc1\.bias$", Kind.COLUMN,
          gated=True, optional=True),
    _core("shared_experts.linear_fc2.weight", _D + r"mlp\.shared_experts\.linear_fc2\.weight$", Kind.ROW,
          mlp=True, optional=True),
    _core("shared_experts.rest", _D + r"mlp\.shared_experts\.(?:linear_fc2\.bias|gate_weight)$", Kind.REPLICATED,
          optional=True),
    _core("layernorms", _D + r"(?:input_layernorm|pre_mlp_layernorm)\." + _LN, Kind.REPLICATED, optional=True),
    _core("fused_layernorms", _D + r"(?:self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_" + _LN,
          Kind.REPLICATED, optional=True),
    _core("qk_layernorms", _D + r"self_attention\.(?:q_layernorm|k_layernorm)\." + _LN, Kind.REPLICATED,
          optional=True),
    # a routed expert's own extra state (SequentialMLP's local_experts.{i}.linear_fc*): its expert's file
    _core("experts.extra_state", _D + r"mlp\.experts\.local_experts\.\d+\.(?:.+\.)?_extra_state$", Kind.CARRIED,
          optional=True, expert=True),
    _core("layer_extra_state", _D + r"(?:.+\.)?_extra_state$", Kind.CARRIED, optional=True),
    _core("final_layernorm", r"^decoder\.final_layernorm\." + _LN, Kind.REPLICATED, place=_LAST),
    _core("output_layer", r"^output_layer\.weight$", Kind.COLUMN, vocab=True, place=_LAST, optional=True),
    _core("last_extra_state", r"^(?:output_layer|decoder\.final_layernorm)\._extra_state$", Kind.CARRIED,
          place=_LAST, optional=True),
    _core("first_extra_state", r"^embedding\.(?:.+\.)?_extra_state$", Kind.CARRIED, place=_FIRST, optional=True),
)


#: megatron-core keeps the router's expert bias in float32 whatever the model's dtype (as DeepSeek
#: publishes ``e_score_correction_bias``), and makes the router's weight in float32 (0.16.1's
#: ``TopKRouter``; transformers keeps Nemotron-H's ``gate.weight`` so): no sign of a model of mixed dtypes.
FLOAT32_BUFFER = re.compile(r"\.mlp\.router\.(?:expert_bias|weight)$")


# -- megatron-core's expert numbering (MoE) ----------------------------------------------------------
#: Where a parameter name carries its expert number: SequentialMLP's
#: ``mlp.experts.local_experts.{i}.linear_fc1.weight`` and grouped GEMM's
#: ``mlp.experts.linear_fc1.weight{i}``. Every EP rank of a stage holds the same dense weights and
#: its own ``E / EP`` experts, numbered locally in its files; canonical names (what the planner
#: sees: one parameter per global expert) carry the global number:
#:
#: =============  ==============================  ======================================
#: EP rank ``e``  file key (local number ``i``)    canonical key (global number)
#: =============  ==============================  ======================================
#: ``0 .. EP-1``  ``...local_experts.{i}.<rest>``  ``...local_experts.{e*E/EP+i}.<rest>``
#: ``0 .. EP-1``  ``...linear_fc1.weight{i}``      ``...linear_fc1.weight{e*E/EP+i}``
#: =============  ==============================  ======================================
_EXPERT_RES: tuple[re.Pattern[str], ...] = (
    re.compile(r"(\.local_experts\.)(\d+)(\.)"),
    re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)()$"),
)


def expert_index(key: str) -> int | None:
    """The expert number in a parameter name, or None for a parameter of no single expert."""
    for rx in _EXPERT_RES:
        m = rx.search(key)
        if m:
            return int(m.group(2))
    return None


def with_expert(key: str, index: int) -> str:
    """``key`` with its expert number replaced (a local number on an EP rank <-> the global one)."""
    for rx in _EXPERT_RES:
        if rx.search(key):
            return rx.sub(lambda m: f"{m.group(1)}{index}{m.group(3)}", key, count=1)
    raise ValueError(f"{key} names no expert")


# -- megatron-core's multi-token prediction (MTP) layers ---------------------------------------------
#: How megatron-core names its multi-token prediction layers (``mtp.layers.N``): after the decoder's
#: stack, on the last pipeline stage, numbered apart from the stack's layers (no layer of it), their
#: rules placing them (:data:`reshard.models.deepseek.DEEPSEEK_RULES`).
MTP_LAYERS = "mtp.layers."
#: An entry of a multi-token prediction layer: the layer (``mtp.layers.N``) and the rest of its name.
_MTP_ENTRY = re.compile(r"^(" + re.escape(MTP_LAYERS) + r"\d+)\.(.+)$")


def holds_mtp_layers(keys: Iterable[str]) -> bool:
    """Whether megatron-core names ``keys`` hold multi-token prediction layers (``mtp.layers.N``)."""
    return any(k.startswith(MTP_LAYERS) for k in keys)


def stack_layer(key: str) -> int | None:
    """The decoder layer parameter ``key`` belongs to (legacy or megatron-core names), None for a
    parameter of no decoder layer: embeddings, final norm, a multi-token prediction layer's."""
    return None if key.startswith(MTP_LAYERS) else layer_index(key)


def beside_stack_entry(name: str) -> tuple[str, str] | None:
    """The layer beside the decoder's stack (a multi-token prediction layer, ``mtp.layers.N``) that
    megatron-core name ``name`` is an entry of, and the rest of its name; None for an entry of none.
    torch_dist never stacks such a layer's entries: its experts are one key, the expert axis leading."""
    m = _MTP_ENTRY.match(name)
    return (m.group(1), m.group(2)) if m else None


#: A linear layer's bias as megatron-core's ``add_bias_linear`` gives it (attention output, MLP and
#: routed experts' fc1/fc2, the router), under SequentialMLP's and grouped GEMM's names.
_LINEAR_BIAS = re.compile(r"\.(?:linear_proj|linear_fc[12]|router)\.bias\d*$")


class MegatronCoreFamily(ModelFamily):
    """What a family of megatron-core's GPT model has beside its rule table: the multi-token
    prediction layers after the stack (:data:`MTP_LAYERS`), whose pipeline stage (the last) keeps
    its own copy of the embeddings when it is not the first (they embed the shifted tokens there),
    and the expert TP of MoE layers with linear biases."""

    beside_stack = (MTP_LAYERS,)
    stage_copy_words = ("the multi-token prediction stage's copy",
                        "the multi-token prediction layers' copy of the embeddings")

    def keeps_stage_copy(self, keys: Iterable[str]) -> bool:
        return holds_mtp_layers(keys)

    def expert_tp(self, keys: Sequence[str]) -> int | None:
        """1 for a model with MoE layers and linear biases (``add_bias_linear``): megatron-core 0.16.1's
        ``TransformerConfig`` asserts "Bias in Moe is only supported when ETP==1"; None otherwise."""
        moe = any(k.endswith(".mlp.router.weight") for k in keys)
        return 1 if moe and any(_LINEAR_BIAS.search(k) for k in keys) else None


def is_megatron_core(keys: Iterable[str]) -> bool:
    """Whether parameter names follow megatron-core (``decoder.layers.N``) rather than legacy."""
    return any(k.startswith(("decoder.", "output_layer.")) for k in keys)


def local_experts(keys: Sequence[str], where: str) -> int:
    """Experts per MoE layer in one rank file (0: no MoE layer), numbered locally 0..L-1."""
    counts = experts_per_layer(keys, where, hint="each rank file must number its experts locally, from 0")
    return next(iter(counts.values()), 0)


def expert_rows(stages: list[SourceStage]) -> list[SourceStage]:
    """The grid's rows with their experts under global numbers: the EP ranks of a stage must hold
    the same keys (same dense weights, same count of local experts); the rows after a stage's first
    keep only their experts (the dense weights are taken from EP rank 0)."""
    first: dict[int, SourceStage] = {}
    out = []
    for st in stages:
        keys = list(st.modules[0])
        head = first.setdefault(st.stage, st)
        if set(keys) != set(head.modules[0]):
            diff = sorted(set(keys) ^ set(head.modules[0]))
            raise InconsistentShardsError(
                f"expert-parallel rank {st.expert_rank} holds other parameters than rank {head.expert_rank} "
                f"({len(diff)} differ, e.g. {diff[0]})", culprit=st.names[0],
                hint="all expert-parallel rank folders must come from one checkpoint (same experts per rank)")
        per_rank = local_experts(keys, st.names[0])
        base = st.expert_rank * per_rank
        canonical = dict(st.canonical)
        for key in keys:
            i = expert_index(key)
            if i is not None:
                canonical[key] = with_expert(st.canonical_name(key), base + i)
        modules = st.modules if st is head else [
            {k: v for k, v in mod.items() if expert_index(k) is not None} for mod in st.modules]
        out.append(replace(st, canonical=canonical, modules=modules))
    return out


def experts_per_layer(keys: Iterable[str], where: str, saved: int | None = None,
                      hint: str = "supply every expert (every expert-parallel rank folder)") -> dict[int | None, int]:
    """Experts per MoE layer (layer -> count) among parameter names ``keys``: numbered 0..E-1, as
    many in every MoE layer, and as many as the saved ``args.num_experts`` (``saved``) says — a
    target EP rank's share is a run of numbers, so a gap would silently lose an expert."""
    found: dict[int | None, set[int]] = {}
    for key in keys:
        g = expert_index(key)
        if g is not None:
            found.setdefault(stack_layer(key), set()).add(g)
    for layer, gs in found.items():
        if sorted(gs) != list(range(len(gs))):
            missing = sorted(set(range(max(gs) + 1)) - gs)
            raise CheckpointFormatError(f"layer {layer} holds experts numbered {sorted(gs)[:8]}..., missing "
                                        f"{missing[:8]}", culprit=where, hint=hint)
    counts = {layer: len(gs) for layer, gs in found.items()}
    if len(set(counts.values())) > 1 or (counts and saved is not None and saved not in counts.values()):
        what = ", ".join(f"layer {layer}: {n}" for layer, n in sorted(counts.items(), key=lambda kv: kv[0] or 0))
        raise CheckpointFormatError(f"MoE layers hold different numbers of experts ({what})" if saved is None else
                                    f"args.num_experts is {saved} but the MoE layers hold {what}", culprit=where,
                                    hint=hint)
    return counts


def rank_experts(entries: Sequence[TargetParam], rank: int, ep: int, counts: dict[int | None, int]
                 ) -> list[TargetParam]:
    """What target expert-parallel rank ``rank`` of ``ep`` holds of a stage's ``entries``: every
    entry of no single expert, and its own experts renumbered from 0 under their output names."""
    out = []
    for tp in entries:
        g = expert_index(tp.param.key)
        if g is None:
            out.append(tp)
            continue
        per_rank = counts[tp.param.layer] // ep
        if g // per_rank == rank:
            out.append(replace(tp, out_key=with_expert(tp.out_key, g % per_rank)))
    return out




# --- names by role: for a writer that lays a model out from its roles (:mod:`reshard.sample`) ------
#: Legacy Megatron GPT names by role: a layer's entries are ``layer + role + entry`` (``weight``,
#: ``bias``); ``{layers}``: how the stack's names start (``transformer.``, ``language_model.encoder.``),
#: ``{i}``: the layer, ``{attention}``: its attention module (``attention``, ``self_attention``).
LEGACY_ROLES: dict[str, str] = {
    "embedding": "word_embeddings.weight", "position": "position_embeddings.weight",
    "layer": "{layers}layers.{i}.", "ln1": "input_layernorm.", "qkv": "{attention}.query_key_value.",
    "dense": "{attention}.dense.", "ln2": "post_attention_layernorm.", "h4h": "mlp.dense_h_to_4h.",
    "4hh": "mlp.dense_4h_to_h.", "final_ln": "{layers}final_layernorm.",
}
#: megatron-core GPT names by role (local spec): ``role + entry`` (``weight``, ``bias``,
#: ``_extra_state``), a layer's under ``layer`` (``{i}``: the layer).
CORE_ROLES: dict[str, str] = {
    "embedding": "embedding.word_embeddings.", "position": "embedding.position_embeddings.",
    "layer": "decoder.layers.{i}.", "ln1": "input_layernorm.", "proj": "self_attention.linear_proj.",
    "qkv": "self_attention.linear_qkv.", "ln2": "pre_mlp_layernorm.", "fc1": "mlp.linear_fc1.",
    "fc2": "mlp.linear_fc2.", "final_ln": "decoder.final_layernorm.", "output": "output_layer.",
}


# --- Megatron-DeepSpeed's GPTModelPipe layer files (DeepSpeed pipeline parallelism) ---------------
#: Layer roles of a ``GPTModelPipe``, told apart by their keys (:func:`pipe_layer_role`).
EMBEDDING, TRANSFORMER, FINAL_NORM, LM_HEAD = "embedding", "transformer", "final norm", "lm_head"
#: A layer file's keys as canonical (legacy Megatron) names, by role: ``prefix + key``, except the
#: keys renamed whole. A transformer layer file holds one layer, numbered 0 (the planner numbers
#: them globally); ``lm_head_pipe.*`` names no rule, so an unexpected head entry is refused.
PIPE_LAYER_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    EMBEDDING: ("language_model.embedding.", {}),
    TRANSFORMER: ("language_model.encoder.layers.0.", {}),
    FINAL_NORM: ("language_model.encoder.final_layernorm.", {}),
    LM_HEAD: ("lm_head_pipe.", {"lm_head.weight": "language_model.output_layer.weight"}),
}


def pipe_layer_role(keys: Collection[str]) -> str:
    """A ``GPTModelPipe`` layer file's role, from its keys."""
    if "word_embeddings.weight" in keys:
        return EMBEDDING
    if "lm_head.weight" in keys:
        return LM_HEAD
    if set(keys) <= {"weight", "bias"}:
        return FINAL_NORM
    return TRANSFORMER


# --- legacy names as megatron-core's: writing a megatron-core format from a legacy checkpoint ------
_LEG_LAYER = r"^(?:transformer|language_model\.encoder)\.layers\.(\d+)\."
_CORE_LAYER = r"decoder.layers.\1."
#: Legacy Megatron name -> megatron-core name (local spec). Both compute the same model from the
#: same tensors when the fused QKV rows are grouped per query group (``checkpoint_version`` >= 2:
#: :data:`MIN_CORE_COMPATIBLE_VERSION`). ``word_embeddings_for_head`` has no row: megatron-core
#: keeps no copy of a tied head in the checkpoints it writes.
LEGACY_TO_CORE: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(a), b) for a, b in (
    (_LEG_LAYER + _ATT + r"query_key_value\.", _CORE_LAYER + "self_attention.linear_qkv."),
    (_LEG_LAYER + _ATT + r"dense\.", _CORE_LAYER + "self_attention.linear_proj."),
    (_LEG_LAYER + r"mlp\.dense_h_to_4h\.", _CORE_LAYER + "mlp.linear_fc1."),
    (_LEG_LAYER + r"mlp\.dense_4h_to_h\.", _CORE_LAYER + "mlp.linear_fc2."),
    (_LEG_LAYER + r"(?:input_layernorm|input_norm)\.", _CORE_LAYER + "input_layernorm."),
    (_LEG_LAYER + r"(?:post_attention_layernorm|post_attention_norm)\.", _CORE_LAYER + "pre_mlp_layernorm."),
    (_LEG_FINAL + r"(?:final_layernorm|final_norm)\.", "decoder.final_layernorm."),
    (_EMB + r"word_embeddings\.weight$", "embedding.word_embeddings.weight"),
    (_EMB + r"position_embeddings\.weight$", "embedding.position_embeddings.weight"),
    (r"^(?:transformer\.|language_model\.)?final_linear\.weight$", "output_layer.weight"),
    (r"^language_model\.output_layer\.weight$", "output_layer.weight"),
))
#: Legacy QKV rows are grouped per head (megatron-core's layout) from this ``checkpoint_version`` on.
MIN_CORE_COMPATIBLE_VERSION = 2.0

# -- megatron-core's names in torch_dist (``dist_checkpointing``'s global keys) -------------------
# torch_dist -> megatron-core per-rank (:mod:`reshard.formats.torch_dist` applies them):
#
# =================================================  ================================================
# torch_dist                                         per-rank module entry
# =================================================  ================================================
# ``decoder.layers.X`` (leading axis: layer ``i``)   ``decoder.layers.{i}.X``
# ``decoder.layers.X._extra_state/shard_{i}_{L}``    ``decoder.layers.{i}.X._extra_state``
# ``...experts.experts.Y`` (next axis: expert e)     ``...experts.local_experts.{e}.Y`` (MoE)
# ``mtp.layers.N...experts.experts.Y`` (axis: e)     ``mtp.layers.N...experts.local_experts.{e}.Y``
# ``...linear_qkv.layer_norm_weight`` (local spec)   ``...input_layernorm.weight``
# ``...linear_fc1.layer_norm_weight`` (local spec)   ``...pre_mlp_layernorm.weight``
# (absent)                                           ``output_layer._extra_state`` = None
# =================================================  ================================================

#: Layer-norm names of megatron-core's local spec (``sharded_state_dict_keys_map``): torch_dist
#: stores them under Transformer Engine's fused names (torch_dist name part -> per-rank name part).
LOCAL_SPEC_NAMES: dict[str, str] = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                                    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


def has_spec_keys_map(names: Iterable[str]) -> bool:
    """Whether torch_dist stores a model's norms under :data:`LOCAL_SPEC_NAMES`: the local layer spec
    with fused QKV has that keys map; multi-latent attention's spec has none."""
    return not any(".self_attention.linear_kv_down_proj." in n for n in names)


def dist_renames(names: Iterable[str]) -> Mapping[str, str]:
    """What torch_dist's keys rename in the per-rank names ``names`` of a whole model (torch_dist
    name part -> per-rank name part): the local spec's fused norm names where its spec has the
    keys map (:func:`has_spec_keys_map`), else nothing."""
    return LOCAL_SPEC_NAMES if has_spec_keys_map(names) else {}


def per_rank_renames(transformer_impl: Any) -> Mapping[str, str]:
    """What reading torch_dist renames for a per-rank module of a model saved with
    ``transformer_impl`` (torch_dist name part -> per-rank name part): the local spec's norms
    (``local``); Transformer Engine's (the default, None) keep torch_dist's fused names."""
    return LOCAL_SPEC_NAMES if transformer_impl == "local" else {}


#: Entries megatron-core's per-rank state dict holds that torch_dist does not store.
PER_RANK_ONLY: dict[str, Any] = {"output_layer._extra_state": None}
#: The prefix of the per-layer keys, stacked along a leading layer axis in torch_dist.
LAYERS = "decoder.layers."
#: Routed experts in torch_dist keys: one key per expert weight, a global expert axis leading
#: (after the layer axis when stacked); per rank, ``local_experts.{e}`` (SequentialMLP).
EXPERTS, LOCAL_EXPERT = ".mlp.experts.experts.", ".mlp.experts.local_experts.{}."
#: A routed expert's entry under SequentialMLP's per-rank name: the experts' module, the expert, the linear
#: layer and the entry (``decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight``).
_SEQUENTIAL_ENTRY = re.compile(r"^(.+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\."
                               r"(weight|bias|_extra_state)$")
#: The same under grouped GEMM's per-rank names (Transformer Engine's ``GroupedLinear``): the experts'
#: module, the linear layer, and the entry and its expert (``linear_fc1.weight{e}``) or the one extra
#: state of all its experts (``linear_fc1._extra_state``).
_GROUPED_ENTRY = re.compile(r"^(.*\bmlp\.experts\.)(linear_fc[12])\.(?:(weight|bias)(\d+)|_extra_state)$")
_STACK_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def expert_dist_name(rest: str) -> tuple[str, int | None]:
    """A layer entry's name in torch_dist (``rest``: the name after ``decoder.layers.{i}.``; an expert's
    under the experts' shared key :data:`EXPERTS`, SequentialMLP's and grouped GEMM's names alike) and
    its expert."""
    g = expert_index(rest)
    if g is None:
        return rest, None
    m = _GROUPED_ENTRY.match(rest)
    if m is not None and m.group(3):
        return f".{m.group(1)}{m.group(2)}.{m.group(3)}".replace(".mlp.experts.", EXPERTS)[1:], g
    return f".{rest}".replace(LOCAL_EXPERT.format(g), EXPERTS)[1:], g


def grouped_extra_states(names: Iterable[str]) -> set[str]:
    """The one extra state per linear layer of grouped experts (Transformer Engine's ``GroupedLinear``)
    that megatron-core's per-rank module holds beside the experts' weights ``names``."""
    return {f"{m.group(1)}{m.group(2)}._extra_state" for n in names if (m := _GROUPED_ENTRY.match(n)) and m.group(3)}


def as_sequential_experts(module: Mapping[str, Any], experts_of: Callable[[int], int],
                          made_up: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``module`` with grouped GEMM's per-rank names of the experts (Transformer Engine's
    ``GroupedLinear``) under SequentialMLP's, which megatron-core's ``TEGroupedMLP.sharded_state_dict``
    keys alike (torch_dist's keys of both): ``linear_fc1.weight{e}`` as expert ``e``'s
    ``local_experts.{e}.linear_fc1.weight``, and the linear layer's one extra state as one per expert
    (``experts_of(layer)`` of them), each the same, as its ``_split_extra_state`` makes them of a state
    without FP8 metadata; one in ``made_up`` (the source lacks it) is None's, made beside expert 0's
    weight."""
    out: dict[str, Any] = {}
    for name, value in module.items():
        m = _GROUPED_ENTRY.match(name)
        layer = _STACK_LAYER.match(name)
        if m is None or layer is None:
            out[name] = value
            continue
        experts = f"{m.group(1)}local_experts."
        if m.group(3):
            out[f"{experts}{m.group(4)}.{m.group(2)}.{m.group(3)}"] = value
            if m.group(3) != "weight" or m.group(4) != "0" or f"{m.group(1)}{m.group(2)}._extra_state" not in made_up:
                continue
            value = None
        for g in range(experts_of(int(layer.group(1)))):
            out[f"{experts}{g}.{m.group(2)}._extra_state"] = value
    return out


def as_grouped_experts(module: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``module`` (SequentialMLP's expert names, as torch_dist keys them) under grouped GEMM's per-rank
    names, as Transformer Engine's ``GroupedLinear`` holds them (:func:`as_sequential_experts`
    backwards): expert ``e``'s ``local_experts.{e}.linear_fc1.weight`` as ``linear_fc1.weight{e}``, and
    its experts' extra states as the linear layer's one ``linear_fc1._extra_state`` — which
    megatron-core's ``merge_extra_states`` makes of equal ones alone (Transformer Engine splits FP8
    metadata per expert: refused)."""
    out: dict[str, Any] = {}
    for name, value in module.items():
        m = _SEQUENTIAL_ENTRY.match(name)
        if m is None:
            out[name] = value
        elif m.group(4) != "_extra_state":
            out[f"{m.group(1)}{m.group(3)}.{m.group(4)}{m.group(2)}"] = value
        else:
            key = f"{m.group(1)}{m.group(3)}._extra_state"
            if key in out and not _same_object(out[key], value):
                raise LayoutError(f"the experts of {m.group(1)[:-1]} hold different extra states (Transformer "
                                  "Engine's FP8 metadata, split per expert), which grouped GEMM's one extra state "
                                  "does not hold apart", culprit=where,
                                  hint="convert a per-rank checkpoint of this run instead")
            out.setdefault(key, value)
    return out


def _same_object(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (objects that do not compare are not the same)
        return False


#: megatron-core's module order: top-level modules, then a layer's submodules (an MoE layer's router,
#: experts by number, shared experts), then their entries.
_CORE_TOP = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
             "decoder.final_layernorm.", MTP_LAYERS, "output_layer.")
_CORE_SUBMODULES = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                    "self_attention.linear_q_down_proj.", "self_attention.linear_q_up_proj.",
                    "self_attention.linear_q_proj.", "self_attention.linear_kv_down_proj.",
                    "self_attention.linear_kv_up_proj.", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                    "self_attention.kv_layernorm.", "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.",
                    "mlp.router.", "mlp.experts.", "mlp.shared_experts.")
_CORE_INNER = ("gate_weight", "linear_fc1.", "linear_fc2.")
_CORE_ENTRIES = ("weight", "bias", "_extra_state")
#: megatron-core's local-spec linear layers carry an ``_extra_state`` entry (None); legacy ones none.
#: (a multi-token prediction layer's decoder layer and its ``eh_proj`` likewise; a mixer's linear
#: ``in_proj`` and ``out_proj``, which megatron-core builds as its linear layers, too).
_CORE_LINEAR_WEIGHT = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.(?:.+\.)?"
                                 r"(?:linear_(?:proj|qkv|fc1|fc2|q_down_proj|q_up_proj|q_proj|kv_down_proj|kv_up_proj)"
                                 r"|in_proj|out_proj)|mtp\.layers\.\d+\.eh_proj)\.weight$")
_CORE_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def core_name(key: str) -> str:
    """The megatron-core name of legacy parameter ``key`` (:data:`LEGACY_TO_CORE`)."""
    for pattern, repl in LEGACY_TO_CORE:
        if pattern.match(key):
            return pattern.sub(repl, key, count=1)
    raise LayoutError(f"{key} has no megatron-core counterpart", culprit=key,
                      hint="write this checkpoint in its own per-rank layout (drop --to)")


def as_megatron_core(module: Mapping[str, Any]) -> dict[str, Any]:
    """A legacy module (values untouched) as megatron-core's per-rank module holds it: core names,
    core order, ``None`` extra states of the local spec's linear layers and of the output layer."""
    return core_module({core_name(k): v for k, v in module.items()})


def core_module(module: Mapping[str, Any]) -> dict[str, Any]:
    """A module under megatron-core's local-spec names (values untouched) as megatron-core's own
    per-rank module holds it: core order, ``None`` extra states of the linear layers (experts'
    included) and of the output layer (what ``load_state_dict(strict=True)`` expects)."""
    out = dict(module)
    for key in module:
        m = _CORE_LINEAR_WEIGHT.match(key)
        if m:
            out.setdefault(m.group(1) + "._extra_state", None)
    out.setdefault("output_layer._extra_state", None)
    return dict(sorted(out.items(), key=lambda kv: _core_position(kv[0])))


def _core_position(key: str) -> tuple[int, ...]:
    def index(options: tuple[str, ...], name: str, *, prefix: bool) -> int:
        for n, o in enumerate(options):
            if name.startswith(o) if prefix else name == o:
                return n
        return len(options)

    m = _CORE_LAYER_KEY.match(key)
    top = index(_CORE_TOP, key, prefix=True)
    entry = index(_CORE_ENTRIES, key.rsplit(".", 1)[-1], prefix=False)
    if m is None:
        return (top, 0, 0, -1, 0, entry)
    rest = m.group(2)
    expert = expert_index(key)
    inner = next((n for n, name in enumerate(_CORE_INNER) if name in rest), len(_CORE_INNER))
    return (top, int(m.group(1)), index(_CORE_SUBMODULES, rest, prefix=True), -1 if expert is None else expert,
            inner, entry)


class MegatronGPT(MegatronCoreFamily):
    """GPT-style decoders under Megatron-LM's legacy names or megatron-core's (dense and MoE). ``naming``
    tells which a checkpoint uses."""

    name = "megatron-gpt"
    rules = MEGATRON_GPT_RULES
    supported = "legacy Megatron GPT names and megatron-core GPT names (dense or MoE MLP; no MLA)"

    def claims(self, keys: Sequence[str]) -> bool:
        return True  # the fallback family: a key none of its rules matches is refused by resolve

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core" if is_megatron_core(keys) else "legacy"
