"""Reading safetensors files as lazy tensors: validated by the ``safetensors`` library, then
mapped, so a target reads only its rows and a row run is written straight from the mapping.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> ``dtype``,
``shape``, ``data_offsets`` relative to the end of the header) and the tensors' bytes. Nothing in
it is executable; the library's ``safe_open`` checks the header (offsets in bounds, contiguous,
sizes matching shapes and dtypes) before any offset here is trusted. Each tensor is then a
:class:`SafeTensor` whose boxes of whole rows are views of the file mapped private copy-on-write
(pages given back once written, :class:`~reshard.core.pages.PageDropper`).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from reshard.core import remote
from reshard.core.errors import CorruptCheckpointError
from reshard.core.lazy import LazyTensor
from reshard.core.pages import PageDropper
from reshard.core.torch_writer import contiguous_strides

#: safetensors' dtype names (one table for reading and writing).
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
_TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: where its bytes are (absolute offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class MappedSafetensors:
    """One safetensors file's tensors, mapped on first read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries = read_header(path)
        self._mm: mmap.mmap | None = None
        self._pages: PageDropper | None = None

    def tensor(self, name: str) -> LazyTensor:
        """The tensor ``name``: a view of the mapped file, or where the file is a streamed
        skeleton (:mod:`reshard.core.remote`), read from its source while converting."""
        e = self.entries[name]
        source = remote.source_for(self.path)
        if source is not None:
            if e.end > source.size:
                raise CorruptCheckpointError(f"{name} runs past the end of the file", culprit=source.url,
                                             hint="the file is truncated; re-copy it")
            return remote.RemoteTensor(remote.RemoteStorage(source, e.begin, e.end - e.begin), 0, e.shape,
                                       contiguous_strides(e.shape), e.dtype)
        return SafeTensor(self, e)

    def _bytes(self, e: Entry) -> torch.Tensor | None:
        """The entry's bytes as a ``uint8`` view of the mapping (None for an empty tensor)."""
        if e.end == e.begin:
            return None
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._pages = PageDropper([self.path])
        return torch.frombuffer(self._mm, dtype=torch.uint8, offset=e.begin, count=e.end - e.begin)

    def release(self, t: torch.Tensor) -> None:
        if self._pages is not None:
            self._pages.drop(t.data_ptr(), t.numel() * t.element_size())


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of a safetensors file, after the ``safetensors`` library has validated it;
    :class:`CorruptCheckpointError` naming the file otherwise."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            names = set(f.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"is not a valid safetensors file: {str(exc).splitlines()[0][:200]}",
                                     culprit=str(path), hint="re-copy or re-save the file") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES.get(rec["dtype"])
        if dtype is None:
            raise CorruptCheckpointError(f"{name} has dtype {rec['dtype']}, which reshard does not convert",
                                         culprit=str(path), hint=f"store it as one of {', '.join(_TORCH_DTYPES)}")
        begin, end = rec["data_offsets"]
        out[name] = Entry(name, dtype, tuple(rec["shape"]), base + begin, base + end)
    if set(out) != names:  # the library read another header than this one: never trust offsets then
        raise CorruptCheckpointError("header changed while it was read", culprit=str(path), hint="re-copy the file")
    return out


class SafeTensor(LazyTensor):
    """One tensor of a :class:`MappedSafetensors`: a box of whole rows (every later dim complete) is
    a view of the mapping; any other box is copied out of the whole tensor's view."""

    def __init__(self, file: MappedSafetensors, entry: Entry) -> None:
        self.file, self.entry = file, entry
        self.shape, self.dtype = entry.shape, entry.dtype

    def _whole(self) -> torch.Tensor:
        raw = self.file._bytes(self.entry)
        if raw is None:
            return torch.empty(self.shape, dtype=self.dtype)
        return raw.view(self.dtype).view(self.shape)

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        if 0 in sizes or not self.shape or any(o or s != d for o, s, d in zip(offsets[1:], sizes[1:], self.shape[1:])):
            return None
        return self._whole().narrow(0, offsets[0], sizes[0])

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        whole = self._whole()
        box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        if out is None:
            view = self.view_box(offsets, sizes)
            if view is not None:  # the caller gives it back (release) once it is written
                return view
            out = box.contiguous()
        else:
            out.copy_(box)
        # copied: the rows the box lies in are given back here, since the caller holds only the copy
        # (part of each row, columns of a transposed slab: every page of those rows was touched)
        if whole.dim() and 0 not in sizes:
            self.file.release(whole.narrow(0, offsets[0], sizes[0]))
        return out

    def release(self, t: torch.Tensor) -> None:
        self.file.release(t)

    def __repr__(self) -> str:
        return f"SafeTensor({self.file.path.name}:{self.entry.name}, shape={self.shape}, dtype={self.dtype})"
