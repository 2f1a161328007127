"""The registry of checkpoint formats: a private dict behind a read-only view.

Built-in formats are imported on first use (nothing happens at import time); third parties
register theirs with :func:`register_format`, or through the entry-point group
``reshard.formats`` (each entry point names a :class:`~reshard.formats.base.CheckpointFormat`
subclass or instance), loaded on first use as well. Registering a second, different format
under a taken name raises, unless ``clobber=True``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from types import MappingProxyType

from reshard.formats.base import CheckpointFormat

#: Built-in formats, as "module:class" (imported on first use).
BUILTIN: tuple[str, ...] = (
    "reshard.formats.megatron:MegatronFormat",
    "reshard.formats.deepspeed_pipeline:DeepSpeedPipelineFormat",
    "reshard.formats.deepspeed:DeepSpeedFormat",
    "reshard.formats.deepspeed:DeepSpeedZero3Format",
    "reshard.formats.deepspeed:DeepSpeedDescriptorFormat",
)
ENTRY_POINT_GROUP = "reshard.formats"

_registry: dict[str, CheckpointFormat] = {}
#: Read-only view of the registered formats (name -> format); see :func:`available`.
registry: Mapping[str, CheckpointFormat] = MappingProxyType(_registry)
_loaded = False
_lock = threading.RLock()


def register_format(fmt: CheckpointFormat | type[CheckpointFormat], *, clobber: bool = False) -> CheckpointFormat:
    """Register ``fmt`` (an instance, or a class to instantiate) under ``fmt.name``; returns it."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not isinstance(inst, CheckpointFormat):
        raise TypeError(f"{fmt!r} is not a CheckpointFormat")
    with _lock:
        old = _registry.get(inst.name)
        if old is not None and not clobber and type(old) is not type(inst):
            raise ValueError(f"checkpoint format {inst.name!r} is already registered ({old!r}); "
                             f"pass clobber=True to replace it")
        _registry[inst.name] = inst
    return inst


def unregister_format(name: str) -> None:
    """Remove a registered format (tests, plug-in reloads); unknown names are ignored."""
    with _lock:
        _registry.pop(name, None)


def available() -> list[CheckpointFormat]:
    """Every registered format, built-ins and plug-ins loaded, in detection order."""
    _load()
    with _lock:
        return sorted(_registry.values(), key=lambda f: (f.priority, f.name))


def get_format(name: str) -> CheckpointFormat:
    _load()
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"no checkpoint format {name!r}; registered: {sorted(registry)}") from None


def _load() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for spec in BUILTIN:
            module, _, cls = spec.partition(":")
            fmt = getattr(importlib.import_module(module), cls)
            if fmt.name not in _registry:
                register_format(fmt)
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            register_format(ep.load())
