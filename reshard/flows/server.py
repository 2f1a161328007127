"""Prefect's API server for one ``reshard run``, started by reshard itself — early, and without
importing Prefect's server.

Without ``PREFECT_API_URL`` Prefect starts a temporary server the first time a client needs one
(``SubprocessASGIServer``): it imports the whole server package into the calling process first
(about 2 s), then waits for the subprocess (2-3 s) while nothing else happens. reshard's CLI
instead spawns the same subprocess — the same ``uvicorn ... prefect.server.api.server:create_app``
command and environment — once it has checked the input (a refusal or an up-to-date destination
needs no server) and before importing Prefect's client or the flow, so the server comes up while
those imports run, and points the run at it (:attr:`EmbeddedServer.api_url`). This module
imports neither Prefect nor anything heavy.

The server is this process's child: :mod:`reshard.flows.session` settles with it before stopping
it (every task run recorded). If this process dies without stopping it (``kill -9`` included) the
server stops itself: it holds the read end of a pipe whose only writer is this process, and the
kernel closes that pipe however this process ends (see :data:`_SERVE`).

Its state is reshard's own: a SQLite database under the shard cache's root
(:func:`own_database`), not Prefect's default ``~/.prefect/prefect.db``, which whatever other
Prefect the user runs migrates to its own schema (a newer Prefect's alembic revision stops an
older server at start-up). A user who chose their Prefect state (``PREFECT_API_URL``,
``PREFECT_HOME`` or a database URL in the environment) keeps it; trouble with any database is
one line naming the file and the fix (:class:`~reshard.core.errors.PrefectServerError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from reshard.core.errors import PrefectServerError

#: uvicorn's exit status when its port was taken meanwhile (the spawn is retried on another).
PORT_TAKEN = 3
#: How long a stopped server is given to shut down before it is killed.
STOP_GRACE_SECONDS = 5.0


#: The environment variables with which a user chooses the Prefect state runs use: with any of
#: them set, the database is theirs (Prefect's default under their ``PREFECT_HOME``, or their URL).
USER_STATE_SETTINGS = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                       "PREFECT_API_DATABASE_CONNECTION_URL")
#: The database setting reshard gives the servers it starts (never this process's environment: a
#: child process would take it for the user's choice).
DATABASE_SETTING = "PREFECT_SERVER_DATABASE_CONNECTION_URL"


def own_database(cache_root: Path) -> Path:
    """The SQLite file of reshard's own Prefect state: beside the shard cache, out of reach of the
    user's other Prefect installs."""
    return cache_root / "prefect" / "prefect.db"


def server_database(cache_root: Path) -> dict[str, str]:
    """The environment a Prefect server reshard starts needs on top of this process's: reshard's
    own database, unless the user chose their Prefect state (then nothing)."""
    if any(os.environ.get(name) for name in USER_STATE_SETTINGS):
        return {}
    db = own_database(cache_root)
    db.parent.mkdir(parents=True, exist_ok=True)
    # the memo of the server's block registration too, which would go to ~/.prefect
    return {DATABASE_SETTING: f"sqlite+aiosqlite:///{db}",
            "PREFECT_MEMO_STORE_PATH": str(db.parent / "memo_store.toml")}


#: How long a server reshard starts may take to answer, unless the setting below says: the first
#: start in a home migrates its database, which a busy machine takes long over.
STARTUP_TIMEOUT = 120
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def startup_timeout() -> float:
    """Seconds to wait for a server reshard starts (:data:`STARTUP_TIMEOUT` unless set)."""
    return float(os.environ.get(STARTUP_TIMEOUT_SETTING) or STARTUP_TIMEOUT)


#: reshard's defaults for the Prefect it runs: no telemetry (offline, a server prints a traceback
#: per failed attempt to send it). An explicit setting always wins.
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def prefect_environment(cache_root: Path) -> None:
    """The CLI's process: defaults for running offline on a small machine (:data:`QUIET`, results
    beside the shard cache); an explicit setting always wins."""
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(STARTUP_TIMEOUT_SETTING, str(STARTUP_TIMEOUT))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(cache_root / "prefect-results"))


def database_in_use(env: dict[str, str]) -> str:
    """The database a Prefect server started with ``env`` opens, as a user would name it: the
    SQLite file, or the configured URL without its password."""
    url = env.get(DATABASE_SETTING) or env.get("PREFECT_API_DATABASE_CONNECTION_URL")
    if url:
        if url.startswith("sqlite") and ":///" in url:
            return url.split(":///", 1)[1]
        return re.sub(r":[^:@/]*@", ":***@", url)
    home = env.get("PREFECT_HOME") or str(Path.home() / ".prefect")
    return str(Path(home) / "prefect.db")


