"""Every bad input: one line naming the culprit and the fix, exit code 2, no committed output,
source untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from reshard.cli import main
from reshard.storage.manifest import MANIFEST_NAME


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _edit(folder: Path, rank: int, fn) -> None:
    p = folder / f"mp_rank_{rank:02d}_model_states.pt"
    sd = torch.load(p, weights_only=False)
    fn(sd)
    torch.save(sd, p)


def _run_cli(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def src(sample_factory, tmp_path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(sample_factory(8, 2.0), folder)
    return folder


def _rm(folder, rank):
    (folder / f"mp_rank_{rank:02d}_model_states.pt").unlink()


def _extra(folder, rank):
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / f"mp_rank_{rank:02d}_model_states.pt")


def _truncate(folder, rank):
    p = folder / f"mp_rank_{rank:02d}_model_states.pt"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


CASES = {
    "missing-rank": (lambda f: _rm(f, 3), ["--target-tp", "2"], "missing [3]"),
    "extra-rank": (lambda f: _extra(f, 8), ["--target-tp", "2"], "mp_world_size is 8 but 9"),
    "gap-in-ranks": (lambda f: (_rm(f, 7), _extra(f, 9)), ["--target-tp", "2"], "missing [7, 8]"),
    "duplicate-rank": (lambda f: shutil.copy(f / "mp_rank_01_model_states.pt", f / "mp_rank_1_model_states.pt"),
                       ["--target-tp", "2"], "rank 1 appears in 2 files"),
    "mp-world-size": (lambda f: [_edit(f, r, lambda sd: sd.update(mp_world_size=4)) for r in range(8)],
                      ["--target-tp", "2"], "saved mp_world_size is 4"),
    "both-module-keys": (lambda f: _edit(f, 0, lambda sd: sd.update(model={})), ["--target-tp", "2"],
                         "both 'module' and 'model'"),
    "no-module-key": (lambda f: _edit(f, 0, lambda sd: sd.pop("module")), ["--target-tp", "2"],
                      "neither 'module' nor 'model'"),
    "unknown-version": (lambda f: [_edit(f, r, lambda sd: sd.update(checkpoint_version=5.0)) for r in range(8)],
                        ["--target-tp", "2"], "unknown checkpoint_version 5.0"),
    "bad-version-flag": (lambda f: None, ["--target-tp", "2", "--version", "4"], "unknown checkpoint_version 4.0"),
    "versions-disagree": (lambda f: _edit(f, 2, lambda sd: sd.update(checkpoint_version=1.0)),
                          ["--target-tp", "2"], "disagree on checkpoint_version"),
    "key-missing-on-a-rank": (lambda f: _edit(f, 5, lambda sd: sd["module"].pop(
        "transformer.layers.1.mlp.dense_4h_to_h.bias")), ["--target-tp", "2"], "mp_rank_05"),
    "inconsistent-shapes": (lambda f: _edit(f, 6, lambda sd: sd["module"].__setitem__(
        "transformer.layers.0.mlp.dense_h_to_4h.bias", torch.zeros(7))), ["--target-tp", "2"],
        "transformer.layers.0.mlp.dense_h_to_4h.bias: shape/dtype"),
    "replicated-differs": (lambda f: _edit(f, 4, lambda sd: sd["module"]["transformer.final_layernorm.weight"].add_(1)),
                           ["--target-tp", "2"], "replicated parameter transformer.final_layernorm.weight differs"),
    "unknown-parameter": (lambda f: [_edit(f, r, lambda sd: sd["module"].__setitem__("lm_head.weight", torch.zeros(2)))
                                     for r in range(8)], ["--target-tp", "2"], "lm_head.weight"),
    "indivisible-target": (lambda f: None, ["--target-tp", "3"], "cannot be divided evenly over 3"),
    "indivisible-heads": (lambda f: None, ["--target-tp", "16"], "8 attention heads cannot be divided over 16"),
    "truncated": (lambda f: _truncate(f, 2), ["--target-tp", "2"], "mp_rank_02_model_states.pt"),
    "zero-bytes": (lambda f: (f / "mp_rank_03_model_states.pt").write_bytes(b""), ["--target-tp", "2"],
                   "file is empty"),
    "not-a-zip": (lambda f: (f / "mp_rank_03_model_states.pt").write_text("hello"), ["--target-tp", "2"],
                  "not a torch zip checkpoint"),
    "bad-target-tp": (lambda f: None, ["--target-tp", "0"], "must be a positive integer"),
    "quant-bits": (lambda f: None, ["--target-tp", "2", "--quantize", "--bits", "9"], "does not fit int8"),
}


NO_HINT = {"bad-target-tp"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_cleanly(src, tmp_path, capsys, case):
    mutate, args, expected = CASES[case]
    mutate(src)
    before = _snapshot(src)
    dst = tmp_path / "dst"
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(dst), *args])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), err
    assert "Traceback" not in err
    assert expected in lines[0]
    assert "(fix: " in lines[0] or case in NO_HINT, "errors say how to fix them"
    assert not dst.exists(), "nothing may be written under DST"
    assert _snapshot(src) == before, "the source must never be modified"


def test_split_without_head_count_names_the_flag(sample_factory, tmp_path, capsys):
    src = sample_factory(2, 2.0, save_args=False)
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(tmp_path / "dst"), "--target-tp", "8"])
    assert code == 2 and "--num-heads" in err and not (tmp_path / "dst").exists()
    # with the flag it works, and a merge never needs it
    assert main(["run", "--direct", str(src), str(tmp_path / "dst"), "--target-tp", "8", "--num-heads", "8"]) == 0
    assert main(["run", "--direct", str(src), str(tmp_path / "m"), "--target-tp", "1"]) == 0


def test_wrong_head_count_flag_is_refused(sample_factory, tmp_path, capsys):
    src = sample_factory(2, 2.0, save_args=False)
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(tmp_path / "d"), "--target-tp", "4",
                                  "--num-heads", "6"])
    assert code == 2 and "heads" in err


def test_committed_destination_is_refused_without_overwrite(sample_factory, tmp_path, capsys):
    src = sample_factory(8, 2.0)
    dst = tmp_path / "dst"
    assert main(["run", "--direct", str(src), str(dst), "--target-tp", "2"]) == 0
    before = _snapshot(dst)
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(dst), "--target-tp", "4"])
    assert code == 2 and "already holds a committed checkpoint" in err and "--overwrite" in err
    assert _snapshot(dst) == before
    assert main(["run", "--direct", str(src), str(dst), "--target-tp", "4", "--overwrite"]) == 0
    names = sorted(p.name for p in dst.iterdir())
    ranks = [f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]
    assert names == sorted(ranks + ["ds_checkpoint.json", MANIFEST_NAME])
    assert main(["verify", str(dst)]) == 0


def test_destination_inside_source_is_refused(src, capsys):
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(src / "out"), "--target-tp", "2"])
    assert code == 2 and "inside" in err and not (src / "out").exists()


MARKER_ENV = "RESHARD_TEST_PAYLOAD_MARKER"


class _Payload:
    """Pickles as a call to os.system that would create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload", [_Payload, _EvalPayload], ids=["os.system", "eval"])
