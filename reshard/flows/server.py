"""Prefect's API server for one ``reshard run``, started by reshard itself — early, and without
importing Prefect's server.

Without ``PREFECT_API_URL`` Prefect starts a temporary server the first time a client needs one
(``SubprocessASGIServer``): it imports the whole server package into the calling process first
(about 2 s), then waits for the subprocess (2-3 s) while nothing else happens. reshard's CLI
instead spawns the same subprocess — the same ``uvicorn ... prefect.server.api.server:create_app``
command and environment — as its first step, before importing torch, Prefect's client or the
flow, so the server comes up while those imports run, and points the run at it
(:attr:`EmbeddedServer.api_url`). This module imports neither Prefect nor anything heavy.

The server is this process's child: :mod:`reshard.flows.runner` settles with it before stopping
it (every task run recorded). If this process dies without stopping it (``kill -9`` included) the
server stops itself: it holds the read end of a pipe whose only writer is this process, and the
kernel closes that pipe however this process ends (see :data:`_SERVE`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: uvicorn's exit status when its port was taken meanwhile (the spawn is retried on another).
PORT_TAKEN = 3
#: How long a stopped server is given to shut down before it is killed.
STOP_GRACE_SECONDS = 5.0


def prefect_environment(cache_root: Path) -> None:
    """Defaults for running offline on a small machine; an explicit setting always wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(cache_root / "prefect-results"))


def start_embedded(cache_root: Path) -> "EmbeddedServer":
    """The environment's defaults set (the server inherits them), the server spawned: it comes up
    while the caller goes on (see :meth:`EmbeddedServer.wait_ready`)."""
    prefect_environment(cache_root)
    return EmbeddedServer()


def _prefect_dir() -> str:
    """Where the ``prefect`` package lies (uvicorn's ``--app-dir``), found without importing it."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("prefect is not installed")
    return str(Path(spec.origin).parent.parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """One Prefect API server subprocess on 127.0.0.1 (SQLite under ``PREFECT_HOME``, as Prefect's
    own temporary server) that stops itself once this process is gone."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawn()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        env.pop("PREFECT_API_URL", None)
        # the pipe exists before the child does: there is no moment at which this process could
        # die and leave a server that does not know whom it serves
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, "--app-dir", _prefect_dir(), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"], env=env, stdin=subprocess.PIPE)

    def wait_ready(self, timeout: float) -> None:
        """Return once the server answers its health check; a taken port is retried on another."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                if self.proc.returncode != PORT_TAKEN:
                    raise RuntimeError(f"Prefect's server exited with status {self.proc.returncode} while starting")
                self.port = _free_port()
                self._spawn()
            with contextlib.suppress(urllib.error.URLError, OSError):  # not up yet
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's server did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server (gracefully, killed after :data:`STOP_GRACE_SECONDS`)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):  # already closed
            if proc.stdin is not None:
                proc.stdin.close()


#: The server's command: uvicorn, run by a Python that also watches its stdin. Nothing is ever
#: written to that pipe; it reaches end-of-file only when the process that spawned the server is
#: gone (however it went). The server then waits a moment, so that whatever it has received is
#: written and its graceful shutdown finds nothing half-done (and logs nothing), and stops the
#: way uvicorn stops on SIGTERM; a server still there 10 s later exits outright. SIGINT and SIGHUP
#: from the terminal are left to uvicorn, which stops on them as the parent does.
_SERVE = r"""# reshard: Prefect's embedded API server, which stops once the process that started it is gone
import contextlib, os, runpy, signal, sys, threading, time

def watch_parent():
    with contextlib.suppress(OSError, ValueError):
        sys.stdin.buffer.read()  # nothing is ever written: returns at end-of-file
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(1)

threading.Thread(target=watch_parent, name="reshard-parent-watch", daemon=True).start()
sys.argv[0] = "uvicorn"
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""
