"""DeepSeek-V3-class models (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V2-Lite's attention): multi-latent
attention (MLA) and DeepSeek MoE: the megatron-core rule table (how each tensor splits over TP) and
the family that claims MLA checkpoints. The Hugging Face architecture ``DeepseekV3ForCausalLM``
(name table, ``config.json`` <-> Megatron-LM ``args``) is :mod:`reshard.models.hf_deepseek`. The
facts both rest on, with the code lines they were read from, are in ``docs/deepseek-v3-notes.md``.

megatron-core's MLA tensors (local spec; ``n`` heads, ``qk``/``r``/``v`` the no-rope, rope and value
head dims, ``Lq``/``Lkv`` the query and key-value latent ranks) and how reshard splits them:

==============================  ==============  ================  ===================================
megatron-core (``self_attention.``)  shape        split over TP     Hugging Face (``self_attn.``)
==============================  ==============  ================  ===================================
``linear_q_down_proj``          ``[Lq, h]``     rows (gathered    ``q_a_proj``
                                                in the forward)
``q_layernorm``                 ``[Lq]``        replicated        ``q_a_layernorm``
``linear_q_up_proj``            ``[n(qk+r), Lq]``  rows, by head   ``q_b_proj``
``linear_q_proj`` (no ``Lq``)   ``[n(qk+r), h]``   rows, by head   ``q_proj``
``linear_kv_down_proj``         ``[Lkv+r, h]``  rows (gathered)   ``kv_a_proj_with_mqa``
``kv_layernorm``                ``[Lkv]``       replicated        ``kv_a_layernorm``
``linear_kv_up_proj``           ``[n(qk+v), Lkv]`` rows, by head   ``kv_b_proj`` (per head ``[nope|v]``)
``linear_proj``                 ``[h, n v]``    columns           ``o_proj``
==============================  ==============  ================  ===================================

Rows are head-major in both libraries (``[head0: nope, rope | head1: ...]``), so every tensor is
the same bytes under another name: no transform but renaming. The down projections are written
split by rows, as megatron-core's local spec holds them. Its Transformer-Engine spec keeps a full
copy on every rank and fuses the latent norms into the up projections as ``layer_norm_weight``:
such checkpoints are read by their own table (:class:`DeepSeekTE`), and refused where the two
mix (fused names beside split rows) or without latent norms (whole down projections under the
local spec's names). megatron-core's MLA de-interleaves the rope dims, which is transformers'
``rope_interleave=True``: the default, and the only one read.

DeepSeek MoE: a sigmoid router with ``expert_bias`` (HF ``e_score_correction_bias``), routed and
shared experts, group-limited routing, the first ``first_k_dense_replace`` layers dense.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.pipeline_stages import LAYOUT_ARG
from reshard.core.plan_types import CanonicalParam, ModelFacts
from reshard.core.rules import Kind, Place, Rule
from reshard.models.base import ModelFamily
from reshard.models.facts import hidden_and_heads, int_arg, saved_arg
from reshard.models.megatron_gpt import (
    DECODER_LAYER,
    MEGATRON_GPT_RULES,
    MTP_LAYERS,
    MegatronCoreFamily,
    holds_mtp_layers,
)

_D = DECODER_LAYER + r"self_attention\."
_MLA_LINEAR = ("linear_q_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_down_proj",
               "linear_kv_up_proj")


def _mla(name: str, pattern: str, kind: Kind, **kw: Any) -> Rule:
    return Rule("mla." + name, _D + pattern, kind, family="core", optional=True, **kw)


#: A decoder layer's MLA tensors (local spec), then every megatron-core GPT rule (the MoE layers,
#: norms, embeddings and output layer are the same modules).
_DECODER_RULES: tuple[Rule, ...] = (
    _mla("q_kv_projections", r"(?:" + "|".join(_MLA_LINEAR) + r")\.weight$", Kind.COLUMN),
    _mla("latent_norms", r"(?:q_layernorm|kv_layernorm)\.weight$", Kind.REPLICATED),
    # linear_proj (the output projection, split by columns) is megatron-core's GPT rule
) + MEGATRON_GPT_RULES

#: The same tensors as Transformer Engine's spec holds them: the down projections a whole copy on every
#: TP rank (``TELinear``, ``parallel_mode="duplicated"``), the latent norms fused into the up
#: projections (``TELayerNormColumnParallelLinear``'s ``layer_norm_weight``), the up projections split
#: by rows as in the local spec; the dense layers' pre-MLP norm fused into ``linear_fc1`` (a GPT rule).
_TE_DECODER_RULES: tuple[Rule, ...] = (
    _mla("te_down_projections", r"linear_(?:q|kv)_down_proj\.weight$", Kind.REPLICATED),
    _mla("te_up_projections", r"(?:linear_q_up_proj|linear_q_proj|linear_kv_up_proj)\.weight$", Kind.COLUMN),
    _mla("te_latent_norms", r"linear_(?:q|kv)_up_proj\.layer_norm_weight$", Kind.REPLICATED),
) + MEGATRON_GPT_RULES

_MTP = "^" + re.escape(MTP_LAYERS) + r"\d+\."


def mtp_rules(decoder: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """megatron-core's multi-token prediction layers (``mtp.layers.{i}``, on the last pipeline stage):
    the input norms ``enorm`` (of the next token's embedding) and ``hnorm`` (of the hidden state),
    ``eh_proj`` ``[h, 2h]`` (column-parallel: rows split, gathered in the forward), a whole decoder
    layer as ``transformer_layer`` (split as a decoder layer is) and the ``final_layernorm`` before
    the shared output layer."""
    own = (Rule("mtp.norms", _MTP + r"(?:enorm|hnorm|final_layernorm)\.weight$", Kind.REPLICATED, family="core",
                optional=True, place=Place.LAST),
           Rule("mtp.eh_proj", _MTP + r"eh_proj\.weight$", Kind.COLUMN, family="core", optional=True,
                place=Place.LAST),
           Rule("mtp.eh_proj_extra_state", _MTP + r"eh_proj\._extra_state$", Kind.CARRIED, family="core",
                optional=True, place=Place.LAST))
    layer = tuple(dataclasses.replace(r, name="mtp." + r.name, optional=True, place=Place.LAST,
                                      pattern=_MTP + r"transformer_layer\." + r.pattern[len(DECODER_LAYER):])
                  for r in decoder if r.pattern.startswith(DECODER_LAYER))
    return own + layer


#: The family's table: the decoder's rules and the multi-token prediction layers' (local spec, and
#: as Transformer Engine's spec holds them).
DEEPSEEK_RULES: tuple[Rule, ...] = _DECODER_RULES + mtp_rules(_DECODER_RULES)
DEEPSEEK_TE_RULES: tuple[Rule, ...] = _TE_DECODER_RULES + mtp_rules(_TE_DECODER_RULES)

#: A key of an MLA checkpoint (what the family claims by).
MLA_KEY = re.compile(r"^decoder\.layers\.\d+\.self_attention\.linear_(?:q_down|q|kv_down)_proj\.")
#: Transformer Engine's MLA names (down projections copied on every rank, latent norms fused).
_TEMLA_KEY = re.compile(r"\.self_attention\.linear_(?:q|kv)_up_proj\.layer_norm_weight$")


#: Megatron-LM's ``args`` of multi-latent attention's shape: the latent ranks (no query latent:
#: ``q_lora_rank`` null) and the head dims of keys without rope, with rope, and of values.
MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


class DeepSeek(MegatronCoreFamily):
    """megatron-core GPT models with multi-latent attention (DeepSeek-V2/V3, Kimi-K2), dense or MoE,
    under megatron-core's local spec. MLA tensors by :data:`DEEPSEEK_RULES`, everything else as
    :class:`~reshard.models.megatron_gpt.MegatronGPT`."""

    name = "deepseek"
    rules = DEEPSEEK_RULES
    priority = 50
    supported = ("megatron-core GPT names with multi-latent attention (local spec: q/kv down and up projections, "
                 "q_layernorm, kv_layernorm), dense or MoE MLP")

    def claims(self, keys: Sequence[str]) -> bool:
        return any(MLA_KEY.match(k) for k in keys)

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def decide_heads(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                     origin: dict[str, str], where: str) -> tuple[int | None, int | None, int | None]:
        """(hidden size, attention heads, value head dim): MLA's head width is ``args.v_head_dim``,
        which sizes ``linear_proj`` (``heads x v_head_dim`` columns); ``kv_channels`` is not read —
        Megatron-LM ignores it under ``--multi-latent-attention`` and saves whatever it was (by
        default ``hidden / heads``). Without ``v_head_dim`` the width stays unknown here and the
        output projection's spec takes it from its columns over the heads (exact, at the source TP
        it knows), rather than assuming Megatron-LM's default 128: args without ``v_head_dim`` are
        no Megatron-LM MLA run's, so its defaults need not hold."""
        hidden, heads = hidden_and_heads(options, args, params, origin, where)
        v_dim = int_arg(args, "v_head_dim")
        if v_dim is not None:
            origin["head_dim"] = "args.v_head_dim"
        return hidden, heads, v_dim

    def decide_groups(self, options: ReshardOptions, args: Any, heads: int | None, params: list[CanonicalParam],
                      head_dim: int | None, n: int, origin: dict[str, str], where: str) -> int | None:
        """MLA has no query groups (every head its own keys and values). Also refuses Transformer
        Engine's MLA files without latent norms, whose down projections are whole on each of the ``n``
        source TP ranks (the local spec splits their rows)."""
        te = next((p.key for p in params if p.key.endswith("mlp.linear_fc1.layer_norm_weight")), None)
        if te is not None or saved_arg(args, "transformer_impl") == "transformer_engine":
            what = te or "args.transformer_impl transformer_engine"
            raise LayoutError(f"{what}: a Transformer Engine MLA checkpoint without latent norms (its down projections "
                              "are whole on every rank under the local spec's names) is not read", culprit=where,
                              hint="save it with megatron-core's local spec (--transformer-impl local), or with "
                                   "latent norms (qk_layernorm)")
        for p, rows in _down_projections(params, args):
            if n > 1 and p.shape[0] == rows:
                raise LayoutError(f"{p.key} holds all {rows} rows on each of {n} TP ranks: a Transformer Engine MLA "
                                  "checkpoint (down projections copied on every rank) is not read", culprit=where,
                                  hint="save it with megatron-core's local spec (--transformer-impl local)")
        return super().decide_groups(options, args, heads, params, head_dim, n, origin, where)

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        """``mtp_layers``: the multi-token prediction layers (what the export writes copies of the
        embeddings and head for). Refuses what megatron-core's MLA cannot load: MTP layers placed by a
        pipeline layout string (reshard puts them on the last stage, where megatron-core builds them
        without one). A target TP that cuts a head is refused by ``linear_proj``'s spec (split by
        heads), with the target TPs every tensor allows."""
        return mtp_family_facts(options, args, params, origin, where)

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """The routing, the multi-latent attention's ranks and head dims (as the saved ``args``
        record them) and the multi-token prediction layers the checkpoint holds."""
        mla = {name: saved_arg(args, name) for name in MLA_ARGS if saved_arg(args, name) is not None}
        return {**super().summary(args, model_facts, experts), "mla": mla or None,
                "mtp_layers": mtp_layers(model_facts)}


