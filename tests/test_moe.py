"""Mixture-of-experts checkpoints written by real megatron-core (0.16.1, CPU, gloo): SequentialMLP
experts under expert parallelism, in Megatron-LM's ``mp_rank_TT[_PPP]_EEE`` folders.

megatron-core builds each expert from the CPU generator at its local position, so the same seed
gives the same model at every TP of one EP but other experts at another EP. Hence two proofs:

* at the same EP, a TP change equals megatron-core's own shards at the target TP, tensor for tensor
  and key for key in megatron-core's order;
* at any (TP, EP, PP), megatron-core loads the output strictly at the target layout and computes
  the source layout's logits, with the same routing decisions in every MoE layer (top-k is
  discontinuous: equal logits could hide a near tie, equal routing cannot).

A misplaced expert is caught: swapping two experts of a converted checkpoint changes the logits
far above the tolerance.

Expert tensor parallelism (experts split over fewer ranks than the dense layers, TP 2 x ETP 1 x EP 2
and TP 4 x ETP 2 x EP 2) is written by megatron-core too, with only the (TP rank, EP rank) folders
Megatron-LM's processes save: reshard reads and writes exactly those files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from layout_helpers import convert
from mcore_fixtures import (
    copy_with_args,
    mcore_forward_moe,
    mcore_moe_checkpoints,
    mcore_moe_dist_checkpoints,
    mcore_moe_etp_checkpoints,
    needs_mcore,
)
from reshard.cli import main
from reshard.core.safe_load import load_shard

pytestmark = needs_mcore

#: (model, source (tp, ep, pp), target (tp, ep, pp)); a target with pp > 1 is converted on to the
#: source's own (tp, ep) with pp 1 before the forward (megatron-core's pipeline schedule is not run).
CONVERSIONS: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = [
    ("moe", (1, 2, 1), (2, 2, 1)),
    ("moe", (2, 2, 1), (1, 1, 1)),
    ("moe", (2, 2, 1), (1, 4, 1)),
    ("moe", (1, 2, 1), (2, 4, 1)),
    ("moe", (1, 1, 1), (2, 2, 1)),
    ("moe", (1, 2, 1), (1, 4, 2)),
    ("moe_gelu", (2, 1, 1), (1, 2, 1)),
    ("moe_gelu", (1, 4, 1), (2, 1, 1)),
    ("moe_bias", (1, 2, 1), (1, 4, 1)),
    ("moe_bias", (1, 2, 1), (1, 1, 1)),
]
ATOL = 2e-5


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    return mcore_moe_checkpoints(tmp_path_factory.mktemp("moe"))


def _iteration(run: Path) -> Path:
    text = (run / "latest_checkpointed_iteration.txt").read_text().strip()
    return run / (f"iter_{int(text):07d}" if text.isdigit() else text)


def _modules(run: Path) -> dict[str, dict]:
    return {d.name: load_shard(d / "model_optim_rng.pt", mmap=False) for d in sorted(_iteration(run).iterdir())}


def _layout(tp: int, ep: int, pp: int) -> dict[str, int]:
    return {"target_tp": tp, "target_ep": ep, "target_pp": pp}


@pytest.fixture(scope="module")
def converted(moe, tmp_path_factory):
    """Every conversion of :data:`CONVERSIONS` and megatron-core's forward on each output."""
    root = tmp_path_factory.mktemp("moe_out")
    cases, outs = [], []
    for i, (name, (st, se, sp), (tt, te, tpp)) in enumerate(CONVERSIONS):
        out = root / f"c{i}"
        convert(moe[(name, st, se, sp)], out, **_layout(tt, te, tpp))
        outs.append(out)
        if tpp > 1:  # back to one stage for the forward, through another layout
            out = root / f"c{i}_pp1"
            convert(outs[-1], out, **_layout(st, se, 1))
        cases.append((name, out, tt if tpp == 1 else st, te if tpp == 1 else se))
    return outs, mcore_forward_moe(cases, root)


def test_a_tp_change_equals_megatron_cores_own_shards(moe, tmp_path):
    for (st, tt) in ((1, 2), (2, 1)):
        out = tmp_path / f"tp{st}to{tt}"
        convert(moe[("moe", st, 2, 1)], out, target_tp=tt)
        ours, theirs = _modules(out), _modules(moe[("moe", tt, 2, 1)])
        assert list(ours) == list(theirs) == [f"mp_rank_{t:02d}_{e:03d}" for t in range(tt) for e in range(2)]
        for folder, sd in theirs.items():
            mine = ours[folder]["model"]
            assert list(mine) == list(sd["model"]), folder  # megatron-core's order, experts included
            for key, value in sd["model"].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(mine[key], value), (folder, key)
                else:
                    assert mine[key] == value, (folder, key)
            args = ours[folder]["args"]
            assert (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                    args.expert_tensor_parallel_size) == (tt, 2, tt)


