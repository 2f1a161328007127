"""A ZeRO stage 3 checkpoint saved by DeepSpeed's own engine is recognized and refused with the
explanation and what to do, on every path (plan, inspect, --direct, the flow from local and S3)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import upload_to_s3
from reshard.cli import main
from reshard.core.errors import CheckpointFormatError

pytestmark = pytest.mark.slow  # every test reads a checkpoint DeepSpeed's engine saves (the zero3 fixture)

_SAVE = textwrap.dedent('''
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.nn as nn
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo's all-reduce (tests/zero_engine.py)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    engine.save_checkpoint(sys.argv[1], tag="global_step1")
''')


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zero3")
    env = dict(os.environ, PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    port = str(29100 + os.getpid() % 400)
    proc = subprocess.run([sys.executable, "-c", _SAVE, str(root), port], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = root / "global_step1"
    assert sorted(p.name for p in step.iterdir()) == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    return step


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _assert_zero3_line(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "ZeRO stage 3" in lines[0] and "placeholders" in lines[0] and "zero_to_fp32" in lines[0]


def test_every_command_refuses_it_in_one_line_and_touches_nothing(zero3, tmp_path, capsys):
    before = _digest(zero3)
    for argv in (["plan", str(zero3), "--target-tp", "1"], ["inspect", str(zero3)],
                 ["run", "--direct", str(zero3), str(tmp_path / "out"), "--target-tp", "1"]):
        assert main(argv) == 2
        _assert_zero3_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and _digest(zero3) == before


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_flow_refuses_it_from_local_and_s3(zero3, where, tmp_path, request, monkeypatch):
    request.getfixturevalue("prefect_env")
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    source, so = str(zero3), {}
    if where == "s3":
        source, so = upload_to_s3(zero3, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                                  monkeypatch, prefix="z3")
    with pytest.raises(CheckpointFormatError, match="ZeRO stage 3") as info:
        run_flow(ReshardParams(source=source, destination=str(tmp_path / "out"), target_tp=1, storage_options=so,
                               cache_dir=str(tmp_path / "cache")))
    assert info.value.culprit == source and "zero_to_fp32" in info.value.hint
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
