"""The streaming writer (reshard.core.torch_writer) and the streaming engine built on it.

* the writer's file is byte-identical to ``torch.save`` of the same object materialized — for
  every kind of entry a checkpoint carries (Namespace args, nested dicts, quantization records,
  fp16/bf16/int8/uint16/bool tensors, empty and 0-dim tensors, views and shared storages in
  carried entries, requires_grad, foreign stand-ins, zip64-sized offsets are covered manually);
* it loads with ``torch.load`` (both modes), reshard's safe loader and a strict zip reader (CRCs);
* memory is bounded: the writer never holds more than its queue of chunks, the engine never
  assembles a whole output tensor (non-quantized), and converting a checkpoint whose single
  output tensor is ~130 MB grows peak RSS by far less than that.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mapped_pages import resident_bytes
from reshard.core import cpus as cpus_module
from reshard.core import foreign, torch_writer
from reshard.core.safe_load import load_shard
from reshard.core.torch_writer import PendingTensor, WriterError
from reshard.execution import engine
from reshard.execution.engine import build_target, convert_target
from reshard.execution.plan import ReshardOptions
from reshard.execution.planner import build_plan
from reshard.sample import CoreGPTConfig, GPTConfig, write_core_sample_checkpoint, write_sample_checkpoint

NAME = "mp_rank_00_model_states.pt"


def pending(t: torch.Tensor, step: int = 7) -> PendingTensor:
    """``t`` as a pending tensor whose producer writes it in odd-sized chunks."""
    t = t.contiguous()

    def produce(sink) -> None:
        mv = torch_writer.tensor_bytes(t)
        for i in range(0, len(mv), step):
            sink.write(mv[i:i + step])

    return PendingTensor(tuple(t.shape), t.dtype, produce, t.requires_grad, "t")


def pend_all(obj):
    """A copy of ``obj`` with every tensor directly under a dict named ``module`` pending."""
    out = dict(obj)
    out["module"] = type(obj["module"])((k, pending(v) if isinstance(v, torch.Tensor) else v)
                                        for k, v in obj["module"].items())
    if isinstance(obj.get("q"), dict):
        out["q"] = dict(obj["q"], scales=pending(obj["q"]["scales"], step=5))
    return out


def state_dicts():
    base = torch.arange(48, dtype=torch.float32)
    shared = torch.randn(6, 4)
    yield "mixed", {
        "module": collections.OrderedDict(
            w16=torch.randn(5, 3).half(), wbf=torch.randn(7).bfloat16(),
            w8=torch.arange(6, dtype=torch.int8).view(2, 3),
            empty=torch.zeros(0, 4), empty2=torch.zeros(3, 0, 2), scalar=torch.tensor(3.5),
            u16=torch.arange(5, dtype=torch.int32).to(torch.uint16), flag=torch.tensor([True, False]),
            grad=torch.ones(3, requires_grad=True), extra=None, te=io.BytesIO(b"fp8")),
        "args": argparse.Namespace(num_layers=2, name="0", sizes=[1, 2], nested=argparse.Namespace(a=1)),
        "carried": {"view": base[3:9], "whole": base.view(6, 8), "again": None, "shared": [shared, shared[1]],
                    "0": "0", "1": 1, "cpu": "cpu", "storage": "storage"},
        "q": {"scales": torch.rand(2, 4, 3), "bits": 8, "layout": "x"},
        "iteration": 5, "mp_world_size": 2, "tuple": (1, "a", None),
    }
    yield "only_pending", {"module": {f"layer.{i}": torch.randn(i + 1, 2).half() for i in range(5)}}
    yield "no_tensors", {"module": {}, "args": argparse.Namespace(x=1)}
    sig = torch.frombuffer(bytearray(b"PK\x07\x08\x11\x22\x33\x44tail...."), dtype=torch.uint8).clone()
    yield "descriptor_lookalike", {"module": {"a": sig, "b": sig[:8].clone(), "c": sig[:7].clone()}}


@pytest.mark.parametrize("label,sd", list(state_dicts()), ids=[n for n, _ in state_dicts()])
def test_bytes_equal_torch_save(tmp_path, label, sd):
    if "carried" in sd:  # the same view object twice: memoized by the pickler, one storage
        sd["carried"]["again"] = sd["carried"]["view"]
    (tmp_path / "ref").mkdir()
    (tmp_path / "out").mkdir()
    torch.save(sd, tmp_path / "ref" / NAME)
    stats = torch_writer.save(pend_all(sd), tmp_path / "out" / NAME)
    ref = (tmp_path / "ref" / NAME).read_bytes()
    out = (tmp_path / "out" / NAME).read_bytes()
    assert stats.size == len(out)
    assert out == ref
    with zipfile.ZipFile(tmp_path / "out" / NAME) as z:
        assert z.testzip() is None  # every CRC-32 right


def test_loads_every_way(tmp_path):
    _, sd = next(state_dicts())
    sd.pop("carried")
    sd["module"].pop("te")
    out = tmp_path / NAME
    torch_writer.save(pend_all(sd), out)
    for loaded in (torch.load(out, weights_only=False), load_shard(out)):
        for k, v in sd["module"].items():
            if isinstance(v, torch.Tensor):
                assert loaded["module"][k].dtype == v.dtype and torch.equal(loaded["module"][k], v), k
        assert torch.equal(loaded["q"]["scales"], sd["q"]["scales"])
    with torch.serialization.safe_globals([argparse.Namespace]):
        safe = torch.load(out, weights_only=True)
    assert safe["args"].num_layers == 2 and safe["module"]["grad"].requires_grad


def test_foreign_stand_ins_and_non_ascii_path(tmp_path):
    """Stand-ins pickle under their real names (pure-Python pickler), as foreign.save does; a
    non-ascii path goes through torch's Python-stream writer (archive name ``archive``)."""
    path_cls = foreign.STAND_INS["pathlib.PosixPath"]
    sd = {"module": {"w": torch.randn(3, 2)}, "args": argparse.Namespace(save=path_cls("a", "b"))}
    for name in ("model_optim_rng.pt", "mödel.pt"):
        ref, out = tmp_path / "ref" / name, tmp_path / "out" / name
        ref.parent.mkdir(exist_ok=True)
        out.parent.mkdir(exist_ok=True)
        foreign.save(sd, ref)
        torch_writer.save(pend_all(sd), out, pickle_module=foreign.ForeignPickleModule)
        assert out.read_bytes() == ref.read_bytes(), name
    with zipfile.ZipFile(out) as z:
        assert z.namelist()[0] == "archive/data.pkl"


