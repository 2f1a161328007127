"""``--to universal``: DeepSpeed universal checkpoints written from ZeRO stage 1, 2 and 3 checkpoints saved
by DeepSpeed's own engine (``tests/zero_engine.py``), equal file by file to DeepSpeed's
``ds_to_universal.py``; an engine started with ``checkpoint.load_universal`` at another data-parallel
size (and at TP 1 from a TP 2 source) resumes from reshard's output exactly as from DeepSpeed's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ZERO_TAG, run_zero_engine
from reshard.cli import main
from shared_builds import once

#: (ZeRO stage, dtype, data-parallel ranks[, TP]): fp32, bf16 with unequal partitions (DP 3),
#: ZeRO-1, DeepSpeed's BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation: files that name
#: no ZeRO stage), and TP 2 x DP 2 (merged by the rule table; ds_to_universal by the source's patterns).
BF16_OPTIMIZER = (1, "bf16-fp32acc", 2)
CONFIGS = [(2, "fp32", 2), (2, "bf16", 3), (1, "bf16", 2), BF16_OPTIMIZER, (2, "bf16", 2, 2)]


def _ds_to_universal(step: Path) -> Path:
    """DeepSpeed's converter, as its users run it (the output folder is the new tag's), once per
    source checkpoint per test run: several tests compare with, or resume from, the same output,
    and none writes into it (shared_builds)."""

    def convert(out: Path) -> None:
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step),
               "--output_folder", str(out / ZERO_TAG), "--num_extract_workers", "1", "--num_merge_workers", "1"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    return once(f"ds-to-universal-{step.parent.name}", convert)


def _same(got: Any, want: Any, where: str) -> None:
    """Equal as loaded: tensors in dtype, shape and every bit; dicts in key order; objects field by field."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif hasattr(want, "__dict__") and not isinstance(want, type):
        assert type(got).__qualname__ == type(want).__qualname__, where
        _same(vars(got), vars(want), where)
    else:
        assert got == want, (where, got, want)


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_universal_equals_ds_to_universal(zero_checkpoint, config, tmp_path):
    step = zero_checkpoint(*config)
    assert main(["run", "--direct", str(step), str(tmp_path / "got"), "--to", "universal"]) == 0
    got, want = tmp_path / "got", _ds_to_universal(step)
    zero = {f for f in _files(want) if f.startswith(f"{ZERO_TAG}/zero/")}
    assert {f for f in _files(got) if f.startswith(f"{ZERO_TAG}/zero/")} == zero
    for f in sorted(zero):  # the master weights, both moments, the step, the optimizer's settings
        _same(torch.load(got / f, weights_only=False), torch.load(want / f, weights_only=False), f)
    assert (got / "latest_universal").read_text() == (want / "latest_universal").read_text() == ZERO_TAG
    names = {f.rsplit("/", 1)[1] for f in zero}
    assert names == {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt", "optimizer_state.pt"}
    frozen = f"{ZERO_TAG}/zero/position_embeddings.weight"  # fp32.pt only, as DeepSpeed writes it
    assert {f for f in zero if f.startswith(frozen + "/")} == {frozen + "/fp32.pt"}
    # the cut DeepSpeed's loader uses per rule (what a wrong table would get wrong)
    dense = torch.load(got / f"{ZERO_TAG}/zero/transformer.layers.0.attention.dense.weight/fp32.pt")
    qkv = torch.load(got / f"{ZERO_TAG}/zero/transformer.layers.0.attention.query_key_value.weight/exp_avg.pt")
    norm = torch.load(got / f"{ZERO_TAG}/zero/transformer.layers.0.input_layernorm.weight/exp_avg_sq.pt")
    assert (dense["cat_dim"], qkv["cat_dim"], "cat_dim" in norm) == (1, 0, False)
    # the model states at TP 1: the engine's metadata and LR scheduler kept for the resume
    ms = torch.load(got / ZERO_TAG / "mp_rank_00_model_states.pt", weights_only=False)
    src = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)
    assert ms["mp_world_size"] == 1 and "lr_scheduler" in ms and "param_shapes" not in ms
    assert all(ms[k] == src[k] for k in ("global_steps", "dp_world_size", "ds_version", "checkpoint_version"))


#: ZeRO stage 3 (TP 1): fp32 at DP 2, bf16 at DP 3 (parameters not divisible by 3: padded shares),
#: and with the 16-bit weights gathered for save_16bit_model (the model states stay placeholders).
ZERO3_CONFIGS = [(3, "fp32", 2), (3, "bf16", 3), (3, "bf16-gather", 2)]


