"""What a newcomer sees: installs and commands that print nothing but reshard's own lines."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import flow_runs_to
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
    assert first.startswith(f"committed {dst}: deepspeed -> deepspeed, TP 8 -> 2, 3 files")
    assert "warning: dropped training state" in first
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    assert main(["run", "--direct", src, str(dst), "--target-tp", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"up to date {dst}: deepspeed -> deepspeed, TP 8 -> 2, 3 files")
    assert "nothing written" in out.out
    assert len(out.out.splitlines()) == 1 and out.err == ""  # the conversion's warning was told when it ran
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    assert main(["run", "--direct", src, str(dst), "--target-tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True


def test_the_flows_second_run_is_up_to_date_without_running_the_flow(sample_factory, tmp_path, prefect_env,
                                                                    reshard_cli_here):
    """The flow path's identical re-run is told up to date by the checks made before Prefect is
    reached: no flow run (none is recorded on the server), nothing written, no warning repeated
    (the re-run in a process of its own, as a user's: its whole stderr is what the user sees)."""
    args = ["run", str(sample_factory(4, 2.0)), str(tmp_path / "dst"), "--target-tp", "2",
            "--cache-dir", str(tmp_path / "cache")]
    first = reshard_cli_here(args, prefect_env)
    assert first.returncode == 0 and first.stdout.startswith("committed"), first.stderr[-2000:]
    assert "warning: dropped training state" in first.stdout
    assert len(flow_runs_to(tmp_path / "dst")) == 1
    second = _cli(args, prefect_env)
    assert second.returncode == 0, second.stderr[-2000:]
    lines = second.stdout.splitlines()
    head = f"up to date {tmp_path / 'dst'}: deepspeed -> deepspeed, TP 4 -> 2, 3 files"
    assert len(lines) == 1 and lines[0].startswith(head), lines
    assert "nothing written" in lines[0] and second.stderr == "", second.stderr
    assert len(flow_runs_to(tmp_path / "dst")) == 1  # the first run's only


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


@pytest.mark.slow
def test_a_built_wheel_installs_into_a_fresh_venv_and_converts(tmp_path):
    """What a user outside `make` does (README, "Installing outside make"): build a wheel, install it
    with torch first under the pinned constraints into a new venv, with a new HOME. Every format's
    runtime needs must come with it: the Hugging Face import (safetensors) and the default flow path
    (Prefect, its database migrated on first use) run there, not only `--version`."""
    import torch

    wheels, venv, home = tmp_path / "wheels", tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "RESHARD_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(HOME=str(home), PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip")))

    def sh(*cmd: str | Path, timeout: float = 900) -> str:
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout,
                             cwd=tmp_path)
        assert res.returncode == 0, f"{cmd}: {res.stderr[-3000:]}"
        return res.stdout

    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", ROOT, "-w", wheels)
    wheel = next(wheels.glob("reshard-*.whl"))
    sh(sys.executable, "-m", "venv", venv)
    pip, reshard = venv / "bin" / "pip", venv / "bin" / "reshard"
    # --no-compile: pip's byte-compiling of every installed module (torch's thousands) is pip's work,
    # not what this test proves; the commands below compile what they import, as a first run does.
    sh(pip, "install", "-q", "--no-compile", f"torch=={torch.__version__.split('+')[0]}")
    sh(pip, "install", "-q", "--no-compile", "-c", ROOT / "constraints.txt", f"{wheel}[s3]")
    assert sh(reshard, "--version").strip() == f"reshard {importlib.metadata.version('reshard')}"
    sh(reshard, "sample", "tp4", "--tp", "4")
    sh(reshard, "run", "--direct", "tp4", "hf", "--to", "hf")          # Hugging Face out
    sh(reshard, "run", "--direct", "hf", "back", "--target-tp", "2")   # and in: safetensors read
    assert json.loads(sh(reshard, "inspect", "back", "--json"))["tp"] == 2
    assert sh(reshard, "run", "tp4", "tp2", "--target-tp", "2").startswith("committed")   # the flow, a new HOME
    sh(reshard, "verify", "tp2")


# --- output that goes to a pipe, help, messages ---------------------------------------------------------

