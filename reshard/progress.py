"""In-process progress events, for whoever shows them (the CLI's display).

Emitters are the conversion steps themselves — the ``--direct`` runner and the Prefect tasks
(when they run in this process: the default thread runner; on Dask workers ``notify`` finds no
listener and does nothing, and Prefect's logs and report artifact are the record). This module
knows neither: tasks and the direct runner import it, never the CLI or a flow.

Events (plain dicts, ``event`` says which):

===============  ==============================================================================
``planned``      ``targets``: [{``name``, ``rank``, ``bytes``}] — what will be written (estimates)
``bytes``        ``name``, ``done``: bytes of that output produced so far
``target-done``  ``name``, ``rank``, ``sources``, ``size``, ``seconds``: one output finished
``status``       ``text``: what happens before the plan's first byte (starting Prefect's server)
===============  ==============================================================================
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

PLANNED, BYTES, TARGET_DONE, STATUS = "planned", "bytes", "target-done", "status"

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


def planned(targets: Iterable[tuple[str, int, int]]) -> None:
    """``targets``: (name, rank, estimated bytes) of every output, in order."""
    notify({"event": PLANNED, "targets": [{"name": n, "rank": r, "bytes": b} for n, r, b in targets]})


def bytes_reporter(name: str) -> Callable[[int], None] | None:
    """An ``on_bytes`` callback for the writer of output ``name`` (None when nobody listens)."""
    with _lock:
        if not _listeners:
            return None
    return lambda done: notify({"event": BYTES, "name": name, "done": done})


def target_done(record: dict[str, Any]) -> None:
    notify(dict(record, event=TARGET_DONE))


def status(text: str) -> None:
    notify({"event": STATUS, "text": text})
