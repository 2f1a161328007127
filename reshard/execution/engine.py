"""Execute a validated plan: build one target file's state dict and save it.

A target is one (pipeline stage, tensor-parallel rank) of the output (``plan.targets``). Each
reads only the source shards it needs (memory-mapped), so targets are independent units of
work — the Prefect layer runs one task per target on top of :func:`convert_target`.

Module entries are written under their target names (layers renumbered per stage); replicated
tensors and carried entries (``_extra_state``) come from the target's base source rank, as do
the top-level entries (``args`` retargeted: TP, PP, padded vocabulary).

Streaming, in bounded memory (docs/performance.md): the target's state dict is laid out with
every tensor still a :class:`~reshard.core.torch_writer.PendingTensor` (shape and dtype are known
from the plan) and written by :func:`reshard.core.torch_writer.save` — the bytes ``torch.save``
would write — as it is produced. A partitioned tensor is never assembled: along dim 0 its pieces
are byte ranges of the memory-mapped sources, written straight from the mapping; along a later
dim the sources' rows are gathered block by block into reused scratch buffers. Pages of the
sources are given back once read (:class:`~reshard.core.pages.PageDropper`), so memory is a few chunks
(``CHUNK_BYTES``), not a shard or a target. Quantized weights are the exception: each is
quantized whole (one int8 tensor at a time), with the cache-blocked quantizer.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.core import foreign
from reshard.core.allocator import return_large_buffers
from reshard.core.cpus import usable_cores
from reshard.core.errors import CorruptCheckpointError
from reshard.core.layouts import (
    FILL,
    PartitionSpec,
    Piece,
    assemble,
    part_segments,
    pieces_for_target,
    source_ranks_for_target,
)
from reshard.core.lazy import LazyTensor, materialized
from reshard.core.pages import PageDropper
from reshard.core.plan_types import LAYER_FILE, PIPE_RANK_FILE, ParamPlan, Plan, TargetPlan
from reshard.core.quantize import QUANT_KEY, combine_piece_scales, scale_table
from reshard.core.quantize_blocked import quantize_groups_blocked
from reshard.core.remote import materialize_lazy
from reshard.core.rules import QUANT_SLOT_ORDER
from reshard.core.torch_writer import CHUNK_BYTES, IN_FLIGHT, PendingTensor, RecordSink, WriterError, tensor_bytes
from reshard.execution import adapter_merge
from reshard.execution.ds_pipe import retarget_rank_file
from reshard.execution.specs import quant_groups_for
from reshard.formats.registry import get_format
from reshard.models.megatron_args import MadeArgs, complete

#: ``args`` attributes that name the tensor-parallel degree; updated in the output.
TP_ARG_NAMES: tuple[str, ...] = ("tensor_model_parallel_size", "model_parallel_size")
#: ``args`` attributes for uneven pipeline stages; cleared when the PP degree changes.
#: ``layout`` of the quantization record written into each quantized output shard.
QUANT_LAYOUT = "reshard.quantize.v1: [layers, 4 (qkv, dense, h_to_4h, 4h_to_h), width], stored 1/s"


@dataclass(frozen=True)
class TargetResult:
    """Small record of one written target rank (safe to pass between Prefect tasks)."""

    rank: int
    path: str
    size: int
    sources: tuple[int, ...]
    seconds: float
    #: the file's SHA-256, when :func:`convert_target` was asked to hash it while writing
    sha256: str | None = None


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA when present (or as requested), else CPU — chosen at run time, never at import."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_target(plan: Plan, tgt: int, device: torch.device | None = None) -> dict[str, Any]:
    """Target ``tgt``'s full state dict (``plan.targets[tgt]``; module tensors own their storage).

    The same tensors :func:`convert_target` streams to disk, materialized in memory."""
    device = device or torch.device("cpu")
    shards = _load_sources(plan, tgt)
    out = _target_layout(plan, tgt, shards, device, PageDropper(()))
    kind = plan.targets[tgt].kind
    modules = [out] if kind == LAYER_FILE else [] if kind == PIPE_RANK_FILE else \
        [out[f"model{i}"] for i in range(plan.target_vpp)] if plan.target_vpp > 1 else [out[plan.module_key]]
    for module in modules:
        for k, v in list(module.items()):
            if isinstance(v, PendingTensor):
                module[k] = v.materialize()
    rec = out.get(QUANT_KEY)
    if plan.options.int8 and isinstance(rec, dict) and isinstance(rec.get("scales"), PendingTensor):
        rec["scales"] = rec["scales"].materialize()
    return out


def target_state(plan: Plan, tgt: int) -> dict[str, Any]:
    """Target ``tgt``'s state dict with every produced tensor pending: names, shapes, dtypes and
    the top-level entries, no tensor bytes read (what a format needs to index what it writes).

    Read from the first rank file of each source stage alone, standing in for its stage's other
    ranks (their shapes are equal, as the full plan checks), so it works while only those
    header files are fetched; top-level and carried entries are the base rank's, exact for a
    target whose base rank is rank 0."""
    src, fmt = plan.source, get_format(plan.source.format)
    if src.layer_ids:  # DeepSpeed pipeline layer files are planned from all files anyway
        return _target_layout(plan, tgt, _load_sources(plan, tgt), torch.device("cpu"), PageDropper(()))
    heads: dict[int, dict[str, Any]] = {}
    shards = {}
    for i in plan.targets[tgt].sources:
        stage = i // src.tp
        if stage not in heads:
            heads[stage] = adapter_merge.opened(fmt, src, plan.target_options(tgt), stage * src.tp)
        shards[i] = heads[stage]
    return _target_layout(plan, tgt, shards, torch.device("cpu"), PageDropper(()))


def _load_sources(plan: Plan, tgt: int) -> dict[int, dict[str, Any]]:
    """The source shards target ``tgt`` reads, memory-mapped (tensors are read on first touch)."""
    fmt = get_format(plan.source.format)
    options = plan.target_options(tgt)
    return {i: adapter_merge.opened(fmt, plan.source, options, i) for i in plan.targets[tgt].sources}


def _target_layout(plan: Plan, tgt: int, shards: dict[int, dict[str, Any]], device: torch.device,
                   pages: PageDropper) -> dict[str, Any]:
    """Target ``tgt``'s state dict with every produced tensor still a :class:`PendingTensor`
    (shape and dtype known, bytes streamed on demand, in the order torch.save writes them)."""
    tp = plan.targets[tgt]
    src = plan.source
    # a DeepSpeed pipeline layer file is a module state dict itself (its rows follow the rank files)
    modules = {i: sd if src.layer_ids and i >= src.rows * src.tp else sd[plan.module_key] for i, sd in shards.items()}
    n, m, opts = plan.source_tp, plan.target_tp, plan.options
    first = shards[tp.sources[0]]
    for i in tp.sources:  # top-level entries from the base rank of the first stage read
        if i % n == tp.base_rank:
            first = shards[i]
            break

    chunks: list[OrderedDict[str, Any]] = [OrderedDict() for _ in range(plan.target_vpp)]
    scratch = thread_scratch()  # shared by the gathered tensors this thread writes (one at a time)
    quant = _QuantState(plan, tp) if opts.int8 else None
    degrees = plan.degrees
    for entry in tp.params:
        p = entry.param
        module = chunks[entry.chunk]  # model{chunk} of an interleaved pipeline's file; else the module
        pn, pm = degrees.of(p.rule)  # a routed expert's at the expert TP
        pt = degrees.rank(p.rule, tp.tp_rank)
        if p.spec is None:
            base = source_ranks_for_target(pn, pm, pt)[0]
            value = modules[src.index(p.stage, base)][p.src_key]
            culprit = str(src.files[src.index(p.stage, base)])
            if isinstance(value, LazyTensor):
                module[entry.out_key] = _pending_lazy(value, entry.out_key, culprit)
            elif isinstance(value, torch.Tensor):
                module[entry.out_key] = _pending_copy(value, entry.out_key, culprit, pages)
            else:
                module[entry.out_key] = value
            continue
        srcs = {r: modules[src.index(p.stage, r)][p.src_key] for r in range(pn)
                if src.index(p.stage, r) in modules}
        culprit = str(src.files[src.index(p.stage, min(srcs))])
        if quant is not None and p.quant_slot is not None:
            module[entry.out_key] = quant.pending(p, srcs, tp.tp_rank, device, culprit, pages)
        else:
            module[entry.out_key] = _pending_assembled(p.spec, srcs, pn, pm, pt, entry.out_key, culprit,
                                                       pages, scratch)

    module = chunks[0]
    if tp.kind == LAYER_FILE:  # keep the saved module versions (``state_dict()._metadata``) as they were
        meta = getattr(first, "_metadata", None)
        if meta is not None:
            module._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        return module
    out: dict[str, Any] = {}
    for k, v in first.items():
        if k == plan.module_key and len(chunks) > 1:  # Megatron-LM's interleaved pipeline: a module per chunk
            out.update((f"model{i}", chunk) for i, chunk in enumerate(chunks))
        elif k == plan.module_key:
            out[k] = None if tp.kind == PIPE_RANK_FILE else module
        elif k in plan.dropped:
            continue
        else:
            out[k] = materialize_lazy(v)  # an entry copied as it is: a streamed file's tensors read here
    if "mp_world_size" in out:
        out["mp_world_size"] = m
    if "args" in out and out["args"] is not None:
        out["args"] = retarget_args(out["args"], plan, holds=set(out))
    if tp.kind == PIPE_RANK_FILE:
        retarget_rank_file(out, plan, first.get("mp_world_size"))
    if quant is not None:
        out[QUANT_KEY] = quant.record(len(source_ranks_for_target(n, m, tp.tp_rank)))
    return out


# --- producers: each output tensor, streamed --------------------------------------------------------


def _read_errors(culprit: str) -> Any:
    """A source tensor's bytes could not be read (truncated member): one clear error."""
    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            raise CorruptCheckpointError(f"cannot read tensor data: {str(exc).splitlines()[0][:200]}",
                                         culprit=culprit,
                                         hint="the shard is truncated or corrupt; re-copy it") from None
    return guard()