@pytest.mark.parametrize("case", range(len(CONVERSIONS)), ids=[f"{n}-{s}-to-{t}" for n, s, t in CONVERSIONS])
def test_megatron_core_computes_the_source_logits_and_routing_at_the_target_layout(moe, converted, case):
    name, src, dst = CONVERSIONS[case]
    outs, results = converted
    logits, routing = results[case]
    run = moe[(name, *src[:2], 1)] if src[2] == 1 else None
    assert run is not None
    want, want_routing = torch.load(run / "logits.pt"), torch.load(run / "routing.pt")
    assert torch.allclose(logits, want, atol=ATOL, rtol=0), (logits - want).abs().max()
    assert want_routing and routing.keys() == want_routing.keys()
    for router, chosen in want_routing.items():
        assert torch.equal(routing[router], chosen), router
    folders = sorted(d.name for d in _iteration(outs[case]).iterdir())
    tt, te, tpp = dst
    assert len(folders) == tt * te * tpp
    if te > 1 and tpp > 1:
        assert folders[-1] == f"mp_rank_{tt - 1:02d}_{tpp - 1:03d}_{te - 1:03d}"


def test_a_misplaced_expert_changes_the_logits(moe, tmp_path):
    """What the logits test would see if reshard dealt experts out wrongly: two experts swapped."""
    out = tmp_path / "out"
    convert(moe[("moe", 1, 2, 1)], out, target_tp=1, target_ep=1)
    f = _iteration(out) / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    a, b = (f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight" for i in (0, 3))
    sd["model"][a], sd["model"][b] = sd["model"][b], sd["model"][a]
    torch.save(sd, f)
    [(logits, _)] = mcore_forward_moe([("moe", out, 1, 1)], tmp_path)
    want = torch.load(moe[("moe", 1, 2, 1)] / "logits.pt")
    assert (logits - want).abs().max() > 100 * ATOL


def test_experts_round_trip_byte_stable_through_other_layouts(moe, tmp_path):
    src = moe[("moe", 2, 2, 1)]
    convert(src, tmp_path / "a", **_layout(1, 4, 2))
    convert(tmp_path / "a", tmp_path / "b", **_layout(2, 2, 1))
    for folder, sd in _modules(src).items():
        back = _modules(tmp_path / "b")[folder]["model"]
        assert list(back) == list(sd["model"])
        assert all(torch.equal(back[k], v) for k, v in sd["model"].items() if isinstance(v, torch.Tensor))


def test_a_two_number_folder_is_an_expert_rank_when_the_args_say_so(moe, capsys):
    """``mp_rank_00_001`` is EP rank 1 here (PP 1, EP 2 in the args), not pipeline stage 1."""
    assert main(["inspect", str(moe[("moe", 1, 2, 1)]), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["tp"], rec["pp"], rec["ep"], rec["experts"]) == (1, 1, 2, 4)


def test_inspect_shows_the_expert_axis_only_for_moe_models(moe, sample_factory, capsys):
    assert main(["inspect", str(moe[("moe", 1, 2, 1)])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "ep           2" in lines and "experts      4" in lines
    assert main(["inspect", str(sample_factory(tp=2))]) == 0
    assert not any(ln.startswith(("ep ", "experts ")) for ln in capsys.readouterr().out.splitlines())


def test_grouped_gemm_names_are_dealt_out_like_sequential_ones(moe, tmp_path):
    """megatron-core's grouped-GEMM experts (``experts.linear_fc1.weight{i}``), written here by
    renaming SequentialMLP's keys the way megatron-core names them: EP 2 -> 1 numbers them globally."""
    src = tmp_path / "grouped"
    shutil.copytree(moe[("moe", 1, 2, 1)], src)
    for f in _iteration(src).glob("*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = {_grouped(k): v for k, v in sd["model"].items() if not _expert_extra(k)}
        torch.save(sd, f)
    convert(src, tmp_path / "out", target_tp=1, target_ep=1)
    [(folder, out)] = _modules(tmp_path / "out").items()
    src_modules = _modules(src)
    for e, sd in enumerate(src_modules.values()):
        for i in range(2):
            for fc in (1, 2):
                assert torch.equal(out["model"][f"decoder.layers.1.mlp.experts.linear_fc{fc}.weight{2 * e + i}"],
                                   sd["model"][f"decoder.layers.1.mlp.experts.linear_fc{fc}.weight{i}"])
    assert sum(".experts.linear_fc" in k for k in out["model"]) == 8


def _grouped(key: str) -> str:
    import re

    m = re.match(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$", key)
    return f"{m.group(1)}{m.group(3)}.weight{m.group(2)}" if m else key


def _expert_extra(key: str) -> bool:
    return ".local_experts." in key and key.endswith("_extra_state")


# --- refusals: one line, exit 2, nothing written ------------------------------------------------

def _refused(capsys, args: list[str], dst: Path, *needles: str) -> None:
    code = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not dst.exists()


def test_an_expert_count_the_target_ep_does_not_divide_is_refused(moe, tmp_path, capsys):
    _refused(capsys, ["run", "--direct", str(moe[("moe", 1, 2, 1)]), str(tmp_path / "o"), "--target-tp", "1",
                      "--target-ep", "3"], tmp_path / "o", "4 experts", "3 expert-parallel ranks", "1, 2, 4")


def test_a_missing_expert_rank_folder_is_refused(moe, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(moe[("moe", 2, 2, 1)], src)
    shutil.rmtree(_iteration(src) / "mp_rank_01_001")
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "lacks tensor-parallel ranks [1]")
    shutil.rmtree(_iteration(src) / "mp_rank_00_001")
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "expert_model_parallel_size is 2 but 1 expert-parallel ranks")


def test_expert_counts_that_disagree_across_ranks_are_refused(moe, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(moe[("moe", 1, 2, 1)], src)
    f = _iteration(src) / "mp_rank_00_001" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["model"] = {k: v for k, v in sd["model"].items() if ".local_experts.1." not in k}
    torch.save(sd, f)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "mp_rank_00_001", "expert-parallel rank 1 holds other parameters than rank 0")


@pytest.mark.parametrize("dropped,needle", [(1, "missing [1]"), (3, "args.num_experts is 4 but")])
def test_a_missing_expert_is_refused_not_dealt_out_wrongly(moe, tmp_path, capsys, dropped, needle):
    """At EP 1 nothing else numbers the experts: a gap would shift every later expert's target rank."""
    src = tmp_path / "src"
    shutil.copytree(moe[("moe", 1, 1, 1)], src)
    f = _iteration(src) / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["model"] = {k: v for k, v in sd["model"].items() if f".local_experts.{dropped}." not in k}
    torch.save(sd, f)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1", "--target-ep", "1"],
             tmp_path / "o", needle)


def test_args_that_misdescribe_the_expert_tp_are_refused(moe, tmp_path, capsys):
    """Files split over TP 2 whose args claim expert TP 1: Megatron-LM would have saved two of the
    four folders, so the files are not what the args say (read as they say, experts would be half)."""
    src = copy_with_args(moe[("moe", 2, 2, 1)], tmp_path / "src", expert_tensor_parallel_size=1)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "no process saves when the experts' TP is 1")


def test_a_format_that_cannot_hold_experts_refuses_them(moe, tmp_path, capsys):
    """A plugin format that does not declare ``holds_experts`` (one safetensors file per TP rank)."""
    from safetensors.torch import save_file

    from plugin_format import SafetensorsPerRank
    from reshard.formats import register_format, unregister_format

    sd = torch.load(_iteration(moe[("moe", 1, 1, 1)]) / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}, str(src / "rank-00.safetensors"),
              metadata={"reshard.top": json.dumps({"checkpoint_version": 3.0})})
    fmt = register_format(SafetensorsPerRank)
    try:
        _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
                 "mixture-of-experts", "cannot hold its experts")
    finally:
        unregister_format(fmt.name)


# --- Hugging Face: Mixtral and Qwen2-MoE ----------------------------------------------------------

HF_CASES = [("mixtral", (2, 2, 1), "MixtralForCausalLM"), ("qwen_moe", (1, 2, 1), "Qwen2MoeForCausalLM"),
            ("qwen3_moe", (2, 2, 1), "Qwen3MoeForCausalLM")]
TOL = 2e-5


def _hf_export(src: Path, out: Path) -> Path:
    assert main(["run", "--direct", str(src), str(out), "--to", "hf"]) == 0
    return out


@pytest.mark.parametrize("name,layout,arch", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_transformers_runs_the_moe_export_with_megatron_cores_logits(moe, tmp_path, name, layout, arch):
    from test_hf_export import hf_logits

    src = moe[(name, *layout)]
    out = _hf_export(src, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["num_experts_per_tok"] == 2
    if arch == "Qwen2MoeForCausalLM":
        assert (cfg["num_experts"], cfg["norm_topk_prob"], cfg["mlp_only_layers"], cfg["qkv_bias"]) == (4, False, [0],
                                                                                                       True)
        assert (cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == \
            (96, 48, 32)
    elif arch == "Qwen3MoeForCausalLM":
        assert (cfg["num_experts"], cfg["norm_topk_prob"], cfg["mlp_only_layers"], cfg["attention_bias"]) == \
            (4, True, [0], False)
        assert (cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["head_dim"]) == (96, 48, 8)
    else:
        assert (cfg["num_local_experts"], cfg["intermediate_size"], cfg["rope_theta"], cfg["rms_norm_eps"]) == \
            (4, 48, 50000.0, 1e-6)
    logits = hf_logits(out)
    assert (logits - torch.load(src / "logits.pt")).abs().max() < TOL


def _swapped(a: str, b: str):
    def edit(sd: dict) -> None:
        sd[a], sd[b] = sd[b], sd[a]
    return edit


def _renumbered(template: str, experts: int = 4):
    """Every expert under the next one's number (what a wrong local -> global numbering writes)."""
    def edit(sd: dict) -> None:
        moved = [sd[template.format(e)] for e in range(experts)]
        for e in range(experts):
            sd[template.format(e)] = moved[(e + 1) % experts]
    return edit


_MX = "model.layers.1.block_sparse_moe."
_QW = "model.layers.1.mlp."
WRONG_MOE = {
    "mixtral": {
        "experts renumbered by one": {"tensors": _renumbered(_MX + "experts.{}.w2.weight")},
        "an expert's gate (w1) and up (w3) swapped": {"tensors": _swapped(_MX + "experts.2.w1.weight",
                                                                          _MX + "experts.2.w3.weight")},
        "top-1 routing instead of top-2": {"config": {"num_experts_per_tok": 1}},
    },
    "qwen_moe": {
        "top-k renormalized (norm_topk_prob)": {"config": {"norm_topk_prob": True}},
        "experts renumbered by one": {"tensors": _renumbered(_QW + "experts.{}.down_proj.weight")},
        "the shared expert's gate and up swapped": {"tensors": _swapped(_QW + "shared_expert.gate_proj.weight",
                                                                        _QW + "shared_expert.up_proj.weight")},
    },
    "qwen3_moe": {
        "top-k not renormalized (norm_topk_prob)": {"config": {"norm_topk_prob": False}},
        "experts renumbered by one": {"tensors": _renumbered(_QW + "experts.{}.gate_proj.weight")},
        "query and key norms swapped": {"tensors": _swapped("model.layers.1.self_attn.q_norm.weight",
                                                            "model.layers.1.self_attn.k_norm.weight")},
    },
}


@pytest.mark.parametrize("name,layout,arch", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_the_moe_logits_comparison_catches_each_plausible_wrong_export(moe, tmp_path, name, layout, arch):
    from test_hf_export import hf_logits, mutated_copy

    src = moe[(name, *layout)]
    good = _hf_export(src, tmp_path / "good")
    want = torch.load(src / "logits.pt")
    for i, (label, change) in enumerate(WRONG_MOE[name].items()):
        diff = (hf_logits(mutated_copy(good, tmp_path / f"wrong{i}", **change)) - want).abs().max().item()
        assert diff > 10 * TOL, f"{label}: logits moved only {diff:.2e}"


def test_a_qwen3_moe_export_imports_back_into_megatron_cores_own_shards(moe, tmp_path):
    """megatron-core -> Qwen3-MoE -> megatron-core at the same layout (and padding) is megatron-core's
    own files, key for key in its order (query/key norms after the QKV) and tensor for tensor."""
    src = moe[("qwen3_moe", 2, 2, 1)]
    out = _hf_export(src, tmp_path / "hf")
    assert main(["run", "--direct", str(out), str(tmp_path / "back"), "--target-tp", "2", "--target-ep", "2",
                 "--make-vocab-size-divisible-by", "32"]) == 0
    ours, theirs = _modules(tmp_path / "back"), _modules(src)
    assert list(ours) == list(theirs)
    for folder, sd in theirs.items():
        assert list(ours[folder]["model"]) == list(sd["model"]), folder
        for key, value in sd["model"].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(ours[folder]["model"][key], value), (folder, key)


def test_moe_models_no_hugging_face_architecture_computes_are_refused(moe, tmp_path, capsys):
    _refused(capsys, ["run", "--direct", str(moe[("moe", 1, 2, 1)]), str(tmp_path / "a"), "--to", "hf"],
             tmp_path / "a", "shared experts without a gate")
    _refused(capsys, ["run", "--direct", str(moe[("moe_gelu", 1, 4, 1)]), str(tmp_path / "b"), "--to", "hf"],
             tmp_path / "b", "mixture-of-experts model with LayerNorm")
    src = copy_with_args(moe[("qwen3_moe", 2, 2, 1)], tmp_path / "src", qk_layernorm=False)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "c"), "--to", "hf"], tmp_path / "c",
             "args.qk_layernorm contradicts the query/key layer norms")


def test_quantizing_experts_is_refused(moe, tmp_path, capsys):
    _refused(capsys, ["run", "--direct", str(moe[("moe", 1, 2, 1)]), str(tmp_path / "o"), "--target-tp", "1",
                      "--quantize"], tmp_path / "o", "--quantize", "experts")


def test_target_ep_on_a_dense_model_is_refused(sample_factory, tmp_path, capsys):
    src = sample_factory(tp=2)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1", "--target-ep", "2"],
             tmp_path / "o", "no experts", "--target-ep")


def test_the_flow_reshards_experts_from_s3(moe, tmp_path, request, monkeypatch):
    """The Prefect flow from object storage (a run folder of three-number ``mp_rank_TT_PPP_EEE``
    folders after a first conversion) writes the same bytes as ``--direct``."""
    request.getfixturevalue("prefect_env")
    from conftest import upload_to_s3
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    src = tmp_path / "src"
    convert(moe[("moe", 1, 2, 1)], src, **_layout(1, 2, 2))
    source, so = upload_to_s3(src, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                              monkeypatch, prefix="moe")
    run_flow(ReshardParams(source=source, destination=str(tmp_path / "flow"), target_tp=2, target_ep=4,
                           target_pp=1, storage_options=so, cache_dir=str(tmp_path / "cache")))
    assert main(["run", "--direct", str(src), str(tmp_path / "direct"), "--target-tp", "2", "--target-ep", "4",
                 "--target-pp", "1"]) == 0
    files = {p.relative_to(tmp_path / "direct").as_posix() for p in (tmp_path / "direct").rglob("*") if p.is_file()}
    assert len([f for f in files if f.endswith("model_optim_rng.pt")]) == 8
    for f in sorted(files - {"reshard_manifest.json"}):
        assert (tmp_path / "flow" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f


# --- Hugging Face import: Mixtral and Qwen2-MoE folders -> megatron-core at any (TP, EP) ------------

_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
#: name -> (transformers config class, its arguments): tiny, random, seeded.
HF_MOE = {
    "mixtral": ("MixtralConfig", {**_SMALL, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "rope_theta": 50000.0}),
    # a dense first layer, a gated shared expert, top-2 not renormalized, QKV biases
    "qwen2_moe": ("Qwen2MoeConfig", {**_SMALL, "intermediate_size": 96, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "mlp_only_layers": [0], "norm_topk_prob": False}),
    # query/key norms, a head dim above hidden / heads, a dense first layer, no shared expert, renormalized
    "qwen3_moe": ("Qwen3MoeConfig", {**_SMALL, "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 4,
                                     "num_experts_per_tok": 2, "mlp_only_layers": [0], "norm_topk_prob": True,
                                     "head_dim": 16}),
}


def make_hf_moe(name: str, folder: Path) -> torch.Tensor:
    """Save MoE model ``name`` (random, seeded; norms distinct from ones) to ``folder``; its logits."""
    import transformers
    from transformers.utils import logging as hf_logging

    from mcore_fixtures import TOKENS

    hf_logging.disable_progress_bar()
    cls, kw = HF_MOE[name]
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw, initializer_range=0.1))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))
    model.eval()
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


