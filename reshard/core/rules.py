"""Parameter rules as data: an ordered table from name pattern to tensor-parallel behaviour.

The table is resolved into one rule per key *before* any tensor is read. A key that no rule
matches is an error listing every such key (DeepSpeed's loader silently treats them as
replicated); rules that matched nothing are reported so a stale table is visible.

==========  ===================================================================
kind        meaning
==========  ===================================================================
column      split on dim 0 (output features); concatenated on merge
row         split on dim 1 (input features); row-parallel output is summed
qkv         fused query/key/value on dim 0; layout depends on checkpoint version
replicated  identical on every rank; verified equal, taken once
==========  ===================================================================
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

    @property
    def dim(self) -> int | None:
        return {Kind.COLUMN: 0, Kind.QKV: 0, Kind.ROW: 1}.get(self.kind)


_L = r"^(?:transformer|language_model\.encoder)\.layers\.\d+\."
_ATT = r"(?:self_)?attention\."
_EMB = r"^(?:language_model\.embedding\.|embedding\.)?"

#: Legacy Megatron GPT names (``transformer.*`` / ``language_model.encoder.*``).
LEGACY_GPT_RULES: tuple[Rule, ...] = (
    Rule("qkv.weight", _L + _ATT + r"query_key_value\.weight$", Kind.QKV, QuantSlot.QKV, head_dim=True),
    Rule("qkv.bias", _L + _ATT + r"query_key_value\.bias$", Kind.QKV, head_dim=True),
    Rule("attn.dense.weight", _L + _ATT + r"dense\.weight$", Kind.ROW, QuantSlot.DENSE, head_dim=True),
    Rule("attn.dense.bias", _L + _ATT + r"dense\.bias$", Kind.REPLICATED),
    Rule("mlp.h_to_4h.weight", _L + r"mlp\.dense_h_to_4h\.weight$", Kind.COLUMN, QuantSlot.H_TO_4H, mlp=True),
    Rule("mlp.h_to_4h.bias", _L + r"mlp\.dense_h_to_4h\.bias$", Kind.COLUMN),
    Rule("mlp.4h_to_h.weight", _L + r"mlp\.dense_4h_to_h\.weight$", Kind.ROW, QuantSlot.FOUR_H_TO_H, mlp=True),
    Rule("mlp.4h_to_h.bias", _L + r"mlp\.dense_4h_to_h\.bias$", Kind.REPLICATED),
    Rule("layernorms", _L + r"(?:input_layernorm|post_attention_layernorm)\.(?:weight|bias)$",
         Kind.REPLICATED),
    Rule("final_layernorm", r"^(?:transformer|language_model\.encoder)\.final_layernorm\.(?:weight|bias)$",
         Kind.REPLICATED),
    Rule("word_embeddings", _EMB + r"word_embeddings\.weight$", Kind.COLUMN),
    Rule("position_embeddings", _EMB + r"position_embeddings\.weight$", Kind.REPLICATED),
    Rule("final_linear", r"^(?:transformer\.|language_model\.)?final_linear\.weight$", Kind.COLUMN),
)

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def layer_index(key: str) -> int | None:
    """Transformer layer number in a parameter name, or None for non-layer parameters."""
    m = _LAYER_RE.search(key)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Resolution:
    """Result of matching keys against a table: one rule per key plus unused rules."""

    by_key: Mapping[str, Rule]
    unused_rules: tuple[str, ...]


def resolve(keys: Iterable[str], rules: tuple[Rule, ...] = LEGACY_GPT_RULES,
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
            hint="reshard does not guess how unknown parameters are partitioned; "
                 "only legacy Megatron GPT names are supported so far")
    unused = tuple(r.name for r in rules if r.name not in used)
    return Resolution(MappingProxyType(by_key), unused)