@pytest.mark.parametrize("config", ZERO3_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_zero3_universal_equals_ds_to_universal(zero_checkpoint, config, tmp_path):
    """ZeRO-3: the files DeepSpeed's ds_to_universal writes for stage 3, equal as loaded (flat whole
    tensors of the trained parameters, no step files, rank 0's optimizer state with the groups, the
    model-states files carried), and no others."""
    step = zero_checkpoint(*config)
    assert main(["run", "--direct", str(step), str(tmp_path / "got"), "--to", "universal"]) == 0
    got, want = tmp_path / "got", _ds_to_universal(step)
    files = _files(want)
    assert _files(got) - {"reshard_manifest.json"} == files
    for f in sorted(files - {"latest_universal"}):
        _same(torch.load(got / f, weights_only=False), torch.load(want / f, weights_only=False), f)
    assert (got / "latest_universal").read_text() == ZERO_TAG
    zero = got / ZERO_TAG / "zero"
    assert not (zero / "position_embeddings.weight").exists()  # frozen: DeepSpeed's ZeRO-3 output has none
    qkv = torch.load(zero / "transformer.layers.0.attention.query_key_value.weight" / "fp32.pt")
    assert qkv.shape == (3 * 64 * 64,) and not list(zero.glob("*/step.pt"))


def _resumed(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("config, resume_dp", [((2, "fp32", 2), 3), ((2, "bf16", 2, 2), 1), ((3, "fp32", 2), 3),
                                               ((3, "bf16", 3), 2)],
                         ids=["dp2-to-dp3", "tp2dp2-to-tp1dp1", "zero3-dp2-to-dp3", "zero3-dp3-to-dp2"])
def test_an_engine_resumes_from_it_as_from_deepspeeds_own(zero_checkpoint, config, resume_dp, tmp_path):
    """DeepSpeed's engine (``checkpoint.load_universal``) at another DP size, at TP 1 from a TP 2
    source, and under ZeRO-3, loads reshard's output to the same fp32 weights, Adam moments, step and
    group settings as DeepSpeed's own output."""
    stage, dtype = config[0], config[1]
    step = zero_checkpoint(*config)
    assert main(["run", "--direct", str(step), str(tmp_path / "got"), "--to", "universal"]) == 0
    want_dir = _ds_to_universal(step)
    got = _resumed(run_zero_engine(tmp_path / "got.pt", stage, dtype, resume_dp, 1, resume=tmp_path / "got"))
    want = _resumed(run_zero_engine(tmp_path / "want.pt", stage, dtype, resume_dp, 1, resume=want_dir))
    _same(got, want, "resumed")
    # from the checkpoint (the engine says 0.5); DeepSpeed's ZeRO-3 loader gives every group group 0's
    decay = [0.1, 0.1] if stage == 3 else [0.1, 0.0]
    assert [g["weight_decay"] for g in got["groups"]] == decay
    assert [float(s) for s in got["steps"]] == [2.0, 2.0]
    params = got["params"]
    assert all(not torch.equal(p["exp_avg"], p["exp_avg_sq"]) for p in params.values())
    if len(config) == 3:  # TP 1: the weights are the source's master weights
        _master_weights_of(step, params)


def _master_weights_of(step: Path, params: dict[str, Any]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref = get_fp32_state_dict_from_zero_checkpoint(str(step.parent), tag=step.name)
    assert all(torch.equal(params[k]["fp32"], ref[k]) for k in params)


def test_bf16_optimizer_master_weights_equal_ds_to_universal(zero_checkpoint, tmp_path):
    """BF16_Optimizer files (no ``zero_stage``; ``zero_to_fp32`` refuses them): ``--weights master``
    equals the fp32.pt files of DeepSpeed's ``ds_to_universal``, the module copy differs."""
    step = zero_checkpoint(*BF16_OPTIMIZER)
    assert main(["run", "--direct", str(step), str(tmp_path / "m"), "--target-tp", "1", "--weights", "master"]) == 0
    got = torch.load(tmp_path / "m" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    bf16 = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    want = _ds_to_universal(step) / ZERO_TAG / "zero"
    assert list(got) == list(bf16)
    for key, value in got.items():
        assert torch.equal(value, torch.load(want / key / "fp32.pt")["param"]), key
    assert any(not torch.equal(got[k], bf16[k].float()) for k in got)


def test_bf16_optimizer_inspected_and_universal_files_planned_in_fp32(zero_checkpoint, capsys):
    from reshard.core.options import ReshardOptions
    from reshard.execution.planner import build_plan

    step = zero_checkpoint(*BF16_OPTIMIZER)
    capsys.readouterr()
    assert main(["inspect", str(step)]) == 0
    assert "optimizer    BF16_Optimizer, 2 data-parallel ranks" in capsys.readouterr().out
    plan = build_plan(str(step), ReshardOptions(to="universal"))
    sizes = {t.name.split("/zero/")[-1]: t.bytes_written for t in plan.targets}
    emb = plan.params[0]
    assert emb.key == "word_embeddings.weight" and emb.dtype == torch.bfloat16
    n = emb.shape[0] * emb.shape[1]
    assert sizes["word_embeddings.weight/exp_avg.pt"] == sizes["word_embeddings.weight/fp32.pt"] == 4 * n


def test_optimizer_files_are_read_once_per_conversion(zero_checkpoint, tmp_path):
    from reshard.core import zero_master

    step = zero_checkpoint(2, "bf16", 3)
    f = next(step.glob("*optim_states.pt"))
    assert zero_master.optimizer_state(f) is zero_master.optimizer_state(f)  # kept
    assert zero_master.kept_optimizer_files() >= 1
    zero_master.forget_optimizer_files()
    assert main(["run", "--direct", str(step), str(tmp_path / "u"), "--to", "universal"]) == 0
    assert zero_master.kept_optimizer_files() == 0  # dropped when the run ended


def test_a_tied_alias_has_no_moments_of_its_own(zero_checkpoint, tmp_path):
    """``shared_params``: the output layer is the word embeddings' Parameter. Its master weight is the
    owner's; Adam's moments are the owner's only (ds_to_universal writes none for the alias)."""
    step = zero_checkpoint(2, "bf16-tied", 2)
    for weights in ("master", "exp_avg"):
        assert main(["run", "--direct", str(step), str(tmp_path / weights), "--target-tp", "1",
                     "--weights", weights]) == 0
    master = torch.load(tmp_path / "master" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    moment = torch.load(tmp_path / "exp_avg" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert torch.equal(master["output_layer.weight"], master["word_embeddings.weight"])
    assert "word_embeddings.weight" in moment and "output_layer.weight" not in moment
    assert main(["run", "--direct", str(step), str(tmp_path / "u"), "--to", "universal"]) == 0
    assert sorted(p.name for p in (tmp_path / "u" / ZERO_TAG / "zero" / "output_layer.weight").iterdir()) == \
        ["fp32.pt"]


def test_every_optimizer_state_is_a_weights_choice():
    from reshard.core.options import WEIGHTS
    from reshard.core.zero_master import STATES

    assert set(WEIGHTS) == {"module", *STATES}


def test_adam_moments_as_module_weights(zero_checkpoint, tmp_path):
    """``--weights exp_avg``: the first moment written as the module (per TP rank), equal to the
    universal checkpoint's; frozen parameters have none and are left out."""
    step = zero_checkpoint(2, "bf16", 3)
    assert main(["run", "--direct", str(step), str(tmp_path / "m"), "--target-tp", "1", "--weights", "exp_avg"]) == 0
    assert main(["run", "--direct", str(step), str(tmp_path / "u"), "--to", "universal"]) == 0
    module = torch.load(tmp_path / "m" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert "position_embeddings.weight" not in module and len(module) == 27
    for key, value in module.items():
        ref = torch.load(tmp_path / "u" / ZERO_TAG / "zero" / key / "exp_avg.pt")["param"]
        assert torch.equal(value, ref), key


def _refused(capsys, src: Path, out: Path, needle: str, *extra: str) -> None:
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert main(["run", "--direct", str(src), str(out), "--to", "universal", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_what_cannot_be_written_as_universal_is_refused_in_one_line(zero_checkpoint, sample_factory, tmp_path, capsys):
    good = zero_checkpoint(2, "bf16", 3)
    autotp = shutil.copytree(zero_checkpoint(3, "bf16", 3), tmp_path / "autotp")
    for f in list(autotp.glob("*mp_rank_00_*.pt")):  # a second TP rank's files (an AutoTP run's grid)
        shutil.copy(f, f.with_name(f.name.replace("mp_rank_00", "mp_rank_01")))
    _refused(capsys, autotp, tmp_path / "o1", "DeepSpeed AutoTP")
    _refused(capsys, good, tmp_path / "o2", "drop --weights", "--weights", "master")
    _refused(capsys, sample_factory(2), tmp_path / "o3", "no ZeRO optimizer files")
    bad = shutil.copytree(good, tmp_path / "missing")
    (bad / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(capsys, bad, tmp_path / "o4", "missing [1]")
    _refused(capsys, good, tmp_path / "o5", "drop --target-tp", "--target-tp", "2")
    _refused(capsys, good, tmp_path / "o6", "drop --quantize", "--quantize")
    _refused(capsys, good, tmp_path / "o7", "cut wrongly", "--version", "0")


@pytest.mark.parametrize("config", [(2, "bf16", 2, 2), (3, "bf16", 3)], ids=["zero2-tp2", "zero3"])
def test_the_flow_writes_it_from_s3(zero_checkpoint, config, tmp_path, request, monkeypatch):
    """The Prefect flow from object storage: the optimizer files are fetched (only) because the output
    needs them, and the result equals ``--direct``'s file for file."""
    request.getfixturevalue("prefect_env")
    from conftest import upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.discovery import discover
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    step = zero_checkpoint(*config)
    source, so = upload_to_s3(step, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                              monkeypatch, prefix=f"uc{config[0]}")
    listed = {o.name for o in discover(source, so, ReshardOptions(to="universal")).objects}
    assert listed == {p.name for p in step.iterdir()}  # model states and optimizer files
    run_flow(ReshardParams(source=source, destination=str(tmp_path / "flow"), to="universal", storage_options=so,
                           cache_dir=str(tmp_path / "cache")))
    assert main(["run", "--direct", str(step), str(tmp_path / "direct"), "--to", "universal"]) == 0
    files = _files(tmp_path / "direct") - {"reshard_manifest.json"}
    assert _files(tmp_path / "flow") - {"reshard_manifest.json"} == files
    for f in sorted(files):
        assert (tmp_path / "flow" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f
