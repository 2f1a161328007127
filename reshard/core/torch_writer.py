"""Write a ``torch.save`` file while its tensors are still being produced, holding a few at most.

``torch.save`` needs the whole object in memory: it pickles it, then writes every storage.
reshard knows every output tensor's shape and dtype before any byte is read, so it can write
the same file as a stream instead:

1. **Pickle first.** The object is pickled with a pickler that emits exactly what ``torch.save``
   would (same protocol, same persistent ids ``('storage', storage_type, key, location, numel)``,
   same reduce tuples), but module tensors are :class:`PendingTensor` placeholders: shape,
   dtype and a *producer* that will stream the bytes later. Real tensors (carried entries) are
   handled exactly as ``torch.save`` handles them, shared storages and views included.
2. **Skeleton.** torch's own zip writer (``torch._C.PyTorchFileWriter``, the one ``torch.save``
   uses, with its 64-byte alignment, zip64 handling and version records) writes ``data.pkl``,
   ``.format_version``, ``.storage_alignment``, ``byteorder``, then every ``data/<key>`` record as
   *metadata only* (``write_record_metadata``: header, a hole of the record's size, descriptor),
   then ``version`` and ``.data/serialization_id``. CRC computation is off at this point (torch's
   CRC-32 runs at ~0.25 GB/s; zlib-ng's, used here, at ~30 GB/s — stdlib ``zlib.crc32`` at ~4).
3. **Stream.** Each record's bytes are produced in file order, chunk by chunk (the engine never
   assembles a whole tensor: chunks are views of the memory-mapped sources, or gathers of their
   rows), and written into its hole with ``pwrite`` by a writer thread while the
   producer reads the next chunk; CRC-32 is computed on the fly by the producer, and optionally
   the SHA-256 of the whole file, in file order, by a third thread (``save(..., sha256=True)``),
   so the file need not be read again.
4. **Patch.** The CRC fields (data descriptors and central directory) and the serialization id
   (20 digits of record-name hash — already right — and 20 digits of combined CRC, recomputed the
   way ``PyTorchStreamWriter`` does) are written in place.

The result is byte-identical to ``torch.save`` of the materialized object (tests compare them),
loads with ``torch.load`` (``weights_only`` either way) and any zip reader (CRCs are right).

Memory: the writer holds at most ``IN_FLIGHT`` chunks plus the one being produced;
producers decide how big a chunk is (engine: ``CHUNK_BYTES``).
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import hashlib
import io
import os
import pickle
import queue
import shutil
import struct
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from zlib_ng import zlib_ng  # CRC-32 with carry-less multiply: ~8x stdlib zlib's on x86-64 (AVX-512)

#: Bytes per streamed chunk (producers cut larger runs into pieces of this size). Small enough to
#: stay in the CPU's caches through CRC, ``pwrite`` and SHA-256 (8 MiB chunks reached the later
#: stages from memory); small chunks mean many range boundaries in the sources,
#: which the page dropper covers (:meth:`reshard.core.pages.PageDropper.drop`). See
#: docs/performance.md, "The streamed chunk size".
CHUNK_BYTES = 1 << 20
#: Chunks queued between the producer and the writer thread.
QUEUE_DEPTH = 4
#: Chunks queued between the writer thread and the hashing thread (``save(..., sha256=True)``).
HASH_QUEUE_DEPTH = 2
#: Chunks a producer can have handed over and not yet released: queued, being written, queued
#: for hashing, being hashed.
IN_FLIGHT = QUEUE_DEPTH + HASH_QUEUE_DEPTH + 2

_PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_DESCRIPTOR_SIG = 0x08074B50
_CD_SIG = 0x02014B50
_LOCAL_SIG = 0x04034B50
_EOCD_SIG = 0x06054B50
_EOCD64_SIG = 0x06064B50
_EOCD64_LOC_SIG = 0x07064B50
_MASK64 = (1 << 64) - 1
_SERIALIZATION_ID = ".data/serialization_id"


class WriterError(Exception):
    """A producer broke its contract (wrong byte count, shape) — a bug, never bad input."""


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK64)) & _MASK64


# --- placeholders -------------------------------------------------------------------------------


class RecordSink(abc.ABC):
    """Where a producer writes one record's bytes, in order, exactly ``nbytes`` of them."""

    @abc.abstractmethod
    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        """Append ``data`` (bytes-like or a contiguous CPU tensor). ``release`` is called once the
        bytes have been consumed (e.g. to drop the source pages); ``keep`` is held until then."""

    def zeros(self, n: int) -> None:
        """Append ``n`` zero bytes."""
        while n > 0:
            k = min(n, len(_ZEROS))
            self.write(_ZEROS[:k])
            n -= k


