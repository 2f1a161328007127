"""A real ``prefect server start`` process for tests, plus helpers for the processes around it.

``PrefectServer(root).start()`` runs the server on a free 127.0.0.1 port with its SQLite database
and home under ``root``, analytics and UI off, and a 1-second scheduler loop; ``client_env()`` is
the environment a CLI, worker or ``serve`` process needs to use it (short poll intervals, results
and the shard cache under ``root``). Every wait is bounded; ``stop()`` sends SIGTERM to the
server's process group and SIGKILL after a grace period.

:func:`session_server` is the one server of a test run that the session fixture ``prefect_env``
shares between pytest-xdist's workers (each worker used to start its own, and an idle Prefect server
keeps a few percent of a core busy): the first worker to ask starts it through this file run as a
script, which stops it once the run's pytest process is gone, however the run ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from rendezvous import free_port

BIN = Path(sys.executable).parent


def base_env() -> dict[str, str]:
    """This process's environment without any Prefect or AWS settings (tests add their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_UI_ENABLED="false",
               PYTHONUNBUFFERED="1")
    return env


def spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so its whole process group can be stopped), output to ``log``."""
    out = open(log, "ab")
    try:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True)
    finally:
        out.close()


def stop(proc: subprocess.Popen | None, grace: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """``sig`` to the process group, then SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # exited between the timeout and the kill
            pass
        proc.wait(timeout=10)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


#: Services the session server does without: its flows run in the test processes (no deployments,
#: schedules, automations or paused runs), while the task run recorder and the event persister,
#: which the tests read task runs through, stay on.
IDLE_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "CANCELLATION_CLEANUP", "PAUSE_EXPIRATIONS",
                 "REPOSSESSOR", "DB_VACUUM", "TRIGGERS", "EVENT_LOGGER")


class PrefectServer:
    def __init__(self, root: Path, start_timeout: float = 120.0, services_off: tuple[str, ...] = ()):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "server.log"
        self.startup_s: float | None = None
        self.services_off = services_off

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def server_env(self) -> dict[str, str]:
        env = base_env()
        env.update(PREFECT_HOME=str(self.root / "server-home"),
                   PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="1",
                   PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED="false",
                   PREFECT_LOGGING_SERVER_LEVEL="WARNING")
        env.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in self.services_off})
        return env

    def client_env(self, **extra: str) -> dict[str, str]:
        env = base_env()
        env.update(PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.root / "client-home"),
                   PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(self.root / "results"),
                   RESHARD_CACHE_DIR=str(self.root / "shard-cache"),
                   PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="2",
                   PREFECT_RUNNER_POLL_FREQUENCY="1", PREFECT_CLI_PROMPT="false",
                   PREFECT_CLI_WRAP_LINES="false", COLUMNS="200")
        env.update(extra)
        return env

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.api_url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> PrefectServer:
        self.port = free_port()
        t0 = time.monotonic()
        self.proc = spawn([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                          self.server_env(), self.log)
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {self.proc.returncode}:\n{tail(self.log)}")
            if time.monotonic() - t0 > self.start_timeout:
                self.stop()
                raise RuntimeError(f"prefect server not healthy after {self.start_timeout:.0f}s:\n{tail(self.log)}")
            time.sleep(0.25)
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        stop(self.proc, grace=15.0)

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.5, on_timeout: Any = None) -> Any:
    """Poll ``predicate()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail}")
        time.sleep(interval)


def session_server(root: Path, watch_pid: int, timeout: float = 240.0) -> str:
    """The API URL of the run's shared server under ``root`` (a folder every worker of the run sees),
    started by the first caller (callers hold a file lock around this). The server lives until
    ``watch_pid`` (the run's pytest process) exits."""
    url_file = root / "api-url"
    if url_file.exists():
        return url_file.read_text()
    root.mkdir(parents=True, exist_ok=True)
    keeper = spawn([sys.executable, __file__, str(root), str(watch_pid)], base_env(), root / "keeper.log")
    wait_for(lambda: url_file.exists() or keeper.poll() is not None, timeout,
             "the session's Prefect server", on_timeout=lambda: tail(root / "keeper.log"))
    if not url_file.exists():
        raise RuntimeError(f"the session's Prefect server did not start:\n{tail(root / 'keeper.log')}"
                           f"\n{tail(root / 'server' / 'server.log')}")
    return url_file.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _keep(root: Path, watch_pid: int) -> None:
    """Run the session server until ``watch_pid`` exits (this file run as a script)."""
    server = PrefectServer(root / "server", start_timeout=180.0, services_off=IDLE_SERVICES)
    server.start()
    try:
        tmp = root / "api-url.tmp"
        tmp.write_text(server.api_url)
        tmp.rename(root / "api-url")
        print(json.dumps({"api_url": server.api_url, "startup_s": round(server.startup_s or 0, 1)}), flush=True)
        while _alive(watch_pid) and server.proc is not None and server.proc.poll() is None:
            time.sleep(1.0)
    finally:
        server.stop()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _keep(Path(sys.argv[1]), int(sys.argv[2]))
