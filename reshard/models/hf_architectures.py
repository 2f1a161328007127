"""The toolkit every Hugging Face architecture is written with: the tensor transforms (each owning
its byte mapping both ways — export: byte runs or a whole-tensor conversion; import: the
megatron-core tensor as a lazy view of the Hugging Face ones, :meth:`Transform.gather`), the name
table (:class:`NameRow`, :func:`name_table`), where one megatron-core tensor goes
(:func:`export_of`), the base class of an architecture (:class:`HFArchitectureFamily`) and what an
export and an import hand on (:class:`HFArchitecture`, :class:`HFModel`).

Pure: no files, no torch I/O. The ``hf`` format (:mod:`reshard.formats.hf`) streams the bytes. Each
architecture — its name table, its ``config.json`` reading, its export decision — is its own module
(the built-ins are listed in :mod:`reshard.models.hf_registry`); what several share is
:mod:`reshard.models.hf_common`'s.

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

(``g`` query groups, ``q`` query heads per group, ``d`` head dim, ``f`` FFN width.)
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import functools
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lazy import Converted, LazyTensor, RowConcat
from reshard.core.plan_types import ModelFacts
from reshard.models.megatron_gpt import core_module, core_name, expert_index


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
    #: The Hugging Face tensor is a linear weight stored ``[in, out]``, the transpose of
    #: megatron-core's ``[out, in]`` (:class:`~reshard.models.stacked.Stacked` slabs with
    #: ``transpose``): a quantized release whose groups run along the input axis encodes these.
    transpose: bool = False

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

    def convert_transposed(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        """The outputs with their last two axes swapped: for outputs stored ``[in, out]``
        (:attr:`transpose`), the ``[out, in]`` weights a quantizer that groups the inputs encodes.
        Default: views of :meth:`convert`'s outputs; a transform that transposes makes them
        without transposing twice."""
        return [x.transpose(-2, -1) for x in self.convert(t, facts)]


def row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one leading-dim row of a tensor of ``shape`` (a transform's byte runs move whole rows)."""
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


def expect_rows(names: tuple[str, ...], parts: Sequence[LazyTensor], rows: tuple[int, ...]) -> None:
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
        return [Run(0, shape[0] * row_bytes(shape, itemsize), 0, 0)] if shape else [Run(0, itemsize, 0, 0)]

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
        return [Run(0, self.rows(shape, facts) * row_bytes(shape, itemsize), 0, 0)]

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
        row = row_bytes(shape, itemsize)
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
        expect_rows(names, parts, (heads * d, g * d, g * d))
        q = heads // g
        return RowConcat([seg for i in range(g)
                          for seg in ((q_, i * q * d, q * d), (k_, i * d, d), (v_, i * d, d))])


