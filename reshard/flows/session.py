"""The Prefect a ``reshard`` flow runs against when called from Python: the caller's, or reshard's
own embedded server, with the quiet, isolated defaults the CLI has.

Prefect without ``PREFECT_API_URL`` starts a temporary server of its own on ``~/.prefect/prefect.db``
(a database any other Prefect on the machine migrates to its schema), sends it telemetry (on an
offline machine: a ``Failed to send telemetry`` traceback per attempt, and ``database is locked``
ones while the run writes) and lets it print on the caller's terminal. :func:`prefect_session`
instead runs the block on the server :mod:`reshard.flows.server` starts: reshard's own database
(unless the caller chose one), no telemetry, its output kept out of the caller's terminal, task
results beside the shard cache. It does so only when the caller chose no server: with
``PREFECT_API_URL`` set (environment or profile), or inside a flow run (a subflow runs on its
parent's server), nothing changes. The caller's settings and environment are left as they were
(the block's settings are Prefect's temporary settings).

The server is settled with before it stops. Task runs reach it only as events: the client's
EventsWorker streams them over a websocket, and the server's task_run_recorder service writes
them one by one. Stopped while events are still on their way or being written, the server loses
them (task runs left Pending or Running in its database) and logs "Error flushing 1 events" with
a CancelledError traceback. So the session sends everything (events and logs) and waits until
the server holds the last state of every task run it sent; the stop then finds an idle server.
Should this process die without stopping it (SIGKILL), the server notices and stops itself
rather than run on, orphaned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reshard.events import flush_worker

#: Most seconds a session waits for the embedded server to record the flow's task runs.
SETTLE_TIMEOUT = 20.0


def _configured_api() -> bool:
    """Did the caller choose a Prefect server (``PREFECT_API_URL``, in the environment or the
    active profile)?"""
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def _in_flow_run() -> bool:
    """Is a flow or task run active in this context (a flow called here is a subflow, on its
    parent's server)?"""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def embedded_settings(api_url: str, cache_root: Path) -> Any:
    """The Prefect settings of a block run on reshard's embedded server at ``api_url``: the API
    there; task results beside the shard cache unless ``PREFECT_RESULTS_LOCAL_STORAGE_PATH`` says
    where; no flow-run heartbeats. Heartbeats let a server mark a run whose process died as
    crashed; this server dies with this process, so they tell it nothing, and each run's end
    would wait for the heartbeat thread's 1 s sleep (Prefect joins it). Runs on a configured
    server keep them."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )

    updates: dict[Any, Any] = {PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    if not os.environ.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH"):
        updates[PREFECT_RESULTS_LOCAL_STORAGE_PATH] = str(cache_root / "prefect-results")
    return temporary_settings(updates=updates)


@contextlib.contextmanager
def prefect_session(cache_dir: str | None = None, *, server: Any = None) -> Iterator[str | None]:
    """Run the block's flows on reshard's embedded server unless the caller chose Prefect's
    server (see the module docstring); yields that server's API URL, or None where the caller's
    Prefect is used. ``server``: an :class:`~reshard.flows.server.EmbeddedServer` started
    already (the CLI spawns it before it imports the flow, so it boots meanwhile); ``cache_dir``:
    the shard cache whose folder holds reshard's database and task results (default
    ``$RESHARD_CACHE_DIR`` or ``~/.cache/reshard``)."""
    if _in_flow_run() or _configured_api():
        if server is not None:
            server.stop()
        yield None
        return
    from reshard.storage.cache import ShardCache

    root = ShardCache(cache_dir).root
    embedded = _EmbeddedServer.attach(server, root)
    interrupted = False  # Ctrl-C: the server is stopping too, nothing to settle with
    try:
        with embedded_settings(embedded.server.api_url, root):
            try:
                embedded.note_events()
                yield embedded.server.api_url
            except BaseException as exc:
                interrupted = not isinstance(exc, Exception)
                raise
            finally:
                embedded.detach(settle=not interrupted)  # in the settings: it asks this server
    finally:
        embedded.server.stop()  # stopped already, unless the settings could not be entered


class _TaskRunLedger:
    """Per task run, the last state event sent to the server: the state its task_run_recorder
    makes current (the event's id becomes the state's id, its time the state's timestamp)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._last: dict[Any, tuple[Any, Any]] = {}

    def sent(self, event: Any) -> None:
        # what the recorder records: prefect/server/services/task_run_recorder.py, message_handler
        try:
            if not event.event.startswith("prefect.task-run") or \
                    event.resource.get("prefect.orchestration") != "client":
                return
            run_id = event.resource.prefect_object_id("prefect.task-run")
        except Exception:  # noqa: BLE001 - not a task run's event
            return
        with self._lock:
            self._last[run_id] = (event.id, event.occurred)

    def pending(self, runs: list[Any], ids: list[Any]) -> list[Any]:
        """Those of ``ids`` whose last sent state ``runs`` (the server's task runs) do not hold yet."""
        by_id = {r.id: r for r in runs}
        with self._lock:
            last = dict(self._last)
        out = []
        for run_id in ids:
            event_id, occurred = last[run_id]
            run = by_id.get(run_id)
            state = getattr(run, "state", None)
            if run is None or state is None or (run.state_id != event_id and state.timestamp < occurred):
                out.append(run_id)
        return out

    def ids(self) -> list[Any]:
        with self._lock:
            return list(self._last)


class _EmbeddedServer:
    """A session's embedded server (see the module docstring): reshard's own
    :class:`~reshard.flows.server.EmbeddedServer`, the block pointed at it, task-run events noted
    as they are sent, and, once the block is over, settled with and stopped."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.ledger: _TaskRunLedger | None = None  # set by note_events

    @classmethod
    def attach(cls, server: Any, cache_root: Any) -> _EmbeddedServer:
        """Use ``server`` (started early by the CLI), or start one, and wait until it answers."""
        from reshard.flows.server import EmbeddedServer, startup_timeout

        if server is None:
            server = EmbeddedServer(cache_root)
        server.wait_ready(startup_timeout())
        return cls(server)

    def note_events(self) -> None:
        """Note each task-run event this process sends (inside :func:`embedded_settings`: the
        events worker made now sends to this server)."""
        from prefect.events.worker import EventsWorker

        if EventsWorker._client_override is not None:  # events go elsewhere (tests): leave that alone
            return
        # The worker this process's events go through (Prefect's emit_event uses the same
        # instance); note each event once it is sent. Prefect only sends events through its
        # own client classes, so the note is taken around the worker's handling of an item.
        worker = EventsWorker.instance()
        handle = worker._handle
        ledger = self.ledger = _TaskRunLedger()

        async def handle_and_note(event: Any) -> None:
            await handle(event)
            ledger.sent(event)

        worker._handle = handle_and_note

    def detach(self, *, settle: bool) -> None:
        """Send what is queued (events, logs), wait until the server recorded this process's
        task runs (``settle``; at most SETTLE_TIMEOUT seconds in all)."""
        import time

        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        deadline = time.monotonic() + SETTLE_TIMEOUT
        try:
            with contextlib.suppress(Exception):  # best effort: the run's own outcome stands
                if settle:
                    self._flush(EventsWorker, deadline, wait_empty=True)
                    self._flush(APILogWorker, deadline, wait_empty=False)  # batched: it drains quietly
                    self._wait_recorded(deadline)
        finally:
            self.server.stop()

    @staticmethod
    def _flush(service: Any, deadline: float, *, wait_empty: bool) -> None:
        """Send everything queued, then stop the worker (see :func:`reshard.events.flush_worker`;
        a batched worker, APILogWorker, never reports its queue empty, nor logs "Still processing")."""
        import time

        try:
            worker = service.instance()
        except Exception:  # noqa: BLE001 - nothing to flush
            return
        flush_worker(worker, deadline - time.monotonic(), wait_empty=wait_empty)

    def _wait_recorded(self, deadline: float) -> None:
        import time

        if self.ledger is None:
            return
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId

        pending = self.ledger.ids()
        pause = 0.02
        try:
            with get_client(sync_client=True) as client:
                while pending and time.monotonic() < deadline:
                    if not self.server.running():
                        return
                    runs = []
                    for i in range(0, len(pending), 100):
                        chunk = pending[i:i + 100]
                        runs += client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=chunk)),
                                                      limit=len(chunk))
                    pending = self.ledger.pending(runs, pending)
                    if pending:
                        time.sleep(pause)
                        pause = min(pause * 2, 0.25)
        except Exception:  # noqa: BLE001 - best effort: the run's own outcome stands
            return
