"""Reads pinned to the version of an object that was listed: S3's ``If-Match`` with the listed
ETag, so an object replaced while a conversion runs fails the read (HTTP 412) instead of mixing
two versions' bytes. Used by the ranged reads of a streamed source
(:mod:`reshard.storage.remote_read`) and by the shard cache's downloads (:mod:`reshard.storage.cache`)."""

from __future__ import annotations

from typing import Any

from reshard.core.errors import StorageError
from reshard.storage.s3_transfer import is_s3


def if_match_of(fs: Any, etag: str | None) -> str | None:
    """The ``If-Match`` value for an object listed with ``etag`` (None where the store has no
    ETags to pin: local files, whose identity is their modification time)."""
    tag = (etag or "").strip('"')
    return f'"{tag}"' if is_s3(fs) and tag and not tag.startswith("mtime:") else None


def get_range(fs: Any, path: str, start: int, end: int, if_match: str | None) -> bytes:
    """Bytes ``[start, end)`` of ``path``, of the version ``if_match`` names (None: any)."""
    if if_match is None:
        return fs.cat_file(path, start=start, end=end)
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)
    return sync(fs.loop, _get_object, fs, bucket, key, start, end, if_match)


async def _get_object(fs: Any, bucket: str, key: str, start: int, end: int, if_match: str) -> bytes:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=if_match)
    body = resp["Body"]
    try:
        return await body.read()
    finally:
        body.close()


def changed(exc: BaseException | None) -> bool:
    """Did ``If-Match`` fail (S3's 412 PreconditionFailed; s3fs raises it as an ``OSError`` whose
    cause is botocore's error)?"""
    seen = 0
    while exc is not None and seen < 5:
        text = f"{type(exc).__name__} {exc}"
        if "PreconditionFailed" in text or "pre-conditions you specified" in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def changed_error(url: str, since: str = "while it was being read") -> StorageError:
    """The one error for an object that is no longer the version listed (not transient: reading it
    again reads the new version)."""
    return StorageError(f"the object changed {since}", culprit=url,
                        hint="do not convert a checkpoint that is still being written; run again once it is complete")