def database_error(stderr: str, status: int | None, env: dict[str, str], own: bool) -> PrefectServerError:
    """What a Prefect process (started with ``env``; ``own``: on reshard's own database) that died
    opening its database printed, as one line naming the database and the fix (the alembic
    traceback itself is not shown)."""
    from importlib.metadata import version

    db = database_in_use(env)
    unknown = re.search(r"Can't locate revision identified by '(\w+)'", stderr)
    if unknown:
        fix = ("delete it (it holds only reshard's run history)" if own else
               "unset PREFECT_HOME to let reshard keep a database of its own, point it at another folder, "
               f"or install the Prefect version that migrated it; this one is {version('prefect')}")
        return PrefectServerError(f"Prefect's database was migrated by another Prefect version (alembic revision "
                                  f"{unknown.group(1)}, unknown to Prefect {version('prefect')})", culprit=db, hint=fix)
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    last = (errors or lines or [f"exit status {status}"])[-1][:300]
    return PrefectServerError(f"Prefect's server could not start ({last})", culprit=db,
                              hint="check that the database is readable and writable and not used by another "
                                   "Prefect version; PREFECT_HOME or PREFECT_SERVER_DATABASE_CONNECTION_URL choose "
                                   "another")


def is_migrated(database: str) -> bool:
    """Has a SQLite ``database`` (a path, as :func:`database_in_use` names it) been migrated by
    some Prefect (it records its alembic revision)? Told without importing Prefect; another
    database (a URL) is taken as migrated."""
    import sqlite3

    if "://" in database:
        return True
    if not Path(database).is_file():
        return False
    try:
        db = sqlite3.connect(f"{Path(database).resolve().as_uri()}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute("SELECT count(*) FROM alembic_version").fetchone()[0] > 0
        finally:
            db.close()
    except sqlite3.Error as exc:  # busy, or not a database: another server has it, or the server will say
        return "no such table" not in str(exc)


def upgrade_database(cache_root: Path) -> int:
    """Migrate the database the embedded server will use (what ``make install`` runs once, so the
    first conversion's server starts quickly): 0, or one line on stderr and 2."""
    prefect_environment(cache_root)
    own = server_database(cache_root)
    env = dict(os.environ, **own)
    done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        err = database_error(done.stderr + done.stdout, done.returncode, env, own=bool(own))
        print(f"reshard: error: {err.one_line()}", file=sys.stderr)
        return 2
    return 0


def start_embedded(cache_root: Path) -> EmbeddedServer:
    """The environment's defaults set (the server inherits them), the server spawned: it comes up
    while the caller goes on (see :meth:`EmbeddedServer.wait_ready`)."""
    prefect_environment(cache_root)
    return EmbeddedServer(cache_root)


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

    def __init__(self, cache_root: Path) -> None:
        self.database = server_database(cache_root)  # reshard's own, unless the user chose theirs
        #: Does this server create its database (the first run in this home): it then migrates it
        #: before it answers, which takes long enough that the user should be told why.
        self.database_path = database_in_use(dict(os.environ, **self.database))
        self.creates_database = not is_migrated(self.database_path)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # what the server prints goes here, not to the user's terminal: read back when it fails to start
        self._stderr = tempfile.TemporaryFile()
        self._spawn()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        env = dict(QUIET, **os.environ)
        env.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1", **self.database)
        env.pop("PREFECT_API_URL", None)
        # the pipe exists before the child does: there is no moment at which this process could
        # die and leave a server that does not know whom it serves
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, "--app-dir", _prefect_dir(), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"], env=env, stdin=subprocess.PIPE, stderr=self._stderr)

    def wait_ready(self, timeout: float) -> None:
        """Return once the server answers its health check; a taken port is retried on another."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                if self.proc.returncode != PORT_TAKEN:
                    raise database_error(self._printed(), self.proc.returncode, dict(os.environ, **self.database),
                                         own=bool(self.database))
                self.port = _free_port()
                self._spawn()
            with contextlib.suppress(urllib.error.URLError, OSError):  # not up yet
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                self.stop()
                raise PrefectServerError(f"Prefect's server did not start within {timeout:.0f} s",
                                         culprit=self.database_path,
                                         hint=f"raise {STARTUP_TIMEOUT_SETTING} on a busy machine")
            time.sleep(0.05)

    def _printed(self) -> str:
        """The end of what the server has printed so far."""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 65536))
        return self._stderr.read().decode("utf-8", "replace")

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
        self._stderr.close()


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


if __name__ == "__main__":  # ``python -m reshard.flows.server upgrade``: the Makefile's pre-migration
    if sys.argv[1:] != ["upgrade"]:
        sys.exit("usage: python -m reshard.flows.server upgrade")
    from reshard.storage.cache import default_cache_dir

    sys.exit(upgrade_database(default_cache_dir()))
