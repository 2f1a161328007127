"""reshard as a Python library: ``reshard.convert/plan/inspect/verify``, their typed results and
errors (the very lines the CLI prints), an import without side effects, the progress callback, and
the command line that explains itself (``--version``, grouped help, ``--to`` and ``reshard
formats`` read from the registries)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from reshard.cli import main
from reshard.core.options import in_keywords

ROOT = Path(__file__).resolve().parent.parent


def _cli_error(capsys, args: list[str]) -> str:
    """The one line the CLI prints on stderr for ``args`` (exit code 2 asserted)."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_convert_returns_the_committed_record_and_a_rerun_is_up_to_date(sample_factory, tmp_path):
    src, dst = sample_factory(4), tmp_path / "tp2"
    result = reshard.convert(str(src), str(dst), target_tp=2)
    assert isinstance(result, reshard.ConversionResult) and not result.up_to_date
    manifest = json.loads((dst / "reshard_manifest.json").read_text())
    assert result.manifest == manifest and result.conversion_id == manifest["conversion_id"]
    assert [f.model_dump() for f in result.files] == [{k: f[k] for k in ("path", "size", "sha256")}
                                                     for f in manifest["files"]]
    for f in result.files:  # what the record says is what is on disk
        assert (dst / f.path).stat().st_size == f.size and _sha256(dst / f.path) == f.sha256
    assert (result.source_tp, result.target_tp, result.target_format) == (4, 2, "deepspeed")
    assert result.warnings == manifest["warnings"] and any("dropped training state" in w for w in result.warnings)
    again = reshard.convert(str(src), str(dst), target_tp=2)
    assert again.up_to_date and again.files == result.files
    assert reshard.verify(str(dst)).files == result.files


def test_convert_reads_and_writes_s3(sample_factory, tmp_path, s3_server, s3_bucket, monkeypatch):
    from conftest import upload_to_s3

    url, so = upload_to_s3(sample_factory(4), s3_server, s3_bucket, monkeypatch)
    result = reshard.convert(url, f"{s3_bucket}/out", target_tp=2, storage_options=so,
                             cache_dir=str(tmp_path / "cache"))
    local = reshard.convert(str(sample_factory(4)), str(tmp_path / "local"), target_tp=2)
    assert [(f.path, f.size, f.sha256) for f in result.files] == [(f.path, f.size, f.sha256) for f in local.files]
    assert reshard.verify(f"{s3_bucket}/out", storage_options=so).manifest == result.manifest
    planned = reshard.plan(url, target_tp=2, storage_options=so, cache_dir=str(tmp_path / "cache"))
    assert [t["sources"] for t in planned["targets"]] == [[0, 1], [2, 3]]


