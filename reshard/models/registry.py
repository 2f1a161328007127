"""The registry of model families, like the formats' (:mod:`reshard.formats.registry`): a private
dict behind a read-only view, built-ins imported on first use, plug-ins through
:func:`register_family` or the entry-point group ``reshard.models``; a conflicting registration
raises unless ``clobber=True``."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from types import MappingProxyType

from reshard.models.base import ModelFamily

#: Built-in families, as "module:class" (imported on first use).
BUILTIN: tuple[str, ...] = ("reshard.models.megatron_gpt:MegatronGPT",)
ENTRY_POINT_GROUP = "reshard.models"

_registry: dict[str, ModelFamily] = {}
#: Read-only view of the registered families (name -> family).
registry: Mapping[str, ModelFamily] = MappingProxyType(_registry)
_loaded = False
_lock = threading.RLock()


def register_family(family: ModelFamily | type[ModelFamily], *, clobber: bool = False) -> ModelFamily:
    """Register ``family`` (an instance, or a class to instantiate) under its name; returns it."""
    inst = family() if isinstance(family, type) else family
    if not isinstance(inst, ModelFamily):
        raise TypeError(f"{family!r} is not a ModelFamily")
    with _lock:
        old = _registry.get(inst.name)
        if old is not None and not clobber and type(old) is not type(inst):
            raise ValueError(f"model family {inst.name!r} is already registered ({old!r}); "
                             f"pass clobber=True to replace it")
        _registry[inst.name] = inst
    return inst


def unregister_family(name: str) -> None:
    with _lock:
        _registry.pop(name, None)


def families() -> list[ModelFamily]:
    """Every registered family, built-ins and plug-ins loaded, in the order they are asked."""
    _load()
    with _lock:
        return sorted(_registry.values(), key=lambda f: (f.priority, f.name))


def _load() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for spec in BUILTIN:
            module, _, cls = spec.partition(":")
            fam = getattr(importlib.import_module(module), cls)
            if fam.name not in _registry:
                register_family(fam)
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            register_family(ep.load())
