"""Run the ``reshard`` flow from the CLI or Python: ephemeral server by default, a configured
server when ``PREFECT_API_URL`` is set; threads by default, Dask on request."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from reshard.events import flush_worker
from reshard.flows.params import ReshardParams
from reshard.flows.server import prefect_environment


def task_runner(dask_address: str | None = None, dask_workers: int | None = None, gpus_per_worker: int = 0) -> Any:
    """Threads (default), a Dask scheduler at ``dask_address``, or a local Dask cluster."""
    if dask_address is None and not dask_workers:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=4)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    kwargs: dict[str, Any] = {"n_workers": dask_workers, "processes": False, "threads_per_worker": 2}
    if gpus_per_worker:
        kwargs["resources"] = {"GPU": gpus_per_worker}
    return DaskTaskRunner(cluster_kwargs=kwargs)


def run_flow(params: ReshardParams, *, dask_address: str | None = None, dask_workers: int | None = None,
             on_target_done: Callable[[dict[str, Any]], None] | None = None,
             console_level: str | None = None, server: Any = None) -> dict[str, Any]:
    """Run the flow in this process and return its summary, the flow's
    :class:`~reshard.result.ConversionResult` as plain data (raises the first task error).
    ``server``: the embedded server (:class:`reshard.flows.server.EmbeddedServer`) when the
    caller started it already (the CLI does, before it imports the flow, so it boots meanwhile);
    without it and without ``PREFECT_API_URL`` one is started here."""
    from reshard.storage.cache import ShardCache

    prefect_environment(ShardCache(params.cache_dir).root)
    from reshard import progress
    from reshard.flows.reshard_flow import reshard_flow

    if console_level:
        quiet_console(console_level)

    flow = reshard_flow.with_options(task_runner=task_runner(dask_address, dask_workers,
                                                             1 if params.gpu_resource else 0))

    def done_only(event: dict[str, Any]) -> None:
        if on_target_done is not None and event.get("event") == progress.TARGET_DONE:
            on_target_done(event)

    # the embedded server (no PREFECT_API_URL): started here unless the CLI started it already,
    # settled with (every task run recorded) and stopped when the run is over, and made to die
    # with this process
    embedded = _EmbeddedServer.attach(server, ShardCache(params.cache_dir).root)
    unsubscribe = progress.subscribe(done_only) if on_target_done else (lambda: None)
    interrupted = False  # Ctrl-C: the server is stopping too, nothing to settle with
    with embedded.settings() if embedded is not None else contextlib.nullcontext():
        try:
            if embedded is not None:
                embedded.note_events()
            with _no_heartbeats(embedded is not None):
                return flow(params).model_dump()
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            unsubscribe()
            if embedded is not None:
                embedded.detach(settle=not interrupted)


def _no_heartbeats(embedded: bool) -> Any:
    """Flow-run heartbeats off for a run on the embedded server. Heartbeats let a server mark a
    run whose process died as crashed; the embedded server dies with this process, so nothing is
    lost, and each run's end no longer waits for the heartbeat thread's 1 s sleep (Prefect joins
    it). Runs on a configured server (deployments, workers) keep them."""
    import contextlib

    if not embedded:
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


class _ConsoleFilter:
    """For the CLI: what Prefect's console handlers print.

    The CLI reports a run itself: a progress line per target, then one summary line or one
    ``reshard: error:`` line. So, unless ``run_logs`` (``-v``), the flow's and tasks' own log
    records (loggers ``prefect.flow_runs`` / ``prefect.task_runs``: states such as Failed,
    NotReady or Crashed, retries, exceptions) stay off the console; they still reach the API/UI
    in full. Prefect's other warnings (e.g. an unreachable API) are printed. Tracebacks are never
    printed, and a record carrying a reshard error is left to the CLI's final line.
    """

    RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self, run_logs: bool = False) -> None:
        self.run_logs = run_logs

    def filter(self, record: Any) -> bool:
        from reshard.core.errors import ReshardError

        if not self.run_logs and any(record.name == n or record.name.startswith(n + ".") for n in self.RUN_LOGGERS):
            return False
        if record.exc_info and isinstance(record.exc_info[1], ReshardError):
            return False
        if "Finished in state Failed" in record.getMessage():
            return False
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_console(level: str = "WARNING", *, run_logs: bool | None = None) -> None:
    """Limit Prefect's console handlers to ``level`` and drop tracebacks (logs still reach
    the Prefect API/UI in full). ``run_logs`` (default: ``level`` is INFO or lower) keeps the
    flow's and tasks' own records on the console (see :class:`_ConsoleFilter`)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    numeric = level if isinstance(level, int) else logging.getLevelName(str(level).upper())
    if run_logs is None:
        run_logs = isinstance(numeric, int) and numeric <= logging.INFO
    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in logging.root.manager.loggerDict]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(level)
                mine = [f for f in handler.filters if isinstance(f, _ConsoleFilter)]
                if mine:
                    for f in mine:
                        f.run_logs = run_logs
                else:
                    handler.addFilter(_ConsoleFilter(run_logs))


# --- the embedded server -----------------------------------------------------------------------
#
# Without PREFECT_API_URL a run needs a server of its own: reshard starts Prefect's server in a
# subprocess (:mod:`reshard.flows.server`: the command Prefect's own temporary server runs, started
# earlier and without importing Prefect's server package) and stops it when the run is over. Task
# runs reach that server only as events: the client's EventsWorker streams them over a websocket,
# and the server's task_run_recorder service writes them one by one. Stopped while events are
# still on their way or being written, the server loses them (task runs left Pending or Running in
# its database) and logs "Error flushing 1 events" with a CancelledError traceback. So
# ``run_flow`` settles first: it sends everything (events and logs) and waits until the server
# holds the last state of every task run it sent; the stop then finds an idle server. Should this
# process die without stopping it (SIGKILL), the server notices and stops itself rather than run
# on, orphaned.

#: Most seconds ``run_flow`` waits for the embedded server to record the flow's task runs.
SETTLE_TIMEOUT = 20.0


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
    """run_flow's handling of the embedded server (see the comment above): reshard's own
    :class:`~reshard.flows.server.EmbeddedServer`, the run pointed at it, task-run events noted
    as they are sent, and, once the run is over, settled with and stopped."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.ledger: _TaskRunLedger | None = None  # set by note_events

    @classmethod
    def attach(cls, server: Any = None, cache_root: Any = None) -> "_EmbeddedServer | None":
        """Use ``server`` (started early by the CLI), or start one; note the task-run events this
        process sends it. None when a configured server (``PREFECT_API_URL``) is used."""
        from prefect.settings import PREFECT_API_URL

        from reshard.flows.server import EmbeddedServer

        if PREFECT_API_URL.value():  # configured (environment or profile): no server of our own
            if server is not None:
                server.stop()
            return None
        if server is None:
            server = EmbeddedServer(cache_root)
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        server.wait_ready(float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
        return cls(server)

    def note_events(self) -> None:
        """Note each task-run event this process sends (inside :meth:`settings`: the events
        worker made now sends to this server)."""
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

    def settings(self) -> Any:
        """The run's Prefect settings: the API at this server."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.server.api_url})

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