IMPORT_LAYOUTS = [(1, 1), (2, 2), (1, 4)]


@pytest.fixture(scope="module")
def hf_imported(tmp_path_factory):
    """Each HF MoE model imported at every layout of :data:`IMPORT_LAYOUTS`, and megatron-core's
    forward on each (built from the import's own saved args)."""
    root = tmp_path_factory.mktemp("hf_moe")
    want, cases = {}, []
    for name in HF_MOE:
        want[name] = make_hf_moe(name, root / name)
        for tp, ep in IMPORT_LAYOUTS:
            out = root / f"{name}_tp{tp}_ep{ep}"
            assert main(["run", "--direct", str(root / name), str(out), "--target-tp", str(tp), "--target-ep",
                         str(ep)]) == 0
            cases.append((None, out, tp, ep))
    got = mcore_forward_moe(cases, root)
    return root, want, dict(zip([(n, tp, ep) for n in HF_MOE for tp, ep in IMPORT_LAYOUTS], got))


@pytest.mark.parametrize("tp,ep", IMPORT_LAYOUTS)
@pytest.mark.parametrize("name", list(HF_MOE))
def test_megatron_core_runs_the_moe_import_with_transformers_logits(hf_imported, name, tp, ep):
    root, want, got = hf_imported
    logits, routing = got[(name, tp, ep)]
    assert (logits - want[name]).abs().max() < TOL
    reference = got[(name, 1, 1)][1]  # the same routing at every layout
    assert routing.keys() == reference.keys() and all(torch.equal(routing[k], reference[k]) for k in reference)
    args = load_shard(next(_iteration(root / f"{name}_tp{tp}_ep{ep}").glob("*/model_optim_rng.pt")))["args"]
    assert (args.num_experts, args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (4, ep, tp)


def test_a_moe_import_exports_back_to_the_same_tensors(hf_imported, tmp_path):
    """Hugging Face -> megatron-core TP 2 x EP 2 -> Hugging Face gives back every tensor."""
    from test_hf_export import hf_tensors

    root, _, _ = hf_imported
    for name in HF_MOE:
        back = _hf_export(root / f"{name}_tp2_ep2", tmp_path / name)
        assert {k: v for k, v in hf_tensors(back).items()}.keys() == hf_tensors(root / name).keys()
        assert all(torch.equal(v, hf_tensors(root / name)[k]) for k, v in hf_tensors(back).items())


def test_the_import_comparison_catches_a_wrong_routing_normalization(hf_imported, tmp_path):
    """Reading Qwen2-MoE's ``norm_topk_prob`` the wrong way round (renormalizing the top-k) moves the
    logits far above the tolerance: the comparison above would see it."""
    root, want, _ = hf_imported
    src = shutil.copytree(root / "qwen2_moe", tmp_path / "flipped")
    cfg = json.loads((src / "config.json").read_text())
    cfg["norm_topk_prob"] = not cfg["norm_topk_prob"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--target-tp", "1"]) == 0
    [(logits, _)] = mcore_forward_moe([(None, tmp_path / "out", 1, 1)], tmp_path)
    assert (logits - want["qwen2_moe"]).abs().max() > 10 * TOL


# --- torch_dist: experts along a global expert axis ------------------------------------------------

@pytest.fixture(scope="module")
def moe_dist(tmp_path_factory):
    return mcore_moe_dist_checkpoints(tmp_path_factory.mktemp("moe_dist"))


def test_torch_dist_experts_read_into_megatron_cores_own_per_rank_shards(moe, moe_dist, tmp_path):
    """A torch_dist MoE checkpoint (per-layer keys, experts on a leading global axis) written at
    TP 2 x EP 2 reads into exactly the per-rank files megatron-core itself saves at that layout."""
    convert(moe_dist[("moe", 2, 2)], tmp_path / "out", target_tp=2, target_ep=2)
    ours, theirs = _modules(tmp_path / "out"), _modules(moe[("moe", 2, 2, 1)])
    assert list(ours) == list(theirs)
    for folder, sd in theirs.items():
        mine = ours[folder]["model"]
        assert list(mine) == list(sd["model"]), folder
        for key, value in sd["model"].items():
            assert torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value, key


@pytest.mark.parametrize("name,src,dst", [("moe", (2, 2), (1, 4)), ("moe_gelu", (1, 4), (2, 2)),
                                          ("moe_gelu", (1, 4), (1, 1))])
def test_megatron_core_runs_torch_dist_experts_at_any_layout(moe_dist, tmp_path, name, src, dst):
    """Stacked keys (layers, then experts) and per-layer keys alike: the source's logits and routing."""
    run = moe_dist[(name, *src)]
    convert(run, tmp_path / "out", target_tp=dst[0], target_ep=dst[1])
    [(logits, routing)] = mcore_forward_moe([(name, tmp_path / "out", *dst)], tmp_path)
    assert (logits - torch.load(run / "logits.pt")).abs().max() < ATOL
    want = torch.load(run / "routing.pt")
    assert want and all(torch.equal(routing[k], v) for k, v in want.items())


def test_torch_dist_grouped_gemm_experts_are_refused(moe_dist, tmp_path, capsys):
    """Grouped-GEMM experts share torch_dist's keys with SequentialMLP's, but their per-rank names differ."""
    src = tmp_path / "src"
    shutil.copytree(moe_dist[("moe", 2, 2)], src)
    common = _iteration(src) / "common.pt"
    sd = torch.load(common, weights_only=False)
    sd["args"].moe_grouped_gemm = True
    torch.save(sd, common)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "grouped GEMM", "common.pt")


def test_a_bad_moe_config_is_refused_in_one_line(hf_imported, tmp_path, capsys):
    root, _, _ = hf_imported
    src = shutil.copytree(root / "qwen2_moe", tmp_path / "bad")
    cfg = json.loads((src / "config.json").read_text())
    cfg["decoder_sparse_step"] = 0
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "decoder_sparse_step is 0")


