"""The manifest: the commit marker of an output checkpoint.

A destination holds a *committed* checkpoint exactly when ``reshard_manifest.json`` exists
there. It is written last, after every file it lists is complete, so a crash at any earlier
point leaves nothing that reads as complete. ``verify`` re-hashes every listed file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from reshard.core.errors import ManifestMismatchError, StorageError

MANIFEST_NAME = "reshard_manifest.json"
MANIFEST_FORMAT = "reshard-manifest/1"
_CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Streaming sha256 of a file (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path, name: str) -> dict[str, Any]:
    return {"path": name, "size": path.stat().st_size, "sha256": sha256_file(path)}


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a committed checkpoint's manifest; a folder without one is not committed."""
    p = Path(folder) / MANIFEST_NAME
    if not p.is_file():
        raise ManifestMismatchError("holds no committed checkpoint (no reshard_manifest.json)",
                                    culprit=str(folder), hint="run `reshard run` to produce one")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestMismatchError(f"unreadable manifest: {exc}", culprit=str(p)) from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), list):
        raise ManifestMismatchError("not a reshard manifest", culprit=str(p))
    return data


def verify_folder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file listed in the manifest: present, same size, same sha256."""
    folder = Path(folder)
    data = read_manifest(folder)
    problems = []
    for rec in data["files"]:
        name = rec.get("path", "")
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise StorageError(f"manifest lists an unsafe path {name!r}", culprit=str(folder))
        f = folder / name
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != rec["size"]:
            problems.append(f"{name}: size {f.stat().st_size} != {rec['size']}")
        elif sha256_file(f) != rec["sha256"]:
            problems.append(f"{name}: sha256 mismatch")
    if problems:
        raise ManifestMismatchError(f"{len(problems)} file(s) do not match the manifest: {'; '.join(problems)}",
                                    culprit=str(folder), hint="re-run the conversion with --overwrite")
    return data