_ZEROS = memoryview(bytes(1 << 20))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides torch gives a fresh contiguous tensor of ``shape``."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class _PendingStorage:
    """Identity of a pending tensor's storage while pickling (carries no data)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: PendingTensor) -> None:
        self.tensor = tensor


class PendingTensor:
    """A contiguous CPU tensor that does not exist yet: pickled exactly as ``torch.save`` pickles
    a fresh contiguous tensor of this shape and dtype; its bytes come from ``produce(sink)``."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, produce: Callable[[RecordSink], None],
                 requires_grad: bool = False, name: str = "") -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.produce = produce
        self.requires_grad = bool(requires_grad)
        self.name = name
        self._storage = _PendingStorage(self)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __reduce_ex__(self, proto: int) -> tuple[Any, ...]:
        # mirrors torch.Tensor._reduce_ex_internal for a plain contiguous CPU tensor: fresh
        # tuples (the pickler memoizes by identity) and a fresh empty backward-hooks dict
        size = tuple(list(self.shape))
        stride = tuple(list(contiguous_strides(self.shape)))
        if self.dtype in torch.storage._new_dtypes():
            return (torch._utils._rebuild_tensor_v3,
                    (self._storage, 0, size, stride, self.requires_grad, OrderedDict(), self.dtype))
        return (torch._utils._rebuild_tensor_v2,
                (self._storage, 0, size, stride, self.requires_grad, OrderedDict()))

    def materialize(self) -> torch.Tensor:
        """Run the producer into memory: the tensor itself."""
        out = torch.empty(self.shape, dtype=self.dtype)
        sink = _MemorySink(out)
        self.produce(sink)
        sink.finish(self.name)
        return out

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[torch.Tensor]:
        """The tensor for reading inside the ``with``: where the producer writes it as one region
        of memory (a mapped source's rows, in chunks) that region itself, uncopied, its pages
        given back on exit; else :meth:`materialize`'s copy. For a consumer that needs the whole
        tensor at once (the FP8 export's block maxima) but never keeps it."""
        sink = _BorrowSink(self)
        try:
            self.produce(sink)
            yield sink.result()
        finally:
            sink.give_back()

    def __repr__(self) -> str:
        return f"PendingTensor({self.name or '?'}, {list(self.shape)}, {self.dtype})"


