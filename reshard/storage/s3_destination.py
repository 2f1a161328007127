"""An S3 destination whose outputs go straight to their final keys, invisible until the commit.

An uncompleted multipart upload is not an object: it is neither listed nor readable. So each
output is uploaded as the parts of a multipart upload *to its final key* — while it is being
written (:meth:`S3Destination.open_stream`: the writer's bytes go up part by part and never lie
whole on local disk) or, for a file written locally, as soon as it is complete (:meth:`publish`)
— and left uncompleted; the commit completes them all, then writes the manifest. The final keys
change only during the commit, exactly as with a staging copy, but the bytes cross the network
once and the server copies nothing (the staging copy cost a third of the upload).

What a resume needs is kept at the destination, beside the lock, one small JSON per output under
``DST/.reshard-staging/<name>.upload.json``: the upload's id, its parts' ETags, size and sha256.

==========================  =============================================================
event                       what is left, and what the next run does with it
==========================  =============================================================
killed while uploading      an incomplete upload with no record (a file being published,
(or streaming)              or an output being streamed): aborted (fresh start, commit,
                            abandon) — never completed; the output is converted again
killed after uploading      the record and its pending upload: the resume reuses both
killed while completing     some objects completed, the others still pending: the resume
                            completes the rest; a completed one is recognised by its size
                            and multipart ETag (MD5 of the parts' MD5s)
commit done                 records removed, every other incomplete upload under DST aborted
==========================  =============================================================

Every incomplete upload under the destination belongs to the lock holder (only it uploads
there), so the sweeps cover the whole destination prefix.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reshard.core.errors import StorageError
from reshard.crashpoints import crash_point
from reshard.storage.destination import UPLOAD_ATTEMPTS, RemoteDestination
from reshard.storage.location import storage_errors
from reshard.storage.manifest import MANIFEST_NAME, file_record
from reshard.storage.s3_transfer import (
    MultipartStream,
    PendingUpload,
    abort_incomplete_uploads,
    abort_upload,
    complete_upload,
    upload_parts,
    upload_state,
    uploaded_bytes,
)

log = logging.getLogger(__name__)

#: Multipart uploads: part size (raised for files over 80 GB, see ``part_size_for``) and parts in flight.
UPLOAD_PART_BYTES = 8 << 20
UPLOAD_CONCURRENCY = 10
#: Uploads completed at once by the commit (each is one request; the server assembles the parts).
COMPLETE_CONCURRENCY = 8
RECORD_SUFFIX = ".upload.json"


class S3Destination(RemoteDestination):
    """S3 (s3fs): outputs uploaded to their final keys, completed at the commit."""

    takes_streams = True

    def _record_path(self, name: str) -> str:
        return f"{self.staging_prefix}/{name}{RECORD_SUFFIX}"

    def _read_record(self, name: str) -> dict[str, Any] | None:
        path = self._record_path(name)
        with storage_errors(self.url):
            self.loc.fs.invalidate_cache(path)
            if not self.loc.fs.exists(path):
                return None
            raw = self.loc.fs.cat_file(path)
        try:
            rec = json.loads(raw)
            PendingUpload.from_record(rec["upload"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None  # torn or foreign: the output is redone
        return rec if rec.get("path") == name else None

    def _pending(self, name: str) -> tuple[dict[str, Any], PendingUpload, str] | None:
        """``name``'s record, its upload and that upload's state, or None when there is no usable one."""
        rec = self._read_record(name)
        if rec is None:
            return None
        up = PendingUpload.from_record(rec["upload"])
        if up.path != self.loc.join(name):
            return None
        with storage_errors(self.url):
            state = upload_state(self.loc.fs, up)
        return (rec, up, state) if state else None

    def staged_size(self, name: str) -> int | None:
        found = self._pending(name)
        return None if found is None else int(found[0]["size"])

    def publish(self, name: str, sha256: str | None = None) -> dict[str, Any]:
        """Upload the written file as the parts of an uncompleted upload to its final key, check
        the server holds every byte, record the upload, free the local copy."""
        local = self.staged(name)
        if not local.exists():  # a killed run uploaded it and freed the local copy before recording that
            found = self._pending(name)
            if found is not None:
                return {k: found[0][k] for k in ("path", "size", "sha256")}
        record = file_record(local, name, sha256)
        crash_point("uploading")
        attempt = 1
        while True:
            try:
                with storage_errors(self.url):
                    up = upload_parts(self.loc.fs, local, self.loc.join(name), part_size=UPLOAD_PART_BYTES,
                                      concurrency=UPLOAD_CONCURRENCY)
                    self._record_upload(record, up)
            except StorageError as exc:  # a short upload: sent again, a few times
                if not exc.transient or attempt >= UPLOAD_ATTEMPTS:
                    raise
                attempt += 1
                continue
            local.unlink()
            return record

    def open_stream(self, name: str, size_hint: int | None = None) -> S3OutputStream:
        """An upload of output ``name`` fed while it is written (see :class:`S3OutputStream`)."""
        crash_point("uploading")
        with storage_errors(self.url):
            return S3OutputStream(self, name, size_hint)

    def _record_upload(self, record: dict[str, Any], up: PendingUpload) -> dict[str, Any]:
        """Check the server holds every byte of ``up``, then record it beside the lock: from here
        on a resume reuses the upload (until then it is an orphan the next sweep aborts)."""
        held = uploaded_bytes(self.loc.fs, up)
        if held != record["size"]:
            abort_upload(self.loc.fs, up)
            raise StorageError(f"upload of {record['path']} failed verification (the server holds {held} of "
                               f"{record['size']} bytes)", culprit=self.url, hint="retry; check the storage endpoint",
                               transient=True)
        uploaded = json.dumps(dict(record, upload=up.to_record())).encode()
        self.loc.fs.pipe_file(self._record_path(record["path"]), uploaded)
        return record

    def commit(self, names: list[str], manifest: dict[str, Any]) -> None:
        """Complete every output's upload (the first alone, then the rest at once), remove stale
        files of an overwritten checkpoint, write the manifest last, then sweep."""
        fs = self.loc.fs
        self._assert_lock()
        uploads = []
        for name in names:
            rec = self._read_record(name)
            if rec is None:
                raise StorageError(f"{name} was not uploaded by this conversion (no upload record)",
                                   culprit=self.url, hint="re-run; the output will be uploaded again")
            uploads.append(PendingUpload.from_record(rec["upload"]))
        with storage_errors(self.url):
            if uploads:
                complete_upload(fs, uploads[0])
                crash_point("copying")
            with ThreadPoolExecutor(max_workers=COMPLETE_CONCURRENCY, thread_name_prefix="reshard-complete") as pool:
                list(pool.map(lambda up: complete_upload(fs, up), uploads[1:]))
            for old in self._old_files:
                if old not in names and fs.exists(self.loc.join(old)):
                    fs.rm_file(self.loc.join(old))
            crash_point("committed-files")
            self._assert_lock()
            fs.pipe_file(self.loc.join(MANIFEST_NAME), json.dumps(manifest, indent=2, sort_keys=True).encode())
            fs.rm(self.staging_prefix, recursive=True)  # the records go only after the commit
        try:  # orphans: uploads of killed attempts, of lost CreateMultipartUpload responses
            self._abort_incomplete_uploads()
        except Exception:  # committed all the same; the orphans only cost storage until a lifecycle rule
            log.warning("could not abort incomplete multipart uploads under %s", self.url, exc_info=True)
        self._release_lock()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _abort_incomplete_uploads(self, keep: frozenset[str] = frozenset()) -> None:
        """Abort the incomplete uploads under the destination (all are the lock holder's), except ``keep``."""
        abort_incomplete_uploads(self.loc.fs, self.loc.path, keep)

    def _drop_unusable_staging(self) -> None:
        """A failed run that may be resumed keeps its recorded uploads; the unrecorded ones (killed
        mid-upload, lost responses) can never be completed and go."""
        with storage_errors(self.url):
            fs = self.loc.fs
            fs.invalidate_cache(self.staging_prefix)
            found = fs.find(self.staging_prefix) if fs.exists(self.staging_prefix) else []
            keep = set()
            for path in found:
                if path.endswith(RECORD_SUFFIX):
                    rec = self._read_record(path[len(self.staging_prefix) + 1:-len(RECORD_SUFFIX)])
                    if rec is not None:
                        keep.add(str(rec["upload"]["upload_id"]))
            self._abort_incomplete_uploads(frozenset(keep))



class S3OutputStream:
    """One output streamed to its final key as the writer produces it (``update``: the file's
    bytes in order, each once, as a hash is fed), left uncompleted by :meth:`finish` and recorded
    like a published file. Not verified twice: the parts' count of bytes is checked against what
    was fed, and the writer's SHA-256 of the same bytes goes into the manifest."""

    def __init__(self, dest: S3Destination, name: str, size_hint: int | None = None) -> None:
        self.dest, self.name = dest, name
        self.upload = MultipartStream(dest.loc.fs, dest.loc.join(name), part_size=UPLOAD_PART_BYTES,
                                      concurrency=UPLOAD_CONCURRENCY, size_hint=size_hint)

    def update(self, data: Any) -> None:
        with storage_errors(self.dest.url):
            self.upload.update(data)

    def finish(self, sha256: str | None) -> dict[str, Any]:
        """The last part sent and the upload recorded; its manifest record."""
        if not sha256:
            self.abort()
            raise ValueError("a streamed output needs the writer's sha256")
        with storage_errors(self.dest.url):
            up = self.upload.finish()
            record = {"path": self.name, "size": up.size, "sha256": sha256}
            return self.dest._record_upload(record, up)

    def abort(self) -> None:
        self.upload.abort()
