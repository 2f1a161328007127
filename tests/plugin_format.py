"""A checkpoint format defined outside reshard — the tests' proof that adding a format is one
module: one safetensors file per tensor-parallel rank, ``rank-XX.safetensors``, holding that
rank's module tensors; the top-level entries (checkpoint version, Megatron ``args``) ride in the
file's metadata as JSON. Read and written with the ``safetensors`` library, never pickle.

Registered with ``reshard.formats.register_format(SafetensorsPerRank)``; nothing in reshard names it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.core.errors import CheckpointFormatError
from reshard.core.source import SourceCheckpoint
from reshard.core.torch_writer import PendingTensor, SaveStats
from reshard.formats import CheckpointFormat
from reshard.formats.base import check_contiguous

NAME = "test-safetensors-per-rank"
_FILE = re.compile(r"^rank-(\d+)\.safetensors$")


class SafetensorsPerRank(CheckpointFormat):
    name = NAME
    priority = 50
    patterns = (re.compile(r"(^|/)rank-\d+\.safetensors$"),)

    # -- reading --------------------------------------------------------------------------------
    def detect(self, folder: Path) -> bool:
        return any(_FILE.match(c.name) for c in folder.iterdir())

    def locate(self, path: Path) -> SourceCheckpoint:
        found = {int(m.group(1)): c for c in sorted(path.iterdir()) if (m := _FILE.match(c.name))}
        check_contiguous(sorted(found), str(path))
        return SourceCheckpoint(tuple(found[r] for r in sorted(found)), origin=str(path), format=NAME)

    def load(self, path: Any) -> dict[str, Any]:
        try:
            with safe_open(str(path), framework="pt") as f:
                module = {k: f.get_tensor(k) for k in f.keys()}
                meta = f.metadata() or {}
        except Exception as exc:  # the library's errors: truncated, not safetensors, ...
            raise CheckpointFormatError(f"cannot read safetensors: {exc}", culprit=str(path)) from None
        top = json.loads(meta.get("reshard.top", "{}"))
        if "args" in top:
            top["args"] = argparse.Namespace(**top["args"])
        return {"module": module, **top}

    # -- writing --------------------------------------------------------------------------------
    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        return f"rank-{tp_rank:02d}.safetensors"

    def write(self, obj: Any, path: Any, *, pickle_module: Any = None, sha256: bool = False,
              on_bytes: Any = None) -> SaveStats:
        module = {k: (v.materialize() if isinstance(v, PendingTensor) else v).contiguous()
                  for k, v in obj["module"].items()}
        top = {k: (vars(v) if k == "args" else v) for k, v in obj.items()
               if k in ("checkpoint_version", "args", "iteration")}
        save_file(module, str(path), metadata={"reshard.top": json.dumps(top, sort_keys=True, default=str)})
        data = Path(path).read_bytes()
        return SaveStats(size=len(data), records=len(module),
                         sha256=hashlib.sha256(data).hexdigest() if sha256 else None)


def write_as_safetensors(src: Path, dst: Path) -> Path:
    """The sample's ``mp_rank_XX_model_states.pt`` files, rewritten in this format (test-side)."""
    dst.mkdir(parents=True, exist_ok=True)
    for r, f in enumerate(sorted(src.glob("mp_rank_*_model_states.pt"))):
        sd = torch.load(f, weights_only=False)
        top = {"checkpoint_version": sd.get("checkpoint_version", 0)}
        if sd.get("args") is not None:
            top["args"] = vars(sd["args"])
        save_file({k: v.contiguous() for k, v in sd["module"].items()}, str(dst / f"rank-{r:02d}.safetensors"),
                  metadata={"reshard.top": json.dumps(top, sort_keys=True)})
    return dst


def read_modules(folder: Path) -> list[dict[str, torch.Tensor]]:
    return [SafetensorsPerRank().load(f)["module"] for f in sorted(folder.glob("rank-*.safetensors"))]
