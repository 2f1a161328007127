"""Find a checkpoint's rank files and read the facts the layout depends on.

Two inputs are accepted:

* a folder of ``mp_rank_XX_model_states.pt`` files (one per tensor-parallel rank);
* a DeepSpeed checkpoint descriptor JSON::

      {"type": "Megatron", "checkpoints": [...], "version": 2.0,
       "parallelization": "tp", "mp_size": 8, "base_dir": "..."}

  whose file list is relative to ``base_dir`` (or the JSON's folder);
* a Megatron-LM run folder (holding ``latest_checkpointed_iteration.txt``) or one of its
  iteration folders ``iter_XXXXXXX`` / ``release``, with one ``mp_rank_TT[_PPP]/model_optim_rng.pt``
  per tensor-parallel rank ``TT`` and pipeline stage ``PPP`` (``_PPP`` only when PP > 1).

* a DeepSpeed pipeline-parallel folder (``PipelineModule`` / Megatron-DeepSpeed ``GPTModelPipe``):
  one ``layer_LL-model_TT-model_states.pt`` per layer that has weights and tensor-parallel rank
  ``TT`` (``LL``: the layer's index in the whole pipeline, whatever stage held it), beside
  ``mp_rank_KK_model_states.pt`` files whose ``module`` is None, one per (stage, TP rank),
  ``KK = stage * TP + TT``. TP is the number of model ranks of the layer files, PP the number of
  ``mp_rank`` files over TP (as DeepSpeed's ``reshape_3d_utils`` derives them).

Files are kept as a grid ``stages[pp][tp]``; ``files`` is that grid flattened stage by stage, so a
file's index is ``pp * TP + tp`` (for PP = 1, its tensor-parallel rank). A DeepSpeed pipeline
folder's layer files follow the ``mp_rank`` files as further rows of the grid, one row per layer
(``layer_ids``), so ``files[(PP + g) * TP + tp]`` is layer ``layer_ids[g]`` of rank ``tp``.

This module only deals with local paths; ``reshard.storage`` maps URLs onto it.
"""

from __future__ import annotations

import json
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
MEGATRON_RANK_DIR_RE = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(_\d+)?$")
MEGATRON_FILE = "model_optim_rng.pt"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
ITER_DIR_RE = re.compile(r"^iter_(\d+)$")

#: ``SourceCheckpoint.format`` values; outputs are written in the format they were read in.
DEEPSPEED = "deepspeed"
MEGATRON = "megatron"
#: DeepSpeed pipeline parallelism: ``layer_LL-model_TT-model_states.pt`` plus module-less rank files.
DEEPSPEED_PIPE = "deepspeed-pipeline"
SUPPORTED_VERSIONS: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)
MODULE_KEYS: tuple[str, ...] = ("module", "model")
AUTO = "auto"


@dataclass(frozen=True)
class SourceCheckpoint:
    """A located checkpoint: rank files (stage by stage, rank order) plus format-level settings.

    ``pp``: pipeline stages (the grid is ``files[s * tp : (s + 1) * tp]`` per stage);
    ``iteration``: a Megatron iteration folder's name (``iter_0000100``, ``release``).
    """

    files: tuple[Path, ...]
    origin: str
    descriptor_version: float | None = None
    descriptor: dict[str, Any] | None = field(default=None, compare=False)
    format: str = DEEPSPEED
    pp: int = 1
    iteration: str | None = None
    layer_ids: tuple[int, ...] = ()

    @property
    def tp(self) -> int:
        return len(self.files) // (self.pp + len(self.layer_ids))

    def layer_file_index(self, group: int, rank: int) -> int:
        """Position in ``files`` of DeepSpeed pipeline layer ``layer_ids[group]``, TP rank ``rank``."""
        return (self.pp + group) * self.tp + rank

    def stage_files(self, stage: int) -> tuple[Path, ...]:
        """Stage ``stage``'s rank files in tensor-parallel rank order."""
        return self.files[stage * self.tp:(stage + 1) * self.tp]

    def index(self, stage: int, rank: int) -> int:
        """Position of (stage, tensor-parallel rank) in ``files``."""
        return stage * self.tp + rank

    @property
    def relative_names(self) -> tuple[str, ...]:
        """Each file's path relative to the folder it was located from (Megatron rank files are
        all named ``model_optim_rng.pt``; their folders tell them apart)."""
        root = Path(self.origin)
        root = root if root.is_dir() else root.parent
        return tuple(f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name for f in self.files)


