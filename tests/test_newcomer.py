"""What a newcomer sees: installs and commands that print nothing but reshard's own lines."""

from __future__ import annotations

import importlib.metadata
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
