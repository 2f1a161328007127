"""Run the ``reshard`` flow from the CLI or Python: ephemeral server by default, a configured
server when ``PREFECT_API_URL`` is set; threads by default, Dask on request."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reshard.events import flush_worker
from reshard.flows.params import ReshardParams


def prefect_environment(cache_root: Path) -> None:
    """Defaults for running offline on a small machine; an explicit setting always wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(cache_root / "prefect-results"))


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
             console_level: str | None = None) -> dict[str, Any]:
    """Run the flow in this process and return its summary (raises the first task error)."""
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

    # Prefect's embedded server (no PREFECT_API_URL) is stopped at interpreter exit: settle
    # with it first, so that it stops idle, and make it die with this process
    embedded = _EmbeddedServer.attach()
    unsubscribe = progress.subscribe(done_only) if on_target_done else (lambda: None)
    settle = False
    try:
        with _no_heartbeats(embedded is not None):
            out = flow(params)
        settle = True
        return out
    except Exception:
        settle = True
        raise
    finally:
        unsubscribe()
        if embedded is not None:
            embedded.detach(settle=settle)  # not after Ctrl-C: the server is stopping too


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


# --- Prefect's embedded server --------------------------------------------------------------
#
# Without PREFECT_API_URL, Prefect runs a temporary server in a subprocess (``uvicorn ...
# prefect.server.api.server:create_app``, SubprocessASGIServer) and stops it from an ``atexit``
# hook. Task runs reach that server only as events: the client's EventsWorker streams them over a
# websocket, and the server's task_run_recorder service writes them one by one. Stopped while
# events are still on their way or being written, the server loses them (task runs left Pending or
# Running in its database) and logs "Error flushing 1 events" with a CancelledError traceback. So
# ``run_flow`` settles first: it sends everything (events and logs) and waits until the server
# holds the last state of every task run it sent; the atexit stop then finds an idle server.
# And a watchdog process stops the server if this process dies without its atexit hooks
# (SIGKILL), which would otherwise leave it running, orphaned.

#: Most seconds ``run_flow`` waits for the embedded server to record the flow's task runs.
SETTLE_TIMEOUT = 20.0

_WATCHDOG = r"""# reshard: stops Prefect's embedded server once the process that started it is gone
import os, signal, sys, time
for name in ("SIGINT", "SIGHUP"):  # the terminal's signals are for the parent
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
pid = None
for line in sys.stdin:  # ends (EOF) when the parent is gone, however it went
    word, _, arg = line.strip().partition(" ")
    if word == "watch":
        pid = int(arg)
    elif word == "release":  # the parent stopped the server itself
        pid = None

def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True

if pid and alive(pid):
    # nothing new can reach the server now; give it a moment to write what it has received,
    # so that its graceful shutdown finds nothing half-written (and logs nothing)
    time.sleep(1.5)
    try:
        os.kill(pid, signal.SIGTERM)  # uvicorn shuts down gracefully
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A small process that stops the server ``pid`` once this process is gone.

    It reads a pipe from this process; the kernel closes the pipe however this process ends
    (``kill -9`` included), and the watchdog then terminates the server. Unlike
    ``PR_SET_PDEATHSIG`` (Linux only, and tied to the *thread* that spawned the child: Prefect
    may start the server from any thread) this needs no hook into how Prefect spawns the server.
    """

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        self.pid: int | None = None

    def _say(self, line: str) -> None:
        stdin = self.proc.stdin
        if stdin is None:  # never: Popen was given stdin=PIPE
            return
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except (OSError, ValueError):  # the watchdog is gone (or its pipe closed): nothing to tell
            pass

    def watch(self, pid: int) -> None:
        if pid != self.pid:
            self.pid = pid
            self._say(f"watch {pid}")

    def release(self) -> None:
        """The server was stopped normally: let the watchdog end without doing anything."""
        self._say("release")
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - exiting anyway: an unreaped watchdog exits by itself on EOF
            pass


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
    """run_flow's handling of Prefect's embedded server (see the comment above)."""

    _watched: dict[int, _Watchdog] = {}  # server pid -> its watchdog, one per server process

    def __init__(self, server: Any, ledger: _TaskRunLedger | None) -> None:
        self.server = server
        self.ledger = ledger

    @classmethod
    def attach(cls) -> "_EmbeddedServer | None":
        """Start (or find) the embedded server, guard it with a watchdog and note the task-run
        events this process sends it; None when a configured server is used."""
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():
            return None
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()  # Prefect's shared instance: the one its clients use
        cls._start_guarded(server)
        from prefect.events.worker import EventsWorker

        ledger = None
        if EventsWorker._client_override is None:  # else events go elsewhere (tests): leave that alone
            # The worker this process's events go through (Prefect's emit_event uses the same
            # instance); note each event once it is sent. Prefect only sends events through its
            # own client classes, so the note is taken around the worker's handling of an item.
            worker = EventsWorker.instance()
            handle = worker._handle
            ledger = _TaskRunLedger()

            async def handle_and_note(event: Any) -> None:
                await handle(event)
                ledger.sent(event)

            worker._handle = handle_and_note
        return cls(server, ledger)

    @classmethod
    def _start_guarded(cls, server: Any) -> None:
        import atexit

        watchdog = None
        if not server.running:
            try:
                watchdog = _Watchdog()
            except Exception:  # noqa: BLE001 - no watchdog: Prefect's own atexit stop remains
                watchdog = None
        if watchdog is not None:
            # registered before Prefect's atexit stop (registered in start), so it runs after it
            atexit.register(cls._released, server, watchdog)
            spawn = getattr(server, "_run_uvicorn_command", None)
            if callable(spawn):
                # watch each server process the moment it is spawned (start() may respawn on a
                # taken port), so that even a kill during the server's startup stops it
                def spawn_watched() -> Any:
                    proc = spawn()
                    watchdog.watch(proc.pid)
                    return proc

                server._run_uvicorn_command = spawn_watched
            try:
                server.start()
            finally:
                server.__dict__.pop("_run_uvicorn_command", None)
        else:
            server.start()
        proc = server.server_process
        if proc is None:
            return
        if watchdog is None and proc.pid not in cls._watched:
            try:  # a server someone else started: guard it from now on
                watchdog = _Watchdog()
                atexit.register(cls._released, server, watchdog)
            except Exception:  # noqa: BLE001
                return
        if watchdog is not None:
            watchdog.watch(proc.pid)
            cls._watched[proc.pid] = watchdog

    @staticmethod
    def _released(server: Any, watchdog: _Watchdog) -> None:
        # at exit, after Prefect's own stop: with the server gone, the watchdog has nothing to do
        if server.server_process is None or server.server_process.pid != watchdog.pid:
            watchdog.release()

    def detach(self, *, settle: bool) -> None:
        """Send what is queued (events, logs), wait until the server recorded this process's
        task runs (``settle``; at most SETTLE_TIMEOUT seconds in all)."""
        import time

        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        deadline = time.monotonic() + SETTLE_TIMEOUT
        try:
            if settle:
                self._flush(EventsWorker, deadline, wait_empty=True)
                self._flush(APILogWorker, deadline, wait_empty=False)  # batched: it drains quietly
                self._wait_recorded(deadline)
        except Exception:  # noqa: BLE001 - best effort: the run's own outcome stands
            pass

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
                    proc = self.server.server_process
                    if proc is None or proc.poll() is not None:
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
