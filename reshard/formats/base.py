"""What an on-disk checkpoint format answers, without reading tensor bytes.

A format is one module holding one :class:`CheckpointFormat` subclass, registered in
:mod:`reshard.formats.registry`. Locating a checkpoint asks every registered format, in
``priority`` order, whether a folder (or file) holds it; the first that does lays the files out
as a :class:`~reshard.core.source.SourceCheckpoint` grid for the planner. Remote discovery
fetches exactly the objects some format's ``patterns`` name.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from reshard.core.errors import CheckpointFormatError
from reshard.core.source import SourceCheckpoint


class CheckpointFormat(ABC):
    """One on-disk layout. Subclasses set the class attributes and implement :meth:`detect` and
    :meth:`locate` (and :meth:`detect_file` if the format is a single file, like a descriptor)."""

    #: Registry key, also ``SourceCheckpoint.format`` of what it locates (unless it delegates).
    name: ClassVar[str]
    #: Detection order: lower first (a Megatron-LM run folder before a plain folder of files).
    priority: ClassVar[int] = 100
    #: Object names (relative to the checkpoint's root) this format reads; remote discovery
    #: fetches the objects that match any registered format's patterns, nothing else.
    patterns: ClassVar[tuple[re.Pattern[str], ...]] = ()

    def detect(self, folder: Path) -> bool:
        """Does this local folder hold a checkpoint of this format? (Names only.)"""
        return False

    def detect_file(self, path: Path) -> bool:
        """Is this local file a checkpoint of this format (e.g. a descriptor)? (Names only.)"""
        return False

    @abstractmethod
    def locate(self, path: Path) -> SourceCheckpoint:
        """The checkpoint at ``path`` as a validated grid of files; raises
        :class:`~reshard.core.errors.CheckpointFormatError` naming the file and the fix."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_contiguous(ranks: list[int], where: str) -> None:
    """Ranks must be exactly 0..N-1 (a gap is a missing file, an extra one a stray)."""
    expected = list(range(len(ranks)))
    if ranks != expected:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(
            f"rank files are not 0..N-1: found ranks {ranks}" + (f", missing {missing}" if missing else ""),
            culprit=where, hint="copy the missing rank files, or remove stray extra ones")