class DeepSeekTE(DeepSeek):
    """The same models saved with megatron-core's Transformer Engine spec (the default on GPUs):
    down projections whole on every rank, latent norms fused into the up projections.

    Claimed by those fused norm names, read by :data:`DEEPSEEK_TE_RULES`. Per-rank outputs keep
    these names (what the same run loads again); Hugging Face and the other outputs take the
    tensors, whose bytes are the local spec's."""

    name = "deepseek-te"
    rules = DEEPSEEK_TE_RULES
    priority = 49  # asked before the local spec's family: its names are a subset of these files' names
    supported = ("megatron-core GPT names with multi-latent attention (Transformer Engine spec: down projections "
                 "copied on every rank, latent norms fused as linear_q/kv_up_proj.layer_norm_weight)")

    def claims(self, keys: Sequence[str]) -> bool:
        return any(_TEMLA_KEY.search(k) for k in keys)

    def decide_groups(self, options: ReshardOptions, args: Any, heads: int | None, params: list[CanonicalParam],
                      head_dim: int | None, n: int, origin: dict[str, str], where: str) -> int | None:
        """No query groups, as for the local spec; refuses down projections that are not whole (a file
        mixing the two specs' layouts: the fused norms of one, the row splits of the other)."""
        for p, rows in _down_projections(params, args):
            if p.shape[0] != rows:
                raise LayoutError(f"{p.key} holds {p.shape[0]} of its {rows} rows, but the latent norms are fused as "
                                  "Transformer Engine's spec saves them (it keeps the down projections whole on "
                                  "every rank)", culprit=where, hint="the checkpoint mixes two layouts; re-save it")
        return ModelFamily.decide_groups(self, options, args, heads, params, head_dim, n, origin, where)


