"""Every input format through the Prefect flow, from a local folder and from S3: the same bytes
as ``--direct`` on the local files, and every fetched shard checked for its role in its format."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import output_bytes, task_states, upload_to_s3
from reshard.core.errors import CheckpointFormatError, CorruptCheckpointError
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions
from reshard.flows.params import ReshardParams
from reshard.flows.runner import run_flow
from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint
from reshard.storage.manifest import MANIFEST_NAME
from test_deepspeed_pipeline import write_pipeline

pytestmark = pytest.mark.usefixtures("prefect_env")

CORE = CoreGPTConfig(layers=2, hidden=64, heads=8, ffn=128, vocab=100, divisible_by=8, seq=16)


def _deepspeed(root: Path, sample_factory) -> tuple[Path, dict]:
    return Path(shutil.copytree(sample_factory(4, 2.0), root / "ds")), {"target_tp": 2}


def _descriptor(root: Path, sample_factory) -> tuple[Path, dict]:
    folder = Path(shutil.copytree(sample_factory(4, 2.0), root / "desc"))
    names = sorted(p.name for p in folder.glob("mp_rank_*_model_states.pt"))
    desc = {"type": "Megatron", "version": 2.0, "checkpoints": names, "parallelization": "tp", "mp_size": 4}
    (folder / "ckpt.json").write_text(json.dumps(desc))
    return folder / "ckpt.json", {"target_tp": 2}


def _megatron(root: Path, _sample_factory) -> tuple[Path, dict]:
    """A Megatron-LM run folder with pipeline stages, of the interleaved schedule (``model0``/``model1``
    per rank file) in and out: TP 2 x PP 2 x VPP 2 -> TP 1, the PP and its virtual stages kept."""
    write_core_sample_checkpoint(root / "plain", tp=1, cfg=replace(CORE, layers=4))
    run_direct(str(root / "plain"), str(root / "vpp"), ReshardOptions(target_tp=2, target_pp=2, target_vpp=2))
    return root / "vpp", {"target_tp": 1}


def _pipeline(root: Path, _sample_factory) -> tuple[Path, dict]:
    return write_pipeline(root / "pipe", tp=2, pp=2), {"target_tp": 1, "target_pp": 1}


FORMATS = {"deepspeed": _deepspeed, "descriptor": _descriptor, "megatron": _megatron, "pipeline": _pipeline}


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_through_the_flow_equals_direct(fmt, where, sample_factory, tmp_path, request, monkeypatch):
    src, opts = FORMATS[fmt](tmp_path, sample_factory)
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(**opts))
    source, so = str(src), {}
    if where == "s3":
        source, so = upload_to_s3(src, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                            monkeypatch)
    out = run_flow(ReshardParams(source=source, destination=str(tmp_path / "flow"), storage_options=so,
                                 cache_dir=str(tmp_path / "cache"), **opts))
    assert output_bytes(tmp_path / "flow") == output_bytes(tmp_path / "direct")
    if fmt == "megatron":
        first = torch.load(tmp_path / "flow" / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt",
                           weights_only=False)
        assert "model0" in first and "model1" in first and first["args"].virtual_pipeline_model_parallel_size == 2
    states = task_states(out["flow_run_id"], expect={"check-shard": 1})  # task runs reach the server late
    assert set(states["check-shard"]) == {"Completed"}


def _corrupt_layer_file(src: Path) -> str:
    name = "layer_02-model_01-model_states.pt"
    f = src / name
    sd = torch.load(f, weights_only=True)
    sd["bogus"] = "not a tensor"
    torch.save(sd, f)
    return name


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_bad_shard_is_caught_by_its_own_check_wherever_it_lives(where, tmp_path, request, monkeypatch):
    """The check is the format's, decided by the file's name in the listing: remote shards (cached
    under names without ``.pt``) are checked too, and the error names the user's URL."""
    src, opts = _pipeline(tmp_path, None)
    name = _corrupt_layer_file(src)
    source, so = str(src), {}
    if where == "s3":
        source, so = upload_to_s3(src, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                            monkeypatch)
    with pytest.raises(CheckpointFormatError, match="'bogus' is not a tensor") as info:
        run_flow(ReshardParams(source=source, destination=str(tmp_path / "out"), storage_options=so,
                               cache_dir=str(tmp_path / "cache"), **opts))
    assert info.value.culprit.endswith(name) and info.value.culprit.startswith(source)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_a_truncated_remote_rank_file_is_refused_by_the_shard_check(sample_factory, tmp_path, s3_server, s3_bucket,
                                                                     monkeypatch):
    src, opts = _deepspeed(tmp_path, sample_factory)
    f = src / "mp_rank_03_model_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    source, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch)
    with pytest.raises(CorruptCheckpointError) as info:
        run_flow(ReshardParams(source=source, destination=str(tmp_path / "out"), storage_options=so,
                               cache_dir=str(tmp_path / "cache"), **opts))
    assert info.value.culprit == f"{source}/mp_rank_03_model_states.pt"