def _storage_type_of(dtype: torch.dtype) -> Any:
    """The legacy typed-storage class torch pickles for ``dtype`` (``torch.HalfStorage``, ...)."""
    return getattr(torch, torch.storage.TypedStorage(0, dtype=dtype, _internal=True)._pickle_storage_type())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def as_bytes(data: Any) -> tuple[memoryview, Any]:
    if isinstance(data, torch.Tensor):
        t = data if data.device.type == "cpu" else data.cpu()
        t = t if t.is_contiguous() else t.contiguous()
        return tensor_bytes(t), t
    mv = memoryview(data)
    return (mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")), None


def first_rows(t: PendingTensor, rows: int) -> PendingTensor:
    """The first ``rows`` rows of ``t``, produced by ``t``'s own producer (the bytes after them
    are dropped as they come): a padded vocabulary cut to its true rows, streamed."""
    keep = rows * (t.nbytes // t.shape[0]) if t.shape and t.shape[0] else 0

    def produce(sink: RecordSink) -> None:
        t.produce(_PrefixSink(sink, keep))

    return PendingTensor((rows, *t.shape[1:]), t.dtype, produce, t.requires_grad, t.name)


def flat(t: PendingTensor) -> PendingTensor:
    """``t`` as one dimension (its bytes unchanged: a contiguous tensor's elements in order)."""
    return PendingTensor((t.numel,), t.dtype, t.produce, t.requires_grad, t.name)


class _PrefixSink(RecordSink):
    """Passes on the first ``limit`` bytes written to it, drops the rest."""

    def __init__(self, sink: RecordSink, limit: int) -> None:
        self.sink, self.limit, self.pos = sink, limit, 0

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        mv, hold = as_bytes(data)
        take = max(0, min(len(mv), self.limit - self.pos))
        self.pos += len(mv)
        if take:
            self.sink.write(mv[:take], release, (keep, hold, data))
        elif release is not None:
            release()


class _MemorySink(RecordSink):
    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.view = tensor_bytes(out)
        self.pos = 0

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        mv, _hold = as_bytes(data)
        n = len(mv)
        if self.pos + n > len(self.view):
            raise WriterError(f"producer wrote more than {len(self.view)} bytes")
        self.view[self.pos:self.pos + n] = mv
        self.pos += n
        if release is not None:
            release()

    def finish(self, name: str) -> None:
        if self.pos != len(self.view):
            raise WriterError(f"producer of {name or 'a tensor'} wrote {self.pos} of {len(self.view)} bytes")


class _BorrowSink(RecordSink):
    """A producer's writes held as they are while they are one region of memory (contiguous CPU
    tensors, each starting where the last ended: chunks of one mapped tensor, or tensors stored one
    after another in one mapped file, as an expert's gate and up projections); at the first write
    that is not, what was held is copied into a tensor of its own and the rest copied as it comes,
    as :class:`_MemorySink` does (so a gathering producer's reused buffers are not all held at once)."""

    def __init__(self, t: PendingTensor) -> None:
        self.t = t
        self.held: list[tuple[torch.Tensor, Callable[[], None] | None]] = []
        self.end = -1
        self.copy: _MemorySink | None = None

    def _joins(self, data: Any) -> bool:
        if not (isinstance(data, torch.Tensor) and data.device.type == "cpu" and data.is_contiguous()):
            return False
        return not self.held or data.data_ptr() == self.end

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        if self.copy is None and self._joins(data):
            self.held.append((data, release))
            self.end = data.data_ptr() + data.nbytes
            return
        if self.copy is None:
            self.copy = _MemorySink(torch.empty(self.t.shape, dtype=self.t.dtype))
            held, self.held = self.held, []
            for piece, piece_release in held:
                self.copy.write(piece, piece_release)
        self.copy.write(data, release, keep)

    def result(self) -> torch.Tensor:
        if self.copy is not None:
            self.copy.finish(self.t.name)
            return self.copy.out
        nbytes = sum(piece.nbytes for piece, _ in self.held)
        if nbytes != self.t.nbytes:
            raise WriterError(f"producer of {self.t.name or 'a tensor'} wrote {nbytes} of {self.t.nbytes} bytes")
        if not self.held:
            return torch.empty(self.t.shape, dtype=self.t.dtype)
        # one tensor over the pieces' bytes (they may belong to several storages: the held pieces
        # keep them alive until give_back)
        start = self.held[0][0].data_ptr()
        region = torch.frombuffer((ctypes.c_char * nbytes).from_address(start), dtype=torch.uint8)
        return region.view(self.t.dtype).view(self.t.shape)

    def give_back(self) -> None:
        held, self.held = self.held, []
        for _, release in held:
            if release is not None:
                release()


# --- pickling -----------------------------------------------------------------------------------


@dataclass
class _Record:
    """One ``data/<key>`` record: a pending tensor or a real storage."""

    key: str
    nbytes: int
    pending: PendingTensor | None = None
    storage: Any = None


def _pickle(obj: Any, pickler_base: type) -> tuple[bytes, list[_Record]]:
    """``torch.serialization._save``'s pickling step, with pending tensors allowed."""
    records: dict[str, _Record] = {}
    id_map: dict[Any, str] = {}
    storage_dtypes: dict[int, torch.dtype] = {}
    cpu_tag = torch.serialization.location_tag(torch.UntypedStorage(0))

    def persistent_id(o: Any) -> Any:
        if isinstance(o, _PendingStorage):
            t = o.tensor
            if t.dtype in torch.storage._new_dtypes():
                storage_type: Any = torch.UntypedStorage
                numel = t.nbytes
            else:
                storage_type = _storage_type_of(t.dtype)
                numel = t.numel
            key = id_map.setdefault(("pending", id(o)), str(len(id_map)))
            records.setdefault(key, _Record(key, t.nbytes, pending=t))
            return ("storage", storage_type, key, cpu_tag, numel)
        if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                storage_dtype = o.dtype
                storage_type = getattr(torch, o._pickle_storage_type())
                numel = o._size()
            else:
                storage = o
                storage_dtype = torch.uint8
                storage_type = torch.serialization.normalize_storage_type(type(o))
                numel = storage.nbytes()
            if str(storage.device) != "meta" and storage.data_ptr() != 0:
                if storage.data_ptr() in storage_dtypes:
                    if storage_dtype != storage_dtypes[storage.data_ptr()]:
                        raise RuntimeError("Cannot save multiple tensors or storages that "
                                           "view the same data as different types")
                else:
                    storage_dtypes[storage.data_ptr()] = storage_dtype
            key = id_map.setdefault(("real", storage._cdata), str(len(id_map)))
            if getattr(o, "_fake_device", None) is not None:
                location = str(o._fake_device)
            else:
                location = torch.serialization.location_tag(storage)
            records[key] = _Record(key, storage.nbytes(), storage=storage)
            return ("storage", storage_type, key, location, numel)
        return None

    class _Pickler(pickler_base):  # type: ignore[misc, valid-type]
        def persistent_id(self, o: Any) -> Any:
            return persistent_id(o)

    buf = io.BytesIO()
    _Pickler(buf, protocol=_PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue(), list(records.values())


# --- zip structure ------------------------------------------------------------------------------


@dataclass
class ZipEntry:
    name: str  # record name without the archive prefix
    cd_offset: int  # central-directory entry
    data_offset: int
    size: int
    descriptor: int  # offset of the data descriptor (crc at +4), or -1: none (empty records)


@dataclass(frozen=True)
class CentralEntry:
    """One record as the central directory lists it (offsets relative to the archive's start)."""

    name: str  # with the archive prefix
    flags: int
    size: int
    header_offset: int
    cd_offset: int  # of this entry, relative to the archive's start


def central_directory(pread: Callable[[int, int], bytes], base: int, end: int) -> list[CentralEntry]:
    """The central directory of the zip archive in ``[base, end)`` of a file read by ``pread(n,
    offset)``; raises :class:`WriterError` if it is not one. Reads the tail and the directory
    only (no local header): a remote file's structure costs two or three ranged reads."""
    tail = pread(22, end - 22)
    if len(tail) != 22:
        raise WriterError("the archive is shorter than its end record")
    sig, _d, _cd, _n1, n, cd_size, cd_off, _clen = struct.unpack("<IHHHHIIH", tail)
    if sig != _EOCD_SIG:
        raise WriterError("no end-of-central-directory record")
    if n == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF:
        loc = pread(20, end - 22 - 20)
        lsig, _disk, eocd64, _tot = struct.unpack("<IIQI", loc)
        if lsig != _EOCD64_LOC_SIG:
            raise WriterError("zip64 locator missing")
        rec = pread(56, base + eocd64)
        (sig64, _sz, _vm, _vn, _d1, _d2, _n1b, n, cd_size, cd_off) = struct.unpack("<IQHHIIQQQQ", rec)
        if sig64 != _EOCD64_SIG:
            raise WriterError("zip64 end record missing")
    if cd_off + cd_size > end - base:
        raise WriterError("the central directory lies past the archive's end")
    cd = pread(cd_size, base + cd_off)
    entries: list[CentralEntry] = []
    pos = 0
    for _ in range(n):
        (sig, _vm, _vn, flags, _meth, _t, _dt, _crc, csize, usize, nlen, xlen, clen, _dn, _ia, _ea,
         lho) = struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, pos)
        if sig != _CD_SIG:
            raise WriterError("bad central directory entry")
        full = cd[pos + 46:pos + 46 + nlen].decode("utf-8")
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + xlen]
        size, off = usize, lho
        x = 0
        while x + 4 <= len(extra):  # zip64 extended information
            hid, hlen = struct.unpack_from("<HH", extra, x)
            if hid == 0x0001:
                vals = list(struct.unpack_from(f"<{hlen // 8}Q", extra, x + 4))
                if usize == 0xFFFFFFFF:
                    size = vals.pop(0)
                if csize == 0xFFFFFFFF:
                    vals.pop(0)
                if lho == 0xFFFFFFFF:
                    off = vals.pop(0)
            x += 4 + hlen
        entries.append(CentralEntry(full, flags, size, off, cd_off + pos))
        pos += 46 + nlen + xlen + clen
    return entries


def read_entries(fd: int, base: int = 0, end: int | None = None) -> list[ZipEntry]:
    """The records of the zip archive in ``[base, end)`` of the file (``end``: the file's end),
    in file order, parsed from its central directory (the archive's own offsets are from
    ``base``); ``ZipEntry.data_offset`` is absolute. Raises :class:`WriterError` if it is not one."""
    end = os.fstat(fd).st_size if end is None else end
    return zip_entries(lambda n, off: os.pread(fd, n, off), base, end)


def zip_entries(pread: Callable[[int, int], bytes], base: int, end: int) -> list[ZipEntry]:
    """:func:`read_entries` of a file read by ``pread(n, offset)`` (a streamed one's structure)."""
    entries: list[ZipEntry] = []
    for ce in central_directory(pread, base, end):
        off = ce.header_offset + base
        lh = pread(30, off)
        if len(lh) != 30:
            raise WriterError(f"bad local header for {ce.name}")
        lsig, lnlen, lxlen = struct.unpack_from("<I", lh)[0], *struct.unpack_from("<HH", lh, 26)
        if lsig != _LOCAL_SIG:
            raise WriterError(f"bad local header for {ce.name}")
        data_off = off + 30 + lnlen + lxlen
        name = ce.name.split("/", 1)[1] if "/" in ce.name else ce.name
        entries.append(ZipEntry(name, base + ce.cd_offset, data_off, ce.size,
                                data_off + ce.size if ce.flags & 0x8 else -1))
    return entries


#: A record of the archive larger than this is not part of its structure (see :func:`skeleton_ranges`).
SKELETON_RECORD = 64 << 10
#: Bytes kept at the start of a skipped record beside its name: its local header's fixed 30 bytes
#: and extra field (torch's alignment padding, under 64 bytes + 4, and a zip64 field of 20) — what
#: a reader locates the data by. The first bytes of the data come with it.
_HEADER_ROOM = 30 + 128


def skeleton_ranges(pread: Callable[[int, int], bytes], base: int, end: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges of the ``torch.save`` archive in ``[base, end)`` that hold
    its structure — the central directory, every small record (``data.pkl``, versions), and each
    tensor record's local header — but not the bytes of tensor records over
    :data:`SKELETON_RECORD`: what ``torch.load`` reads of a file onto the meta device, or
    memory-mapped (reading no tensor). A streamed file's structure, read into memory at once.
    Raises :class:`WriterError` if it is not such an archive."""
    entries = sorted(central_directory(pread, base, end), key=lambda e: e.header_offset)
    cd_start = min((e.cd_offset for e in entries), default=end - base - 22)
    out = []
    for i, e in enumerate(entries):
        lo = e.header_offset
        hi = entries[i + 1].header_offset if i + 1 < len(entries) else cd_start
        if not 0 <= lo <= hi <= end - base:
            raise WriterError(f"record {e.name} lies outside the archive")
        tensor = e.name.rsplit("/", 2)[-2:-1] == ["data"] and e.name.rsplit("/", 1)[-1].isdigit()
        if tensor and e.size > SKELETON_RECORD:
            out.append((base + lo, min(_HEADER_ROOM + len(e.name.encode()), hi - lo)))
        else:
            out.append((base + lo, hi - lo))
    out.append((base + cd_start, end - base - cd_start))
    return merge_ranges(out)


def merge_ranges(ranges: list[tuple[int, int]], gap: int = 4096) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges sorted, with those less than ``gap`` bytes apart joined."""
    merged: list[list[int]] = []
    for off, n in sorted(r for r in ranges if r[1] > 0):
        if merged and off <= merged[-1][0] + merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], off + n - merged[-1][0])
        else:
            merged.append([off, n])
    return [(o, n) for o, n in merged]


