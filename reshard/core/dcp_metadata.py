"""The index of a ``torch.distributed.checkpoint`` (DCP) folder — ``.metadata`` — read safely and checked.

megatron-core's ``torch_dist`` format is a DCP folder: ``.metadata`` (a plain pickle of torch's
``Metadata``) says, for every global key, its shape, dtype and *chunks* (boxes of the global
tensor, each one ``torch.save`` blob at ``(file, offset, length)`` in a ``__R_K.distcp`` file),
or that it is a byte item (a ``torch.save`` blob of a Python object). This module turns it into
plain records (:class:`DcpMetadata`) without running code from the file:

* the pickle is read by an unpickler that resolves only the DCP record classes it names — to
  inert stand-ins that keep their fields — plus ``torch.Size``, dtypes, layouts and paths (the
  folder torch's writer saved to, read as a pure path); any other
  global is refused *before* anything is built (:class:`~reshard.core.errors.UnsafeCheckpointError`);
* the records are checked: every tensor's chunks lie inside it and tile it exactly (no overlap,
  no gap), every chunk and byte item has a storage entry naming a plain file name, and — with
  :func:`check_storage` — each entry lies inside its file (a truncated ``.distcp``).

:func:`metadata_bytes` writes the same records back as a ``.metadata`` torch reads — by name, like
the reader, so writing one does not import ``torch.distributed.checkpoint`` (half a second of
imports, a third of a small conversion's run).

Pure: paths and sizes come from the caller (the torch_dist format), no filesystem access here
beyond opening the one file :func:`read_metadata` is given.
"""

from __future__ import annotations

import io
import itertools
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError

#: Storage files a ``.metadata`` may name: plain names inside the checkpoint folder.
STORAGE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\.distcp$")


@dataclass(frozen=True)
class ChunkRef:
    """One saved box of a global tensor: ``offsets``/``sizes`` per dim, and where its
    ``torch.save`` blob lies (``file`` relative to the checkpoint folder)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class DcpBytes:
    """A byte item: one ``torch.save`` blob of a Python object (``_extra_state``, RNG state)."""

    key: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """``keys``: every key, in the index's order (the saver's: module order for megatron-core)."""

    tensors: Mapping[str, DcpTensor]
    byte_items: Mapping[str, DcpBytes]
    keys: tuple[str, ...]

    def files(self, keys: set[str] | None = None) -> set[str]:
        """Storage files holding ``keys`` (all keys when None)."""
        out = {c.file for t in self.tensors.values() if keys is None or t.key in keys for c in t.chunks}
        return out | {b.file for b in self.byte_items.values() if keys is None or b.key in keys}


# --- the restricted unpickler ---------------------------------------------------------------------


class _Record:
    """Stand-in for a DCP dataclass: keeps what ``NEWOBJ``/``REDUCE`` and ``BUILD`` hand it."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, index: int | None = None) -> Any:
        """A field from the ``BUILD`` state (a dict, or ``(dict, slots)``, or a tuple by index)."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict) and st[0] is None:
            st = st[1]
        if isinstance(st, dict):
            return st.get(name)
        if isinstance(st, tuple) and index is not None and index < len(st):
            return st[index]
        return None


def _record_class(name: str) -> type[_Record]:
    return type(name, (_Record,), {"__module__": __name__})


#: The modules of the DCP records a ``.metadata`` names.
DCP_METADATA, DCP_FILESYSTEM = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
_STAND_INS: dict[tuple[str, str], Any] = {
    (DCP_METADATA, n): _record_class(n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta")
}
_STAND_INS.update({(DCP_FILESYSTEM, "_StorageInfo"): _record_class("_StorageInfo")})
# torch also pickles the planner's records and enums in ``planner_data`` (never read here)
_STAND_INS.update({("torch.distributed.checkpoint.planner", n): _record_class(n)
                   for n in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")})
_STAND_INS[(DCP_METADATA, "_MEM_FORMAT_ENCODING")] = _record_class("_MEM_FORMAT_ENCODING")
_STAND_INS[("torch", "Size")] = lambda dims=(): tuple(dims)
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


def _get_layout(name: str) -> Any:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return _LAYOUTS[name]


_STAND_INS[("torch.serialization", "_get_layout")] = _get_layout


def _path(*parts: Any) -> PurePosixPath:
    """``pathlib.PosixPath(*parts)`` as pickled: torch 2.13's ``FileSystemWriter`` records the folder
    it saved to (``storage_meta.checkpoint_id``) as the path object itself. Read as a pure path of
    the same parts (string handling only: no filesystem access, nothing imported or run)."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError(f"a path of {', '.join(type(p).__name__ for p in parts)}, not of strings")
    return PurePosixPath(*parts)


