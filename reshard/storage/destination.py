"""Atomic commit of an output checkpoint to a local folder or any fsspec URL.

Protocol, the same everywhere:

1. refuse a destination that already holds a committed checkpoint (``reshard_manifest.json``)
   unless ``overwrite``; refuse one equal to or inside the source;
2. every output file is staged and checked (size) without touching its final name: under the
   staging prefix ``DST/.reshard-staging/`` (local folders, plain fsspec filesystems), or on S3
   as an uncompleted multipart upload to its final key, which is invisible until completed
   (:mod:`reshard.storage.s3_destination`);
3. only when all are staged are they moved into place (renamed locally, copied on fsspec
   filesystems, completed on S3), stale files of an overwritten checkpoint removed;
4. the manifest is written last — it is the commit marker. Until it exists the destination
   does not hold a committed checkpoint, whatever else lies there; leftovers of a failed run
   are cleaned by the next one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from reshard.core.errors import DestinationError, StorageError
from reshard.crashpoints import crash_point
from reshard.storage.location import Location, storage_errors
from reshard.storage.manifest import MANIFEST_NAME, file_record

log = logging.getLogger(__name__)

STAGING_DIR = ".reshard-staging"
LOCK_NAME = ".reshard-lock.json"
UPLOAD_ATTEMPTS = 3
#: A lock not refreshed for this long belongs to a dead run and may be taken over.
LOCK_STALE_SECONDS = 600
#: Pause between writing the lock and reading it back (see ``Destination.acquire``): long enough
#: for a racing writer's lock to become visible through an object store's front ends.
LOCK_SETTLE_SECONDS = 0.3
#: The same on a local filesystem, where a write is visible at once: the pause only has to
#: cover the few milliseconds between a racing run's "no lock here" check and its write.
LOCAL_LOCK_SETTLE_SECONDS = 0.1


def _inside(child: str, parent: str) -> bool:
    child, parent = child.rstrip("/"), parent.rstrip("/")
    return child == parent or child.startswith(parent + "/")


class Destination(ABC):
    """Where outputs go. Engines write to :meth:`staged` paths (always local), then call
    :meth:`publish`; :meth:`commit` makes the checkpoint visible, :meth:`abort` cleans up."""

    lock_settle_seconds = LOCK_SETTLE_SECONDS
    #: Does :meth:`open_stream` take outputs while they are written?
    takes_streams = False

    def __init__(self, loc: Location, *, overwrite: bool, workdir: Path):
        self.loc = loc
        self.overwrite = overwrite
        self.workdir = workdir
        self._old_files: list[str] = []

    @property
    def url(self) -> str:
        return self.loc.url

    # -- checks --------------------------------------------------------------------------
    def check_outside(self, source: Location, folders: list[str]) -> None:
        """Refuse a destination equal to or inside a folder the source's files live in."""
        if type(source.fs) is not type(self.loc.fs):
            return
        for folder in folders:
            if _inside(self.loc.path, folder):
                raise DestinationError("destination is the source folder or inside it", culprit=self.url,
                                       hint="write the converted checkpoint to a separate folder")

    def check(self, source: Location | None) -> None:
        """Refuse before anything is written (see module docstring, step 1)."""
        if source is not None:
            with storage_errors(source.url):
                is_folder = not source.fs.isfile(source.path)
            if is_folder:
                self.check_outside(source, [source.path])
        with storage_errors(self.url):
            if self.loc.fs.isfile(self.loc.path):
                raise DestinationError("exists and is not a folder", culprit=self.url)
            committed = self.loc.fs.exists(self.loc.join(MANIFEST_NAME))
        if committed and not self.overwrite:
            raise DestinationError("already holds a committed checkpoint", culprit=self.url,
                                   hint="pass --overwrite to replace it, or choose another destination")

    # -- protocol --------------------------------------------------------------------------
    @abstractmethod
    def open(self, *, clean_staging: bool = True) -> None:
        """Create the staging area (emptied unless resuming); uncommit an old checkpoint when
        overwriting."""

    @abstractmethod
    def staged(self, name: str) -> Path:
        """Local path the engine writes output ``name`` to."""

    @abstractmethod
    def staged_size(self, name: str) -> int | None:
        """Size of ``name`` where :meth:`commit` takes it from, or None when it is not staged."""

    @abstractmethod
    def publish(self, name: str, sha256: str | None = None) -> dict[str, Any]:
        """Output ``name`` is complete: stage it remotely; returns its manifest record.
        ``sha256``: the digest the writer computed while writing it (saves a read pass)."""

    def open_stream(self, name: str, size_hint: int | None = None) -> Any:
        """An upload of output ``name`` (about ``size_hint`` bytes) that takes the file's bytes while they are written
        (``update(data)`` in file order, ``finish(sha256)`` -> its manifest record, ``abort()``),
        so the output never lies whole on local disk; None where this destination cannot take
        one (:attr:`takes_streams` is False: the output is then written to :meth:`staged` and
        :meth:`publish` ed). Default: None."""
        return None

    @abstractmethod
    def commit(self, names: list[str], manifest: dict[str, Any]) -> None:
        """Move staged files into place, then write the manifest last."""

    @abstractmethod
    def abort(self) -> None:
        """Remove what this run staged (best effort); never writes a manifest."""

    def abandon(self) -> None:
        """A failed run that may be resumed (the flow) gives up its claim: our lock goes, and what a
        resume cannot reuse (an empty staging folder, incomplete multipart uploads); staged outputs
        stay for the resume. Nothing is touched when the lock is not (or no longer) ours. Best effort."""
        if not self._owns_lock():
            return
        try:
            self._drop_unusable_staging()
            self._release_lock()
        except Exception:  # best effort: a stale lock is taken over after LOCK_STALE_SECONDS
            log.warning("could not release %s after a failed run", self.url, exc_info=True)

    def _drop_unusable_staging(self) -> None:
        """What :meth:`abandon` removes besides the lock."""

    # -- the writer lock --------------------------------------------------------------------
    _lock_token: str | None = None
    _lock_conversion: str | None = None
    _created: bool = False

    def _read_lock(self) -> dict[str, Any] | None:
        path = self.loc.join(LOCK_NAME)
        with storage_errors(self.url):
            self.loc.fs.invalidate_cache(path)
            if not self.loc.fs.exists(path):
                return None
            raw = self.loc.fs.cat_file(path)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def _write_lock(self) -> None:
        rec = {"token": self._lock_token, "conversion_id": self._lock_conversion, "host": socket.gethostname(),
               "pid": os.getpid(), "time": time.time()}
        with storage_errors(self.url):
            self._put_lock(json.dumps(rec).encode())

    def _put_lock(self, data: bytes) -> None:
        """Replace the lock file whole (an object PUT is atomic)."""
        self.loc.fs.pipe_file(self.loc.join(LOCK_NAME), data)

    def acquire(self, token: str, conversion_id: str) -> None:
        """Claim the destination for this run. Another live run of a *different* conversion
        holds it -> refuse; a run of the same conversion (a resume, or a duplicate that would
        write the same bytes) or a stale lock -> take over. The claim is re-checked right before
        the manifest is written, so of two racing conversions exactly one commits."""
        held = self._read_lock()
        if held and held.get("conversion_id") != conversion_id and held.get("token") != token:
            age = time.time() - float(held.get("time", 0))
            if age < LOCK_STALE_SECONDS:
                raise DestinationError(
                    f"another conversion ({str(held.get('conversion_id'))[:12]}, not {conversion_id[:12]}) is "
                    f"writing here (host {held.get('host')}, pid {held.get('pid')}, {age:.0f}s ago)", culprit=self.url,
                    hint="wait for it to finish, or choose another destination")
        self._lock_token, self._lock_conversion = token, conversion_id
        try:
            with storage_errors(self.url):
                if not self.loc.fs.exists(self.loc.path):
                    self._created = True
                self.loc.fs.makedirs(self.loc.path, exist_ok=True)
            self._write_lock()
        except BaseException:
            self._lock_token = self._lock_conversion = None  # never claimed: nothing of ours to undo
            raise
        # object stores have no atomic create-if-absent everywhere: write, wait, read back. Of two
        # racing writers the later one wins and the earlier one sees it here.
        time.sleep(self.lock_settle_seconds)
        held = self._read_lock()
        if held and held.get("token") != token and held.get("conversion_id") != conversion_id:
            self._lock_token = None
            raise DestinationError("another conversion claimed this destination at the same moment",
                                   culprit=self.url, hint="run the conversions to different destinations")

    def adopt_lock(self, token: str, conversion_id: str) -> None:
        """Continue a claim made by :meth:`acquire` in another task/process of the same run."""
        self._lock_token, self._lock_conversion = token, conversion_id

    def heartbeat(self) -> None:
        """Refresh our lock so long conversions do not look dead (never someone else's)."""
        if self._lock_token:
            held = self._read_lock()
            if held is None or held.get("token") == self._lock_token:
                self._write_lock()

    def _assert_lock(self) -> None:
        if not self._lock_token:
            return
        held = self._read_lock()
        if held and held.get("token") != self._lock_token and held.get("conversion_id") != self._lock_conversion:
            raise DestinationError("another conversion took over this destination; nothing was committed",
                                   culprit=self.url, hint="run the conversions to different destinations")

    def _owns_lock(self) -> bool:
        """Is the lock on the destination still this run's (not taken over by another)?"""
        if not self._lock_token:
            return False
        try:
            held = self._read_lock()
        except Exception:  # unreadable: assume not ours, so we never delete another run's staging
            return False
        return bool(held) and held.get("token") == self._lock_token

    def lost_lock(self) -> bool:
        """We claimed the destination and another conversion has claimed it since."""
        return bool(self._lock_token) and not self._owns_lock()

    def _release_lock(self) -> None:
        if not self._lock_token:
            return
        held = self._read_lock()
        if held and held.get("token") == self._lock_token:
            with storage_errors(self.url):
                self.loc.fs.rm_file(self.loc.join(LOCK_NAME))
        self._lock_token = None

    def committed_manifest(self) -> dict[str, Any] | None:
        """The manifest of the checkpoint committed here, or None (absent or unreadable)."""
        try:
            with storage_errors(self.url):
                path = self.loc.join(MANIFEST_NAME)
                if not self.loc.fs.exists(path):
                    return None
                data = json.loads(self.loc.fs.cat_file(path))
            return data if isinstance(data, dict) else None
        except (ValueError, UnicodeDecodeError):
            return None

    def _read_old_manifest_files(self) -> list[str]:
        data = self.committed_manifest() or {}
        files = data.get("files") if isinstance(data.get("files"), list) else []
        return [r["path"] for r in files if isinstance(r, dict) and isinstance(r.get("path"), str)]


