"""Scale out: a conversion spread over machines that share nothing but the object store.

A real Dask cluster — a scheduler and two ``dask worker`` processes, each with its own HOME,
shard cache and Prefect result folder — runs the ``reshard`` flow against the tests' SeaweedFS
and Prefect server: every task fetches what it reads itself and uploads what it writes straight
to the destination, so the output equals ``--direct`` byte for byte. Killing a worker in the middle
of a conversion (a real SIGKILL, after it sent all but the last part of an output) lets Dask run
its task again on the other worker; the checkpoint commits whole or not at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import upload_to_s3
from prefect_server import spawn, stop, tail, wait_for
from rendezvous import free_port
from reshard.core.options import ReshardOptions
from reshard.direct import run_direct
from reshard.sample import GPTConfig, write_sample_checkpoint
from reshard.storage.manifest import MANIFEST_NAME

#: Wide enough that at TP 8 the weights are holes of the shards' skeletons (records over 64 KiB).
CFG = GPTConfig(layers=4, hidden=384, heads=8, vocab=2048, seq=16)
DASK = str(Path(sys.executable).parent / "dask")


class Cluster:
    """``dask scheduler`` and named ``dask worker`` processes, each worker with a home of its own."""

    def __init__(self, root: Path, env: dict[str, str], workers: dict[str, dict[str, str]]) -> None:
        self.root, self.port = root, free_port()
        root.mkdir(parents=True, exist_ok=True)
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scheduler = spawn([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                "--no-dashboard"], env, root / "scheduler.log")
        self.workers: dict[str, subprocess.Popen] = {}
        self.homes: dict[str, Path] = {}
        for name, extra in workers.items():
            home = root / name
            (home / "home").mkdir(parents=True)
            self.homes[name] = home
            wenv = dict(env, HOME=str(home / "home"), RESHARD_CACHE_DIR=str(home / "cache"),
                        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"), **extra)
            self.workers[name] = spawn([DASK, "worker", self.address, "--name", name, "--no-nanny",
                                        "--nthreads", "2", "--no-dashboard", "--local-directory",
                                        str(home / "dask")], wenv, home / "worker.log")
        from distributed import Client

        def ready() -> bool:
            with Client(self.address, timeout=5) as c:
                return len(c.scheduler_info()["workers"]) == len(workers)

        wait_for(ready, 60, "the Dask workers to join", on_timeout=self.logs)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{tail(h / 'worker.log', 3000)}" for n, h in self.homes.items()) + \
            f"\n--- scheduler\n{tail(self.root / 'scheduler.log', 2000)}"

    def stop(self) -> None:
        for proc in self.workers.values():
            stop(proc, grace=10)
        stop(self.scheduler, grace=10)


def _cluster_env(prefect_env: dict[str, str], s3_server: Any) -> dict[str, str]:
    env = {k: v for k, v in prefect_env.items() if k not in ("HOME", "RESHARD_CACHE_DIR")}
    return dict(env, AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
                PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.fixture
def tp8_on_s3(tmp_path, s3_server, s3_bucket, monkeypatch) -> tuple[str, dict, dict[str, bytes]]:
    src = tmp_path / "tp8"
    write_sample_checkpoint(src, tp=8, cfg=CFG)
    url, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch)
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(target_tp=2))
    want = {p.name: p.read_bytes() for p in (tmp_path / "direct").iterdir() if p.name != MANIFEST_NAME}
    return url, so, want


def _run(cluster: Cluster, src: str, dst: str, so: dict, **options: Any) -> dict[str, Any]:
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    return run_flow(ReshardParams(source=src, destination=dst, storage_options=so, **(options or {"target_tp": 2})),
                    dask_address=cluster.address)


def _outputs(url: str, so: dict) -> dict[str, bytes]:
    from reshard.storage.location import open_location

    loc = open_location(url, so)
    loc.fs.invalidate_cache()
    return {p.rsplit("/", 1)[-1]: loc.fs.cat_file(p) for p in loc.fs.find(loc.path)
            if not p.endswith(MANIFEST_NAME) and "/.reshard" not in p}


def _held(home: Path) -> tuple[int, int]:
    """(entries, allocated bytes) of a worker's shard cache."""
    shards = home / "cache" / "shards"
    entries = list(shards.iterdir()) if shards.is_dir() else []
    return len(entries), sum(p.stat().st_blocks * 512 for p in entries)


