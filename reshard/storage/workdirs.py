"""What a conversion keeps on local disk while it runs, and when it goes.

A flow run of a conversion works in that conversion's *work folder* under the shard cache
(``work/<conversion id>``, :meth:`~reshard.storage.cache.ShardCache.conversion_work`): the
source's view, outputs converted and waiting to be published, and each attempt's scratch folder
for the output it writes. A resumed run of the same conversion reuses it; once the conversion is
committed nothing in it is needed, and it is removed (:meth:`WorkUse.finish`).

Runs of one conversion may overlap (two destinations, or a duplicate), and a run may die at any
moment (SIGKILL), so neither "remove when done" nor "remove what I made" is safe alone. Both
rest on ``flock``, which the kernel releases however a process ends:

* every run holds a shared lock on ``work/<id>.lock`` while it lasts; the run that finishes the
  conversion removes the folder only if it can take that lock exclusively (no other run holds
  it) — else the last one to finish does;
* each attempt at writing an output writes into a scratch folder of its own
  (:func:`scratch_folder`), whose lock it holds exclusively while it writes; the next attempt
  under the same parent removes every scratch folder whose lock nobody holds (a dead attempt's).

So a crash leaves, per run that was alive, at most one file per output of the conversion (a
converted output waiting, or a partial one), plus the view's links into the shard cache; the
conversion's next attempt at any output reclaims the partial ones, and its commit the rest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

LOCK_SUFFIX = ".lock"


def _flock(fd: int, *, exclusive: bool, wait: bool) -> bool:
    """Take a lock on ``fd``; False when ``wait`` is off and another process holds it."""
    import fcntl

    flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Is ``path`` still the file open as ``fd`` (not removed, nor replaced, since it was opened)?"""
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def scratch_folder(parent: Path) -> Iterator[Path]:
    """A new, private folder under ``parent`` for one attempt at writing a file (two runs of a
    conversion may write the same output at once), removed when the block ends. Its lock
    (``<name>.lock`` beside it, taken before the folder exists) is held while the block runs;
    dead attempts' folders under ``parent`` (their locks free) are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    name = uuid.uuid4().hex
    pending = parent / f".{name}{LOCK_SUFFIX}.tmp"  # locked before it is visible under its name
    fd = os.open(pending, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        _flock(fd, exclusive=True, wait=True)
        lock = parent / f"{name}{LOCK_SUFFIX}"
        os.replace(pending, lock)
        reclaim_scratch(parent)
        folder = parent / name
        folder.mkdir()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the folder first: a folder without its lock is free to take
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def reclaim_scratch(parent: Path) -> None:
    """Remove the scratch folders under ``parent`` that no live attempt holds (and their locks).
    A lock still being made (``.<name>.lock.tmp``) is left alone: its attempt has no folder yet,
    and one that died making it left an empty file, which goes with the work folder."""
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return
    held = set()
    for lock in (e for e in entries if e.name.endswith(LOCK_SUFFIX)):
        name = lock.name[:-len(LOCK_SUFFIX)]
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:  # its attempt finished meanwhile
            continue
        try:
            if not _flock(fd, exclusive=True, wait=False):
                held.add(name)
            elif _same_file(fd, lock):  # its attempt is gone
                shutil.rmtree(parent / name, ignore_errors=True)
                lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    for entry in entries:  # a folder whose lock is gone: its attempt was finishing, or it predates locks
        if entry.is_dir() and entry.name not in held and not (parent / f"{entry.name}{LOCK_SUFFIX}").exists():
            shutil.rmtree(entry, ignore_errors=True)


class WorkUse:
    """One run's hold on a conversion's work folder (``folder``): a shared lock on
    ``<folder>.lock`` from construction to :meth:`close`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lock = folder.with_name(folder.name + LOCK_SUFFIX)
        folder.parent.mkdir(parents=True, exist_ok=True)
        while True:  # a finishing run may remove the lock file under us: then take the new one
            fd = os.open(self.lock, os.O_CREAT | os.O_RDONLY, 0o644)
            _flock(fd, exclusive=False, wait=True)  # waits only while a finishing run removes the folder
            if _same_file(fd, self.lock):
                self._fd: int | None = fd
                return
            os.close(fd)

    def finish(self) -> bool:
        """The conversion is committed: remove its work folder, unless another run of it is using
        it (that one removes it when it finishes). True when removed."""
        if self._fd is None:
            return False
        if not _flock(self._fd, exclusive=True, wait=False):
            return False
        shutil.rmtree(self.folder, ignore_errors=True)
        self.lock.unlink(missing_ok=True)  # whoever waits on it finds it gone and takes a new one
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WorkUse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
