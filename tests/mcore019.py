"""What megatron-core 0.19 writes differently from the installed 0.16.1, rebuilt here from 0.19.2's
source (test-only helper: megatron-core 0.19 needs Python 3.12, the suite runs on 3.11).

* Its two new enums (``megatron/core/transformer/enums.py``), which Megatron-LM 0.19 saves in
  ``args`` (``inference_cuda_graph_scope`` always, ``cuda_graph_modules`` as a list): served under
  their own module and name by :func:`serve_019_enums`, so pickle writes them exactly as 0.19 does.
* Its torch_dist common state (``dist_checkpointing.serialization.save``): no ``common.pt``; the
  common dict becomes ``ShardedObject("common_state", data, (1,), (0,))``, whose blob is
  ``torch.save([data])`` (``strategies/torch.py``, ``_mcore_to_torch_sharded_object``) written as a
  byte item of the index under its unique key ``common_state/shard_0_1``. :func:`as_019_dist`
  moves a torch_dist folder written by the installed megatron-core there, through torch's own
  checkpoint records, and :func:`load_019_common_state` reads it back as 0.19's
  ``load_common_state_dict`` does (``torch.distributed.checkpoint.load`` of that key, no process
  group), so a test can check its input is what 0.19 reads.
"""

from __future__ import annotations

import enum
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

COMMON_STATE = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key


class InferenceCudaGraphScope(enum.Enum):
    none = 1
    layer = 2
    block = 3


class CudaGraphModule(enum.Enum):
    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4
    moe_preprocess = 5
    mamba = 6


def serve_019_enums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the two enums pickle under megatron-core's module, as 0.19 pickles them."""
    from megatron.core.transformer import enums

    for cls in (InferenceCudaGraphScope, CudaGraphModule):
        monkeypatch.setattr(cls, "__module__", enums.__name__)
        monkeypatch.setattr(enums, cls.__name__, cls, raising=False)


def as_019_dist(run: Path, dst: Path, **common_changes: Any) -> Path:
    """A copy of the torch_dist run ``run`` laid out as megatron-core 0.19 saves it: its
    ``common.pt`` (changed by ``common_changes``: a key set, or removed when given None; ``args``
    attributes as ``args__name``) appended to rank 0's ``__0_0.distcp`` as the common-state blob,
    indexed in ``.metadata`` by torch's own records."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    shutil.copytree(run, dst)
    folder = next(p.parent for p in dst.glob("*/.metadata"))
    common = torch.load(folder / "common.pt", weights_only=False)
    for key, value in common_changes.items():
        if key.startswith("args__"):
            setattr(common["args"], key[len("args__"):], value)
        elif value is None:
            common.pop(key, None)
        else:
            common[key] = value
    (folder / "common.pt").unlink()
    blob = io.BytesIO()
    torch.save([common], blob)
    distcp = folder / "__0_0.distcp"
    offset = distcp.stat().st_size
    with open(distcp, "ab") as f:
        f.write(blob.getvalue())
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file: torch's records
    meta.state_dict_metadata[COMMON_STATE] = BytesStorageMetadata()
    meta.storage_data[MetadataIndex(COMMON_STATE)] = _StorageInfo(distcp.name, offset, len(blob.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return dst


def load_019_common_state(folder: Path) -> dict[str, Any]:
    """The common state of a torch_dist iteration folder as megatron-core 0.19's
    ``load_common_state_dict`` reads one without ``common.pt`` (trusted test input)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {COMMON_STATE: io.BytesIO()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    loaded = state[COMMON_STATE]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=False)
    return loaded[0]
