"""The Prefect pipeline on local files: same bytes as --direct, per-shard caching across runs,
resume after SIGKILL, Dask runner."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import (
    cache_records,
    flow_runs_to,
    read_task_runs,
    record_kinds,
    run_reshard_cli,
    task_name,
    task_states,
)
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions
from reshard.flows.params import ReshardParams
from reshard.flows.runner import run_flow
from reshard.storage.manifest import MANIFEST_NAME

pytestmark = pytest.mark.usefixtures("prefect_env")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}


def _params(src, dst, tmp_path, **kw) -> ReshardParams:
    return ReshardParams(source=str(src), destination=str(dst), cache_dir=str(tmp_path / "cache"), **kw)


def test_flow_output_equals_direct_and_rerun_is_all_cached(sample_factory, tmp_path):
    src = sample_factory(8, 2.0)
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(target_tp=2))
    first = run_flow(_params(src, tmp_path / "flow", tmp_path, target_tp=2))
    assert not first["up_to_date"]
    assert _files(tmp_path / "flow") == _files(tmp_path / "direct")
    states = task_states(first["flow_run_id"], expect={"convert-target": 2})
    assert set(states["convert-target"]) == {"Completed"}

    manifest = tmp_path / "flow" / MANIFEST_NAME
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    second = run_flow(_params(src, tmp_path / "flow", tmp_path, target_tp=2))
    assert second["up_to_date"] and second["conversion_id"] == first["conversion_id"]
    # task runs reach the server as events a little after the flow returns: wait for every one
    states = task_states(second["flow_run_id"], expect={"fetch-shard": 8, "check-shard": 8, "convert-target": 2,
                                                        "upload-target": 2})
    for name in ("fetch-shard", "check-shard", "convert-target", "upload-target"):
        assert states[name] and set(states[name]) == {"Cached"}, (name, states)
    assert len(states["fetch-shard"]) == 8 and len(states["convert-target"]) == 2
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before, "nothing new may be written"


def test_changed_options_are_not_served_from_cache(sample_factory, tmp_path):
    src = sample_factory(8, 2.0)
    run_flow(_params(src, tmp_path / "a", tmp_path, target_tp=2))
    out = run_flow(_params(src, tmp_path / "b", tmp_path, target_tp=2, quantize=True, groups=4))
    states = task_states(out["flow_run_id"], expect={"convert-target": 2, "fetch-shard": 8})
    assert set(states["convert-target"]) == {"Completed"}
    assert set(states["fetch-shard"]) == {"Cached"}  # same shards, same identity


_cli = run_reshard_cli


@pytest.mark.parametrize("crash", ["uploaded:3", "converted:1", "staged-all:1", "committed-files:1"])
def test_sigkill_then_resume_gives_identical_output(sample_factory, tmp_path, prefect_env, reshard_cli_here, crash):
    src = sample_factory(2, 2.0)
    run_direct(str(src), str(tmp_path / "clean"), ReshardOptions(target_tp=8))
    args = ["run", str(src), str(tmp_path / "dst"), "--target-tp", "8", "--cache-dir", str(tmp_path / "cache"),
            "--json"]
    before = cache_records(prefect_env)
    killed = _cli(args, prefect_env, crash=crash)
    written = record_kinds(cache_records(prefect_env) - before)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "dst" / MANIFEST_NAME).exists(), "a killed run must not look committed"
    resumed = reshard_cli_here(args, prefect_env)  # the kill needs its own process; the resume does not
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    assert _files(tmp_path / "dst") == _files(tmp_path / "clean")
    assert reshard_cli_here(["verify", str(tmp_path / "dst")], prefect_env).returncode == 0
    states = task_states(summary["flow_run_id"], expect={"convert-target": 8, "upload-target": 8})
    if crash.startswith("uploaded"):
        # every step whose result the killed run recorded is reused, no more and no less. Which
        # ones those are depends on timing: Prefect commits a task's cache record just *after* the
        # task reports Completed, and uploads run concurrently, so the 3rd upload's SIGKILL can land
        # before the 1st and 2nd were recorded (they are then redone; the output is the same).
        assert written.count("convert") >= 1, written  # the 3rd upload ran, so conversions finished
        assert states["convert-target"].count("Cached") == written.count("convert"), (states, written)
        assert states["upload-target"].count("Cached") == written.count("upload"), (states, written)
        assert states["fetch-shard"] == ["Cached"] * 2
        # the summary names the outputs the killed run had staged, and says so
        assert list(summary["resumed"].values()).count("staged") == written.count("upload"), (summary, written)
    assert _leftovers(tmp_path / "cache") == [], "the resumed commit left its work folder behind"


def _leftovers(cache: Path) -> list[str]:
    """Everything under the shard cache's work folders."""
    work = cache / "work"
    return sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) if work.exists() else []