# Python 3.13 defines the path classes in ``pathlib._local`` and pickles them under that name
# (CPython gh-133789); 3.12 and 3.14 under ``pathlib``.
_STAND_INS.update({(module, "PosixPath"): _path for module in ("pathlib", "pathlib._local")})


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STAND_INS:
            return _STAND_INS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in .metadata")


def read_metadata(path: str | Path) -> DcpMetadata:
    """The checked index of the DCP folder whose ``.metadata`` is ``path``."""
    where = str(path)
    data = Path(path).read_bytes()
    try:
        root = _SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"refused to unpickle: {exc}; nothing from it was executed", culprit=where,
                                    hint="a .metadata holds only torch.distributed.checkpoint records; "
                                         "re-save the checkpoint from a trusted source") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise CorruptCheckpointError(f"cannot read the checkpoint index: {type(exc).__name__}: {exc}"[:300],
                                     culprit=where, hint="the file is truncated or corrupt; re-copy it") from None
    if type(root).__name__ != "Metadata" or not isinstance(root, _Record):
        raise CorruptCheckpointError(f"holds a {type(root).__name__}, not a checkpoint Metadata", culprit=where,
                                     hint="point at a torch.distributed.checkpoint folder")
    return _records(root, where)


def _records(root: _Record, where: str) -> DcpMetadata:
    sd_meta = root.field("state_dict_metadata", 0)
    storage = root.field("storage_data", 2)
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError("the index lacks state_dict_metadata or storage_data", culprit=where,
                                     hint="the file is not a complete torch.distributed.checkpoint index")
    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for idx, info in storage.items():
        fqn, off = _field(idx, "fqn", where), idx.field("offset", 1) if isinstance(idx, _Record) else None
        file = _field(info, "relative_path", where)
        offset, length = _field(info, "offset", where), _field(info, "length", where)
        if not (isinstance(file, str) and STORAGE_NAME_RE.match(file)):
            raise CorruptCheckpointError(f"storage entry of {fqn} names {file!r}, not a .distcp file of the folder",
                                         culprit=where, hint="the index is corrupt or crafted; re-copy the checkpoint")
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0):
            raise CorruptCheckpointError(f"storage entry of {fqn} has offset {offset!r}, length {length!r}",
                                         culprit=where, hint="the index is corrupt; re-copy the checkpoint")
        places[(str(fqn), None if off is None else tuple(off))] = (file, offset, length)
    tensors: dict[str, DcpTensor] = {}
    byte_items: dict[str, DcpBytes] = {}
    for key, md in sd_meta.items():
        kind = type(md).__name__
        if kind == "BytesStorageMetadata":
            place = places.get((key, None))
            if place is None:
                raise CorruptCheckpointError(f"byte item {key} has no storage entry", culprit=where,
                                             hint="the index is incomplete; re-copy the checkpoint")
            byte_items[key] = DcpBytes(key, *place)
            continue
        if kind != "TensorStorageMetadata":
            raise CorruptCheckpointError(f"{key} is described by a {kind}", culprit=where,
                                         hint="the index is corrupt; re-copy the checkpoint")
        props, size, chunks = md.field("properties", 0), md.field("size", 1), md.field("chunks", 2)
        dtype = props.field("dtype", 0) if isinstance(props, _Record) else None
        if not isinstance(dtype, torch.dtype) or not _is_dims(size) or not isinstance(chunks, list):
            raise CorruptCheckpointError(f"{key}: unreadable dtype/size/chunks", culprit=where,
                                         hint="the index is corrupt; re-copy the checkpoint")
        refs = []
        for ch in chunks:
            offs, sizes = _field(ch, "offsets", where), _field(ch, "sizes", where)
            if not (_is_dims(offs) and _is_dims(sizes) and len(offs) == len(size) == len(sizes)):
                raise CorruptCheckpointError(f"{key}: a chunk's offsets/sizes do not match its {len(size)} dims",
                                             culprit=where, hint="the index is corrupt; re-copy the checkpoint")
            place = places.get((key, tuple(offs)))
            if place is None:
                raise CorruptCheckpointError(f"{key}: chunk at {tuple(offs)} has no storage entry", culprit=where,
                                             hint="the index is incomplete; re-copy the checkpoint")
            refs.append(ChunkRef(tuple(offs), tuple(sizes), *place))
        t = DcpTensor(key, tuple(size), dtype, tuple(refs))
        check_tiling(t, where)
        tensors[key] = t
    return DcpMetadata(tensors, byte_items, tuple(sd_meta))


