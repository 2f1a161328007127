"""Parameter rules as data: an ordered table from name pattern to tensor-parallel behaviour. The
tables themselves belong to the model families (:mod:`reshard.models`); this module holds what a
rule is and how a table is resolved.

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

* ``qkv``: ``versioned`` — Megatron-LM's legacy fused QKV, layout decided by ``checkpoint_version``
  (0: ``[Q;K;V]``, 1.0: ``[np, hn, 3]``, 2.0/3.0: per query group ``[q heads; k; v]``);
  ``grouped`` — megatron-core's fused QKV, always per query group.
* ``gated``: the fc1 of a gated MLP (SwiGLU) holds ``[W_r; V_r]`` per rank (2 fused parts).
* ``vocab``: vocabulary-parallel (rows are padded to ``make_vocab_size_divisible_by * TP``).
* ``place``: which pipeline stage holds the parameter (its layer's, the first, the last).
* ``tied_head``: the last stage's copy of the word embeddings when input and output
  embeddings are tied and PP > 1 (dropped when merging to PP = 1, recreated when splitting).
* ``expert``: one routed expert's weight (MoE), numbered in its name as its family says.
* ``sections``: fused parts of unequal widths, each split over TP on its own (a state-space mixer's
  input projection); the value names the layout, which the family sizes
  (:meth:`reshard.models.base.ModelFamily.split_sections`). Column kind only.
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
    ``expert``: the parameter is one routed expert's (numbered in its name, by the family): split
    over the expert TP, dealt out over the expert-parallel ranks.
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
    expert: bool = False
    sections: str | None = None

    @property
    def dim(self) -> int | None:
        return {Kind.COLUMN: 0, Kind.QKV: 0, Kind.ROW: 1}.get(self.kind)


#: A layer number in a parameter name. Whether that layer is one of the stack's (numbered with it,
#: placed by the pipeline stages) or sits beside it is the family's to say
#: (:meth:`reshard.models.base.ModelFamily.layer_index`).
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def layer_index(key: str) -> int | None:
    """The layer number a parameter name spells, or None for a name of no layer (ask the family,
    :meth:`reshard.models.base.ModelFamily.layer_index`, whether the layer is one of the stack)."""
    m = _LAYER_RE.search(key)
    return int(m.group(1)) if m else None


#: The logical name suffix of a later pipeline stage's own copy of a first-stage entry (a stage copy:
#: a family whose layers beside the stack embed tokens again keeps the embeddings there too, see
#: :meth:`reshard.models.base.ModelFamily.keeps_stage_copy`): read as ``<entry key>`` + this, written
#: back on the last stage under the entry's own name, dropped at one stage.
STAGE_COPY = "@stage-copy"


def with_layer(key: str, index: int) -> str:
    """``key`` with its layer number replaced (pipeline stages number their layers locally)."""
    return _LAYER_RE.sub(f".layers.{index}.", key, count=1)


@dataclass(frozen=True)
class Resolution:
    """Result of matching keys against a table: one rule per key plus unused rules."""

    by_key: Mapping[str, Rule]
    unused_rules: tuple[str, ...]


def resolve(keys: Iterable[str], rules: tuple[Rule, ...], source: str = "checkpoint",
            supported: str = "") -> Resolution:
    """Assign the first matching rule to every key; raise listing all unmatched keys (``supported``:
    what the table's family reads, for the hint)."""
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
            hint="reshard does not guess how unknown parameters are partitioned"
                 + (f"; supported are {supported}" if supported else ""))
    families = {r.family for r in rules if r.name in used} - {"shared"}
    unused = tuple(r.name for r in rules
                   if r.name not in used and not r.optional and r.family in families)
    return Resolution(MappingProxyType(by_key), unused)
