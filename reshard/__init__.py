"""reshard: change the parallel layout and the format of large-language-model checkpoints, exactly.

The Python API (see :mod:`reshard.api`)::

    import reshard

    result = reshard.convert("ckpt/tp8", "ckpt/tp2", target_tp=2)   # in-process, committed atomically
    reshard.plan("ckpt/tp8", target_tp=2)                            # what it would do, no bytes moved
    reshard.inspect("ckpt/tp8")                                      # what a checkpoint holds
    reshard.verify("ckpt/tp2")                                       # re-hash against the manifest

Every expected failure is a :class:`ReshardError` (``culprit``, ``message``, ``fix``). Importing
this package loads nothing heavy and changes no process-wide state: the functions load the
engine on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reshard.core.errors import (
    CheckpointFormatError,
    ConfigError,
    CorruptCheckpointError,
    DestinationError,
    InconsistentShardsError,
    LayoutError,
    ManifestMismatchError,
    MissingModelFactError,
    PrefectServerError,
    ReshardError,
    StorageError,
    UnknownParameterError,
    UnsafeCheckpointError,
)
from reshard.version import __version__

if TYPE_CHECKING:
    from reshard.api import Progress, convert, inspect, plan, verify
    from reshard.core.options import ReshardOptions
    from reshard.result import ConversionResult, OutputFile

#: Public names loaded on first use (attribute -> module), so ``import reshard`` stays light.
_LAZY = {"convert": "reshard.api", "plan": "reshard.api", "inspect": "reshard.api", "verify": "reshard.api",
         "Progress": "reshard.api", "ConversionResult": "reshard.result", "OutputFile": "reshard.result",
         "ReshardOptions": "reshard.core.options"}

__all__ = ["CheckpointFormatError", "ConfigError", "ConversionResult", "CorruptCheckpointError", "DestinationError",
           "InconsistentShardsError", "LayoutError", "ManifestMismatchError", "MissingModelFactError", "OutputFile",
           "PrefectServerError", "Progress", "ReshardError", "ReshardOptions", "StorageError",
           "UnknownParameterError", "UnsafeCheckpointError", "__version__", "convert", "inspect", "plan", "verify"]


def __dir__() -> list[str]:
    """The public API (what ``dir(reshard)`` and completion show), the lazy names included, and the
    subpackages a caller may import; not this module's own imports."""
    return sorted({*__all__, "api", "core", "formats", "models"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
