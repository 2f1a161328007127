"""Changing pipeline stages (PP) together with TP, for Megatron-LM ``mp_rank_TT_PPP`` folders.

Layers are renumbered per stage, embeddings live on the first stage, final norm and output layer
on the last; with tied embeddings and PP > 1 the last stage holds a copy of the word embeddings
(megatron-core ``output_layer.weight``, legacy ``word_embeddings_for_head.weight``), dropped at
PP 1 and recreated when splitting. Checked against independently written samples (bit for bit),
round trips, and checkpoints written by real megatron-core at PP 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from layout_helpers import convert, converted_args, legacy_names
from mcore_fixtures import TOKENS, iteration_folder, mcore_checkpoints, mcore_forward, model_options, needs_mcore
from mcore_reference import Arch, core_logits
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError
from reshard.core.safe_load import load_shard
from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint

GQA = CoreGPTConfig(layers=4, hidden=64, heads=8, groups=4, ffn=96, swiglu=True, rmsnorm=True, bias=False, rope=True,
                    tied=False, vocab=100, divisible_by=16)
TIED = CoreGPTConfig(layers=4, hidden=64, heads=8, ffn=128, tied=True, vocab=100, divisible_by=16)
CONFIGS = {"gqa": GQA, "tied": TIED}
MOVES = [((2, 1), (2, 2)), ((2, 2), (2, 1)), ((1, 4), (2, 2)), ((4, 2), (1, 1)), ((2, 4), (4, 1)),
         ((1, 1), (2, 4)), ((2, 2), (1, 4)), ((4, 4), (4, 2))]

_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_samples")

    def make(name: str, tp: int, pp: int) -> Path:
        if (name, tp, pp) not in _CACHE:
            folder = root / f"{name}_tp{tp}_pp{pp}"
            write_core_sample_checkpoint(folder, tp=tp, pp=pp, cfg=CONFIGS[name])
            _CACHE[(name, tp, pp)] = folder
        return _CACHE[(name, tp, pp)]

    return make


def _files(run: Path, tp: int, pp: int) -> list[Path]:
    it = next(p for p in run.iterdir() if p.is_dir())
    subs = [f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{s:03d}" for s in range(pp) for r in range(tp)]
    return [it / sub / "model_optim_rng.pt" for sub in subs]


def _load(run: Path, tp: int, pp: int) -> list[dict]:
    return [load_shard(f, mmap=False) for f in _files(run, tp, pp)]


def _same(ours: list[dict], theirs: list[dict], args: bool = True) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert list(a["model"]) == list(b["model"])
        for k, v in b["model"].items():
            if isinstance(v, torch.Tensor):
                assert a["model"][k].dtype == v.dtype and torch.equal(a["model"][k], v), k
            else:
                assert a["model"][k] is None and v is None, k
        if args:
            assert vars(a["args"]) == converted_args(b["args"])


@pytest.mark.parametrize("move", MOVES, ids=[f"tp{a}pp{b}-tp{c}pp{d}" for (a, b), (c, d) in MOVES])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_and_pp_change_equals_the_sample_written_there(samples, tmp_path, name, move):
    (n, spp), (m, tpp) = move
    plan = convert(samples(name, n, spp), tmp_path / "out", target_tp=m, target_pp=tpp)
    assert [t.name.split("/")[1] for t in plan.targets] == [
        f"mp_rank_{r:02d}" if tpp == 1 else f"mp_rank_{r:02d}_{s:03d}" for s in range(tpp) for r in range(m)]
    assert plan.facts.target_pp_layers == (4 // tpp,) * tpp
    _same(_load(tmp_path / "out", m, tpp), _load(samples(name, m, tpp), m, tpp))
    if name == "tied" and spp > 1 and tpp == 1:
        assert any("tied copy" in w for w in plan.warnings)


@pytest.mark.parametrize("move", MOVES[:5], ids=[f"tp{a}pp{b}-tp{c}pp{d}" for (a, b), (c, d) in MOVES[:5]])
def test_pp_round_trip_is_bit_identical(samples, tmp_path, move):
    (n, spp), (m, tpp) = move
    src = samples("tied", n, spp)
    convert(src, tmp_path / "mid", target_tp=m, target_pp=tpp)
    convert(tmp_path / "mid", tmp_path / "back", target_tp=n, target_pp=spp)
    for a, b in zip(_files(tmp_path / "back", n, spp), _files(src, n, spp)):
        x, y = load_shard(a, mmap=False), load_shard(b, mmap=False)
        assert list(x["model"]) == list(y["model"])
        assert all(torch.equal(x["model"][k], v) for k, v in y["model"].items() if isinstance(v, torch.Tensor))
        assert vars(x["args"]) == converted_args(y["args"])


def _legacy_copy(src: Path, dst: Path, tied: bool) -> Path:
    shutil.copytree(src, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = legacy_names(sd["model"], tied=tied)
        torch.save(sd, f)
    return dst


@pytest.mark.parametrize("name", list(CONFIGS))
def test_legacy_names_pipeline_stages(samples, tmp_path, name):
    tied = CONFIGS[name].tied
    src = _legacy_copy(samples(name, 2, 1), tmp_path / "src", tied)
    want = _legacy_copy(samples(name, 1, 2), tmp_path / "want", tied)
    convert(src, tmp_path / "out", target_tp=1, target_pp=2)
    last = _load(tmp_path / "out", 1, 2)[1]["model"]
    assert ("word_embeddings_for_head.weight" in last) == tied
    assert "language_model.encoder.layers.1.input_norm.weight" in last  # layer 3, renumbered
    _same(_load(tmp_path / "out", 1, 2), _load(want, 1, 2))
    convert(tmp_path / "out", tmp_path / "back", target_tp=2, target_pp=1)
    _same(_load(tmp_path / "back", 2, 1), _load(src, 2, 1))


def test_uneven_source_stages_are_renumbered(samples, tmp_path):
    """Stages of 3 + 1 layers (Megatron's decoder_first_pipeline_num_layers): kept at the same PP,
    merged and re-split evenly at another PP (the uneven-split args are cleared)."""
    src = tmp_path / "uneven"
    shutil.copytree(samples("gqa", 1, 1), src)
    f0 = _files(src, 1, 1)[0]
    sd = torch.load(f0, weights_only=False)
    model = sd["model"]
    stage1 = {k.replace("decoder.layers.3.", "decoder.layers.0."): v for k, v in model.items()
              if k.startswith(("decoder.layers.3.", "decoder.final_layernorm.", "output_layer."))}
    stage0 = {k: v for k, v in model.items() if not k.startswith(("decoder.layers.3.", "decoder.final_layernorm.",
                                                                  "output_layer."))}
    sd["args"].pipeline_model_parallel_size = 2
    sd["args"].decoder_first_pipeline_num_layers = 3
    shutil.rmtree(f0.parent)
    for stage, mod in enumerate((stage0, stage1)):
        p = f0.parent.parent / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt"
        p.parent.mkdir(parents=True)
        torch.save({**sd, "model": mod}, p)
    plan = convert(src, tmp_path / "same", target_tp=1)
    assert plan.facts.source_pp_layers == (3, 1) and plan.facts.target_pp_layers == (3, 1)  # kept as is
    assert _load(tmp_path / "same", 1, 2)[0]["args"].decoder_first_pipeline_num_layers == 3
    plan = convert(src, tmp_path / "even", target_tp=2, target_pp=4)
    assert plan.facts.target_pp_layers == (1, 1, 1, 1)
    out = _load(tmp_path / "even", 2, 4)
    assert out[0]["args"].decoder_first_pipeline_num_layers is None
    _same(out, _load(samples("gqa", 2, 4), 2, 4), args=False)
    convert(src, tmp_path / "one", target_tp=1, target_pp=1)
    _same(_load(tmp_path / "one", 1, 1), _load(samples("gqa", 1, 1), 1, 1), args=False)


def test_run_direct_writes_pipeline_stages_under_their_planned_names(samples, tmp_path):
    from reshard.direct import run_direct
    from reshard.execution.plan import ReshardOptions

    report = run_direct(str(samples("tied", 2, 1)), str(tmp_path / "out"), ReshardOptions(target_tp=1, target_pp=2))
    assert [t.name for t in report.plan.targets] == ["iter_0000100/mp_rank_00_000/model_optim_rng.pt",
                                                     "iter_0000100/mp_rank_00_001/model_optim_rng.pt"]
    _same(_load(tmp_path / "out", 1, 2), _load(samples("tied", 1, 2), 1, 2))


def test_pipeline_refusals(samples, sample_factory, tmp_path):
    with pytest.raises(LayoutError, match="4 layers cannot be split evenly over 3 pipeline stages"):
        convert(samples("gqa", 2, 2), tmp_path / "x", target_tp=2, target_pp=3)
    with pytest.raises(LayoutError, match="cannot write 2 pipeline stages in the DeepSpeed") as info:
        convert(sample_factory(2, 2.0), tmp_path / "x", target_tp=2, target_pp=2)
    assert "Megatron-LM" in info.value.hint
    partial = tmp_path / "partial"
    shutil.copytree(samples("gqa", 2, 2), partial)
    for r in range(2):
        shutil.rmtree(_files(partial, 2, 2)[2 + r].parent)
    with pytest.raises(CheckpointFormatError, match="args.pipeline_model_parallel_size is 2 but 1"):
        convert(partial, tmp_path / "x", target_tp=2)
    diverged = tmp_path / "diverged"
    shutil.copytree(samples("tied", 1, 2), diverged)
    f = _files(diverged, 1, 2)[1]
    sd = torch.load(f, weights_only=False)
    sd["model"]["output_layer.weight"][0, 0] += 1
    torch.save(sd, f)
    with pytest.raises(InconsistentShardsError, match="tied output_layer.weight differs"):
        convert(diverged, tmp_path / "x", target_tp=1, target_pp=1)
    assert not (tmp_path / "x").exists()


# --- real megatron-core pipeline stages ----------------------------------------------------------


@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    return mcore_checkpoints(tmp_path_factory.mktemp("mcore"))


def _keys_shapes(mods: list[dict]) -> list[list[tuple]]:
    return [[(k, tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in m["model"].items()]
            for m in mods]


@needs_mcore
def test_megatron_core_pipeline_layouts(mcore, tmp_path):
    """Our stage files have exactly megatron-core's keys, order and shapes at the target (TP, PP);
    megatron-core loads the merged outputs strictly and computes what the tensors say."""
    cases = [("mha", (2, 1), (1, 2)), ("mha", (2, 2), (2, 1)), ("mha", (1, 2), (2, 2)), ("gqa", (2, 2), (1, 1)),
             ("llama", (1, 2), (2, 1)), ("gqa", (1, 1), (2, 2))]
    forward = []
    for i, (name, (n, spp), (m, tpp)) in enumerate(cases):
        dst = tmp_path / f"c{i}"
        convert(mcore[(name, n, spp)], dst, target_tp=m, target_pp=tpp)
        ours = _load(dst, m, tpp)
        assert _keys_shapes(ours) == _keys_shapes(_load(mcore[(name, m, tpp)], m, tpp)), (name, n, spp, m, tpp)
        if tpp == 1:
            forward.append((name, dst, m))
        convert(dst, tmp_path / f"b{i}", target_tp=n, target_pp=spp)
        back, src = _load(tmp_path / f"b{i}", n, spp), _load(mcore[(name, n, spp)], n, spp)
        for a, b in zip(back, src):
            assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items() if isinstance(v, torch.Tensor))
    # PP 1 -> 2 with tied embeddings: the last stage's output_layer is the embeddings' copy
    stages = _load(tmp_path / "c0", 1, 2)
    head, emb = stages[1]["model"]["output_layer.weight"], stages[0]["model"]["embedding.word_embeddings.weight"]
    assert torch.equal(head, emb)
    got = mcore_forward(forward, tmp_path)
    for (name, dst, m), logits in zip(forward, got):
        o = model_options(name)
        arch = Arch(o["layers"], o["heads"], o.get("groups") or o["heads"], o.get("swiglu", False),
                    o.get("norm") == "RMSNorm", o.get("pos") == "rope")
        ref = core_logits([s["model"] for s in _load(dst, m, 1)], arch, torch.tensor(TOKENS))
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert iteration_folder(tmp_path / "c1").name == "iter_0000007"
