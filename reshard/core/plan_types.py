"""The plan's data: what a validated conversion is (:class:`Plan`), per parameter (:class:`ParamPlan`),
per output file (:class:`TargetPlan`), and the model facts it was decided from (:class:`ModelFacts`);
plus the records a format reads for the planners (:class:`SourceRead`, :class:`SourceStage`) and the
canonical parameter records the planners see (:class:`CanonicalParam`). No logic beyond small derived values."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.core.layouts import PartitionSpec
from reshard.core.options import ReshardOptions
from reshard.core.pipeline_stages import StageLayout
from reshard.core.rules import QuantSlot, Rule
from reshard.core.source import DEEPSPEED, SourceCheckpoint

#: Top-level entries that are wrong after a reshard; dropped with the reason reported.
DROPPED_ENTRIES: dict[str, str] = {
    "optimizer": "optimizer state is partitioned for the old layout",
    "optimizer_state_dict": "optimizer state is partitioned for the old layout",
    "lr_scheduler": "scheduler state belongs with the dropped optimizer",
    "opt_param_scheduler": "scheduler state belongs with the dropped optimizer",
    "rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "random_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "np_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "torch_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "cuda_rng_state": "per-rank RNG state has no meaning at a new TP degree",
    "rng_tracker_states": "per-rank RNG state has no meaning at a new TP degree",
    "param_shapes": "per-rank ZeRO parameter shapes describe the old layout",
}


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """The model facts the layout depends on, and where each came from (``origin``:
    fact -> ``args`` / ``--flag`` / ``shapes`` / ``tensors``). None: unknown (and not needed).

    The fields are what every family shares; a family's own facts (say the low ranks of its
    attention) go in ``family_facts`` (name -> JSON value, decided by its
    :meth:`~reshard.models.base.ModelFamily.decide_family_facts`), so a family adds facts without
    editing this record."""

    naming: str
    num_layers: int
    hidden: int | None
    heads: int | None
    query_groups: int | None
    head_dim: int | None
    swiglu: bool | None
    tied_embeddings: bool | None
    vocab_size: int | None
    padded_vocab_source: int | None
    padded_vocab_target: int | None
    make_vocab_size_divisible_by: int | None
    #: Layers per pipeline stage: per model chunk, virtual stage first, with virtual stages (see
    #: :mod:`reshard.core.pipeline_stages`).
    source_pp_layers: tuple[int, ...]
    target_pp_layers: tuple[int, ...]
    origin: Mapping[str, str] = field(default_factory=dict)
    family_facts: Mapping[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """A JSON-able record (``family_facts`` only where the family has any)."""
        rec = {k: v for k, v in self.__dict__.items() if k not in ("origin", "family_facts")}
        rec["source_pp_layers"] = list(self.source_pp_layers)
        rec["target_pp_layers"] = list(self.target_pp_layers)
        rec["origin"] = dict(self.origin)
        if self.family_facts:
            rec["family_facts"] = dict(self.family_facts)
        return rec


@dataclass(frozen=True)
class TensorDegrees:
    """The tensor-parallel degrees parameters are split over, in the source and the output: the
    dense TP, and for routed experts' weights the expert TP (ETP), which Megatron-LM may set apart
    (``--expert-tensor-parallel-size``). Shared experts and the router follow the dense TP.

    ========================  ==========================  ================================
    parameter                 split over (source, output)  output rank holding slice ``t``
    ========================  ==========================  ================================
    dense, shared experts     ``(tp, target_tp)``          TP rank ``t``
    routed experts' weights   ``(etp, target_etp)``        TP ranks ``r`` with ``r % ETP == t``
    ========================  ==========================  ================================
    """

    tp: int
    target_tp: int
    etp: int
    target_etp: int

    def of(self, rule: Rule) -> tuple[int, int]:
        """(source, output) degree of a parameter of ``rule`` (a routed expert's: the expert TP)."""
        return (self.etp, self.target_etp) if rule.expert else (self.tp, self.target_tp)

    def rank(self, rule: Rule, tp_rank: int) -> int:
        """Which slice of a parameter of ``rule`` an output file at TP rank ``tp_rank`` holds (the
        expert TP divides the TP)."""
        return tp_rank % self.of(rule)[1]


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """One logical module entry: its rule, per-source-rank shape, and partition spec.

    ``key`` is the logical name (global layer numbers); ``stage``/``src_key`` say where the
    source holds it. Carried non-tensor entries (``_extra_state``) have ``dtype`` None."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    spec: PartitionSpec | None
    layer: int | None
    stage: int = 0
    src_key: str = ""

    @property
    def quant_slot(self) -> QuantSlot | None:
        return self.rule.quant


@dataclass(frozen=True, kw_only=True)
class TargetParam:
    """One entry of a target's module: its name there and the logical parameter it holds."""

    out_key: str
    param: ParamPlan
    #: The model chunk (virtual pipeline stage) of its file that holds it: ``model{chunk}`` of a
    #: Megatron-LM rank file of the interleaved pipeline; 0 otherwise.
    chunk: int = 0


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    """One output file: its index in ``Plan.targets`` (``rank``), its path relative to the
    destination, which source files feed it (indices into ``source.files``; for PP = 1 these
    are the source TP ranks) and the bytes it moves. Writers iterate these; they never build
    names themselves.

    ``tp_rank``/``pp_rank``: its place in the target grid; ``base_rank``: the source TP rank
    that replicated tensors and top-level entries are taken from; ``params``: its module.
    ``kind``: what the file holds (:data:`RANK_FILE`, or for DeepSpeed pipelines
    :data:`LAYER_FILE` / :data:`PIPE_RANK_FILE`; see :mod:`reshard.execution.ds_pipe`)."""

    rank: int
    name: str
    sources: tuple[int, ...]
    bytes_read: int
    bytes_written: int
    tp_rank: int = 0
    pp_rank: int = 0
    #: Its expert-parallel rank (MoE; 0 without experts).
    ep_rank: int = 0
    base_rank: int = 0
    params: tuple[TargetParam, ...] = ()
    kind: str = "rank"
    #: The weights its module is read as (a ``--weights`` value), when not the plan's own (a
    #: universal checkpoint's files of Adam moments); None: ``options.weights``.
    weights: str | None = None


#: ``TargetPlan.kind``: top-level entries with the module under ``module_key``.
RANK_FILE = "rank"


#: A DeepSpeed pipeline layer file: the layer's module state dict itself, nothing around it.
LAYER_FILE = "layer"


#: A DeepSpeed pipeline ``mp_rank`` file: top-level entries, ``module`` None (weights are in layer files).
PIPE_RANK_FILE = "pipe-rank"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated conversion. ``extra_files``: small text files the writer must also write
    (relative name -> content), e.g. Megatron's ``latest_checkpointed_iteration.txt``.
    ``params``: logical tensors; ``carried``: opaque non-tensor module entries."""

    source: SourceCheckpoint
    options: ReshardOptions
    module_key: str
    version: float
    params: tuple[ParamPlan, ...]
    targets: tuple[TargetPlan, ...]
    unused_rules: tuple[str, ...]
    dropped: dict[str, str]
    facts: ModelFacts
    ds_config: dict[str, Any] | None = None
    warnings: tuple[str, ...] = field(default=())
    carried: tuple[ParamPlan, ...] = ()
    target_pp: int = 1
    output_format: str = DEEPSPEED
    extra_files: Mapping[str, str] = field(default_factory=dict)
    #: Files of the source copied into the output unchanged (output name -> source file): its
    #: tokenizer and generation config (``CheckpointFormat.carried``).
    copied_files: Mapping[str, Path] = field(default_factory=dict)
    #: The output's expert TP (MoE; None: the target TP).
    target_etp: int | None = None
    #: The source's and the output's pipeline stages: layers per model chunk and the setting they
    #: come from (None: a plan of DeepSpeed pipeline layer files, which have no chunks).
    source_stages: StageLayout | None = None
    target_stages: StageLayout | None = None
    #: How the planning layer reads a target's pending state dict (see :meth:`target_state`); set by
    #: :func:`reshard.execution.planner.build_plan`, so a format gets it with the plan it is handed
    #: and never imports the engine (the layers point one way).
    state_reader: Callable[[Plan, int], dict[str, Any]] | None = field(default=None, compare=False, repr=False)

    @property
    def source_tp(self) -> int:
        return self.source.tp

    @property
    def source_pp(self) -> int:
        """The source's pipeline-parallel ranks."""
        return self.source.pipeline_ranks

    @property
    def target_vpp(self) -> int:
        """The output's virtual pipeline stages per rank (1: none)."""
        return self.target_stages.vpp if self.target_stages is not None else 1

    @property
    def target_tp(self) -> int:
        return self.options.target_tp

    @property
    def degrees(self) -> TensorDegrees:
        """The TP degrees each parameter is split over, in the source and the output."""
        tm = self.options.target_tp
        return TensorDegrees(self.source.tp, tm, self.source.expert_tp, self.target_etp or tm)

    @property
    def target_ep(self) -> int:
        """The output's expert-parallel degree (1 without experts)."""
        return 1 + max((t.ep_rank for t in self.targets), default=0)

    def target_options(self, tgt: int) -> ReshardOptions:
        """The options target ``tgt``'s sources are opened with (its own ``weights``, if any)."""
        weights = self.targets[tgt].weights
        if weights is None or weights == self.options.weights:
            return self.options
        return self.options.model_copy(update={"weights": weights})

    def target_state(self, tgt: int) -> dict[str, Any]:
        """Target ``tgt``'s state dict with every produced tensor pending: names, shapes, dtypes
        and the top-level entries, no tensor bytes read. A format that writes an index or a header
        before the bytes (Hugging Face, torch_dist) reads what it will write from here."""
        if self.state_reader is None:
            raise RuntimeError("this plan was not made by reshard.execution.planner.build_plan, which wires the "
                               "engine's target_state into it")
        return self.state_reader(self, tgt)

    @property
    def peak_memory_estimate(self) -> int:
        """Bytes held at once by the engine: one target rank's tensors plus one source tensor."""
        largest_src = max((nbytes(p.shape, p.dtype) for p in self.params), default=0)
        return max((t.bytes_written for t in self.targets), default=0) + largest_src


def dropped_warning(dropped: Mapping[str, str]) -> list[str]:
    """One line for the top-level entries left out (the reason per entry is in ``Plan.dropped``)."""
    if not dropped:
        return []
    return [f"dropped training state that belongs to the old layout: {', '.join(dropped)} "
            f"(the output holds the model and its settings)"]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else elems(shape) * dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class SourceStage:
    """One row of the source grid while planning (a pipeline stage, or one DeepSpeed pipeline layer
    file): its files' names and module dicts under the *files'* keys (what the engine and the
    cross-rank checks read), and the canonical name of each key that the format names otherwise
    (``canonical``: file key -> canonical name; a key not in it is its own canonical name)."""

    index: int
    names: list[str]
    modules: list[dict[str, Any]]
    canonical: Mapping[str, str] = field(default_factory=dict)
    #: What the row holds, when its format tells rows apart (a pipeline layer file's role).
    role: str | None = None
    #: The pipeline stage the row belongs to (None: the row is a stage, ``index``) and its
    #: expert-parallel rank: a stage's EP rows after the first hold that rank's experts only.
    pp_stage: int | None = None
    expert_rank: int = 0

    def canonical_name(self, key: str) -> str:
        return self.canonical.get(key, key)

    @property
    def stage(self) -> int:
        """The pipeline stage of this row."""
        return self.index if self.pp_stage is None else self.pp_stage


@dataclass(frozen=True, kw_only=True)
class SourceRead:
    """What a format reads from a source's files for the planner, no tensor bytes: every rank
    file's top-level entries (``shards``, module included; tensors lazy) and name, the module key,
    and the grid's rows (:class:`SourceStage`) indexed like ``SourceCheckpoint.files`` rows."""

    shards: list[dict[str, Any]]
    names: list[str]
    module_key: str
    stages: list[SourceStage]
    #: The source as its files' contents tell it (a Megatron-LM folder ``mp_rank_TT_NNN`` is a
    #: pipeline stage NNN or an expert-parallel rank NNN: only the saved args say); None: as located.
    source: SourceCheckpoint | None = None
    #: What the source declares but does not hold, which the output therefore lacks (one line each;
    #: a layer a Hugging Face folder's config declares but saves no weights for).
    warnings: tuple[str, ...] = ()

    @property
    def args(self) -> Any:
        """The saved Megatron ``args`` (rank 0's), or None."""
        return self.shards[0].get("args")

    @property
    def module_rows(self) -> list[SourceStage]:
        """The rows that hold module entries (a DeepSpeed pipeline's rank-file rows hold none)."""
        return [st for st in self.stages if st.modules]


@dataclass(frozen=True, kw_only=True)
class CanonicalParam:
    """One parameter as the planner sees it, whatever the format: its canonical name (``key``;
    global layer number), rule, per-rank shape and dtype, layer, and where its per-rank pieces
    are — row ``stage`` of the source grid, entry ``src_key`` of each of the row's files (read
    lazily through the format). ``order``: position in the source, for the output's order (a
    tuple: an expert's entries sort by their global expert number inside their layer's experts)."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    layer: int | None
    stage: int
    src_key: str
    order: tuple[int, int, int]

    def planned(self, spec: PartitionSpec | None) -> ParamPlan:
        """This parameter's plan with its partition spec (None: replicated or carried)."""
        return ParamPlan(key=self.key, rule=self.rule, shape=self.shape, dtype=self.dtype, spec=spec,
                         layer=self.layer, stage=self.stage, src_key=self.src_key)


def elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
