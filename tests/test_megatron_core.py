"""Equivalence on checkpoints written by real megatron-core (0.16.1, CPU, gloo).

megatron-core with ``use_cpu_initialization=True`` builds each full (master) weight from the
default CPU generator and gives every rank its slice (``stride=2`` for a gated fc1, so a rank
holds ``[W_r; V_r]``), so the same seed gives the same logical model at every TP — verified
below, logits included. Then a reshard of the TP=N checkpoint to M must equal, tensor for
tensor, what megatron-core itself wrote at TP=M; and megatron-core's own forward on reshard's
output (strict ``load_state_dict``) must give the source's logits, also when the vocabulary
padding changes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from layout_helpers import convert
from mcore_fixtures import (
    MODELS,
    TOKENS,
    iteration_folder,
    mcore_checkpoints,
    mcore_forward,
    model_options,
    needs_mcore,
    rank_module,
    run_harness,
)
from mcore_reference import Arch, core_logits
from reshard.core.errors import LayoutError
from reshard.core.safe_load import load_shard

pytestmark = needs_mcore

SAME_PADDING = [n for n, (o, _) in MODELS.items() if o["vocab"] % (o["divisible_by"] * max(MODELS[n][1])) == 0]
PAIRS = [(name, n, m) for name in SAME_PADDING for n, m in itertools.permutations(MODELS[name][1], 2)]
DROPPED = {"optimizer", "opt_param_scheduler", "rng_state"}


@pytest.fixture(scope="session")
def mcore(tmp_path_factory):
    return mcore_checkpoints(tmp_path_factory.mktemp("mcore"))


def _full(name: str, shards: list[dict]) -> dict:
    """Logical tensors from TP shards, by megatron-core's own layout rules (independent of reshard)."""
    swiglu = model_options(name).get("swiglu", False)
    out = {}
    for k, v in shards[0].items():
        ts = [sd[k] for sd in shards]
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif "linear_fc1" in k and swiglu:
            halves = [t.chunk(2) for t in ts]
            out[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif any(s in k for s in ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer")):
            out[k] = torch.cat(ts)
        elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[k] = torch.cat(ts, dim=1)
        else:
            assert all(torch.equal(t, v) for t in ts), k
            out[k] = v
    return out


def _shards(run, tp):
    return [rank_module(run, r) for r in range(tp)]


@pytest.mark.parametrize("name", SAME_PADDING)
def test_same_seed_builds_the_same_model_at_every_tp(mcore, name):
    tps = MODELS[name][1]
    ref = _full(name, _shards(mcore[(name, tps[0], 1)], tps[0]))
    ref_logits = torch.load(mcore[(name, tps[0], 1)] / "logits.pt")
    for tp in tps[1:]:
        full = _full(name, _shards(mcore[(name, tp, 1)], tp))
        assert list(full) == list(ref)
        for k, v in ref.items():
            assert (v is None and full[k] is None) or torch.equal(full[k], v), (tp, k)
        torch.testing.assert_close(torch.load(mcore[(name, tp, 1)] / "logits.pt"), ref_logits, atol=1e-5, rtol=0)


def test_different_vocab_padding_is_a_different_random_model(mcore):
    """The caveat: the padded vocabulary (112 rows at TP 1, 128 at TP 2) changes how many random
    numbers the embedding draws, so later weights differ. These models are compared by logits."""
    a = _full("padded", _shards(mcore[("padded", 1, 1)], 1))
    b = _full("padded", _shards(mcore[("padded", 2, 1)], 2))
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(a[key], b[key])


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_forward_matches_megatron_core(mcore, name):
    o = model_options(name)
    arch = Arch(o["layers"], o["heads"], o.get("groups") or o["heads"], o.get("swiglu", False),
                o.get("norm") == "RMSNorm", o.get("pos") == "rope", o.get("eps", 1e-5), o.get("rope_base", 10000.0),
                o.get("qk_norm", False), o.get("kv_channels"), (o.get("window_size") or (None,))[0])
    for tp in MODELS[name][1]:
        got = core_logits(_shards(mcore[(name, tp, 1)], tp), arch, torch.tensor(TOKENS))
        torch.testing.assert_close(got, torch.load(mcore[(name, tp, 1)] / "logits.pt"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,n,m", PAIRS, ids=[f"{a}-{n}to{m}" for a, n, m in PAIRS])
def test_reshard_equals_megatron_core_at_the_target_tp(mcore, tmp_path, name, n, m):
    plan = convert(mcore[(name, n, 1)], tmp_path / "out", target_tp=m)
    assert plan.output_format == "megatron"
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "7"
    theirs_dir = iteration_folder(mcore[(name, m, 1)])
    for r in range(m):
        ours_file = iteration_folder(tmp_path / "out") / f"mp_rank_{r:02d}" / "model_optim_rng.pt"
        ours = load_shard(ours_file)
        theirs = load_shard(theirs_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
        assert list(ours["model"]) == list(theirs["model"])
        for k, v in theirs["model"].items():
            if isinstance(v, torch.Tensor):
                assert ours["model"][k].dtype == v.dtype and torch.equal(ours["model"][k], v), k
            else:
                assert ours["model"][k] is None and v is None, k  # _extra_state of local-spec layers
        assert set(ours) == set(theirs) - DROPPED
        # tp/pp/padding updated, what the output holds said (no optimizer or RNG state); the rest kept
        assert vars(ours["args"]) == vars(theirs["args"]) | {"world_size": n, "no_save_optim": True,
                                                             "no_save_rng": True}
        assert ours["iteration"] == 7 and ours["checkpoint_version"] == 3.0
    assert [list(t.sources) for t in plan.targets] == [
        [s for s in range(n) if s * m < (t + 1) * n and (s + 1) * m > t * n] for t in range(m)]


CASES = [("padded", 1, 2, {}), ("padded", 2, 1, {"vocab_size": 100}), ("padded", 4, 2, {"vocab_size": 100}),
         ("padded", 1, 4, {}), ("padded_tied", 2, 1, {}), ("padded_tied", 1, 4, {}), ("llama", 2, 1, {}),
         ("gqa_swiglu", 4, 1, {}), ("mha", 1, 4, {}), ("gqa12", 2, 3, {}), ("gqa12", 3, 1, {})]


def test_megatron_core_forward_on_resharded_checkpoints(mcore, tmp_path):
    """megatron-core loads each output strictly at the target TP and computes the source's logits
    (on the true vocabulary; re-padded rows are zeros)."""
    outs = []
    for i, (name, n, m, extra) in enumerate(CASES):
        dst = tmp_path / f"case{i}"
        plan = convert(mcore[(name, n, 1)], dst, target_tp=m, **extra)
        vocab = model_options(name)["vocab"]
        f = plan.facts
        rows = torch.cat([rank_module(dst, q)["embedding.word_embeddings.weight"] for q in range(m)])
        assert rows.shape[0] == f.padded_vocab_target
        if f.padded_vocab_target != f.padded_vocab_source:  # re-padded: rows past the known vocabulary are 0
            known = f.vocab_size or min(f.padded_vocab_source, f.padded_vocab_target)
            assert torch.count_nonzero(rows[known:]) == 0 and known < rows.shape[0]
        outs.append((name, dst, m))
    logits = mcore_forward(outs, tmp_path)
    for (name, n, m, _), got in zip(CASES, logits):
        want = torch.load(mcore[(name, n, 1)] / "logits.pt")
        vocab = model_options(name)["vocab"]
        torch.testing.assert_close(got[:, :vocab], want[:, :vocab], atol=1e-5, rtol=0, msg=f"{name} {n}->{m}")


def test_gqa_split_must_keep_whole_query_groups(mcore, tmp_path):
    with pytest.raises(LayoutError, match=r"2 query groups \(8 heads\) cannot be divided over 4 target ranks"):
        convert(mcore[("gqa", 1, 1)], tmp_path / "x", target_tp=4)
    with pytest.raises(LayoutError, match="6 query groups .* over 4 target ranks"):
        convert(mcore[("gqa12", 2, 1)], tmp_path / "y", target_tp=4)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_real_shards_merge_without_the_true_vocab_size_and_repad_exactly_with_it(mcore, tmp_path):
    """megatron-core's TP 2 shards (true vocabulary 100, not saved) merge to TP 1 keeping their 128
    rows, with a warning; given the size they take Megatron's own padding (112)."""
    plan = convert(mcore[("padded", 2, 1)], tmp_path / "x", target_tp=1)
    assert (plan.facts.padded_vocab_source, plan.facts.padded_vocab_target) == (128, 128)
    assert any("kept the 128 vocabulary rows at TP 1" in w and "--vocab-size V" in w for w in plan.warnings)
    merged = load_shard(iteration_folder(tmp_path / "x") / "mp_rank_00" / "model_optim_rng.pt")
    parts = [load_shard(iteration_folder(mcore[("padded", 2, 1)]) / f"mp_rank_0{r}" / "model_optim_rng.pt")
             for r in range(2)]
    key = "embedding.word_embeddings.weight"
    assert torch.equal(merged["model"][key], torch.cat([p["model"][key] for p in parts]))
    plan = convert(mcore[("padded", 2, 1)], tmp_path / "y", target_tp=1, vocab_size=100)
    assert (plan.facts.padded_vocab_source, plan.facts.padded_vocab_target) == (128, 112)
    out = load_shard(iteration_folder(tmp_path / "y") / "mp_rank_00" / "model_optim_rng.pt")
    assert out["args"].padded_vocab_size == 112


def test_inspect_facts_from_megatron_core_args(mcore):
    from reshard.execution.plan import ReshardOptions
    from reshard.execution.planner import build_plan

    plan = build_plan(str(mcore[("llama", 2, 1)]), ReshardOptions(target_tp=2))
    f = plan.facts
    assert (f.naming, f.heads, f.query_groups, f.head_dim, f.swiglu, f.tied_embeddings) == \
        ("megatron-core", 8, 2, 8, True, False)
    assert f.origin["query_groups"] == "args" and f.origin["swiglu"].startswith("shapes")
    assert len(plan.carried) == 2 * 4 + 1 and all(p.dtype is None for p in plan.carried)  # local spec: None


def test_a_failed_harness_job_is_reported_with_its_traceback_and_the_server_runs_the_next(tmp_path):
    """run_harness keeps one harness server per test process: a job that raises comes back as a
    RuntimeError carrying the rank's traceback (from jobs_N.log), and the same server then runs the
    next jobs file (megatron-core's logits of a real checkpoint)."""
    bad = {"kind": "write", "out": str(tmp_path / "bad"), "tp": 1, "model": {"hidden": 64}, "tokens": TOKENS}
    with pytest.raises(RuntimeError, match=r"(?s)harness failed \(failed\).*KeyError: 'layers'"):
        run_harness([bad], tmp_path / "work")
    assert (tmp_path / "work" / "jobs_0.log").is_file()
    ckpt = mcore_checkpoints(tmp_path / "m")[("gqa_swiglu", 2, 1)]
    (logits,) = mcore_forward([("gqa_swiglu", ckpt, 2)], tmp_path / "work")
    assert torch.equal(logits, torch.load(ckpt / "logits.pt"))
