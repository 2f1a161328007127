"""S3 uploads and server-side copies that keep the connection busy.

s3fs's ``put_file`` uploads a file in batches of parts and waits for each whole batch before
reading the next, so the tail of every batch runs with few requests in flight, and its
``copy`` of a large object is a sequence of 50 MiB ``UploadPartCopy`` calls, one object after
another. Measured on the loopback SeaweedFS server (``bench/bench_s3.py``), those two were
most of the gap to ``aws s3 cp``. Here:

* :func:`put_multipart`: a sliding window — ``concurrency`` parts in flight at every moment,
  each read from the file just before it is sent (memory: ``concurrency x part_size``).
* :func:`copy_objects`: one ``CopyObject`` per object up to 5 GiB (S3's single-request copy
  limit; larger ones fall back to s3fs's managed copy), all objects at once.

Request retries stay where they are configured (botocore, via s3fs); a failed multipart
upload is aborted so no orphaned parts are left behind. An upload can still be orphaned
without this process knowing its id — the response to ``CreateMultipartUpload`` is lost and
botocore's retry creates a second one, or the process is killed mid-upload — so a destination
also sweeps its staging prefix with :func:`abort_incomplete_uploads`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: S3's largest single-request ``CopyObject``.
MAX_SINGLE_COPY = 5 << 30
#: S3's smallest multipart part (except the last).
MIN_PART = 5 << 20


def is_s3(fs: Any) -> bool:
    p = fs.protocol
    return "s3" in ((p,) if isinstance(p, str) else tuple(p)) and hasattr(fs, "call_s3")


def put_multipart(fs: Any, local: Path, remote: str, *, part_size: int = 8 << 20, concurrency: int = 10) -> None:
    """Upload ``local`` to ``remote`` (an s3fs path) with ``concurrency`` parts always in flight."""
    part_size = max(part_size, MIN_PART)
    bucket, key, _ = fs.split_path(remote)
    size = local.stat().st_size
    if size <= part_size:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=local.read_bytes())
        return
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        fd = os.open(local, os.O_RDONLY)
        try:
            def send(numbered: tuple[int, int]) -> dict[str, Any]:
                number, offset = numbered
                body = os.pread(fd, min(part_size, size - offset), offset)
                out = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                 Body=body)
                return {"PartNumber": number, "ETag": out["ETag"]}

            with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reshard-put") as pool:
                parts = list(pool.map(send, enumerate(range(0, size, part_size), start=1)))
        finally:
            os.close(fd)
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                   MultipartUpload={"Parts": parts})
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # best effort: the original error is what the caller must see
            pass
        raise


#: Listing rounds of :func:`abort_incomplete_uploads` (each aborts up to a listing page, 1000).
ABORT_ROUNDS = 100


def abort_incomplete_uploads(fs: Any, prefix: str) -> int:
    """Abort every incomplete multipart upload whose key lies under ``prefix`` (an s3fs path,
    ``bucket/key/prefix``, taken as a folder); returns how many were aborted.

    Lists from the start again after each page rather than following the listing's markers
    (SeaweedFS, for one, ends a listing early when given them): aborted uploads drop out of
    the listing. An upload gone meanwhile (``NoSuchUpload``: completed or aborted by someone
    else) is skipped and not asked for again; any other error is raised."""
    bucket, key, _ = fs.split_path(prefix)
    key_prefix = key.rstrip("/") + "/" if key else ""
    tried: set[str] = set()
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


def copy_objects(fs: Any, pairs: list[tuple[str, str]], sizes: dict[str, int], *, concurrency: int = 8) -> None:
    """Server-side copy of every ``(source, destination)`` pair at once."""
    def copy(pair: tuple[str, str]) -> None:
        src, dst = pair
        if sizes.get(src, MAX_SINGLE_COPY + 1) > MAX_SINGLE_COPY:
            fs.copy(src, dst)
            return
        sb, sk, _ = fs.split_path(src)
        db, dk, _ = fs.split_path(dst)
        fs.call_s3("copy_object", Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk})

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(pairs))),
                            thread_name_prefix="reshard-copy") as pool:
        list(pool.map(copy, pairs))
