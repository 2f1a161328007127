"""``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` (transformers'
``models/qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``; the text models) both ways: megatron-core's GPT
model with gated DeltaNet layers and gated attention (:mod:`reshard.models.qwen3_next` is its
megatron-core side). ``nk``/``nv`` key/value heads of the mixer (``r = nv / nk`` value heads per key
head), ``dk``/``dv`` their dims, ``q`` query heads per query group of the attention, ``d`` its head dim.

=============================================  ===============================================  ==============
Hugging Face (``model.layers.{l}.``)           megatron-core (``decoder.layers.{l}.``)          transform
=============================================  ===============================================  ==============
``linear_attn.in_proj_qkvz`` per key head      ``self_attention.in_proj.weight``                rows regrouped
``[q dk; k dk; v r*dv; z r*dv]``,              ``[q; k; v; z; beta; alpha]`` (all heads of
``linear_attn.in_proj_ba`` per key head        each, in order)
``[b r; a r]`` (Qwen3-Next)
``linear_attn.in_proj_{qkv,z,b,a}`` (Qwen3.5)  ``self_attention.in_proj.weight``                concatenated
``linear_attn.conv1d.weight`` ``[q;k;v,1,K]``  ``self_attention.conv1d.weight``                 same
``linear_attn.{A_log,dt_bias}``                ``self_attention.{A_log,dt_bias}``               same
``linear_attn.norm.weight`` (``w``)            ``self_attention.out_norm.weight`` (``w - 1``)   zero-centred
``linear_attn.out_proj.weight``                ``self_attention.out_proj.weight``               same
``input_layernorm`` (a DeltaNet layer)         ``self_attention.in_proj.layer_norm_weight``     same
``input_layernorm`` (an attention layer)       ``self_attention.linear_qkv.layer_norm_weight``  same
``self_attn.q_proj`` per head ``[q d; gate d]``  ``self_attention.linear_qkv.weight`` per query   regrouped
``self_attn.k_proj``, ``v_proj``               group ``[q heads; gate heads; k; v]``
``self_attn.{q,k}_norm``, ``o_proj``           ``self_attention.{q,k}_layernorm``, ``linear_proj``  same
``post_attention_layernorm`` (MoE layer)       ``pre_mlp_layernorm.weight``                     same
``post_attention_layernorm`` (dense layer)     ``mlp.linear_fc1.layer_norm_weight``             same
``mlp.gate``, ``mlp.experts.{e}.*``,           ``mlp.router``, ``mlp.experts.local_experts.{e}``,  as Qwen2-MoE
``mlp.shared_expert.*``, ``shared_expert_gate``  ``mlp.shared_experts.*``, ``gate_weight``
=============================================  ===============================================  ==============

The arithmetic, read from transformers 5.24 and megatron-core 0.16.1:

* norms: transformers' ``Qwen3NextRMSNorm`` scales by ``1 + w`` (zero-centred), megatron-core's
  Transformer Engine norms do so under ``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``),
  every norm of the model: the same ``w``. The mixer's gated norm (``Qwen3NextRMSNormGated``) scales
  by ``w``, megatron-core's ``out_norm`` (a zero-centred norm too) by ``1 + w'``: ``w' = w - 1``,
  converted exactly or refused (``ZeroCentred``);
* mixer: ``g = -exp(A_log) softplus(alpha + dt_bias)``, ``beta = sigmoid(b)``, L2-normed q and k, a
  causal depthwise conv (SiLU, no bias) over ``[q; k; v]``, ``nv / nk`` value heads per key head
  (``repeat_interleave``), the output normed per value head and gated by ``silu(z)``;
* attention: the query projection's second half per head is a sigmoid output gate (megatron-core's
  ``--attention-output-gate``), query/key RMSNorm per head, partial rotary (``partial_rotary_factor``:
  ``--rotary-percent``; both rotate the leading dims of each head by halves);
* MoE: top-k of the router's softmax, renormalized (``norm_topk_prob``), plus a shared expert gated by
  ``sigmoid(shared_expert_gate x)`` (``--moe-shared-expert-gate``).
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lazy import Converted, LazyTensor, RowConcat
from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    ByteTransform,
    GatedSplit,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    OutTensor,
    Run,
    Same,
    VocabRows,
    WholeTensorTransform,
    expect_rows,
    name_table,
    row_bytes,
)
from reshard.models.hf_common import (
    CORE_LAYER,
    EXTRA_STATE,
    HF_LAYER,
    NOT_EXPORTED_FLAGS,
    config_int,
    import_refusal,
    megatron_model,
    not_exact,
    rope_of,
)
from reshard.models.hf_moe import megatron_moe_args
from reshard.models.hf_qwen_moe import QWEN_ROUTED, QWEN_SHARED
from reshard.models.megatron_gpt import experts_per_layer, stack_layer
from reshard.models.qwen3_next import HEAD_ARGS, LINEAR_HEADS, VARIANT, facts_heads

_L, _H = CORE_LAYER, HF_LAYER
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
#: The family facts an import records beside the mixer's heads: which layers are gated DeltaNet
#: layers and which have a dense MLP (their norms have other megatron-core names).
LINEAR_LAYERS, DENSE_LAYERS = "linear_layers", "dense_layers"
#: The releases' multi-token prediction weights, which transformers does not load (nor reshard).
MTP_PREFIX = "mtp."


class Segments(ByteTransform):
    """A megatron-core tensor whose rows are runs of rows of several Hugging Face tensors: the
    subclass lists them (:meth:`segments`: ``(output, first row there, first row here, rows)``) and
    the outputs' rows (:meth:`out_rows`); the bytes move both ways by those runs."""

    @abc.abstractmethod
    def out_rows(self, facts: ModelFacts) -> tuple[int, ...]:
        """The rows of each Hugging Face tensor, in the table's order."""

    @abc.abstractmethod
    def segments(self, facts: ModelFacts) -> list[tuple[int, int, int, int]]:
        """The runs of rows: ``(output, first row there, first row here, rows)``."""

    def _check(self, shape: tuple[int, ...], facts: ModelFacts) -> None:
        if shape[0] != sum(self.out_rows(facts)):
            raise LayoutError(f"{shape[0]} rows are not the {sum(self.out_rows(facts))} the model's heads make",
                              culprit=type(self).__name__, hint="check the saved args against the checkpoint")

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        self._check(shape, facts)
        return [OutTensor(n, (rows, *shape[1:])) for n, rows in zip(names, self.out_rows(facts))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        self._check(shape, facts)
        row = row_bytes(shape, itemsize)
        return [Run(here * row, rows * row, out, there * row) for out, there, here, rows in self.segments(facts)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        expect_rows(names, parts, self.out_rows(facts))
        return RowConcat([(parts[out], there, rows) for out, there, _, rows in
                          sorted(self.segments(facts), key=lambda s: s[2])])


class GatedQKV(Segments):
    """megatron-core's fused QKV with the output gate, per query group ``[q heads; gate heads; k; v]``,
    as transformers' ``q_proj`` (per head ``[query d; gate d]``), ``k_proj`` and ``v_proj``."""

    def out_rows(self, facts: ModelFacts) -> tuple[int, ...]:
        g, heads, d = facts.query_groups or 0, facts.heads or 0, facts.head_dim or 0
        return 2 * heads * d, g * d, g * d

    def segments(self, facts: ModelFacts) -> list[tuple[int, int, int, int]]:
        g, heads, d = facts.query_groups or 0, facts.heads or 0, facts.head_dim or 0
        if not (g and heads and d) or heads % g:
            raise LayoutError(f"{heads} heads in {g} query groups of dim {d}", culprit="linear_qkv",
                              hint="check --num-heads / --num-query-groups")
        q = heads // g
        out = []
        for i in range(g):
            base = i * (2 * q + 2) * d
            for j in range(q):
                head = i * q + j
                out += [(0, 2 * head * d, base + j * d, d), (0, (2 * head + 1) * d, base + (q + j) * d, d)]
            out += [(1, i * d, base + 2 * q * d, d), (2, i * d, base + (2 * q + 1) * d, d)]
        return out


class InProjQKVZBA(Segments):
    """megatron-core's mixer input projection ``[q; k; v; z; beta; alpha]`` as Qwen3-Next's
    ``in_proj_qkvz`` (per key head ``[q dk; k dk; v r dv; z r dv]``) and ``in_proj_ba`` (per key head
    ``[b r; a r]``): transformers' ``fix_query_key_value_ordering`` undone."""

    def out_rows(self, facts: ModelFacts) -> tuple[int, ...]:
        nk, nv, dk, dv = facts_heads(facts)
        return 2 * nk * dk + 2 * nv * dv, 2 * nv

    def segments(self, facts: ModelFacts) -> list[tuple[int, int, int, int]]:
        nk, nv, dk, dv = facts_heads(facts)
        r = nv // nk
        per_head = 2 * dk + 2 * r * dv
        v0, z0, b0 = 2 * nk * dk, 2 * nk * dk + nv * dv, 2 * nk * dk + 2 * nv * dv
        out = []
        for g in range(nk):
            at = g * per_head
            out += [(0, at, g * dk, dk), (0, at + dk, nk * dk + g * dk, dk),
                    (0, at + 2 * dk, v0 + g * r * dv, r * dv), (0, at + 2 * dk + r * dv, z0 + g * r * dv, r * dv),
                    (1, 2 * g * r, b0 + g * r, r), (1, 2 * g * r + r, b0 + nv + g * r, r)]
        return out


class InProjSplit(Segments):
    """megatron-core's mixer input projection as Qwen3.5's ``in_proj_qkv`` ``[q; k; v]``, ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a``: the same order, one after another."""

    def out_rows(self, facts: ModelFacts) -> tuple[int, ...]:
        nk, nv, dk, dv = facts_heads(facts)
        return 2 * nk * dk + nv * dv, nv * dv, nv, nv

    def segments(self, facts: ModelFacts) -> list[tuple[int, int, int, int]]:
        out, here = [], 0
        for i, rows in enumerate(self.out_rows(facts)):
            out.append((i, 0, here, rows))
            here += rows
        return out


def zero_centred(w: torch.Tensor, name: str) -> torch.Tensor:
    """Import: ``w - 1`` in ``w``'s dtype, refused where ``(w - 1) + 1`` is not ``w`` again (exact for
    every ``w`` in ``[0.5, 2]``: Sterbenz)."""
    out = (w.double() - 1.0).to(w.dtype)
    if not torch.equal((out.double() + 1.0).to(w.dtype), w):
        bad = w[(out.double() + 1.0).to(w.dtype) != w]
        raise CheckpointFormatError(f"holds gated norm weights (e.g. {bad[0].item():g}) whose zero-centred form "
                                    f"w - 1 is not exact in {w.dtype}", culprit=name,
                                    hint="convert a float32 copy of the folder (its w - 1 is exact there)")
    return out


class ZeroCentred(WholeTensorTransform):
    """The mixer's gated norm: transformers scales by ``w``, megatron-core's zero-centred ``out_norm``
    by ``1 + w'``. Import: ``w' = w - 1``, exact or refused (:func:`zero_centred`); export:
    ``w = w' + 1`` rounded to the dtype (a zero-centred weight holds more precision near 0 than
    ``1 + w'`` can: the export's notes say so)."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], shape)]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        return [(t.double() + 1.0).to(t.dtype)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        w = parts[0]
        return Converted(w, lambda t: zero_centred(t, names[0]), tuple(w.shape))


_A = _L + "self_attention."
_GDN = _H + "linear_attn."
#: The names a table spells for a norm the folder names alike in every layer, but megatron-core
#: names by the layer's kind (:meth:`Qwen3NextFamily.table_name`, :meth:`~Qwen3NextFamily.folder_name`).
_VIRTUAL = {_GDN + "input_layernorm.weight": _H + "input_layernorm.weight",
            _H + "mlp.post_attention_layernorm.weight": _H + "post_attention_layernorm.weight"}
_VIRTUAL_RE = [(re.compile(re.escape(v).replace(r"\{layer\}", r"(\d+)") + "$"), r, v) for v, r in _VIRTUAL.items()]


def _names(in_proj: tuple[Any, tuple[str, ...]]) -> NameTable:
    """The name table, the mixer's input projection given (Qwen3-Next's or Qwen3.5's)."""
    transform, hf = in_proj
    return name_table(
        ("embedding.word_embeddings.weight", VocabRows(), ("model.embed_tokens.weight",)),
        ("decoder.final_layernorm.weight", Same(), ("model.norm.weight",)),
        ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
        # norms: by the layer's kind (the folder's one name: _VIRTUAL)
        (_A + "in_proj.layer_norm_weight", Same(), (_GDN + "input_layernorm.weight",)),
        ((_A + "linear_qkv.layer_norm_weight", _L + "input_layernorm.weight"), Same(),
         (_H + "input_layernorm.weight",)),
        (_L + "pre_mlp_layernorm.weight", Same(), (_H + "post_attention_layernorm.weight",)),
        (_L + "mlp.linear_fc1.layer_norm_weight", Same(), (_H + "mlp.post_attention_layernorm.weight",)),
        # the gated DeltaNet mixer
        (_A + "in_proj.weight", transform, tuple(_GDN + n for n in hf), LINEAR),
        (_A + "conv1d.weight", Same(), (_GDN + "conv1d.weight",)),
        (_A + "A_log", Same(), (_GDN + "A_log",)),
        (_A + "dt_bias", Same(), (_GDN + "dt_bias",)),
        (_A + "out_norm.weight", ZeroCentred(), (_GDN + "norm.weight",)),
        (_A + "out_proj.weight", Same(), (_GDN + "out_proj.weight",), LINEAR),
        # gated attention
        (_A + "linear_qkv.weight", GatedQKV(),
         (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"), LINEAR),
        (_A + "linear_proj.weight", Same(), (_H + "self_attn.o_proj.weight",), LINEAR),
        (_A + "q_layernorm.weight", Same(), (_H + "self_attn.q_norm.weight",)),
        (_A + "k_layernorm.weight", Same(), (_H + "self_attn.k_norm.weight",)),
        # dense MLP layers
        (_L + "mlp.linear_fc1.weight", GatedSplit(), (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
         LINEAR),
        (_L + "mlp.linear_fc2.weight", Same(), (_H + "mlp.down_proj.weight",), LINEAR),
        (EXTRA_STATE, None, ()),
    ) + QWEN_ROUTED + QWEN_SHARED


QWEN3_NEXT_NAMES = _names((InProjQKVZBA(), ("in_proj_qkvz.weight", "in_proj_ba.weight")))
QWEN3_5_NAMES = _names((InProjSplit(), ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                        "in_proj_a.weight")))

#: transformers' defaults for what a ``config.json`` may leave out (the classes' own).
_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "max_position_embeddings": 32768, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "partial_rotary_factor": 0.25, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


def layer_types(c: Mapping[str, Any], layers: int, where: str) -> list[str]:
    """``layer_types`` (default: every ``full_attention_interval``-th layer, 4, attends fully)."""
    types = c.get("layer_types")
    if types is None:
        every = c.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(layers)]
    if len(types) != layers or any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in types):
        raise CheckpointFormatError(f"layer_types {types!r} is not {layers} of {LINEAR_ATTENTION!r} / "
                                    f"{FULL_ATTENTION!r}", culprit=where,
                                    hint="check layer_types against num_hidden_layers")
    return list(types)


def linear_attention_freq(types: Sequence[str]) -> int | list[int]:
    """megatron-core's ``linear_attention_freq`` for ``layer_types``: ``N`` where every ``N``-th layer
    (from 1) attends fully and the others are DeltaNet layers (``get_linear_attention_pattern``), else
    one flag per layer (1: a DeltaNet layer)."""
    flags = [int(t == LINEAR_ATTENTION) for t in types]
    for n in range(1, len(flags) + 1):
        if flags == [0 if (i + 1) % n == 0 else 1 for i in range(len(flags))]:
            return n
    return flags


def linear_flags(args: Any, layers: int) -> list[int]:
    """The args' DeltaNet layers, one flag per layer (megatron-core's ``get_linear_attention_pattern``)."""
    freq = saved_arg(args, "linear_attention_freq")
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [0 if (i + 1) % freq == 0 else 1 for i in range(layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == layers:
        return [int(bool(f)) for f in freq]
    raise not_exact(f"args.linear_attention_freq {freq!r} (an int or one flag per layer of {layers})")


class Qwen3NextFamily(HFArchitectureFamily):
    """What the three classes share: the ``config.json`` reading, the export's checks, the norms'
    names by layer kind. A subclass says its class, name table and MoE layers."""

    priority = 0
    names: NameTable = QWEN3_NEXT_NAMES
    model_type = ""
    #: Whether the class's layers may be MoE layers (``"some"``: Qwen3-Next's, by
    #: ``mlp_only_layers``/``decoder_sparse_step``), must be (``"all"``) or are not (``"none"``).
    moe = "some"

    # -- import ---------------------------------------------------------------------------------
    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}
        refuse, need = import_refusal(self.name, where), config_int(c, where)
        if c["hidden_act"] != "silu":
            raise refuse(f"activation {c['hidden_act']} (megatron-core's SwiGLU and its mixer's conv are silu)")
        if c["attention_bias"]:
            raise refuse("attention biases (megatron-core gives biases to every linear layer or the QKV alone)")
        base, rope_type, partial = rope_of(c)
        if rope_type != "default":
            raise refuse(f"rotary scaling {rope_type}")
        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        groups, head_dim = c.get("num_key_value_heads") or heads, need("head_dim")
        if (head_dim * partial) % 2:
            raise refuse(f"partial_rotary_factor {partial} of head_dim {head_dim} (not an even number of dims)")
        types = layer_types(c, layers, where)
        heads_of = {a: need(a) for a in HEAD_ARGS}
        if heads_of["linear_num_value_heads"] % heads_of["linear_num_key_heads"]:
            raise CheckpointFormatError("linear_num_value_heads is no multiple of linear_num_key_heads",
                                        culprit=where, hint="check config.json")
        moe_layers = self._moe_layers(c, layers, need, where)
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True, apply_layernorm_1p=True,
            position_embedding_type="rope", rotary_base=base, rotary_percent=partial, rotary_interleaved=False,
            add_bias_linear=False, add_qkv_bias=False, max_position_embeddings=need("max_position_embeddings"),
            qk_layernorm=True, attention_output_gate=True, experimental_attention_variant=VARIANT,
            linear_attention_freq=linear_attention_freq(types), linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            **heads_of)
        if any(moe_layers):
            arch_args.update(megatron_moe_args(need("num_experts"), need("moe_intermediate_size"),
                                               need("shared_expert_intermediate_size"), not c["norm_topk_prob"],
                                               moe_layers, need, refuse))
        ffn = c["intermediate_size"] if isinstance(c.get("intermediate_size"), int) else need("moe_intermediate_size")
        model = megatron_model(self.name, self.names, vocab=need("vocab_size"), hidden=hidden, layers=layers,
                               heads=heads, groups=groups, head_dim=head_dim, ffn=ffn,
                               tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)
        model.args.transformer_impl = "transformer_engine"  # the only spec megatron-core builds these layers with
        own = {LINEAR_HEADS: heads_of, LINEAR_LAYERS: [i for i, t in enumerate(types) if t == LINEAR_ATTENTION],
               DENSE_LAYERS: [i for i, m in enumerate(moe_layers) if not m]}
        return dataclasses.replace(model, facts=dataclasses.replace(model.facts, family_facts=own))

    def _moe_layers(self, c: Mapping[str, Any], layers: int, need: Callable[..., int], where: str) -> list[int]:
        """One flag per layer (1: MoE), as the class builds its layers."""
        if self.moe == "none":
            return [0] * layers
        if self.moe == "all":
            return [1] * layers
        step, dense = need("decoder_sparse_step"), set(c.get("mlp_only_layers") or ())
        if step < 1:
            raise CheckpointFormatError(f"decoder_sparse_step is {step}", culprit=where, hint="check config.json")
        experts = c.get("num_experts") or 0
        return [int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(layers)]

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """The release's multi-token prediction layers (``mtp.*``, ``mtp_num_hidden_layers``): not
        imported, as transformers does not load them (``_keys_to_ignore_on_load_unexpected``)."""
        declared = config.get("mtp_num_hidden_layers")
        if not isinstance(declared, int) or declared <= 0:
            return []
        return [f"mtp_num_hidden_layers {declared}: the folder's multi-token prediction weights (mtp.*) are not "
                f"imported (transformers' {self.name} does not load them either)"]

    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        if name.startswith(MTP_PREFIX):
            return None  # the release's multi-token prediction layers: see import_warnings
        m = re.match(r"^model\.layers\.(\d+)\.(input|post_attention)_layernorm\.weight$", name)
        if m is None:
            return name
        layer, which = int(m.group(1)), m.group(2)
        own = facts.family_facts
        if which == "input" and layer in own.get(LINEAR_LAYERS, ()):
            return f"{_GDN.format(layer=layer)}input_layernorm.weight"
        if which == "post_attention" and layer in own.get(DENSE_LAYERS, ()):
            return f"{_H.format(layer=layer)}mlp.post_attention_layernorm.weight"
        return name

    def folder_name(self, name: str, facts: ModelFacts) -> str:
        for rx, real, _ in _VIRTUAL_RE:
            m = rx.match(name)
            if m:
                return real.format(layer=m.group(1))
        return name

    # -- export ---------------------------------------------------------------------------------
    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model with gated DeltaNet layers whose MLPs this class builds: its ``config.json``, or the
        refusal of what it does not compute; None for any other model."""
        if not any(k.endswith(".self_attention.in_proj.weight") for k in keys):
            return None
        config, moe_layers = self.shared_config(args, facts, keys, dtype, widths)
        if not self._builds(moe_layers):
            return None
        return self._decided(config, moe_layers)

    def _builds(self, moe_layers: list[int]) -> bool:
        return {"none": not any(moe_layers), "all": all(moe_layers), "some": any(moe_layers)}[self.moe]

    def _decided(self, config: dict[str, Any], moe_layers: list[int]) -> HFArchitecture:
        out = {"architectures": [self.name], "model_type": self.model_type, **config}
        if self.moe == "some":
            out.update(decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(moe_layers) if not m])
        elif self.moe == "all" and not out.get("norm_topk_prob", True):
            raise not_exact(f"top-k scores not renormalized ({self.name} renormalizes them)")
        if self.moe != "some":
            out.pop("norm_topk_prob", None)
        linear = sum(t == LINEAR_ATTENTION for t in config["layer_types"])
        note = ("linear_attn.norm.weight is 1 + megatron-core's zero-centred out_norm.weight, rounded to the "
                "weights' dtype (a zero-centred weight holds more precision near 0; exact for the weights an import "
                "wrote)")
        return HFArchitecture(name=self.name, config=out, names=self.names, notes=(note,),
                              reason=f"{linear} gated DeltaNet and {len(config['layer_types']) - linear} gated "
                                     "attention layers" + (f", {config['num_experts']} experts and a gated shared "
                                                           "expert per MoE layer" if any(moe_layers) else ""))

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        """Another of the three classes' version of the model: its name table, its ``config.json``
        (refused where its MLPs differ)."""
        family = decided.family
        if not isinstance(family, Qwen3NextFamily) or "layer_types" not in decided.config:
            return HFArchitectureFamily.export(self, decided)
        config = {k: v for k, v in decided.config.items() if k not in ("architectures", "model_type",
                                                                      "decoder_sparse_step", "mlp_only_layers")}
        layers = config["num_hidden_layers"]
        dense = set(decided.config.get("mlp_only_layers") or ()) if config.get("num_experts") else set(range(layers))
        moe_layers = [int(i not in dense) for i in range(layers)]
        if not self._builds(moe_layers):
            return HFArchitectureFamily.export(self, decided)
        config.setdefault("norm_topk_prob", True)
        return self._decided(config, moe_layers)

    def shared_config(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                      widths: Mapping[str, int]) -> tuple[dict[str, Any], list[int]]:
        """The ``config.json`` entries the three classes share and the MoE layers (one flag per
        layer), or the refusal of what none of them computes."""
        layers = facts.num_layers
        for flag, what in (*NOT_EXPORTED_FLAGS, ("multi_latent_attention", "multi-latent attention"),
                           ("squared_relu", "squared ReLU")):
            if flag != "apply_layernorm_1p" and saved_arg(args, flag, default=False):
                raise not_exact(f"{what} ({flag})")
        wants = {"experimental_attention_variant": VARIANT, "attention_output_gate": True, "apply_layernorm_1p": True,
                 "normalization": "RMSNorm", "position_embedding_type": "rope", "qk_layernorm": True}
        for arg, value in wants.items():
            if saved_arg(args, arg) != value:
                raise not_exact(f"args.{arg} is {saved_arg(args, arg)!r} (Qwen3-Next and Qwen3.5: {value!r})")
        if not facts.swiglu:
            raise not_exact("the MLP is not SwiGLU")
        if saved_arg(args, "window_size") is not None:
            raise not_exact("a sliding window (Qwen3-Next and Qwen3.5 attend fully)")
        biased = sorted(k for k in keys if re.search(r"\.(?:bias\d*|expert_bias)$", k))
        if biased:
            raise not_exact(f"biases ({biased[0]}; Qwen3-Next and Qwen3.5 have none)")
        if facts.heads is None or facts.query_groups is None or facts.head_dim is None or facts.hidden is None:
            raise not_exact("heads, query groups or head dim unknown (give --num-heads / --num-query-groups)")
        flags = linear_flags(args, layers)
        held = {stack_layer(k) for k in keys if k.endswith(".self_attention.in_proj.weight")}
        if held != {i for i, f in enumerate(flags) if f}:
            raise not_exact(f"args.linear_attention_freq {saved_arg(args, 'linear_attention_freq')!r} contradicts the "
                            f"gated DeltaNet layers the tensors hold ({sorted(held)})")
        nk, nv, dk, dv = facts_heads(facts)
        partial = float(saved_arg(args, "rotary_percent", default=1.0))
        base = float(saved_arg(args, "rotary_base", default=10000.0))
        eps = float(saved_arg(args, "norm_epsilon", default=1e-5))
        moe_layers = [0] * layers
        for k in keys:
            if k.endswith(".mlp.router.weight"):
                moe_layers[stack_layer(k)] = 1  # type: ignore[index]
        config: dict[str, Any] = {
            "vocab_size": facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source,
            "hidden_size": facts.hidden,
            "intermediate_size": widths.get("dense") or saved_arg(args, "ffn_hidden_size") or widths.get("expert"),
            "num_hidden_layers": layers, "num_attention_heads": facts.heads,
            "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim, "hidden_act": "silu",
            "rms_norm_eps": eps, "attention_bias": False, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": partial},
            "max_position_embeddings": saved_arg(args, "max_position_embeddings", "seq_length"),
            "layer_types": [LINEAR_ATTENTION if f else FULL_ATTENTION for f in flags],
            "linear_conv_kernel_dim": int(saved_arg(args, "linear_conv_kernel_dim", default=4)),
            "linear_key_head_dim": dk, "linear_value_head_dim": dv, "linear_num_key_heads": nk,
            "linear_num_value_heads": nv, "tie_word_embeddings": bool(facts.tied_embeddings),
            "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "use_cache": True}
        if any(moe_layers):
            config.update(self._routing(args, keys, moe_layers, widths))
        return config, moe_layers

    @staticmethod
    def _routing(args: Any, keys: set[str], moe_layers: list[int], widths: Mapping[str, int]) -> dict[str, Any]:
        """``config.json``'s MoE entries, or the refusal of routing the classes do not compute."""
        if saved_arg(args, "moe_router_score_function", default="softmax") != "softmax":
            raise not_exact("router scores not by softmax (Qwen3-Next routes on the softmax of the logits)")
        for flag, what in (("moe_router_enable_expert_bias", "a router expert bias"),
                           ("moe_router_num_groups", "group-limited routing"),
                           ("moe_expert_capacity_factor", "token dropping (expert capacity)"),
                           ("moe_input_jitter_eps", "router input jitter")):
            if saved_arg(args, flag):
                raise not_exact(f"{what} ({flag})")
        if saved_arg(args, "moe_router_topk_scaling_factor", default=1.0) not in (None, 1.0):
            raise not_exact("scaled routing weights (moe_router_topk_scaling_factor)")
        topk = saved_arg(args, "moe_router_topk")
        if not isinstance(topk, int):
            raise not_exact("the router's top-k is unknown (the saved args lack moe_router_topk)")
        for i, m in enumerate(moe_layers):
            if m and not all(f"decoder.layers.{i}.mlp.shared_experts.{n}" in keys
                             for n in ("linear_fc1.weight", "gate_weight")):
                raise not_exact(f"layer {i}'s MoE without a gated shared expert (Qwen3-Next has one in each)")
        experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
        return {"num_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": widths.get("expert"),
                "shared_expert_intermediate_size": widths.get("shared"),
                "norm_topk_prob": not saved_arg(args, "moe_router_pre_softmax", default=False),
                "output_router_logits": False, "router_aux_loss_coef": 0.0}


class Qwen3NextForCausalLM(Qwen3NextFamily):
    """transformers' ``Qwen3NextForCausalLM``: MoE layers (dense ones by ``mlp_only_layers``), the
    mixer's projections fused per key head."""

    name = "Qwen3NextForCausalLM"
    model_types = ("qwen3_next",)
    model_type = "qwen3_next"
    names = QWEN3_NEXT_NAMES
    moe = "some"


class Qwen3_5ForCausalLM(Qwen3NextFamily):
    """transformers' ``Qwen3_5ForCausalLM`` (the text model): dense MLPs, the mixer's projections apart."""

    name = "Qwen3_5ForCausalLM"
    model_types = ("qwen3_5_text",)
    model_type = "qwen3_5_text"
    names = QWEN3_5_NAMES
    moe = "none"


class Qwen3_5MoeForCausalLM(Qwen3NextFamily):
    """transformers' ``Qwen3_5MoeForCausalLM`` (the text model): every layer MoE with a gated shared
    expert, top-k renormalized, the mixer's projections apart. A model Qwen3-Next's class also
    computes is exported as Qwen3-Next's unless ``--hf-architecture`` names this class."""

    name = "Qwen3_5MoeForCausalLM"
    model_types = ("qwen3_5_moe_text",)
    model_type = "qwen3_5_moe_text"
    names = QWEN3_5_NAMES
    moe = "all"

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        return super().read_config({**config, "norm_topk_prob": True}, where)  # its router always renormalizes

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        return None  # Qwen3-Next's class claims every such model first


QWEN3_NEXT = Qwen3NextForCausalLM()
QWEN3_5 = Qwen3_5ForCausalLM()
QWEN3_5_MOE = Qwen3_5MoeForCausalLM()
