"""DeepSeek-V3-class models (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V2-Lite's attention): multi-latent
attention (MLA) and DeepSeek MoE, in one module — the megatron-core rule table (how each tensor
splits over TP), the family that claims MLA checkpoints, and the Hugging Face architecture
``DeepseekV3ForCausalLM`` both ways (name table, ``config.json`` <-> Megatron-LM ``args``, and
every setting the two libraries compute differently, refused by name). The facts it rests on, with
the code lines they were read from, are in ``docs/deepseek-v3-notes.md``.

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

import argparse
import dataclasses
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.pipeline_stages import LAYOUT_ARG
from reshard.core.plan_types import CanonicalParam, ModelFacts
from reshard.core.rules import Kind, Place, Rule
from reshard.models.base import ModelFamily
from reshard.models.facts import hidden_and_heads, int_arg, saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    MTP_HF,
    NOT_EXPORTED_FLAGS,
    GatedSplit,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    OutTensor,
    Run,
    Same,
    VocabRows,
    mtp_to_hf,
    name_table,
)
from reshard.models.megatron_gpt import (
    DECODER_LAYER,
    MEGATRON_GPT_RULES,
    MTP_LAYERS,
    MegatronCoreFamily,
    experts_per_layer,
    holds_mtp_layers,
    stack_layer,
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


def _mtp_rules(decoder: tuple[Rule, ...]) -> tuple[Rule, ...]:
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
DEEPSEEK_RULES: tuple[Rule, ...] = _DECODER_RULES + _mtp_rules(_DECODER_RULES)
DEEPSEEK_TE_RULES: tuple[Rule, ...] = _TE_DECODER_RULES + _mtp_rules(_TE_DECODER_RULES)

#: A key of an MLA checkpoint (what the family claims by).
_MLA_KEY = re.compile(r"^decoder\.layers\.\d+\.self_attention\.linear_(?:q_down|q|kv_down)_proj\.")
#: Transformer Engine's MLA names (down projections copied on every rank, latent norms fused).
_TE_MLA_KEY = re.compile(r"\.self_attention\.linear_(?:q|kv)_up_proj\.layer_norm_weight$")


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
        return any(_MLA_KEY.match(k) for k in keys)

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
        return any(_TE_MLA_KEY.search(k) for k in keys)

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


# -- Hugging Face's DeepseekV3ForCausalLM ----------------------------------------------------------
_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_A, _HA = _L + "self_attention.", _H + "self_attn."
_FC1 = (_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", _L + "mlp.experts.linear_fc1.weight{expert}")
_FC2 = (_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", _L + "mlp.experts.linear_fc2.weight{expert}")


def mtp_layers(facts: ModelFacts) -> int:
    """The model's multi-token prediction layers (its family fact ``mtp_layers``; 0 without)."""
    return int(facts.family_facts.get("mtp_layers", 0))


def mtp_layer_count(keys: Iterable[str]) -> int:
    """The multi-token prediction layers megatron-core parameter names ``keys`` hold (``mtp.layers.{i}``)."""
    return len({k.split(".")[2] for k in keys if k.startswith(MTP_LAYERS)})


class SharedCopies(VocabRows):
    """The word embeddings or the output layer, and DeepSeek's copy of it in every multi-token
    prediction layer (``model.layers.{L + i}.embed_tokens`` / ``shared_head.head``, which vLLM's
    MTP reads): the same rows, written once per copy. Import reads the first; the copies are the
    same tensor (:data:`~reshard.models.hf_architectures.MTP_SHARED_COPIES`)."""

    def __init__(self, copy: str) -> None:
        self.copy = copy

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        first = super().outputs(names, shape, facts)[0]
        return [first] + [OutTensor(mtp_to_hf(f"{MTP_HF}{i}.{self.copy}", facts.num_layers), first.shape)
                          for i in range(mtp_layers(facts))]

    def copies(self, keys: Collection[str]) -> int:
        return 1 + mtp_layer_count(keys)

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        run = super().runs(shape, itemsize, facts)[0]
        return [dataclasses.replace(run, out=i) for i in range(1 + mtp_layers(facts))]


