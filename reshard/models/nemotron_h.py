"""Nemotron-H on megatron-core's side: ``MambaModel``, a hybrid stack whose layers are Mamba-2 mixers
(``M``), attention (``*``), MLPs (``-``) or MoE layers (``E``) as Megatron-LM's
``--hybrid-override-pattern`` says, built with megatron-core's ``mamba_stack_spec`` (Transformer
Engine's fused norm-linear layers: a layer's pre-norm is the ``layer_norm_weight`` of its first
linear layer, an MoE layer's is ``pre_mlp_layernorm``). The Hugging Face architecture
``NemotronHForCausalLM`` is :mod:`reshard.models.hf_nemotron_h`.

What megatron-core 0.16.1 holds per rank (``ssm/mamba_mixer.py``; ``d`` = heads x head dim, ``g``
groups of ``s`` state rows, ``n`` heads, kernel ``k``) and how reshard splits it over TP, as
``MambaMixer.sharded_state_dict`` states it:

=========================================  =================================  ================================
``decoder.layers.{l}.mixer.``              shape                              split over TP
=========================================  =================================  ================================
``in_proj.weight``                         ``[2d + 2gs + n, h]``:             each section on its own: z and x
                                           ``[z; x; B; C; dt]``               by heads, B and C by whole groups,
                                                                              dt by heads
``in_proj.layer_norm_weight``              ``[h]``                            whole on every rank
``conv1d.weight``, ``conv1d.bias``         ``[d + 2gs, 1, k]``, ``[d + 2gs]``  ``[x; B; C]``, each on its own
``A_log``, ``D``, ``dt_bias``              ``[n]``                            axis 0 (by heads)
``norm.weight`` (gated RMSNorm)            ``[d]``, normalised per group of   axis 0: a rank holds whole groups
                                           ``d / g``                          (``g`` divides by TP)
``out_proj.weight``                        ``[h, d]``                         axis 1 (row parallel)
=========================================  =================================  ================================

Attention, MLP and MoE layers hold megatron-core's GPT names
(:data:`~reshard.models.megatron_gpt.MEGATRON_GPT_RULES`; Transformer Engine's fused norms
``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``; grouped
experts ``mlp.experts.linear_fc1.weight{e}``); the stack's last norm is ``decoder.final_norm``.

megatron-core asserts that the groups and the heads divide by the TP (each rank holds whole groups);
a target TP that does not divide them is refused by the sectioned layout, naming the section.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ModelFacts
from reshard.core.rules import Kind, Place, Rule
from reshard.models.facts import saved_arg
from reshard.models.megatron_gpt import DECODER_LAYER, MEGATRON_GPT_RULES, MegatronCoreFamily

#: The Mamba mixer's module of a layer (megatron-core's name).
MIXER = "mixer."
#: Layer symbols of megatron-core's ``hybrid_override_pattern`` (``ssm/mamba_hybrid_layer_allocation.py``
#: ``Symbols``): Mamba, attention, MLP, MoE.
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
#: megatron-core 0.19's separators in the pattern: pipeline segments (``|``) and multi-token prediction
#: depths after the main pattern (``/``) (``models/hybrid/hybrid_layer_allocation.py`` ``Symbols``).
PIPE, MTP_SEPARATOR = "|", "/"
#: The sections of the fused tensors, named as ``MambaMixer.sharded_state_dict`` names them.
IN_PROJ_SECTIONS, CONV_SECTIONS = ("z", "x", "B", "C", "dt"), ("x", "B", "C")
IN_PROJ, CONV1D = "mamba.in_proj", "mamba.conv1d"
#: megatron-core's fixed mixer settings (``MambaMixer.__init__`` defaults the stack spec keeps):
#: the causal conv's kernel, the gated norm's epsilon, the activation, no linear biases.
CONV_KERNEL, MIXER_NORM_EPS = 4, 1e-5

_M = DECODER_LAYER + re.escape(MIXER)

#: The family's table: the Mamba mixer's entries, the stack's final norm, then megatron-core's GPT rules
#: (attention, MLP and MoE layers under Transformer Engine's names, embeddings, output layer).
NEMOTRON_H_RULES: tuple[Rule, ...] = (
    Rule("mamba.in_proj.weight", _M + r"in_proj\.weight$", Kind.COLUMN, family="core", sections=IN_PROJ),
    Rule("mamba.in_proj.layer_norm_weight", _M + r"in_proj\.layer_norm_weight$", Kind.REPLICATED, family="core"),
    Rule("mamba.conv1d", _M + r"conv1d\.(?:weight|bias)$", Kind.COLUMN, family="core", sections=CONV1D),
    Rule("mamba.heads", _M + r"(?:A_log|D|dt_bias)$", Kind.COLUMN, family="core"),
    Rule("mamba.norm", _M + r"norm\.weight$", Kind.COLUMN, family="core"),
    Rule("mamba.out_proj.weight", _M + r"out_proj\.weight$", Kind.ROW, family="core"),
    Rule("final_norm", r"^decoder\.final_norm\.weight$", Kind.REPLICATED, family="core", place=Place.LAST),
    Rule("final_norm.extra_state", r"^decoder\.final_norm\._extra_state$", Kind.CARRIED, family="core",
         place=Place.LAST, optional=True),
) + MEGATRON_GPT_RULES

#: The model fact of the layer pattern (megatron-core's ``hybrid_override_pattern`` symbols).
PATTERN_FACT = "hybrid_override_pattern"
_MIXER_KEY = re.compile(_M + r"A_log$")
_IN_PROJ_KEY, _CONV_KEY = re.compile(_M + r"in_proj\.weight$"), re.compile(_M + r"conv1d\.(?:weight|bias)$")


def layer_kind(keys: Sequence[str], layer: int) -> str | None:
    """The ``hybrid_override_pattern`` symbol of stack layer ``layer`` from its parameter names
    (megatron-core names, the layer numbered as in ``keys``), None for a layer ``keys`` do not hold."""
    prefix = f"decoder.layers.{layer}."
    rests = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    if not rests:
        return None
    if any(r.startswith(MIXER) for r in rests):
        return MAMBA
    if any(r.startswith("self_attention.") for r in rests):
        return ATTENTION
    if any(r.startswith("mlp.router.") for r in rests):
        return MOE
    return MLP


def hybrid_pattern(args: Any) -> str | None:
    """The saved ``args``' layer pattern (megatron-core 0.16's ``hybrid_override_pattern``, 0.19's
    ``hybrid_layer_pattern``), None when they record none."""
    return saved_arg(args, "hybrid_override_pattern", "hybrid_layer_pattern")


def mixer_dims(args: Any, where: str) -> tuple[int, int, int]:
    """``(d, g s, n)`` of the whole model from the saved ``args`` (``mamba_num_heads`` x
    ``mamba_head_dim``, else ``2 hidden_size`` as ``MambaMixer``'s ``expand`` 2 makes it;
    ``mamba_num_groups`` x ``mamba_state_dim``), or :class:`LayoutError` naming what is missing."""
    head_dim, groups, state = (saved_arg(args, k) for k in ("mamba_head_dim", "mamba_num_groups", "mamba_state_dim"))
    heads, hidden = saved_arg(args, "mamba_num_heads"), saved_arg(args, "hidden_size")
    for name, v in (("mamba_head_dim", head_dim), ("mamba_num_groups", groups), ("mamba_state_dim", state)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"args.{name} is {v!r}: the mixer's fused sections cannot be sized", culprit=where,
                              hint="give the checkpoint's args (Megatron-LM saves them) or --model-config")
    if heads is None:
        if not isinstance(hidden, int):
            raise LayoutError("args.mamba_num_heads and args.hidden_size are unknown", culprit=where,
                              hint="give the checkpoint's args (Megatron-LM saves them) or --model-config")
        heads = 2 * hidden // head_dim
    return heads * head_dim, groups * state, heads


class NemotronH(MegatronCoreFamily):
    """megatron-core's hybrid ``MambaModel`` (Nemotron-H's): Mamba-2 mixers beside attention, MLP and
    MoE layers, the mixer's fused tensors split section by section over TP."""

    name = "nemotron-h"
    rules = NEMOTRON_H_RULES
    dist_stacks_layers = False  # MambaStack.sharded_state_dict keys every layer apart (decoder.layers.{i}.)
    dist_keys_map = False  # the stack spec is Transformer Engine's: an MoE layer's pre_mlp_layernorm keeps its name
    dist_per_rank_only = frozenset()  # MambaModel keeps output_layer._extra_state in its sharded state dict
    priority = 45
    supported = ("megatron-core MambaModel names (decoder.layers.N.mixer.*: in_proj, conv1d, A_log, D, dt_bias, "
                 "norm, out_proj; attention, MLP and MoE layers; decoder.final_norm)")

    def claims(self, keys: Sequence[str]) -> bool:
        return any(_MIXER_KEY.match(k) for k in keys) or "decoder.final_norm.weight" in keys

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def split_sections(self, rule: Rule, key: str, rank_rows: int, n: int, args: Any) -> tuple[tuple[int, int], ...]:
        """``in_proj``: z, x (whole heads), B, C (whole groups of ``mamba_state_dim`` rows), dt (heads);
        ``conv1d``: x, B, C — each rank's share of the whole model's, as ``MambaMixer`` holds them."""
        d, gs, heads = mixer_dims(args, key)
        head_dim, state = saved_arg(args, "mamba_head_dim"), saved_arg(args, "mamba_state_dim")
        groups = gs // state
        if heads % n or groups % n:
            raise LayoutError(f"{heads} heads in {groups} groups (args.mamba_num_groups) do not divide over the "
                              f"source's {n} tensor-parallel ranks", culprit=key,
                              hint="check the checkpoint's args against its files")
        x, b, dt = (d // n, head_dim), (gs // n, state), (heads // n, 1)
        sections = (x, x, b, b, dt) if rule.sections == IN_PROJ else (x, b, b)
        if sum(rows for rows, _ in sections) != rank_rows:
            raise LayoutError(f"{rank_rows} rows per rank, but the args' {heads} heads of {head_dim}, {groups} groups "
                              f"of {state} make {sum(rows for rows, _ in sections)}", culprit=key,
                              hint="check mamba_num_heads / mamba_head_dim / mamba_num_groups / mamba_state_dim")
        return sections

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        """The layer pattern the saved ``args`` record; and the refusal, before anything is written, of
        a target TP that megatron-core's mixer is not built at: ``MambaMixer`` asserts that its heads
        and its groups (``args.mamba_num_groups``, transformers' ``n_groups``) divide by the TP."""
        if not any(p.rule.sections for p in params):
            return {}
        _, gs, heads = mixer_dims(args, where)
        groups, tp = gs // saved_arg(args, "mamba_state_dim"), options.target_tp
        if tp and (heads % tp or groups % tp):
            fits = ", ".join(str(t) for t in range(1, groups + 1) if heads % t == 0 and groups % t == 0)
            raise LayoutError(f"the Mamba mixers' {groups} groups (args.mamba_num_groups, n_groups) and {heads} heads "
                              f"do not divide over {tp} tensor-parallel ranks (megatron-core's mixer holds whole "
                              f"groups and heads on each)", culprit="--target-tp",
                              hint=f"choose a target TP among {fits}")
        pattern = hybrid_pattern(args)
        if pattern is None:
            return {}
        if PIPE in pattern or MTP_SEPARATOR in pattern:
            # the segments are the source's pipeline stages (and virtual ones): placing layers by an even
            # split would misplace them, and the written args would keep a layout the output lacks
            raise LayoutError(f"the saved layer pattern {pattern!r} lays out pipeline segments ('|') or multi-token "
                              "prediction layers ('/'), megatron-core 0.19's forms reshard does not read yet",
                              culprit="args.hybrid_layer_pattern",
                              hint="save the checkpoint with a pattern of layer symbols only (stages split by "
                                   "--decoder-first-pipeline-num-layers)")
        origin[PATTERN_FACT] = "args"
        return {PATTERN_FACT: pattern}

    def dist_parts(self, name: str, args: Any = None) -> tuple[tuple[str, int | None], ...] | None:
        """``in_proj.weight`` as ``.z .x .B .C .dt``, ``conv1d.weight`` / ``.bias`` as ``.x .B .C``
        (``MambaMixer.sharded_state_dict``'s ``_split_tensor_factory``), the whole model's rows of each."""
        names = IN_PROJ_SECTIONS if _IN_PROJ_KEY.match(name) else CONV_SECTIONS if _CONV_KEY.match(name) else None
        if names is None:
            return None
        if args is None:
            return tuple((n, None) for n in names)
        d, gs, heads = mixer_dims(args, name)
        rows = (d, d, gs, gs, heads) if names == IN_PROJ_SECTIONS else (d, gs, gs)
        return tuple(zip(names, rows, strict=True))

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """The layer pattern and the mixer's sizes the saved ``args`` record."""
        mixer = {k: saved_arg(args, k) for k in ("mamba_num_heads", "mamba_head_dim", "mamba_num_groups",
                                                 "mamba_state_dim") if saved_arg(args, k) is not None}
        return {**super().summary(args, model_facts, experts), "hybrid_override_pattern": hybrid_pattern(args),
                "mixer": mixer or None}