class GatedSplit(ByteTransform):
    """SwiGLU's fused first MLP layer ``[gate; up]`` as its two projections."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        f = shape[0] // 2
        return [OutTensor(names[0], (f, *shape[1:])), OutTensor(names[1], (f, *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        half = shape[0] // 2 * row_bytes(shape, itemsize)
        return [Run(0, half, 0, 0), Run(half, half, 1, 0)]

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        gate, up = parts
        expect_rows(names, parts, (gate.shape[0], gate.shape[0]))
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


def linear_weight(key: str, tables: Sequence[NameTable]) -> bool:
    """Whether megatron-core (or legacy Megatron) parameter ``key`` is a linear layer's weight in
    ``tables`` (:attr:`NameRow.linear`): the bytes ``--quantize fp8`` encodes, known before the
    architecture is decided (the built-in tables agree on every row they share)."""
    if not re.search(r"\.weight\d*$", key):
        return False
    with contextlib.suppress(LayoutError):  # a legacy name; a megatron-core name has no legacy pattern
        key = core_name(key)
    return any(row.linear and any(p.match(key) for p in row.core_patterns) for table in tables for row in table)


def transposed_slab(key: str, tables: Sequence[NameTable]) -> bool:
    """Whether megatron-core parameter ``key`` is written as a slab stored ``[in, out]``
    (:attr:`Transform.transpose` of a stacking row) in ``tables``: the bytes ``--quantize mxfp4``
    encodes, known before the architecture is decided."""
    return any(row.transform is not None and row.transform.stacks is not None and row.transform.transpose
               and any(p.match(key) for p in row.core_patterns) for table in tables for row in table)


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
    #: a slab stored ``[in, out]``, the transpose of this ``[out, in]`` linear weight
    #: (:attr:`Transform.transpose`): what ``--quantize mxfp4`` encodes
    transposed_slab: bool = False
    #: for a :attr:`transposed_slab`: the slab's transpose ``[out, in]`` from the tensor itself
    #: (:meth:`WholeTensorTransform.convert_transposed`), else None
    convert_transposed: Any = None


def export_of(key: str, shape: tuple[int, ...], itemsize: int, facts: ModelFacts,
              architecture: HFArchitecture) -> Export:
    """Where megatron-core tensor ``key`` goes in ``architecture`` (its name table, each name as the
    folder spells it: :meth:`HFArchitectureFamily.folder_name`); an unknown key is an error."""
    folder_name = architecture.family.folder_name if architecture.family is not None else None
    for row in architecture.names:
        m = next((m for m in (p.match(key) for p in row.core_patterns) if m), None)
        if m is None:
            continue
        transform = row.transform
        if transform is None:
            return Export(key)
        filled = tuple(n.format(**m.groupdict()) for n in row.hf)
        if folder_name is not None:
            filled = tuple(folder_name(n, facts) for n in filled)
        outputs = tuple(transform.outputs(filled, shape, facts))
        part = None if transform.stacks is None else int(m[transform.stacks])
        linear = row.linear and part is None and all(o.name.endswith(".weight") and len(o.shape) == 2
                                                     for o in outputs)  # not biases, nor slabs of a 3-D tensor
        transposed = part is not None and transform.transpose and len(shape) == 2
        if isinstance(transform, WholeTensorTransform):
            return Export(key, outputs, (), functools.partial(transform.convert, facts=facts), linear, part,
                          transposed, functools.partial(transform.convert_transposed, facts=facts)
                          if transposed else None)
        return Export(key, outputs, tuple(transform.runs(shape, itemsize, facts)), linear=linear, part=part,
                      transposed_slab=transposed)
    raise LayoutError(f"{key} has no counterpart in Hugging Face's {architecture.name}", culprit=key,
                      hint="export a model whose every tensor that architecture holds")


#: The layers (leaf module names) vLLM runs as one matmul, so llm-compressor gives each group one
#: NVFP4 global scale (``--quantize nvfp4``): its ``FUSED_LAYER_NAMES``, one list it applies to every
#: model (an architecture whose serving stack fuses others sets its own ``fused_layers``).
FUSED_LAYERS: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"),
                                             ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))


@dataclass(frozen=True, kw_only=True)
class HFArchitecture:
    """The chosen class, its ``config.json``, why (for the report) and its name table."""

    name: str
    config: dict[str, Any]
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    names: NameTable = ()
    #: The architecture that wrote it, whose hooks name the folder's tensors (set by the registry's
    #: :func:`~reshard.models.hf_registry.decide_export` and ``export_as``; None: the table's names).
    family: HFArchitectureFamily | None = field(default=None, compare=False, repr=False)

    @property
    def fused_layers(self) -> tuple[tuple[str, ...], ...]:
        """The layers that share one NVFP4 global scale: its family's, else :data:`FUSED_LAYERS`."""
        return self.family.fused_layers if self.family is not None else FUSED_LAYERS


@dataclass(frozen=True)
class HFModel:
    """What a ``config.json`` says, as Megatron-LM sees it, and the name table its tensors are read by
    (``base_prefix``: the base model's prefix, which some saved folders leave out of the names)."""

    architecture: str
    args: argparse.Namespace
    facts: ModelFacts
    names: NameTable = ()
    base_prefix: str | None = None
    #: The architecture that read it (set by the registry's
    #: :func:`~reshard.models.hf_registry.read_config`; None: the toolkit's defaults).
    family: HFArchitectureFamily | None = field(default=None, compare=False, repr=False)