def rank_file_name(rank: int) -> str:
    """DeepSpeed's name for a tensor-parallel rank's model-states file."""
    return f"mp_rank_{rank:02d}_model_states.pt"


def layer_file_name(layer: int, rank: int) -> str:
    """DeepSpeed's name for one pipeline layer's file of one tensor-parallel rank
    (``PipelineModule.ckpt_layer_path``: ``layer_{idx:02d}-model_{rank:02d}-model_states.pt``)."""
    return f"layer_{layer:02d}-model_{rank:02d}-model_states.pt"


def megatron_file_name(iteration: str, rank: int, stage: int, pp: int) -> str:
    """Megatron-LM's path of one rank's file, relative to the run folder."""
    folder = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
    return f"{iteration}/{folder}/{MEGATRON_FILE}"


def iteration_text(iteration: str) -> str:
    """What Megatron-LM writes to ``latest_checkpointed_iteration.txt`` for an iteration folder."""
    m = ITER_DIR_RE.match(iteration)
    return str(int(m.group(1))) if m else iteration


def locate(src: str | Path) -> SourceCheckpoint:
    """Resolve a folder or descriptor JSON into its ordered rank files (validated)."""
    p = Path(src)
    if not p.exists():
        raise CheckpointFormatError("no such file or folder", culprit=str(p),
                                    hint="pass a folder of mp_rank_XX_model_states.pt files or a descriptor JSON")
    if p.is_dir():
        if (p / MEGATRON_LATEST).is_file():
            return _locate_megatron_run(p)
        if any(MEGATRON_RANK_DIR_RE.match(c.name) and c.is_dir() for c in p.iterdir()):
            return _locate_megatron_iteration(p, str(p))
        return _locate_folder(p)
    if p.suffix.lower() == ".json":
        return _locate_descriptor(p)
    raise CheckpointFormatError("not a checkpoint folder or descriptor JSON", culprit=str(p),
                                hint="pass the folder that holds mp_rank_XX_model_states.pt files")


def _locate_folder(folder: Path) -> SourceCheckpoint:
    if any(LAYER_FILE_RE.match(c.name) or LAYER_FILE_NO_MODEL_RE.match(c.name) for c in folder.iterdir()):
        return _locate_deepspeed_pipeline(folder)
    by_rank: dict[int, list[Path]] = {}
    for child in sorted(folder.iterdir()):
        m = RANK_FILE_RE.match(child.name)
        if m and child.is_file():
            by_rank.setdefault(int(m.group(1)), []).append(child)
    if not by_rank:
        zero3 = sorted(c.name for c in folder.iterdir() if ZERO3_MODEL_FILE_RE.match(c.name))
        if zero3:
            raise CheckpointFormatError(
                f"a DeepSpeed ZeRO stage 3 checkpoint ({zero3[0]}, ...): its model-states files hold only "
                f"placeholders, the weights are partitioned over the *_optim_states.pt files of every "
                f"data-parallel rank", culprit=str(folder),
                hint="consolidate the weights with the zero_to_fp32.py script DeepSpeed saved beside the "
                     "checkpoint, or save with stage3_gather_16bit_weights_on_model_save=true, and convert that")
        dist = [c.name for c in folder.iterdir() if c.suffix == ".distcp" or c.name in (".metadata", "metadata.json")]
        iters = sorted(c.name for c in folder.iterdir() if c.is_dir() and ITER_DIR_RE.match(c.name))
        if dist:
            hint = ("this is a torch_dist (distributed) checkpoint; save or convert it with Megatron-LM's "
                    "--ckpt-format torch first")
        elif iters:
            hint = f"a Megatron-LM run folder needs {MEGATRON_LATEST}, or point at one iteration folder ({iters[-1]})"
        else:
            hint = "point at the global_stepN folder that holds the model-states files"
        raise CheckpointFormatError("holds no mp_rank_XX_model_states.pt files", culprit=str(folder),
                                    hint=hint)
    dups = {r: fs for r, fs in by_rank.items() if len(fs) > 1}
    if dups:
        r, fs = next(iter(dups.items()))
        raise CheckpointFormatError(f"rank {r} appears in {len(fs)} files: {', '.join(f.name for f in fs)}",
                                    culprit=str(folder), hint="keep exactly one file per rank")
    _check_contiguous(sorted(by_rank), str(folder))
    return SourceCheckpoint(tuple(by_rank[r][0] for r in sorted(by_rank)), origin=str(folder))


