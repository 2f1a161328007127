"""The per-shard check: what one source file must hold, decided by its role in the checkpoint.

The role comes from the file's format and its *name in the source listing* (never from where a
cache keeps it; see ``reshard.formats.shard_role``), so a shard fetched from object storage is
checked exactly like the same file on disk.
Cross-shard consistency (same keys, degrees, versions) is the planner's job; this check only
catches a file that cannot be what its name says, as early as the file arrives.

=============  ======================================================  ========================================
role           files                                                   check
=============  ======================================================  ========================================
``rank``       ``mp_rank_XX_model_states.pt``, ``model_optim_rng.pt``  loads safely; one module (model0..: one
                                                                       per chunk); version
``pipe-rank``  ``mp_rank_XX_model_states.pt`` beside layer files       loads safely; its module is empty
``layer``      ``layer_LL-model_TT-model_states.pt``                   loads safely; a dict of tensors
``metadata``   descriptor JSON, ``latest*`` markers                    none (read by the locator)
=============  ======================================================  ========================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, ReshardError
from reshard.core.lazy import LazyTensor
from reshard.core.pipeline_stages import chunk_keys
from reshard.core.safe_load import load_shard
from reshard.core.source import AUTO, MODULE_KEYS, choose_module_key, parse_version

RANK, PIPE_RANK, LAYER, METADATA = "rank", "pipe-rank", "layer", "metadata"


def check_shard_file(path: str, role: str, module_key: str, where: str,
                     load: Callable[[str], dict[str, Any]] = load_shard) -> dict[str, Any]:
    """Check one fetched file for its ``role``; returns a small record (for logs and the UI).
    ``where`` names the file in errors (the user's URL, not a cache path); ``load`` is the
    file's format's reader."""
    if role == METADATA:
        return {"kind": METADATA}
    sd = _load(path, where, load)
    if role == LAYER:
        bad = [k for k, v in sd.items() if not isinstance(v, (torch.Tensor, LazyTensor))]
        if bad:
            raise CheckpointFormatError(f"layer file entry {bad[0]!r} is not a tensor", culprit=where,
                                        hint="a DeepSpeed pipeline layer file holds one layer's state dict")
        return {"kind": LAYER, "tensors": len(sd)}
    version = parse_version(sd.get("checkpoint_version", 0), where)
    if role == PIPE_RANK:
        if sd.get("module") not in (None, {}):
            raise CheckpointFormatError("rank file of a pipeline checkpoint holds a module", culprit=where,
                                        hint="a folder holds either pipeline layer files or per-rank modules")
        return {"kind": PIPE_RANK, "checkpoint_version": version, "mp_world_size": sd.get("mp_world_size")}
    chunks = chunk_keys(sd)
    if chunks and module_key == AUTO and not any(k in sd for k in MODULE_KEYS):  # Megatron-LM's interleaved pipeline
        bad = [k for k in chunks if not isinstance(sd[k], dict)]
        if bad:
            raise CheckpointFormatError(f"{bad[0]!r} is a {type(sd[bad[0]]).__name__}, not a state dict", culprit=where)
        return {"kind": RANK, "module_key": f"{chunks[0]}..{chunks[-1]}", "tensors": sum(len(sd[k]) for k in chunks),
                "checkpoint_version": version, "mp_world_size": sd.get("mp_world_size")}
    key = choose_module_key(sd, module_key, where)
    module = sd[key]
    return {"kind": RANK, "module_key": key, "tensors": len(module) if isinstance(module, dict) else 0,
            "checkpoint_version": version, "mp_world_size": sd.get("mp_world_size")}


def _load(path: str, where: str, load: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    try:
        return load(path)
    except ReshardError as err:  # name the user's file, not the cache entry it was fetched to
        if err.culprit == str(path) and where != str(path):
            err.culprit = where
            err.args = (err.one_line(),)
        raise
