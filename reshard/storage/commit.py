"""Atomic commit of an output checkpoint into a local folder.

Protocol: every output file is written under ``DST/.reshard-staging/`` and only moved into
``DST`` when all of them are complete; the manifest is written last (temp file + rename).
Until the manifest exists the destination does not hold a committed checkpoint, whatever
else lies there. A destination that already holds one is refused unless ``overwrite``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from reshard.core.errors import DestinationError
from reshard.storage.manifest import MANIFEST_NAME, read_manifest

STAGING_DIR = ".reshard-staging"


class LocalDestination:
    """A folder being filled with a new checkpoint; see the module docstring for the protocol."""

    def __init__(self, folder: str | os.PathLike[str], *, overwrite: bool = False,
                 source_paths: tuple[Path, ...] = ()):
        self.folder = Path(folder)
        self.overwrite = overwrite
        self._created = False
        self._old_files: list[str] = []
        self._check(source_paths)

    def _check(self, source_paths: tuple[Path, ...]) -> None:
        dst = self.folder.resolve()
        for sp in source_paths:
            src_dir = sp.resolve().parent
            if dst == src_dir or src_dir in dst.parents:
                raise DestinationError("destination is the source folder or inside it", culprit=str(self.folder),
                                       hint="write the converted checkpoint to a separate folder")
        if dst.exists() and not dst.is_dir():
            raise DestinationError("exists and is not a folder", culprit=str(self.folder))
        if (dst / MANIFEST_NAME).exists() and not self.overwrite:
            raise DestinationError("already holds a committed checkpoint", culprit=str(self.folder),
                                   hint="pass --overwrite to replace it, or choose another destination")

    @property
    def staging(self) -> Path:
        return self.folder / STAGING_DIR

    def open(self) -> None:
        """Create the folder and a clean staging area; uncommit an old checkpoint if overwriting."""
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            self._created = True
        manifest = self.folder / MANIFEST_NAME
        if manifest.exists():  # overwrite was checked in __init__
            try:
                self._old_files = [r["path"] for r in read_manifest(self.folder)["files"]]
            except Exception:  # an unreadable old manifest still gets replaced
                self._old_files = []
            manifest.unlink()
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()

    def staged(self, name: str) -> Path:
        return self.staging / name

    def commit(self, names: list[str], manifest: dict[str, Any]) -> Path:
        """Move staged files into place, drop stale old files, then write the manifest."""
        for name in names:
            os.replace(self.staged(name), self.folder / name)
        for old in self._old_files:
            if old not in names and old != MANIFEST_NAME:
                (self.folder / old).unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        tmp = self.folder / (MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync(tmp)
        os.replace(tmp, self.folder / MANIFEST_NAME)
        return self.folder / MANIFEST_NAME

    def abort(self) -> None:
        """Remove everything this run staged; remove the folder if this run created it empty."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._created:
            try:
                self.folder.rmdir()
            except OSError:
                pass


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
