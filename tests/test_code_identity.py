"""The code identity (``reshard.tasks.identity.code_version``) covers every module that decides output
bytes: a change to a format's writer, a model family's name table or the planner — not only to
``reshard/core`` — changes the conversion id, so a resumed flow never reuses outputs written by
other code and ``--direct`` never calls them up to date. So does a change to a plugin's module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import reshard

PACKAGE = Path(reshard.__file__).resolve().parent

_PRINT = """
import sys
sys.path.insert(0, {plugins!r})
from reshard.tasks.identity import code_version, conversion_id
if {plugin!r}:
    from reshard.formats import register_format
    from plugin_format import SafetensorsPerRank
    register_format(SafetensorsPerRank)
print(code_version(), conversion_id([{{"name": "a.pt", "size": 1, "etag": "e"}}], {{"target_tp": 2}}))
"""


def _identity(root: Path, plugin: bool = False) -> tuple[str, str]:
    """``(code_version, a conversion id)`` as a fresh process computes them with the package at
    ``root/reshard`` (and, with ``plugin``, the tests' plugin format from ``root/plugins``)."""
    code = _PRINT.format(plugins=str(root / "plugins"), plugin=plugin)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    version, cid = out.stdout.split()
    return version, cid


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the reshard package (and the plugin module) that a test may edit."""
    shutil.copytree(PACKAGE, tmp_path / "reshard", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "plugins").mkdir()
    shutil.copy(Path(__file__).parent / "plugin_format.py", tmp_path / "plugins" / "plugin_format.py")
    return tmp_path


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# a change that decides nothing: still another version of the code\n")


@pytest.mark.parametrize("module", ["formats/hf.py", "models/hf_architectures.py", "formats/torch_dist.py",
                                    "execution/planner.py", "conversion.py"])
def test_a_change_to_any_module_that_decides_bytes_changes_the_conversion_id(copy, module):
    before = _identity(copy)
    assert _identity(copy) == before  # deterministic
    _edit(copy / "reshard" / module)
    after = _identity(copy)
    assert after[0] != before[0] and after[1] != before[1], module


def test_a_change_to_a_plugins_module_changes_it_too(copy):
    plain, before = _identity(copy), _identity(copy, plugin=True)
    assert before != plain  # the registered plugin is part of the code
    _edit(copy / "plugins" / "plugin_format.py")
    assert _identity(copy, plugin=True) != before
