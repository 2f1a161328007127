"""reshard's embedded Prefect server keeps state of its own: a user's ``~/.prefect/prefect.db``,
migrated by whatever other Prefect they run, never stops ``make demo`` or ``reshard run``; a
database the user chose that this Prefect cannot open is one line naming the file and the fix."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent
#: A revision id no Prefect of this install knows (one Prefect 3.9.1 migrates to).
FOREIGN_REVISION = "27d8f4e1a6c9"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def foreign_home(tmp_path_factory) -> Path:
    """A HOME whose ``~/.prefect/prefect.db`` another Prefect version migrated."""
    home = tmp_path_factory.mktemp("home")
    env = _env(home)
    env["PREFECT_HOME"] = str(home / ".prefect")
    subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env, check=True,
                   capture_output=True, timeout=300)
    _set_revision(home / ".prefect" / "prefect.db")
    return home


def _set_revision(path: Path) -> None:
    """Stamp the database with :data:`FOREIGN_REVISION`, as the other Prefect's migration would, and
    close it: Prefect's databases are in WAL mode, and the last connection's close moves the change
    into the file itself (an open one would do it later, in the middle of the test)."""
    db = sqlite3.connect(path)
    try:
        with db:
            db.execute("UPDATE alembic_version SET version_num = ?", (FOREIGN_REVISION,))
    finally:
        db.close()
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RESHARD_", "AWS_"))}
    env.update(HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", DS_ACCELERATOR="cpu",
               DS_BUILD_OPS="0")
    return env


def _revision(home: Path) -> str:
    db = sqlite3.connect(home / ".prefect" / "prefect.db")
    try:
        return db.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    finally:
        db.close()


def test_make_demo_works_beside_another_prefects_database(foreign_home, tmp_path):
    """The README's first command (the installed venv taken as it is: ``-o`` keeps make from
    reinstalling) with the pre-migration it runs: no traceback, the user's database untouched."""
    before = (foreign_home / ".prefect" / "prefect.db").read_bytes()
    mig = subprocess.run([sys.executable, "-m", "reshard.flows.server", "upgrade"], env=_env(foreign_home),
                         capture_output=True, text=True, timeout=300)
    assert mig.returncode == 0 and mig.stdout == "" and mig.stderr == "", mig.stderr
    res = subprocess.run(["make", "-f", str(ROOT / "Makefile"), "-o", f"{VENV}/.installed", f"VENV={VENV}", "demo"],
                         cwd=tmp_path, env=_env(foreign_home), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    assert "up to date demo-output/tp2" in res.stdout and "ok: " in res.stdout
    # the plan's preview and the conversion tell what it drops; the up-to-date re-run does not
    assert res.stdout.count("warning: dropped training state") == 2, res.stdout
    assert (foreign_home / ".cache" / "reshard" / "prefect" / "prefect.db").is_file()  # reshard's own
    assert (foreign_home / ".prefect" / "prefect.db").read_bytes() == before
    assert _revision(foreign_home) == FOREIGN_REVISION


def test_a_chosen_database_another_prefect_migrated_is_one_line(foreign_home, tmp_path):
    """PREFECT_HOME is the user's to choose; when it holds a database of another Prefect version,
    ``reshard run`` and the pre-migration say so in one line naming the file, exit 2, change
    nothing. Without PREFECT_HOME the same HOME converts."""
    from reshard.sample import write_sample_checkpoint

    write_sample_checkpoint(tmp_path / "src", tp=2)
    db = foreign_home / ".prefect" / "prefect.db"
    chosen = dict(_env(foreign_home), PREFECT_HOME=str(db.parent))
    want = (f"reshard: error: {db}: Prefect's database was migrated by another Prefect version (alembic revision "
            f"{FOREIGN_REVISION}, unknown to Prefect ")
    for args in (["-m", "reshard.cli", "run", str(tmp_path / "src"), str(tmp_path / "out"), "--target-tp", "1"],
                 ["-m", "reshard.flows.server", "upgrade"]):
        res = subprocess.run([sys.executable, *args], env=chosen, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr
        assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith(want), res.stderr
        assert "unset PREFECT_HOME" in res.stderr
    assert not (tmp_path / "out").exists() and _revision(foreign_home) == FOREIGN_REVISION
    res = subprocess.run([sys.executable, "-m", "reshard.cli", "run", str(tmp_path / "src"), str(tmp_path / "out"),
                          "--target-tp", "1"], env=_env(foreign_home), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr and "error" not in res.stderr, res.stderr
    assert (tmp_path / "out" / "mp_rank_00_model_states.pt").is_file()


def test_reshards_own_database_left_by_a_newer_prefect_is_named_with_its_fix(tmp_path):
    """reshard's own database, migrated by a newer reshard's Prefect: the fix is to delete it."""
    from reshard.flows import server

    home = tmp_path / "home"
    env = _env(home)
    assert subprocess.run([sys.executable, "-m", "reshard.flows.server", "upgrade"], env=env,
                          capture_output=True, timeout=300).returncode == 0
    own = home / ".cache" / "reshard" / "prefect" / "prefect.db"
    _set_revision(own)
    res = subprocess.run([sys.executable, "-m", "reshard.flows.server", "upgrade"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"reshard: error: {own}: ") and "(fix: delete it" in res.stderr
    assert server.own_database(home / ".cache" / "reshard") == own
    shutil.rmtree(home)


def test_a_new_homes_first_run_says_it_creates_the_database_once(tmp_path):
    """A HOME that never ran ``make install``: the first run's server creates reshard's own
    database, and the run says so in one line (instead of minutes of "0/? bytes"); later runs,
    whose database is migrated, do not."""
    from reshard.sample import write_sample_checkpoint

    write_sample_checkpoint(tmp_path / "src", tp=2)
    home = tmp_path / "home"
    env = _env(home)
    own = home / ".cache" / "reshard" / "prefect" / "prefect.db"
    said = []
    for out in ("a", "b"):
        res = subprocess.run([sys.executable, "-m", "reshard.cli", "run", str(tmp_path / "src"), str(tmp_path / out),
                              "--target-tp", "1"], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        said.append([line for line in res.stderr.splitlines() if "database" in line])
    assert said == [[f"reshard: first run: creating Prefect's database {own} (once; this takes a while)"], []]
    assert own.is_file() and not (home / ".prefect" / "prefect.db").exists()