def test_producer_errors_propagate_and_nothing_hangs(tmp_path):
    assert not [t for t in threading.enumerate() if t.name in ("reshard-writer", "reshard-hasher")]
    def short(sink):
        sink.write(b"\0" * 10)

    with pytest.raises(WriterError, match="wrote 10 of 16 bytes"):
        torch_writer.save({"a": PendingTensor((4,), torch.float32, short)}, tmp_path / "a.pt")

    def boom(sink):
        sink.write(b"\0" * 8)
        raise ValueError("source vanished")

    with pytest.raises(ValueError, match="source vanished"):
        torch_writer.save({"a": PendingTensor((4,), torch.float32, boom)}, tmp_path / "b.pt")
    # the writer's threads were joined (other parts keep process-wide pools: count only these)
    assert not [t for t in threading.enumerate() if t.name in ("reshard-writer", "reshard-hasher")]


class _BrokenDigest:
    def update(self, data):
        raise OSError("hash engine failed")


@pytest.mark.parametrize("broken", ["write", "hash"])
def test_a_failing_write_or_hash_stage_reaches_the_producer_and_releases_every_chunk(tmp_path, broken):
    """Either thread of the write pipeline failing: the producer gets that error (not a hang, not
    a later symptom) and every chunk handed over is released exactly once."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY if broken == "write" else os.O_RDWR)  # read-only: pwrite fails
    released: list[int] = []
    digest = _BrokenDigest() if broken == "hash" else None
    stage = torch_writer.writer_pipeline(fd, 2, digest)
    handed = 0
    with pytest.raises(OSError) as err:
        for i in range(50):
            stage.put((memoryview(b"x" * 64), i * 64, functools.partial(released.append, i), None))
            handed += 1
        stage.close()
    with contextlib.suppress(OSError):
        stage.close()  # after an error from put: the threads still stop
    os.close(fd)
    assert ("hash engine failed" in str(err.value)) == (broken == "hash")
    assert sorted(released) == list(range(handed))
    assert not stage.thread.is_alive()


@pytest.mark.parametrize("sha256", [False, True])
def test_writer_holds_a_bounded_number_of_chunks(tmp_path, sha256):
    """200 chunks streamed; never more than ``IN_FLIGHT`` (+ the one being produced) alive at
    once — each chunk is released as soon as it is on disk (and hashed)."""
    live, peak, lock = 0, 0, threading.Lock()
    chunk = 1 << 16

    def produce(sink):
        nonlocal live, peak
        for i in range(200):
            buf = bytearray([i % 251]) * chunk
            with lock:
                live += 1
                peak = max(peak, live)

            def release():
                nonlocal live
                with lock:
                    live -= 1

            sink.write(buf, release=release)

    torch_writer.save({"big": PendingTensor((200 * chunk,), torch.uint8, produce)}, tmp_path / "x.pt", sha256=sha256)
    assert live == 0
    assert peak <= torch_writer.IN_FLIGHT + 1
    assert peak >= torch_writer.QUEUE_DEPTH  # the bound is what is measured, not a loose one
    t = torch.load(tmp_path / "x.pt")["big"]
    assert t.numel() == 200 * chunk and int(t[-1]) == 199 % 251


# --- the engine ------------------------------------------------------------------------------------

GQA = CoreGPTConfig(layers=2, hidden=192, heads=48, groups=24, ffn=96, swiglu=True, rmsnorm=True, bias=False,
                    rope=True, tied=False, vocab=200, divisible_by=8, seq=16)


def _engine_cases(tmp: Path):
    cfg = GPTConfig(layers=2, hidden=64, heads=8, vocab=128, seq=16)
    write_sample_checkpoint(tmp / "legacy", tp=8, cfg=cfg, dtype=torch.float16)
    yield "legacy_8to2", tmp / "legacy", {"target_tp": 2}
    yield "legacy_8to2_quantized", tmp / "legacy", {"target_tp": 2, "quantize": True, "groups": 4}
    write_sample_checkpoint(tmp / "legacy2", tp=2, cfg=cfg, dtype=torch.bfloat16, version=0)
    yield "legacy_2to8_v0", tmp / "legacy2", {"target_tp": 8}
    write_core_sample_checkpoint(tmp / "gqa", tp=8, cfg=GQA, extra_state=torch.arange(5, dtype=torch.uint8))
    for f in (tmp / "gqa").rglob("model_optim_rng.pt"):  # foreign objects in carried args
        sd = torch.load(f, weights_only=False)
        sd["args"].lr = np.float64(3e-4)
        torch.save(sd, f)
    yield "gqa_8to6_padded_vocab_foreign", tmp / "gqa", {"target_tp": 6}


@pytest.mark.parametrize("chunk", [64, 1 << 20], ids=["tiny_chunks", "default"])
def test_engine_writes_what_torch_save_writes(tmp_path, monkeypatch, chunk):
    """convert_target's file == torch.save(build_target(...)) byte for byte (streamed with tiny
    chunks too, so every row block, chunk boundary and zero fill is exercised)."""
    monkeypatch.setattr(engine, "CHUNK_BYTES", chunk)
    for label, src, opts in _engine_cases(tmp_path):
        plan = build_plan(str(src), ReshardOptions(**opts))
        for t in plan.targets:
            out = tmp_path / "out" / label / t.name
            ref = tmp_path / "ref" / label / t.name
            out.parent.mkdir(parents=True, exist_ok=True)
            ref.parent.mkdir(parents=True, exist_ok=True)
            convert_target(plan, t.rank, out)
            foreign.save(build_target(plan, t.rank), ref)
            assert out.read_bytes() == ref.read_bytes(), (label, t.name)


def test_engine_never_assembles_a_whole_tensor(tmp_path, monkeypatch):
    """Without quantization every output tensor is streamed from the sources' pages: the
    eager paths (assemble, materialize, clone) are never taken."""
    write_sample_checkpoint(tmp_path / "src", tp=4, cfg=GPTConfig(layers=1, hidden=64, heads=8, vocab=128, seq=16))

    def forbidden(*a, **k):
        raise AssertionError("assembled a whole tensor")

    monkeypatch.setattr(engine, "assemble", forbidden)
    monkeypatch.setattr(engine, "owned_copy", forbidden)
    monkeypatch.setattr(PendingTensor, "materialize", forbidden)
    plans = {}
    for m in (1, 2, 8):
        plans[m] = plan = build_plan(str(tmp_path / "src"), ReshardOptions(target_tp=m))
        (tmp_path / f"out{m}").mkdir()
        for t in plan.targets:
            convert_target(plan, t.rank, tmp_path / f"out{m}" / t.name)
    monkeypatch.undo()  # the eager reference may assemble
    for m, plan in plans.items():
        for t in plan.targets:
            ref = tmp_path / f"ref{m}" / t.name
            ref.parent.mkdir(exist_ok=True)
            foreign.save(build_target(plan, t.rank), ref)
            assert (tmp_path / f"out{m}" / t.name).read_bytes() == ref.read_bytes(), (m, t.name)


_RSS_CHILD = r"""
import json, resource, sys
from reshard.execution.engine import convert_target
from reshard.execution.plan import ReshardOptions
from reshard.execution.planner import build_plan
plan = build_plan(sys.argv[1], ReshardOptions(target_tp=1))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert_target(plan, 0, sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and madvise: Linux")
def test_peak_memory_is_bounded_by_chunks_not_tensors(tmp_path):
    """TP 4 -> 1 of a model whose word embeddings are one ~134 MB output tensor (fp32): an
    engine that assembles the tensor (or keeps the source pages it read) grows peak RSS by
    well over 134 MB; the streaming engine by a few chunks."""
    cfg = GPTConfig(layers=1, hidden=256, heads=4, vocab=131072, seq=16)
    write_sample_checkpoint(tmp_path / "src", tp=4, cfg=cfg, dtype=torch.float32)
    out = tmp_path / NAME
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "src"), str(out)],
                       capture_output=True, text=True, check=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    growth_mib = (res["after_kib"] - res["before_kib"]) / 1024
    emb = torch.load(out, mmap=True, weights_only=False)["module"]["word_embeddings.weight"]
    assert emb.numel() * emb.element_size() > 130e6
    assert growth_mib < 80, f"peak RSS grew by {growth_mib:.0f} MiB converting a 134 MB tensor"
    del emb
    os.remove(out)


