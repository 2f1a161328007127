"""Find a checkpoint's rank files and read the facts the layout depends on.

Two inputs are accepted:

* a folder of ``mp_rank_XX_model_states.pt`` files (one per tensor-parallel rank);
* a DeepSpeed checkpoint descriptor JSON::

      {"type": "Megatron", "checkpoints": [...], "version": 2.0,
       "parallelization": "tp", "mp_size": 8, "base_dir": "..."}

  whose file list is relative to ``base_dir`` (or the JSON's folder).

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
SUPPORTED_VERSIONS: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0)
MODULE_KEYS: tuple[str, ...] = ("module", "model")
AUTO = "auto"


@dataclass(frozen=True)
class SourceCheckpoint:
    """A located checkpoint: rank files in rank order plus descriptor-level settings."""

    files: tuple[Path, ...]
    origin: str
    descriptor_version: float | None = None
    descriptor: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def tp(self) -> int:
        return len(self.files)


def rank_file_name(rank: int) -> str:
    """DeepSpeed's name for a tensor-parallel rank's model-states file."""
    return f"mp_rank_{rank:02d}_model_states.pt"


def locate(src: str | Path) -> SourceCheckpoint:
    """Resolve a folder or descriptor JSON into its ordered rank files (validated)."""
    p = Path(src)
    if not p.exists():
        raise CheckpointFormatError("no such file or folder", culprit=str(p),
                                    hint="pass a folder of mp_rank_XX_model_states.pt files or a descriptor JSON")
    if p.is_dir():
        return _locate_folder(p)
    if p.suffix.lower() == ".json":
        return _locate_descriptor(p)
    raise CheckpointFormatError("not a checkpoint folder or descriptor JSON", culprit=str(p),
                                hint="pass the folder that holds mp_rank_XX_model_states.pt files")


def _locate_folder(folder: Path) -> SourceCheckpoint:
    by_rank: dict[int, list[Path]] = {}
    for child in sorted(folder.iterdir()):
        m = RANK_FILE_RE.match(child.name)
        if m and child.is_file():
            by_rank.setdefault(int(m.group(1)), []).append(child)
    if not by_rank:
        layer_files = sorted(folder.glob("layer_*-model_*-model_states.pt"))
        hint = ("pipeline-parallel layer files are not supported yet" if layer_files
                else "point at the global_stepN folder that holds the model-states files")
        raise CheckpointFormatError("holds no mp_rank_XX_model_states.pt files", culprit=str(folder),
                                    hint=hint)
    dups = {r: fs for r, fs in by_rank.items() if len(fs) > 1}
    if dups:
        r, fs = next(iter(dups.items()))
        raise CheckpointFormatError(f"rank {r} appears in {len(fs)} files: {', '.join(f.name for f in fs)}",
                                    culprit=str(folder), hint="keep exactly one file per rank")
    _check_contiguous(sorted(by_rank), str(folder))
    return SourceCheckpoint(tuple(by_rank[r][0] for r in sorted(by_rank)), origin=str(folder))


def _check_contiguous(ranks: list[int], where: str) -> None:
    expected = list(range(len(ranks)))
    if ranks != expected:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(
            f"rank files are not 0..N-1: found ranks {ranks}" + (f", missing {missing}" if missing else ""),
            culprit=where, hint="copy the missing rank files, or remove stray extra ones")


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
    if len(present) != 1:
        what = "both 'module' and 'model'" if present else "neither 'module' nor 'model'"
        raise CheckpointFormatError(f"has {what} entries", culprit=where,
                                    hint="pass --module-key to choose the module state dict")
    return present[0]
