"""S3 multipart uploads that keep the connection busy, and that publish nothing until told.

s3fs's ``put_file`` uploads a file in batches of parts and waits for each whole batch before
reading the next, so the tail of every batch runs with few requests in flight. Measured on the
loopback SeaweedFS server (``bench/bench_s3.py``), that was most of the gap to ``aws s3 cp``.
Here:

* :func:`upload_parts` / :func:`put_multipart`: a sliding window — ``concurrency`` parts in
  flight at every moment, each read from the file just before it is sent (memory:
  ``concurrency x part_size``).
* :class:`MultipartStream`: the same window fed with bytes as a writer produces them, in file
  order, so an output goes up while it is being converted and never lies whole on local disk.

Request retries stay where they are configured (botocore, via s3fs); a failed multipart
upload is aborted so no orphaned parts are left behind. An upload can still be orphaned
without this process knowing its id — the response to ``CreateMultipartUpload`` is lost and
botocore's retry creates a second one, or the process is killed mid-upload — so a destination
also sweeps its prefix with :func:`abort_incomplete_uploads`.

:func:`upload_parts` sends every part and stops short of ``CompleteMultipartUpload``: until it is
completed (:func:`complete_upload`) the object does not exist — not listed, not readable — so an
output can go straight to its final key and still become visible only at the commit
(:class:`reshard.storage.s3_destination.S3Destination`).
"""

from __future__ import annotations

import hashlib
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: S3's smallest multipart part (except the last).
MIN_PART = 5 << 20


def is_s3(fs: Any) -> bool:
    p = fs.protocol
    return "s3" in ((p,) if isinstance(p, str) else tuple(p)) and hasattr(fs, "call_s3")


#: S3's most parts per upload, and its largest part.
MAX_PARTS = 10_000
MAX_PART = 5 << 30
#: :class:`MultipartStream`: parts of one size, then twice that size for the next as many.
PARTS_PER_SIZE = 2000