@pytest.mark.parametrize("cores, current, expected", [(1, 1, 1), (1, 8, 1), (2, 2, 1), (2, 16, 1), (3, 3, 1),
                                                      (4, 4, 2), (16, 16, 14), (16, 4, 4), (64, 64, 62)])
def test_quantizing_leaves_the_writer_and_hasher_a_core_each_and_never_raises_torchs_threads(cores, current, expected):
    assert engine.streaming_threads(cores, current, quantizing=True) == expected
    assert engine.streaming_threads(cores, current, quantizing=False) == 1


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("200000 100000", 2), ("150000 100000", 2),
                                        ("50000 100000", 1), ("", None), ("garbage", None), ("0 100000", None)])
def test_a_cgroup_cpu_quota_caps_the_cores(text, cpus):
    assert cpus_module.cgroup_cpu_limit(text) == cpus


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(tmp_path, monkeypatch):
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus_module, "CPU_MAX", tmp_path / "absent")
    assert cpus_module.usable_cores() == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # a container given one CPU
    monkeypatch.setattr(cpus_module, "CPU_MAX", tmp_path / "cpu.max")
    assert cpus_module.usable_cores() == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus_module.usable_cores() == affinity


def test_each_converting_thread_runs_its_own_torch_threads_and_gets_its_count_back(tmp_path, monkeypatch):
    """torch keeps its intra-op count per thread, so each thread that converts sets its own
    (:func:`engine.streaming_threads`: one, or for a quantized target the cores less the writer's and
    the hasher's) and gets its own count back, also when conversions overlap in threads. A larger
    machine than this one is stood in for by its core count (5)."""
    before = torch.get_num_threads()
    monkeypatch.setattr(engine, "usable_cores", lambda: 5)
    write_sample_checkpoint(tmp_path / "src", tp=4, cfg=GPTConfig(layers=1, hidden=64, heads=8, vocab=128, seq=16))
    try:
        for options, want in ((ReshardOptions(target_tp=2), 1), (ReshardOptions(target_tp=2, quantize=True), 3)):
            plan = build_plan(str(tmp_path / "src"), options)
            fmt = engine.get_format(plan.output_format)
            during, after = [], []
            real_write = type(fmt).write

            def write(*args, real_write=real_write, fmt=fmt, during=during, **kwargs):
                during.append(torch.get_num_threads())
                return real_write(fmt, *args, **kwargs)

            monkeypatch.setattr(fmt, "write", write)
            jobs = [(t.rank, i) for t in plan.targets for i in range(3)]
            ready = threading.Barrier(len(jobs))

            def convert(t: int, i: int, plan=plan, ready=ready, after=after) -> None:
                torch.get_num_threads()  # a thread takes the process-wide count (7) at its first use ...
                ready.wait()  # ... here before any conversion has set another
                convert_target(plan, t, tmp_path / f"{t}-{i}.pt")
                after.append(torch.get_num_threads())

            torch.set_num_threads(7)
            threads = [threading.Thread(target=convert, args=job) for job in jobs]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert len(during) == len(after) == len(threads)
            assert set(during) == {want} and set(after) == {7} and torch.get_num_threads() == 7
            torch.set_num_threads(6)
            convert_target(plan, 0, tmp_path / "main.pt")  # on the calling thread, alone
            assert during[-1] == want and torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