def test_plan_and_inspect_are_what_the_cli_prints_as_json(sample_factory, capsys):
    src = str(sample_factory(4))
    capsys.readouterr()
    assert main(["plan", src, "--target-tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(reshard.plan(src, target_tp=2)))
    assert main(["inspect", src, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(reshard.inspect(src)))


def _committed(sample_factory, tmp_path) -> Path:
    dst = tmp_path / "committed"
    reshard.convert(str(sample_factory(4)), str(dst), target_tp=2)
    return dst


def _from_line(line: str) -> reshard.LayoutError:
    """The CLI's one error line as the error it was printed from."""
    culprit, rest = line.removeprefix("reshard: error: ").split(": ", 1)
    message, _, fix = rest.partition(" (fix: ")
    return reshard.LayoutError(message, culprit=culprit, hint=fix.removesuffix(")") or None)


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir(exist_ok=True)
    return tmp_path / "empty"


#: (error class, what is wrong) -> the API call and the CLI arguments for the same bad input
ERROR_CASES = {
    "missing source": (reshard.StorageError,
                       lambda s, t: (reshard.convert, (str(t / "nope"), str(t / "o")), {"target_tp": 1},
                                     ["run", "--direct", str(t / "nope"), str(t / "o"), "--target-tp", "1"])),
    "not a checkpoint": (reshard.CheckpointFormatError,
                         lambda s, t: (reshard.inspect, (str(_empty(t)),), {}, ["inspect", str(t / "empty")])),
    "indivisible layout": (reshard.LayoutError,
                           lambda s, t: (reshard.convert, (str(s(4)), str(t / "o")), {"target_tp": 3},
                                         ["run", "--direct", str(s(4)), str(t / "o"), "--target-tp", "3"])),
    "bad option value": (reshard.LayoutError,
                         lambda s, t: (reshard.convert, (str(s(4)), str(t / "o")), {"target_tp": 0},
                                       ["run", "--direct", str(s(4)), str(t / "o"), "--target-tp", "0"])),
    "unknown fact": (reshard.MissingModelFactError,
                     lambda s, t: (reshard.plan, (str(s(2, 2.0, save_args=False)),), {"target_tp": 8},
                                   ["plan", str(s(2, 2.0, save_args=False)), "--target-tp", "8"])),
    "committed destination": (reshard.DestinationError,
                              lambda s, t: (reshard.convert, (str(s(4)), str(_committed(s, t))), {"target_tp": 1},
                                            ["run", "--direct", str(s(4)), str(t / "committed"), "--target-tp", "1"])),
    "unreadable config": (reshard.ConfigError,
                          lambda s, t: (reshard.convert, (str(s(4)), str(t / "o")),
                                        {"target_tp": 2, "target_config": str(t / "ds.json")},
                                        ["run", "--direct", str(s(4)), str(t / "o"), "--target-tp", "2",
                                         "--target-config", str(t / "ds.json")])),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_each_error_class_carries_the_line_the_cli_prints(sample_factory, tmp_path, capsys, case):
    cls, make = ERROR_CASES[case]
    fn, args, kwargs, cli = make(sample_factory, tmp_path)
    with pytest.raises(cls) as caught:
        fn(*args, **kwargs)
    err = caught.value
    assert isinstance(err, reshard.ReshardError) and err.culprit and err.message
    # the same line, but for an option: the CLI names its flag (--target-tp), Python its keyword (target_tp)
    line = _cli_error(capsys, cli)
    assert line == f"reshard: error: {err}" or (case == "bad option value" and "--target-tp" in line
                                                 and str(in_keywords(_from_line(line))) == str(err))
    assert str(err) == err.one_line() and (err.fix is None or f"(fix: {err.fix})" in str(err))
    assert not (tmp_path / "o").exists()


def test_a_tampered_output_and_a_missing_bucket_raise_their_classes(sample_factory, tmp_path, capsys, s3_server):
    dst = _committed(sample_factory, tmp_path)
    with open(dst / "mp_rank_00_model_states.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    with pytest.raises(reshard.ManifestMismatchError) as caught:
        reshard.verify(str(dst))
    assert _cli_error(capsys, ["verify", str(dst)]) == f"reshard: error: {caught.value}"
    so = s3_server.storage_options()
    with pytest.raises(reshard.StorageError) as missing:
        reshard.inspect("s3://no-such-bucket-here/ckpt", storage_options=so)
    assert "no-such-bucket-here" in str(missing.value)


def test_an_unknown_keyword_is_one_error_naming_it(sample_factory, tmp_path):
    with pytest.raises(TypeError, match=r"^convert\(\) got an unexpected keyword argument 'target_pd'"):
        reshard.convert(str(sample_factory(4)), str(tmp_path / "o"), target_pd=2)


def test_the_progress_callback_sees_every_output_to_its_last_byte(sample_factory, tmp_path):
    seen: list[reshard.Progress] = []
    result = reshard.convert(str(sample_factory(4)), str(tmp_path / "o"), target_tp=2, progress=seen.append)
    assert seen and seen[-1].finished and seen[-1].files_done == seen[-1].files == 2
    written = sum(f.size for f in result.files if f.path.endswith(".pt"))
    assert seen[-1].done_bytes == seen[-1].total_bytes == written
    assert all(a.done_bytes <= b.done_bytes for a, b in zip(seen, seen[1:]))
    assert {p.file for p in seen if p.finished} == {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"}


_SNAPSHOT = r"""
import json, logging, os, signal, sys, threading
def state():
    loggers = {n: [type(h).__name__ for h in l.handlers] + [l.level, l.propagate]
               for n, l in logging.Logger.manager.loggerDict.items() if isinstance(l, logging.Logger)}
    root = logging.getLogger()
    sigs = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)}
    return {"root": [type(h).__name__ for h in root.handlers] + [root.level], "loggers": loggers,
            "env": dict(os.environ), "signals": sigs, "threads": sorted(t.name for t in threading.enumerate()),
            "warnings": repr(__import__("warnings").filters[:5])}
before = state()
import reshard
reshard.convert, reshard.plan, reshard.inspect, reshard.verify, reshard.ConversionResult, reshard.ReshardOptions
after = state()
heavy = sorted(m for m in ("torch", "prefect", "fsspec", "numpy") if m in sys.modules)
print(json.dumps({"same": {k: before[k] == after[k] for k in before}, "heavy": heavy,
                  "new_loggers": sorted(set(after["loggers"]) - set(before["loggers"]))}))
"""


def test_importing_reshard_changes_no_process_wide_state():
    """No logging handler or level, environment variable, signal handler, thread or warning
    filter changes on ``import reshard`` and on reaching its API; nothing heavy is imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RESHARD_"))}
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, env=env, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert all(got["same"].values()), got
    assert got["heavy"] == [] and got["new_loggers"] == [], got


# --- the command line ------------------------------------------------------------------------------

def _help(capsys, args: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_version_and_a_plain_description(capsys):
    assert _help(capsys, ["--version"]).strip() == f"reshard {reshard.__version__}"
    top = _help(capsys, ["--help"])
    assert "``" not in top and "Change the parallel layout" in top and "formats" in top


def test_run_help_is_in_groups_with_the_common_flags_first(capsys):
    text = _help(capsys, ["run", "--help"])
    titles = [ln.rstrip(":") for ln in text.splitlines() if re.match(r"^[a-z][a-z ()0-9,'.-]*:$", ln)]
    assert titles[:1] == ["positional arguments"] and titles[2:] == [
        "target layout", "output", "execution", "storage",
        "quantization (int8 per-rank, fp8, mxfp4, w4a16, fp8-channel, nvfp4 or like-source with --to hf)",
        "model facts (only when the checkpoint's saved args lack them)"], titles
    sections = text.split("\n\n")
    layout = next(s for s in sections if s.startswith("target layout:"))
    facts = next(s for s in sections if s.startswith("model facts"))
    assert "--target-tp" in layout and "--num-heads" in facts and "--num-heads" not in layout
    for kind in ("Hugging Face", "torch_dist", "descriptor JSON", "s3://", "gs://", "az://"):
        assert kind in text, kind


def test_to_and_formats_list_what_the_registry_holds_plug_ins_included(capsys, monkeypatch):
    from plugin_format import NAME, SafetensorsPerRank
    from reshard.formats import register_format, registry, unregister_format

    monkeypatch.setenv("COLUMNS", "4000")  # argparse wraps help at hyphens: one line per flag here
    register_format(SafetensorsPerRank)
    try:
        text = " ".join(_help(capsys, ["run", "--help"]).split())
        choices = text.split("one of: ", 1)[1].split(" --")[0].split(", ")
        assert set(choices) == {n for n, f in registry.items() if f.writes} and NAME in choices
        assert "universal" in choices and "hf" in choices and "deepspeed-zero3" not in choices
        capsys.readouterr()
        assert main(["formats"]) == 0
        listed = capsys.readouterr().out
    finally:
        unregister_format(NAME)
    rows = {ln.split()[0]: ln for ln in listed.splitlines() if ln.startswith("  ") and ln.split()}
    assert NAME in rows and "reads/writes" in rows[NAME]
    assert "reads " in rows["deepspeed-zero3"] and "writes" not in rows["deepspeed-zero3"]
    assert rows["universal"].split()[1] == "writes" and "megatron-gpt" in rows
    assert "LlamaForCausalLM" in listed and "Qwen3MoeForCausalLM" in listed


def test_to_a_format_reshard_only_reads_is_one_line(sample_factory, tmp_path, capsys):
    line = _cli_error(capsys, ["run", "--direct", str(sample_factory(4)), str(tmp_path / "o"), "--to",
                               "deepspeed-zero3"])
    assert line.startswith("reshard: error: --to: reshard reads but does not write 'deepspeed-zero3'")


# --- the README's Python blocks -----------------------------------------------------------------------

def test_the_readmes_python_examples_run(tmp_path, monkeypatch, capsys):
    """Every ```python block of the README, in order, in one namespace, in a folder holding the
    sample checkpoint the README tells a reader to make (``reshard sample ckpt/tp8 --tp 8``)."""
    text = _readme_section("Python API")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 2, "the README's Python API section"
    monkeypatch.chdir(tmp_path)
    assert "reshard sample ckpt/tp8 --tp 8" in text
    assert main(["sample", "ckpt/tp8", "--tp", "8"]) == 0
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own examples
    assert (tmp_path / "ckpt" / "tp2" / "reshard_manifest.json").is_file()
    assert (tmp_path / "ckpt" / "hf" / "config.json").is_file()


def _readme_section(title: str) -> str:
    """The README's ``## title`` section, to its next ``##`` heading."""
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_walk_through_runs(tmp_path, monkeypatch, capsys, prefect_env):
    """The walk-through's commands as written (the flow path, on the session's Prefect server), then
    its Python check of the round trip; and what it says of the outputs."""
    import shlex

    text = _readme_section("A walk-through")
    commands = [ln.split("#", 1)[0].strip() for ln in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)[0]
                .splitlines()]
    commands = [c for c in commands if c]
    assert commands and all(c.startswith("reshard ") for c in commands), commands
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", prefect_env["PREFECT_API_URL"])
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, (command, capsys.readouterr().err)
    (check,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    exec(compile(check, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    walked = reshard.inspect("walk/mcore")
    assert walked["tp"] == 2 and walked["ep"] == 2
    assert json.loads((tmp_path / "walk" / "fp8" / "config.json").read_text())["quantization_config"][
        "quant_method"] == "fp8"


# --- the flow as a building block of a user's own flow -------------------------------------------

@pytest.mark.slow
def test_the_post_training_example_runs_reshard_as_a_subflow_on_a_real_server(sample_factory, tmp_path,
                                                                             prefect_env):
    """docs/examples/post_training.py on a real ``prefect server`` (the run's, tests/prefect_server.py):
    the user's flow runs reshard's flow as a subflow (a child run of the parent's), gets the typed
    record, and its evaluation task loads the export in transformers."""
    src = sample_factory(4)
    env = dict(prefect_env, PREFECT_HOME=str(tmp_path / "client-home"), RESHARD_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "post_training.py"), str(src),
                          str(tmp_path / "hf")], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    check = subprocess.run([sys.executable, "-c", _READ_RUN, out["conversion_flow_run"]], capture_output=True,
                           text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    run = json.loads(check.stdout)
    assert run == {"name_of_flow": "reshard", "state": "COMPLETED", "is_subflow": True,
                   "parent_flow": "post-training"}
    assert out["files"] == ["model.safetensors", "config.json"] and out["loss"] > 0
    assert (tmp_path / "hf" / "reshard_manifest.json").is_file()


# A user's script that calls reshard's flow from plain Python (no flow around it, no Prefect
# setting): it must leave its process's environment and Prefect settings as they were.
_DIRECT_CALL = r"""
import json, os, sys
from prefect.settings import PREFECT_API_URL
from reshard.flows.params import ReshardParams
from reshard.flows.reshard_flow import reshard_flow

before = dict(os.environ)
result = reshard_flow(ReshardParams(source=sys.argv[1], destination=sys.argv[2], target_tp=2))
print(json.dumps({"files": len(result.files), "env_kept": dict(os.environ) == before,
                  "api_url": PREFECT_API_URL.value()}))
"""


@pytest.mark.slow
def test_the_flow_from_python_and_the_example_run_quietly_on_reshards_own_prefect(sample_factory, tmp_path):
    """With no Prefect setting (a new user's environment: no PREFECT_*, telemetry not turned
    off), a direct ``reshard_flow(...)`` call and docs/examples/post_training.py run on reshard's
    embedded server as the CLI does: reshard's own database, not ``~/.prefect/prefect.db``; no
    traceback or telemetry noise on stderr (Prefect's temporary server printed ~100 lines of
    "database is locked" and "Failed to send telemetry" tracebacks); the caller's environment
    and settings unchanged."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RESHARD_")) and k != "DO_NOT_TRACK"}
    env["HOME"] = str(home)
    src = sample_factory(4)
    runs = [subprocess.run([sys.executable, "-c", _DIRECT_CALL, str(src), str(tmp_path / "tp2")], env=env,
                           capture_output=True, text=True, timeout=600),
            subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "post_training.py"), str(src),
                            str(tmp_path / "hf")], env=env, capture_output=True, text=True, timeout=600)]
    for res in runs:
        assert res.returncode == 0, res.stderr[-3000:]
        noise = [line for line in res.stderr.splitlines()
                 if re.search(r"Traceback|telemetry|database is locked|ERROR|Error", line)]
        assert not noise, res.stderr[-3000:]
    assert json.loads(runs[0].stdout) == {"files": 3, "env_kept": True, "api_url": None}
    assert json.loads(runs[1].stdout.strip().splitlines()[-1])["files"] == ["model.safetensors", "config.json"]
    assert not (home / ".prefect" / "prefect.db").exists()
    assert (home / ".cache" / "reshard" / "prefect" / "prefect.db").is_file()


_READ_RUN = r"""
import json, sys
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as c:
    run = c.read_flow_run(sys.argv[1])
    parent = c.read_task_run(run.parent_task_run_id) if run.parent_task_run_id else None
    parent_flow = c.read_flow(c.read_flow_run(parent.flow_run_id).flow_id).name if parent else None
    print(json.dumps({"name_of_flow": c.read_flow(run.flow_id).name, "state": run.state.type.value,
                      "is_subflow": parent is not None, "parent_flow": parent_flow}))
"""