def test_pickle_that_would_run_code_is_refused_and_never_runs(src, tmp_path, capsys, payload):
    marker = tmp_path / "pwned"
    _edit(src, 0, lambda sd: sd.update(extra=payload(marker)))
    # prove the payload is live: a plain unsafe load would run it
    torch.load(src / "mp_rank_00_model_states.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    code, err = _run_cli(capsys, ["run", "--direct", str(src), str(tmp_path / "dst"), "--target-tp", "2"])
    assert code == 2 and "refused to unpickle" in err and "mp_rank_00" in err
    assert not marker.exists(), "the payload must never execute"
    assert not (tmp_path / "dst").exists()


def test_descriptor_input_and_its_errors(sample_factory, tmp_path, capsys):
    src = sample_factory(8, 1.0)
    files = [f"mp_rank_{r:02d}_model_states.pt" for r in range(8)]
    desc = tmp_path / "ckpt.json"
    desc.write_text(json.dumps({"type": "Megatron", "checkpoints": files, "version": 1.0,
                                "parallelization": "tp", "mp_size": 8, "base_dir": str(src)}))
    assert main(["run", "--direct", str(desc), str(tmp_path / "ok"), "--target-tp", "2"]) == 0
    bad = {
        "malformed": ("{not json", "malformed descriptor JSON"),
        "traversal": (json.dumps({"type": "Megatron", "checkpoints": ["../x.pt"], "version": 1.0,
                                  "parallelization": "tp", "base_dir": str(src)}), "escapes base_dir"),
        "mp-size": (json.dumps({"type": "Megatron", "checkpoints": files[:4], "version": 1.0,
                                "parallelization": "tp", "mp_size": 8, "base_dir": str(src)}), "mp_size 8 but 4"),
        "type": (json.dumps({"type": "bloom", "checkpoints": files, "version": 1.0}), "not supported"),
    }
    for name, (text, expected) in bad.items():
        desc.write_text(text)
        code, err = _run_cli(capsys, ["run", "--direct", str(desc), str(tmp_path / name), "--target-tp", "2"])
        assert code == 2 and expected in err, (name, err)
        assert not (tmp_path / name).exists()
