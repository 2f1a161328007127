"""GLM-4.5 / 4.6 / 4.7 between transformers' ``Glm4MoeForCausalLM`` and megatron-core's GPT model,
checked against both libraries.

Sources are tiny random models made by transformers (fixed seed, float32, norms, biases and expert
biases made distinct): ``glm45`` has GLM-4.5's settings at toy sizes — a QKV bias, query/key norms,
partial rotary left to transformers' default (0.5: half of each head's 8 dims rotate), GQA, a dense
first layer, 4 sigmoid-routed experts with an expert bias in 2 groups of which one is kept (top-2:
megatron-core's group score is GLM's there), a shared expert, routed scaling 2.5; ``air`` has
GLM-4.5-Air's (no query/key norms) with every group kept (``topk_group == n_group``: no group
routing in megatron-core) and two shared experts; ``glm45_mtp`` adds a multi-token prediction layer
as the releases hold it. Each is imported into megatron-core per-rank files at (TP, EP) (1, 1) and
(2, 2); megatron-core 0.16.1 builds the model from the saved ``args`` (local spec, gloo, on the CPU),
loads each strictly and must give transformers' logits (and its MTP layer transformers' MTP logits).
The export back gives every tensor bit for bit; megatron-core's own TP 2 x EP 2 checkpoint exports
to a folder transformers computes megatron-core's logits from. Each plausible wrong import (the
whole head rotated, group routing or the routed scaling dropped) moves the logits far above the
tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_fixtures import TOKENS, copy_with_args, edit_saved_args, needs_mcore, run_harness
from reshard.cli import main
from test_deepseek import add_mtp_layer, dequantized_logits, hf_folder_logits, mtp_reference
from test_hf_export import hf_tensors
from test_hf_import import make_fp8_folder, randomized

pytestmark = needs_mcore
TOL = 5e-5
_GLM45 = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_shared_experts=1, n_routed_experts=4,
              routed_scaling_factor=2.5, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
              norm_topk_prob=True, attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
              max_position_embeddings=64, tie_word_embeddings=False, num_mtp_layers=0,
              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
MODELS = {
    "glm45": _GLM45,
    "air": {**_GLM45, "use_qk_norm": False, "topk_group": 2, "n_shared_experts": 2, "routed_scaling_factor": 1.0},
}
#: Wrong imports (edits of the saved args of ``glm45`` at TP 2 x EP 2) the logits must catch.
WRONG = {
    "whole head rotated": {"rotary_percent": 1.0},
    "group routing ignored": {"moe_router_num_groups": None, "moe_router_group_topk": None},
    "routed scaling factor dropped": {"moe_router_topk_scaling_factor": None},
}

#: A GLM-4.5-like model as megatron-core builds it (the harness's model options): QKV bias, query/key
#: norms, half of each head rotated, a dense first layer, sigmoid routing with expert bias in 2
#: groups, a shared expert, one MTP layer.
MCORE_MODEL = {
    "layers": 2, "hidden": 32, "heads": 4, "groups": 2, "kv_channels": 8, "ffn": 48, "swiglu": True,
    "norm": "RMSNorm", "bias": False, "qkv_bias": True, "eps": 1e-5, "pos": "rope", "rotary_percent": 0.5,
    "rope_base": 50000.0, "qk_norm": True, "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128,
    "seq": 64, "experts": 4, "topk": 2, "moe_ffn": 12, "shared_ffn": 12, "moe_layer_freq": [0, 1],
    "expert_bias": True, "norm_noise": True, "mtp": 1,
    "router": {"moe_router_score_function": "sigmoid", "moe_router_num_groups": 2, "moe_router_group_topk": 1,
               "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32"},
}


def make_glm(config: dict, folder: Path, seed: int = 0) -> torch.Tensor:
    """Save a random Glm4MoeForCausalLM of ``config`` to ``folder`` (``partial_rotary_factor`` left
    out of its config.json: transformers' default); its logits for the test tokens."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    model = randomized(Glm4MoeForCausalLM, Glm4MoeConfig(**config), seed)
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["rope_parameters"].pop("partial_rotary_factor")  # as the releases' config.json: the class default
    (folder / "config.json").write_text(json.dumps(saved))
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def _run(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), *extra]) == 0
    return out


