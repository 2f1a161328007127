"""A located checkpoint (:class:`SourceCheckpoint`), the file names of the built-in layouts, and
the few facts read from a rank file's top level (checkpoint version, module key).

Which files form a checkpoint is each format's business (:mod:`reshard.formats`: Megatron-LM
folders, DeepSpeed ``mp_rank_XX`` files and descriptors, DeepSpeed pipeline layer files); they
all produce this one grid, which is all the planner sees.

Files are kept as a grid of rows of TP files; ``files`` is that grid flattened row by row, so a
file's index is ``row * TP + tp`` (for PP = 1 and EP = 1, its tensor-parallel rank). A row is a
pipeline stage, or with expert parallelism (MoE) one expert-parallel rank of a stage: row
``pp * EP + ep`` (the dense weights are replicated over a stage's EP rows; each row holds its own
experts). A DeepSpeed pipeline
folder's layer files follow the ``mp_rank`` files as further rows of the grid, one row per layer
(``layer_ids``), so ``files[(PP + g) * TP + tp]`` is layer ``layer_ids[g]`` of rank ``tp``.

This module only deals with local paths; ``reshard.storage`` maps URLs onto them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointFormatError

RANK_FILE_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
#: Layer files of a pipeline run without a model-parallel axis (``PipeDataParallelTopology``).
LAYER_FILE_NO_MODEL_RE = re.compile(r"^layer_(\d+)-model_states\.pt$")
#: DeepSpeed ZeRO stage 3 saves one model-states file per (data-parallel rank, model-parallel rank),
#: holding only placeholders; the weights are partitioned over the matching ``*_optim_states.pt``.
ZERO3_MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MEGATRON_RANK_DIR_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
MEGATRON_FILE = "model_optim_rng.pt"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
ITER_DIR_RE = re.compile(r"^iter_(\d+)$")

#: ``SourceCheckpoint.format`` values; outputs are written in the format they were read in.
DEEPSPEED = "deepspeed"
MEGATRON = "megatron"
#: DeepSpeed pipeline parallelism: ``layer_LL-model_TT-model_states.pt`` plus module-less rank files.
DEEPSPEED_PIPE = "deepspeed-pipeline"
#: A DeepSpeed ZeRO stage 3 engine folder (``zero_pp_rank_D_mp_rank_TT_model_states.pt``).
DEEPSPEED_ZERO3 = "deepspeed-zero3"
SUPPORTED_VERSIONS: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)
MODULE_KEYS: tuple[str, ...] = ("module", "model")
AUTO = "auto"


@dataclass(frozen=True)
class SourceCheckpoint:
    """A located checkpoint: rank files (stage by stage, rank order) plus format-level settings.

    ``pp``: pipeline stages, ``ep``: expert-parallel ranks per stage (the grid's rows are
    ``files[r * tp : (r + 1) * tp]``, row ``r = stage * ep + expert rank``);
    ``iteration``: a Megatron iteration folder's name (``iter_0000100``, ``release``);
    ``aux``: files every grid file reads its tensors from (a torch_dist checkpoint's grid is its
    ``.metadata``; its ``common.pt`` and ``.distcp`` files are ``aux``): fetched, checked and
    recorded like the grid's files, needed by every target.
    """

    files: tuple[Path, ...]
    origin: str
    descriptor_version: float | None = None
    descriptor: dict[str, Any] | None = field(default=None, compare=False)
    format: str = DEEPSPEED
    pp: int = 1
    iteration: str | None = None
    layer_ids: tuple[int, ...] = ()
    aux: tuple[Path, ...] = ()
    ep: int = 1
    #: Expert tensor parallelism (MoE; None: the TP): a routed expert's weights are split over this
    #: many ranks, held by grid positions ``0 .. etp-1`` of their EP row (see ``holes``).
    etp: int | None = None
    #: Grid positions no file of their own stands at (Megatron-LM writes one file per (TP rank, EP
    #: rank) *that some process holds*: with ETP != TP not every pair). As located they repeat a file
    #: of their row; the format's :meth:`~reshard.formats.base.CheckpointFormat.axes` explains them
    #: from the saved args (and fills them with the files holding what the planner reads there) or
    #: refuses the checkpoint as incomplete.
    holes: tuple[int, ...] = ()
    #: Virtual pipeline stages per rank file (Megatron-LM's interleaved schedule): each file holds
    #: ``model0 .. model{chunks-1}``. The grid then has a row per *model chunk*: stage ``s`` of
    #: ``pp`` is chunk ``(s % pipeline_ranks, s // pipeline_ranks)`` (megatron-core's order, see
    #: :mod:`reshard.core.pipeline_stages`), its files those of its pipeline rank, read through
    #: their ``model{s // pipeline_ranks}``.
    chunks: int = 1

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline-parallel ranks (``pp`` counts model chunks: ranks x virtual stages)."""
        return self.pp // self.chunks

    def chunk_of(self, index: int) -> int:
        """The virtual stage of the model chunk grid position ``index`` reads."""
        return index // self.tp // self.ep // self.pipeline_ranks

    @property
    def rows(self) -> int:
        """Rows of rank files: one per (pipeline stage, expert-parallel rank)."""
        return self.pp * self.ep

    @property
    def tp(self) -> int:
        return len(self.files) // (self.rows + len(self.layer_ids))

    @property
    def expert_tp(self) -> int:
        """The TP degree routed experts are split over (MoE)."""
        return self.tp if self.etp is None else self.etp

    def layer_file_index(self, group: int, rank: int) -> int:
        """Position in ``files`` of DeepSpeed pipeline layer ``layer_ids[group]``, TP rank ``rank``."""
        return (self.rows + group) * self.tp + rank

    def index(self, row: int, rank: int) -> int:
        """Position of (grid row, tensor-parallel rank) in ``files`` (a row is a stage when EP = 1)."""
        return row * self.tp + rank

    @property
    def relative_names(self) -> tuple[str, ...]:
        """Each file's path relative to the folder it was located from (Megatron rank files are
        all named ``model_optim_rng.pt``; their folders tell them apart)."""
        return self._relative(self.files)

    @property
    def distinct_files(self) -> tuple[Path, ...]:
        """Every file the checkpoint reads, each once: the grid's (a grid may repeat a file, see
        ``holes``) and ``aux``. What sizes, listings and the manifest count."""
        return tuple(dict.fromkeys((*self.files, *self.aux)))

    @property
    def relative_distinct_files(self) -> tuple[str, ...]:
        """:attr:`distinct_files` relative to the folder the checkpoint was located from."""
        return self._relative(self.distinct_files)

    def _relative(self, paths: tuple[Path, ...]) -> tuple[str, ...]:
        root = Path(self.origin)
        root = root if root.is_dir() else root.parent
        return tuple(f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name for f in paths)