@pytest.mark.parametrize("source,load_at", [("per-rank moe 1x2", (2, 2)), ("torch_dist moe_gelu 1x4", (2, 2)),
                                            ("torch_dist moe 2x2", (1, 4)), ("torch_dist moe 2x2 cut", (1, 4))])
def test_written_torch_dist_experts_load_in_megatron_core_at_any_layout(moe, moe_dist, tmp_path, source, load_at):
    """``--to torch_dist`` puts experts on the global expert axis as megatron-core does (stacked over
    layers when every layer is alike, per layer when dense and MoE layers mix): megatron-core's own
    ``dist_checkpointing.load`` reads it at another (TP, EP) and computes the source's logits.
    ``cut``: written as many small ``.distcp`` files (``--max-shard-size``), a layer's experts and
    dense weights in different files, each keyed as the whole model is."""
    name, layout = source.split()[1:3]
    cut = ["--max-shard-size", "16KB"] if source.endswith("cut") else []
    run = moe[(name, 1, 2, 1)] if source.startswith("per-rank") else moe_dist[(name, *map(int, layout.split("x")))]
    assert main(["run", "--direct", str(run), str(tmp_path / "dist"), "--to", "torch_dist", *cut]) == 0
    assert len(list((tmp_path / "dist").rglob("*.distcp"))) >= (8 if cut else 1)
    [(logits, routing)] = mcore_forward_moe([(name, tmp_path / "dist", *load_at)], tmp_path, dist=True)
    assert (logits - torch.load(run / "logits.pt")).abs().max() < ATOL
    assert all(torch.equal(routing[k], v) for k, v in torch.load(run / "routing.pt").items())
    again = tmp_path / "again"
    assert main(["run", "--direct", str(tmp_path / "dist"), str(again), "--to", "torch_dist", *cut]) == 0
    for f in sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file() and p.suffix != ".json"):
        assert (again / f).read_bytes() == (tmp_path / "dist" / f).read_bytes(), f  # round trips byte-stable


