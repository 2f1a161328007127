"""What ``reshard`` leaves on the console and behind it, around Prefect.

* With Prefect's embedded server (no ``PREFECT_API_URL``) a run ends with the server idle: every
  task run it was sent is recorded before the server is stopped, so its shutdown loses nothing
  and logs nothing ("Error flushing 1 events" + a CancelledError traceback, before).
* A ``reshard run`` killed with SIGKILL takes the embedded server with it (it was left running,
  orphaned, before), at startup as well as mid-run — and even when it dies the instant the
  server's process exists (the server watches a pipe it holds from birth).
* ``reshard emit-training-completed`` prints its one line, nothing on stderr.
* A failing ``reshard run`` prints exactly one line on stderr, reshard's own, unless ``-v``.

Every test runs the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_reshard_cli

LINUX_PROC = Path("/proc/self/environ").exists()

# Loaded into every Python process started with this folder on PYTHONPATH, it slows the embedded
# server's task_run_recorder (each write waits RESHARD_TEST_RECORDER_DELAY seconds first), as a
# busy machine or a slow disk does: events then queue up in the server, and a server stopped
# before it has written them loses them. Everywhere else it does nothing.
SLOW_RECORDER = '''
import os, sys
if os.environ.get("RESHARD_TEST_RECORDER_DELAY") and "prefect.server.api.server:create_app" in sys.argv:
    import asyncio
    from prefect.server.services import task_run_recorder as _recorder

    _record, _delay = _recorder.record_bulk_task_run_events, float(os.environ["RESHARD_TEST_RECORDER_DELAY"])

    async def _slow_record(events):
        await asyncio.sleep(_delay)
        return await _record(events)

    _recorder.record_bulk_task_run_events = _slow_record
'''


def embedded_env(root: Path, **extra: str) -> dict[str, str]:
    """An environment for the CLI that uses Prefect's embedded server, with its own home (and so
    its own database) under ``root``: no PREFECT_API_URL, no other Prefect setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
    env.update(PREFECT_HOME=str(root / "prefect-home"), RESHARD_CACHE_DIR=str(root / "shard-cache"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", DS_ACCELERATOR="cpu",
               DS_BUILD_OPS="0", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def task_run_states(home: Path, flow_run_id: str) -> list[tuple[str, str]]:
    """(task name, state name) of a flow run's task runs in the embedded server's database."""
    with sqlite3.connect(home / "prefect.db") as db:
        rows = db.execute("SELECT name, state_name FROM task_run WHERE flow_run_id = ?", (flow_run_id,)).fetchall()
    return sorted((name.rsplit("-", 1)[0], state or "") for name, state in rows)


def flow_run_count(home: Path) -> int:
    """Flow runs in the embedded server's database (0 before it exists)."""
    if not (home / "prefect.db").is_file():
        return 0
    with sqlite3.connect(home / "prefect.db") as db:
        return db.execute("SELECT count(*) FROM flow_run").fetchone()[0]


def server_pids(home: Path) -> list[int]:
    """Live (not zombie) embedded Prefect servers whose PREFECT_HOME is ``home``."""
    marker = f"PREFECT_HOME={home}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"uvicorn" not in cmdline or b"prefect.server.api.server" not in cmdline:
                continue
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(proc.name))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --- 1: the embedded server stops idle -------------------------------------------------------

@pytest.mark.slow  # starts the embedded Prefect server
def test_embedded_server_records_every_task_run_and_stops_quietly(sample_factory, tmp_path):
    """Two conversions of one source (the second's per-shard steps served from the cache) against
    the embedded server, whose recorder is slow: each leaves every task run recorded in a final
    state, nothing on stderr. An identical re-run is told up to date before any server starts."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RECORDER)
    env = embedded_env(tmp_path, RESHARD_TEST_RECORDER_DELAY="0.1",
                       PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    home = Path(env["PREFECT_HOME"])
    src = sample_factory(8, 2.0)
    seen = []
    for attempt in ("fresh", "fetches cached", "up to date"):
        dst = tmp_path / ("dst2" if attempt == "fetches cached" else "dst")
        runs_before = flow_run_count(home)
        res = run_reshard_cli(["run", str(src), str(dst), "--target-tp", "2", "--json"], env, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stderr == "", f"{attempt} run printed on stderr:\n{res.stderr[-3000:]}"
        summary = json.loads(res.stdout)
        assert summary["up_to_date"] is (attempt == "up to date")
        if attempt == "up to date":  # no flow ran, no server was started
            assert summary["flow_run_id"] is None and flow_run_count(home) == runs_before
            continue
        states = task_run_states(home, summary["flow_run_id"])
        unfinished = [s for s in states if s[1] not in ("Completed", "Cached")]
        assert states and not unfinished, f"{attempt} run: the server lost task runs' last states: {unfinished}"
        assert any(name == "report" for name, _ in states), f"{attempt} run: the last task run never reached the server"
        seen.append(sorted(name for name, _ in states))
    assert seen[0] == seen[1]  # the same task runs, all recorded, both times
    if LINUX_PROC:  # and the servers are gone
        assert wait_until(lambda: not server_pids(home), 10, 0.1), server_pids(home)


# --- 2: a killed run takes the embedded server with it ----------------------------------------

@pytest.mark.slow  # starts the embedded Prefect server
@pytest.mark.skipif(not LINUX_PROC, reason="finds the server through /proc")
@pytest.mark.parametrize("when", ["startup", "mid-run"])
def test_a_killed_run_takes_the_embedded_server_with_it(sample_factory, tmp_path, when):
    env = embedded_env(tmp_path)
    home = Path(env["PREFECT_HOME"])
    args = ["run", str(sample_factory(8, 2.0)), str(tmp_path / "dst"), "--target-tp", "2"]
    if when == "mid-run":
        env["RESHARD_CRASH_AT"] = "converted:1"  # the run SIGKILLs itself after its first conversion
    log = tmp_path / "stderr.log"  # not a pipe: a server left behind would hold it open
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "reshard.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        assert wait_until(lambda: server_pids(home), 120, 0.02), "the embedded server never started"
        if when == "startup":
            proc.kill()  # while the server is still starting (migrations, services)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
        gone = wait_until(lambda: not server_pids(home), 30, 0.2)
        assert gone, f"the embedded server outlived its killed parent: {server_pids(home)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(server_pids(home))


# The parent SIGKILLs itself the moment the server's process exists: before anything else it
# could do to arrange the server's end (a watchdog spawned after the server left this window open).
DIES_AT_SPAWN = """
import os, signal, subprocess
from reshard.flows import server

class _DiesAtSpawn(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

server.subprocess.Popen = _DiesAtSpawn
server.start_embedded(__import__("pathlib").Path(os.environ["RESHARD_CACHE_DIR"]))
"""


@pytest.mark.slow  # starts the embedded Prefect server
@pytest.mark.skipif(not LINUX_PROC, reason="finds the server through /proc")
def test_a_parent_killed_the_moment_it_spawned_the_server_takes_the_server_with_it(tmp_path):
    env = embedded_env(tmp_path)
    home = Path(env["PREFECT_HOME"])
    log = tmp_path / "stderr.log"  # not a pipe: the server inherits it, and would hold it open
    try:
        with open(log, "w") as err:
            proc = subprocess.run([sys.executable, "-c", DIES_AT_SPAWN], env=env, stdout=subprocess.DEVNULL,
                                  stderr=err, timeout=120)
        assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
        assert wait_until(lambda: server_pids(home), 30, 0.02), "the server was never spawned"
        gone = wait_until(lambda: not server_pids(home), 30, 0.2)
        assert gone, f"the embedded server outlived its killed parent: {server_pids(home)}"
    finally:
        kill_all(server_pids(home))


# --- 3: emitting the event is silent ----------------------------------------------------------

def test_emit_training_completed_prints_one_line_and_nothing_on_stderr(prefect_env):
    for _ in range(2):
        res = run_reshard_cli(["emit-training-completed", "s3://ckpt/run7/global_step1000", "--tp", "8",
                               "--step", "1000"], prefect_env, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stderr == "", res.stderr
        assert len(res.stdout.splitlines()) == 1 and res.stdout.startswith("emitted reshard.training.completed")


# --- 4: a failing run prints one line ----------------------------------------------------------

def _truncated_copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    last = sorted(dst.glob("mp_rank_*_model_states.pt"))[-1]
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size // 2)
    return dst


@pytest.mark.slow  # starts the embedded Prefect server
def test_a_failing_run_prints_one_line_unless_verbose(sample_factory, tmp_path):
    """A run that fails inside the flow (its first conversion raises) on the embedded server: only
    reshard's line without ``-v``; with ``-v`` Prefect's task-run lines too."""
    env = embedded_env(tmp_path, RESHARD_TEST_FAIL_CONVERT="1")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_CONVERT)
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["run", str(sample_factory(4, 2.0)), str(tmp_path / "out"), "--target-tp", "2"]
    res = run_reshard_cli(args, env, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if not line.startswith("reshard: first run: ")]
    assert len(lines) == 1 and lines[0].startswith("reshard: error: ") and "injected" in lines[0], res.stderr
    assert not (tmp_path / "out" / "reshard_manifest.json").exists()

    res = run_reshard_cli([*args, "-v"], env, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert any("Task run '" in line for line in lines), res.stderr  # Prefect's own lines, with -v
    assert len([line for line in lines if line.startswith("reshard: error: ")]) == 1, res.stderr
    assert "Traceback" not in res.stderr


# Loaded into every Python process started with this folder on PYTHONPATH: with
# RESHARD_TEST_FAIL_CONVERT set, the flow's conversion step raises a reshard error, as a shard
# unreadable only while its tensors are read would (no check before the flow can see it).
FAILING_CONVERT = """
import os, sys
if os.environ.get("RESHARD_TEST_FAIL_CONVERT") and sys.argv[1:2] == ["run"]:
    import reshard.execution.engine as _engine
    from reshard.core.errors import CorruptCheckpointError

    def _fails(*args, **kwargs):
        raise CorruptCheckpointError("injected read failure", culprit="mp_rank_00_model_states.pt")

    _engine.convert_target = _fails
"""


@pytest.mark.parametrize("case", ["missing", "indivisible", "truncated"])
def test_bad_input_on_the_flow_path_is_refused_before_any_prefect_server_starts(sample_factory, tmp_path, case):
    """What the plan can see is refused in the CLI's own process, at ``--direct``'s speed: no
    server is spawned (the first thing it does is make its database's folder under the cache),
    nothing is created for Prefect, one line."""
    src = {"missing": tmp_path / "nope", "indivisible": sample_factory(4, 2.0),
           "truncated": _truncated_copy(sample_factory(4, 2.0), tmp_path / "src")}[case]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
    (tmp_path / "home").mkdir()
    env.update(HOME=str(tmp_path / "home"), RESHARD_CACHE_DIR=str(tmp_path / "cache"), DO_NOT_TRACK="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    target = "3" if case == "indivisible" else "2"
    res = run_reshard_cli(["run", str(src), str(tmp_path / "out"), "--target-tp", target], env, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), res.stderr
    assert {"missing": "no such file or folder", "indivisible": "cannot be divided evenly over 3",
            "truncated": "mp_rank_03"}[case] in lines[0]
    assert not (tmp_path / "cache" / "prefect").exists(), "a Prefect server was started for a refused input"
    assert not (tmp_path / "home" / ".prefect").exists() and not (tmp_path / "out").exists()


def test_a_failing_run_from_s3_prints_one_line(sample_factory, s3_server, s3_bucket, prefect_env, tmp_path):
    from reshard.storage.location import open_location

    folder = _truncated_copy(sample_factory(4, 2.0), tmp_path / "src")
    so = s3_server.storage_options()
    src = f"{s3_bucket}/truncated"
    loc = open_location(src, so)
    for p in sorted(folder.iterdir()):
        loc.fs.put_file(str(p), loc.join(p.name))
    res = run_reshard_cli(["run", src, f"{s3_bucket}/out", "--target-tp", "2", "--cache-dir", str(tmp_path / "cache"),
                           "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
                           "--storage-option", "region_name=us-east-1",
                           "--storage-option", f"key={s3_server.access_key}",
                           "--storage-option", f"secret={s3_server.secret_key}"], prefect_env, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: ") and "mp_rank_03" in lines[0], res.stderr