# --- streaming ----------------------------------------------------------------------------------


class WriteStage:
    """One thread of the write pipeline: takes queued chunks ``(data, offset, release, keep)`` in
    order, does its work on each, then hands it to the next stage — or, being the last, calls its
    release hook. The first error stops the work (later chunks are only released) and is raised
    to the producer by :meth:`put` / :meth:`close`. :func:`writer_pipeline` builds the usual
    writer-and-hasher pair; a format whose stage does more (the Hugging Face writer hashes the
    file in order while it writes ahead) builds its own."""

    def __init__(self, name: str, work: Callable[[memoryview, int | None], None], depth: int,
                 after: WriteStage | None = None) -> None:
        self.work = work
        self.after = after
        self.q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def failed(self) -> BaseException | None:
        return self.error or (self.after.failed() if self.after is not None else None)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                if self.after is not None:
                    self.after.q.put(None)
                return
            mv, offset, release, _keep = item
            forward = False
            try:
                if self.failed() is None:
                    self.work(mv, offset)
                    forward = self.after is not None
            except BaseException as exc:  # disk full, I/O error: reported to the producer
                self.error = exc
            if forward:
                try:
                    self.after.put(item)  # type: ignore[union-attr]
                except BaseException as exc:  # the next stage failed: its error is reported
                    self.error = self.error or exc
                    forward = False
            if not forward and release is not None:
                try:
                    release()
                except BaseException as exc:
                    self.error = self.error or exc
            del mv, _keep, item

    def put(self, item: Any) -> None:
        while True:
            error = self.failed()
            if error is not None:
                raise error
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self.thread.is_alive():
                    raise WriterError(f"{self.thread.name} thread died") from self.error

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.after is not None:
            self.after.thread.join()
        error = self.failed()
        if error is not None:
            raise error