def test_killed_runs_leave_one_partial_output_each_at_most_and_the_commit_leaves_nothing(sample_factory, tmp_path,
                                                                                        prefect_env, reshard_cli_here):
    """Two runs killed with their outputs half-written: the second's attempts reclaim the first's
    partial files, so at most one per output is left (it was one per attempt, forever); the run
    that commits removes the conversion's work folder; so does an up-to-date re-run's check."""
    src = sample_factory(8, 2.0)
    args = ["run", str(src), str(tmp_path / "dst"), "--target-tp", "2", "--cache-dir", str(tmp_path / "cache"),
            "--json"]
    for _ in range(2):
        killed = _cli(args, prefect_env, crash="writing:2")
        assert killed.returncode == -9, killed.stderr[-2000:]
        partial = [p for p in _leftovers(tmp_path / "cache") if "/.partial/" in p and p.endswith(".pt")]
        assert 1 <= len(partial) <= 2, partial  # two outputs, one partial each at most
    resumed = reshard_cli_here(args, prefect_env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _leftovers(tmp_path / "cache") == []
    run_direct(str(src), str(tmp_path / "clean"), ReshardOptions(target_tp=2))
    assert _files(tmp_path / "dst") == _files(tmp_path / "clean")
    left = tmp_path / "cache" / "work" / json.loads(resumed.stdout)["conversion_id"][:24] / "out" / ".partial"
    left.mkdir(parents=True)  # as a run killed after this one's commit, before its own, would leave
    assert reshard_cli_here(args, prefect_env).returncode == 0  # up to date
    assert _leftovers(tmp_path / "cache") == []


def test_a_new_destinations_first_conversion_is_no_resume(sample_factory, tmp_path, prefect_env, reshard_cli_here):
    """A second destination of the same source reuses the per-shard steps (fetch, check) of the
    first: that is no resume, and the summary does not call it one."""
    src = sample_factory(8, 2.0)
    for dst in ("a", "b"):
        res = reshard_cli_here(["run", str(src), str(tmp_path / dst), "--target-tp", "2", "--cache-dir",
                                str(tmp_path / "cache")], prefect_env)
        assert res.returncode == 0, res.stderr[-2000:]
        line = res.stdout.splitlines()[0]
        assert line.startswith(f"committed {tmp_path / dst}") and "resumed" not in line, line


def test_dask_runner_gives_the_same_output(sample_factory, tmp_path):
    src = sample_factory(8, 1.0)
    run_flow(_params(src, tmp_path / "threads", tmp_path, target_tp=4))
    run_flow(_params(src, tmp_path / "dask", tmp_path / "c2", target_tp=4, gpu_resource=True), dask_workers=2)
    assert _files(tmp_path / "dask") == _files(tmp_path / "threads")


def test_bad_input_fails_the_flow_with_the_typed_error(sample_factory, tmp_path):
    from reshard.core.errors import LayoutError

    with pytest.raises(LayoutError, match="cannot be divided evenly over 3"):
        run_flow(_params(sample_factory(8, 2.0), tmp_path / "dst", tmp_path, target_tp=3))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("args,expected", [
    (["--target-tp", "3"], "cannot be divided evenly over 3"),
    (["--target-tp", "0"], "--target-tp"),
    (["--target-tp", "2", "--quantize", "--bits", "9"], "--bits"),
], ids=["indivisible", "tp0", "bits9"])
def test_cli_through_prefect_gives_one_line_errors(sample_factory, tmp_path, capsys, args, expected):
    from reshard.cli import main

    code = main(["run", str(sample_factory(8, 2.0)), str(tmp_path / "dst"), *args, "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("reshard: error: ") and expected in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "dst").exists()


def test_gpu_concurrency_limit_is_used_and_a_missing_one_fails_loudly(sample_factory, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError

    name = f"reshard-gpu-{os.getpid()}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    src = sample_factory(8, 2.0)
    out = run_flow(_params(src, tmp_path / "limited", tmp_path, target_tp=4, gpu_concurrency_limit=name))
    assert len(out["files"]) == 5
    assert _convert_tags(out["flow_run_id"], 4) == [["reshard-gpu"]] * 4
    plain = run_flow(_params(src, tmp_path / "plain", tmp_path, target_tp=4))
    assert _convert_tags(plain["flow_run_id"], 4) == [[]] * 4  # no GPU option: no tag, no slot round trip
    # strict=True: a missing limit fails the run (never runs unlimited)
    with pytest.raises(ConcurrencySlotAcquisitionError, match="no-such-limit.*must be created"):
        run_flow(_params(src, tmp_path / "nolimit", tmp_path / "c2", target_tp=4,
                         gpu_concurrency_limit="no-such-limit"))
    assert not (tmp_path / "nolimit" / MANIFEST_NAME).exists()


def _convert_tags(flow_run_id: str, expected: int) -> list[list[str]]:
    return [sorted(r.tags) for r in read_task_runs(flow_run_id, expect={"convert-target": expected})
            if task_name(r) == "convert-target"]


def test_a_target_converts_as_soon_as_its_own_sources_are_ready(sample_factory, tmp_path):
    """8 -> 2 with rank file 7 corrupt: target 0 (sources 0-3) still converts — it does not wait
    for every shard — while target 1 never starts, the cross-rank checks refuse the run, and
    nothing is published at the destination."""
    import shutil

    from reshard.core.errors import CorruptCheckpointError

    src = shutil.copytree(sample_factory(8, 2.0), tmp_path / "src")  # the factory's samples are shared
    bad = src / "mp_rank_07_model_states.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError):
        run_flow(_params(src, tmp_path / "dst", tmp_path, target_tp=2))
    states = task_states(str(flow_runs_to(tmp_path / "dst")[0].id), expect={"check-shard": 8, "convert-target": 1})
    assert states["check-shard"].count("Failed") == 1, states
    assert states["convert-target"].count("Completed") == 1, states
    assert "Completed" not in states.get("upload-target", []), states
    assert not (tmp_path / "dst").exists() or not any((tmp_path / "dst").rglob("*.pt"))


def test_runs_on_the_embedded_server_send_no_heartbeats(tmp_path):
    """The embedded server dies with the process, so a heartbeat tells it nothing; without them a
    run's end does not wait for Prefect's heartbeat thread (up to 1 s). A configured server keeps them."""
    from prefect.settings import get_current_settings

    from reshard.flows.session import embedded_settings

    default = get_current_settings().flows.heartbeat_frequency
    assert default is not None
    with embedded_settings("http://127.0.0.1:9/api", tmp_path):
        assert get_current_settings().flows.heartbeat_frequency is None
    assert get_current_settings().flows.heartbeat_frequency == default
