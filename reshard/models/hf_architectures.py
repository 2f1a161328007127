"""Hugging Face architectures a megatron-core GPT model maps onto *exactly*, and the name table of
each: which ``transformers`` class computes the same function from the same tensors, its
``config.json``, and where every megatron-core tensor's bytes go in the Hugging Face tensors —
and back: each transform owns both directions (export: byte runs or a whole-tensor conversion;
import: the megatron-core tensor as a lazy view of the Hugging Face ones, :meth:`Transform.gather`).

Pure: no files, no torch I/O. The ``hf`` format (:mod:`reshard.formats.hf`) streams the bytes.

Architectures (decided by :func:`decide_architecture` from the saved ``args`` and the tensors
present; anything else is refused with what differs — never an approximate export):

=======================  =========================================================================
architecture             megatron-core model
=======================  =========================================================================
``LlamaForCausalLM``     RMSNorm, SwiGLU, rotary (whole head, not interleaved, no scaling), no
                         linear biases — or biases on every linear layer (``attention_bias``,
                         ``mlp_bias``)
``MistralForCausalLM``   Llama's without biases, with megatron-core's sliding window on every layer
                         (``window_size`` ``(W - 1, 0)``: ``sliding_window`` W; decided by its
                         architecture, :func:`sliding_window`)
``Qwen2ForCausalLM``     the same with biases on the fused QKV only (``--add-qkv-bias``)
``GPT2LMHeadModel``      LayerNorm, GELU (exact; ``gelu_new`` with ``--openai-gelu``), learned
                         absolute positions, biases on every linear layer, multi-head attention
                         (legacy Megatron GPT, megatron-core's GPT with those settings)
``MixtralForCausalLM``   Llama's, every MLP a MoE layer (softmax top-k renormalized), no shared
                         expert
``Qwen2MoeForCausalLM``  Llama's or Qwen2's, MoE layers with one sigmoid-gated shared expert,
                         dense layers allowed (``mlp_only_layers``)
``Qwen3ForCausalLM``     Llama's with query/key RMSNorm per head (``--qk-layernorm``), biases on
                         the attention layers (all four) or none
``Qwen3MoeForCausalLM``  Qwen3's, MoE layers without a shared expert, dense layers allowed
=======================  =========================================================================

Tensor transforms (one class each, owning its byte mapping; rows are the leading dim):

==================  =====================================  ========================================
kind                megatron-core tensor                   Hugging Face tensors
==================  =====================================  ========================================
:class:`Same`       any ``[r, ...]``                       one tensor, same bytes
:class:`VocabRows`  ``[padded_vocab, h]``                  ``[vocab, h]``: the first ``vocab`` rows
:class:`QKVSplit`   ``[g * (q + 2) * d, ...]`` per group:  ``q_proj [g*q*d, ...]``, ``k_proj
                    ``q*d`` query rows, ``d`` key rows,    [g*d, ...]``, ``v_proj [g*d, ...]``
                    ``d`` value rows
:class:`GatedSplit` ``[2 * f, h]`` = ``[gate; up]``        ``gate_proj [f, h]``, ``up_proj [f, h]``
:class:`Conv1D`     ``[out, in]``                          ``[in, out]`` (GPT-2's ``Conv1D``; whole)
:class:`GPT2QKV`    ``[heads * 3 * d, h]`` per head q,k,v  ``c_attn [h, 3 * heads * d]``: all q, all
                                                           k, all v, transposed (whole)
==================  =====================================  ========================================

"whole": a transpose is no byte run, so that one tensor is read into memory, then written.

(``g`` query groups, ``q`` query heads per group, ``d`` head dim, ``f`` FFN width.) megatron-core's
rotary embedding rotates the two halves of each head (``rotate_half``), as transformers' Llama
does, so no row permutation is needed.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lazy import Converted, LazyTensor, RowConcat
from reshard.core.plan_types import ModelFacts
from reshard.core.rules import layer_index
from reshard.models.facts import saved_arg
from reshard.models.megatron_gpt import core_name, expert_index, experts_per_layer

#: megatron-core's defaults for what Megatron-LM's ``args`` may not record.
ROPE_BASE_DEFAULT = 10000.0
NORM_EPS_DEFAULT = 1e-5


@dataclass(frozen=True)
class Run:
    """Bytes ``[src, src + length)`` of the megatron-core tensor go to output ``out`` at byte ``dst``."""

    src: int
    length: int
    out: int
    dst: int


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]


class Transform(abc.ABC):
    """How one megatron-core tensor becomes Hugging Face tensors (``names``: theirs, filled in)."""

    @abc.abstractmethod
    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        """The Hugging Face tensors (names and shapes) made from a megatron-core tensor of ``shape``."""

    @abc.abstractmethod
    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        """Import: the megatron-core tensor made from the Hugging Face tensors ``parts`` (called
        ``names``, in :meth:`outputs` order), read lazily; :class:`CheckpointFormatError` naming them
        if their shapes disagree with each other or the config."""

    #: The name field that numbers the many megatron-core tensors this transform makes *one*
    #: Hugging Face tensor of, each a slab of a new leading axis (:mod:`reshard.models.stacked`;
    #: the Hugging Face name lacks the field); None: each tensor has Hugging Face tensors of its own.
    stacks: str | None = None

    def fan_out(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> list[LazyTensor]:
        """Import of a transform that :attr:`stacks`: the megatron-core tensors numbered ``0 ..``, each
        a lazy view of its slab of the Hugging Face tensor ``parts[0]``."""
        raise TypeError(f"{type(self).__name__} stacks no tensors")

    def copies(self, keys: Collection[str]) -> int:
        """How many times the export writes the tensor's bytes, in a model of megatron-core names
        ``keys`` (what ``--max-shard-size`` counts before the model's facts are decided). Default: once."""
        return 1


class ByteTransform(Transform):
    """A transform that only moves bytes: streamed, nothing held in memory."""

    @abc.abstractmethod
    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        """Where each byte range of the megatron-core tensor goes (bytes no run covers are dropped)."""


class WholeTensorTransform(Transform):
    """A transform that needs the whole tensor (a transpose): it is read into memory, one at a time."""

    @abc.abstractmethod
    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        """The outputs, in :meth:`outputs` order."""


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


def _expect_rows(names: tuple[str, ...], parts: Sequence[LazyTensor], rows: tuple[int, ...]) -> None:
    """Import: the Hugging Face tensors fused into one must have these rows and agree otherwise."""
    got = tuple(p.shape[0] if p.shape else 0 for p in parts)
    rest = {tuple(p.shape[1:]) for p in parts}
    if got != rows or len(rest) != 1 or len({p.dtype for p in parts}) != 1:
        shapes = ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in parts)
        raise CheckpointFormatError(f"are {shapes}; config.json implies {rows} rows and the rest alike",
                                    culprit=", ".join(names), hint="check config.json against the weights")


