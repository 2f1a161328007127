"""Parameter rules as data: an ordered table from name pattern to tensor-parallel behaviour.

The table is resolved into one rule per key *before* any tensor is read. A key that no rule
matches is an error listing every such key (DeepSpeed's loader silently treats them as
replicated); rules that matched nothing are reported so a stale table is visible.

==========  ===================================================================
kind        meaning
==========  ===================================================================
column      split on dim 0 (output features); concatenated on merge
row         split on dim 1 (input features); row-parallel output is summed
qkv         fused query/key/value on dim 0; layout per ``Rule.qkv`` (below)
replicated  identical on every rank; verified equal, taken once
carried     opaque per-module state (``_extra_state``); taken from the first source rank as-is
==========  ===================================================================

Columns that refine a kind (all data, read by ``plan``):

* ``qkv``: ``versioned`` — legacy ``query_key_value``, layout decided by ``checkpoint_version``
  (0: ``[Q;K;V]``, 1.0: ``[np, hn, 3]``, 2.0/3.0: per query group ``[q heads; k; v]``);
  ``grouped`` — megatron-core ``linear_qkv``, always per query group.
* ``gated``: the fc1 of a gated MLP (SwiGLU) holds ``[W_r; V_r]`` per rank (2 fused parts).
* ``vocab``: vocabulary-parallel (rows are padded to ``make_vocab_size_divisible_by * TP``).
* ``place``: which pipeline stage holds the parameter (its layer's, the first, the last).
* ``tied_head``: the last stage's copy of the word embeddings when input and output
  embeddings are tied and PP > 1 (dropped when merging to PP = 1, recreated when splitting).
* ``family``: ``legacy`` or ``core`` naming; ``optional``: present only with some model options
  (untied output, TE fused norms, ...). Unused-rule reports cover the checkpoint's own family,
  non-optional rules only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from reshard.core.errors import UnknownParameterError


class Kind(str, Enum):
    COLUMN = "column"
    ROW = "row"
    QKV = "qkv"
    REPLICATED = "replicated"
    CARRIED = "carried"


class QKVLayout(str, Enum):
    VERSIONED = "versioned"
    GROUPED = "grouped"


class Place(str, Enum):
    """Pipeline stage of a parameter: the stage of its layer, the first, or the last."""

    LAYER = "layer"
    FIRST = "first"
    LAST = "last"


class QuantSlot(str, Enum):
    """The four per-layer weights DeepSpeed's WeightQuantization quantizes, in scale order."""

    QKV = "qkv"
    DENSE = "dense"
    H_TO_4H = "h_to_4h"
    FOUR_H_TO_H = "4h_to_h"


#: Row order of the per-layer scale table ``[layers, 4, width]``.
QUANT_SLOT_ORDER: tuple[QuantSlot, ...] = (QuantSlot.QKV, QuantSlot.DENSE, QuantSlot.H_TO_4H,
                                           QuantSlot.FOUR_H_TO_H)


@dataclass(frozen=True)
class Rule:
    """One row of a rule table.

    ``head_dim``: the partitioned dim is made of attention heads (a split must not cut one).
    ``mlp``: the weight is an MLP weight (gets 2x groups with extra grouping).
    """

    name: str
    pattern: str
    kind: Kind
    quant: QuantSlot | None = None
    head_dim: bool = False
    mlp: bool = False
    qkv: QKVLayout | None = None
    gated: bool = False
    vocab: bool = False
    place: Place = Place.LAYER
    tied_head: bool = False
    family: str = "legacy"
    optional: bool = False

    @property
    def dim(self) -> int | None:
        return {Kind.COLUMN: 0, Kind.QKV: 0, Kind.ROW: 1}.get(self.kind)


# --- legacy Megatron / DeepSpeed names (transformer.* / language_model.encoder.*) ---------------
_L = r"^(?:transformer|language_model\.encoder)\.layers\.\d+\."
_ATT = r"(?:self_)?attention\."
_EMB = r"^(?:language_model\.embedding\.|embedding\.)?"
_LEG_FINAL = r"^(?:transformer|language_model\.encoder)\."
# --- megatron-core names (embedding.*, decoder.layers.N.*, output_layer.*) ----------------------
_D = r"^decoder\.layers\.\d+\."
_LN = r"(?:weight|bias)$"

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
    _core("layernorms", _D + r"(?:input_layernorm|pre_mlp_layernorm)\." + _LN, Kind.REPLICATED, optional=True),
    _core("fused_layernorms", _D + r"(?:self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_" + _LN,
          Kind.REPLICATED, optional=True),
    _core("qk_layernorms", _D + r"self_attention\.(?:q_layernorm|k_layernorm)\." + _LN, Kind.REPLICATED,
          optional=True),
    _core("layer_extra_state", _D + r"(?:.+\.)?_extra_state$", Kind.CARRIED, optional=True),
    _core("final_layernorm", r"^decoder\.final_layernorm\." + _LN, Kind.REPLICATED, place=_LAST),
    _core("output_layer", r"^output_layer\.weight$", Kind.COLUMN, vocab=True, place=_LAST, optional=True),
    _core("last_extra_state", r"^(?:output_layer|decoder\.final_layernorm)\._extra_state$", Kind.CARRIED,
          place=_LAST, optional=True),
    _core("first_extra_state", r"^embedding\.(?:.+\.)?_extra_state$", Kind.CARRIED, place=_FIRST, optional=True),
)

#: Kept for callers of the first release; the table now also holds megatron-core names.
LEGACY_GPT_RULES = MEGATRON_GPT_RULES

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def layer_index(key: str) -> int | None:
    """Transformer layer number in a parameter name, or None for non-layer parameters."""
    m = _LAYER_RE.search(key)
    return int(m.group(1)) if m else None


def with_layer(key: str, index: int) -> str:
    """``key`` with its layer number replaced (pipeline stages number their layers locally)."""
    return _LAYER_RE.sub(f".layers.{index}.", key, count=1)


def is_megatron_core(keys: Iterable[str]) -> bool:
    """Whether parameter names follow megatron-core (``decoder.layers.N``) rather than legacy."""
    return any(k.startswith(("decoder.", "output_layer.")) for k in keys)


@dataclass(frozen=True)
class Resolution:
    """Result of matching keys against a table: one rule per key plus unused rules."""

    by_key: Mapping[str, Rule]
    unused_rules: tuple[str, ...]


def resolve(keys: Iterable[str], rules: tuple[Rule, ...] = MEGATRON_GPT_RULES,
            source: str = "checkpoint") -> Resolution:
    """Assign the first matching rule to every key; raise listing all unmatched keys."""
    compiled = [(r, re.compile(r.pattern)) for r in rules]
    by_key: dict[str, Rule] = {}
    unmatched: list[str] = []
    used: set[str] = set()
    for key in keys:
        for rule, rx in compiled:
            if rx.search(key):
                by_key[key] = rule
                used.add(rule.name)
                break
        else:
            unmatched.append(key)
    if unmatched:
        shown = ", ".join(unmatched[:20]) + (f" ... (+{len(unmatched) - 20} more)" if len(unmatched) > 20 else "")
        raise UnknownParameterError(
            f"{len(unmatched)} parameter(s) match no rule: {shown}", culprit=source,
            hint="reshard does not guess how unknown parameters are partitioned; supported are legacy "
                 "Megatron GPT names and megatron-core GPT names (dense MLP, no MoE/MLA)")
    families = {r.family for r in rules if r.name in used} - {"shared"}
    unused = tuple(r.name for r in rules
                   if r.name not in used and not r.optional and r.family in families)
    return Resolution(MappingProxyType(by_key), unused)