#: megatron-core (local spec) <-> transformers' DeepseekV3ForCausalLM; every linear weight is FP8
#: in DeepSeek's own release (``LINEAR``), the router, norms, embeddings and head are not.
_DECODER_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", SharedCopies("embed_tokens.weight"), ("model.embed_tokens.weight",)),
    (_L + "input_layernorm.weight", Same(), (_H + "input_layernorm.weight",)),
    (_A + "linear_q_down_proj.weight", Same(), (_HA + "q_a_proj.weight",), LINEAR),
    ((_A + "q_layernorm.weight", _A + "linear_q_up_proj.layer_norm_weight"), Same(), (_HA + "q_a_layernorm.weight",)),
    (_A + "linear_q_up_proj.weight", Same(), (_HA + "q_b_proj.weight",), LINEAR),
    (_A + "linear_q_proj.weight", Same(), (_HA + "q_proj.weight",), LINEAR),
    (_A + "linear_kv_down_proj.weight", Same(), (_HA + "kv_a_proj_with_mqa.weight",), LINEAR),
    ((_A + "kv_layernorm.weight", _A + "linear_kv_up_proj.layer_norm_weight"), Same(),
     (_HA + "kv_a_layernorm.weight",)),
    (_A + "linear_kv_up_proj.weight", Same(), (_HA + "kv_b_proj.weight",), LINEAR),
    (_A + "linear_proj.weight", Same(), (_HA + "o_proj.weight",), LINEAR),
    ((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"), Same(),
     (_H + "post_attention_layernorm.weight",)),
    (_L + "mlp.linear_fc1.weight", GatedSplit(), (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), LINEAR),
    (_L + "mlp.linear_fc2.weight", Same(), (_H + "mlp.down_proj.weight",), LINEAR),
    (_L + "mlp.router.weight", Same(), (_H + "mlp.gate.weight",)),
    (_L + "mlp.router.expert_bias", Same(), (_H + "mlp.gate.e_score_correction_bias",)),
    (_FC1, GatedSplit(), (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
     LINEAR),
    (_FC2, Same(), (_H + "mlp.experts.{expert}.down_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.linear_fc1.weight", GatedSplit(),
     (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), LINEAR),
    (_L + "mlp.shared_experts.linear_fc2.weight", Same(), (_H + "mlp.shared_experts.down_proj.weight",), LINEAR),
    ("decoder.final_layernorm.weight", Same(), ("model.norm.weight",)),
    ("output_layer.weight", SharedCopies("shared_head.head.weight"), ("lm_head.weight",)),
    ("{prefix}_extra_state", None, ()),
)

_M, _HM = MTP_LAYERS + "{layer}.", MTP_HF + "{layer}."


def _mtp_names(table: NameTable) -> NameTable:
    """Multi-token prediction layer ``i``: megatron-core's ``mtp.layers.{i}`` <-> the folder's
    ``model.layers.{num_hidden_layers + i}`` (in the table as ``model.mtp_layers.{i}``, see
    :data:`~reshard.models.hf_architectures.MTP_HF`): its norms, ``eh_proj`` and a decoder layer
    under the decoder layer's own names; ``final_layernorm`` is ``shared_head.norm``."""
    own = name_table((_M + "enorm.weight", Same(), (_HM + "enorm.weight",)),
                     (_M + "hnorm.weight", Same(), (_HM + "hnorm.weight",)),
                     (_M + "eh_proj.weight", Same(), (_HM + "eh_proj.weight",)),
                     (_M + "final_layernorm.weight", Same(), (_HM + "shared_head.norm.weight",)))
    layer = tuple(dataclasses.replace(
        row, core=tuple(_M + "transformer_layer." + c[len(_L):] for c in row.core),
        hf=tuple(_HM + h[len(_H):] for h in row.hf)) for row in table if row.core[0].startswith(_L))
    return own + layer


#: The whole table: the multi-token prediction layers', then the decoder's.
DEEPSEEK_V3_NAMES: NameTable = _mtp_names(_DECODER_NAMES) + _DECODER_NAMES

#: transformers' DeepseekV3Config defaults for what a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "rope_interleave": True, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
}
#: The epsilon transformers fixes for the two latent norms (``q_a_layernorm``, ``kv_a_layernorm``);
#: megatron-core has one epsilon for every norm, so only models whose ``rms_norm_eps`` is this are exact.
LATENT_NORM_EPS = 1e-6


def rope_from_hf(c: Mapping[str, Any], refuse: Any) -> dict[str, Any]:
    """Megatron-LM's rope ``args`` for a DeepseekV3 ``config.json`` (either layout: transformers 5's
    ``rope_parameters``, 4's ``rope_theta`` + ``rope_scaling``). YaRN's cos/sin factor and softmax
    scale must come out the same: transformers uses ``mscale / mscale_all_dim`` when both are set,
    else ``mscale`` 1 (and no softmax scaling without ``mscale_all_dim``); megatron-core always uses
    the ratio, so ``mscale_all_dim`` 0 reads as mscale 1."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else c.get("rope_scaling")
    params = dict(params or {})
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=base, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise refuse(f"rotary scaling {rope_type} (megatron-core's MLA has YaRN or none)")
    for key in ("attention_factor", "partial_rotary_factor"):
        if params.get(key) is not None:
            raise refuse(f"rope {key} {params[key]}")
    if params.get("truncate") is False:
        raise refuse("YaRN without truncation (truncate false)")
    original = params.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = float(params.get("factor") or c["max_position_embeddings"] / original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not all_dim:
        mscale, all_dim = 1.0, 0.0
    elif not mscale:
        raise refuse("YaRN mscale_all_dim without mscale (megatron-core scales cos/sin by their ratio)")
    return dict(rope_type="yarn", rotary_base=base, rotary_scaling_factor=factor,
                original_max_position_embeddings=int(original), beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale), mscale_all_dim=float(all_dim))


def rope_to_hf(args: Any, refuse: Any) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for megatron-core's MLA rope ``args`` (Megatron-LM's CLI
    defaults where the args are silent: YaRN with factor 1, which is plain rope)."""
    base = float(saved_arg(args, "rotary_base", default=10000.0))
    rope_type = saved_arg(args, "rope_type", default="yarn")
    factor = float(saved_arg(args, "rotary_scaling_factor", default=1.0))
    mscale = float(saved_arg(args, "mscale", default=1.0))
    all_dim = float(saved_arg(args, "mscale_all_dim", default=0.0))
    if factor <= 1.0:  # YaRN at factor 1 is plain rope, and no mscale applies
        return {"rope_type": "default", "rope_theta": base}
    if rope_type != "yarn":
        if all_dim:
            raise refuse(f"plain rope with rotary_scaling_factor {factor:g} and mscale_all_dim {all_dim:g} "
                         "(megatron-core scales the softmax; transformers does not)")
        return {"rope_type": "default", "rope_theta": base}
    if not all_dim and mscale != 1.0:
        raise refuse(f"YaRN mscale {mscale:g} without mscale_all_dim (transformers then uses mscale 1)")
    if all_dim and not mscale:
        raise refuse("YaRN mscale 0 with mscale_all_dim set (transformers then uses mscale 1)")
    return {"rope_type": "yarn", "rope_theta": base, "factor": factor,
            "original_max_position_embeddings": int(saved_arg(args, "original_max_position_embeddings", default=4096)),
            "beta_fast": float(saved_arg(args, "beta_fast", default=32)),
            "beta_slow": float(saved_arg(args, "beta_slow", default=1)),
            "mscale": mscale, "mscale_all_dim": all_dim}


class DeepseekV3(HFArchitectureFamily):
    """transformers' ``DeepseekV3ForCausalLM`` (also Kimi-K2's folders): megatron-core MLA + DeepSeek
    MoE, both ways, exactly or refused naming the setting."""

    name = "DeepseekV3ForCausalLM"
    priority = 0
    model_types = ("deepseek_v3", "kimi_k2")
    names = DEEPSEEK_V3_NAMES

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}

        def refuse(what: str) -> LayoutError:
            return LayoutError(f"megatron-core does not compute this {self.name} exactly: {what}", culprit=where,
                               hint="only models Megatron-LM reproduces exactly are imported")

        def need(key: str) -> int:
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool):
                raise CheckpointFormatError(f"has no integer {key}", culprit=where, hint="check config.json")
            return int(c[key])

        if c["hidden_act"] != "silu":
            raise refuse(f"activation {c['hidden_act']} (Megatron's SwiGLU is silu)")
        if c["attention_bias"]:
            raise refuse("attention_bias (megatron-core's MLA projections have no biases)")
        if not c["rope_interleave"]:
            raise refuse("rope_interleave false (megatron-core's MLA rotates interleaved rope dims)")
        eps = float(c["rms_norm_eps"])
        if eps != LATENT_NORM_EPS:
            raise refuse(f"rms_norm_eps {eps:g} (transformers' latent norms use {LATENT_NORM_EPS:g} whatever it "
                         "says; megatron-core has one epsilon)")
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            raise refuse(f"scoring_func {c['scoring_func']} (transformers' DeepseekV3 routes on sigmoid scores)")
        layers, heads, hidden = need("num_hidden_layers"), need("num_attention_heads"), need("hidden_size")
        topk, experts = need("num_experts_per_tok"), need("n_routed_experts")
        groups, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
        if groups > 1 and topk // topk_group != 2:
            raise refuse(f"group routing with num_experts_per_tok {topk} and topk_group {topk_group} (transformers "
                         "scores a group by its top 2 experts, megatron-core by its top k / topk_group)")
        if experts % groups or (groups > 1 and experts // groups < 2):
            raise CheckpointFormatError(f"{experts} experts in {groups} groups (transformers scores a group by its top "
                                        "2 experts)", culprit=where, hint="check n_routed_experts and n_group")
        if topk > topk_group * experts // groups:
            raise CheckpointFormatError(f"num_experts_per_tok {topk} exceeds the experts of {topk_group} groups",
                                        culprit=where, hint="check num_experts_per_tok, n_group and topk_group")
        if topk > 1 and not c["norm_topk_prob"]:
            raise refuse("norm_topk_prob false with more than one expert per token (megatron-core renormalizes)")
        if topk == 1 and c["norm_topk_prob"]:
            raise refuse("norm_topk_prob with one expert per token (megatron-core keeps the raw sigmoid score)")
        shared = int(c["n_shared_experts"] or 0)
        if shared < 1:
            raise refuse("no shared expert")
        dense = int(c["first_k_dense_replace"] or 0)
        if not 0 <= dense < layers:
            raise refuse(f"first_k_dense_replace {dense} of {layers} layers (no MoE layer left)")
        moe_ffn = need("moe_intermediate_size")
        q_lora = c.get("q_lora_rank")
        v_dim = need("v_head_dim")
        rope = rope_from_hf(c, refuse)
        max_pos = need("max_position_embeddings")
        vocab = need("vocab_size")
        tied = bool(c["tie_word_embeddings"])
        scaling = float(c["routed_scaling_factor"] or 1.0)
        args = argparse.Namespace(
            num_layers=layers, hidden_size=hidden, ffn_hidden_size=need("intermediate_size"),
            # kv_channels as Megatron-LM and Megatron-Bridge leave it (hidden / heads): MLA's widths are its own
            num_attention_heads=heads, kv_channels=hidden // heads, group_query_attention=False,
            multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=need("kv_lora_rank"),
            qk_head_dim=need("qk_nope_head_dim"), qk_pos_emb_head_dim=need("qk_rope_head_dim"), v_head_dim=v_dim,
            qk_layernorm=True, normalization="RMSNorm", norm_epsilon=eps, swiglu=True,
            position_embedding_type="rope", rotary_percent=1.0, rotary_interleaved=False,
            **rope, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=not tied,
            vocab_size=vocab, padded_vocab_size=vocab, max_position_embeddings=max_pos, seq_length=max_pos,
            num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=moe_ffn * shared, moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=topk_group if groups > 1 else None,
            # pre-softmax as Megatron-Bridge's DeepSeek-V3 records it (with sigmoid scores megatron-core reads it not)
            moe_router_topk_scaling_factor=scaling, moe_router_pre_softmax=True,
            moe_router_load_balancing_type="none", moe_layer_freq=[0] * dense + [1] * (layers - dense),
            expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False,
            mtp_num_layers=None, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            transformer_impl="local", use_legacy_models=False, ckpt_format="torch")
        facts = ModelFacts(naming="megatron-core", num_layers=layers, hidden=hidden, heads=heads, query_groups=heads,
                           head_dim=v_dim, swiglu=True, tied_embeddings=tied, vocab_size=vocab,
                           padded_vocab_source=vocab, padded_vocab_target=None, make_vocab_size_divisible_by=None,
                           source_pp_layers=(layers,), target_pp_layers=(layers,))
        return HFModel(self.name, args, facts, self.names)

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """``num_nextn_predict_layers`` beyond the multi-token prediction layers the folder holds:
        transformers declares DeepSeek-V3's one MTP layer but saves no weights for it (its model has
        none). The output says what it holds (fewer layers: vLLM's MTP speculative decoding would
        look for weights that are not there), and this says why it changed."""
        declared = config.get("num_nextn_predict_layers")
        held = int(getattr(args, "mtp_num_layers", None) or 0)
        if not isinstance(declared, int) or declared <= held:
            return []
        return [f"num_nextn_predict_layers {declared} -> {held}: config.json declares {declared} multi-token "
                f"prediction layer{'s' if declared > 1 else ''} but the folder holds the weights of "
                f"{held or 'none'} (transformers saves DeepSeek-V3 without them)"]

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        if not any(_MLA_KEY.match(k) for k in keys):
            return None

        def refuse(what: str) -> LayoutError:
            return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                               hint="keep it in a Megatron layout (DeepseekV3ForCausalLM needs DeepSeek's settings)")

        def has(pattern: str) -> bool:
            return any(re.search(pattern, k) for k in keys)

        for flag, what in (*NOT_EXPORTED_FLAGS, ("add_bias_linear", "linear biases"),
                           ("moe_shared_expert_gate", "a gated shared expert"),
                           ("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter")):
            if saved_arg(args, flag, default=False):
                raise refuse(f"{what} ({flag})")
        if saved_arg(args, "position_embedding_type", default="rope") not in ("rope", "none"):
            raise refuse(f"position embedding {saved_arg(args, 'position_embedding_type')} "
                         "(MLA rotates its own rope dims)")
        if float(saved_arg(args, "rotary_percent", default=1.0)) != 1.0:
            raise refuse(f"rotary_percent {saved_arg(args, 'rotary_percent')} (the whole rope head must rotate)")
        if saved_arg(args, "normalization") != "RMSNorm":
            raise refuse(f"normalization {saved_arg(args, 'normalization')} (DeepseekV3 uses RMSNorm)")
        if not facts.swiglu:
            raise refuse("the MLP is not SwiGLU")
        eps = float(saved_arg(args, "norm_epsilon", default=1e-5))
        if eps != LATENT_NORM_EPS:
            raise refuse(f"norm epsilon {eps:g} (transformers fixes the latent norms' at {LATENT_NORM_EPS:g})")
        if not has(r"\.self_attention\.(?:kv_layernorm\.weight|linear_kv_up_proj\.layer_norm_weight)$"):
            raise refuse("MLA without latent norms (qk_layernorm false)")
        if not has(r"\.mlp\.router\.weight$"):
            raise refuse("no MoE layer (DeepseekV3's layers after first_k_dense_replace are MoE)")
        if saved_arg(args, "moe_router_score_function", default="softmax") != "sigmoid":
            raise refuse("router scores by softmax (DeepseekV3 routes on sigmoid scores)")
        if not has(r"\.mlp\.router\.expert_bias$"):
            raise refuse("a router without expert bias (DeepseekV3 has e_score_correction_bias)")
        if has(r"\.mlp\.router\.bias$"):
            raise refuse("a router bias")
        if not has(r"\.mlp\.shared_experts\.linear_fc1\.weight$"):
            raise refuse("MoE layers without a shared expert")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise refuse("the router's top-k is unknown (the saved args lack moe_router_topk)")
        groups, group_topk = saved_arg(args, "moe_router_num_groups"), saved_arg(args, "moe_router_group_topk")
        if not (groups and groups > 1 and group_topk):  # megatron-core routes over every expert then
            groups = group_topk = None
        if groups and topk // group_topk != 2:
            raise refuse(f"group routing with top-k {topk} and group top-k {group_topk} (transformers scores a "
                         "group by its top 2 experts)")
        moe_layers = {stack_layer(k) for k in keys if k.endswith(".mlp.router.weight")}
        dense = sorted(set(range(facts.num_layers)) - moe_layers)
        if dense != list(range(len(dense))):
            raise refuse(f"dense layers {dense} (DeepseekV3's dense layers are the first ones)")
        moe_ffn, shared_ffn = widths.get("expert"), widths.get("shared")
        if not moe_ffn or not shared_ffn or shared_ffn % moe_ffn:
            raise refuse(f"a shared expert of width {shared_ffn}, not a multiple of the routed experts' {moe_ffn} "
                         "(DeepseekV3's is n_shared_experts x moe_intermediate_size)")
        mtp = mtp_layers(facts)
        if mtp and facts.tied_embeddings:
            raise refuse("tied embeddings with multi-token prediction layers (DeepSeek's MTP layers hold a copy of "
                         "an untied head)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        rope = rope_to_hf(args, refuse)
        q_lora = saved_arg(args, "q_lora_rank") if has(r"\.linear_q_down_proj\.weight$") else None
        heads, v_dim = facts.heads, saved_arg(args, "v_head_dim")
        vocab = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
        max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
        scaling = saved_arg(args, "moe_router_topk_scaling_factor")
        config: dict[str, Any] = {
            "architectures": [self.name], "model_type": "deepseek_v3", "vocab_size": vocab,
            "hidden_size": facts.hidden, "intermediate_size": widths.get("dense") or moe_ffn,
            "moe_intermediate_size": moe_ffn, "num_hidden_layers": facts.num_layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "n_shared_experts": shared_ffn // moe_ffn, "n_routed_experts": experts,
            "routed_scaling_factor": float(scaling) if scaling else 1.0,
            "kv_lora_rank": saved_arg(args, "kv_lora_rank"),
            "q_lora_rank": q_lora, "qk_rope_head_dim": saved_arg(args, "qk_pos_emb_head_dim"), "v_head_dim": v_dim,
            "qk_nope_head_dim": saved_arg(args, "qk_head_dim"), "n_group": groups or 1,
            "topk_group": group_topk or 1, "num_experts_per_tok": topk,
            "first_k_dense_replace": len(dense), "norm_topk_prob": topk > 1, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": eps,
            "rope_parameters": rope, "rope_theta": rope["rope_theta"], "rope_interleave": True, "attention_bias": False,
            "tie_word_embeddings": bool(facts.tied_embeddings),
            "num_nextn_predict_layers": mtp,
            "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None, "use_cache": True,
        }
        if isinstance(max_pos, int):
            config["max_position_embeddings"] = max_pos
        if rope["rope_type"] == "yarn":  # also as transformers 4 and DeepSeek's own config.json say it
            config["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope.items() if k != "rope_theta"}}
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim")
                   if not isinstance(config[k], int)]
        if missing or (has(r"\.linear_q_down_proj\.weight$") and not isinstance(q_lora, int)):
            raise refuse(f"the MLA dims are unknown (the saved args lack {', '.join(missing) or 'q_lora_rank'})")
        notes = ("router logits in float32 (transformers' DeepseekV3 keeps its gate in float32)",)
        return HFArchitecture(name=self.name, config=config, names=self.names, notes=notes,
                              reason=f"multi-latent attention, RMSNorm, SwiGLU, {experts} sigmoid-routed experts with "
                                     f"expert bias and a shared expert, top-{topk}"
                                     + (f" in {group_topk} of {groups} groups" if groups else ""))


DEEPSEEK_V3 = DeepseekV3()
