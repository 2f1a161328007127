"""In-process progress listeners (the CLI's per-target-rank progress lines).

Only meaningful when tasks run in this process (the default thread runner); on Dask workers
``notify`` finds no listener and does nothing. Prefect's logs and the report artifact are the
progress record everywhere else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_listeners: list[Callable[[dict[str, Any]], None]] = []


def subscribe(fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Register ``fn``; returns a function that unregisters it."""
    with _lock:
        _listeners.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return unsubscribe


def notify(event: dict[str, Any]) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(event)