def part_size_for(size: int, part_size: int) -> int:
    """``part_size``, raised (in whole MiB) where ``size`` would need more than S3's 10,000 parts:
    8 MiB parts cap an upload at 80 GB, less than one TP-1 shard of a 70B model."""
    need = -(-size // MAX_PARTS)
    return max(part_size, MIN_PART, -(-need // (1 << 20)) << 20)


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload whose parts are all sent but which is not completed: nothing is visible
    at ``path`` (an s3fs path, ``bucket/key``) until :func:`complete_upload`."""

    path: str
    upload_id: str
    etags: tuple[str, ...]
    size: int

    def to_record(self) -> dict[str, Any]:
        return {"path": self.path, "upload_id": self.upload_id, "etags": list(self.etags), "size": self.size}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> PendingUpload:
        return cls(str(rec["path"]), str(rec["upload_id"]), tuple(str(e) for e in rec["etags"]), int(rec["size"]))

    @property
    def object_etag(self) -> str | None:
        """The ETag S3 gives the completed object (MD5 of the parts' MD5s, ``-N``), or None where
        the parts' ETags are not MD5s (e.g. SSE-KMS) and it cannot be known in advance."""
        raw = [e.strip('"') for e in self.etags]
        if not all(len(e) == 32 and all(c in "0123456789abcdefABCDEF" for c in e) for e in raw):
            return None
        return f"{hashlib.md5(b''.join(bytes.fromhex(e) for e in raw)).hexdigest()}-{len(raw)}"  # noqa: S324


def upload_parts(fs: Any, local: Path, remote: str, *, part_size: int = 8 << 20,
                 concurrency: int = 10) -> PendingUpload:
    """Send ``local`` as the parts of a new multipart upload to ``remote`` with ``concurrency``
    parts always in flight, and leave it uncompleted (aborted if any part fails)."""
    bucket, key, _ = fs.split_path(remote)
    size = local.stat().st_size
    part_size = part_size_for(size, part_size)
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        fd = os.open(local, os.O_RDONLY)
        try:
            def send(numbered: tuple[int, int]) -> str:
                number, offset = numbered
                body = os.pread(fd, min(part_size, size - offset), offset)
                return fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                  Body=body)["ETag"]

            offsets = range(0, size, part_size) if size else range(1)  # an empty file: one empty part
            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reshard-put") as pool:
                etags = tuple(pool.map(send, enumerate(offsets, start=1)))
        finally:
            os.close(fd)
    except BaseException:
        _abort_quietly(fs, bucket, key, upload_id)
        raise
    return PendingUpload(remote, upload_id, etags, size)


class MultipartStream:
    """Bytes fed in file order (:meth:`update`) become the parts of a new multipart upload to
    ``remote``, each sent as soon as it is full while the next fills; :meth:`finish` sends the
    last one and returns the upload *uncompleted* (nothing is visible at ``remote`` until
    :func:`complete_upload`). Parts are immutable once sent, so the writer must feed each byte's
    final value, once.

    Memory is ``concurrency x part_size`` in flight plus the part being filled, in reused buffers.
    :meth:`update` blocks while every buffer is in flight: a slow upload slows the producer
    instead of piling bytes up. Parts are ``part_size``, or larger when ``size_hint`` (the
    expected size) would need more than S3's 10,000 parts — then fewer are in flight, so the
    memory stays the same. Beyond what the hint allowed for, sizes double every
    :data:`PARTS_PER_SIZE` parts, so an output of any size fits (S3 lets each part have its own
    size; only the last may be under 5 MiB). Called from one thread; a failed part (after
    botocore's retries) aborts the upload and is raised by the next call.

    ==================  =====================================================
    fed                 parts sent
    ==================  =====================================================
    0 bytes             one empty part (S3 needs one)
    ``part_size + 1``   ``part_size``, then 1 byte at :meth:`finish`
    ==================  =====================================================
    """

    def __init__(self, fs: Any, remote: str, *, part_size: int = 8 << 20, concurrency: int = 10,
                 size_hint: int | None = None) -> None:
        self.fs, self.path = fs, remote
        self.bucket, self.key, _ = fs.split_path(remote)
        part_size = max(part_size, MIN_PART)
        self.base = part_size_for(size_hint + size_hint // 4, part_size) if size_hint else part_size
        in_flight = max(2, concurrency * part_size // self.base)
        self.upload_id: str = fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]
        self.pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="reshard-stream")
        self.free: queue.Queue[bytearray] = queue.Queue()
        self.buffers = 0
        self.limit = in_flight + 1
        self.futures: list[Future[str]] = []
        self.buf: bytearray | None = None
        self.fill = 0
        self.size = 0
        self.closed = False

    def _part_size(self, number: int) -> int:
        return min(MAX_PART, self.base << ((number - 1) // PARTS_PER_SIZE))

    def _buffer(self, size: int) -> bytearray:
        if self.free.empty() and self.buffers < self.limit:
            self.buffers += 1
            return bytearray(size)
        while True:
            try:
                buf = self.free.get(timeout=0.5)
                break
            except queue.Empty:
                self._raise_failed()
        if len(buf) < size:  # the part size grew
            buf = bytearray(size)
        return buf

    def _raise_failed(self) -> None:
        for fut in self.futures:
            if fut.done() and fut.exception() is not None:
                self.abort()
                raise fut.exception()  # type: ignore[misc]

    def update(self, data: Any) -> None:
        """Append ``data`` (bytes-like) to the object."""
        if self.closed:
            raise ValueError(f"{self.path}: stream already finished or aborted")
        mv = memoryview(data).cast("B")
        while len(mv):
            if self.buf is None:
                self._raise_failed()
                self.buf = self._buffer(self._part_size(len(self.futures) + 1))
                self.fill = 0
            want = self._part_size(len(self.futures) + 1)
            take = min(len(mv), want - self.fill)
            self.buf[self.fill:self.fill + take] = mv[:take]
            self.fill += take
            self.size += take
            mv = mv[take:]
            if self.fill == want:
                self._send()

    def _send(self) -> None:
        buf, n, number = self.buf, self.fill, len(self.futures) + 1
        self.buf = None

        def send() -> str:
            try:
                body = buf if len(buf) == n else bytes(memoryview(buf)[:n])  # botocore takes no memoryview
                return self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                       PartNumber=number, Body=body)["ETag"]
            finally:
                self.free.put(buf)  # type: ignore[arg-type]

        if number > MAX_PARTS:
            self.abort()
            raise OSError(f"{self.path}: more than {MAX_PARTS} parts")
        self.futures.append(self.pool.submit(send))

    def finish(self) -> PendingUpload:
        """Send what is left and wait for every part: the upload, not completed."""
        if self.closed:
            raise ValueError(f"{self.path}: stream already finished or aborted")
        if self.buf is not None or not self.futures:  # the rest, or one empty part for an empty object
            if self.buf is None:
                self.buf, self.fill = bytearray(0), 0
            self._send()
        try:
            etags = tuple(f.result() for f in self.futures)
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self.pool.shutdown(wait=True)
        return PendingUpload(self.path, self.upload_id, etags, self.size)

    def abort(self) -> None:
        """Drop the upload and every part sent (best effort); the key is untouched."""
        if self.closed:
            return
        self.closed = True
        for fut in self.futures:
            fut.cancel()
        self.pool.shutdown(wait=True)
        _abort_quietly(self.fs, self.bucket, self.key, self.upload_id)


def uploaded_bytes(fs: Any, up: PendingUpload) -> int:
    """Bytes the server holds for ``up``'s parts (``ListParts``, page by page), one part per part
    number — the one with this upload's ETag where a server lists a part sent twice (a request
    retried after a timeout) twice, as SeaweedFS does; S3 keeps the last. Raises
    ``FileNotFoundError`` when the upload is gone (completed or aborted)."""
    bucket, key, _ = fs.split_path(up.path)
    sizes: dict[int, int] = {}
    marker = 0
    for _ in range(MAX_PARTS // 1000 + 1):
        page = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=up.upload_id, PartNumberMarker=marker)
        parts = page.get("Parts") or []
        for p in parts:
            n = int(p["PartNumber"])
            if n not in sizes or (n <= len(up.etags) and str(p.get("ETag")).strip('"') == up.etags[n - 1].strip('"')):
                sizes[n] = int(p["Size"])
        if not page.get("IsTruncated") or not parts:
            break
        marker = int(page.get("NextPartNumberMarker") or parts[-1]["PartNumber"])
    return sum(sizes.values())


def upload_state(fs: Any, up: PendingUpload) -> str | None:
    """``"pending"`` (the upload is there, uncompleted), ``"completed"`` (gone, and the object at
    its key is the one it made: same size and, where knowable, same ETag) or None (lost)."""
    bucket, key, _ = fs.split_path(up.path)
    try:
        fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=up.upload_id, MaxParts=1)
        return "pending"
    except FileNotFoundError:
        pass
    return "completed" if _is_completed_object(fs, up) else None


def _is_completed_object(fs: Any, up: PendingUpload) -> bool:
    bucket, key, _ = fs.split_path(up.path)
    try:
        head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return False
    expected = up.object_etag
    return int(head["ContentLength"]) == up.size and (
        expected is None or str(head.get("ETag", "")).strip('"') == expected)


def complete_upload(fs: Any, up: PendingUpload) -> None:
    """Make ``up``'s object visible. Completing it again (a resumed commit; a retried request whose
    answer was lost) is no error as long as the object there is the one it made."""
    bucket, key, _ = fs.split_path(up.path)
    parts = [{"PartNumber": n, "ETag": e} for n, e in enumerate(up.etags, start=1)]
    try:
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=up.upload_id,
                   MultipartUpload={"Parts": parts})
    except FileNotFoundError:
        if not _is_completed_object(fs, up):
            raise
        return
    if not _is_completed_object(fs, up):
        raise OSError(f"{up.path}: the completed object is not the {up.size} bytes uploaded")


def put_multipart(fs: Any, local: Path, remote: str, *, part_size: int = 8 << 20, concurrency: int = 10) -> None:
    """Upload ``local`` to ``remote`` (an s3fs path) with ``concurrency`` parts always in flight."""
    part_size = max(part_size, MIN_PART)
    if local.stat().st_size <= part_size:
        bucket, key, _ = fs.split_path(remote)
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=local.read_bytes())
        return
    up = upload_parts(fs, local, remote, part_size=part_size, concurrency=concurrency)
    try:
        complete_upload(fs, up)
    except BaseException:
        bucket, key, _ = fs.split_path(remote)
        _abort_quietly(fs, bucket, key, up.upload_id)
        raise


def abort_upload(fs: Any, up: PendingUpload) -> None:
    """Abort ``up`` (its parts are dropped; the key is untouched), best effort."""
    bucket, key, _ = fs.split_path(up.path)
    _abort_quietly(fs, bucket, key, up.upload_id)


def _abort_quietly(fs: Any, bucket: str, key: str, upload_id: str) -> None:
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception:  # best effort: the original error is what the caller must see
        pass


#: Listing rounds of :func:`abort_incomplete_uploads` (each aborts up to a listing page, 1000).
ABORT_ROUNDS = 100


def abort_incomplete_uploads(fs: Any, prefix: str, keep: frozenset[str] = frozenset()) -> int:
    """Abort every incomplete multipart upload whose key lies under ``prefix`` (an s3fs path,
    ``bucket/key/prefix``, taken as a folder), except those whose id is in ``keep``; returns how
    many were aborted.

    Lists from the start again after each page rather than following the listing's markers
    (SeaweedFS, for one, ends a listing early when given them): aborted uploads drop out of
    the listing. An upload gone meanwhile (``NoSuchUpload``: completed or aborted by someone
    else) is skipped and not asked for again; any other error is raised."""
    bucket, key, _ = fs.split_path(prefix)
    key_prefix = key.rstrip("/") + "/" if key else ""
    tried: set[str] = set(keep)
    aborted = 0
    for _ in range(ABORT_ROUNDS):
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix)
        todo = [u for u in page.get("Uploads") or []
                if str(u.get("Key", "")).startswith(key_prefix) and u.get("UploadId") not in tried]
        if not todo:
            break
        for upload in todo:
            tried.add(upload["UploadId"])
            try:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
            except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
                pass
    return aborted
