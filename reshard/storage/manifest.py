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
from typing import TYPE_CHECKING, Any

from reshard.core.errors import ManifestMismatchError, StorageError

if TYPE_CHECKING:
    from reshard.storage.location import Location

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


def file_record(path: Path, name: str, sha256: str | None = None) -> dict[str, Any]:
    """The manifest's record of the file at ``path``, listed as ``name``: its size and SHA-256,
    the digest read from the file unless the writer computed it already (``sha256``, hashed while
    the file was written)."""
    return {"path": name, "size": path.stat().st_size, "sha256": sha256 if sha256 is not None else sha256_file(path)}


def read_manifest(loc: Location) -> dict[str, Any]:
    """Load a committed checkpoint's manifest; a folder without one is not committed."""
    from reshard.storage.location import storage_errors

    path = loc.join(MANIFEST_NAME)
    with storage_errors(loc.url):
        if not loc.fs.exists(path):
            raise ManifestMismatchError("holds no committed checkpoint (no reshard_manifest.json)",
                                        culprit=loc.url, hint="run `reshard run` to produce one")
        raw = loc.fs.cat_file(path)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestMismatchError(f"unreadable manifest: {exc}", culprit=loc.child_url(MANIFEST_NAME)) from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), list):
        raise ManifestMismatchError("not a reshard manifest", culprit=loc.child_url(MANIFEST_NAME))
    return data


def sha256_at(loc: Location, path: str) -> str:
    """Streaming sha256 of an object on any filesystem."""
    h = hashlib.sha256()
    with loc.fs.open(path, "rb", block_size=_CHUNK) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every file listed in the manifest at ``url``: present, same size, same sha256."""
    from reshard.storage.location import open_location, storage_errors

    loc = open_location(url, storage_options)
    data = read_manifest(loc)
    problems = []
    with storage_errors(url):
        for rec in data["files"]:
            name = rec.get("path", "")
            if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
                raise StorageError(f"manifest lists an unsafe path {name!r}", culprit=url)
            path = loc.join(name)
            loc.fs.invalidate_cache(path)
            if not loc.fs.exists(path):
                problems.append(f"{name}: missing")
                continue
            size = int(loc.fs.info(path)["size"])
            if size != rec["size"]:
                problems.append(f"{name}: size {size} != {rec['size']}")
            elif sha256_at(loc, path) != rec["sha256"]:
                problems.append(f"{name}: sha256 mismatch")
    if problems:
        raise ManifestMismatchError(f"{len(problems)} file(s) do not match the manifest: {'; '.join(problems)}",
                                    culprit=url, hint="re-run the conversion with --overwrite")
    return data
