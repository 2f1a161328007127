"""Load torch checkpoint shards without ever executing code from them.

Checkpoints come from shared buckets; a pickle can run arbitrary code on load. We always use
torch's weights-only unpickler, which only rebuilds tensors and plain containers, plus an
explicit allowlist of harmless classes that real Megatron/DeepSpeed checkpoints carry
(``args`` is an ``argparse.Namespace``). Anything else is refused *before* it runs.

Shards are memory-mapped (``mmap=True``) so opening one costs page-cache, not a full copy in
process memory; tensors are read on first touch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import os
import pickle
import re
import struct
import threading
import types
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from reshard.core import remote
from reshard.core.errors import CheckpointFormatError, CorruptCheckpointError, UnsafeCheckpointError
from reshard.core.foreign import SAFE_STAND_INS, Foreign, find_foreign

# torch's allowlist is process-wide state; concurrent loads in threads would race on it, so
# loads are serialized. With mmap=True a load only reads the pickle, not tensors.
_LOAD_LOCK = threading.Lock()

#: Classes a checkpoint may reference besides tensors and builtin containers. Each entry is
#: data-only: rebuilding it cannot run code beyond setting attributes.
SAFE_GLOBALS: tuple[Any, ...] = (
    argparse.Namespace,
    collections.OrderedDict,
    types.SimpleNamespace,
    # Transformer-Engine ``_extra_state`` (older TE): an opaque in-memory byte buffer, carried as-is.
    io.BytesIO,
    # megatron enums, numpy RNG state, ... in Megatron-LM checkpoints: inert stand-ins that
    # record their arguments and re-pickle under the original name (see reshard.core.foreign).
    *SAFE_STAND_INS,
)


@contextlib.contextmanager
def _only_our_allowlist(entries: tuple[Any, ...] = SAFE_GLOBALS) -> Iterator[None]:
    """Make ``entries`` (:data:`SAFE_GLOBALS`, or nothing) torch's whole user allowlist for the
    duration of one load.

    Others may have added to it: importing ``megatron.core`` registers the *real* megatron and
    numpy classes under the very names our stand-ins use, and torch then resolves such a name to
    either entry depending on set order (a real enum on one run, a stand-in on the next). Swapping
    the list in, and the caller's back after, makes every load resolve to the stand-ins.
    """
    ser = torch.serialization
    saved = ser.get_safe_globals()
    ser.clear_safe_globals()
    ser.add_safe_globals(list(entries))
    try:
        yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(saved)


def load_shard(path: str | os.PathLike[str], *, mmap: bool = True) -> dict[str, Any]:
    """Load one ``*.pt`` shard with the weights-only unpickler and the allowlist; a streamed file's
    stand-in (:mod:`reshard.core.remote`) from its source, tensors as ``RemoteTensor`` s.

    Raises ``CorruptCheckpointError`` for empty, truncated or non-torch files and
    ``UnsafeCheckpointError`` when the pickle references anything outside the allowlist.
    """
    p = Path(path)
    source = remote.source_for(p)
    if source is not None:
        return _load_streamed(source)
    size = p.stat().st_size
    if size == 0:
        raise CorruptCheckpointError("file is empty (0 bytes)", culprit=str(p),
                                     hint="re-copy the shard from the training output")
    if not zipfile.is_zipfile(p):
        raise _not_a_zip(str(p))
    return _torch_load(p, str(p), mmap=mmap)


def _not_a_zip(where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        "not a torch zip checkpoint (truncated, or saved with the legacy "
        "_use_new_zipfile_serialization=False format)", culprit=where,
        hint="re-copy the shard; legacy-format files must be re-saved with torch.save")


def _torch_load(f: Any, where: str, **kw: Any) -> dict[str, Any]:
    """``torch.load`` of ``f`` weights-only with :data:`SAFE_GLOBALS`, errors named for ``where``."""
    try:
        with _LOAD_LOCK, _only_our_allowlist():
            obj = torch.load(f, map_location=kw.pop("map_location", "cpu"), weights_only=True, **kw)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refused to unpickle: {refusal_reason(exc)}; nothing from it was executed", culprit=where,
            hint="only load checkpoints from sources you trust; re-save the state dict with "
                 "plain tensors and dicts") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read shard: {_first_line(exc)}", culprit=where,
                                     hint="the file is truncated or corrupt; re-copy it") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"top level is a {type(obj).__name__}, expected a dict",
                                     culprit=where, hint="pass a DeepSpeed/Megatron model-states file")
    return obj


def _load_streamed(source: remote.ByteSource) -> dict[str, Any]:
    """A streamed ``*.pt`` file: its structure (directory, pickle, small records, each record's
    local header: :func:`reshard.core.torch_writer.skeleton_ranges`) read into memory through
    ``source``, loaded by ``torch.load`` onto the meta device — torch's own weights-only
    unpickler and the allowlist, every storage's place in the file recorded, no tensor byte read
    — and every tensor made a :class:`~reshard.core.remote.RemoteTensor` over ``source``. A tensor
    the engine would not stream from a mapping either (a subclass such as ``Parameter``,
    non-contiguous, quantized, carrying Python state) is refused: its bytes in the output depend
    on more than its values."""
    from reshard.core.torch_writer import WriterError, skeleton_ranges

    where = source.url
    if source.size < 22:
        raise _not_a_zip(where) if source.size else CorruptCheckpointError(
            "file is empty (0 bytes)", culprit=where, hint="re-copy the shard from the training output")
    try:
        f = remote.structure(source, lambda pread: skeleton_ranges(pread, 0, source.size))
    except (WriterError, struct.error, UnicodeDecodeError, ValueError):
        raise _not_a_zip(where) from None
    if not zipfile.is_zipfile(f):
        raise _not_a_zip(where)
    f.seek(0)
    obj = _torch_load(f, where, map_location="meta")
    storages: dict[int, remote.RemoteStorage] = {}

    def lazy(t: torch.Tensor) -> remote.RemoteTensor:
        if not (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized and t.is_contiguous()
                and not torch._utils._get_obj_state(t)):
            raise CheckpointFormatError(
                f"holds a {type(t).__name__} that cannot be read while converting (not a plain contiguous tensor)",
                culprit=where, hint="fetch the shards whole first: --cache-sources")
        st = t.untyped_storage()
        offset = getattr(st, "_checkpoint_offset", None)
        if not isinstance(offset, int):
            raise CorruptCheckpointError("a tensor's place in the file is unknown", culprit=where,
                                         hint="fetch the shards whole first: --cache-sources")
        if offset + st.nbytes() > source.size:
            raise CorruptCheckpointError("a tensor's bytes run past the end of its file", culprit=where,
                                         hint="the file is truncated; re-copy it")
        storage = storages.setdefault(offset, remote.RemoteStorage(source, offset, st.nbytes()))
        return remote.RemoteTensor(storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                                   t.requires_grad)

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return lazy(v)
        if isinstance(v, Foreign):  # a stand-in rebuilt from inert arguments: it must hold no tensor
            if _holds_tensor((v.foreign_args, v.foreign_state)):
                raise CheckpointFormatError("holds a tensor inside a foreign object, which cannot be read while "
                                            "converting", culprit=where,
                                            hint="fetch the shards whole first: --cache-sources")
            return v
        out = remote.rebuilt(v, walk)
        if out is v and _holds_tensor(v):  # a container the walk does not rebuild
            raise CheckpointFormatError(f"holds a tensor inside a {type(v).__name__}, which cannot be read while "
                                        "converting", culprit=where,
                                        hint="fetch the shards whole first: --cache-sources")
        return out

    return walk(obj)


def _holds_tensor(v: Any, _depth: int = 0) -> bool:
    """Is there a tensor anywhere in ``v`` (containers, object attributes)?"""
    if isinstance(v, torch.Tensor):
        return True
    if _depth > 50 or isinstance(v, (str, bytes, int, float, bool, type(None), torch.dtype, io.BytesIO, type)):
        return False
    if isinstance(v, dict):
        return any(_holds_tensor(x, _depth + 1) for x in (*v.keys(), *v.values()))
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds_tensor(x, _depth + 1) for x in v)
    state = getattr(v, "__dict__", None)
    if isinstance(state, dict) and _holds_tensor(state, _depth + 1):
        return True
    if isinstance(v, Foreign):
        return _holds_tensor((v.foreign_args, v.foreign_state), _depth + 1)
    return False


def refuse_foreign_entries(module: Mapping[str, Any], where: str) -> None:
    """Refuse a module (the model's entries) that holds an allowlisted foreign object.

    The stand-ins (:mod:`reshard.core.foreign`) are for what Megatron-LM and DeepSpeed save
    *beside* the model: ``args`` (megatron enums, paths, signals, numpy scalars), RNG state
    (numpy arrays, generators), the rerun state machine, optimizer state (its config, DeepSpeed's
    loss scaler and fragment addresses) — entries reshard carries as data or drops. A module
    entry is a weight, or a Transformer Engine ``_extra_state`` (a byte tensor, a ``BytesIO``
    holding TE's own pickle, which reshard carries unread, or None); an enum or generator there
    stands for no tensor reshard can lay out, so it is refused here rather than carried."""
    for key, value in module.items():
        found = find_foreign(value)
        if found is not None:
            raise UnsafeCheckpointError(
                f"module entry {key} holds a {found}: reshard reads such objects (as inert data) only beside "
                f"the model (args, RNG and optimizer state), never as a weight", culprit=where,
                hint="re-save the model's state dict with its tensors (Transformer Engine's _extra_state as "
                     "Transformer Engine saves it)")


def safe_torch_load(f: Any, *, allowlist: bool = False) -> Any:
    """``torch.load`` of one in-memory blob (a torch_dist chunk or byte item) with the
    weights-only unpickler and, as the only extra globals, :data:`SAFE_GLOBALS` (``allowlist``)
    or none at all (tensor chunks). Errors are torch's; the caller names the blob."""
    with _LOAD_LOCK, _only_our_allowlist(SAFE_GLOBALS if allowlist else ()):
        return torch.load(f, map_location="cpu", weights_only=True)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", str(exc)).splitlines() if ln.strip()]
    return (lines or [type(exc).__name__])[0][:300]


#: Terminal colour codes torch's weights-only message carries (bold around its advice).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: The global torch's weights-only unpickler names when it refuses one (not allowed, or blocked).
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refusal_reason(exc: BaseException) -> str:
    """What a weights-only load refused, in plain words for a one-line error: the global it names
    (``global datetime.date is outside reshard's allowlist``) or the unpickler's own complaint
    (an allowlisted stand-in refusing its arguments), never torch's advice to allowlist the
    global or to load with ``weights_only=False``, nor its terminal colour codes."""
    text = _ANSI.sub("", str(exc))
    m = _REFUSED_GLOBAL.search(text)
    if m:
        return f"global {m.group(1)} is outside reshard's allowlist"
    if "WeightsUnpickler error:" in text:
        said = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation of torch.load")[0]
        if said.strip():
            return " ".join(said.split())[:300]
    return _first_line(exc)


# --- one tensor's torch.save archive, described without loading it ---------------------------------

#: Legacy typed-storage class names torch pickles, and their dtypes.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """A pickled tensor: its storage record ``data/<key>`` and the view of it."""

    key: str
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype | None) -> None:
        self.key, self.dtype = key, dtype


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRecord:
    dtype = rest[2] if len(rest) >= 3 and isinstance(rest[2], torch.dtype) else storage.dtype
    if not (isinstance(storage, _StorageRef) and isinstance(dtype, torch.dtype) and isinstance(offset, int)
            and isinstance(size, tuple) and isinstance(stride, tuple)):
        raise pickle.UnpicklingError("not a plain tensor")
    return TensorRecord(storage.key, dtype, offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and (name in _STORAGE_DTYPES or name == "UntypedStorage"):
            return name
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise pickle.UnpicklingError("unexpected persistent id")
        return _StorageRef(pid[2], _STORAGE_DTYPES.get(pid[1]) if isinstance(pid[1], str) else None)


def tensor_record(data_pkl: bytes) -> TensorRecord:
    """What the ``data.pkl`` of ``torch.save(tensor)`` describes, read by an unpickler that knows
    only tensor rebuilding (so the bytes can be mapped instead of loaded). Raises
    ``pickle.UnpicklingError`` for anything but one plain tensor."""
    try:
        rec = _TensorPickle(io.BytesIO(data_pkl)).load()
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise pickle.UnpicklingError(f"unreadable tensor pickle: {exc}") from None
    if not isinstance(rec, TensorRecord):
        raise pickle.UnpicklingError(f"holds a {type(rec).__name__}, not a tensor")
    return rec
