"""Megatron-Bridge's PEFT checkpoint written (``reshard run HF_ADAPTER DST --to megatron-peft``): the
files Megatron-Bridge 0.6.2's ``save_checkpoint`` writes with ``cfg.peft`` set, the adapters only,
as its TP ranks save them.

===========================================  ===============================================================
file                                         what it holds
===========================================  ===============================================================
``latest_train_state.pt``, ``latest_         the run folder's trackers: the train state (step 0: nothing
checkpointed_iteration.txt``                 trained since the conversion) and the iteration
``iter_0000000/__<t>_0.distcp``              TP rank ``t``'s chunks of every adapter (one chunk per layer of
                                             the stacked global key, and per box of :func:`tp_boxes`);
                                             rank 0's first holds the common state (megatron-core 0.19's
                                             ``common_state`` byte item, ``[common]``)
``iter_0000000/.metadata``                   the index of those chunks (global shapes, every rank's boxes)
``iter_0000000/metadata.json``               the sharded backend (torch_dist)
``iter_0000000/run_config.yaml``             ``model`` (the base, for Megatron-Bridge and reshard's reader),
                                             ``peft`` (the LoRA), ``checkpoint`` (what its loader reads)
``iter_0000000/train_state.pt``              the train state again (Megatron-Bridge reads both)
===========================================  ===============================================================

A torch_dist checkpoint holds global tensors, so the TP only decides the files and the chunks: every
rank writes its boxes of each global tensor into its own ``__<t>_0.distcp`` (megatron-core's fully
parallel save changes nothing here: no adapter weight is replicated over TP), blobs back to back in
the sharded state dict's order (:data:`~reshard.models.lora.MODULE_ORDER`), each the bytes
``torch.save`` writes (:func:`reshard.formats.torch_dist.write_distcp`), so the files are the bytes
Megatron-Bridge writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from reshard.core.errors import LayoutError
from reshard.core.lazy import box_of
from reshard.core.options import ReshardOptions
from reshard.core.source import MEGATRON_LATEST, SourceCheckpoint
from reshard.core.torch_writer import PendingTensor
from reshard.formats.base import CheckpointFormat
from reshard.formats.torch_dist import COMMON_STATE, CONFIG, INDEX, TORCH_DIST, GlobalItem, index_bytes, write_distcp
from reshard.models.bridge_config import RUN_CONFIG, model_section
from reshard.models.lora import dist_key, tp_boxes, wrapped_layer

MEGATRON_PEFT = "megatron-peft"
#: Megatron-Bridge's train state file, in the iteration folder and (``latest_``) in the run folder.
TRAIN_STATE = "train_state.pt"
#: The iteration folder written: an adapter converted from Hugging Face PEFT has trained no step here.
ITERATION = 0
#: megatron-core's common state as Megatron-Bridge saves it without a distributed optimizer (its
#: ``content_metadata``: how the optimizer's state would be sharded; none is saved).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class MegatronPeftFormat(CheckpointFormat):
    """Megatron-Bridge PEFT: a LoRA adapter checkpoint (torch_dist of the adapters, run_config.yaml),
    written from a Hugging Face PEFT adapter.

    Read back as torch_dist (``--to hf-peft``, ``--merge-adapter``)."""

    name = MEGATRON_PEFT
    title = "Megatron-Bridge PEFT checkpoint"
    reads = False
    per_rank = False
    patterns = ()
    markers = ()

    def detect(self, folder: Path) -> bool:
        return False  # read as the torch_dist checkpoint it is

    def locate(self, path: Path) -> SourceCheckpoint:
        raise LayoutError("a Megatron-Bridge PEFT checkpoint is read as torch_dist", culprit=str(path),
                          hint="--to hf-peft exports it; --merge-adapter merges it")

    def check_source(self, source: SourceCheckpoint, options: ReshardOptions) -> None:
        """A model's weights are no adapter: only ``reshard run`` of a PEFT adapter writes this."""
        raise LayoutError(f"{source.origin} is planned as a model's weights; a Megatron-Bridge PEFT checkpoint is "
                          "written from a Hugging Face PEFT adapter", culprit="--to megatron-peft",
                          hint="`reshard run HF_ADAPTER DST --to megatron-peft` (reshard.adapters."
                               "export_megatron_peft), or --to torch_dist")