@pytest.mark.parametrize("name,layout,load_at", [("moe", (1, 2, 1), [(1, 1), (2, 2)]),
                                                 ("moe_gelu", (2, 1, 1), [(4, 1), (1, 4)])])
def test_experts_without_extra_states_become_torch_dist_megatron_core_loads(moe, tmp_path, name, layout, load_at):
    """A per-rank MoE source saved without ``_extra_state`` entries (per-layer keys: ``moe`` mixes
    dense and MoE layers; stacked: ``moe_gelu``): the torch_dist output holds the extra state of
    every linear module, experts' and shared experts' included, and megatron-core's default-strict
    ``dist_checkpointing.load`` reads it at other (TP, EP) with the source's logits."""
    from legacy_twin import rewrite_run
    from test_torch_dist import without_extra_state

    run = moe[(name, *layout)]
    bare = rewrite_run(run, tmp_path / "bare", without_extra_state)
    assert main(["run", "--direct", str(bare), str(tmp_path / "dist"), "--to", "torch_dist"]) == 0
    for (logits, routing), at in zip(mcore_forward_moe([(name, tmp_path / "dist", *at) for at in load_at], tmp_path,
                                                       dist=True), load_at):
        assert (logits - torch.load(run / "logits.pt")).abs().max() < ATOL, at
        assert all(torch.equal(routing[k], v) for k, v in torch.load(run / "routing.pt").items()), at