@pytest.mark.parametrize("args", [["formats"], ["plan", "{src}", "--target-tp", "2", "--json"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(sample_factory, args):
    """``reshard formats | head -2``: the closed pipe is not a storage failure (exit 75 and "storage
    kept failing", before); the command ends as a Unix tool ended by SIGPIPE, saying nothing."""
    cmd = [sys.executable, "-m", "reshard.cli", *[a.format(src=sample_factory(4)) for a in args]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_a_broken_pipe_that_is_not_stdout_stays_a_storage_error(monkeypatch):
    from reshard import cli

    r, w = os.pipe()
    with os.fdopen(w, "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert not cli.stdout_closed(BrokenPipeError(32, "Broken pipe"))  # an S3 socket's: the reader is there
        os.close(r)
        assert cli.stdout_closed(BrokenPipeError(32, "Broken pipe"))
        assert not cli.stdout_closed(ConnectionResetError())
        monkeypatch.undo()


def test_formats_describes_in_plain_words(capsys):
    """Descriptions for a terminal: no reStructuredText roles or literals (``:data:`X```, before)."""
    from reshard.cli import plain_text

    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out and not re.search(r":[a-z]+:", out), out
    assert plain_text("MLA by :data:`RULES`, else :class:`~reshard.models.megatron_gpt.MegatronGPT` "
                      "(``args``)") == "MLA by RULES, else MegatronGPT (args)"


def test_every_argument_of_every_command_has_help():
    import argparse

    from reshard.cli import build_parser

    missing = [f"{name} {act.option_strings or act.dest}"
               for sub in build_parser()._actions if isinstance(sub, argparse._SubParsersAction)
               for name, parser in sub.choices.items()
               for act in parser._actions if act.dest != "help" and not act.help]
    assert missing == []


def test_the_live_display_counts_bytes_in_the_summaries_units():
    """One convention: MiB as `plan` and the summaries print them (rich's own columns said MB);
    before the plan no ``0/? bytes``."""
    import io

    from reshard import progress
    from reshard.cli_progress import ProgressDisplay

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with ProgressDisplay(stream, live=True, status="reading the source") as display:
        display._rich.refresh()
        before = stream.getvalue()
        progress.planned([("a.pt", 0, 3 * 2**20), ("b.pt", 1, 2**20)])
        progress.bytes_reporter("a.pt")(2**20)
        display._rich.refresh()
    shown = stream.getvalue()
    assert "1.0 MiB / 4.0 MiB" in shown and "1.0 MiB / 3.0 MiB" in shown
    assert not re.search(r"\d (?:[kMG]B|bytes)\b", shown) and "/?" not in before


def test_wrong_paths_say_so_for_every_command(tmp_path, capsys):
    missing = tmp_path / "no" / "such"
    for args in (["inspect", str(missing)], ["plan", str(missing), "--target-tp", "2"], ["verify", str(missing)]):
        assert main(args) == 2
        assert capsys.readouterr().err == f"reshard: error: {missing}: no such file or folder (fix: check the path)\n"


@pytest.mark.parametrize("files, hint", [
    ([], "point at a Megatron-LM run or iteration folder, a DeepSpeed global_stepN folder, a torch_dist folder or "
         "a Hugging Face folder"),
    (["config.json"], "a Hugging Face folder needs its weights beside config.json"),
    (["model-00001-of-00002.safetensors"], "a Hugging Face folder needs its config.json"),
    (["iter_0000010/"], "a Megatron-LM run folder needs latest_checkpointed_iteration.txt, or point at one "
                        "iteration folder (iter_0000010)"),
    (["__0_0.distcp", "common.pt"], "a torch_dist checkpoint needs its .metadata index"),
])
def test_a_folder_no_format_reads_is_told_what_it_lacks(tmp_path, capsys, files, hint):
    """Whatever the folder was meant to be (the advice was DeepSpeed's mp_rank_XX files for all)."""
    for name in files:
        (tmp_path / name).mkdir() if name.endswith("/") else (tmp_path / name).write_bytes(b"{}")
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"reshard: error: {tmp_path}: holds no ") and f"(fix: {hint}" in err
    assert "mp_rank_XX" not in err and len(err.splitlines()) == 1


def test_option_errors_name_the_flag_on_the_command_line_and_the_keyword_in_python(sample_factory, capsys):
    import reshard

    src = str(sample_factory(4))
    assert main(["plan", src, "--target-tp", "0"]) == 2
    assert capsys.readouterr().err == ("reshard: error: --target-tp: 0 must be a positive integer (fix: give "
                                       "--target-tp 1 or more, or leave it out)\n")
    with pytest.raises(reshard.LayoutError) as zero:
        reshard.plan(src, target_tp=0)
    assert str(zero.value) == "target_tp: 0 must be a positive integer (fix: give target_tp 1 or more, or leave it out)"
    with pytest.raises(reshard.LayoutError) as typed:
        reshard.plan(src, target_tp="two")
    assert typed.value.culprit == "target_tp" and typed.value.fix == "give target_tp an integer"
    with pytest.raises(reshard.LayoutError) as both:
        reshard.plan(src, target_tp=2, fp8_block="128x128")
    assert "--" not in str(both.value) and str(both.value).startswith("fp8_block: applies only with quantize fp8")


def test_a_wrong_keyword_or_progress_is_pythons_type_error(sample_factory, tmp_path):
    import reshard

    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'target_pd'; did you mean "
                                        r"'target_tp'\?"):
        reshard.convert(str(sample_factory(4)), str(tmp_path / "o"), target_pd=2)
    with pytest.raises(TypeError, match=r"progress=True .* got 'yes'"):
        reshard.convert(str(sample_factory(4)), str(tmp_path / "o"), target_tp=2, progress="yes")
    assert not (tmp_path / "o").exists()


def test_dir_lists_the_public_api():
    import reshard

    names = dir(reshard)
    assert {"convert", "plan", "inspect", "verify", "Progress", "ConversionResult", "ReshardError"} <= set(names)
    assert not {"Any", "TYPE_CHECKING", "annotations"} & set(names)


def test_plan_names_the_conversion_as_run_does_and_inspect_says_a_drop_once(sample_factory, tmp_path, capsys):
    """`plan`'s first line names both formats and only the degrees that change (it said `PP 1 -> 1`
    and the layout in other words than the run's summary); `inspect`'s `skipped` line is the one
    place it tells what a conversion drops (a warning line said it again)."""
    from reshard.sample import write_mixtral_sample

    src = str(sample_factory(8, 2.0))
    assert main(["plan", src, "--target-tp", "2"]) == 0
    head = f"{src}: deepspeed -> deepspeed, TP 8 -> 2 (checkpoint version 2.0)"
    assert capsys.readouterr().out.splitlines()[0] == head
    hf = str(write_mixtral_sample(tmp_path / "hf"))
    assert main(["plan", hf, "--target-tp", "2", "--target-ep", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{hf}: hf -> megatron, TP 1 -> 2, EP 1 -> 2"
    assert main(["plan", hf, "--to", "hf", "--quantize", "fp8"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{hf}: hf -> hf fp8"
    assert main(["inspect", src]) == 0
    out = capsys.readouterr().out
    assert "skipped      lr_scheduler, optimizer, random_rng_state" in out and "warning:" not in out
