"""Storage hygiene: what a run leaves behind besides its output.

* S3 clients are closed on the event loop that created them, whichever thread frees them
  (no "attached to a different loop" errors when conversions run side by side in one process);
* no incomplete multipart upload survives under a destination's staging prefix once a run
  committed, was resumed and committed, or aborted — also one orphaned by a lost
  ``CreateMultipartUpload`` response that botocore retried (real SeaweedFS behind the fault proxy);
* a failed run into a local folder leaves the folder as it was: no ``.reshard-staging``, no lock.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import threading
import time
import uuid
import weakref
from pathlib import Path

import pytest

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions
from reshard.sample import GPTConfig, write_sample_checkpoint
from reshard.storage.cache import ShardCache
from reshard.storage.destination import LOCK_NAME, STAGING_DIR
from reshard.storage.destinations import open_destination
from reshard.storage.location import open_location
from reshard.storage.manifest import MANIFEST_NAME, verify
from reshard.storage.s3_transfer import abort_incomplete_uploads

CFG = GPTConfig(layers=2, hidden=64, heads=8, vocab=128, seq=16)
CROSS_LOOP = ("different loop", "never retrieved", "Task was destroyed")


@pytest.fixture(scope="module")
def tp4(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hygiene") / "tp4"
    write_sample_checkpoint(folder, tp=4, cfg=CFG)
    return folder


@pytest.fixture
def asyncio_records():
    """Records of the ``asyncio`` logger (where "Task exception was never retrieved" goes)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _collect_inside_another_event_loop() -> None:
    """A garbage collection that happens to run in a thread with its own running event loop —
    as it does, sooner or later, in Prefect's API/log/event threads, an ASGI server or a Dask
    worker sharing the process with conversions."""
    def run() -> None:
        async def main() -> None:
            gc.collect()
            await asyncio.sleep(0.5)  # let anything it scheduled here run (and fail) on this loop

        asyncio.run(main())

    t = threading.Thread(target=run, name="another-event-loop")
    t.start()
    t.join(30)


def _cross_loop_trouble(records: list[logging.LogRecord], text: str = "") -> list[str]:
    found = [r.getMessage()[:400] for r in records if any(k in r.getMessage() for k in CROSS_LOOP)]
    found += [line[:400] for line in text.splitlines() if any(k in line for k in CROSS_LOOP)]
    return found


# --- 1. S3 clients closed on their own loop --------------------------------------------------------

def test_s3_filesystem_freed_inside_another_event_loop_closes_its_client_on_its_own(
        s3_server, s3_bucket, asyncio_records, capfd):
    loc = open_location(f"{s3_bucket}/x", s3_server.storage_options())
    loc.fs.pipe_file(loc.join("a"), b"data")  # connects: creates the aiobotocore client on fsspec's loop
    http = loc.fs.s3._endpoint.http_session
    assert http._sessions is not None  # open
    alive = weakref.ref(loc.fs)
    holder = [loc]
    del loc

    def drop_inside_a_loop() -> None:
        async def main() -> None:
            holder.clear()  # the last reference goes in a thread whose running loop is not the client's
            gc.collect()
            await asyncio.sleep(0.5)

        asyncio.run(main())

    t = threading.Thread(target=drop_inside_a_loop)
    t.start()
    t.join(30)
    gc.collect()
    assert alive() is None
    deadline = time.monotonic() + 10
    while http._sessions is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http._sessions is None, "the client was never closed"
    assert _cross_loop_trouble(asyncio_records, capfd.readouterr().err) == []


