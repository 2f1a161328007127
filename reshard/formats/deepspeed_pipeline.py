"""DeepSpeed pipeline parallelism (``PipelineModule``, Megatron-DeepSpeed's ``GPTModelPipe``): one
``layer_LL-model_TT-model_states.pt`` per layer that has weights and tensor-parallel rank ``TT``
(``LL``: the layer's index in the whole pipeline, whatever stage held it), beside
``mp_rank_KK_model_states.pt`` files whose ``module`` is None, one per (stage, TP rank),
``KK = stage * TP + TT``. TP is the number of model ranks of the layer files, PP the number of
``mp_rank`` files over TP (as DeepSpeed's ``reshape_3d_utils`` derives them).

Each layer file is one row of the source grid (rows after the rank files' ``PP`` empty rows; see
:mod:`reshard.core.source`). Its keys are the layer module's own (``input_layernorm.weight``); their
canonical names are the legacy Megatron names the model family knows, by the layer's role
(:data:`reshard.models.megatron_gpt.PIPE_LAYER_NAMES`), so partitioning, checks and facts are those
of every other layout. The planner of this layout (:mod:`reshard.execution.ds_pipe`) writes layer
files back under the files' own keys: layer files are written from layer files only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from reshard.core.checks import check_same_keys
from reshard.core.errors import CheckpointFormatError
from reshard.core.plan_types import SourceRead, SourceStage
from reshard.core.shard_check import LAYER, PIPE_RANK
from reshard.core.source import (
    DEEPSPEED_PIPE,
    LAYER_FILE_NO_MODEL_RE,
    LAYER_FILE_RE,
    RANK_FILE_RE,
    SourceCheckpoint,
    choose_module_key,
    layer_file_name,
    rank_file_name,
)
from reshard.formats.base import CheckpointFormat, check_contiguous
from reshard.models.facts import int_arg
from reshard.models.megatron_gpt import EMBEDDING, FINAL_NORM, LM_HEAD, PIPE_LAYER_NAMES, TRANSFORMER, pipe_layer_role

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions

#: ``checkpoint_parallel_dimensions`` (DeepSpeed ``checkpoint/constants.py``).
PARALLEL_DIMS, PP_DEGREE, TP_DEGREE = "checkpoint_parallel_dimensions", "pp_degree", "tp_degree"


class DeepSpeedPipelineFormat(CheckpointFormat):
    """DeepSpeed pipeline-parallel folder: layer_LL-model_TT-model_states.pt per layer and TP rank."""

    name = DEEPSPEED_PIPE
    priority = 20
    patterns = (re.compile(r"(^|/)layer_\d+-model_\d+-model_states\.pt$"),
                re.compile(r"(^|/)mp_rank_\d+(_\d+)?_model_states\.pt$"))

    def detect(self, folder: Path) -> bool:
        return any(LAYER_FILE_RE.match(c.name) or LAYER_FILE_NO_MODEL_RE.match(c.name) for c in folder.iterdir())

    def shard_role(self, name: str, listing: Sequence[str]) -> str | None:
        """Layer files, and the module-less rank files *beside layer files* (elsewhere an
        ``mp_rank_XX_model_states.pt`` is a DeepSpeed rank file holding a module)."""
        path = PurePosixPath(name)
        if LAYER_FILE_RE.match(path.name) or LAYER_FILE_NO_MODEL_RE.match(path.name):
            return LAYER
        if RANK_FILE_RE.match(path.name) and any(
                PurePosixPath(n).parent == path.parent and LAYER_FILE_RE.match(PurePosixPath(n).name)
                for n in listing):
            return PIPE_RANK
        return None

    def locate(self, path: Path) -> SourceCheckpoint:
        return _locate_pipeline(path)

    def read(self, source: SourceCheckpoint, options: ReshardOptions, *, headers_only: bool = False) -> SourceRead:
        """The rank files (top-level entries, ``module`` None) as ``PP`` empty rows, then one row per
        layer file with its role and its keys' canonical names; the layer order and the saved degrees
        checked. Every file is read (layer files are small: ``headers_only`` changes nothing)."""
        n, pp = source.tp, source.pp
        names = [str(f) for f in source.files[:pp * n]]
        shards = [self.opened(source, options, i) for i in range(pp * n)]
        module_key = _check_rank_files(shards, names, options.module_key)
        _check_degrees(shards, names, shards[0].get("args"), source)
        rows = [SourceStage(index=s, names=[], modules=[]) for s in range(pp)]
        for g in range(len(source.layer_ids)):
            idx = [source.layer_file_index(g, r) for r in range(n)]
            files = [source.files[i] for i in idx]
            modules = [_layer_dict(self.opened(source, options, i), str(f)) for i, f in zip(idx, files)]
            check_same_keys(modules, [str(f) for f in files])
            role = layer_role(modules[0])
            prefix, renamed = PIPE_LAYER_NAMES[role]
            rows.append(SourceStage(index=pp + g, names=[str(f) for f in files], modules=modules, role=role,
                                    canonical={k: renamed.get(k, prefix + k) for k in modules[0]}))
        _check_order([r.role for r in rows[pp:]], source)
        return SourceRead(shards=shards, names=names, module_key=module_key, stages=rows)


def _locate_pipeline(folder: Path) -> SourceCheckpoint:
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
    check_contiguous(sorted(ranks), str(folder))
    if len(ranks) % tp:
        raise CheckpointFormatError(f"{len(ranks)} mp_rank files are not a multiple of the {tp} tensor-parallel "
                                    f"ranks of the layer files", culprit=str(folder),
                                    hint="supply one mp_rank file per (pipeline stage, TP rank)")
    ids = tuple(sorted(layers))
    files = [folder / rank_file_name(k) for k in range(len(ranks))]
    files += [layers[layer][r] for layer in ids for r in range(tp)]
    return SourceCheckpoint(tuple(files), origin=str(folder), format=DEEPSPEED_PIPE, pp=len(ranks) // tp,
                            layer_ids=ids)


def layer_role(module: dict[str, Any]) -> str:
    """A layer file's role, from its keys (:func:`reshard.models.megatron_gpt.pipe_layer_role`)."""
    return pipe_layer_role(set(module))


