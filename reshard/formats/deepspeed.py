"""DeepSpeed's per-rank layout: a folder of ``mp_rank_XX_model_states.pt`` files (one per
tensor-parallel rank, the module under ``module``), or a DeepSpeed checkpoint descriptor JSON::

    {"type": "Megatron", "checkpoints": [...], "version": 2.0,
     "parallelization": "tp", "mp_size": 8, "base_dir": "..."}

whose file list is relative to ``base_dir`` (or the JSON's folder). Also a ZeRO stage 3 engine folder
(``zero_pp_rank_R_mp_rank_TT_model_states.pt`` holding placeholders; the weights are partitioned over
the optimizer files): converted with ``--weights master``, refused with what to do otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from reshard.core.errors import CheckpointFormatError, StorageError
from reshard.core.source import (
    DEEPSPEED,
    DEEPSPEED_ZERO3,
    RANK_FILE_RE,
    ZERO3_MODEL_FILE_RE,
    SourceCheckpoint,
    choose_module_key,
    parse_version,
    rank_file_name,
)
from reshard.core.zero_master import OPTIM_FILE_PATTERN, OPTIM_FILE_RE, master_module, master_module_zero3, optim_files
from reshard.formats.base import CheckpointFormat, check_contiguous

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan

#: The descriptor written beside DeepSpeed-layout outputs (loadable by DeepSpeed's SDLoaderFactory).
DESCRIPTOR_NAME = "ds_checkpoint.json"


class DeepSpeedFormat(CheckpointFormat):
    """DeepSpeed mp_rank_XX_model_states.pt files (a global_stepN folder), beside their ZeRO optimizer files."""

    name = DEEPSPEED
    title = "DeepSpeed mp_rank_XX_model_states"
    priority = 30
    patterns = (re.compile(r"(^|/)mp_rank_\d+(_\d+)?_model_states\.pt$"),)
    markers = (re.compile(r"(^|/)latest$"),)

    def detect(self, folder: Path) -> bool:
        return any(RANK_FILE_RE.match(c.name) and c.is_file() for c in folder.iterdir())

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        return rank_file_name(tp_rank)

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str]:
        return {DESCRIPTOR_NAME: json.dumps(descriptor_for(plan, names), indent=2)}

    def optional_patterns(self, weights: frozenset[str]) -> tuple[re.Pattern[str], ...]:
        return _optimizer_patterns(weights)

    def companions(self, source: SourceCheckpoint, weights: frozenset[str]) -> tuple[Path, ...]:
        if weights == {"module"}:
            return ()
        folders = sorted({f.parent for f in source.files})
        return tuple(c for d in folders for c in sorted(d.iterdir()) if OPTIM_FILE_RE.match(c.name))

    def open(self, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
        """``--weights master`` (or ``exp_avg`` / ``exp_avg_sq``): the module's parameters replaced by
        the fp32 master weights (or Adam's moments) of the ZeRO stage 1/2 optimizer files beside the
        rank file (:mod:`reshard.core.zero_master`)."""
        if options.weights == "module":
            return super().open(source, options, index)
        path = source.files[index]
        sd = dict(self.load(path))
        key = choose_module_key(sd, options.module_key, str(path))
        if not isinstance(sd.get(key), dict):
            return sd  # the planner names what is wrong with it
        tp_rank = int(m.group(1)) if (m := RANK_FILE_RE.match(path.name)) else index
        sd[key] = master_module(sd[key], sd, optim_files(path.parent, tp_rank, str(path)), options.weights)
        return sd

    def locate(self, path: Path) -> SourceCheckpoint:
        folder = path
        by_rank: dict[int, list[Path]] = {}
        for child in sorted(folder.iterdir()):
            m = RANK_FILE_RE.match(child.name)
            if m and child.is_file():
                by_rank.setdefault(int(m.group(1)), []).append(child)
        dups = {r: fs for r, fs in by_rank.items() if len(fs) > 1}
        if dups:
            r, fs = next(iter(dups.items()))
            raise CheckpointFormatError(f"rank {r} appears in {len(fs)} files: {', '.join(f.name for f in fs)}",
                                        culprit=str(folder), hint="keep exactly one file per rank")
        check_contiguous(sorted(by_rank), str(folder))
        return SourceCheckpoint(tuple(by_rank[r][0] for r in sorted(by_rank)), origin=str(folder))


class DeepSpeedZero3Format(CheckpointFormat):
    """DeepSpeed ZeRO stage 3 folder, read for its fp32 master weights. It holds
    ``zero_pp_rank_D_mp_rank_TT_model_states.pt`` per (data-parallel,
    tensor-parallel) rank, whose modules hold only placeholders; the weights are partitioned over the
    ``*_optim_states.pt`` files. Converted with ``--weights master`` (the fp32 master weights, written
    in DeepSpeed's per-rank layout); refused otherwise, with what to do."""

    name = DEEPSPEED_ZERO3
    writes = False  # read for --weights master; written as DeepSpeed per-rank files
    priority = 40
    patterns = (re.compile(r"(^|/)zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$"),)
    writes_as = DEEPSPEED

    def detect(self, folder: Path) -> bool:
        return any(ZERO3_MODEL_FILE_RE.match(c.name) for c in folder.iterdir())

    def shard_role(self, name: str, listing: Sequence[str]) -> str | None:
        return None  # read whole by open(); its files are not checked one by one

    def optional_patterns(self, weights: frozenset[str]) -> tuple[re.Pattern[str], ...]:
        return _optimizer_patterns(weights)

    def locate(self, path: Path) -> SourceCheckpoint:
        """Data-parallel rank 0's model states file of each TP rank, as the grid (the other ranks'
        files are read beside it: :meth:`companions`)."""
        grid = zero3_grid(path)
        return SourceCheckpoint(tuple(grid[t][0] for t in sorted(grid)), origin=str(path), format=self.name)

    def companions(self, source: SourceCheckpoint, weights: frozenset[str]) -> tuple[Path, ...]:
        if weights == {"module"}:
            return ()
        folder = source.files[0].parent
        others = [f for files in zero3_grid(folder).values() for f in files[1:]]
        return tuple(others) + tuple(c for c in sorted(folder.iterdir()) if OPTIM_FILE_RE.match(c.name))

    def open(self, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
        if options.weights == "module":
            first = source.files[0].name
            raise CheckpointFormatError(
                f"a DeepSpeed ZeRO stage 3 checkpoint ({first}, ...): its model-states files hold only "
                f"placeholders, the weights are partitioned over the *_optim_states.pt files of every "
                f"data-parallel rank", culprit=source.origin,
                hint="convert the optimizer's fp32 weights with --weights master (or write a universal "
                     "checkpoint: --to universal), consolidate them with the zero_to_fp32.py script DeepSpeed "
                     "saved beside the checkpoint, or save with stage3_gather_16bit_weights_on_model_save=true "
                     "and convert that")
        path = source.files[index]
        tp_rank = int(ZERO3_MODEL_FILE_RE.match(path.name).group(2))
        states = [self.load(f) for f in zero3_grid(path.parent)[tp_rank]]
        sd = dict(states[0])
        key = choose_module_key(sd, options.module_key, str(path))
        if not isinstance(sd.get(key), dict):
            return sd  # the planner names what is wrong with it
        sd[key] = master_module_zero3(sd[key], states, optim_files(path.parent, tp_rank, str(path)), options.weights)
        sd.pop("frozen_param_fragments", None)  # consumed: the module holds the whole frozen parameters
        sd["ds_config"] = _gathered(sd.get("ds_config"))
        return sd


def _optimizer_patterns(weights: frozenset[str]) -> tuple[re.Pattern[str], ...]:
    """The ZeRO optimizer files, listed only when the conversion reads optimizer states (they hold
    ~12 bytes per parameter: never fetched for a conversion of the module's own weights)."""
    return () if weights == {"module"} else (OPTIM_FILE_PATTERN,)


def _gathered(ds_config: Any) -> Any:
    """The saved config, saying that the module holds whole tensors: a ZeRO-3 checkpoint converted
    from its master weights is what ``stage3_gather_16bit_weights_on_model_save`` saves (whole
    weights in the model states), so reading the output again needs no optimizer files."""
    if not isinstance(ds_config, dict) or not isinstance(ds_config.get("zero_optimization"), dict):
        return ds_config
    zero = {k: v for k, v in ds_config["zero_optimization"].items()
            if k not in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")}
    return {**ds_config, "zero_optimization": {**zero, "gather_16bit_weights_on_model_save": True}}


def zero3_grid(folder: Path) -> dict[int, list[Path]]:
    """TP rank -> its model states files by data-parallel rank (0..D-1 for every TP rank)."""
    grid: dict[int, dict[int, Path]] = {}
    for child in sorted(folder.iterdir()):
        m = ZERO3_MODEL_FILE_RE.match(child.name)
        if m and child.is_file():
            grid.setdefault(int(m.group(2)), {})[int(m.group(1))] = child
    check_contiguous(sorted(grid), str(folder))
    dps = {t: sorted(files) for t, files in grid.items()}
    for t, ranks in dps.items():
        check_contiguous(ranks, f"{folder} (data-parallel ranks of TP rank {t})")
        if len(ranks) != len(dps[0]):
            raise CheckpointFormatError(f"TP rank {t} has {len(ranks)} data-parallel model states files, TP rank 0 "
                                        f"{len(dps[0])}", culprit=str(folder),
                                        hint="supply every zero_pp_rank_D_mp_rank_TT_model_states.pt file")
    return {t: [files[d] for d in sorted(files)] for t, files in grid.items()}


class DeepSpeedDescriptorFormat(CheckpointFormat):
    """DeepSpeed descriptor JSON ({"type": "Megatron", "checkpoints": [...]}), naming mp_rank_XX files. What it
    locates is a DeepSpeed per-rank checkpoint."""

    name = "deepspeed-descriptor"
    writes = False  # what it locates is written as DeepSpeed per-rank files (and a new descriptor)
    priority = 90
    markers = (re.compile(r"(^|/)[^/]+\.json$"),)

    def detect_file(self, path: Path) -> bool:
        return path.suffix.lower() == ".json"

    def locate(self, path: Path) -> SourceCheckpoint:
        return _locate_descriptor(path)

    def descriptor_entries(self, raw: bytes, where: str) -> list[str] | None:
        """The ``checkpoints`` files under ``base_dir``, which must stay inside the descriptor's folder
        (an object store has no absolute paths to follow, and ``..`` would leave the prefix)."""
        try:
            data = json.loads(raw)
            entries = list(data["checkpoints"])
            base = data.get("base_dir") or ""
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StorageError(f"malformed descriptor JSON: {exc}", culprit=where, hint="fix the JSON") from None
        out = []
        for e in entries:
            rel = PurePosixPath(str(base), str(e)) if base else PurePosixPath(str(e))
            if rel.is_absolute() or ".." in rel.parts or "://" in str(rel):
                raise StorageError(f"descriptor entry {e!r} (base_dir {base!r}) is not a relative path",
                                   culprit=where, hint="remote descriptors must list files relative to their folder")
            out.append(str(rel))
        return out


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


def descriptor_for(plan: Plan, names: list[str]) -> dict[str, Any]:
    """DeepSpeed checkpoint descriptor of the new layout (loadable by DeepSpeed's factory)."""
    d: dict[str, Any] = {"type": "Megatron", "version": plan.version, "checkpoints": names,
                         "parallelization": "tp", "mp_size": plan.target_tp, "quantized": plan.options.int8}
    if plan.options.int8:
        d["quantization"] = {"bits": plan.options.bits, "groups": plan.options.groups,
                             "mlp_extra_grouping": plan.options.mlp_extra_grouping,
                             "key": "reshard_quantization"}
    return d