# --- expert tensor parallelism: experts split over fewer ranks than the dense layers ---------------

@pytest.fixture(scope="module")
def moe_etp(tmp_path_factory):
    return mcore_moe_etp_checkpoints(tmp_path_factory.mktemp("moe_etp"))


def _same_files(ours: Path, theirs: Path, etp: int) -> None:
    """``ours`` holds exactly megatron-core's rank folders, keys in its order, tensors bit-equal,
    and args naming the expert TP."""
    mine, want = _modules(ours), _modules(theirs)
    assert list(mine) == list(want)
    for folder, sd in want.items():
        assert list(mine[folder]["model"]) == list(sd["model"]), folder
        for key, value in sd["model"].items():
            got = mine[folder]["model"][key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (folder, key)
        assert mine[folder]["args"].expert_tensor_parallel_size == etp


def test_an_expert_tp_change_equals_megatron_cores_own_shards(moe, moe_etp, tmp_path):
    """megatron-core builds experts from their full weights, so one seed gives one model at every
    expert TP: saved at TP 2 x ETP 1 x EP 2 it has only folders mp_rank_00_000 and mp_rank_01_001
    (no process holds the other pairs), each with whole experts. reshard writes and reads that."""
    etp_run = moe_etp[("moe", 2, 1, 2)]
    assert sorted(d.name for d in _iteration(etp_run).iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    convert(moe[("moe", 1, 2, 1)], tmp_path / "to_etp", target_tp=2, target_etp=1)
    _same_files(tmp_path / "to_etp", etp_run, 1)
    convert(etp_run, tmp_path / "tp1", target_tp=1)  # the expert TP follows the source's (1)
    _same_files(tmp_path / "tp1", moe[("moe", 1, 2, 1)], 1)
    convert(etp_run, tmp_path / "etp2", target_tp=2, target_etp=2)
    _same_files(tmp_path / "etp2", moe[("moe", 2, 2, 1)], 2)


#: (model, source (tp, etp, ep), target (tp, etp, ep)) around expert-TP checkpoints.
ETP_CONVERSIONS: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = [
    ("moe_gelu", (4, 2, 2), (2, 1, 4)),
    ("moe_gelu", (4, 2, 2), (1, 1, 1)),
    ("moe", (2, 1, 2), (2, 1, 1)),
]


@pytest.mark.parametrize("case", range(len(ETP_CONVERSIONS)), ids=[f"{n}-{s}-to-{t}" for n, s, t in ETP_CONVERSIONS])
def test_megatron_core_computes_the_source_logits_at_another_expert_tp(moe_etp, tmp_path, case):
    name, (st, setp, se), (tt, tetp, te) = ETP_CONVERSIONS[case]
    run = moe_etp[(name, st, setp, se)]
    convert(run, tmp_path / "out", target_tp=tt, target_ep=te, target_etp=tetp)
    [(logits, routing)] = mcore_forward_moe([(name, tmp_path / "out", tt, te, tetp)], tmp_path)
    assert (logits - torch.load(run / "logits.pt")).abs().max() < ATOL
    want = torch.load(run / "routing.pt")
    assert want and all(torch.equal(routing[k], v) for k, v in want.items())


def test_expert_tp_sources_write_the_same_torch_dist_and_load_at_any_layout(moe, moe_etp, tmp_path):
    """A layout of global tensors has no expert TP: the expert-TP checkpoint's torch_dist is byte
    for byte the one of the same model saved at TP 1 x EP 2, and megatron-core loads it at TP 2 x
    ETP 1 x EP 2 with the source's logits."""
    run = moe_etp[("moe", 2, 1, 2)]
    assert main(["run", "--direct", str(run), str(tmp_path / "a"), "--to", "torch_dist"]) == 0
    assert main(["run", "--direct", str(moe[("moe", 1, 2, 1)]), str(tmp_path / "b"), "--to", "torch_dist"]) == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for f in files:
        if f.suffix != ".json" and f.name != "common.pt":  # the manifest and args name their source
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    [(logits, routing)] = mcore_forward_moe([("moe", tmp_path / "a", 2, 2, 1)], tmp_path, dist=True)
    assert (logits - torch.load(run / "logits.pt")).abs().max() < ATOL
    assert all(torch.equal(routing[k], v) for k, v in torch.load(run / "routing.pt").items())


@pytest.mark.parametrize("flags,needles", [
    (["--target-tp", "2", "--target-etp", "4"], ["expert tensor parallelism 4 does not divide", "--target-etp"]),
    (["--target-tp", "4", "--target-etp", "2"], []),  # fine: plan only (below)
    (["--to", "torch_dist", "--target-etp", "2"], ["holds global tensors", "--target-etp"]),
])
def test_an_expert_tp_the_output_cannot_hold_is_refused(moe, tmp_path, capsys, flags, needles):
    src = moe[("moe_gelu", 2, 1, 1)]
    if not needles:
        assert main(["plan", str(src), *flags]) == 0
        return
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), *flags], tmp_path / "o", *needles)