def _locate_deepspeed_pipeline(folder: Path) -> SourceCheckpoint:
    """A DeepSpeed pipeline folder: every layer file for every TP rank, and TP x PP rank files."""
    layers: dict[int, dict[int, Path]] = {}
    ranks: list[int] = []
    for child in sorted(folder.iterdir()):
        if LAYER_FILE_NO_MODEL_RE.match(child.name):
            raise CheckpointFormatError(f"{child.name} has no model-parallel rank in its name", culprit=str(folder),
                                        hint="only pipelines saved with a model axis (PipeModelDataParallelTopology, "
                                             "as Megatron-DeepSpeed does: layer_XX-model_YY-...) are supported")
        m = LAYER_FILE_RE.match(child.name)
        if m and child.is_file():
            layers.setdefault(int(m.group(1)), {})[int(m.group(2))] = child
        m = RANK_FILE_RE.match(child.name)
        if m and child.is_file():
            ranks.append(int(m.group(1)))
    tp = 1 + max(r for by_rank in layers.values() for r in by_rank)
    for layer, by_rank in sorted(layers.items()):
        missing = sorted(set(range(tp)) - set(by_rank))
        if missing:
            raise CheckpointFormatError(f"layer {layer:02d} lacks the files of tensor-parallel ranks {missing} "
                                        f"(other layers have {tp} ranks)",
                                        culprit=str(folder / layer_file_name(layer, missing[0])),
                                        hint="copy the missing layer files")
    if not ranks:
        raise CheckpointFormatError("holds DeepSpeed pipeline layer files but no mp_rank_XX_model_states.pt files",
                                    culprit=str(folder), hint="copy the rank files (they hold args and the "
                                                              "iteration) from the same global_step folder")
    _check_contiguous(sorted(ranks), str(folder))
    if len(ranks) % tp:
        raise CheckpointFormatError(f"{len(ranks)} mp_rank files are not a multiple of the {tp} tensor-parallel "
                                    f"ranks of the layer files", culprit=str(folder),
                                    hint="supply one mp_rank file per (pipeline stage, TP rank)")
    ids = tuple(sorted(layers))
    files = [folder / rank_file_name(k) for k in range(len(ranks))]
    files += [layers[layer][r] for layer in ids for r in range(tp)]
    return SourceCheckpoint(tuple(files), origin=str(folder), format=DEEPSPEED_PIPE, pp=len(ranks) // tp,
                            layer_ids=ids)


def _check_contiguous(ranks: list[int], where: str) -> None:
    expected = list(range(len(ranks)))
    if ranks != expected:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(
            f"rank files are not 0..N-1: found ranks {ranks}" + (f", missing {missing}" if missing else ""),
            culprit=where, hint="copy the missing rank files, or remove stray extra ones")


def _locate_megatron_run(run: Path) -> SourceCheckpoint:
    """A Megatron-LM run folder: ``latest_checkpointed_iteration.txt`` names the iteration."""
    latest = run / MEGATRON_LATEST
    text = latest.read_text().strip()
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise CheckpointFormatError(f"holds {text[:40]!r}, not an iteration number or 'release'",
                                    culprit=str(latest), hint="point at the iteration folder instead")
    folder = run / name
    if not folder.is_dir():
        raise CheckpointFormatError(f"names iteration {text} but {name}/ does not exist", culprit=str(latest),
                                    hint="point at an existing iteration folder instead")
    return _locate_megatron_iteration(folder, str(run))