def _streamable(t: torch.Tensor) -> bool:
    """A plain dense CPU tensor whose bytes can be read in place (anything else is copied the
    way the eager engine did, so the output stays what torch.save would write)."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.is_contiguous()
            and not torch._utils._get_obj_state(t))


def _pending_copy(value: torch.Tensor, name: str, culprit: str, pages: PageDropper) -> Any:
    """A replicated or carried tensor, copied from the base rank (owning exactly its bytes)."""
    if not _streamable(value):
        with _read_errors(culprit):
            return owned_copy(value)

    def produce(sink: RecordSink) -> None:
        with _read_errors(culprit):
            _stream_region(sink, value.data_ptr(), value.numel() * value.element_size(), value, pages)

    return PendingTensor(tuple(value.shape), value.dtype, produce, value.requires_grad, name)


def _write_from_source(sink: RecordSink, src: LazyTensor, t: torch.Tensor) -> None:
    """Write ``t`` (read from ``src``) in ``CHUNK_BYTES`` pieces, each given back to ``src`` once
    written (pages of a mapped file are dropped as the writer goes)."""
    flat = t.reshape(-1).view(torch.uint8)
    for off in range(0, flat.numel(), CHUNK_BYTES):
        piece = flat[off:off + CHUNK_BYTES]
        sink.write(piece, release=functools.partial(src.release, piece), keep=piece)


def _pending_lazy(value: LazyTensor, name: str, culprit: str) -> PendingTensor:
    """A replicated tensor of a lazy source, read whole while it is written."""
    def produce(sink: RecordSink) -> None:
        with _read_errors(culprit):
            t = value.materialize()  # small (norms, biases): a view of the mapping, or one copy
        _write_from_source(sink, value, t)

    return PendingTensor(tuple(value.shape), value.dtype, produce, value.requires_grad, name)


def pending_lazy_assembled(spec: PartitionSpec, sources: dict[int, LazyTensor], n: int, m: int, tgt: int,
                           name: str, culprit: str, scratch: ScratchBuffers | None) -> PendingTensor:
    """A partitioned parameter's target slice from lazy sources, each segment along ``spec.dim``
    read as boxes (only the rows this target needs). Along dim 0 a box that is regions of
    mapped files (one, or a run per fused part: :meth:`LazyTensor.views`) is written from the
    mappings, chunk by chunk, its pages given back as written;
    any other box is gathered into reused scratch buffers (fresh allocations per tensor would
    pile up in the allocator's arenas) a block of at most :data:`GATHER_BYTES` at a time — along
    ``spec.dim`` when it is the outermost dim that is not 1, else of whole rows of dim 0, each
    holding every segment's columns — so the buffers in flight are a few blocks (a row wider than a
    block is one block), not the tensor (a parameter cut by a ZeRO partition boundary, a
    row-parallel weight); sources that read the whole tensor for any box are read in one block."""
    any_src = next(iter(sources.values()))
    d = spec.dim
    segs = part_segments(spec, any_src.shape[d], n, m, tgt)
    shape = list(any_src.shape)
    shape[d] = sum(length for _, _, length in segs)
    dtype, isz = any_src.dtype, any_src.dtype.itemsize
    pool = scratch if scratch is not None else ScratchBuffers()
    whole = any(src.box_reads_whole for src in sources.values())  # then one block: each read converts it all

    def gathered(box_shape: list[int], fill: Callable[[torch.Tensor], None], sink: RecordSink) -> None:
        nbytes = math.prod(box_shape) * isz
        buf = pool.take(nbytes)
        out = buf[:nbytes].view(dtype).view(box_shape)
        try:
            fill(out)
        except BaseException:
            pool.give(buf)
            raise
        sink.write(tensor_bytes(out), release=functools.partial(pool.give, buf), keep=buf)

    def fill_segment(s: int, start: int, length: int, out: torch.Tensor) -> None:
        if s == FILL:
            out.zero_()
        else:
            sources[s].read(d, start, length, out=out)

    def fill_rows(r0: int, out: torch.Tensor) -> None:
        """Rows ``r0 .. r0 + len(out)`` of dim 0, every segment's columns along ``d``."""
        col = 0
        for s, start, length in segs:
            part = out.narrow(d, col, length)
            if s == FILL:
                part.zero_()
            else:
                offsets = tuple(r0 if i == 0 else start if i == d else 0 for i in range(len(shape)))
                sources[s].read_box(offsets, tuple(part.shape), out=part)
            col += length

    def produce(sink: RecordSink) -> None:
        def written_from_views(s: int, start: int, length: int) -> bool:
            """Segment ``s`` written straight from where its bytes lie, when they lie in mapped files."""
            views = None if s == FILL else sources[s].views(d, start, length)
            for owner, view in views or ():
                _write_from_source(sink, owner, view)
            return views is not None

        with _read_errors(culprit):
            if math.prod(shape) == 0:
                return
            along = d == 0 or math.prod(any_src.shape[:d]) == 1
            if not along and len(segs) == 1 and written_from_views(*segs[0]):  # one source's whole rows
                return
            if along:
                for s, start, length in segs:
                    if written_from_views(s, start, length):
                        continue
                    for r0, rows in _blocks(length, math.prod(any_src.shape[d + 1:]) * isz, whole):
                        box = [rows if i == d else x for i, x in enumerate(any_src.shape)]
                        gathered(box, functools.partial(fill_segment, s, start + r0, rows), sink)
                return
            for r0, rows in _blocks(shape[0], math.prod(shape[1:]) * isz, whole):
                gathered([rows, *shape[1:]], functools.partial(fill_rows, r0), sink)

    return PendingTensor(tuple(shape), dtype, produce, False, name)