def test_sha256_while_writing_equals_the_files(tmp_path):
    import hashlib

    for label, sd in state_dicts():
        if "carried" in sd:
            sd["carried"]["again"] = sd["carried"]["view"]
        out = tmp_path / label / NAME
        out.parent.mkdir()
        stats = torch_writer.save(pend_all(sd), out, sha256=True)
        assert stats.sha256 == hashlib.sha256(out.read_bytes()).hexdigest(), label
    write_sample_checkpoint(tmp_path / "src", tp=4, cfg=GPTConfig(layers=1, hidden=64, heads=8, vocab=128, seq=16))
    plan = build_plan(str(tmp_path / "src"), ReshardOptions(target_tp=2))
    for t in plan.targets:
        res = convert_target(plan, t.rank, tmp_path / t.name, sha256=True)
        assert res.sha256 == hashlib.sha256((tmp_path / t.name).read_bytes()).hexdigest()
        assert convert_target(plan, t.rank, tmp_path / "again.pt").sha256 is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc: Linux")
def test_page_dropper_gives_back_mapped_pages_and_never_touches_memory(tmp_path):
    from reshard.core.pages import PageDropper

    f = tmp_path / NAME
    torch.save({"w": torch.arange(8 << 20, dtype=torch.int32)}, f)  # 32 MiB
    w = load_shard(f)["w"]
    assert int(w.sum()) == (8 << 20) * ((8 << 20) - 1) // 2  # every page touched
    before = resident_bytes(f)
    assert before > 30 << 20
    PageDropper([f]).drop_tensor(w)
    assert resident_bytes(f) < 1 << 20  # given back ...
    assert int(w[-1]) == (8 << 20) - 1  # ... and read again from the file on demand
    mem = torch.arange(1 << 20, dtype=torch.int64)  # anonymous memory: never dropped
    PageDropper([f]).drop_tensor(mem)
    PageDropper([f]).drop(mem.data_ptr(), mem.numel() * 8)
    assert torch.equal(mem, torch.arange(1 << 20, dtype=torch.int64))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc: Linux")