def _locate_megatron_iteration(folder: Path, origin: str) -> SourceCheckpoint:
    """An iteration folder of ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files, as a (pp, tp) grid."""
    grid: dict[tuple[int, int], Path] = {}
    staged: set[bool] = set()
    for child in sorted(folder.iterdir()):
        m = MEGATRON_RANK_DIR_RE.match(child.name)
        if not (m and child.is_dir()):
            continue
        if m.group(3):
            raise CheckpointFormatError(f"{child.name}: expert-parallel (MoE) checkpoints are not supported",
                                        culprit=str(folder), hint="reshard handles dense GPT models only")
        f = child / MEGATRON_FILE
        if not f.is_file():
            raise CheckpointFormatError(f"{child.name}/ holds no {MEGATRON_FILE}", culprit=str(folder),
                                        hint="copy the missing rank file (distributed-optimizer files alone "
                                             "hold no weights)")
        tp, pp = int(m.group(1)), int(m.group(2)) if m.group(2) is not None else 0
        staged.add(m.group(2) is not None)
        if (pp, tp) in grid:
            raise CheckpointFormatError(f"rank {tp} of stage {pp} appears twice ({child.name})", culprit=str(folder),
                                        hint="keep exactly one folder per rank")
        grid[(pp, tp)] = f
    if len(staged) > 1:
        raise CheckpointFormatError("mixes mp_rank_TT and mp_rank_TT_PPP folders", culprit=str(folder),
                                    hint="remove stray folders from another pipeline layout")
    n_pp = 1 + max(pp for pp, _ in grid)
    n_tp = 1 + max(tp for _, tp in grid)
    for stage in range(n_pp):
        ranks = sorted(tp for pp, tp in grid if pp == stage)
        if not ranks:
            raise CheckpointFormatError(f"pipeline stage {stage} has no rank folders", culprit=str(folder),
                                        hint="copy the missing mp_rank_TT_PPP folders")
        _check_contiguous(ranks, f"{folder} (stage {stage})")
        if len(ranks) != n_tp:
            missing = sorted(set(range(n_tp)) - set(ranks))
            raise CheckpointFormatError(f"stage {stage} lacks tensor-parallel ranks {missing}", culprit=str(folder),
                                        hint="copy the missing rank folders")
    files = tuple(grid[(s, t)] for s in range(n_pp) for t in range(n_tp))
    return SourceCheckpoint(files, origin=origin, format=MEGATRON, pp=n_pp, iteration=folder.name)


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


def _locate_descriptor(path: Path) -> SourceCheckpoint:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"malformed descriptor JSON: {exc}", culprit=str(path),
                                    hint="fix the JSON syntax") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError("descriptor must be a JSON object", culprit=str(path))
    kind = data.get("type")
    if not isinstance(kind, str) or kind.lower() != "megatron":
        raise CheckpointFormatError(f"descriptor type {kind!r} is not supported", culprit=str(path),
                                    hint='only "type": "Megatron" checkpoints can be resharded')
    par = data.get("parallelization", "pp")
    if par != "tp":
        raise CheckpointFormatError(f'parallelization {par!r} is not supported', culprit=str(path),
                                    hint='set "parallelization": "tp" for tensor-parallel shards')
    ckpts = data.get("checkpoints")
    if not isinstance(ckpts, list) or not ckpts or not all(isinstance(c, str) for c in ckpts):
        raise CheckpointFormatError('"checkpoints" must be a non-empty list of file names',
                                    culprit=str(path))
    base = data.get("base_dir")
    base_dir = (path.parent / base) if isinstance(base, str) and base else path.parent
    files = []
    for entry in ckpts:
        rel = Path(entry)
        if rel.is_absolute() or ".." in rel.parts:
            raise CheckpointFormatError(f"checkpoint entry {entry!r} escapes base_dir", culprit=str(path),
                                        hint="list files relative to base_dir, without '..'")
        f = base_dir / rel
        if not f.is_file():
            raise CheckpointFormatError(f"listed checkpoint {entry!r} does not exist under {base_dir}",
                                        culprit=str(path), hint="fix base_dir or the file list")
        files.append(f)
    if len(set(files)) != len(files):
        raise CheckpointFormatError("the same file is listed twice", culprit=str(path))
    mp = data.get("mp_size")
    if mp is not None and mp != len(files):
        raise CheckpointFormatError(f"mp_size {mp} but {len(files)} checkpoints listed", culprit=str(path),
                                    hint="list exactly one file per tensor-parallel rank")
    version = data.get("version")
    dv = None if version is None else parse_version(version, str(path))
    return SourceCheckpoint(tuple(files), origin=str(path), descriptor_version=dv, descriptor=data)


def choose_module_key(sd: dict[str, Any], requested: str, where: str) -> str:
    """The state-dict entry holding the module: ``auto`` needs exactly one of module/model."""
    if requested != AUTO:
        if requested not in sd:
            raise CheckpointFormatError(f"has no {requested!r} entry", culprit=where,
                                        hint=f"top-level keys are {sorted(sd)[:10]}; pass --module-key")
        return requested
    present = [k for k in MODULE_KEYS if k in sd]
    if not present and "model0" in sd:
        raise CheckpointFormatError("holds model0, model1, ...: an interleaved (virtual) pipeline checkpoint",
                                    culprit=where, hint="virtual pipeline stages are not supported; re-save "
                                                        "without --num-layers-per-virtual-pipeline-stage")
    if len(present) != 1:
        what = "both 'module' and 'model'" if present else "neither 'module' nor 'model'"
        raise CheckpointFormatError(f"has {what} entries", culprit=where,
                                    hint="pass --module-key to choose the module state dict")
    return present[0]