def writer_pipeline(fd: int, depth: int, digest: Any = None,
                    hash_work: Callable[[memoryview, int | None], None] | None = None) -> WriteStage:
    """``pwrite`` on one thread and, with a ``digest``, the SHA-256 (in file order) on a second
    one: hashing runs beside the kernel's copy into the page cache instead of after it (on 2
    cores the writer thread alone was the bottleneck: copy + hash in series). Items with an
    ``offset`` of None are hashed only (bytes of the file written elsewhere). ``hash_work``
    replaces the hashing step (given each written item, in queue order) when the items do not
    come in file order."""

    def write(mv: memoryview, offset: int | None) -> None:
        if offset is None:
            return
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:], offset + done)

    if hash_work is None and digest is not None:
        hash_work = lambda mv, _off: digest.update(mv)  # noqa: E731
    hasher = None if hash_work is None else WriteStage("reshard-hasher", hash_work, HASH_QUEUE_DEPTH)
    return WriteStage("reshard-writer", write, depth, after=hasher)


class _FileSink(RecordSink):
    """Streams one record into its hole: CRC here, ``pwrite`` on the writer thread (unless
    ``to_disk`` is off: then the bytes only go on to the hashing stage, see ``save``'s ``stream``)."""

    def __init__(self, writer: WriteStage, entry: ZipEntry, name: str, to_disk: bool = True) -> None:
        self.writer = writer
        self.entry = entry
        self.name = name
        self.to_disk = to_disk
        self.pos = 0
        self.crc = 0
        self.head = b""

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        mv, hold = as_bytes(data)
        n = len(mv)
        if self.pos + n > self.entry.size:
            if release is not None:
                release()
            raise WriterError(f"producer of {self.name} wrote more than {self.entry.size} bytes")
        if n == 0:
            if release is not None:
                release()
            return
        if len(self.head) < 8:
            self.head += bytes(mv[:8 - len(self.head)])
        self.crc = zlib_ng.crc32(mv, self.crc)
        self.writer.put((mv, self.entry.data_offset + self.pos if self.to_disk else None, release, (keep, hold, data)))
        self.pos += n

    def finish(self) -> None:
        if self.pos != self.entry.size:
            raise WriterError(f"producer of {self.name} wrote {self.pos} of {self.entry.size} bytes")