class Same(ByteTransform):
    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], shape)]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, shape[0] * _row_bytes(shape, itemsize), 0, 0)] if shape else [Run(0, itemsize, 0, 0)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        return parts[0]


class VocabRows(ByteTransform):
    """The true vocabulary's rows: Megatron's padding rows are dropped."""

    @staticmethod
    def rows(shape: tuple[int, ...], facts: ModelFacts) -> int:
        return min(facts.vocab_size, shape[0]) if facts.vocab_size else shape[0]

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (self.rows(shape, facts), *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, self.rows(shape, facts) * _row_bytes(shape, itemsize), 0, 0)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        return parts[0]  # the true rows: the planner pads them as Megatron does (``vocab_divisor``)


class QKVSplit(ByteTransform):
    """megatron-core's fused QKV (grouped per query group) as separate Q, K and V projections."""

    @staticmethod
    def _dims(shape: tuple[int, ...], facts: ModelFacts) -> tuple[int, int, int]:
        g, heads, d = facts.query_groups, facts.heads, facts.head_dim
        if not (g and heads and d) or heads % g or shape[0] != (heads + 2 * g) * d:
            raise LayoutError(f"fused QKV of {shape[0]} rows does not match {heads} heads in {g} groups of "
                              f"dim {d}", culprit="linear_qkv", hint="check --num-heads / --num-query-groups")
        return g, heads // g, d

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        g, q, d = self._dims(shape, facts)
        rest = shape[1:]
        return [OutTensor(names[0], (g * q * d, *rest)), OutTensor(names[1], (g * d, *rest)),
                OutTensor(names[2], (g * d, *rest))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        g, q, d = self._dims(shape, facts)
        row = _row_bytes(shape, itemsize)
        out = []
        for i in range(g):
            base = i * (q + 2) * d * row
            out += [Run(base, q * d * row, 0, i * q * d * row),
                    Run(base + q * d * row, d * row, 1, i * d * row),
                    Run(base + (q + 1) * d * row, d * row, 2, i * d * row)]
        return out

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        q_, k_, v_ = parts
        g, heads, d = facts.query_groups or 0, facts.heads or 0, facts.head_dim or 0
        _expect_rows(names, parts, (heads * d, g * d, g * d))
        q = heads // g
        return RowConcat([seg for i in range(g)
                          for seg in ((q_, i * q * d, q * d), (k_, i * d, d), (v_, i * d, d))])


class GatedSplit(ByteTransform):
    """SwiGLU's fused first MLP layer ``[gate; up]`` as its two projections."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        f = shape[0] // 2
        return [OutTensor(names[0], (f, *shape[1:])), OutTensor(names[1], (f, *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        half = shape[0] // 2 * _row_bytes(shape, itemsize)
        return [Run(0, half, 0, 0), Run(half, half, 1, 0)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        gate, up = parts
        _expect_rows(names, parts, (gate.shape[0], gate.shape[0]))
        return RowConcat([(gate, 0, gate.shape[0]), (up, 0, up.shape[0])])


class Conv1D(WholeTensorTransform):
    """GPT-2's ``Conv1D`` weights are stored ``[in, out]``: the transpose of a linear layer's.
    Whole-tensor (a transpose is no byte run): the tensor is read once, in memory, then written."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (shape[1], shape[0]))]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        return [t.t().contiguous()]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        w = parts[0]
        return Converted(w, lambda t: t.t().contiguous(), (w.shape[1], w.shape[0]))


class GPT2QKV(WholeTensorTransform):
    """megatron-core's fused QKV of multi-head attention (``[heads, 3, d]`` rows) as GPT-2's
    ``c_attn``: ``[3, heads, d]`` rows (all queries, all keys, all values), a weight transposed."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (shape[1], shape[0]) if len(shape) == 2 else shape)]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        heads = facts.heads or 0
        if not heads or t.shape[0] % (3 * heads):
            raise LayoutError(f"fused QKV of {t.shape[0]} rows is not 3 x {heads} heads", culprit="linear_qkv",
                              hint="check --num-heads")
        rows = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return [rows.t().contiguous() if t.dim() == 2 else rows.contiguous()]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        c_attn, heads = parts[0], facts.heads or 0
        fused = c_attn.shape[-1]
        if not heads or fused % (3 * heads):
            raise CheckpointFormatError(f"width {fused} is not 3 x {heads} heads", culprit=names[0],
                                        hint="check n_head in config.json")

        def to_core(t: torch.Tensor) -> torch.Tensor:
            rows = t.t() if t.dim() == 2 else t  # [3 * heads * d, ...]: all q, all k, all v
            return rows.reshape(3, heads, fused // (3 * heads), *rows.shape[1:]).transpose(0, 1) \
                .reshape(rows.shape).contiguous()

        shape = (fused, c_attn.shape[0]) if len(c_attn.shape) == 2 else c_attn.shape
        return Converted(c_attn, to_core, shape)


_FIELDS = {"layer": r"(?P<layer>\d+)", "expert": r"(?P<expert>\d+)", "p": r"(?P<p>weight|bias)",
           "prefix": r"(?P<prefix>(?:.+\.)?)"}


def _pattern(template: str) -> re.Pattern[str]:
    """A name template (``decoder.layers.{layer}.x.{p}``) as the regex that matches its names."""
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("^" + "".join(_FIELDS[x] if i % 2 else re.escape(x) for i, x in enumerate(parts)) + "$")


@dataclass(frozen=True)
class NameRow:
    """One row of a name table: the megatron-core names (``core[0]`` is the one an import writes:
    the local spec's; the others are Transformer Engine's fused names), the transform (None: the
    entry holds no weights and is not exported), the Hugging Face names in the transform's order."""

    core: tuple[str, ...]
    transform: ByteTransform | WholeTensorTransform | None
    hf: tuple[str, ...]
    #: A linear layer's weight (attention, dense MLP, routed and shared experts): what ``--quantize
    #: fp8`` encodes. Not embeddings, the output layer, norms, routers or a shared expert's gate,
    #: which vLLM and transformers keep in the model's dtype.
    linear: bool = False

    @functools.cached_property
    def core_patterns(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_pattern(t) for t in self.core)

    @functools.cached_property
    def hf_patterns(self) -> tuple[re.Pattern[str], ...]:
        return tuple(_pattern(t) for t in self.hf)


NameTable = tuple[NameRow, ...]


#: The last element of a :func:`name_table` row whose weights are a linear layer's (:attr:`NameRow.linear`).
LINEAR = "linear"


def name_table(*rows: tuple[Any, ...]) -> NameTable:
    """A :data:`NameTable` from rows ``(core, transform, hf)``, or ``(core, transform, hf, LINEAR)``
    for a linear layer (``core``: one megatron-core name or a tuple of its spellings); an
    architecture defined in another module (DeepSeek's) writes its table with it too."""
    return tuple(NameRow(core if isinstance(core, tuple) else (core,), transform, hf, rest == [LINEAR])
                 for core, transform, hf, *rest in map(tuple, rows))


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_EXTRA_STATE = "{prefix}_extra_state"
#: megatron-core names (local spec first, then Transformer Engine's) <-> Hugging Face names
#: (Llama / Qwen2).
LLAMA_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", VocabRows(), ("model.embed_tokens.weight",)),
    ((_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"), Same(),
     (_H + "input_layernorm.weight",)),
    (_L + "self_attention.linear_qkv.{p}", QKVSplit(),
     (_H + "self_attn.q_proj.{p}", _H + "self_attn.k_proj.{p}", _H + "self_attn.v_proj.{p}"), LINEAR),
    (_L + "self_attention.linear_proj.{p}", Same(), (_H + "self_attn.o_proj.{p}",), LINEAR),
    ((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"), Same(),
     (_H + "post_attention_layernorm.weight",)),
    (_L + "mlp.linear_fc1.{p}", GatedSplit(), (_H + "mlp.gate_proj.{p}", _H + "mlp.up_proj.{p}"), LINEAR),
    (_L + "mlp.linear_fc2.{p}", Same(), (_H + "mlp.down_proj.{p}",), LINEAR),
    ("decoder.final_layernorm.weight", Same(), ("model.norm.weight",)),
    ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
    (_EXTRA_STATE, None, ()),
)


_G = "transformer.h.{layer}."
#: megatron-core names <-> GPT-2 names (``GPT2LMHeadModel``; its linear layers are ``Conv1D``).
GPT2_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", VocabRows(), ("transformer.wte.weight",)),
    ("embedding.position_embeddings.weight", Same(), ("transformer.wpe.weight",)),
    ((_L + "input_layernorm.{p}", _L + "self_attention.linear_qkv.layer_norm_{p}"), Same(), (_G + "ln_1.{p}",)),
    (_L + "self_attention.linear_qkv.weight", GPT2QKV(), (_G + "attn.c_attn.weight",)),
    (_L + "self_attention.linear_qkv.bias", GPT2QKV(), (_G + "attn.c_attn.bias",)),
    (_L + "self_attention.linear_proj.weight", Conv1D(), (_G + "attn.c_proj.weight",)),
    (_L + "self_attention.linear_proj.bias", Same(), (_G + "attn.c_proj.bias",)),
    ((_L + "pre_mlp_layernorm.{p}", _L + "mlp.linear_fc1.layer_norm_{p}"), Same(), (_G + "ln_2.{p}",)),
    (_L + "mlp.linear_fc1.weight", Conv1D(), (_G + "mlp.c_fc.weight",)),
    (_L + "mlp.linear_fc1.bias", Same(), (_G + "mlp.c_fc.bias",)),
    (_L + "mlp.linear_fc2.weight", Conv1D(), (_G + "mlp.c_proj.weight",)),
    (_L + "mlp.linear_fc2.bias", Same(), (_G + "mlp.c_proj.bias",)),
    ("decoder.final_layernorm.{p}", Same(), ("transformer.ln_f.{p}",)),
    ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
    (_EXTRA_STATE, None, ()),
)
_E = "mlp.experts."
#: A routed expert's megatron-core names: SequentialMLP's, then grouped GEMM's.
_FC1 = (_L + _E + "local_experts.{expert}.linear_fc1.weight", _L + _E + "linear_fc1.weight{expert}")
_FC2 = (_L + _E + "local_experts.{expert}.linear_fc2.weight", _L + _E + "linear_fc2.weight{expert}")
#: megatron-core MoE layers <-> Mixtral's (``block_sparse_moe``: router ``gate``, experts' ``w1`` gate,
#: ``w3`` up and ``w2`` down projections), on top of Llama's names.
MIXTRAL_NAMES: NameTable = LLAMA_NAMES + name_table(
    (_L + "mlp.router.weight", Same(), (_H + "block_sparse_moe.gate.weight",)),
    (_FC1, GatedSplit(), (_H + "block_sparse_moe.experts.{expert}.w1.weight",
                          _H + "block_sparse_moe.experts.{expert}.w3.weight"), LINEAR),
    (_FC2, Same(), (_H + "block_sparse_moe.experts.{expert}.w2.weight",), LINEAR),
)
#: A megatron-core MoE layer's router and routed experts <-> Qwen-MoE's (router ``mlp.gate``,
#: ``mlp.experts.{e}.*_proj``).
_QWEN_ROUTED: NameTable = name_table(
    (_L + "mlp.router.weight", Same(), (_H + "mlp.gate.weight",)),
    (_FC1, GatedSplit(), (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
     LINEAR),
    (_FC2, Same(), (_H + "mlp.experts.{expert}.down_proj.weight",), LINEAR),
)
#: megatron-core MoE layers <-> Qwen2-MoE's: the routed experts, one shared expert and its sigmoid
#: gate, on top of Llama's names (its dense layers).
QWEN2_MOE_NAMES: NameTable = LLAMA_NAMES + _QWEN_ROUTED + name_table(
    (_L + "mlp.shared_experts.linear_fc1.weight", GatedSplit(),
     (_H + "mlp.shared_expert.gate_proj.weight", _H + "mlp.shared_expert.up_proj.weight"), LINEAR),
    (_L + "mlp.shared_experts.linear_fc2.weight", Same(), (_H + "mlp.shared_expert.down_proj.weight",), LINEAR),
    (_L + "mlp.shared_experts.gate_weight", Same(), (_H + "mlp.shared_expert_gate.weight",)),
)
#: Qwen3's query/key layer norms (RMSNorm over each head's dims, before the rotary embedding), on
#: top of Llama's names.
QWEN3_NAMES: NameTable = LLAMA_NAMES + name_table(
    (_L + "self_attention.q_layernorm.weight", Same(), (_H + "self_attn.q_norm.weight",)),
    (_L + "self_attention.k_layernorm.weight", Same(), (_H + "self_attn.k_norm.weight",)),
)
#: megatron-core MoE layers <-> Qwen3-MoE's: Qwen2-MoE's router and experts, no shared expert.
QWEN3_MOE_NAMES: NameTable = QWEN3_NAMES + _QWEN_ROUTED
#: The built-in architectures' name tables, both directions (the built-ins of
#: :mod:`reshard.models.hf_registry` are made from them; a plug-in brings its own).
NAME_TABLES = {"LlamaForCausalLM": LLAMA_NAMES, "Qwen2ForCausalLM": LLAMA_NAMES, "MistralForCausalLM": LLAMA_NAMES,
               "GPT2LMHeadModel": GPT2_NAMES,
               "MixtralForCausalLM": MIXTRAL_NAMES, "Qwen2MoeForCausalLM": QWEN2_MOE_NAMES,
               "Qwen3ForCausalLM": QWEN3_NAMES, "Qwen3MoeForCausalLM": QWEN3_MOE_NAMES}


#: Multi-token prediction layers in a name table: Hugging Face folders hold them as decoder layers
#: after the model's own (DeepSeek's ``model.layers.{num_hidden_layers + i}``), which a table's
#: templates cannot count; its rows name them ``model.mtp_layers.{i}`` instead, renamed both ways
#: here. Each also holds copies of the shared embedding and output layer (not imported).
MTP_HF = "model.mtp_layers."
MTP_SHARED_COPIES = re.compile(r"^model\.mtp_layers\.\d+\.(?:embed_tokens|shared_head\.head)\.weight$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_NAME = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def mtp_to_hf(name: str, num_layers: int) -> str:
    """A table's ``model.mtp_layers.{i}.`` name as the folder's ``model.layers.{num_layers + i}.``."""
    return _MTP_NAME.sub(lambda m: f"model.layers.{num_layers + int(m.group(1))}.", name, count=1)


def hf_to_mtp(name: str, num_layers: int) -> str:
    """A folder's layer beyond the model's ``num_layers`` under the table's ``model.mtp_layers.`` name."""
    m = _HF_LAYER.match(name)
    if m is None or int(m.group(1)) < num_layers:
        return name
    return f"{MTP_HF}{int(m.group(1)) - num_layers}.{name[m.end():]}"


def linear_weight(key: str, tables: Sequence[NameTable]) -> bool:
    """Whether megatron-core (or legacy Megatron) parameter ``key`` is a linear layer's weight in
    ``tables`` (:attr:`NameRow.linear`): the bytes ``--quantize fp8`` encodes, known before the
    architecture is decided (the built-in tables agree on every row they share)."""
    if not re.search(r"\.weight\d*$", key):
        return False
    with contextlib.suppress(LayoutError):  # a legacy name; a megatron-core name has no legacy pattern
        key = core_name(key)
    return any(row.linear and any(p.match(key) for p in row.core_patterns) for table in tables for row in table)


@dataclass(frozen=True)
class Export:
    """One megatron-core tensor's Hugging Face outputs and byte runs (empty: not exported)."""

    key: str
    outputs: tuple[OutTensor, ...] = ()
    runs: tuple[Run, ...] = ()
    #: whole-tensor transforms (a transpose): the outputs from the tensor itself, else None
    convert: Any = None
    #: the outputs are a linear layer's weights (:attr:`NameRow.linear`), each ``[out, in]``
    linear: bool = False
    #: a transform that :attr:`~Transform.stacks`: this tensor is slab ``part`` of its one output,
    #: whose leading axis is as long as the tensors naming it (``outputs``: the slab's shape)
    part: int | None = None


def export_of(key: str, shape: tuple[int, ...], itemsize: int, facts: ModelFacts,
              architecture: HFArchitecture) -> Export:
    """Where megatron-core tensor ``key`` goes in ``architecture`` (its name table); an unknown key
    is an error."""
    for row in architecture.names:
        m = next((m for m in (p.match(key) for p in row.core_patterns) if m), None)
        if m is None:
            continue
        transform = row.transform
        if transform is None:
            return Export(key)
        filled = tuple(mtp_to_hf(n.format(**m.groupdict()), facts.num_layers) for n in row.hf)
        outputs = tuple(transform.outputs(filled, shape, facts))
        part = None if transform.stacks is None else int(m[transform.stacks])
        linear = row.linear and part is None and all(o.name.endswith(".weight") and len(o.shape) == 2
                                                     for o in outputs)  # not biases, nor slabs of a 3-D tensor
        if isinstance(transform, WholeTensorTransform):
            return Export(key, outputs, (), functools.partial(transform.convert, facts=facts), linear, part)
        return Export(key, outputs, tuple(transform.runs(shape, itemsize, facts)), linear=linear, part=part)
    raise LayoutError(f"{key} has no counterpart in Hugging Face's {architecture.name}", culprit=key,
                      hint="export a model whose every tensor that architecture holds")


@dataclass(frozen=True, kw_only=True)
class HFArchitecture:
    """The chosen class, its ``config.json``, why (for the report) and its name table."""

    name: str
    config: dict[str, Any]
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    names: NameTable = ()


@dataclass(frozen=True)
class HFModel:
    """What a ``config.json`` says, as Megatron-LM sees it, and the name table its tensors are read by
    (``base_prefix``: the base model's prefix, which some saved folders leave out of the names)."""

    architecture: str
    args: argparse.Namespace
    facts: ModelFacts
    names: NameTable = ()
    base_prefix: str | None = None


class HFArchitectureFamily(abc.ABC):
    """One Hugging Face architecture: everything reshard knows of one ``transformers`` class, in one
    object (registered in :mod:`reshard.models.hf_registry`). A plug-in sets :attr:`name`,
    :attr:`names` and :attr:`model_types`, and overrides :meth:`read_config` to import its folders,
    :meth:`export` to write megatron-core models as it, or both."""

    #: The ``transformers`` class (``config.json``'s ``architectures``).
    name: str = ""
    #: Registry order (built-ins 0, plug-ins after them by default).
    priority: int = 100
    #: ``config.json``'s ``model_type`` values that mean this class when ``architectures`` is absent.
    model_types: tuple[str, ...] = ()
    #: megatron-core names <-> this class's names, each row's transform owning its math both ways.
    names: NameTable = ()

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        """Import: the megatron-core model ``config`` (a ``config.json``) describes, or
        :class:`LayoutError` naming the first thing megatron-core does not compute exactly."""
        raise LayoutError(f"{self.name} is written by reshard but not read", culprit=where,
                          hint="import a folder of an architecture reshard reads")

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """Export: this class's version of a megatron-core model that only it computes (DeepSeek's
        multi-latent attention), asked before the built-in decision; None (the default) for a model
        this class does not claim. ``widths``: :func:`ffn_widths`."""
        return None

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """Import: what ``config`` declares that the folder does not hold (``args``: the imported
        model's, as read with its weights), so that the output lacks it too — one line each, for the
        run's warnings. Default: none."""
        return []

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        """Export under ``--hf-architecture``: this class's ``config.json`` for the model reshard
        decided ``decided`` computes (a built-in architecture, whose ``config`` and ``reason`` say
        what it is), or :class:`LayoutError` saying why this class does not compute it."""
        raise LayoutError(f"the model is {decided.name} ({decided.reason}); {self.name} does not compute it",
                          culprit="--hf-architecture", hint=f"drop --hf-architecture, or give {decided.name}")

    def as_llama_without_biases(self, decided: HFArchitecture, model_type: str, **config: Any) -> HFArchitecture:
        """An :meth:`export` for a class that computes Llama's arithmetic without biases (Mistral with
        no sliding window, Phi-3): Llama's ``config.json`` under this class, with ``config`` added;
        refused for any other decided model."""
        c = decided.config
        if decided.name != "LlamaForCausalLM" or c.get("attention_bias") or c.get("mlp_bias"):
            return HFArchitectureFamily.export(self, decided)
        out = {k: v for k, v in c.items() if k not in ("attention_bias", "mlp_bias")}
        out.update(architectures=[self.name], model_type=model_type, **config)
        return HFArchitecture(name=self.name, config=out, names=self.names, notes=decided.notes,
                              reason=f"{decided.reason} ({self.name})")

    @property
    def imports(self) -> bool:
        """Whether :meth:`read_config` is this class's own (an export-only architecture has none)."""
        return type(self).read_config is not HFArchitectureFamily.read_config

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


#: The dtype names of config.json (transformers' ``dtype`` / ``torch_dtype``), both directions.
HF_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

#: Where an import keeps ``config.json``'s token ids (``bos_token_id``, ``eos_token_id``,
#: ``pad_token_id``, ...) in Megatron-LM's ``args``, which have no field for them: no weight
#: depends on them, so they go through every Megatron layout to the export unchanged.
TOKEN_IDS_ARG = "hf_token_ids"
_TOKEN_ID = re.compile(r"^[a-z_]*token_id$")


def token_ids(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``config.json``'s token ids (each a token number, a list of them, or null), as written."""
    def is_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    out = {}
    for key, value in config.items():
        if not _TOKEN_ID.match(key):
            continue
        if not (value is None or is_id(value) or (isinstance(value, list) and value and all(map(is_id, value)))):
            raise CheckpointFormatError(f"{key} is {value!r}, not a token id or a list of them", culprit=where,
                                        hint="correct it in config.json")
        out[key] = value
    return out


def with_token_ids(arch: HFArchitecture, args: Any) -> HFArchitecture:
    """``arch`` with the token ids an import kept (:data:`TOKEN_IDS_ARG`) in its ``config.json``;
    without any, the ids stay null (transformers' class defaults are another model's) and a note
    says so."""
    ids = getattr(args, TOKEN_IDS_ARG, None) if args is not None else None
    if ids:
        return dataclasses.replace(arch, config={**arch.config, **ids})
    return dataclasses.replace(arch, notes=(*arch.notes, "bos_token_id and eos_token_id null: the checkpoint records "
                                            "no token ids (give the model's config.json with --model-config)"))


def ffn_widths(split_rows: Mapping[str, int], swiglu: bool) -> dict[str, int]:
    """The FFN widths of the dense MLPs, the routed experts and the shared experts (``"dense"``,
    ``"expert"``, ``"shared"``; absent: none such), from each split megatron-core tensor's whole
    size along its split dim (``split_rows``): fc1's rows, halved for SwiGLU (``[gate; up]``)."""
    widths: dict[str, int] = {}
    for key, rows in split_rows.items():
        if re.search(r"linear_fc1\.weight\d*$", key):
            kind = "expert" if expert_index(key) is not None else "shared" if ".shared_experts." in key else "dense"
            widths[kind] = rows // 2 if swiglu else rows
    return widths


def window_args(sliding_window: int) -> dict[str, Any]:
    """Megatron-LM's ``args`` for transformers' ``sliding_window`` ``W`` on every layer.

    transformers masks key ``j`` from query ``i`` unless ``i - W < j <= i`` (``sliding_window_overlay``
    and the causal mask): the ``W`` latest tokens, the query's own included. megatron-core's
    ``window_size`` ``(left, right)`` lets query ``i`` see keys ``i - left`` to ``i + right``, both
    included (its local attention's ``get_sliding_window_causal_mask``; Transformer Engine's and
    flash-attention's windows read the same): ``(W - 1, 0)``. ``window_attn_skip_freq`` None: every
    layer windowed. Megatron-LM's ``--window-size`` saves the pair as a tuple of ints. (megatron-core
    0.16.1's local attention leaves the window out of its fused fp16/bf16 softmax kernel, a GPU path:
    a run trained that way did not compute the window its args state.)"""
    return {"window_size": (sliding_window - 1, 0), "window_attn_skip_freq": None}


def sliding_window(args: Any, num_layers: int) -> int | None:
    """transformers' ``sliding_window`` for the window Megatron-LM's ``args`` give every layer (the
    inverse of :func:`window_args`), None without one; :class:`LayoutError` for a window no
    ``sliding_window`` computes: a look-ahead, a negative side (Transformer Engine's "unbounded",
    which megatron-core's local attention does not read so), windows on some layers only
    (``window_attn_skip_freq``, read as megatron-core's ``is_layer_window_attention`` does), or one
    in a legacy model's args (its attention is not megatron-core's)."""
    size = saved_arg(args, "window_size")
    if size is None:
        return None

    def refuse(what: str) -> LayoutError:
        return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                           hint="keep it in a Megatron layout (a window on every layer, looking back only, "
                                "is exported as MistralForCausalLM's sliding_window)")

    if not (isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                       for v in size)):
        raise refuse(f"window_size {size!r} (megatron-core's window is a pair of ints, (left, right))")
    left, right = size
    if right != 0:
        raise refuse(f"window_size ({left}, {right}) looks {right} tokens ahead (transformers' windows look back "
                     "only)")
    if left < 0:
        raise refuse(f"window_size ({left}, 0) (Transformer Engine reads a negative side as unbounded, "
                     "megatron-core's local attention does not)")
    if saved_arg(args, "use_legacy_models", default=False):
        raise refuse(f"window_size ({left}, 0) in a legacy Megatron model's args (its attention is not "
                     "megatron-core's)")
    freq = saved_arg(args, "window_attn_skip_freq")
    layers = range(1, num_layers + 1)  # megatron-core numbers layers from 1
    if freq is None:
        windowed = [True] * num_layers
    elif isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        windowed = [n % freq != 0 for n in layers]
    elif isinstance(freq, (list, tuple)) and len(freq) == num_layers:
        windowed = [bool(v) for v in freq]
    else:
        raise refuse(f"window_attn_skip_freq {freq!r} (an int or one flag per layer of {num_layers})")
    if not any(windowed):
        return None
    if not all(windowed):
        full = [n - 1 for n, w in zip(layers, windowed) if not w]
        raise refuse(f"sliding-window attention on some layers only (layers {full} attend fully: "
                     f"window_attn_skip_freq {freq!r})")
    return left + 1


#: Megatron-LM ``args`` flags no exported architecture computes (each refused by name, with what it does).
NOT_EXPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("squared_relu", "squared ReLU"),
    ("apply_residual_connection_post_layernorm", "residual taken after the layer norm"),
    ("qk_l2_norm", "L2-normalized queries and keys"), ("rotary_interleaved", "interleaved rotary"),
    ("use_rope_scaling", "rotary scaling"),
    ("apply_layernorm_1p", "norm weights stored as w - 1 (layernorm 1p)"))


def decide_architecture(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                        ffn: int | None, moe_ffn: int | None = None, shared_ffn: int | None = None) -> HFArchitecture:
    """The Hugging Face architecture that computes this megatron-core model exactly (see the module
    table), from the saved ``args`` and the tensor names present; :class:`LayoutError` naming the
    first difference otherwise. ``ffn``, ``moe_ffn``, ``shared_ffn``: the FFN widths of the dense
    MLPs, the routed experts and the shared experts (None: none such)."""
    decided = _decide(args, facts, keys, dtype, ffn, moe_ffn, shared_ffn)
    return dataclasses.replace(decided, names=NAME_TABLES[decided.name])


def _decide(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
            ffn: int | None, moe_ffn: int | None, shared_ffn: int | None) -> HFArchitecture:

    def refuse(what: str) -> LayoutError:
        return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                           hint="keep it in a Megatron layout (Llama, Qwen2 and GPT-2 shapes are exported)")

    def has(pattern: str) -> bool:
        return any(re.search(pattern, k) for k in keys)

    for flag, what in (*NOT_EXPORTED_FLAGS, ("multi_latent_attention", "multi-latent attention")):
        if saved_arg(args, flag, default=False):
            raise refuse(f"{what} ({flag})")
    qk_norm = has(r"\.(q_layernorm|k_layernorm)\.weight$")
    if qk_norm != bool(saved_arg(args, "qk_layernorm", default=qk_norm)):
        raise refuse("args.qk_layernorm contradicts the query/key layer norms the tensors hold")
    if facts.heads is None or facts.query_groups is None or facts.head_dim is None or facts.hidden is None:
        raise refuse("heads, query groups or head dim unknown (give --num-heads / --num-query-groups)")
    norm = saved_arg(args, "normalization")
    if norm is None:  # Megatron-LM's default is LayerNorm, which no SwiGLU, MoE or Qwen3 export has: ask
        if facts.swiglu or qk_norm or has(r"\.mlp\.router\.weight$"):
            raise LayoutError("the normalization is unknown: the checkpoint's args do not record it",
                              culprit="--to hf", hint="give --normalization RMSNorm (or LayerNorm), or the model's "
                                                      "config.json with --model-config")
        norm = "LayerNorm"
    if norm == "LayerNorm" and has(r"\.mlp\.router\.weight$"):
        raise refuse("a mixture-of-experts model with LayerNorm (Mixtral and Qwen2-MoE use RMSNorm)")
    if norm == "LayerNorm":
        if qk_norm:
            raise refuse("query/key layer norms with LayerNorm (Qwen3 uses RMSNorm)")
        return _gpt2(args, facts, has, dtype, ffn, refuse)
    if norm != "RMSNorm":
        raise refuse(f"normalization is {norm}")
    if not facts.swiglu:
        raise refuse("the MLP is not SwiGLU")
    if saved_arg(args, "position_embedding_type") != "rope" or has(r"position_embeddings\."):
        raise refuse(f"position embedding {saved_arg(args, 'position_embedding_type') or 'unknown'} (rotary needed)")
    percent = float(saved_arg(args, "rotary_percent", default=1.0))
    if percent != 1.0:
        raise refuse(f"rotary_percent {percent} (the whole head must rotate)")
    qkv_bias, proj_bias = has(r"linear_qkv\.bias$"), has(r"linear_proj\.bias$")
    mlp_bias = has(r"linear_fc1\.bias$") or has(r"linear_fc2\.bias$")
    vocab = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
    base = float(saved_arg(args, "rotary_base", default=ROPE_BASE_DEFAULT))
    eps = float(saved_arg(args, "norm_epsilon", default=NORM_EPS_DEFAULT))
    config: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": facts.hidden, "intermediate_size": ffn,
        "num_hidden_layers": facts.num_layers, "num_attention_heads": facts.heads,
        "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim, "hidden_act": "silu",
        "rms_norm_eps": eps, "rope_theta": base, "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "tie_word_embeddings": bool(facts.tied_embeddings), "dtype": HF_DTYPES.get(dtype, str(dtype)),
        "bos_token_id": None, "eos_token_id": None, "use_cache": True,
    }
    max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
    if isinstance(max_pos, int):
        config["max_position_embeddings"] = max_pos
    notes = (f"rope_theta {base:g}" + (" (megatron-core's default: args do not record it)"
                                       if saved_arg(args, "rotary_base") is None else ""),
             f"rms_norm_eps {eps:g}"
             + (" (megatron-core's default)" if saved_arg(args, "norm_epsilon") is None else ""))
    if qk_norm and (qkv_bias != proj_bias or mlp_bias):
        where = [n for n, b in (("QKV", qkv_bias), ("attention output", proj_bias), ("MLP", mlp_bias)) if b]
        raise refuse(f"query/key layer norms with biases on the {' and '.join(where)} layers (Qwen3 has them on "
                     "the attention layers alone, or none)")
    if has(r"\.mlp\.router\.weight$"):
        return _moe(args, facts, keys, config, notes, (qkv_bias, proj_bias, mlp_bias), ffn, moe_ffn, shared_ffn,
                    refuse, qk_norm)
    if qk_norm:
        return HFArchitecture(name="Qwen3ForCausalLM", notes=notes,
                              config={"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **config,
                                      "attention_bias": qkv_bias, "use_sliding_window": False},
                              reason="RMSNorm, SwiGLU, rotary, query/key RMSNorm per head" +
                                     (", biases on the attention layers" if qkv_bias else ", no linear biases"))
    if qkv_bias and not proj_bias and not mlp_bias:
        if facts.head_dim * facts.heads != facts.hidden:
            raise refuse("head dim x heads differs from the hidden size, which Qwen2 assumes")
        config.pop("head_dim")
        return HFArchitecture(name="Qwen2ForCausalLM", config={"architectures": ["Qwen2ForCausalLM"],
                                                               "model_type": "qwen2", **config},
                              reason="RMSNorm, SwiGLU, rotary, biases on the fused QKV only", notes=notes)
    if qkv_bias != proj_bias or (mlp_bias and not qkv_bias):
        where = [n for n, b in (("QKV", qkv_bias), ("attention output", proj_bias), ("MLP", mlp_bias)) if b]
        raise refuse(f"biases on the {' and '.join(where)} layers only (Llama has them on all or none, Qwen2 on "
                     "QKV alone)")
    config.update(attention_bias=qkv_bias, mlp_bias=mlp_bias)
    return HFArchitecture(name="LlamaForCausalLM", config={"architectures": ["LlamaForCausalLM"],
                                                           "model_type": "llama", **config},
                          reason="RMSNorm, SwiGLU, rotary" + (", biases on every linear layer" if qkv_bias
                                                              else ", no linear biases"), notes=notes)