def rank_file_name(rank: int) -> str:
    """DeepSpeed's name for a tensor-parallel rank's model-states file."""
    return f"mp_rank_{rank:02d}_model_states.pt"


def layer_file_name(layer: int, rank: int) -> str:
    """DeepSpeed's name for one pipeline layer's file of one tensor-parallel rank
    (``PipelineModule.ckpt_layer_path``: ``layer_{idx:02d}-model_{rank:02d}-model_states.pt``)."""
    return f"layer_{layer:02d}-model_{rank:02d}-model_states.pt"


def megatron_file_name(iteration: str, rank: int, stage: int, pp: int, expert_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's path of one rank's file, relative to the run folder: ``mp_rank_TT``, then
    ``_PPP`` when PP > 1, then ``_EEE`` when EP > 1 (Megatron-LM's ``get_checkpoint_name``)."""
    folder = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "") + (f"_{expert_rank:03d}" if ep > 1 else "")
    return f"{iteration}/{folder}/{MEGATRON_FILE}"


def iteration_dir(text: str) -> str | None:
    """The iteration folder ``latest_checkpointed_iteration.txt`` names (``1000`` -> ``iter_0001000``,
    ``release``), or None for any other text: the inverse of :func:`iteration_text`."""
    text = text.strip()
    if text == "release":
        return "release"
    return f"iter_{int(text):07d}" if text.isdigit() else None


def iteration_text(iteration: str) -> str:
    """What Megatron-LM writes to ``latest_checkpointed_iteration.txt`` for an iteration folder."""
    m = ITER_DIR_RE.match(iteration)
    return str(int(m.group(1))) if m else iteration


def parse_version(value: Any, where: str) -> float:
    """Checkpoint version as a float in SUPPORTED_VERSIONS; anything else is refused."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = None
    if v is None or v not in SUPPORTED_VERSIONS:
        raise CheckpointFormatError(f"unknown checkpoint_version {value!r}", culprit=where,
                                    hint="supported versions are 0, 1.0, 2.0, 3.0; override with --version")
    return v


def choose_module_key(sd: dict[str, Any], requested: str, where: str) -> str:
    """The state-dict entry holding the module: ``auto`` needs exactly one of module/model."""
    if requested != AUTO:
        if requested not in sd:
            raise CheckpointFormatError(f"has no {requested!r} entry", culprit=where,
                                        hint=f"top-level keys are {sorted(sd)[:10]}; pass --module-key")
        return requested
    present = [k for k in MODULE_KEYS if k in sd]
    if not present and "model0" in sd:
        raise CheckpointFormatError("holds model0, model1, ...: a rank file of Megatron-LM's interleaved "
                                    "(virtual) pipeline", culprit=where,
                                    hint="point reshard at the Megatron-LM run or iteration folder it belongs to")
    if len(present) != 1:
        what = "both 'module' and 'model'" if present else "neither 'module' nor 'model'"
        raise CheckpointFormatError(f"has {what} entries", culprit=where,
                                    hint="pass --module-key to choose the module state dict")
    return present[0]
