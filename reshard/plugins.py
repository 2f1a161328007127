"""Plug-in registries (checkpoint formats, model families): a private dict behind a read-only
view, in the style of fsspec's ``registry.py``.

Built-ins are named as ``"module:Class"`` and imported on first use, as are the entry points of
the registry's group (each naming a class or an instance); nothing happens at import time.
Registering a second, different plug-in under a taken name raises unless ``clobber=True``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PluginRegistry(Generic[T]):
    """Plug-ins of one ``kind`` (a subclass of ``base`` each, with ``name`` and ``priority``)."""

    def __init__(self, kind: str, base: type[T], builtin: tuple[str, ...], entry_point_group: str) -> None:
        self.kind, self.base, self.builtin, self.group = kind, base, builtin, entry_point_group
        self._items: dict[str, T] = {}
        #: Read-only view: name -> plug-in.
        self.view: Mapping[str, T] = MappingProxyType(self._items)
        self._loaded = False
        self._lock = threading.RLock()

    def register(self, item: T | type[T], *, clobber: bool = False) -> T:
        """Register ``item`` (an instance, or a class to instantiate) under its name; returns it."""
        inst: Any = item() if isinstance(item, type) else item
        if not isinstance(inst, self.base):
            raise TypeError(f"{item!r} is not a {self.base.__name__}")
        with self._lock:
            old = self._items.get(inst.name)
            if old is not None and not clobber and type(old) is not type(inst):
                raise ValueError(f"{self.kind} {inst.name!r} is already registered ({old!r}); "
                                 f"pass clobber=True to replace it")
            self._items[inst.name] = inst
        return inst

    def unregister(self, name: str) -> None:
        """Remove a plug-in (tests, reloads); unknown names are ignored."""
        with self._lock:
            self._items.pop(name, None)

    def all(self) -> list[T]:
        """Every plug-in, built-ins and entry points loaded, lowest ``priority`` first."""
        self._load()
        with self._lock:
            return sorted(self._items.values(), key=lambda p: (p.priority, p.name))  # type: ignore[attr-defined]

    def get(self, name: str) -> T:
        self._load()
        try:
            return self.view[name]
        except KeyError:
            raise KeyError(f"no {self.kind} {name!r}; registered: {sorted(self.view)}") from None

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for spec in self.builtin:
                module, _, cls = spec.partition(":")
                plugin = getattr(importlib.import_module(module), cls)
                if plugin.name not in self._items:
                    self.register(plugin)
            from importlib.metadata import entry_points

            for ep in entry_points(group=self.group):
                self.register(ep.load())