@dataclass
class SaveStats:
    """What :func:`save` wrote: file size, records and the largest single record."""

    size: int = 0
    records: int = 0
    largest_record: int = 0
    record_order: list[str] = field(default_factory=list)
    sha256: str | None = None


def _skeleton_writer(path: str) -> tuple[Any, Any]:
    """torch.save's writer for ``path`` (ascii paths go to the C++ file writer, others through a
    Python file object, archive name and all), with CRC computation off."""
    align = torch.serialization._get_storage_alignment()
    try:
        path.encode("ascii")
    except UnicodeEncodeError:
        stream = open(path, "wb")  # noqa: SIM115
        return torch._C.PyTorchFileWriter(stream, False, align), stream
    return torch._C.PyTorchFileWriter(path, False, align), None


def _skeleton(writer: Any, data_pkl: bytes, records: list[_Record]) -> dict[str, bytes]:
    """Write ``torch.save``'s records through ``writer``, tensor data as holes; the small records."""
    small: dict[str, bytes] = {}

    def small_record(name: str, value: bytes) -> None:
        small[name] = value
        writer.write_record(name, value, len(value))

    small_record("data.pkl", data_pkl)
    small_record(".format_version", b"1")
    small_record(".storage_alignment", str(torch.serialization._get_storage_alignment()).encode())
    small_record("byteorder", sys.byteorder.encode())
    for rec in records:
        writer.write_record_metadata(f"data/{rec.key}", rec.nbytes)
    writer.write_end_of_file()
    return small


class _Sizer:
    """A write-only stream that only counts: the size of a skeleton, no bytes kept."""

    def __init__(self) -> None:
        self.pos = self.end = 0

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.end + off
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        """Nothing is buffered: the writer calls it, there is nothing to do."""


def saved_size(obj: Any, *, pickle_module: Any = None) -> int:
    """The number of bytes ``torch.save(obj, buffer)`` writes (the archive named ``archive``, as
    for any buffer), from shapes alone: no tensor bytes are produced."""
    base = pickle_module.Pickler if pickle_module is not None else pickle.Pickler
    data_pkl, records = _pickle(obj, base)
    sizer = _Sizer()
    writer = torch._C.PyTorchFileWriter(sizer, False, torch.serialization._get_storage_alignment())
    _skeleton(writer, data_pkl, records)
    del writer
    return sizer.end


class FileDigest:
    """The SHA-256 of a file fed its final bytes in file order, and, when given, a ``stream`` fed
    the same bytes (an upload taking the file while it is written, e.g.
    :class:`reshard.storage.s3_destination.S3OutputStream`): the writers' one in-order pass over
    their output serves both."""

    def __init__(self, stream: Any = None) -> None:
        self.sha = hashlib.sha256()
        self.stream = stream

    def update(self, data: Any) -> None:
        self.sha.update(data)
        if self.stream is not None:
            self.stream.update(data)

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


#: A streamed output's disk blocks are given back in steps of at least this many bytes.
PUNCH_BYTES = 1 << 20
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_fallocate: Any = None


def punch_hole(fd: int, lo: int, hi: int, *, align: bool = True) -> int:
    """Give back the disk blocks of bytes ``[lo, hi)`` of the file (they read as zeros after; the
    file keeps its size), the end rounded down to 4 KiB unless ``align`` is off (the bytes after
    ``hi`` in its block are still needed); returns where that ends (the next ``lo``). Where the
    filesystem or platform cannot, nothing happens: only disk use differs."""
    global _fallocate
    if align:
        hi -= hi % 4096
    if hi <= lo:
        return lo
    if _fallocate is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _fallocate = fn
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate:
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, lo, hi - lo)
    return hi


def file_digest(sha256: bool, stream: Any = None) -> FileDigest | None:
    """What a writer feeds its output to: a :class:`FileDigest` when hashing or streaming, else None."""
    return FileDigest(stream) if sha256 or stream is not None else None


