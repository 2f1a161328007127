"""Real-tool outputs built once per test run and shared by pytest-xdist's workers.

Each xdist worker is its own process with its own session fixtures, so a megatron-core or DeepSpeed
checkpoint that tests on both workers read would be written twice. :func:`once` writes it under the
run's own base temp folder (``<basetemp>/shared``; a worker's base temp is ``<basetemp>/popen-gwN``),
behind a file lock: the first worker to ask builds it, the other waits and reads the same files.
Nothing outlives the run (pytest keeps and removes base temps as it always does), so every run is
cold. Tests never write into a shared build: they copy what they change, as they did when the build
was shared by one worker's tests only."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

_ROOT: list[Path] = []


def set_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fix this process's shared folder (conftest's session fixture calls it first): the run's base
    temp under xdist, this process's own without it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    _ROOT[:] = [root]
    return root


def shared_root() -> Path:
    """The run's shared folder (see :func:`set_root`)."""
    if not _ROOT:
        raise RuntimeError("shared_builds.set_root was not called: the conftest session fixture sets it")
    return _ROOT[0]


def once(name: str, build: Callable[[Path], None]) -> Path:
    """``shared_root() / name``, built by ``build(folder)`` the first time any worker of this run
    asks for it. A build that raises leaves no mark, so the next asker builds it again (and fails
    the same way, in its own test)."""
    root = shared_root()
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            build(folder)
            done.touch()
    return folder
