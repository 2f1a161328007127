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