#: The most bytes gathered into one scratch buffer (a few are in flight at once).
GATHER_BYTES = 2 * CHUNK_BYTES


def _blocks(rows: int, row_bytes: int, whole: bool = False) -> list[tuple[int, int]]:
    """``rows`` cut into runs of whole rows of at most :data:`GATHER_BYTES` (at least one row each;
    ``whole``: one run, for sources that read the whole tensor for any box)."""
    step = rows if whole else max(1, GATHER_BYTES // max(1, row_bytes))
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def _stream_region(sink: RecordSink, addr: int, nbytes: int, keep: torch.Tensor, pages: PageDropper) -> None:
    """Write ``nbytes`` of a (memory-mapped) source from address ``addr`` in chunks; each chunk's
    pages are dropped from this process once written."""
    off = 0
    while off < nbytes:
        k = min(CHUNK_BYTES, nbytes - off)
        a = addr + off
        sink.write(_view(a, k), release=pages.dropper(a, k, (addr, addr + nbytes)), keep=keep)
        off += k


def _pending_assembled(spec: PartitionSpec, sources: dict[int, torch.Tensor], n: int, m: int, tgt: int,
                       name: str, culprit: str, pages: PageDropper, scratch: ScratchBuffers | None = None) -> Any:
    """A partitioned parameter's target slice, written piece by piece, never assembled whole:
    along dim 0 each piece is one contiguous byte range of a source; along a later dim the
    output is built in blocks of rows (``CHUNK_BYTES`` each)."""
    any_src = next(iter(sources.values()))
    if isinstance(any_src, LazyTensor):
        return pending_lazy_assembled(spec, sources, n, m, tgt, name, culprit, scratch)  # type: ignore[arg-type]
    d = spec.dim
    segs = part_segments(spec, any_src.shape[d], n, m, tgt)
    used = {s for s, _, _ in segs if s != FILL}
    kinds = {(tuple(sources[s].shape), sources[s].dtype) for s in used} | {(tuple(any_src.shape), any_src.dtype)}
    if not all(_streamable(sources[s]) for s in used) or len(kinds) != 1:
        with _read_errors(culprit):
            return assemble(spec, sources, n, m, tgt)
    shape = list(any_src.shape)
    shape[d] = sum(length for _, _, length in segs)
    dtype, isz = any_src.dtype, any_src.element_size()
    chunks = [(s, length) for s, _, length in segs]
    if len(chunks) == 1:
        requires_grad = False if chunks[0][0] == FILL else sources[chunks[0][0]].requires_grad
    else:
        requires_grad = any(sources[s].requires_grad for s in used)
    outer = math.prod(any_src.shape[:d])
    inner = math.prod(any_src.shape[d + 1:])
    d_src, d_out = any_src.shape[d], shape[d]

    def produce_rows(sink: RecordSink) -> None:  # outer == 1: contiguous runs
        for s, start, length in segs:
            nb = length * inner * isz
            if s == FILL:
                sink.zeros(nb)
            else:
                t = sources[s]
                _stream_region(sink, t.data_ptr() + start * inner * isz, nb, t, pages)

    def produce_rows_interleaved(sink: RecordSink) -> None:  # outer > 1: rows of the sources interleaved
        # each block of output rows is gathered into one scratch buffer by torch (a strided copy,
        # GIL released) and written as one chunk: handing the writer thousands of KiB-sized row
        # pieces cost ~3x the bytes' copy in per-piece CRC/hash/syscall overhead
        row_bytes = d_out * inner * isz
        src_row = d_src * inner * isz
        per_block = max(1, CHUNK_BYTES // max(row_bytes, 1))
        runs = [(s, start * inner * isz, length * inner * isz) for s, start, length in segs]
        pool = scratch if scratch is not None else ScratchBuffers()
        for o0 in range(0, outer, per_block):
            rows = min(outer, o0 + per_block) - o0
            buf = pool.take(rows * row_bytes)
            out2d = buf[:rows * row_bytes].view(rows, row_bytes)
            col = 0
            for s, off, nb in runs:
                if s == FILL:
                    out2d[:, col:col + nb].zero_()
                else:
                    base = sources[s].data_ptr() + o0 * src_row
                    src2d = torch.frombuffer(_view(base, rows * src_row), dtype=torch.uint8).view(rows, src_row)
                    out2d[:, col:col + nb].copy_(src2d[:, off:off + nb])
                col += nb
            for s in used:
                pages.drop(sources[s].data_ptr() + o0 * src_row, rows * src_row,
                           (sources[s].data_ptr(), sources[s].data_ptr() + outer * src_row))
            sink.write(tensor_bytes(out2d), release=functools.partial(pool.give, buf), keep=buf)

    if math.prod(shape) == 0:
        body: Callable[[RecordSink], None] = lambda sink: None  # noqa: E731  (no bytes)
    else:
        body = produce_rows if outer == 1 else produce_rows_interleaved

    def produce(sink: RecordSink) -> None:
        with _read_errors(culprit):
            body(sink)

    return PendingTensor(tuple(shape), dtype, produce, requires_grad, name)


class _QuantState:
    """Quantized weights of one target and their scales; the scale table's shape is known up
    front (groups per piece x pieces), its values once every quantized weight is written."""

    def __init__(self, plan: Plan, tp: TargetPlan) -> None:
        self.plan = plan
        self.slot_scales: dict[tuple[int, str], torch.Tensor] = {}
        n, m = plan.source_tp, plan.target_tp
        numels: dict[tuple[int, str], int] = {}
        for entry in tp.params:
            p = entry.param
            if p.spec is None or p.quant_slot is None:
                continue
            part_len = p.spec.part_lengths(p.shape[p.spec.dim])[0]  # every part cut into as many pieces
            k = len(pieces_for_target(part_len, n, m, tp.tp_rank, p.spec.keep, p.spec.total))
            numels[(p.layer, p.quant_slot.value)] = quant_groups_for(p, plan.options) * k  # type: ignore[index]
        self.layers = sorted({layer for layer, _ in numels})
        rows = [[numels[(layer, slot.value)] for slot in QUANT_SLOT_ORDER] for layer in self.layers]
        width = max(v for row in rows for v in row)
        self.shape = (len(self.layers), len(QUANT_SLOT_ORDER), width)

    def pending(self, p: ParamPlan, srcs: dict[int, torch.Tensor], tgt: int, device: torch.device, culprit: str,
                pages: PageDropper) -> PendingTensor:
        plan = self.plan
        shape = list(p.shape)
        segs = part_segments(p.spec, p.shape[p.spec.dim], plan.source_tp, plan.target_tp, tgt)  # type: ignore[arg-type, union-attr]
        shape[p.spec.dim] = sum(length for _, _, length in segs)  # type: ignore[union-attr]

        def produce(sink: RecordSink) -> None:
            with _read_errors(culprit):
                q, scales = _assemble_quantized(p, srcs, plan.source_tp, plan.target_tp, tgt, plan, device)
            self.slot_scales[(p.layer, p.quant_slot.value)] = scales  # type: ignore[index, union-attr]
            for t in srcs.values():
                pages.drop_tensor(t)
            if tuple(q.shape) != tuple(shape) or q.dtype != torch.int8:
                raise WriterError(f"quantized {p.key}: planned {shape} int8, produced {list(q.shape)} {q.dtype}")
            sink.write(q, keep=q)

        return PendingTensor(tuple(shape), torch.int8, produce, False, p.key)

    def record(self, merge_count: int) -> dict[str, Any]:
        def produce(sink: RecordSink) -> None:
            rows = [[self.slot_scales[(layer, slot.value)] for slot in QUANT_SLOT_ORDER] for layer in self.layers]
            table = scale_table(rows)
            if tuple(table.shape) != self.shape:
                raise WriterError(f"scale table planned {self.shape}, produced {tuple(table.shape)}")
            sink.write(table, keep=table)

        o = self.plan.options
        return {
            "scales": PendingTensor(self.shape, torch.float32, produce, False, "scales"),
            "bits": o.bits,
            "groups": o.groups,
            "mlp_extra_grouping": o.mlp_extra_grouping,
            "merge_count": merge_count,
            "layout": QUANT_LAYOUT,
        }


class ScratchBuffers:
    """Reusable byte buffers for gathered blocks: taken by the producer, given back by the writer
    thread once a block is on disk (and hashed). At most ``IN_FLIGHT + 1`` exist (handed to the
    writer, being filled), so the producer waits for one rather than allocating — fresh memory
    is expensive to fault in, in VMs especially."""

    def __init__(self, limit: int = IN_FLIGHT + 1) -> None:
        self.limit = limit
        self.made = 0
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            if self.free.empty() and self.made < self.limit:
                self.made += 1
                return torch.empty(max(nbytes, GATHER_BYTES), dtype=torch.uint8)
        buf = self.free.get()
        return buf if buf.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)  # a wider row

    def give(self, buf: torch.Tensor) -> None:
        self.free.put(buf)


_local = threading.local()


def thread_scratch() -> ScratchBuffers:
    """This thread's scratch buffers, kept from target to target: a conversion of many small
    targets (a universal checkpoint's file per parameter) would otherwise allocate fresh buffers
    for each, and freed blocks of this size stay in the allocator's arenas (peak memory grows with
    the number of targets). Per thread, so concurrent conversions never wait on each other's."""
    pool = getattr(_local, "scratch", None)
    if pool is None:
        pool = _local.scratch = ScratchBuffers()
    return pool


def _view(addr: int, nbytes: int) -> memoryview:
    """Bytes ``[addr, addr + nbytes)`` of a live tensor's memory, without copying."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _assemble_quantized(p: ParamPlan, srcs: dict[int, torch.Tensor], n: int, m: int, tgt: int,
                        plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    groups = quant_groups_for(p, plan.options)
    piece_scales: list[torch.Tensor] = []
    srcs = {r: materialized(t) for r, t in srcs.items()}  # type: ignore[misc]

    def quantize_piece(_pc: Piece, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_groups_blocked(x.to(device), plan.options.bits, groups, p.key)
        piece_scales.append(s.cpu())
        return q.cpu()

    q = assemble(p.spec, srcs, n, m, tgt, piece_fn=quantize_piece)
    return q, combine_piece_scales(piece_scales, p.spec.dim)


def retarget_args(args: Any, plan: Plan, holds: set[str] | None = None) -> Any:
    """A copy of the saved Megatron ``args`` describing the output: TP, PP and EP degrees, the padded
    vocabulary, the checkpoint format, and every pipeline stage field (virtual stages, uneven
    first/last stages, accounting, layout string) as Megatron-LM needs it to build the output's
    stages, stale ones cleared (:meth:`~reshard.core.pipeline_stages.StageLayout.args`); with
    ``holds`` (the output's top-level entries), that a Megatron-LM output saved no optimizer or RNG
    state where it holds none (``no_save_optim``, ``no_save_rng``: Megatron-LM's torch_dist loader then
    reads the weights alone, in an ``iter_`` folder too). ``args`` reshard made
    (:class:`~reshard.models.megatron_args.MadeArgs`) are then completed as Megatron-LM's own (every
    key its parser leaves, its defaults where the model decides none)."""
    new = copy.copy(args)
    made = isinstance(args, MadeArgs)
    for name in TP_ARG_NAMES:
        if hasattr(new, name):
            setattr(new, name, plan.target_tp)
    if hasattr(new, "pipeline_model_parallel_size") or made:
        new.pipeline_model_parallel_size = plan.target_pp
    if getattr(new, "expert_model_parallel_size", None) is not None or plan.target_ep > 1:
        new.expert_model_parallel_size = plan.target_ep
    if getattr(new, "expert_tensor_parallel_size", None) is not None or plan.target_etp is not None:
        new.expert_tensor_parallel_size = plan.degrees.target_etp
    facts = plan.facts
    if facts is not None and hasattr(new, "padded_vocab_size") and facts.padded_vocab_target is not None:
        new.padded_vocab_size = facts.padded_vocab_target
    if facts is not None and facts.make_vocab_size_divisible_by is not None and \
            getattr(new, "make_vocab_size_divisible_by", None) is None:  # the padding now needs it to be reproduced
        new.make_vocab_size_divisible_by = facts.make_vocab_size_divisible_by
    ckpt_format = get_format(plan.output_format).ckpt_format
    if ckpt_format is not None and hasattr(new, "ckpt_format"):
        new.ckpt_format = ckpt_format
    if hasattr(new, "transformer_pipeline_model_parallel_size"):
        new.transformer_pipeline_model_parallel_size = plan.target_pp
    target, source = plan.target_stages, plan.source_stages
    kept = target is not None and source is not None and target == source and source.saved
    if target is not None and not kept and hasattr(new, "__dict__"):  # as saved when they describe the output
        for name, value in target.args().items():  # the stages megatron-core builds; stale ones cleared
            if hasattr(new, name) or (value is not None and value is not False):
                setattr(new, name, value)
        if target.vpp == 1 and getattr(new, "overlap_p2p_comm", False):
            new.overlap_p2p_comm = False  # Megatron-LM's validate_args turns it off without them
        elif target.vpp > 1 and (source is None or source.vpp == 1) and hasattr(new, "overlap_p2p_comm"):
            new.overlap_p2p_comm = True  # its default with virtual stages (False needs PP > 2)
    if holds is not None and ckpt_format is not None and hasattr(new, "__dict__"):  # read by Megatron-LM
        if "optimizer" not in holds:
            new.no_save_optim = True
        if "rng_state" not in holds:
            new.no_save_rng = True
    return complete(new) if made else new


def owned_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: saving a view would write its whole base storage."""
    return t.clone(memory_format=torch.contiguous_format)


#: Threads a streamed target keeps busy beside torch's: the writer's ``pwrite`` and the SHA-256.
_WRITER_THREADS = 2


def streaming_threads(cores: int, current: int, quantizing: bool) -> int:
    """torch's intra-op threads while a target streams.

    Quantizing (int8 or FP8): the cores this process may use less the writer's and the hasher's,
    never more than torch had (a caller, a Dask worker, may have lowered it), never fewer than one.
    Every other conversion: one. Why not torch's default (every core): between two ops torch's idle
    OpenMP workers busy-wait, and that spinning is taken from the writer and hasher threads: on 2
    cores one thread quantizes FP8 faster than two and int8 as fast, with less CPU, and FP8 reading
    is slower with two (the A/B runs are in docs/performance.md, sessions 23 and 26). The
    reading side (row gathers, FP8 table gathers) stays at one thread on any machine until a
    many-core one measures otherwise: a flow runs several conversions at once, each with its own
    threads.

    =======  =========  ==========  ========
    cores    current    quantizing  threads
    =======  =========  ==========  ========
    1 or 2   any        yes         1
    16       16         yes         14
    16       4          yes         4
    any      any        no          1
    =======  =========  ==========  ========
    """
    return max(1, min(current, cores - _WRITER_THREADS)) if quantizing else 1


_intra_op = {"lock": threading.Lock(), "users": 0, "saved": 0}


@contextlib.contextmanager
def _streaming_intra_op_threads(quantizing: bool) -> Iterator[None]:
    """torch's intra-op threads at :func:`streaming_threads` in this thread while it streams a
    target, its own count put back after. torch keeps the count per thread (a thread takes the
    process-wide value at its first parallel op, then keeps its own), so each converting thread
    sets its own; the process-wide value is the caller's again when the last conversion ends."""
    mine = torch.get_num_threads()
    with _intra_op["lock"]:
        if _intra_op["users"] == 0:
            _intra_op["saved"] = mine
        _intra_op["users"] += 1
    torch.set_num_threads(streaming_threads(usable_cores(), mine, quantizing))
    try:
        yield
    finally:
        with _intra_op["lock"]:
            _intra_op["users"] -= 1
            torch.set_num_threads(_intra_op["saved"] if _intra_op["users"] == 0 else mine)


def convert_target(plan: Plan, tgt: int, out_path: str | os.PathLike[str],
                   device: torch.device | None = None, *, sha256: bool = False,
                   on_bytes: Callable[[int], None] | None = None, stream: Any = None) -> TargetResult:
    """Write target ``tgt`` (an index into ``plan.targets``) to ``out_path``: the bytes
    ``torch.save`` would write for :func:`build_target`'s dict (foreign stand-ins in carried
    entries under their real names), streamed — the pickle first, then each tensor as it is
    read, holding a few chunks at a time instead of the whole target (see
    :mod:`reshard.core.torch_writer`). ``sha256``: hash the file while writing it
    (``TargetResult.sha256``), so a manifest needs no second read pass. ``on_bytes``: progress
    (bytes of the file produced so far), see :func:`reshard.core.torch_writer.save`. ``stream``:
    an upload fed the file's bytes in order while it is written (the output format must
    :meth:`~reshard.formats.base.CheckpointFormat.writes_streams`); ``out_path`` then keeps little
    more than the file's structure."""
    t0 = time.perf_counter()
    return_large_buffers()
    device = device or torch.device("cpu")
    out_path = Path(out_path)
    shards = _load_sources(plan, tgt)
    pages = PageDropper(plan.source.files[i] for i in plan.targets[tgt].sources)
    sd = _target_layout(plan, tgt, shards, device, pages)
    fmt = get_format(plan.output_format)
    obj = fmt.prepare(plan, tgt, sd)
    pickle_module = foreign.ForeignPickleModule if foreign.contains_foreign(obj) else None
    streaming: dict[str, Any] = {} if stream is None else {"stream": stream}
    if fmt.encodes_on_device():
        streaming["device"] = device
    if stream is not None and not fmt.writes_streams():
        raise WriterError(f"the {fmt.name} format's writer takes no stream")
    try:
        with _streaming_intra_op_threads(bool(plan.options.quantize)):
            stats = fmt.write(obj, out_path, pickle_module=pickle_module, sha256=sha256, on_bytes=on_bytes,
                              **streaming)
    except BaseException:
        _local.scratch = None  # buffers a failed writer never gave back: the next target starts afresh
        raise
    del sd, obj, shards
    return TargetResult(tgt, str(out_path), stats.size, plan.targets[tgt].sources,
                        time.perf_counter() - t0, stats.sha256)
