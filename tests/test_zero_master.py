"""``--weights master``: the fp32 master weights of ZeRO stage 1/2 checkpoints saved by DeepSpeed's
own engine (CPU, gloo, one process per data-parallel rank; see ``tests/zero_engine.py``), equal key
for key to DeepSpeed's ``zero_to_fp32``; bad optimizer files refused in one line, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ZERO_TAG as TAG
from conftest import upload_to_s3
from reshard.cli import main
from reshard.core.options import ReshardOptions
from reshard.core.safe_load import load_shard

#: (ZeRO stage, dtype, data-parallel ranks): fp32 with 2 ranks, bf16 with 3 (a parameter straddles
#: partitions of unequal length), ZeRO-1 under bf16, ZeRO-3 (each parameter partitioned, the
#: module files placeholders) under bf16 and fp32, and with 16-bit gathering on (which only
#: save_16bit_model uses: the checkpoint's module files are still placeholders); ZeRO-2 with
#: round-robin gradients (each group's parameters reordered over the ranks); an output layer tied
#: to the word embeddings (one Parameter, two names: ``shared_params``).
CONFIGS = [(2, "fp32", 2), (2, "bf16", 3), (1, "bf16", 2), (3, "bf16", 2), (3, "fp32", 3), (3, "bf16-gather", 2),
           (2, "bf16-roundrobin", 3), (2, "bf16-tied", 2)]


#: ZeRO 2 and 3, bf16, TP 2 x DP 2: master weights of tensor-parallel sources (zero_to_fp32 reads TP 1 only).
TP2 = [(2, "bf16", 2, 2), (3, "bf16", 2, 2)]


@pytest.fixture(scope="module")
def zero_ckpts(zero_checkpoint) -> dict[tuple, Path]:
    """Each configuration saved once (for the session: the universal checkpoint tests share them)."""
    return {c: zero_checkpoint(*c) for c in (*CONFIGS, *TP2)}


def _zero_to_fp32(step: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(step.parent), tag=step.name)


def _module(folder: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    f = folder / f"mp_rank_{rank:02d}_model_states.pt"
    if not f.exists():  # a ZeRO-3 engine folder: data-parallel rank 0's model states
        f = folder / f"zero_pp_rank_0_mp_rank_{rank:02d}_model_states.pt"
    return load_shard(f, mmap=False)["module"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"zero{c[0]}-{c[1]}-dp{c[2]}")
def test_master_weights_equal_zero_to_fp32(zero_ckpts, config, tmp_path, capsys):
    step = zero_ckpts[config]
    assert main(["run", "--direct", str(step), str(tmp_path / "out"), "--target-tp", "1", "--weights", "master"]) == 0
    got, ref, module = _module(tmp_path / "out"), _zero_to_fp32(step), _module(step)
    assert list(got) == list(module)  # the module's order, every entry
    assert {v.dtype for v in got.values()} == {torch.float32}
    for key, value in ref.items():  # (zero_to_fp32 keeps a frozen ZeRO-3 parameter in its 16-bit dtype)
        assert torch.equal(got[key], value.float()), key
    for key in set(module) - set(ref):  # frozen, and zero_to_fp32 lists none: the module copy, upcast
        assert torch.equal(got[key], module[key].float()), key
    if config[0] == 3:  # placeholders: without --weights master, refused
        assert main(["run", "--direct", str(step), str(tmp_path / "plain"), "--target-tp", "1"]) == 2
        assert "--weights master" in capsys.readouterr().err
        return
    if config[1].startswith("bf16"):  # the 16-bit copy is not the master: a test that read it would fail
        assert any(not torch.equal(module[k].float(), ref[k]) for k in ref)
    capsys.readouterr()
    assert main(["inspect", str(step), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["optimizer"]
    assert (rec["zero_stage"], rec["dp"], rec["groups"], rec["master_dtype"], rec["step"]) == (
        config[0], config[2], 2, "float32", 2)
    # and the default stays the module's own weights
    assert main(["run", "--direct", str(step), str(tmp_path / "plain"), "--target-tp", "1"]) == 0
    assert all(torch.equal(a, b) for a, b in zip(_module(tmp_path / "plain").values(), module.values()))


def test_master_weights_at_another_tp_merge_back_to_zero_to_fp32(zero_ckpts, tmp_path):
    step = zero_ckpts[(2, "bf16", 3)]
    assert main(["run", "--direct", str(step), str(tmp_path / "tp2"), "--target-tp", "2", "--num-heads", "8",
                 "--weights", "master"]) == 0
    assert {v.dtype for v in _module(tmp_path / "tp2", 1).values()} == {torch.float32}
    assert main(["run", "--direct", str(tmp_path / "tp2"), str(tmp_path / "tp1"), "--target-tp", "1"]) == 0
    got, ref = _module(tmp_path / "tp1"), _zero_to_fp32(step)
    assert all(torch.equal(got[k], v.float()) for k, v in ref.items())


@pytest.mark.parametrize("config", TP2, ids=["zero2", "zero3"])
def test_master_weights_of_a_tensor_parallel_source(zero_ckpts, config, tmp_path):
    """TP 2 x DP 2 -> TP 1 equals zero_to_fp32 run on each TP rank's own files (renamed to rank 0, the
    only one it reads), the per-rank results merged by the (separately proven) module-weights path."""
    step = zero_ckpts[config]
    assert main(["run", "--direct", str(step), str(tmp_path / "got"), "--target-tp", "1", "--num-heads", "8",
                 "--weights", "master"]) == 0
    ref = tmp_path / "ref_tp2"
    ref.mkdir()
    per_rank = []
    for t in range(2):
        one = tmp_path / f"rank{t}" / TAG
        one.mkdir(parents=True)
        for f in step.iterdir():  # this TP rank's files, as the TP 1 checkpoint zero_to_fp32 reads
            if f"mp_rank_{t:02d}" in f.name:
                shutil.copy(f, one / f.name.replace(f"mp_rank_{t:02d}", "mp_rank_00"))
        fp32 = _zero_to_fp32(one)
        model_states = next(f for f in sorted(step.iterdir()) if f"mp_rank_{t:02d}_model_states" in f.name)
        sd = torch.load(model_states, weights_only=False)
        assert set(sd["module"]) == set(fp32)
        sd["module"] = {k: fp32[k].float() for k in sd["module"]}
        sd.pop("ds_config")  # a plain per-rank checkpoint of whole weights
        torch.save(sd, ref / f"mp_rank_{t:02d}_model_states.pt")
        per_rank.append(sd["module"])
    assert main(["run", "--direct", str(ref), str(tmp_path / "want"), "--target-tp", "1", "--num-heads", "8"]) == 0
    got, want = _module(tmp_path / "got"), _module(tmp_path / "want")
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(per_rank[0][k], per_rank[1][k]) for k in per_rank[0]
               if per_rank[0][k].shape == per_rank[1][k].shape)  # the TP ranks differ: a swap would show


def _refused(capsys, src: Path, out: Path, *needles: str, extra: tuple[str, ...] = ()) -> None:
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert main(["run", "--direct", str(src), str(out), "--target-tp", "1", "--weights", "master", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(n in err[0] for n in needles), err
    assert not out.exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_bad_optimizer_files_are_refused_in_one_line(zero_ckpts, tmp_path, capsys):
    good = zero_ckpts[(2, "bf16", 3)]
    optim = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"

    bad = shutil.copytree(good, tmp_path / "missing")
    (bad / optim.format(1)).unlink()
    _refused(capsys, bad, tmp_path / "o1", "data-parallel ranks [0, 2]", "missing [1]")

    bad = shutil.copytree(good, tmp_path / "none")
    for f in bad.glob("*optim_states.pt"):
        f.unlink()
    _refused(capsys, bad, tmp_path / "o2", "no ZeRO optimizer files")

    bad = shutil.copytree(good, tmp_path / "step")  # one rank's file from another step
    f = bad / optim.format(2)
    sd = torch.load(f, weights_only=False)
    for state in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
        state["step"] = state["step"] + 1
    torch.save(sd, f)
    _refused(capsys, bad, tmp_path / "o3", "optimizer step 3.0 differs from data-parallel rank 0's 2.0")

    bad = shutil.copytree(good, tmp_path / "shapes")  # param_shapes that do not add up to the groups
    f = bad / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    group = sd["param_shapes"][0]
    group[next(reversed(group))] = torch.Size([1])
    torch.save(sd, f)
    _refused(capsys, bad, tmp_path / "o4", "parameter group 0", "partitions hold")

    bad = shutil.copytree(good, tmp_path / "unsafe")  # a crafted optimizer file never runs code
    torch.save({"optimizer_state_dict": _Boom()}, bad / optim.format(0))
    _refused(capsys, bad, tmp_path / "o5", "refused to unpickle")
    assert not (tmp_path / "pwned").exists()


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {Path(__file__).parent}/pwned",))


def test_master_weights_need_optimizer_files_and_a_layout_that_has_them(sample_factory, tmp_path, capsys):
    from reshard.sample import write_core_sample_checkpoint

    plain = sample_factory(1)  # a DeepSpeed rank file with no ZeRO optimizer files beside it
    assert main(["run", "--direct", str(plain), str(tmp_path / "o"), "--target-tp", "1", "--weights", "master"]) == 2
    assert "no ZeRO optimizer files" in capsys.readouterr().err and not (tmp_path / "o").exists()
    run = tmp_path / "run"
    write_core_sample_checkpoint(run, tp=1)
    assert main(["plan", str(run), "--target-tp", "1", "--weights", "master"]) == 2
    assert "--weights master is not available for the megatron layout" in capsys.readouterr().err
    assert main(["plan", str(plain), "--target-tp", "1", "--weights", "best"]) == 2
    assert "--weights: 'best' is not one of module, master" in capsys.readouterr().err


@pytest.mark.parametrize("config", [(2, "bf16", 3), (3, "bf16", 2)], ids=["zero2", "zero3"])
def test_the_flow_reads_master_weights_from_s3(zero_ckpts, config, tmp_path, request, monkeypatch):
    """Discovery fetches the optimizer files only when --weights master asks for them."""
    request.getfixturevalue("prefect_env")
    from reshard.discovery import discover
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    step = zero_ckpts[config]
    source, so = upload_to_s3(step, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                              monkeypatch, prefix="zm")

    plain = {o.name for o in discover(source, so).objects}
    master = {o.name for o in discover(source, so, ReshardOptions(weights="master")).objects}
    optim = {p.name for p in step.glob("*_optim_states.pt")}
    assert plain == {p.name for p in step.glob("*model_states.pt")} and optim and not optim & plain
    assert master - plain == optim
    run_flow(ReshardParams(source=source, destination=str(tmp_path / "out"), target_tp=1, weights="master",
                           storage_options=so, cache_dir=str(tmp_path / "cache")))
    got, ref = _module(tmp_path / "out"), _zero_to_fp32(step)
    assert all(torch.equal(got[k], v.float()) for k, v in ref.items())


def test_a_parameter_straddling_partitions_reads_every_box_right():
    """FlatSlice against plain slicing: row runs (a view inside one partition, copied across two),
    column boxes, a box copied into a strided ``out``."""
    from reshard.core.lazy import overlaps
    from reshard.core.zero_master import FlatSlice

    flat = torch.arange(40, dtype=torch.float32)
    parts = [(flat[:13].clone(), 0, 13), (flat[13:29].clone(), 0, 16), (flat[29:].clone(), 0, 11)]
    t = FlatSlice([(p, s, n) for p, s, n, _ in overlaps(parts, 5, 29)], (4, 6))
    want = flat[5:29].view(4, 6)
    for offsets, sizes in [((0, 0), (4, 6)), ((1, 0), (2, 6)), ((0, 2), (4, 3)), ((3, 1), (1, 5)), ((2, 0), (2, 6))]:
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(t.read_box(offsets, sizes), want[box]), (offsets, sizes)
        out = torch.empty(sizes[1], sizes[0]).t()  # not contiguous
        assert torch.equal(t.read_box(offsets, sizes, out=out), want[box])
    for offsets, sizes in [((0, 2), (1, 3)), ((2, 1), (1, 4))]:  # runs inside one row: views
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(t.view_box(offsets, sizes), want[box]), (offsets, sizes)
    assert t.view_box((0, 0), (1, 6)) is not None  # elements 5..10: inside the first partition
    assert t.view_box((1, 0), (2, 6)) is None  # elements 11..22 straddle the boundary at 13
