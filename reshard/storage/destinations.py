"""The destination for an output URL: a local folder, S3, or any other fsspec filesystem (the
commit protocol they share is :mod:`reshard.storage.destination`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.core.errors import StorageError
from reshard.storage.destination import Destination, LocalDestination, RemoteDestination
from reshard.storage.location import Location, open_location
from reshard.storage.s3_destination import S3Destination
from reshard.storage.s3_transfer import is_s3


def open_destination(url: str, storage_options: dict[str, Any] | None, *, overwrite: bool,
                     workdir: Path | None, source: Location | None = None, check: bool = True) -> Destination:
    """The right :class:`Destination` for ``url``, checked unless ``check=False`` (nothing
    written yet)."""
    loc = open_location(url, storage_options)
    if loc.is_local:
        dest: Destination = LocalDestination(loc, overwrite=overwrite)
    else:
        if workdir is None:
            raise StorageError("a remote destination needs a local work folder", culprit=url)
        kind = S3Destination if is_s3(loc.fs) else RemoteDestination
        dest = kind(loc, overwrite=overwrite, workdir=workdir)
    if check:
        dest.check(source)
    return dest
