"""What a newcomer sees: installs and commands that print nothing but reshard's own lines."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_numpy_is_a_declared_dependency():
    """torch prints "Failed to initialize NumPy" on every import without numpy; a plain
    ``pip install reshard`` (no test extras, which pull numpy in through DeepSpeed) must have it."""
    requires = importlib.metadata.requires("reshard") or []
    base = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    assert any(r.split(">")[0].split("=")[0].split("<")[0].strip().lower() == "numpy" for r in base), base


def test_building_the_package_prints_no_deprecation_warning(tmp_path):
    """setuptools warns (BuildBackendWarning) for a ``license = {text = ...}`` table."""
    code = ("import warnings; warnings.simplefilter('always');"
            "from setuptools import build_meta;"
            f"build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    noise = [line for line in (res.stdout + res.stderr).splitlines() if "Warning" in line or "deprecat" in line]
    assert noise == []
    metadata = next(tmp_path.glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text()


def test_a_command_prints_no_warning_on_stderr(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="default")
    res = subprocess.run([sys.executable, "-m", "reshard.cli", "sample", str(tmp_path / "s"), "--tp", "2"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stderr == ""


def test_a_healthy_plan_lists_unmatched_rules_only_when_verbose(sample_factory, capsys):
    src = str(sample_factory(8, 2.0))
    assert main(["plan", src, "--target-tp", "2"]) == 0
    assert "matched nothing" not in capsys.readouterr().out
    assert main(["plan", src, "--target-tp", "2", "-v"]) == 0
    assert "rules that matched nothing: final_linear" in capsys.readouterr().out


def _suggested(err: str) -> list[int]:
    import re

    found = re.search(r"choose a target TP among ([\d, ]+)\)", err)
    assert found, err
    return [int(x) for x in found.group(1).split(",")]


@pytest.mark.parametrize("bad", [3, 16, 5])
def test_a_refused_target_tp_names_only_target_tps_that_work(sample_factory, capsys, bad):
    """8 heads and 128 vocabulary rows: the vocabulary alone would allow 16, the heads would not."""
    src = str(sample_factory(8, 2.0))
    assert main(["plan", src, "--target-tp", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    suggested = _suggested(err)
    assert suggested == [1, 2, 4, 8]
    for m in suggested:
        assert main(["plan", src, "--target-tp", str(m)]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_missing_local_source_is_named_as_a_path_before_any_server_starts(tmp_path):
    """A missing local folder is no bucket; and the flow path says so before starting Prefect
    (PREFECT_API_URL points at a closed port: reaching for a server would fail differently)."""
    missing = tmp_path / "nonexistent" / "ckpt"
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api")
    for extra in ([], ["--direct"]):
        res = subprocess.run([sys.executable, "-m", "reshard.cli", "run", str(missing), str(tmp_path / "out"),
                              "--target-tp", "2", *extra], capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 2
        assert res.stderr.splitlines() == [f"reshard: error: {missing}: no such file or folder (fix: check the path)"]
        assert not (tmp_path / "out").exists()


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=600)


def test_an_identical_direct_rerun_is_up_to_date_and_writes_nothing(sample_factory, tmp_path, capsys):
    src, dst = str(sample_factory(8, 2.0)), tmp_path / "dst"
    assert main(["run", "--direct", src, str(dst), "--target-tp", "2"]) == 0
    first = capsys.readouterr().out
    assert first.startswith(f"committed {dst}: TP 8 -> 2, 3 files") and "warning: dropped training state" in first
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    assert main(["run", "--direct", src, str(dst), "--target-tp", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"up to date {dst}: TP 8 -> 2, 3 files") and "nothing written" in out.out
    assert len(out.out.splitlines()) == 1 and out.err == ""  # the conversion's warning was told when it ran
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    assert main(["run", "--direct", src, str(dst), "--target-tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True


def test_the_flows_second_run_is_up_to_date_without_running_the_flow(sample_factory, tmp_path, prefect_env):
    """The flow path's identical re-run is told up to date by the checks made before Prefect is
    reached: no flow run (none is recorded on the server), nothing written, no warning repeated."""
    from prefect.client.orchestration import get_client

    args = ["run", str(sample_factory(4, 2.0)), str(tmp_path / "dst"), "--target-tp", "2",
            "--cache-dir", str(tmp_path / "cache")]
    first = _cli(args, prefect_env)
    assert first.returncode == 0 and first.stdout.startswith("committed"), first.stderr[-2000:]
    assert "warning: dropped training state" in first.stdout
    with get_client(sync_client=True) as client:
        runs = client.count_flow_runs()
    second = _cli(args, prefect_env)
    assert second.returncode == 0, second.stderr[-2000:]
    lines = second.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"up to date {tmp_path / 'dst'}: TP 4 -> 2, 3 files"), lines
    assert "nothing written" in lines[0] and second.stderr == "", second.stderr
    with get_client(sync_client=True) as client:
        assert client.count_flow_runs() == runs


def test_plain_progress_counts_every_output_of_the_plan(tmp_path):
    """Target TP 2 x PP 2 = 4 outputs: the count and the bar run to 4, not to the target TP."""
    from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint

    write_core_sample_checkpoint(tmp_path / "src", tp=2, pp=1,
                                 cfg=CoreGPTConfig(layers=2, hidden=64, heads=8, ffn=128, vocab=100, seq=16))
    res = _cli(["run", "--direct", str(tmp_path / "src"), str(tmp_path / "dst"), "--target-tp", "2",
                "--target-pp", "2"])
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert [line.split()[:2] for line in lines] == [["[#...]", "1/4"], ["[##..]", "2/4"], ["[###.]", "3/4"],
                                                    ["[####]", "4/4"]]
    assert "iter_0000100/mp_rank_01_001/model_optim_rng.pt <- source ranks [1]" in lines[3]


def test_live_display_follows_bytes_of_every_output():
    import io

    from reshard import progress
    from reshard.cli_progress import ProgressDisplay

    stream = io.StringIO()
    with ProgressDisplay(stream, live=True, status="reading the source") as display:
        overall = display._rich.tasks[0]
        assert overall.description == "reading the source" and overall.total is None
        progress.status("starting Prefect's embedded server")  # the flow path, once the input is checked
        assert overall.description == "starting Prefect's embedded server"
        progress.planned([("a.pt", 0, 100), ("b.pt", 1, 300)])
        assert overall.total == 400 and overall.description == "0/2 outputs"
        assert display.live and progress.bytes_reporter("a.pt") is not None
        progress.bytes_reporter("a.pt")(60)
        progress.bytes_reporter("b.pt")(30)
        assert overall.completed == 90
        progress.target_done({"name": "a.pt", "rank": 0, "sources": [0], "size": 110, "seconds": 0.1})
        assert overall.completed == 140 and overall.description == "1/2 outputs"
    assert progress.bytes_reporter("a.pt") is None  # unsubscribed
    assert "#" not in stream.getvalue()  # no plain lines in live mode