def check_tiling(t: DcpTensor, where: str) -> None:
    """The chunks of ``t`` lie inside it and cover every element exactly once.

    The cut points of all chunks split each dim into intervals; every chunk covers a box of
    grid cells, and each cell must be covered by exactly one chunk."""
    for c in t.chunks:
        if any(o + s > d or s < 0 for o, s, d in zip(c.offsets, c.sizes, t.shape)):
            raise CorruptCheckpointError(f"{t.key}: chunk at {c.offsets} of size {c.sizes} lies outside the "
                                         f"tensor's shape {t.shape}", culprit=where,
                                         hint="the index is corrupt; re-copy the checkpoint")
    if 0 in t.shape:
        return
    cuts = [sorted({0, d, *(c.offsets[i] for c in t.chunks), *(c.offsets[i] + c.sizes[i] for c in t.chunks)})
            for i, d in enumerate(t.shape)]
    seen: set[tuple[int, ...]] = set()
    for c in t.chunks:
        spans = [range(cut.index(o), cut.index(o + s)) for cut, o, s in zip(cuts, c.offsets, c.sizes)]
        for cell in itertools.product(*spans):
            if cell in seen:
                raise CorruptCheckpointError(f"{t.key}: chunks overlap near offset {c.offsets}", culprit=where,
                                             hint="the index is corrupt; re-copy the checkpoint")
            seen.add(cell)
    total = 1
    for cut in cuts:
        total *= len(cut) - 1
    if len(seen) != total:
        raise CorruptCheckpointError(f"{t.key}: its chunks leave part of the {t.shape} tensor uncovered",
                                     culprit=where, hint="a rank's .distcp data is missing from the index; "
                                                         "re-copy the checkpoint")


def check_storage(meta: DcpMetadata, sizes: Mapping[str, int], keys: set[str], folder: str) -> None:
    """Every blob of ``keys`` lies inside its file (``sizes``: file name -> bytes; absent: missing)."""
    entries = [(t.key, c.file, c.offset, c.length) for t in meta.tensors.values() if t.key in keys for c in t.chunks]
    entries += [(b.key, b.file, b.offset, b.length) for b in meta.byte_items.values() if b.key in keys]
    for key, file, offset, length in entries:
        if file not in sizes:
            raise CorruptCheckpointError(f"the index places {key} in {file}, which does not exist", culprit=folder,
                                         hint="copy every __R_K.distcp file of the checkpoint")
        if offset + length > sizes[file]:
            raise CorruptCheckpointError(f"{file} is truncated: {key} needs bytes up to {offset + length}, the file "
                                         f"has {sizes[file]}", culprit=f"{folder}/{file}",
                                         hint="re-copy the file from the training output")


