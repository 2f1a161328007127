"""Hugging Face PEFT adapters (``--to hf-peft``): ``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft.PeftModel.from_pretrained`` loads them.

The folder holds LoRA's A and B per Hugging Face module, not a model: it is written from a LoRA
adapter checkpoint (:mod:`reshard.adapters`, which the name table of the base's architecture and
:mod:`reshard.models.lora` tell where each tensor goes), never planned as a model's weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.source import SourceCheckpoint
from reshard.formats.base import CheckpointFormat
from reshard.formats.hf import FileEntry, header_bytes

HF_PEFT = "hf-peft"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class HFPeftFormat(CheckpointFormat):
    """Hugging Face PEFT: a LoRA adapter folder, written from a Megatron-Bridge PEFT checkpoint and
    read by --to megatron-peft.

    Read as an adapter (:func:`read_adapter`), never as a model's weights.

    Its files are ``adapter_config.json`` and ``adapter_model.safetensors``."""

    name = HF_PEFT
    title = "Hugging Face PEFT adapter"
    reads = False
    per_rank = False
    patterns = ()
    markers = ()

    def detect(self, folder: Path) -> bool:
        return False

    def locate(self, path: Path) -> SourceCheckpoint:
        raise LayoutError("a Hugging Face PEFT adapter is not read yet", culprit=str(path),
                          hint="convert the Megatron PEFT checkpoint it came from")

    def check_source(self, source: SourceCheckpoint, options: ReshardOptions) -> None:
        """A model's weights are no adapter: only ``reshard run`` of a LoRA checkpoint writes this."""
        raise LayoutError(f"{source.origin} is planned as a model's weights; an adapter folder is written from a LoRA "
                          "adapter checkpoint", culprit="--to hf-peft",
                          hint="`reshard run LORA_CKPT DST --to hf-peft` (reshard.adapters.export_hf_peft), or "
                               "--to hf")


def adapter_config(*, r: int, alpha: float, dropout: float, targets: list[str],
                   base: str | None) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` as ``save_pretrained`` writes it, for a plain LoRA (no DoRA, no rsLoRA:
    the update is ``alpha / r * B A``); ``lora_alpha`` an integer where it is one, as LoraConfig holds it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": r,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "lora_dropout": dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "use_dora": False, "use_rslora": False, "rank_pattern": {},
            "alpha_pattern": {}, "modules_to_save": None, "inference_mode": True, "init_lora_weights": True}


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Hugging Face PEFT adapter folder (what ``save_pretrained`` writes): its ``adapter_config.json``
    and its tensors as lazy views of ``adapter_model.safetensors`` (validated by the ``safetensors``
    library first). A pickled ``adapter_model.bin`` is refused: reshard does not unpickle weights
    it can read safely otherwise."""
    from reshard.core.safetensors_read import MappedSafetensors

    folder = Path(folder)
    config_path, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise CheckpointFormatError(f"has no {ADAPTER_CONFIG}: not a Hugging Face PEFT adapter", culprit=str(folder),
                                    hint="point at the folder peft's save_pretrained wrote")
    if not weights.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise CheckpointFormatError(f"has no {ADAPTER_WEIGHTS}" + (" (a pickled adapter_model.bin only)" if pickled
                                                                    else ""), culprit=str(folder),
                                    hint="save the adapter with safe_serialization=True (peft's default)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointFormatError("is not valid JSON", culprit=str(config_path),
                                    hint="re-save the adapter with peft's save_pretrained") from None
    if not isinstance(config, dict):
        raise CheckpointFormatError("is not a JSON object", culprit=str(config_path),
                                    hint="re-save the adapter with peft's save_pretrained")
    mapped = MappedSafetensors(weights)
    return config, {name: mapped.tensor(name) for name in mapped.entries}


def write_adapter(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> int:
    """Write the adapter's tensors (name, tensor, each held once: adapters are a model's small part)
    and its config into ``folder``; returns the bytes of the weights file."""
    items = sorted(tensors, key=lambda kv: kv[0])
    entries, start = [], 0
    for name, t in items:
        entries.append(FileEntry(name, t.dtype, tuple(t.shape), start))
        start += entries[-1].nbytes
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ADAPTER_WEIGHTS
    with open(path, "wb") as f:
        f.write(header_bytes(entries))
        for _name, t in items:
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    (folder / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
    return path.stat().st_size