def mtp_family_facts(options: ReshardOptions, args: Any, params: list[CanonicalParam], origin: dict[str, str],
                     where: str) -> dict[str, Any]:
    """The family fact ``mtp_layers`` (the multi-token prediction layers ``params`` hold; what an
    export writes copies of the embeddings and head for), or the refusal of MTP layers placed by a
    pipeline layout string (reshard puts them on the last stage, where megatron-core builds them
    without one). Every megatron-core family with such layers decides it here."""
    if holds_mtp_layers(p.key for p in params):
        for layout, culprit in ((saved_arg(args, LAYOUT_ARG), f"args.{LAYOUT_ARG}"),
                                (options.target_pipeline_layout, "--target-pipeline-layout")):
            if layout:
                raise LayoutError(f"multi-token prediction layers with the pipeline layout {layout!r}: reshard "
                                  "places them on the last stage without a layout string only", culprit=culprit,
                                  hint="give the stages with --target-pp (and --target-vpp, "
                                       "--target-first-stage-layers, --target-last-stage-layers)")

    mtp = mtp_layer_count(p.key for p in params)
    if mtp:
        origin["mtp_layers"] = "parameter names"
    return {"mtp_layers": mtp} if mtp else {}


def _down_projections(params: Sequence[CanonicalParam], args: Any) -> Iterator[tuple[CanonicalParam, int]]:
    """Each MLA down projection among ``params`` with the rows it has whole (from the saved args;
    those whose whole rows the args do not give are left out)."""
    kv = saved_arg(args, "kv_lora_rank")
    full = {"linear_q_down_proj": saved_arg(args, "q_lora_rank"),
            "linear_kv_down_proj": kv + (saved_arg(args, "qk_pos_emb_head_dim") or 0) if isinstance(kv, int) else None}
    for p in params:
        rows = full.get(p.key.rsplit(".", 2)[-2]) if p.key.endswith("_down_proj.weight") else None
        if rows and p.shape:
            yield p, rows


def mtp_layers(facts: ModelFacts) -> int:
    """The model's multi-token prediction layers (its family fact ``mtp_layers``; 0 without)."""
    return int(facts.family_facts.get("mtp_layers", 0))


def mtp_layer_count(keys: Iterable[str]) -> int:
    """The multi-token prediction layers megatron-core parameter names ``keys`` hold (``mtp.layers.{i}``)."""
    return len({k.split(".")[2] for k in keys if k.startswith(MTP_LAYERS)})