def _check_rank_files(shards: list[dict[str, Any]], names: list[str], module_key: str | None) -> str:
    """The rank files' module key; in pipeline mode the engine saves ``module`` as None."""
    key = choose_module_key(shards[0], module_key, names[0])
    for sd, name in zip(shards, names):
        if sd.get(key, None) is not None:
            raise CheckpointFormatError(f"{key!r} holds weights beside pipeline layer files", culprit=name,
                                        hint="a DeepSpeed pipeline checkpoint keeps its weights in the layer files; "
                                             "remove the stray layer_* files or the stray rank files")
        if key not in sd:
            raise CheckpointFormatError(f"has no {key!r} entry as rank 0 has", culprit=name,
                                        hint="all rank files must come from one checkpoint")
    return key


def _check_degrees(shards: list[dict[str, Any]], names: list[str], args: Any, source: SourceCheckpoint) -> None:
    """Saved TP/PP (``checkpoint_parallel_dimensions``, Megatron args, ``mp_world_size``) must be the
    ones the files show: fewer files means a partial copy."""
    n, pp = source.tp, source.pp
    for sd, name in zip(shards, names):
        dims = sd.get(PARALLEL_DIMS)
        if isinstance(dims, dict) and (dims.get(PP_DEGREE), dims.get(TP_DEGREE)) != (pp, n):
            raise CheckpointFormatError(f"{PARALLEL_DIMS} says PP {dims.get(PP_DEGREE)} x TP {dims.get(TP_DEGREE)} "
                                        f"but the folder holds PP {pp} x TP {n}", culprit=name,
                                        hint="supply every layer and rank file of the checkpoint")
        mws = sd.get("mp_world_size")
        if mws is not None and mws not in (n, n * pp):
            raise CheckpointFormatError(f"saved mp_world_size is {mws} but the folder holds PP {pp} x TP {n}",
                                        culprit=name, hint="supply every layer and rank file of the checkpoint")
    for attr, found, what in (("tensor_model_parallel_size", n, "tensor-parallel ranks"),
                              ("pipeline_model_parallel_size", pp, "pipeline stages")):
        saved = int_arg(args, attr)
        if saved is not None and saved != found:
            raise CheckpointFormatError(f"args.{attr} is {saved} but {found} {what} were found", culprit=names[0],
                                        hint="supply every layer and rank file of the checkpoint")


def _layer_dict(sd: Any, name: str) -> dict[str, Any]:
    if not isinstance(sd, dict) or not sd:
        what = "an empty dict" if isinstance(sd, dict) else f"a {type(sd).__name__}"
        raise CheckpointFormatError(f"holds {what}, not a layer's state dict", culprit=name,
                                    hint="re-copy the layer file")
    return sd


def _check_order(roles: list[str], source: SourceCheckpoint) -> None:
    """GPTModelPipe's order: one embedding, transformer layers, one final norm, at most one lm_head."""
    expected = ([EMBEDDING] + [TRANSFORMER] * roles.count(TRANSFORMER) + [FINAL_NORM]
                + ([LM_HEAD] if LM_HEAD in roles else []))
    if roles != expected:
        at = next((i for i, (a, b) in enumerate(zip(roles, expected)) if a != b), min(len(roles), len(expected)))
        found = f"a {roles[at]} layer ({layer_file_name(source.layer_ids[at], 0)})" if at < len(roles) else \
            "no layer file"
        raise CheckpointFormatError(
            f"layer files hold {roles.count(EMBEDDING)} embedding, {roles.count(TRANSFORMER)} transformer, "
            f"{roles.count(FINAL_NORM)} final-norm layers: found {found} where a {expected[at]} layer "
            f"belongs", culprit=source.origin,
            hint="expected GPTModelPipe's layers: embedding, transformer layers, final norm[, lm_head]; "
                 "copy missing layer files or remove stray ones")