def test_workers_that_share_nothing_but_s3_convert_like_direct(tmp_path, prefect_env, s3_server, s3_bucket,
                                                               tp8_on_s3):
    src, so, want = tp8_on_s3
    cluster = Cluster(tmp_path / "cluster", _cluster_env(prefect_env, s3_server), {"a": {}, "b": {}})
    try:
        out = _run(cluster, src, f"{s3_bucket}/out", so)
    finally:
        cluster.stop()
    assert out["files"] and not out["up_to_date"]
    assert _outputs(f"{s3_bucket}/out", so) == want
    held = {name: _held(home) for name, home in cluster.homes.items()}
    assert all(n for n, _ in held.values()), ("both workers fetched what their tasks read", held, cluster.logs())
    source_bytes = sum(len(v) for v in want.values())  # about the TP 8 source's size
    assert sum(b for _, b in held.values()) < source_bytes // 100, held  # stand-ins and markers, not shards


def test_a_worker_killed_mid_conversion_leaves_the_run_to_the_other(tmp_path, prefect_env, s3_server, s3_bucket,
                                                                    tp8_on_s3):
    """Both workers would SIGKILL themselves after sending all but the last part of an output;
    only the first to get there does (a token file). Dask runs its task again on the survivor:
    the run commits the same bytes as ``--direct``, with no upload left open — or, should it fail,
    nothing is committed."""
    src, so, want = tp8_on_s3
    token = tmp_path / "crashed-once"
    crash = {"RESHARD_CRASH_AT": "converted:1", "RESHARD_CRASH_ONCE": str(token)}
    cluster = Cluster(tmp_path / "cluster", _cluster_env(prefect_env, s3_server), {"a": crash, "b": crash})
    dst = f"{s3_bucket}/out"
    try:
        try:
            out = _run(cluster, src, dst, so)
        except Exception as exc:  # failing cleanly is allowed: nothing may be committed then
            out = None
            failure = exc
        dead = [n for n, p in cluster.workers.items() if p.poll() is not None]
    finally:
        cluster.stop()
    assert token.exists() and len(dead) == 1, (dead, cluster.logs())
    if out is None:
        assert _outputs(dst, so).get(MANIFEST_NAME) is None, failure
        pytest.fail(f"the run failed instead of finishing on the surviving worker: {failure}")
    assert _outputs(dst, so) == want
    assert s3_server.client().list_multipart_uploads(Bucket=s3_bucket[5:]).get("Uploads", []) == []


def test_one_target_cut_into_files_is_written_by_both_workers(tmp_path, prefect_env, s3_server, s3_bucket,
                                                              tp8_on_s3):
    """TP 8 -> one torch_dist checkpoint (a single target: a layout of global tensors) cut into
    files of at most 2 MB: each file is a task of its own, so the two workers write the one
    checkpoint together, and the files equal ``--direct``'s byte for byte."""
    src, so, _ = tp8_on_s3
    opts = {"to": "torch_dist", "max_shard_size": "2MB"}
    run_direct(str(tmp_path / "tp8"), str(tmp_path / "direct-dist"), ReshardOptions(**opts))
    want = {p.name: p.read_bytes() for p in (tmp_path / "direct-dist").rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME}
    assert sum(name.endswith(".distcp") for name in want) >= 8
    cluster = Cluster(tmp_path / "cluster", _cluster_env(prefect_env, s3_server), {"a": {}, "b": {}})
    pids = {cluster.workers[n].pid for n in cluster.workers}
    seen = []
    try:
        # Dask places each file's task by the workers' load and where its inputs are; on a loaded
        # machine one worker may take them all in a run (a run whose tasks each end before the next
        # is submitted). Each run must equal --direct; one of up to three must have used both.
        for attempt in range(3):
            dst = f"{s3_bucket}/dist{attempt}"
            out = _run(cluster, src, dst, so, **opts)
            assert _outputs(dst, so) == want
            seen.append(out["converted_on"])
            if {int(w.rsplit(" ", 1)[1]) for w in out["converted_on"].values()} == pids:
                break
    finally:
        cluster.stop()
    made_by = {int(w.rsplit(" ", 1)[1]) for w in seen[-1].values()}
    assert made_by == pids, (seen, pids)  # both workers wrote files of the one checkpoint