@pytest.fixture(scope="session")
def glm_runs(tmp_path_factory):
    """Both models imported at (TP, EP) (1, 1) and (2, 2); ``glm45`` with an MTP layer at TP 2 x EP 2,
    at TP 1 x PP 2, into torch_dist and back to TP 1 x EP 2; an FP8 copy of ``glm45``; ``glm45``
    wrongly in each way of :data:`WRONG`; megatron-core's own :data:`MCORE_MODEL` written at TP 2 x
    EP 2; megatron-core's logits (and MTP logits) for each, two harness runs."""
    root = tmp_path_factory.mktemp("glm4_moe")
    written = root / "mcore_write"
    run_harness([{"kind": "write", "out": str(written), "tp": 2, "ep": 2, "model": MCORE_MODEL, "tokens": TOKENS}],
                root)
    hf, want, runs = {}, {}, {}
    for name, config in MODELS.items():
        hf[name] = root / "hf" / name
        want[name] = make_glm(config, hf[name])
        for tp, ep in ((1, 1), (2, 2)):
            runs[(name, tp, ep)] = _run(hf[name], root / f"{name}_tp{tp}_ep{ep}", "--target-tp", str(tp),
                                        "--target-ep", str(ep))
    hf["glm45_mtp"] = root / "hf" / "glm45_mtp"
    want["glm45_mtp"] = make_glm(_GLM45, hf["glm45_mtp"])
    add_mtp_layer(hf["glm45_mtp"])
    want["glm45_mtp.mtp"] = mtp_reference(hf["glm45_mtp"])
    runs[("glm45_mtp", 2, 2)] = _run(hf["glm45_mtp"], root / "glm45_mtp_tp2_ep2", "--target-tp", "2",
                                     "--target-ep", "2")
    # over two pipeline stages: the MoE layer, the MTP layer and megatron-core's copy of the embeddings on the last
    runs["glm45_mtp_pp2"] = _run(hf["glm45_mtp"], root / "glm45_mtp_pp2", "--target-tp", "1", "--target-pp", "2")
    hf["glm45_fp8"] = root / "hf" / "glm45_fp8"  # as the FP8 releases: block-scaled linear weights
    want["glm45_fp8"] = dequantized_logits(hf["glm45"], make_fp8_folder(hf["glm45"], hf["glm45_fp8"], torch.float32),
                                           root / "hf" / "glm45_fp8_dequantized")
    runs[("glm45_fp8", 2, 2)] = _run(hf["glm45_fp8"], root / "glm45_fp8_tp2_ep2", "--target-tp", "2",
                                     "--target-ep", "2")
    for what, edit in WRONG.items():
        runs[what] = edit_saved_args(_run(hf["glm45"], root / f"wrong_{len(runs)}", "--target-tp", "2",
                                          "--target-ep", "2"), **edit)
    dist = _run(runs[("glm45_mtp", 2, 2)], root / "glm45_mtp_dist", "--to", "torch_dist")
    runs["glm45_mtp_from_dist"] = _run(dist, root / "glm45_mtp_from_dist", "--target-tp", "1", "--target-ep", "2")
    layouts = {"glm45_mtp_pp2": (1, 1, 2), "glm45_mtp_from_dist": (1, 2, 1)}
    jobs = [{"kind": "forward", "ckpt": str(run), "tp": tp, "ep": ep, "pp": pp, "from_args": True, "model": {},
             "tokens": TOKENS, "out": str(root / f"forward_{i}.pt")}
            for i, (key, run) in enumerate(runs.items())
            for tp, ep, pp in [layouts.get(key, (*key[1:], 1) if isinstance(key, tuple) else (2, 2, 1))]]
    runs["glm45_mtp_dist"] = dist
    jobs.append({"kind": "forward_dist", "ckpt": str(dist), "tp": 2, "ep": 2, "from_args": True, "model": {},
                 "tokens": TOKENS, "out": str(root / "forward_dist.pt")})
    run_harness(jobs, root)
    got = {}
    for key, job in zip(runs, jobs):
        got[key] = torch.load(job["out"])
        mtp = torch.load(job["out"] + ".mtp")
        if mtp:
            got[(key if isinstance(key, str) else key[0]) + ".mtp"] = mtp
    return {"hf": hf, "want": want, "runs": runs, "got": got, "written": written}