def save(obj: Any, path: str | os.PathLike[str], *, pickle_module: Any = None,
         depth: int = QUEUE_DEPTH, sha256: bool = False,
         on_bytes: Callable[[int], None] | None = None, offset: int | None = None,
         digest: Any = None, stream: Any = None, keep_data: bool = True,
         pipeline: WriteStage | None = None) -> SaveStats:
    """Write ``obj`` (which may hold :class:`PendingTensor` s) to ``path`` as ``torch.save(obj, path,
    pickle_module=pickle_module)`` would write the materialized object, streaming the tensors.

    ``sha256``: also hash the file as it is written (``SaveStats.sha256``), saving a read pass.
    ``on_bytes``: called after each tensor record with the file offset produced so far (for a
    progress display; it runs on this thread and must be cheap).
    ``offset``: write the archive into the existing file ``path`` at this offset instead of
    creating it: the bytes ``torch.save(obj, buffer)`` writes, at that place, nothing else of the
    file touched (a ``torch.distributed.checkpoint`` file is such archives back to back; archives
    at disjoint places may be written concurrently). ``SaveStats.size`` is then the archive's length.
    ``digest``: a hash object to feed the archive's bytes to, in file order (instead of
    ``sha256``), so consecutive archives hash as one file.
    ``stream``: also feed the file's bytes, in order, to ``stream.update`` (with the SHA-256, see
    :class:`FileDigest`): an upload of the file while it is written. The tensors' bytes then go
    only there, not to ``path``, which keeps the archive's structure alone (its records are
    holes: a sparse file of a few KiB). ``keep_data=False`` does the same for a caller that feeds
    ``digest`` to its own stream.
    ``pipeline``: with ``offset``, write through this :func:`writer_pipeline` of the file (hashing
    into ``digest``) and leave it open, so that archives written back to back keep one pipeline
    busy instead of starting and draining one each; its errors surface at a later ``put`` or at
    its ``close``, which the caller owes."""
    if pipeline is not None and offset is None:
        raise ValueError("a shared pipeline writes archives at an offset into an existing file")
    with structure_path(os.fspath(path), streamed=offset is None and stream is not None) as where:
        return _save(obj, where, pickle_module=pickle_module, depth=depth, sha256=sha256, on_bytes=on_bytes,
                     offset=offset, digest=digest, stream=stream, keep_data=keep_data, pipeline=pipeline)


