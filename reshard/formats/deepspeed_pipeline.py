"""DeepSpeed pipeline parallelism (``PipelineModule``, Megatron-DeepSpeed's ``GPTModelPipe``): one
``layer_LL-model_TT-model_states.pt`` per layer that has weights and tensor-parallel rank ``TT``
(``LL``: the layer's index in the whole pipeline, whatever stage held it), beside
``mp_rank_KK_model_states.pt`` files whose ``module`` is None, one per (stage, TP rank),
``KK = stage * TP + TT``. TP is the number of model ranks of the layer files, PP the number of
``mp_rank`` files over TP (as DeepSpeed's ``reshape_3d_utils`` derives them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from reshard.core.errors import CheckpointFormatError
from reshard.core.shard_check import LAYER, PIPE_RANK
from reshard.core.source import (DEEPSPEED_PIPE, LAYER_FILE_NO_MODEL_RE, LAYER_FILE_RE, RANK_FILE_RE,
                                 SourceCheckpoint, layer_file_name, rank_file_name)
from reshard.formats.base import CheckpointFormat, check_contiguous


class DeepSpeedPipelineFormat(CheckpointFormat):
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