def test_expert_tp_on_a_dense_model_is_refused(sample_factory, tmp_path, capsys):
    src = sample_factory(tp=2)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "2", "--target-etp", "1"],
             tmp_path / "o", "no experts", "--target-etp")


def test_an_incomplete_expert_tp_checkpoint_is_refused(moe_etp, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(moe_etp[("moe_gelu", 4, 2, 2)], src)
    assert sorted(d.name for d in _iteration(src).iterdir()) == [
        "mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]
    shutil.rmtree(_iteration(src) / "mp_rank_02_001")
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "expert-parallel rank 1 lacks tensor-parallel rank 2", "experts' TP is 2")


def test_an_expert_tp_above_the_tp_is_refused_in_per_rank_files(moe_etp, tmp_path, capsys):
    """Megatron-LM's processes sharing a file name would hold different expert slices: no such files."""
    src = copy_with_args(moe_etp[("moe", 2, 1, 2)], tmp_path / "src", expert_tensor_parallel_size=4)
    _refused(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"], tmp_path / "o",
             "expert tensor parallelism 4 does not divide the tensor parallelism 2", "torch_dist")


def test_the_flow_reshards_an_expert_tp_checkpoint_from_s3(moe_etp, tmp_path, request, monkeypatch):
    """Only some (TP rank, EP rank) folders exist, the grid repeats files: the flow from object
    storage fetches each once and writes the same bytes as ``--direct``."""
    request.getfixturevalue("prefect_env")
    from conftest import upload_to_s3
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    src = moe_etp[("moe_gelu", 4, 2, 2)]
    source, so = upload_to_s3(src, request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"),
                              monkeypatch, prefix="moe_etp")
    run_flow(ReshardParams(source=source, destination=str(tmp_path / "flow"), target_tp=2, target_ep=4, target_etp=1,
                           storage_options=so, cache_dir=str(tmp_path / "cache")))
    assert main(["run", "--direct", str(src), str(tmp_path / "direct"), "--target-tp", "2", "--target-ep", "4",
                 "--target-etp", "1"]) == 0
    files = {p.relative_to(tmp_path / "direct").as_posix() for p in (tmp_path / "direct").rglob("*") if p.is_file()}
    assert len([f for f in files if f.endswith("model_optim_rng.pt")]) == 4  # TP 2 x ETP 1 x EP 4: four pairs
    for f in sorted(files - {"reshard_manifest.json"}):
        assert (tmp_path / "flow" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f
    manifest = json.loads((tmp_path / "flow" / "reshard_manifest.json").read_text())
    assert manifest["source"]["etp"] == 2 and len(manifest["source"]["files"]) == 4  # each rank file once


def test_an_expert_tp_that_cannot_split_the_experts_names_target_etp():
    """Experts 6 rows wide cannot be split over an expert TP of 4, whatever the target TP: the
    error names ``--target-etp``, not a target TP (a target TP hint could not fix it)."""
    from reshard.core.errors import LayoutError
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import CanonicalParam
    from reshard.execution.specs import target_specs
    from reshard.models import resolve_family

    key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    family, resolution = resolve_family(["embedding.word_embeddings.weight", key])
    param = CanonicalParam(key=key, rule=resolution.by_key[key], shape=(6, 8), dtype=torch.float32, layer=0,
                           stage=0, src_key=key, order=(0, 0, 0))

    def specs(experts: tuple[int, int | None] | None) -> None:
        """The specs of a TP 1 -> 4 conversion, the experts at an expert TP of their own or at the target TP."""
        target_specs([param], ReshardOptions(target_tp=4, swiglu=False), None, 3.0, 8, 8, 8, 1, 4, {}, "here",
                     family, experts=experts)

    with pytest.raises(LayoutError, match="routed experts' tensor parallelism 4") as err:
        specs(experts=(1, 4))
    assert err.value.culprit == "--target-etp"
    with pytest.raises(LayoutError) as err:  # the expert TP follows the target TP: the TP hint stands
        specs(experts=None)
    assert err.value.culprit == key and err.value.hint == "choose a target TP among 1, 2, 3, 6"


def test_the_flow_waits_for_the_files_each_target_reads(moe_etp, tmp_path):
    """The flow fetches, checks and waits for each target's source files by name. Resharding an
    expert-TP checkpoint to its own layout, each output file reads exactly its own source file —
    though the located grid stands other files in for the pairs Megatron-LM does not save."""
    from reshard.core.options import ReshardOptions
    from reshard.tasks.identity import conversion_id
    from reshard.tasks.shard_tasks import discover_shards
    from reshard.tasks.target_tasks import locate_source, plan_layout

    src = moe_etp[("moe_gelu", 4, 2, 2)]
    options = ReshardOptions(target_tp=4).to_record()
    disc = discover_shards.fn(str(src), {}, options)
    base = {"destination": str(tmp_path / "out"), "storage_options": {}, "overwrite": False, "device": None,
            "options": options, "target_config": None, "cache_dir": str(tmp_path / "cache"),
            "gpu_concurrency_limit": None}
    located = locate_source.fn(base, disc, {}, conversion_id(disc["objects"], options))
    layout = plan_layout.fn(located, {})
    assert {t["name"]: t["sources"] for t in layout["targets"]} == {
        f"iter_0000007/{d}/model_optim_rng.pt": [f"iter_0000007/{d}/model_optim_rng.pt"]
        for d in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001")}


@pytest.mark.parametrize("key,expert", [
    ("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight", 7),
    ("decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.bias", 0),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight12", 12),
    ("decoder.layers.0.mlp.experts.linear_fc2.bias3", 3),
    ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", None),
    ("decoder.layers.1.mlp.router.weight", None),
    ("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1._extra_state", 5),
    ("decoder.layers.2.mlp.shared_experts.linear_fc1._extra_state", None),
    ("decoder.layers.2.self_attention.linear_qkv._extra_state", None),
    ("decoder.layers.1.mlp.linear_fc1.weight", None),
])
def test_the_rule_tables_expert_flag_agrees_with_the_familys_expert_numbering(key, expert):
    """The planner deals out experts and picks the expert TP by the rule's flag; the family renumbers
    them by name: the two must name the same parameters (a shared expert is split like a dense MLP)."""
    from reshard.core.rules import resolve
    from reshard.models.megatron_gpt import MEGATRON_GPT_RULES, expert_index

    rule = resolve([key], MEGATRON_GPT_RULES).by_key[key]
    assert expert_index(key) == expert
    assert rule.expert is (expert is not None)
