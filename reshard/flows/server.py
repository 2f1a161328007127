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
it (every task run recorded), and a watchdog stops it if this process dies without stopping it.
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
    own temporary server), guarded by a :class:`Watchdog`."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: Watchdog | None = None
        self._spawn()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        env.pop("PREFECT_API_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", _prefect_dir(), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"], env=env)
        if self.watchdog is None:
            try:
                self.watchdog = Watchdog()
            except OSError:  # no watchdog: stop() and the atexit stop remain
                self.watchdog = None
        if self.watchdog is not None:
            self.watchdog.watch(self.proc.pid)

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
        """Stop the server (gracefully, killed after :data:`STOP_GRACE_SECONDS`); then the watchdog."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.watchdog is not None:
            self.watchdog.release()
            self.watchdog = None


_WATCHDOG = r"""# reshard: stops Prefect's embedded server once the process that started it is gone
import contextlib, os, signal, sys, time
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
    with contextlib.suppress(OSError):  # gone meanwhile
        os.kill(pid, signal.SIGTERM)  # uvicorn shuts down gracefully
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
"""


class Watchdog:
    """A small process that stops the server ``pid`` once this process is gone.

    It reads a pipe from this process; the kernel closes the pipe however this process ends
    (``kill -9`` included), and the watchdog then terminates the server. Unlike
    ``PR_SET_PDEATHSIG`` (Linux only, and tied to the *thread* that spawned the child: Prefect
    may start the server from any thread) this needs no hook into how Prefect spawns the server.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        self.pid: int | None = None

    def _say(self, line: str) -> None:
        stdin = self.proc.stdin
        if stdin is None:  # never: Popen was given stdin=PIPE
            return
        with contextlib.suppress(OSError, ValueError):  # the watchdog is gone (or its pipe closed): nothing to tell
            stdin.write(line + "\n")
            stdin.flush()

    def watch(self, pid: int) -> None:
        if pid != self.pid:
            self.pid = pid
            self._say(f"watch {pid}")

    def release(self) -> None:
        """The server was stopped normally: let the watchdog end without doing anything."""
        self._say("release")
        with contextlib.suppress(Exception):  # exiting anyway: an unreaped watchdog exits by itself on EOF
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
