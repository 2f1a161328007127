"""Qwen3-Next and Qwen3.5 on megatron-core's side: a megatron-core GPT model whose layers mix gated
DeltaNet mixers (Megatron-LM's ``--experimental-attention-variant gated_delta_net``, the layer
pattern ``--linear-attention-freq``) with full attention whose output is gated
(``--attention-output-gate``), built from megatron-core's Transformer Engine spec (the only spec
``experimental_attention_variant_module_specs`` builds: fused input norms, ``layer_norm_weight``).
The Hugging Face architectures (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``) are :mod:`reshard.models.hf_qwen3_next`.

What megatron-core 0.16.1 holds of a gated DeltaNet layer (``ssm/gated_delta_net.py``;
``nk``/``nv`` key/value heads of ``dk``/``dv`` dims, ``K`` the conv kernel) and how reshard splits it
over TP, as its ``sharded_state_dict`` does:

===============================================  ===========================================  ==================
``decoder.layers.{l}.self_attention.``           shape (whole model)                          split over TP
===============================================  ===========================================  ==================
``in_proj.weight``                               ``[q nk*dk; k nk*dk; v nv*dv; z nv*dv;``     each of the six
                                                 ``beta nv; alpha nv]`` x ``h``               sections on its own
``in_proj.layer_norm_weight``                    ``[h]`` (the layer's input norm)             whole
``conv1d.weight`` (``.bias``)                    ``[q nk*dk; k nk*dk; v nv*dv]`` x ``1 x K``  q, k, v each
``dt_bias``, ``A_log``                           ``[nv]``                                     by value heads
``out_norm.weight``                              ``[dv]`` (zero-centred: ``1 + w``)           whole
``out_proj.weight``                              ``[h, nv*dv]``                               columns (dim 1)
===============================================  ===========================================  ==================

q and k split by key heads, v, z, beta and alpha by value heads (``nv / nk`` value heads per key
head: a rank holds whole key heads and their value heads). The attention's
``self_attention.linear_qkv.weight`` with the output gate holds per query group ``[q heads; gate
heads; k; v]`` (``attention.py`` ``get_query_key_value_tensors``, ``output_gate``): split by whole
query groups of ``(2 q + 2) d`` rows. Everything else (query/key norms, the output projection, the
MLPs and MoE layers with a gated shared expert) is :data:`~reshard.models.megatron_gpt.MEGATRON_GPT_RULES`'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ModelFacts
from reshard.core.rules import Kind, Rule
from reshard.models.facts import int_arg, saved_arg
from reshard.models.megatron_gpt import DECODER_LAYER, MEGATRON_GPT_RULES, MegatronCoreFamily

#: A gated DeltaNet layer's mixer (megatron-core's attribute of the layer).
MIXER = "self_attention."
#: Megatron-LM's ``args`` of the mixer's shape (``TransformerConfig`` fields of the same names).
HEAD_ARGS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
#: Megatron-LM's value of ``experimental_attention_variant`` for these mixers.
VARIANT = "gated_delta_net"
#: The family's own fact: the mixer's heads and dims (:data:`HEAD_ARGS`, by name).
LINEAR_HEADS = "linear_heads"

_IN_PROJ, _CONV, _GATED_QKV = "gdn.in_proj", "gdn.conv1d", "gated_qkv"
#: The names megatron-core's ``sharded_state_dict`` gives each section (``_split_tensor_factory``: the
#: torch_dist keys ``<name>.<section>``), in :meth:`Qwen3Next.split_sections` order.
SECTION_NAMES: dict[str, tuple[str, ...]] = {_IN_PROJ: ("query", "key", "value", "z", "beta", "alpha"),
                                              _CONV: ("query", "key", "value")}
_M = DECODER_LAYER + re.escape(MIXER)
_IN_PROJ_KEY = re.compile(_M + r"in_proj\.weight$")
_CONV_KEY = re.compile(_M + r"conv1d\.(?:weight|bias)$")


def _rule(name: str, pattern: str, kind: Kind, **kw: Any) -> Rule:
    return Rule("core." + name, pattern, kind, family="core", **kw)


#: The family's table: the mixer's tensors and the gated attention's fused QKV (before megatron-core
#: GPT's own rules, which hold the rest).
QWEN3_NEXT_RULES: tuple[Rule, ...] = (
    _rule("gdn.in_proj.weight", _IN_PROJ_KEY.pattern, Kind.COLUMN, sections=_IN_PROJ),
    _rule("gdn.in_proj.layer_norm_weight", _M + r"in_proj\.layer_norm_weight$", Kind.REPLICATED),
    _rule("gdn.conv1d", _CONV_KEY.pattern, Kind.COLUMN, sections=_CONV),
    _rule("gdn.dt_bias_A_log", _M + r"(?:dt_bias|A_log)$", Kind.COLUMN),
    _rule("gdn.out_norm", _M + r"out_norm\.weight$", Kind.REPLICATED),
    _rule("gdn.out_proj", _M + r"out_proj\.weight$", Kind.ROW),
    _rule("gated_linear_qkv", _M + r"linear_qkv\.(?:weight|bias)$", Kind.COLUMN, sections=_GATED_QKV),
) + MEGATRON_GPT_RULES


def linear_heads(args: Any, where: str = "args") -> dict[str, int]:
    """The mixer's heads and dims from the saved ``args`` (:data:`HEAD_ARGS`), or the refusal naming
    the first one missing or a value-head count that is no multiple of the key heads."""
    out = {}
    for name in HEAD_ARGS:
        value = int_arg(args, name)
        if value is None:
            raise LayoutError(f"the gated DeltaNet layers' args.{name} is not recorded", culprit=where,
                              hint="give the model's config.json with --model-config")
        out[name] = value
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise LayoutError(f"args.linear_num_value_heads {out['linear_num_value_heads']} is no multiple of "
                          f"args.linear_num_key_heads {out['linear_num_key_heads']}", culprit=where,
                          hint="check the saved args")
    return out


def facts_heads(facts: ModelFacts) -> tuple[int, int, int, int]:
    """``(nk, nv, dk, dv)`` of the mixer, from the model facts (:data:`LINEAR_HEADS`)."""
    h = facts.family_facts.get(LINEAR_HEADS)
    if not h:
        raise LayoutError("the gated DeltaNet layers' heads are unknown", culprit="--to hf",
                          hint="give the model's config.json with --model-config")
    return (h["linear_num_key_heads"], h["linear_num_value_heads"], h["linear_key_head_dim"],
            h["linear_value_head_dim"])


class Qwen3Next(MegatronCoreFamily):
    """megatron-core GPT models with gated DeltaNet layers (``self_attention.in_proj`` / ``A_log``)
    and gated full attention: Qwen3-Next's and Qwen3.5's, dense or MoE."""

    name = "qwen3-next"
    rules = QWEN3_NEXT_RULES
    priority = 40
    #: torch_dist: built from Transformer Engine's spec alone (no keys map): an MoE layer's separate
    #: ``pre_mlp_layernorm.weight`` keeps its name there.
    dist_keys_map = False
    supported = ("megatron-core GPT names with gated DeltaNet layers (self_attention.in_proj, conv1d, A_log, "
                 "dt_bias, out_norm, out_proj) and gated attention, dense or MoE MLP")

    def claims(self, keys: Sequence[str]) -> bool:
        """A mixer's ``in_proj``, whole (per-rank) or as torch_dist's first part (:meth:`dist_parts`)."""
        return any(_IN_PROJ_KEY.match(k) or _IN_PROJ_KEY.match(k.removesuffix(".query")) for k in keys)

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def split_sections(self, rule: Rule, key: str, rank_rows: int, n: int, args: Any) -> tuple[tuple[int, int], ...]:
        """megatron-core's sections on one of ``n`` ranks: the mixer's six (in_proj) or three (conv1d),
        each split on its own (a key head's q/k rows, a value head's v/z rows, one row of beta/alpha
        per value head are the units); the gated QKV's one section of whole query groups."""
        if rule.sections == _GATED_QKV:
            return (rank_rows, self._gated_group_rows(key, rank_rows, n, args)),
        h = linear_heads(args, key)
        nk, nv, dk, dv = (h[a] for a in HEAD_ARGS)
        for count, what in ((nk, "linear_num_key_heads"), (nv, "linear_num_value_heads")):
            if count % n:
                raise LayoutError(f"args.{what} {count} cannot be divided over the source's {n} ranks",
                                  culprit=key, hint="check the saved args against the checkpoint")
        # value heads ride with their key head: split by key heads, nv/nk value heads per unit
        r = nv // nk
        qkv = ((nk * dk // n, dk), (nk * dk // n, dk), (nv * dv // n, r * dv))
        if rule.sections == _CONV:
            return qkv
        return (*qkv, (nv * dv // n, r * dv), (nv // n, r), (nv // n, r))

    def dist_parts(self, name: str, args: Any = None) -> tuple[tuple[str, int | None], ...] | None:
        """torch_dist: ``in_proj.weight`` as ``.query .key .value .z .beta .alpha`` and ``conv1d.weight``
        (``.bias``) as ``.query .key .value`` (``GatedDeltaNet.sharded_state_dict``'s
        ``_split_tensor_factory``), each part the whole model's rows of its section."""
        layout = _IN_PROJ if _IN_PROJ_KEY.match(name) else _CONV if _CONV_KEY.match(name) else None
        if layout is None:
            return None
        names = SECTION_NAMES[layout]
        if args is None:
            return tuple((n, None) for n in names)
        h = linear_heads(args, name)
        qk, v, nv = h["linear_num_key_heads"] * h["linear_key_head_dim"], \
            h["linear_num_value_heads"] * h["linear_value_head_dim"], h["linear_num_value_heads"]
        rows = (qk, qk, v, v, nv, nv) if layout == _IN_PROJ else (qk, qk, v)
        return tuple(zip(names, rows, strict=True))

    @staticmethod
    def _gated_group_rows(key: str, rank_rows: int, n: int, args: Any) -> int:
        """Rows of one query group of the gated fused QKV (``(2 q + 2) d``; without the gate ``(q + 2) d``)."""
        heads, d = int_arg(args, "num_attention_heads"), int_arg(args, "kv_channels")
        groups = int_arg(args, "num_query_groups") if saved_arg(args, "group_query_attention") else heads
        if heads is None or d is None or groups is None or heads % groups:
            raise LayoutError("the attention's heads, query groups or kv_channels are not recorded", culprit=key,
                              hint="give the model's config.json with --model-config")
        q = heads // groups
        group = ((2 * q if saved_arg(args, "attention_output_gate") else q) + 2) * d
        if rank_rows * n != groups * group:
            raise LayoutError(f"{rank_rows * n} rows are not {groups} query groups of {group} rows", culprit=key,
                              hint="check args.attention_output_gate against the checkpoint")
        return group

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        origin[LINEAR_HEADS] = "args"
        return {LINEAR_HEADS: linear_heads(args, where)}

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """The routing, and the mixer's pattern and shape that the saved ``args`` record."""
        recorded = {k: saved_arg(args, k) for k in ("experimental_attention_variant", "linear_attention_freq",
                                                     "linear_conv_kernel_dim", *HEAD_ARGS, "attention_output_gate")
                    if saved_arg(args, k) is not None}
        return {**super().summary(args, model_facts, experts), "linear_attention": recorded or None}
