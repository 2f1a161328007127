"""Megatron GPT models — legacy Megatron / DeepSpeed names (``transformer.*``,
``language_model.encoder.*``) and megatron-core names (``embedding.*``, ``decoder.layers.N.*``,
``output_layer.*``), dense MLP (optionally SwiGLU), MHA or GQA: one rule table.

The deciders of this family's model facts (heads, query groups, gating, vocabulary padding, tied
embeddings) are in :mod:`reshard.core.facts`.
"""

from __future__ import annotations

from collections.abc import Sequence

from reshard.core.rules import Kind, Place, QKVLayout, QuantSlot, Rule, is_megatron_core
from reshard.models.base import ModelFamily

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


class MegatronGPT(ModelFamily):
    """Legacy and megatron-core GPT naming; ``naming`` tells which a checkpoint uses."""

    name = "megatron-gpt"
    rules = MEGATRON_GPT_RULES

    def claims(self, keys: Sequence[str]) -> bool:
        return True  # the fallback family: a key none of its rules matches is refused by resolve

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core" if is_megatron_core(keys) else "legacy"
