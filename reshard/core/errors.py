"""Typed errors for every way input can be wrong.

Each error carries *what* went wrong (``culprit``: the file, key or setting), *why*, and
*how to fix it* (``hint``). The CLI prints ``str(err)`` on one line and exits with code 2;
library callers can catch the specific class. Nothing here is raised for internal bugs.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base class: bad input or an impossible request, never an internal bug."""

    exit_code: int = 2

    def __init__(self, message: str, *, culprit: str | None = None, hint: str | None = None):
        self.message = message
        self.culprit = culprit
        self.hint = hint
        super().__init__(self.one_line())

    @property
    def fix(self) -> str | None:
        """How to fix it (the CLI's ``(fix: ...)``)."""
        return self.hint

    def one_line(self) -> str:
        """The message as the CLI prints it: culprit, problem, fix — on one line."""
        parts = []
        if self.culprit:
            parts.append(f"{self.culprit}: ")
        parts.append(self.message.replace("\n", " "))
        if self.hint:
            parts.append(f" (fix: {self.hint})")
        return "".join(parts)


class CheckpointFormatError(ReshardError):
    """A file or folder is not a checkpoint reshard understands (missing/extra ranks, keys)."""


class CorruptCheckpointError(CheckpointFormatError):
    """A shard cannot be read: truncated, zero bytes, not a torch zip file."""


class UnsafeCheckpointError(CheckpointFormatError):
    """A shard's pickle references code outside the allowlist; it was not executed."""


class InconsistentShardsError(CheckpointFormatError):
    """Ranks disagree: keys, shapes, dtypes, replicated values, versions."""


class UnknownParameterError(CheckpointFormatError):
    """Parameter names that no rule in the table matches."""


class LayoutError(ReshardError):
    """The requested layout cannot be produced correctly (indivisible heads or dims)."""


class MissingModelFactError(LayoutError):
    """A fact the layout depends on (e.g. head count) is unknown; reshard refuses to guess."""


class DestinationError(ReshardError):
    """The destination already holds a committed checkpoint, or overlaps the source."""


class ManifestMismatchError(ReshardError):
    """A committed checkpoint does not match its manifest (size or sha256)."""


class ConfigError(ReshardError):
    """A DeepSpeed/ZeRO configuration is invalid; ``problems`` lists every issue found."""

    def __init__(self, message: str, *, problems: list[str] | None = None, culprit: str | None = None,
                 hint: str | None = None):
        self.problems = list(problems or [])
        super().__init__(message, culprit=culprit, hint=hint)


class PrefectServerError(ReshardError):
    """The Prefect server a run needs cannot start: its database belongs to another Prefect
    version, cannot be opened, or the server does not come up in time."""


class StorageError(ReshardError):
    """A URL cannot be read or written: no such bucket/prefix, permission denied, size changed.

    ``transient``: the operation may succeed if retried later (e.g. a download that kept
    failing verification); permission and not-found errors are not transient.
    """

    def __init__(self, message: str, *, culprit: str | None = None, hint: str | None = None,
                 transient: bool = False):
        self.transient = transient
        super().__init__(message, culprit=culprit, hint=hint)