def _save(obj: Any, path: str, *, pickle_module: Any, depth: int, sha256: bool,
          on_bytes: Callable[[int], None] | None, offset: int | None, digest: Any, stream: Any,
          keep_data: bool, pipeline: WriteStage | None) -> SaveStats:
    base_pickler = pickle_module.Pickler if pickle_module is not None else pickle.Pickler
    data_pkl, records = _pickle(obj, base_pickler)
    if offset is None:
        writer, skeleton_file = _skeleton_writer(path)
    else:
        skeleton_file = open(path, "r+b")  # noqa: SIM115
        skeleton_file.seek(offset)
        writer = torch._C.PyTorchFileWriter(skeleton_file, False, torch.serialization._get_storage_alignment())
    end: int | None = None  # the archive's end: the file's, unless written into a file at an offset
    try:
        small = _skeleton(writer, data_pkl, records)
        if offset is not None:
            end = skeleton_file.tell()
    finally:
        if skeleton_file is not None:
            skeleton_file.close()
    del writer

    fd = os.open(path, os.O_RDWR)
    base = offset or 0
    try:
        if end is None:
            end = os.fstat(fd).st_size
        entries = read_entries(fd, base, end)
        by_name = {e.name: e for e in entries}
        crcs: dict[str, int] = {}
        heads: dict[str, bytes] = {}
        for name, value in small.items():  # final before any data: hashable in order
            crcs[name], heads[name] = zlib_ng.crc32(value), value[:8]
            _patch_crc(fd, by_name[name], crcs[name])
        stats = SaveStats(records=len(entries))
        own_digest = digest is None
        if own_digest:
            digest = file_digest(sha256, stream)
        to_disk = keep_data and stream is None
        hashed_to = base  # the file's final bytes before this offset are queued for hashing
        # CRCs of streamed records: patched into the file once all data is written (a pwrite here
        # would contend with the writer thread for the file's lock), and into the bytes hashed
        crc_at: dict[int, int] = {}
        wt = pipeline if pipeline is not None else writer_pipeline(fd, depth, digest)
        try:
            for rec in records:
                name = f"data/{rec.key}"
                entry = by_name[name]
                if digest is not None and entry.data_offset > hashed_to:  # descriptor + header
                    wt.put((_final_bytes(fd, hashed_to, entry.data_offset, crc_at), None, None, None))
                    if not to_disk:  # read for the last time: its blocks go back (the data's are holes)
                        punch_hole(fd, hashed_to, min(entry.data_offset + entry.size,
                                                      -(-entry.data_offset // 4096) * 4096), align=False)
                sink = _FileSink(wt, entry, name, to_disk)
                if rec.pending is not None:
                    rec.pending.produce(sink)
                    rec.pending = None  # drop the producer (and what it holds) at once
                elif rec.nbytes:
                    storage = rec.storage if rec.storage.device.type == "cpu" else rec.storage.cpu()
                    sink.write(memoryview((ctypes.c_char * rec.nbytes).from_address(storage.data_ptr())).cast("B"),
                               keep=storage)
                sink.finish()
                crcs[name], heads[name] = sink.crc, sink.head
                if digest is not None and entry.descriptor >= 0:
                    crc_at[entry.descriptor + 4] = sink.crc
                hashed_to = entry.data_offset + entry.size
                stats.largest_record = max(stats.largest_record, rec.nbytes)
                if on_bytes is not None:
                    on_bytes(hashed_to - base)
        finally:
            if pipeline is None:
                wt.close()
        # streamed: the descriptors before ``hashed_to`` went out with their CRCs, their blocks given back
        _patch(fd, entries, crcs, heads, small, descriptors_from=base if to_disk else hashed_to)
        stats.size = end - base
        if digest is not None:
            while hashed_to < end:
                tail = os.pread(fd, min(end - hashed_to, 1 << 24), hashed_to)
                if pipeline is not None:  # after this archive's data, still in flight
                    wt.put((memoryview(tail), None, None, None))
                else:
                    digest.update(tail)
                hashed_to += len(tail)
            if own_digest:
                stats.sha256 = digest.hexdigest()
        if not to_disk:  # every byte went to the stream: the structure's blocks go back too
            punch_hole(fd, base, end, align=False)
        stats.record_order = [e.name for e in entries]
    finally:
        os.close(fd)
    return stats


@contextlib.contextmanager
def structure_path(path: str, *, streamed: bool) -> Iterator[str]:
    """Where a writer puts file ``path``: ``path`` itself — or, for a ``streamed`` file (its bytes
    go to a stream, the local file keeps only its structure), the same name (torch names the
    archive after it) in a fresh :func:`memory_folder`, removed afterwards."""
    folder = memory_folder() if streamed else None
    if folder is None:
        yield path
        return
    try:
        yield os.path.join(folder, os.path.basename(path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def memory_folder() -> str | None:
    """A new private folder on a memory-backed filesystem (``/dev/shm``) for a streamed file's
    structure — the zip writer's headers and directory, a block per record, which would otherwise
    take local disk in proportion to the model's tensors — or None where there is none (then the
    structure stays beside the output, its blocks given back as they are streamed)."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK)):
        return None
    try:
        return tempfile.mkdtemp(prefix="reshard-", dir=shm)
    except OSError:
        return None


def _final_bytes(fd: int, lo: int, hi: int, crc_at: dict[int, int]) -> bytes:
    """The file's bytes ``[lo, hi)`` as they will be once patched: the skeleton's, with the
    CRC-32s in ``crc_at`` (offset -> value) that fall inside written in (and taken out of it)."""
    buf = bytearray(os.pread(fd, hi - lo, lo))
    for off in [o for o in crc_at if lo <= o - 4 and o + 4 <= hi]:  # one at most: the previous record's
        if struct.unpack_from("<I", buf, off - 4 - lo)[0] != _DESCRIPTOR_SIG:
            raise WriterError(f"no data descriptor at offset {off - 4}")
        struct.pack_into("<I", buf, off - lo, crc_at.pop(off))
    return bytes(buf)


def _patch_crc(fd: int, e: ZipEntry, crc: int, *, descriptor: bool = True) -> None:
    """Write a record's CRC-32 into its data descriptor (unless ``descriptor`` is off) and
    central-directory entry."""
    if e.descriptor < 0:
        if crc != 0:
            raise WriterError(f"record {e.name} has data but no data descriptor")
        return
    packed = struct.pack("<I", crc)
    if descriptor:
        if struct.unpack("<I", os.pread(fd, 4, e.descriptor))[0] != _DESCRIPTOR_SIG:
            raise WriterError(f"no data descriptor after {e.name}")
        os.pwrite(fd, packed, e.descriptor + 4)
    os.pwrite(fd, packed, e.cd_offset + 16)


def _patch(fd: int, entries: list[ZipEntry], crcs: dict[str, int], heads: dict[str, bytes],
           small: dict[str, bytes], *, descriptors_from: int = 0) -> None:
    """Write the real CRC-32s and serialization id into the skeleton: into the central directory,
    and into each data descriptor from ``descriptors_from`` on (those before it went out with
    their CRCs to a stream already, and their blocks were given back)."""
    combined = 0
    sid: ZipEntry | None = None
    for e in entries:
        if e.name == _SERIALIZATION_ID:
            sid = e
            continue
        if e.name not in crcs:  # small records: ours, or written by torch at end of file
            value = small.get(e.name)
            if value is None:
                value = os.pread(fd, e.size, e.data_offset)
            crcs[e.name] = zlib_ng.crc32(value)
            heads[e.name] = value[:8]
        # PyTorchStreamWriter folds in the CRC of every written chunk that starts like a data
        # descriptor: the descriptors, and a record's data when it happens to start that way
        head = heads[e.name]
        if e.size >= 8 and len(head) >= 8 and struct.unpack_from("<I", head)[0] == _DESCRIPTOR_SIG:
            combined = _hash_combine(combined, struct.unpack_from("<I", head, 4)[0])
        if e.descriptor >= 0:
            combined = _hash_combine(combined, crcs[e.name])
    if sid is not None:
        old = os.pread(fd, sid.size, sid.data_offset)
        if sid.size != 40 or not old.isdigit():
            raise WriterError(f"unexpected serialization id format {old!r} (torch {torch.__version__})")
        new = old[:20] + f"{combined:020d}".encode()
        os.pwrite(fd, new, sid.data_offset)
        crcs[sid.name] = zlib_ng.crc32(new)
    for e in entries:
        _patch_crc(fd, e, crcs[e.name], descriptor=e.descriptor >= descriptors_from)