class HFArchitectureFamily(abc.ABC):
    """One Hugging Face architecture: everything reshard knows of one ``transformers`` class, in one
    object, one module (registered in :mod:`reshard.models.hf_registry`; the built-ins are listed
    there). A plug-in sets :attr:`name`, :attr:`names` and :attr:`model_types`, and overrides
    :meth:`read_config` to import its folders, :meth:`decide` to claim the megatron-core models it
    computes on export, :meth:`export` to write a model another class was decided for under
    ``--hf-architecture``, or any of them; the naming hooks (:meth:`folder_name`,
    :meth:`table_name`, :meth:`args_from_weights`) for what its table's templates cannot spell."""

    #: The ``transformers`` class (``config.json``'s ``architectures``).
    name: str = ""
    #: Registry order (built-ins 0, plug-ins after them by default).
    priority: int = 100
    #: ``config.json``'s ``model_type`` values that mean this class when ``architectures`` is absent.
    model_types: tuple[str, ...] = ()
    #: megatron-core names <-> this class's names, each row's transform owning its math both ways.
    names: NameTable = ()
    #: Asked for its :meth:`decide` only after every other class has declined the model: a class that
    #: claims a model by its shape alone (the built-ins with Llama's arithmetic, GPT-2), beside which a
    #: class claiming a model only it computes (DeepSeek's MLA, Mistral's window) decides first.
    fallback: bool = False
    #: Why megatron-core does not compute this class's models (None: it does): such a class's folders
    #: are converted Hugging Face -> Hugging Face only (read under megatron-core names, written back
    #: by :meth:`decide`), and the ``hf`` format refuses any other output for them in these words.
    hf_only: str | None = None
    #: The layers (leaf module names) that share one NVFP4 global scale (:data:`FUSED_LAYERS`).
    fused_layers: tuple[tuple[str, ...], ...] = FUSED_LAYERS

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        """Import: the megatron-core model ``config`` (a ``config.json``) describes, or
        :class:`LayoutError` naming the first thing megatron-core does not compute exactly."""
        raise LayoutError(f"{self.name} is written by reshard but not read", culprit=where,
                          hint="import a folder of an architecture reshard reads")

    def imported_config(self, config: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        """Import: the part of ``config`` (a ``config.json``) that describes the model imported, which
        :meth:`read_config` reads and the token ids are kept from (a vision-language class: its language
        model's ``text_config``). Default: all of it."""
        return config

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """Export: this class's ``config.json`` for a megatron-core model it claims (its
        :attr:`names` set), :class:`LayoutError` naming why a model it claims is not exact, or None
        (the default) for a model this class does not claim (asked in :attr:`fallback` order by
        :func:`~reshard.models.hf_registry.decide_export`). ``widths``: :func:`ffn_widths`."""
        return None

    def folder_name(self, name: str, facts: ModelFacts) -> str:
        """A Hugging Face name of :attr:`names` as this class's folders spell it, for what a table's
        templates cannot count (DeepSeek's multi-token prediction layers, numbered on after the
        decoder's). Default: the same."""
        return name

    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        """Import: a folder's tensor name as :attr:`names` spells it (the inverse of
        :meth:`folder_name`), or None for a tensor that is not imported (a copy of another one).
        Default: the same."""
        return name

    def args_from_weights(self, module: Mapping[str, Any], model: HFModel) -> dict[str, Any]:
        """Import: Megatron-LM ``args`` that the imported megatron-core ``module`` decides rather than
        ``config.json`` (DeepSeek's multi-token prediction layers, which transformers declares but
        does not save), or :class:`CheckpointFormatError` for weights that contradict ``model``.
        Default: none."""
        return {}

    def core_module(self, module: Mapping[str, Any]) -> dict[str, Any]:
        """Import: the imported megatron-core ``module`` (values untouched) as megatron-core's own
        per-rank module of this class's model holds it: its order and the ``None`` extra states of its
        linear layers. Default: a GPT model's (:func:`~reshard.models.megatron_gpt.core_module`)."""
        return core_module(module)

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """Import: what ``config`` declares that the folder does not hold (``args``: the imported
        model's, as read with its weights), so that the output lacks it too — one line each, for the
        run's warnings. Default: none."""
        return []

    def windows(self, config: Mapping[str, Any], num_layers: int) -> list[int | None]:
        """The attention window of each layer that this class's ``config`` (a ``config.json``) computes
        (None: the layer attends fully), checked against the args' by
        :func:`~reshard.models.hf_registry.decide_export`. Default: ``sliding_window`` on every layer."""
        return [config.get("sliding_window")] * num_layers

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