def test_concurrent_s3_conversions_close_their_clients_on_their_own_loop(s3_server, s3_bucket, tp4, tmp_path,
                                                                          asyncio_records, capfd):
    """Two conversions at once in one process, one succeeds and one fails; whatever clients they
    leave to the garbage collector must not be closed on a foreign loop."""
    so = s3_server.storage_options()
    src = f"{s3_bucket}/src"
    loc = open_location(src, so)
    for p in sorted(tp4.iterdir()):
        loc.fs.put_file(str(p), loc.join(p.name))
    del loc
    gc.collect()
    barrier = threading.Barrier(2, timeout=60)
    outcome: dict[int, str] = {}

    def run(tp: int) -> None:
        barrier.wait()
        try:
            run_direct(src, f"{s3_bucket}/out-tp{tp}", ReshardOptions(target_tp=tp), storage_options=so,
                       cache=ShardCache(tmp_path / f"cache{tp}"))
            outcome[tp] = "ok"
        except LayoutError as exc:
            outcome[tp] = f"refused: {exc}"

    gc.disable()  # the whole process's garbage is collected below, inside another event loop
    try:
        threads = [threading.Thread(target=run, args=(tp,)) for tp in (2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        _collect_inside_another_event_loop()
    finally:
        gc.enable()
    gc.collect()
    time.sleep(0.5)
    gc.collect()
    assert outcome[2] == "ok" and outcome[3].startswith("refused"), outcome
    verify(f"{s3_bucket}/out-tp2", so)
    assert _cross_loop_trouble(asyncio_records, capfd.readouterr().err) == []


# --- 2. no orphaned multipart uploads under the staging prefix -------------------------------------

def _uploads(server, bucket: str, prefix: str = "") -> list[str]:
    """Keys of the incomplete multipart uploads in ``bucket`` (asked directly, not through reshard)."""
    out = server.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return sorted(u["Key"] for u in out.get("Uploads", []))


@pytest.mark.parametrize("end", ["commit", "resume-then-commit", "abort"])
def test_lost_create_multipart_upload_response_leaves_no_upload_behind(s3_server, s3_bucket, tmp_path, end):
    """The proxy forwards the first CreateMultipartUpload and resets the connection instead of
    relaying the answer: the server holds an upload this process never heard of, botocore retries
    and the output goes up through a second one, which stays uncompleted (invisible) until the
    commit. After the run ends — committed, resumed after a kill then committed, or aborted — no
    incomplete upload is left under the destination."""
    from faultproxy import FaultProxy

    bucket = s3_bucket.removeprefix("s3://")
    dst = f"{s3_bucket}/out"
    name = "mp_rank_00_model_states.pt"
    data = os.urandom(11 << 20)  # > UPLOAD_PART_BYTES (8 MiB): a two-part multipart upload
    with FaultProxy(s3_server.endpoint_url) as proxy:
        so = s3_server.storage_options(endpoint_url=proxy.endpoint_url)
        dest = open_destination(dst, dict(so), overwrite=False, workdir=tmp_path / "w1")
        cid = "conversion-" + uuid.uuid4().hex
        dest.acquire(uuid.uuid4().hex, cid)
        dest.open(clean_staging=False)
        dest.staged(name).write_bytes(data)
        with proxy.faulting("reset", method="POST", path=r"\?uploads", start=1, max_faults=1,
                            reset_after_upstream=True):
            record = dest.publish(name)
        assert proxy.faults_injected == 1
        assert _uploads(s3_server, bucket) == [f"out/{name}"] * 2  # the orphan and the pending one
        assert not open_location(dst, so).fs.exists(f"{bucket}/out/{name}")  # nothing visible yet
        manifest = {"files": [record], "conversion_id": cid}
        if end == "abort":
            dest.abort()
            assert not open_location(dst, so).fs.exists(f"{bucket}/out/{LOCK_NAME}")
        else:
            if end == "resume-then-commit":  # killed here; the resume reuses what was staged
                dest = open_destination(dst, dict(so), overwrite=False, workdir=tmp_path / "w2", check=False)
                dest.acquire(uuid.uuid4().hex, cid)
                dest.open(clean_staging=False)
                assert dest.staged_size(name) == len(data)
            dest.commit([name], manifest)
            assert open_location(dst, so).fs.cat_file(f"{bucket}/out/{name}") == data
    assert _uploads(s3_server, bucket) == []


def test_abort_incomplete_uploads_stays_under_its_prefix(s3_server, s3_bucket):
    bucket = s3_bucket.removeprefix("s3://")
    client = s3_server.client()
    keys = ["d/.reshard-staging/a.pt", "d/.reshard-staging/sub/b.pt", "d/.reshard-staging/a.pt",
            "d/.reshard-staging-not/c.pt", "d/other.pt", "e/.reshard-staging/d.pt"]
    for key in keys:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    fs = open_location(s3_bucket, s3_server.storage_options()).fs
    assert abort_incomplete_uploads(fs, f"{bucket}/d/.reshard-staging") == 3
    assert _uploads(s3_server, bucket) == ["d/.reshard-staging-not/c.pt", "d/other.pt", "e/.reshard-staging/d.pt"]
    assert abort_incomplete_uploads(fs, f"{bucket}/d/.reshard-staging") == 0


def test_a_part_sent_twice_is_counted_once_and_completes_as_sent_last(s3_server, s3_bucket):
    """A part whose request timed out is sent again under the same number; SeaweedFS then lists
    both copies (S3 keeps the last). The verification before an upload is recorded counts each
    part number once — the copy with the upload's own ETag — so a retried part is not taken for
    a corrupt upload (seen as "the server holds 1763038 of 881519 bytes" under injected latency),
    and the completed object holds the part as sent last."""
    from reshard.storage.s3_transfer import PendingUpload, complete_upload, uploaded_bytes

    bucket = s3_bucket.removeprefix("s3://")
    client = s3_server.client()
    up_id = client.create_multipart_upload(Bucket=bucket, Key="twice.bin")["UploadId"]
    client.upload_part(Bucket=bucket, Key="twice.bin", UploadId=up_id, PartNumber=1, Body=b"x" * 10)
    etag = client.upload_part(Bucket=bucket, Key="twice.bin", UploadId=up_id, PartNumber=1, Body=b"y" * 20)["ETag"]
    listed = client.list_parts(Bucket=bucket, Key="twice.bin", UploadId=up_id)["Parts"]
    fs = open_location(s3_bucket, s3_server.storage_options()).fs
    up = PendingUpload(f"{bucket}/twice.bin", up_id, (etag,), 20)
    assert uploaded_bytes(fs, up) == 20, listed
    complete_upload(fs, up)
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/twice.bin") == b"y" * 20


# --- 3. a failed local run leaves the destination as it was ----------------------------------------

def _truncated_source(tp4: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for p in tp4.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    os.truncate(src / "mp_rank_03_model_states.pt", 5000)
    return src


def _as_before(out: Path, existed: bool) -> None:
    if existed:
        assert sorted(os.listdir(out)) == [], sorted(os.listdir(out))
    else:
        assert not out.exists() or os.listdir(out) == [], sorted(os.listdir(out))


@pytest.mark.parametrize("existed", [False, True], ids=["new-folder", "existing-empty-folder"])
def test_failed_flow_run_leaves_no_staging_folder(tp4, tmp_path, capsys, existed, prefect_env):
    """``reshard run`` (the Prefect flow) on a source with a truncated shard: exit 2, and the
    destination holds no ``.reshard-staging`` (nor lock) afterwards."""
    from reshard.cli import main

    src = _truncated_source(tp4, tmp_path)
    out = tmp_path / "out"
    if existed:
        out.mkdir()
    code = main(["run", str(src), str(out), "--target-tp", "2", "--cache-dir", str(tmp_path / "cache")])
    assert code == 2, capsys.readouterr().err
    _as_before(out, existed)


@pytest.mark.parametrize("existed", [False, True], ids=["new-folder", "existing-empty-folder"])
@pytest.mark.parametrize("when", ["bad-input", "after-the-claim"])
def test_failed_direct_run_leaves_the_destination_as_it_was(tp4, tmp_path, existed, when):
    out = tmp_path / "out"
    if existed:
        out.mkdir()
    if when == "bad-input":
        with pytest.raises(CheckpointFormatError):
            run_direct(str(_truncated_source(tp4, tmp_path)), str(out), ReshardOptions(target_tp=2))
    else:
        def fail(_result):
            assert (out / LOCK_NAME).is_file() and (out / STAGING_DIR).is_dir()  # claimed and staging
            raise RuntimeError("disk full")

        with pytest.raises(RuntimeError, match="disk full"):
            run_direct(str(tp4), str(out), ReshardOptions(target_tp=2), on_target_done=fail)
    _as_before(out, existed)


def test_local_destination_staged_size_creates_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dest = open_destination(str(out), None, overwrite=False, workdir=None, check=False)
    assert dest.staged_size("mp_rank_00_model_states.pt") is None
    assert os.listdir(out) == []


def test_abandon_releases_the_claim_and_keeps_what_the_resume_reuses(tmp_path):
    """For a failed flow run (which can be resumed): our lock goes, staged outputs stay, an empty
    staging folder goes; the resume finds the staged output and commits it."""
    out = tmp_path / "out"
    token, cid = uuid.uuid4().hex, "conversion-1"
    claim = open_destination(str(out), None, overwrite=False, workdir=None)
    claim.acquire(token, cid)
    claim.open(clean_staging=False)
    claim.staged("a.pt").write_bytes(b"a" * 10)
    claim.staged("sub/b.pt").parent.mkdir(parents=True, exist_ok=True)  # a folder, no output yet

    later = open_destination(str(out), None, overwrite=False, workdir=None, check=False)  # another task
    later.adopt_lock(token, cid)
    later.abandon()
    assert not (out / LOCK_NAME).exists()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [STAGING_DIR, f"{STAGING_DIR}/a.pt"]

    resumed = open_destination(str(out), None, overwrite=False, workdir=None, check=False)
    resumed.acquire(uuid.uuid4().hex, cid)
    resumed.open(clean_staging=False)
    assert resumed.staged_size("a.pt") == 10
    resumed.commit(["a.pt"], {"files": [resumed.publish("a.pt")], "conversion_id": cid})
    assert sorted(os.listdir(out)) == ["a.pt", MANIFEST_NAME]
    assert json.loads((out / MANIFEST_NAME).read_text())["conversion_id"] == cid

    empty = tmp_path / "empty"
    first = open_destination(str(empty), None, overwrite=False, workdir=None)
    first.acquire(token, cid)
    first.open()
    first.abandon()
    assert os.listdir(empty) == []

    taken = tmp_path / "taken"  # not ours any more: nothing is touched
    mine = open_destination(str(taken), None, overwrite=False, workdir=None)
    mine.acquire(token, cid)
    mine.staged("x.pt").write_bytes(b"x")
    other = open_destination(str(taken), None, overwrite=False, workdir=None, check=False)
    other.acquire(uuid.uuid4().hex, cid)  # a duplicate run of the same conversion took over
    mine.abandon()
    assert (taken / LOCK_NAME).is_file() and (taken / STAGING_DIR / "x.pt").is_file()


def test_a_flow_that_fails_after_its_claim_releases_the_destination(tp4, tmp_path, prefect_env, monkeypatch):
    """Publishing fails after the flow claimed the destination: the run fails with that error and
    leaves no lock behind (staged outputs, if any, would stay for the resume)."""
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow
    from reshard.storage.destination import LocalDestination

    def full(self, name, sha256=None):
        assert (tmp_path / "out" / LOCK_NAME).is_file()  # claimed
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalDestination, "publish", full)
    with pytest.raises(OSError, match="No space left"):
        run_flow(ReshardParams(source=str(tp4), destination=str(tmp_path / "out"), target_tp=2,
                               cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "out" / LOCK_NAME).exists()


# --- 4. a conversion's work folder: bounded while it runs, gone once it is committed ---------------

def _dead_attempt(parent: Path, name: str = "dead") -> Path:
    """What an attempt killed while writing leaves: its lock file (no process holds it) and its
    folder with a half-written output."""
    parent.mkdir(parents=True, exist_ok=True)
    (parent / f"{name}.lock").write_bytes(b"")
    (parent / name).mkdir()
    (parent / name / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    return parent / name


def test_an_attempt_reclaims_dead_attempts_scratch_but_never_a_live_one(tmp_path):
    from reshard.storage.workdirs import scratch_folder

    parent = tmp_path / ".partial"
    dead = _dead_attempt(parent)
    legacy = parent / "0123abcd"  # a folder without a lock (written before locks, or its lock just went)
    legacy.mkdir()
    with scratch_folder(parent) as live:
        (live / "out.pt").write_bytes(b"y")
        assert not dead.exists() and not legacy.exists() and not (parent / "dead.lock").exists()
        with scratch_folder(parent) as other:  # a second attempt meanwhile: the live one is left alone
            assert (live / "out.pt").is_file() and other != live
        assert not other.exists()
    assert os.listdir(parent) == []


def test_the_run_that_finishes_a_conversion_removes_its_work_folder_unless_another_holds_it(tmp_path):
    from reshard.storage.workdirs import WorkUse

    cache = ShardCache(tmp_path / "cache")
    folder = cache.conversion_work("c" * 64)
    _dead_attempt(folder / "out" / ".partial")
    first, second = WorkUse(folder), WorkUse(folder)  # two runs of one conversion at once
    assert not first.finish() and folder.is_dir()  # the other still works there
    first.close()
    assert second.finish() and not folder.exists()
    second.close()
    assert os.listdir(cache.work) == []
    third = WorkUse(folder)  # a later run of the same conversion starts afresh
    assert third.lock.is_file()
    third.close()
    assert cache.finish_work("c" * 64) and os.listdir(cache.work) == []