def test_dropping_an_entry_gives_back_its_folios_neighbours_too(tmp_path):
    """A touch maps whole page-cache folios (up to 2 MiB): the start of the next entry comes with
    the end of this one. When that entry is never read (another EP rank's copy of a dense weight)
    nothing else would give those pages back, so a drop widens to whole folios."""
    from reshard.core.pages import PageDropper

    f = tmp_path / NAME
    torch.save({"a": torch.arange(1 << 18, dtype=torch.int32), "b": torch.arange(1 << 20, dtype=torch.int32)}, f)
    sd = load_shard(f)
    a, b = sd["a"], sd["b"]
    assert int(a.sum()) > 0 and int(b[:4096].sum()) > 0  # a whole, and b's first 16 KiB
    assert resident_bytes(f) >= (1024 + 16) << 10
    PageDropper([f]).drop_tensor(a)
    assert resident_bytes(f) < 16 << 10  # b's pages in a's last folio went too ...
    assert torch.equal(b[:4096], torch.arange(4096, dtype=torch.int32))  # ... and read again on demand


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc: Linux")
@pytest.mark.parametrize("pad", [0, 40000, 100000])
@pytest.mark.parametrize("block", [128 << 10, 100000])
def test_a_tensor_read_forward_block_by_block_leaves_nothing_mapped(tmp_path, pad, block):
    """What the engine does with a row-parallel weight: read a block of rows, drop it, read the
    next. The fault that starts each block maps its whole fault-around window (or folio), pages
    of the block before it included — already dropped. A dropper that gives back exactly the
    blocks read leaves part of every window a boundary falls in mapped (1.5 MiB of this 6 MiB
    tensor with 128 KiB blocks, ``pad`` 40000); a drop reaching back to its window's start, none."""
    from reshard.core.pages import PageDropper

    f = tmp_path / NAME
    rows, cols = 3072, 1024
    torch.save({"pad": torch.zeros(pad, dtype=torch.uint8), "w": torch.ones(rows, cols, dtype=torch.float16)}, f)
    w = load_shard(f)["w"]
    pages = PageDropper([f])
    step = max(1, block // (cols * 2))
    out = torch.empty(step, cols, dtype=torch.float16)
    whole = (w.data_ptr(), w.data_ptr() + w.numel() * 2)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        out[:n].copy_(w[r0:r0 + n])
        pages.drop(w[r0].data_ptr(), n * cols * 2, whole)
    assert resident_bytes(f) == 0
    assert torch.equal(w[-1], torch.ones(cols, dtype=torch.float16))  # read again on demand


def test_an_archive_written_at_an_offset_is_torch_saves_buffer_bytes_and_its_size_is_known_up_front(tmp_path):
    """``save(offset=)`` puts exactly ``torch.save(obj, buffer)``'s bytes at its place and touches
    nothing else of the file (a torch.distributed.checkpoint file is such archives back to back,
    written concurrently), ``saved_size`` says how many from the shapes alone, and a shared
    ``digest`` hashes the file in order."""
    import hashlib
    import io

    from reshard.core.torch_writer import PendingTensor, save, saved_size

    t = torch.randn(3, 5, 7).to(torch.bfloat16)
    pending = PendingTensor(tuple(t.shape), t.dtype, lambda sink: sink.write(t, keep=t), name="w")
    buf = io.BytesIO()
    torch.save(t.clone(), buf)
    path = tmp_path / "blobs.distcp"
    path.write_bytes(b"head" + b"\xee" * len(buf.getvalue()) + b"next archive")  # its place, then another's
    digest = hashlib.sha256(b"head")
    assert saved_size(pending) == len(buf.getvalue())
    stats = save(pending, path, offset=4, digest=digest)
    assert stats.size == len(buf.getvalue())
    assert path.read_bytes() == b"head" + buf.getvalue() + b"next archive"
    assert digest.hexdigest() == hashlib.sha256(b"head" + buf.getvalue()).hexdigest()


def test_a_streamed_file_goes_to_the_stream_whole_and_leaves_no_disk_behind(tmp_path, monkeypatch):
    """With a ``stream`` the writer feeds it the file's final bytes, in order: exactly what
    ``torch.save`` writes (CRCs in every data descriptor and in the directory, serialization id
    included); the local file keeps the structure only while it is needed, and gives every block
    back at the end — the disk a streamed output takes does not grow with its records."""
    import hashlib

    class Collect:
        def __init__(self) -> None:
            self.data = bytearray()

        def update(self, b) -> None:
            self.data += bytes(b)

    tensors = {f"layer{i}.w": torch.randn(64, 96) for i in range(40)}  # 40 records, 24 KiB each
    tensors["small"] = torch.arange(3)
    obj = {"module": {k: torch_writer.PendingTensor(tuple(v.shape), v.dtype, lambda sink, v=v: sink.write(v))
                      for k, v in tensors.items()}, "args": {"lr": 0.5}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save({"module": tensors, "args": {"lr": 0.5}}, tmp_path / "a" / "out.pt")
    want = (tmp_path / "a" / "out.pt").read_bytes()
    got = Collect()
    made: list[str | None] = []  # the memory folders this save took (other processes may hold their own)
    real_folder = torch_writer.memory_folder
    monkeypatch.setattr(torch_writer, "memory_folder", lambda: made.append(real_folder()) or made[-1])
    stats = torch_writer.save(obj, tmp_path / "b" / "out.pt", sha256=True, stream=got)
    assert bytes(got.data) == want and stats.size == len(want)
    assert stats.sha256 == hashlib.sha256(want).hexdigest()
    out = tmp_path / "b" / "out.pt"  # the structure was held in memory, or given back as it went
    assert not out.exists() or out.stat().st_blocks * 512 <= 4096
    assert len(made) == 1 and (made[0] is None or not os.path.exists(made[0])), ("left in memory", made)
    beside = tmp_path / "c" / "out.pt"  # without a memory folder: beside the output, given back
    beside.parent.mkdir()
    monkeypatch.setattr(torch_writer, "memory_folder", lambda: None)
    again = Collect()
    torch_writer.save(obj, beside, sha256=True, stream=again)
    assert bytes(again.data) == want and beside.stat().st_blocks * 512 <= 4096  # the last, partial block


def test_a_borrowed_tensor_is_its_producers_one_region_uncopied_and_given_back_after_use():
    """``PendingTensor.borrowed``: a producer writing one region of memory in chunks (a mapped
    source's rows) lends that region itself, its chunks released only when the ``with`` ends; a
    producer writing from two places gives a copy, each piece released as it is copied; a short
    producer is an error."""
    source = torch.arange(64, dtype=torch.float32)
    released: list[int] = []

    def chunked(sink):
        flat = source.view(torch.uint8)
        for off in range(0, flat.numel(), 48):
            piece = flat[off:off + 48]
            sink.write(piece, release=functools.partial(released.append, off), keep=piece)

    t = PendingTensor((8, 8), torch.float32, chunked)
    with t.borrowed() as got:
        assert got.data_ptr() == source.data_ptr() and torch.equal(got, source.view(8, 8)) and not released
    assert released == list(range(0, 256, 48))

    other = torch.full((32,), -1.0)
    released.clear()

    def two_places(sink):
        sink.write(source[:32], release=functools.partial(released.append, "a"))
        sink.write(other, release=functools.partial(released.append, "b"))

    with PendingTensor((64,), torch.float32, two_places).borrowed() as got:
        assert released == ["a", "b"] and got.data_ptr() not in (source.data_ptr(), other.data_ptr())
        assert torch.equal(got, torch.cat([source[:32], other]))
    short = PendingTensor((64,), torch.float32, lambda sink: sink.write(source[:32]))
    with pytest.raises(WriterError, match="wrote 128 of 256 bytes"), short.borrowed():
        raise AssertionError("a short producer's tensor was lent")