@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=["tp1_ep1", "tp2_ep2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_runs_the_import_with_transformers_logits(glm_runs, name, layout):
    logits = glm_runs["got"][(name, *layout)]
    torch.testing.assert_close(logits[:, :128], glm_runs["want"][name], rtol=0, atol=TOL)


def test_the_import_writes_glms_settings_as_megatron_lms_args(glm_runs):
    args = torch.load(glm_runs["runs"][("glm45", 2, 2)] / "release" / "mp_rank_00_000" / "model_optim_rng.pt",
                      weights_only=False)["args"]
    assert (args.rotary_percent, args.add_qkv_bias, args.add_bias_linear, args.qk_layernorm) == (0.5, True, False, True)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_num_groups,
            args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert args.moe_layer_freq == [0, 1] and args.moe_shared_expert_intermediate_size == 12
    air = torch.load(glm_runs["runs"][("air", 1, 1)] / "release" / "mp_rank_00" / "model_optim_rng.pt",
                     weights_only=False)["args"]
    assert air.moe_router_num_groups is None and not air.qk_layernorm  # every group kept: no group routing


def test_megatron_core_runs_the_imported_mtp_layer_with_transformers_mtp_logits(glm_runs):
    logits = glm_runs["got"][("glm45_mtp", 2, 2)]
    torch.testing.assert_close(logits[:, :128], glm_runs["want"]["glm45_mtp"], rtol=0, atol=TOL)
    (mtp,) = glm_runs["got"]["glm45_mtp.mtp"]
    torch.testing.assert_close(mtp[:-1, :128], glm_runs["want"]["glm45_mtp.mtp"], rtol=0, atol=TOL)
    assert (mtp[:-1, :128] - logits[:-1, :128]).abs().max() > 1e-2  # not the main head's logits again


def test_an_fp8_glm_folder_is_imported_as_the_model_it_encodes(glm_runs):
    logits = glm_runs["got"][("glm45_fp8", 2, 2)]
    torch.testing.assert_close(logits[:, :128], glm_runs["want"]["glm45_fp8"], rtol=0, atol=TOL)


def test_the_fp8_export_of_a_glm_model_encodes_every_linear_weight(glm_runs, tmp_path):
    out = _run(glm_runs["runs"][("glm45_mtp", 2, 2)], tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    got = hf_tensors(out)
    fp8 = sorted(k for k, v in got.items() if v.dtype == torch.float8_e4m3fn)
    assert {k.split(".")[-2] for k in fp8} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"}
    assert all(k + "_scale_inv" in got for k in fp8)
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight", "lm_head.weight"):
        assert got[k].dtype == torch.float32, k
    config = json.loads((out / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in config["quantization_config"]["modules_to_not_convert"]


def test_megatron_core_runs_the_mtp_layer_imported_over_pipeline_stages(glm_runs):
    logits = glm_runs["got"]["glm45_mtp_pp2"]
    torch.testing.assert_close(logits[:, :128], glm_runs["want"]["glm45_mtp"], rtol=0, atol=TOL)
    (mtp,) = glm_runs["got"]["glm45_mtp_pp2.mtp"]
    torch.testing.assert_close(mtp[:-1, :128], glm_runs["want"]["glm45_mtp.mtp"], rtol=0, atol=TOL)


@pytest.mark.parametrize("case", ["glm45_mtp_dist", "glm45_mtp_from_dist"], ids=["torch_dist_out", "torch_dist_in"])
def test_the_mtp_layer_goes_through_torch_dist_both_ways(glm_runs, case):
    torch.testing.assert_close(glm_runs["got"][case][:, :128], glm_runs["want"]["glm45_mtp"], rtol=0, atol=TOL)
    (mtp,) = glm_runs["got"][case + ".mtp"]
    torch.testing.assert_close(mtp[:-1, :128], glm_runs["want"]["glm45_mtp.mtp"], rtol=0, atol=TOL)


@pytest.mark.parametrize("what", list(WRONG))
def test_the_logits_comparison_catches_each_plausible_wrong_import(glm_runs, what):
    assert (glm_runs["got"][what][:, :128] - glm_runs["want"]["glm45"]).abs().max() > 100 * TOL, what


@pytest.mark.parametrize("name", [*MODELS, "glm45_mtp"])
def test_the_export_gives_back_every_tensor_bit_for_bit_and_the_config(glm_runs, name, tmp_path):
    out = _run(glm_runs["runs"][(name, 2, 2)], tmp_path / "hf", "--to", "hf")
    want, got = hf_tensors(glm_runs["hf"][name]), hf_tensors(out)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((glm_runs["hf"][name] / "config.json").read_text())
    for key in ("num_key_value_heads", "head_dim", "n_shared_experts", "n_routed_experts", "num_experts_per_tok",
                "routed_scaling_factor", "first_k_dense_replace", "rms_norm_eps", "attention_bias", "use_qk_norm",
                "norm_topk_prob", "intermediate_size", "moe_intermediate_size"):
        assert config[key] == source[key], key
    assert (config["n_group"], config["topk_group"]) == ((2, 1) if name != "air" else (1, 1))
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5}
    assert config["num_nextn_predict_layers"] == (name == "glm45_mtp")
    torch.testing.assert_close(hf_folder_logits(out), glm_runs["want"][name], rtol=0, atol=1e-6)


def test_transformers_runs_the_export_of_megatron_cores_own_checkpoint_with_its_logits(glm_runs, tmp_path):
    src = glm_runs["written"]
    out = _run(src, tmp_path / "hf", "--to", "hf")
    torch.testing.assert_close(hf_folder_logits(out), torch.load(src / "logits.pt")[:, :128], rtol=0, atol=TOL)
    (mtp,) = torch.load(src / "mtp_logits.pt")
    torch.testing.assert_close(mtp_reference(out), mtp[:-1, :128], rtol=0, atol=TOL)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_nextn_predict_layers"], config["n_group"]) == (
        ["Glm4MoeForCausalLM"], 1, 2)


def _refused(src: Path, dst: Path, capsys, *extra: str) -> str:
    assert main(["run", "--direct", str(src), str(dst), *extra]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("change,words", [
    ({"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
     "n_group 4, topk_group 2, num_experts_per_tok 2"),
    ({"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3},
     "n_group 2, topk_group 1, num_experts_per_tok 3"),
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor 0.3"),
    ({"hidden_act": "gelu"}, "activation gelu"),
    ({"n_shared_experts": 0}, "no shared expert"),
])
def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(glm_runs, tmp_path, capsys, change, words):
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((glm_runs["hf"]["glm45"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    shutil.copy(glm_runs["hf"]["glm45"] / "model.safetensors", src)
    assert words in _refused(src, tmp_path / "out", capsys, "--target-tp", "1")


@pytest.mark.parametrize("change,words", [
    ({"moe_router_topk": 4, "moe_router_group_topk": 1}, "moe_router_num_groups 2, moe_router_group_topk 1, "
                                                         "moe_router_topk 4"),
    ({"rotary_percent": 0.3}, "rotary_percent 0.3"),
    ({"moe_shared_expert_gate": True}, "gated shared expert"),
    ({"rotary_interleaved": True}, "interleaved rotary"),
])
def test_an_export_transformers_would_compute_otherwise_is_refused_in_one_line(glm_runs, tmp_path, capsys, change,
                                                                               words):
    src = copy_with_args(glm_runs["runs"][("glm45", 2, 2)], tmp_path / "src", **change)
    assert words in _refused(src, tmp_path / "out", capsys, "--to", "hf")


def test_group_routing_that_keeps_every_group_is_exported_as_none(glm_runs, tmp_path):
    """megatron-core keeping 2 of 2 groups routes over every expert: GLM's ``n_group`` 1 computes it."""
    src = copy_with_args(glm_runs["runs"][("glm45", 2, 2)], tmp_path / "src", moe_router_group_topk=2)
    config = json.loads((_run(src, tmp_path / "hf", "--to", "hf") / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["num_experts_per_tok"]) == (1, 1, 2)