class LocalDestination(Destination):
    """A local folder: staged files are renamed into place (atomic on one filesystem)."""

    lock_settle_seconds = LOCAL_LOCK_SETTLE_SECONDS

    def _put_lock(self, data: bytes) -> None:
        """Write a private file, then rename it over the lock: two runs writing the lock at once
        each leave a whole record, never a torn mix (which would read as "no lock")."""
        final = self.folder / LOCK_NAME
        tmp = final.with_name(f"{LOCK_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, final)

    def __init__(self, loc: Location, *, overwrite: bool):
        super().__init__(loc, overwrite=overwrite, workdir=Path(loc.path) / STAGING_DIR)
        self.folder = Path(loc.path)
        self._created = False

    def open(self, *, clean_staging: bool = True) -> None:
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            self._created = True
        manifest = self.folder / MANIFEST_NAME
        if manifest.exists():
            self._old_files = self._read_old_manifest_files()
            manifest.unlink()
        if clean_staging:
            shutil.rmtree(self.workdir, ignore_errors=True)
        # the staging folder itself is made by the first staged() write: a run that fails before
        # writing an output leaves none behind

    def staged(self, name: str) -> Path:
        p = self.workdir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def staged_size(self, name: str) -> int | None:
        p = self.workdir / name  # a question only: never creates the staging folder (unlike staged())
        return p.stat().st_size if p.is_file() else None

    def _drop_unusable_staging(self) -> None:
        _remove_empty_dirs(self.workdir)

    def publish(self, name: str, sha256: str | None = None) -> dict[str, Any]:
        return file_record(self.staged(name), name, sha256)

    def commit(self, names: list[str], manifest: dict[str, Any]) -> None:
        self._assert_lock()
        sizes = {r["path"]: r["size"] for r in manifest.get("files", [])}
        for i, name in enumerate(names):
            final = self.folder / name
            final.parent.mkdir(parents=True, exist_ok=True)
            staged = self.staged(name)
            if not staged.exists() and final.is_file() and final.stat().st_size == sizes.get(name):
                continue  # moved already by a duplicate run of this same conversion
            os.replace(staged, final)
            if i == 0:
                crash_point("copying")
        for old in self._old_files:
            if old not in names:
                (self.folder / old).unlink(missing_ok=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        crash_point("committed-files")
        self._assert_lock()
        tmp = self.folder / f"{MANIFEST_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / MANIFEST_NAME)
        self._release_lock()

    def abort(self) -> None:
        if not self._owns_lock():
            return  # not (or no longer) ours: the staging area may be another run's
        shutil.rmtree(self.workdir, ignore_errors=True)  # before the lock: then another run may stage here
        try:
            self._release_lock()
        except Exception:  # best effort; a stale lock is taken over after LOCK_STALE_SECONDS
            pass
        if self._created:
            try:
                self.folder.rmdir()
            except OSError:
                pass


class RemoteDestination(Destination):
    """A plain fsspec filesystem: staged files are uploaded to the staging prefix as soon as each
    is written, then copied to their final names at the commit (S3: :class:`S3Destination`)."""

    def __init__(self, loc: Location, *, overwrite: bool, workdir: Path):
        super().__init__(loc, overwrite=overwrite, workdir=workdir / "out")
        self.staging_prefix = loc.join(STAGING_DIR)

    def open(self, *, clean_staging: bool = True) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        fs = self.loc.fs
        with storage_errors(self.url):
            manifest = self.loc.join(MANIFEST_NAME)
            if fs.exists(manifest):
                self._old_files = self._read_old_manifest_files()
                fs.rm_file(manifest)
            if clean_staging and fs.exists(self.staging_prefix):
                fs.rm(self.staging_prefix, recursive=True)
            if clean_staging:
                self._abort_incomplete_uploads()

    def staged(self, name: str) -> Path:
        p = self.workdir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def staged_remote_size(self, name: str) -> int | None:
        """Size of ``name`` under the staging prefix, or None when it is not there."""
        path = f"{self.staging_prefix}/{name}"
        with storage_errors(self.url):
            self.loc.fs.invalidate_cache(path)
            if not self.loc.fs.exists(path):
                return None
            return int(self.loc.fs.info(path)["size"])

    def staged_size(self, name: str) -> int | None:
        return self.staged_remote_size(name)

    def publish(self, name: str, sha256: str | None = None) -> dict[str, Any]:
        """Hash the staged file (unless the writer did), upload it to the staging prefix, check the
        size, free the disk."""
        local = self.staged(name)
        remote = f"{self.staging_prefix}/{name}"
        if not local.exists():
            # a killed run uploaded it and freed the local copy before recording that: re-hash remotely
            size = self.staged_remote_size(name)
            if size is not None:
                from reshard.storage.manifest import sha256_at

                with storage_errors(self.url):
                    return {"path": name, "size": size, "sha256": sha256_at(self.loc, remote)}
        record = file_record(local, name, sha256)
        crash_point("uploading")
        last = ""
        for _ in range(UPLOAD_ATTEMPTS):
            with storage_errors(self.url):
                self.loc.fs.put_file(str(local), remote)
                self.loc.fs.invalidate_cache(remote)
                size = int(self.loc.fs.info(remote)["size"])
            if size == record["size"]:
                local.unlink()
                return record
            last = f"uploaded {size} of {record['size']} bytes"
        raise StorageError(f"upload of {name} failed verification ({last})", culprit=self.url,
                           hint="retry; check the storage endpoint", transient=True)

    def commit(self, names: list[str], manifest: dict[str, Any]) -> None:
        fs = self.loc.fs
        self._assert_lock()
        with storage_errors(self.url):
            for i, name in enumerate(names):
                fs.copy(f"{self.staging_prefix}/{name}", self.loc.join(name))
                if i == 0:
                    crash_point("copying")
            for old in self._old_files:
                if old not in names and fs.exists(self.loc.join(old)):
                    fs.rm_file(self.loc.join(old))
            crash_point("committed-files")
            self._assert_lock()
            fs.pipe_file(self.loc.join(MANIFEST_NAME), json.dumps(manifest, indent=2, sort_keys=True).encode())
            # staging goes only after the commit: a crash before the manifest leaves it for the resume
            fs.rm(self.staging_prefix, recursive=True)
        self._release_lock()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _abort_incomplete_uploads(self) -> None:
        """Abort the incomplete uploads this destination may have left (none on a plain fsspec
        filesystem; see :class:`~reshard.storage.s3_destination.S3Destination`). Run when nothing
        of this run is being uploaded: at a fresh start and on abort."""

    def abort(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)  # this run's private local folder
        if not self._owns_lock():
            return  # not (or no longer) ours: the staging prefix may be another run's
        # staging first, the lock last: once released, another run may start staging here
        try:
            if self.loc.fs.exists(self.staging_prefix):
                self.loc.fs.rm(self.staging_prefix, recursive=True)
        except Exception:  # best effort: the next run cleans leftovers; nothing reads them as committed
            pass
        try:
            self._abort_incomplete_uploads()
        except Exception:  # best effort, as above
            pass
        try:
            self._release_lock()
        except Exception:  # best effort; a stale lock is taken over after LOCK_STALE_SECONDS
            pass


def _remove_empty_dirs(root: Path) -> None:
    """Remove ``root`` and the folders under it that hold no file (deepest first)."""
    if not root.is_dir():
        return
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:  # not empty
            pass
    try:
        root.rmdir()
    except OSError:
        pass