def _field(rec: Any, name: str, where: str) -> Any:
    if not isinstance(rec, _Record):
        raise CorruptCheckpointError(f"unexpected {type(rec).__name__} where a record with {name!r} belongs",
                                     culprit=where, hint="the index is corrupt; re-copy the checkpoint")
    return rec.field(name)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_dims(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(_is_int(d) and d >= 0 for d in v)


# --- writing ---------------------------------------------------------------------------------------


class _Global:
    """A class named in the pickle by module and name (``STACK_GLOBAL``), never imported here."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _New:
    """An instance as pickle's default reduction writes one: ``NEWOBJ`` of its class, then
    ``BUILD`` with its state (what torch's dataclasses pickle as)."""

    def __init__(self, cls: _Global, state: Any) -> None:
        self.cls, self.state = cls, state


class _Call:
    """``REDUCE``: ``func(*args)`` at load time (an enum member)."""

    def __init__(self, func: _Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args


_G = {n: _Global(DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                            "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                            "_MEM_FORMAT_ENCODING")}
_G["_StorageInfo"] = _Global(DCP_FILESYSTEM, "_StorageInfo")
#: ``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``: how ``TensorProperties`` pickles its memory format.
_CONTIGUOUS = _Call(_G["_MEM_FORMAT_ENCODING"], (0,))


class _IndexPickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python pickler: its dispatch is a dict
    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def _save_global_ref(self, obj: _Global) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_new(self, obj: _New) -> None:
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def _save_call(self, obj: _Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[_Global] = _save_global_ref
    dispatch[_New] = _save_new
    dispatch[_Call] = _save_call


def metadata_bytes(meta: DcpMetadata) -> bytes:
    """The ``.metadata`` of ``meta`` (keys in ``meta.keys`` order) as torch's ``Metadata`` pickles:
    ``torch.distributed.checkpoint`` loads it into its own records, :func:`read_metadata` reads
    it back into ``meta``.

    ======================  ==========================================================
    torch record            state written
    ======================  ==========================================================
    ``Metadata``            ``state_dict_metadata``, ``storage_data``; the rest None
    ``TensorStorageMetadata``  ``properties``, ``size`` (``torch.Size``), ``chunks``
    ``TensorProperties``    (dtype, strided, no grad, contiguous, not pinned)
    ``ChunkStorageMetadata``   ``offsets``, ``sizes``
    ``MetadataIndex``       ``fqn``, ``offset`` (a chunk's; None for a byte item), ``index`` None
    ``_StorageInfo``        ``relative_path``, ``offset``, ``length``
    ======================  ==========================================================
    """
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}

    def place(fqn: str, offsets: tuple[int, ...] | None, file: str, offset: int, length: int) -> None:
        index = _New(_G["MetadataIndex"], {"fqn": fqn, "offset": None if offsets is None else torch.Size(offsets),
                                          "index": None})
        storage[index] = _New(_G["_StorageInfo"], {"relative_path": file, "offset": offset, "length": length})

    for key in meta.keys:
        if key in meta.byte_items:
            b = meta.byte_items[key]
            sd_meta[key] = _New(_G["BytesStorageMetadata"], {})
            place(key, None, b.file, b.offset, b.length)
            continue
        t = meta.tensors[key]
        props = _New(_G["TensorProperties"], (t.dtype, torch.strided, False, _CONTIGUOUS, False))
        chunks = [_New(_G["ChunkStorageMetadata"], {"offsets": torch.Size(c.offsets), "sizes": torch.Size(c.sizes)})
                  for c in t.chunks]
        sd_meta[key] = _New(_G["TensorStorageMetadata"], {"properties": props, "size": torch.Size(t.shape),
                                                          "chunks": chunks})
        for c in t.chunks:
            place(key, c.offsets, c.file, c.offset, c.length)
    root = _New(_G["Metadata"], {"state_dict_metadata": sd_meta, "planner_data": None, "storage_data": storage,
                                 "storage_meta": None, "version": None})
    buf = io.BytesIO()
    _IndexPickler(buf, protocol=4).dump(root)
    return buf.getvalue()