def iteration_folder() -> str:
    return f"iter_{ITERATION:07d}"


def rank_items(pairs: Mapping[str, tuple[Any, Any]], tp: int, layers: int, swiglu: bool) -> list[list[GlobalItem]]:
    """Each TP rank's chunks, in its file's order (the sharded state dict's: each key of the first
    layer's modules in order, A before B; its layers in order; each layer's boxes in order). A chunk
    is made when its blob is written (read box by box from the lazy adapters: one chunk in memory)."""
    keys: dict[str, list[tuple[int, Any]]] = {}
    for key, (a, b) in pairs.items():
        for side, t in (("A", a), ("B", b)):
            dkey, layer = dist_key(key, side)
            keys.setdefault(dkey, []).append((layer, (side, wrapped_layer(key), t)))
    out: list[list[GlobalItem]] = [[] for _ in range(tp)]
    for dkey, per_layer in keys.items():
        for layer, (side, wrapped, t) in per_layer:
            shape = tuple(t.shape)
            for rank, boxes in enumerate(tp_boxes(wrapped, side, shape, tp, swiglu)):
                for off, size in boxes:
                    out[rank].append(GlobalItem(dkey, (layer, *off), (1, *size), (layers, *shape), t.dtype,
                                                _pending(t, off, size, dkey)))
    return out


def _pending(t: Any, off: tuple[int, int], size: tuple[int, int], name: str) -> PendingTensor:
    def produce(sink: Any) -> None:
        sink.write(box_of(t, off, size).contiguous())

    return PendingTensor(size, t.dtype, produce, False, name)


def run_config(args: Any, peft: Mapping[str, Any], tp: int, base: str | None) -> str:
    """``run_config.yaml``: the base's ``model`` section (:func:`~reshard.models.bridge_config.model_section`,
    with the layout the adapters were saved at and ``hf_model_id``, the base the adapter names),
    ``peft``, and the ``checkpoint`` fields Megatron-Bridge's loader reads (no optimizer or RNG
    state saved)."""
    model = model_section(args)
    model.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, hf_model_id=base)
    checkpoint = {"ckpt_format": TORCH_DIST, "fully_parallel_save": True, "save_optim": False, "save_rng": False}
    return yaml.safe_dump({"checkpoint": checkpoint, "model": model, "peft": dict(peft)}, sort_keys=False)


def write_train_state(path: Path) -> None:
    """Megatron-Bridge's ``TrainState.state_dict()`` at step 0, saved as Megatron-Bridge saves it
    (``torch.save`` to the file's path)."""
    zero = {"step": torch.tensor(ITERATION), "consumed_train_samples": torch.tensor(0),
            "skipped_train_samples": torch.tensor(0), "consumed_valid_samples": torch.tensor(0),
            "floating_point_operations_so_far": torch.tensor(0.0), "do_train": torch.tensor(False),
            "do_valid": torch.tensor(False), "do_test": torch.tensor(False)}
    torch.save(zero, path)


def write_checkpoint(folder: Path, ranks: Sequence[list[GlobalItem]], config: str) -> int:
    """Write the run folder (the table above) into ``folder``; returns the bytes of the ``.distcp`` files."""
    it = folder / iteration_folder()
    it.mkdir(parents=True, exist_ok=True)
    common = {"checkpoint_version": 3.0, "iteration": ITERATION, "content_metadata": dict(CONTENT_METADATA)}
    files = [(f"__{t}_0.distcp", ([GlobalItem(COMMON_STATE, (), (), (), None, common)] if t == 0 else []) + items)
             for t, items in enumerate(ranks)]
    size = 0
    for name, items in files:
        size += write_distcp(items, str(it / name)).size
    (it / INDEX).write_bytes(index_bytes(files))
    (it / CONFIG).write_text(json.dumps({"sharded_backend": TORCH_DIST, "sharded_backend_version": 1}),
                             encoding="utf-8")
    (it / RUN_CONFIG).write_text(config, encoding="utf-8")
    write_train_state(it / TRAIN_STATE)
    write_train_state(folder / f"latest_{TRAIN_STATE}")
    (folder / MEGATRON_LATEST).write_text(str(ITERATION), encoding="utf-8")
    return size