def _gpt2(args: Any, facts: ModelFacts, has: Any, dtype: torch.dtype, ffn: int | None,
          refuse: Any) -> HFArchitecture:
    """LayerNorm, GELU (exact, or tanh with ``--openai-gelu``), learned absolute positions, biases
    on every linear layer, multi-head attention: ``GPT2LMHeadModel``."""
    if facts.swiglu:
        raise refuse("LayerNorm with a SwiGLU MLP (GPT-2 has a plain GELU MLP)")
    if saved_arg(args, "position_embedding_type", default="learned_absolute") != "learned_absolute" or \
            not has(r"^embedding\.position_embeddings\."):
        raise refuse("LayerNorm without learned absolute positions (GPT-2 learns them)")
    if facts.query_groups != facts.heads:
        raise refuse(f"{facts.query_groups} query groups for {facts.heads} heads (GPT-2 has multi-head attention)")
    if facts.head_dim * facts.heads != facts.hidden:
        raise refuse("head dim x heads differs from the hidden size, which GPT-2 assumes")
    missing = [n for n, pat in (("QKV", r"linear_qkv\.bias$"), ("attention output", r"linear_proj\.bias$"),
                                ("MLP", r"linear_fc1\.bias$")) if not has(pat)]
    if missing:
        raise refuse(f"no biases on the {' and '.join(missing)} layers (GPT-2 has them on every linear layer)")
    rows = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
    eps = float(saved_arg(args, "norm_epsilon", default=NORM_EPS_DEFAULT))
    gelu = "gelu_new" if saved_arg(args, "openai_gelu", default=False) else "gelu"
    config: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": rows, "n_embd": facts.hidden,
        "n_layer": facts.num_layers, "n_head": facts.heads, "n_inner": ffn, "activation_function": gelu,
        "layer_norm_epsilon": eps, "tie_word_embeddings": bool(facts.tied_embeddings),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None, "use_cache": True,
    }
    max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
    if isinstance(max_pos, int):
        config["n_positions"] = max_pos
    notes = (f"activation {gelu} ({'--openai-gelu' if gelu == 'gelu_new' else 'exact GELU, Megatron default'})",
             f"layer_norm_epsilon {eps:g}" + (" (megatron-core's default)" if saved_arg(args, "norm_epsilon") is None
                                              else ""))
    return HFArchitecture(name="GPT2LMHeadModel", config=config, notes=notes,
                          reason="LayerNorm, GELU, learned positions, biases on every linear layer, multi-head")


def _moe(args: Any, facts: ModelFacts, keys: set[str], config: dict[str, Any], notes: tuple[str, ...],
         biases: tuple[bool, bool, bool], ffn: int | None, moe_ffn: int | None, shared_ffn: int | None,
         refuse: Callable[[str], LayoutError], qk_norm: bool = False) -> HFArchitecture:
    """A Llama-like model whose MLPs are megatron-core MoE layers: ``MixtralForCausalLM`` (every layer
    MoE, no shared expert, the top-k softmax scores renormalized: megatron-core's default top-k of
    the logits then softmax) or ``Qwen2MoeForCausalLM`` (one sigmoid-gated shared expert per MoE
    layer, dense layers allowed, ``norm_topk_prob`` as ``--moe-router-pre-softmax`` says, QKV bias
    optional) — or with query/key layer norms (``qk_norm``) ``Qwen3MoeForCausalLM`` (no shared expert,
    dense layers allowed, ``norm_topk_prob`` likewise). Routing that none computes (sigmoid scores,
    expert bias, groups, capacity, scaling) is refused."""
    qkv_bias, proj_bias, mlp_bias = biases
    if (proj_bias and not qk_norm) or mlp_bias:
        raise refuse("linear biases besides the QKV's in a mixture-of-experts model")
    score = saved_arg(args, "moe_router_score_function", default="softmax")
    if score != "softmax":
        raise refuse(f"router scores by {score} (Mixtral and Qwen2-MoE route on softmax scores)")
    expert_bias = saved_arg(args, "moe_router_enable_expert_bias", default=False)
    if any(k.endswith(".mlp.router.expert_bias") for k in keys) or expert_bias:
        raise refuse("a router expert bias (aux-loss-free load balancing)")
    for flag, what in (("moe_router_num_groups", "group-limited routing"), ("moe_expert_capacity_factor",
                                                                           "token dropping (expert capacity)"),
                       ("moe_input_jitter_eps", "router input jitter")):
        if saved_arg(args, flag):
            raise refuse(f"{what} ({flag})")
    if saved_arg(args, "moe_router_topk_scaling_factor", default=1.0) != 1.0:
        raise refuse("scaled routing weights (moe_router_topk_scaling_factor)")
    topk = saved_arg(args, "moe_router_topk")
    if not isinstance(topk, int):
        raise refuse("the router's top-k is unknown (the saved args lack moe_router_topk)")
    experts = max(experts_per_layer(keys, "--to hf").values(), default=0)
    moe_layers = {layer_index(k) for k in keys if k.endswith(".mlp.router.weight")}
    dense = sorted(set(range(facts.num_layers)) - moe_layers)
    shared = any(k.endswith(".mlp.shared_experts.linear_fc1.weight") for k in keys)
    pre_softmax = bool(saved_arg(args, "moe_router_pre_softmax", default=False))
    routing = {"num_experts_per_tok": topk, "output_router_logits": False, "router_aux_loss_coef": 0.0}
    if qk_norm:
        if shared:
            raise refuse("query/key layer norms with shared experts (Qwen3-MoE has no shared expert)")
        return HFArchitecture(
            name="Qwen3MoeForCausalLM", notes=notes,
            config={"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **config,
                    "intermediate_size": ffn or moe_ffn, "moe_intermediate_size": moe_ffn, "num_experts": experts,
                    "norm_topk_prob": not pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": dense,
                    "attention_bias": qkv_bias, "use_sliding_window": False, **routing},
            reason=f"RMSNorm, SwiGLU, rotary, query/key RMSNorm per head, {experts} experts per MoE layer, top-{topk} "
                   f"of softmax{'' if pre_softmax else ' renormalized'}" + (", attention biases" if qkv_bias else ""))
    if not shared:
        if dense:
            raise refuse(f"dense layers {dense} beside MoE layers without shared experts (Mixtral's layers are all "
                         "MoE; Qwen2-MoE's MoE layers have a shared expert)")
        if pre_softmax:
            raise refuse("top-k softmax scores not renormalized (--moe-router-pre-softmax; Mixtral renormalizes "
                         "and has no shared expert)")
        if qkv_bias:
            raise refuse("a QKV bias (Mixtral has none)")
        return HFArchitecture(
            name="MixtralForCausalLM", notes=notes,
            config={"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **config,
                    "intermediate_size": moe_ffn, "num_local_experts": experts, "sliding_window": None, **routing},
            reason=f"RMSNorm, SwiGLU, rotary, {experts} experts in every layer, top-{topk} of softmax renormalized")
    if not any(k.endswith(".mlp.shared_experts.gate_weight") for k in keys):
        raise refuse("shared experts without a gate (Qwen2-MoE gates its shared expert by a sigmoid)")
    if facts.head_dim * facts.heads != facts.hidden:
        raise refuse("head dim x heads differs from the hidden size, which Qwen2-MoE assumes")
    config = {k: v for k, v in config.items() if k != "head_dim"}
    return HFArchitecture(
        name="Qwen2MoeForCausalLM", notes=notes,
        config={"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **config,
                "intermediate_size": ffn or moe_ffn, "moe_intermediate_size": moe_ffn,
                "shared_expert_intermediate_size": shared_ffn, "num_experts": experts,
                "norm_topk_prob": not pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": dense,
                "qkv_bias": qkv_bias, "use_sliding_window": False, **routing},
        reason=f"RMSNorm, SwiGLU, rotary, {experts} experts and a gated shared expert per MoE layer, top-{topk} "
               f"of softmax{'' if pre_softmax else ' renormalized'}" + (", QKV bias" if qkv_bias else ""))
