"""DeepSeek-V3-class models (multi-latent attention, DeepSeek MoE) between transformers'
``DeepseekV3ForCausalLM`` and megatron-core's MLA + MoE GPT model, checked against both libraries.

Sources are tiny random models made by transformers (fixed seed, float32, norms and expert biases
made distinct): ``v3`` has DeepSeek-V3's settings at toy sizes — query and key-value latent
ranks, YaRN (factor 40, mscale and mscale_all_dim 1), a dense first layer, 4 sigmoid-routed
experts with an expert bias in 2 groups of which one is kept (top-2: group routing changes the
chosen experts, checked), a shared expert, routed scaling 2.5; ``v2_lite`` has no query latent
(``q_lora_rank`` null: ``linear_q_proj``), plain rope, no groups, two shared experts. Each is
imported into megatron-core per-rank files at (TP, EP) (1, 1) and (2, 2) (``v3`` also from an FP8
block-scaled copy, and into torch_dist); megatron-core 0.16.1 builds the model from the saved
``args`` (local spec, gloo, on the CPU), loads each strictly and must give transformers' logits.
The export back gives every tensor bit for bit and a ``config.json`` transformers computes the
same logits from. Each plausible wrong answer moves the logits far above the tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_fixtures import TOKENS, copy_with_args, edit_saved_args, iteration_folder, needs_mcore, run_harness
from quantized_releases import compress_folder_ct
from reshard.cli import main
from reshard.core.lazy import RowConcat
from reshard.models import hf_deepseek
from test_hf_export import hf_tensors
from test_hf_import import make_fp8_folder, randomized

pytestmark = needs_mcore
TOL = 5e-5
_V3 = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
           routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=6,
           qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
           norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=160, tie_word_embeddings=False,
           num_mtp_layers=0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                              "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                              "original_max_position_embeddings": 4})
#: Kimi-K2.5's kind of model: experts whose widths are whole groups of 32 (its INT4 groups).
_K25 = {**_V3, "moe_intermediate_size": 32}
MODELS = {
    "v3": _V3,
    "v2_lite": {**_V3, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
                "routed_scaling_factor": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
}


def make_deepseek(config: dict, folder: Path, seed: int = 0, edit=None) -> torch.Tensor:
    """Save a random DeepseekV3ForCausalLM of ``config`` to ``folder``; its logits for the test tokens
    (``edit(model)`` changes the model after saving: what a wrong conversion would compute)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = randomized(DeepseekV3ForCausalLM, DeepseekV3Config(**config), seed)
    if folder is not None:
        model.save_pretrained(folder)
    if edit is not None:
        edit(model)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def add_mtp_layer(folder: Path, seed: int = 5) -> None:
    """Give the saved model in ``folder`` one multi-token prediction layer as DeepSeek publishes it:
    ``model.layers.{L}`` with ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer of the last layer's
    kind, ``shared_head.norm`` and copies of the embeddings and head (``embed_tokens``,
    ``shared_head.head``); ``num_nextn_predict_layers`` 1. transformers makes no MTP weights itself."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for key, w in list(tensors.items()):
        if key.startswith(last):
            scale = 0.1 if key.endswith("e_score_correction_bias") else 0.3
            tensors[mtp + key[len(last):]] = torch.randn(w.shape, generator=g) * scale + (1.0 if "norm" in key else 0.0)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=g)
    tensors[mtp + "eh_proj.weight"] = 0.3 * torch.randn(hidden, 2 * hidden, generator=g)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def mtp_reference(folder: Path) -> torch.Tensor:
    """transformers' own multi-token prediction (``MtpModel``, what ``generate(use_mtp=True)`` drafts
    with) for the test tokens: the MTP layer of ``folder`` on the main model's last hidden states and
    the next tokens' embeddings, through the shared head. Positions 0..s-2 (the last has no next token)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = main.config.num_hidden_layers
    prefix = f"model.layers.{layers}."
    own = {k[len(prefix):]: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix)}
    experts = main.config.n_routed_experts
    state = {f"layers.0.{k.replace('shared_head.norm', 'post_norm')}": own.pop(k)
             for k in list(own) if k.split(".")[0] in ("enorm", "hnorm", "eh_proj") or k.startswith("shared_head.norm")}
    state["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([own.pop(f"mlp.experts.{e}.gate_proj.weight"), own.pop(f"mlp.experts.{e}.up_proj.weight")])
         for e in range(experts)])
    state["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack(
        [own.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(experts)])
    state.update({f"layers.0.mtp_block.{k}": v for k, v in own.items()
                  if k not in ("embed_tokens.weight", "shared_head.head.weight")})
    mtp = MtpModel(main, 1).eval()
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        out = mtp.forward_layer(0, hidden, torch.arange(len(TOKENS))[None], None, input_ids=torch.roll(ids, -1, 1))
        return mtp._project_to_logits(out)[0, :-1]


def hf_folder_logits(folder: Path) -> torch.Tensor:
    """transformers' logits for the test tokens of the model saved in ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def dequantized_logits(src: Path, tensors: dict[str, torch.Tensor], folder: Path) -> torch.Tensor:
    """transformers' logits of ``src``'s model with ``tensors`` (an FP8 folder's weights dequantized by
    DeepSeek's formula), saved as a plain folder in transformers' own per-expert names."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((src / "config.json").read_text())
    return hf_folder_logits(folder)


def _run(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), *extra]) == 0
    return out


def _kv_b_not_per_head(self, names, parts, facts):
    """kv_b_proj read as all heads' no-rope key rows, then all value rows (not ``[nope | v]`` per head)."""
    w = parts[0]
    heads, per = facts.heads, w.shape[0] // facts.heads
    nope = per - facts.head_dim
    return RowConcat([(w, h * per, nope) for h in range(heads)] + [(w, h * per + nope, facts.head_dim)
                                                                    for h in range(heads)])


class _WrongSame(hf_deepseek.Same):
    gather = _kv_b_not_per_head


def _table_with(row_hf: str, transform) -> tuple:
    return tuple(dataclasses.replace(r, transform=transform) if r.hf and r.hf[0].endswith(row_hf) else r
                 for r in hf_deepseek.DEEPSEEK_V3_NAMES)


#: plausible wrong imports (megatron-core side): an edit of the saved args, or a misread tensor
WRONG = {
    "group routing ignored": {"moe_router_num_groups": None, "moe_router_group_topk": None},
    "routed scaling factor dropped": {"moe_router_topk_scaling_factor": None},
    "YaRN read as plain rope": {"rope_type": "rope"},
    "kv_b rows not [nope | v] per head": "kv_b_proj.weight",
}


#: A DeepSeek-V3-like model as megatron-core builds it (the harness's model options): MLA with YaRN,
#: a dense first layer, sigmoid routing with expert bias in 2 groups, a shared expert, one MTP layer.
#: No kv_channels: its args hold Megatron-LM's default, hidden / heads = 8, not v_head_dim 6 (Megatron-LM
#: ignores kv_channels under MLA).
MCORE_MODEL = {
    "layers": 2, "hidden": 32, "heads": 4, "ffn": 48, "swiglu": True, "norm": "RMSNorm", "bias": False, "eps": 1e-6,
    "pos": "rope", "qk_norm": True, "tied": False, "vocab": 128, "divisible_by": 32,
    "saved_vocab_size": 128, "seq": 160, "experts": 4, "topk": 2, "moe_ffn": 12, "shared_ffn": 12,
    "moe_layer_freq": [0, 1], "expert_bias": True, "norm_noise": True, "mtp": 1,
    "router": {"moe_router_score_function": "sigmoid", "moe_router_num_groups": 2, "moe_router_group_topk": 1,
               "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32"},
    "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6,
            "rope_type": "yarn", "rotary_base": 10000.0, "rotary_scaling_factor": 40.0,
            "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0},
}


@pytest.fixture(scope="session")
def mcore_written(tmp_path_factory):
    """:data:`MCORE_MODEL` written by megatron-core itself at TP 2 x EP 2, per-rank files and torch_dist
    (same seed), with its logits and its MTP layer's logits."""
    root = tmp_path_factory.mktemp("deepseek_mcore")
    jobs = [{"kind": kind, "out": str(root / kind), "tp": 2, "ep": 2, "model": MCORE_MODEL, "tokens": TOKENS}
            for kind in ("write", "write_dist")]
    # and over two pipeline stages: the MTP layer and megatron-core's copy of the embeddings on the last
    jobs.append({"kind": "write", "out": str(root / "write_pp2"), "tp": 1, "pp": 2, "ep": 1, "model": MCORE_MODEL,
                 "tokens": TOKENS})
    run_harness(jobs, root)
    return root


@pytest.mark.parametrize("kind,folder", [("write", "run"), ("write", "iteration"), ("write_dist", "run")],
                         ids=["per_rank", "per_rank_iteration_folder", "torch_dist"])
def test_transformers_runs_the_export_of_megatron_cores_own_checkpoint_with_its_logits(mcore_written, kind, folder,
                                                                                      tmp_path):
    src = mcore_written / kind
    out = _run(src if folder == "run" else iteration_folder(src), tmp_path / "hf", "--to", "hf")
    torch.testing.assert_close(hf_folder_logits(out), torch.load(src / "logits.pt")[:, :128], rtol=0, atol=TOL)
    (mtp,) = torch.load(src / "mtp_logits.pt")
    torch.testing.assert_close(mtp_reference(out), mtp[:-1, :128], rtol=0, atol=TOL)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["n_group"] == 2 and config["routed_scaling_factor"] == 2.5
    from safetensors.torch import load_file  # the MTP layer's copies (vLLM reads them) are the model's own, every row

    t = load_file(out / "model.safetensors")
    assert torch.equal(t["model.layers.2.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t["model.layers.2.shared_head.head.weight"], t["lm_head.weight"])


@pytest.fixture(scope="session")
def deepseek_runs(tmp_path_factory, mcore_written):
    """Both models imported at (TP, EP) (1, 1) and (2, 2), v3 also from FP8 and into torch_dist and
    wrongly in each way of :data:`WRONG`; megatron-core's own checkpoints (:func:`mcore_written`) from
    torch_dist to per-rank files at TP 1 and from per-rank files to torch_dist; megatron-core's logits
    and routing for each, one harness run."""
    root = tmp_path_factory.mktemp("deepseek")
    hf, want, runs = {}, {}, {}
    for name, config in MODELS.items():
        hf[name] = root / "hf" / name
        want[name] = make_deepseek(config, hf[name])
        for tp, ep in ((1, 1), (2, 2)):
            runs[(name, tp, ep)] = _run(hf[name], root / f"{name}_tp{tp}_ep{ep}", "--target-tp", str(tp),
                                        "--target-ep", str(ep))
    hf["v3_mtp"] = root / "hf" / "v3_mtp"
    want["v3_mtp"] = make_deepseek(_V3, hf["v3_mtp"])
    add_mtp_layer(hf["v3_mtp"])
    want["v3_mtp.mtp"] = mtp_reference(hf["v3_mtp"])
    runs[("v3_mtp", 2, 2)] = _run(hf["v3_mtp"], root / "v3_mtp_tp2_ep2", "--target-tp", "2", "--target-ep", "2")
    hf["v3_fp8"] = root / "hf" / "v3_fp8"
    want["v3_fp8"] = dequantized_logits(hf["v3"], make_fp8_folder(hf["v3"], hf["v3_fp8"], torch.float32),
                                        root / "hf" / "v3_fp8_dequantized")
    runs[("v3_fp8", 2, 2)] = _run(hf["v3_fp8"], root / "v3_fp8_tp2_ep2", "--target-tp", "2", "--target-ep", "2")
    # Kimi-K2.5's release: the routed experts INT4 (compressed-tensors pack-quantized, group 32), the rest kept
    hf["v3_k25_bf"], hf["v3_k25"] = root / "hf" / "v3_k25_bf", root / "hf" / "v3_k25"
    want["v3_k25_unquantized"] = make_deepseek(_K25, hf["v3_k25_bf"])
    want["v3_k25"] = dequantized_logits(hf["v3_k25_bf"], compress_folder_ct(
        hf["v3_k25_bf"], hf["v3_k25"], "w4a16", r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj",
        ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*layers\\.0\\.mlp.*"]),
        root / "hf" / "v3_k25_dequantized")
    runs[("v3_k25", 2, 2)] = _run(hf["v3_k25"], root / "v3_k25_tp2_ep2", "--target-tp", "2", "--target-ep", "2")
    for what, wrong in WRONG.items():
        out = root / f"wrong_{len(runs)}"
        if isinstance(wrong, dict):
            edit_saved_args(_run(hf["v3"], out, "--target-tp", "2", "--target-ep", "2"), **wrong)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(hf_deepseek.DEEPSEEK_V3, "names", _table_with(wrong, _WrongSame()))
                _run(hf["v3"], out, "--target-tp", "2", "--target-ep", "2")
        runs[what] = out
    dists = {"dist": _run(hf["v3"], root / "v3_dist", "--to", "torch_dist"),
             "mtp_dist": _run(runs[("v3_mtp", 2, 2)], root / "v3_mtp_dist", "--to", "torch_dist"),
             "mcore_to_dist": _run(mcore_written / "write", root / "mcore_to_dist", "--to", "torch_dist")}
    runs["mcore_from_dist"] = _run(mcore_written / "write_dist", root / "mcore_from_dist", "--target-tp", "1",
                                   "--target-ep", "1")
    runs["v3_mtp_from_dist"] = _run(dists["mtp_dist"], root / "v3_mtp_from_dist", "--target-tp", "1", "--target-ep",
                                    "2")
    # multi-latent attention over two pipeline stages (the dense layer on the first, the MoE layer on the last)
    runs["v3_pp2"] = _run(hf["v3"], root / "v3_pp2", "--target-tp", "1", "--target-pp", "2")
    # and with the MTP layer (on the last stage, beside megatron-core's copy of the embeddings)
    runs["v3_mtp_pp2"] = _run(hf["v3_mtp"], root / "v3_mtp_pp2", "--target-tp", "1", "--target-pp", "2")
    hf["v3_mtp4"] = root / "hf" / "v3_mtp4"  # four layers: PP 2 x VPP 2, the MTP layer in the last rank's last chunk
    want["v3_mtp4"] = make_deepseek({**_V3, "num_hidden_layers": 4}, hf["v3_mtp4"])
    add_mtp_layer(hf["v3_mtp4"])
    want["v3_mtp4.mtp"] = mtp_reference(hf["v3_mtp4"])
    runs["v3_mtp4_vpp"] = _run(hf["v3_mtp4"], root / "v3_mtp4_vpp", "--target-tp", "1", "--target-pp", "2",
                               "--target-vpp", "2")
    layouts = {"v3_mtp_from_dist": (1, 2, 1), "v3_pp2": (1, 1, 2), "v3_mtp_pp2": (1, 1, 2), "v3_mtp4_vpp": (1, 1, 2),
               "mcore_from_dist": (1, 1, 1)}
    jobs = [{"kind": "forward", "ckpt": str(run), "tp": tp, "ep": ep, "pp": pp, "from_args": True, "model": {},
             "tokens": TOKENS, "out": str(root / f"forward_{i}.pt")}
            for i, (key, run) in enumerate(runs.items())
            for tp, ep, pp in [layouts.get(key, (*key[1:], 1) if isinstance(key, tuple) else (2, 2, 1))]]
    jobs += [{"kind": "forward_dist", "ckpt": str(run), "tp": 2, "ep": 2, "from_args": True, "model": {},
              "tokens": TOKENS, "out": str(root / f"forward_{name}.pt")} for name, run in dists.items()]
    run_harness(jobs, root)  # one megatron-core start-up for every model
    got = {}
    for key, job in zip([*runs, *dists], jobs):
        got[key] = (torch.load(job["out"]), torch.load(job["out"] + ".routing"))
        mtp = torch.load(job["out"] + ".mtp")  # the MTP layers' logits of a model that has them
        if mtp:
            got[(key if isinstance(key, str) else key[0]) + ".mtp"] = mtp
    return {"hf": hf, "want": want, "runs": runs, "got": got, "root": root}


@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=["tp1_ep1", "tp2_ep2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_mla_runs_the_import_with_transformers_logits(deepseek_runs, name, layout):
    logits, routing = deepseek_runs["got"][(name, *layout)]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"][name], rtol=0, atol=TOL)
    assert routing  # the MoE layer routed (its router ran)


def test_multi_latent_attention_over_pipeline_stages(deepseek_runs):
    """Imported at PP 2 (the dense MLA layer on the first stage, the MoE one on the last), megatron-core
    runs the two stages in turn with transformers' logits; its last stage's router ran."""
    logits, routing = deepseek_runs["got"]["v3_pp2"]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3"], rtol=0, atol=TOL)
    assert routing


@pytest.mark.parametrize("run,model", [("v3_mtp_pp2", "v3_mtp"), ("v3_mtp4_vpp", "v3_mtp4")], ids=["pp2", "pp2_vpp2"])
def test_megatron_core_runs_the_mtp_layer_imported_over_pipeline_stages(deepseek_runs, run, model):
    """Imported at PP 2 (and PP 2 x VPP 2), megatron-core loads each stage strictly (the last holds the
    MTP layer and the copy of the embeddings it needs) and gives transformers' logits and MTP logits."""
    logits, _ = deepseek_runs["got"][run]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"][model], rtol=0, atol=TOL)
    (mtp,) = deepseek_runs["got"][run + ".mtp"]
    torch.testing.assert_close(mtp[:-1, :128], deepseek_runs["want"][model + ".mtp"], rtol=0, atol=TOL)


def test_megatron_core_runs_the_imported_mtp_layer_with_transformers_mtp_logits(deepseek_runs):
    logits, _ = deepseek_runs["got"][("v3_mtp", 2, 2)]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3_mtp"], rtol=0, atol=TOL)
    (mtp,) = deepseek_runs["got"]["v3_mtp.mtp"]  # one MTP layer: its logits for positions 0..s-2
    torch.testing.assert_close(mtp[:-1, :128], deepseek_runs["want"]["v3_mtp.mtp"], rtol=0, atol=TOL)
    assert (mtp[:-1, :128] - logits[:-1, :128]).abs().max() > 1e-2  # not the main head's logits again


@pytest.mark.parametrize("case", ["mtp_dist", "v3_mtp_from_dist"], ids=["torch_dist_out", "torch_dist_in"])
def test_the_mtp_layer_goes_through_torch_dist_both_ways(deepseek_runs, case):
    logits, _ = deepseek_runs["got"][case]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3_mtp"], rtol=0, atol=TOL)
    (mtp,) = deepseek_runs["got"][case + ".mtp"]
    torch.testing.assert_close(mtp[:-1, :128], deepseek_runs["want"]["v3_mtp.mtp"], rtol=0, atol=TOL)


@pytest.mark.parametrize("case,source", [("mcore_from_dist", "write_dist"), ("mcore_to_dist", "write")],
                         ids=["torch_dist_to_tp1", "tp2_to_torch_dist"])
def test_megatron_cores_own_mla_checkpoint_goes_through_torch_dist_with_its_logits(deepseek_runs, mcore_written, case,
                                                                                    source):
    """megatron-core's own MLA checkpoints, whose args hold Megatron-LM's default kv_channels (8, not
    v_head_dim 6): its torch_dist at TP 1 and its TP 2 files as torch_dist, loaded by megatron-core
    from the args they carry, give its logits and MTP logits."""
    logits, routing = deepseek_runs["got"][case]
    torch.testing.assert_close(logits, torch.load(mcore_written / source / "logits.pt"), rtol=0, atol=TOL)
    assert routing
    (mtp,) = deepseek_runs["got"][case + ".mtp"]
    (want,) = torch.load(mcore_written / source / "mtp_logits.pt")
    torch.testing.assert_close(mtp, want, rtol=0, atol=TOL)


def test_a_kimi_k25_int4_release_is_imported_as_the_model_it_encodes(deepseek_runs):
    """Routed experts INT4 by compressed-tensors' own compressor (group 32, symmetric), attention,
    shared experts, the dense layer and the head ignored, as Kimi-K2.5 ships: megatron-core at TP 2 x
    EP 2 computes transformers' logits of compressed-tensors' own decompression."""
    logits, _ = deepseek_runs["got"][("v3_k25", 2, 2)]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3_k25"], rtol=0, atol=TOL)
    assert (deepseek_runs["want"]["v3_k25"] - deepseek_runs["want"]["v3_k25_unquantized"]).abs().max() > 1e-3


def test_an_fp8_deepseek_folder_is_imported_as_the_model_it_encodes(deepseek_runs):
    logits, _ = deepseek_runs["got"][("v3_fp8", 2, 2)]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3_fp8"], rtol=0, atol=TOL)
    assert (deepseek_runs["want"]["v3_fp8"] - deepseek_runs["want"]["v3"]).abs().max() > 1e-3  # FP8 did round


def test_megatron_core_loads_the_torch_dist_import_with_transformers_logits(deepseek_runs):
    logits, _ = deepseek_runs["got"]["dist"]
    torch.testing.assert_close(logits[:, :128], deepseek_runs["want"]["v3"], rtol=0, atol=TOL)


@pytest.mark.parametrize("what", list(WRONG))
def test_the_logits_comparison_catches_each_plausible_wrong_import(deepseek_runs, what):
    logits, _ = deepseek_runs["got"][what]
    assert (logits[:, :128] - deepseek_runs["want"]["v3"]).abs().max() > 100 * TOL, what


def _zero_bias(model):
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def _no_shared_expert(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".shared_experts." in name:
                p.zero_()


@pytest.mark.parametrize("what,edit", [("expert bias dropped", _zero_bias),
                                       ("shared expert dropped", _no_shared_expert),
                                       ("group routing ignored", None), ("softmax instead of sigmoid", "softmax")])
def test_the_transformers_logits_move_under_each_wrong_router(deepseek_runs, what, edit, monkeypatch):
    """The reference itself is sensitive: a conversion that lost any of these would be caught."""
    config = {**_V3, "n_group": 1, "topk_group": 1} if edit is None else _V3
    if edit == "softmax":
        monkeypatch.setattr(torch.Tensor, "sigmoid", lambda self: self.softmax(-1))
        edit = None
    wrong = make_deepseek(config, None, edit=edit)
    assert (wrong - deepseek_runs["want"]["v3"]).abs().max() > 100 * TOL, what


@pytest.mark.parametrize("name", [*MODELS, "v3_mtp"])
def test_the_export_gives_back_every_tensor_bit_for_bit_and_transformers_logits(deepseek_runs, name, tmp_path):
    out = _run(deepseek_runs["runs"][(name, 2, 2)], tmp_path / "hf", "--to", "hf")
    want, got = hf_tensors(deepseek_runs["hf"][name]), hf_tensors(out)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((deepseek_runs["hf"][name] / "config.json").read_text())
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "n_shared_experts", "routed_scaling_factor", "first_k_dense_replace", "rms_norm_eps"):
        assert config[key] == source[key], key
    assert config["num_nextn_predict_layers"] == (name == "v3_mtp") and config["topk_method"] == "noaux_tc"
    torch.testing.assert_close(hf_folder_logits(out), deepseek_runs["want"][name], rtol=0, atol=1e-6)


def test_the_fp8_export_of_a_deepseek_model_encodes_every_linear_weight(deepseek_runs, tmp_path):
    out = _run(deepseek_runs["runs"][("v3", 2, 2)], tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    got = hf_tensors(out)
    fp8 = sorted(k for k, v in got.items() if v.dtype == torch.float8_e4m3fn)
    assert {k.split(".")[-2] for k in fp8} == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"}
    assert all(k + "_scale_inv" in got for k in fp8)
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.0.self_attn.kv_a_layernorm.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert got[k].dtype == torch.float32, k
    config = json.loads((out / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in config["quantization_config"]["modules_to_not_convert"]


def _refused(src: Path, dst: Path, capsys, *extra: str) -> str:
    assert main(["run", "--direct", str(src), str(dst), *extra]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("change,words", [
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"rope_interleave": False}, "rope_interleave false"),
    ({"num_experts_per_tok": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1}, "group routing"),
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.2}},
     "attention_factor"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}, "4 experts in 4 groups"),
    ({"hidden_act": "gelu"}, "activation gelu"),
])
def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(deepseek_runs, tmp_path, capsys, change,
                                                                      words):
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((deepseek_runs["hf"]["v3"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    shutil.copy(deepseek_runs["hf"]["v3"] / "model.safetensors", src)
    assert words in _refused(src, tmp_path / "out", capsys, "--target-tp", "1")


@pytest.mark.parametrize("change,words", [
    ({"norm_epsilon": 1e-5}, "norm epsilon 1e-05"),
    ({"moe_router_group_topk": 2}, "group routing"),
    ({"moe_router_score_function": "softmax"}, "softmax"),
    ({"rotary_scaling_factor": 4.0, "mscale": 2.0, "mscale_all_dim": 0.0}, "YaRN mscale 2 without mscale_all_dim"),
    ({"moe_shared_expert_gate": True}, "gated shared expert"),
    ({"rotary_percent": 0.5}, "rotary_percent 0.5"),
    ({"rotary_interleaved": True}, "interleaved rotary"),
])
def test_an_export_transformers_would_compute_otherwise_is_refused_in_one_line(deepseek_runs, tmp_path, capsys,
                                                                               change, words):
    src = copy_with_args(deepseek_runs["runs"][("v3", 2, 2)], tmp_path / "src", **change)
    assert words in _refused(src, tmp_path / "out", capsys, "--to", "hf")


@pytest.mark.parametrize("source", ["hf", "mcore"])
def test_a_target_tp_that_cuts_an_attention_head_is_refused_with_the_valid_ones(deepseek_runs, mcore_written, tmp_path,
                                                                                 capsys, source):
    """4 heads over TP 8 (or 3) are refused as the dense models' are: naming the heads and the target TPs
    every tensor allows (the heads, the latent ranks' down projections: 1, 2, 4)."""
    src = deepseek_runs["hf"]["v3"] if source == "hf" else mcore_written / "write"
    for tp in ("8", "3"):
        err = _refused(src, tmp_path / f"out{tp}", capsys, "--target-tp", tp)
        assert f"4 attention heads cannot be divided over {tp} target ranks" in err, err
        assert err.endswith("(fix: choose a target TP among 1, 2, 4)"), err


def test_a_bf16_model_keeps_its_float32_expert_bias_both_ways(deepseek_runs, tmp_path):
    """DeepSeek publishes ``e_score_correction_bias`` in float32 beside bf16 weights, and megatron-core
    keeps ``expert_bias`` in float32: neither is a model of mixed dtypes."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "bf16"
    src.mkdir()
    tensors = load_file(deepseek_runs["hf"]["v3"] / "model.safetensors")
    save_file({k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in tensors.items()},
              src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((deepseek_runs["hf"]["v3"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    ranks = _run(src, tmp_path / "ranks", "--target-tp", "2", "--target-ep", "2")
    module = torch.load(ranks / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert module["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    assert module["decoder.layers.1.self_attention.linear_kv_up_proj.weight"].dtype == torch.bfloat16
    out = _run(ranks, tmp_path / "hf", "--to", "hf")
    want, got = hf_tensors(src), hf_tensors(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                               for k in want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def as_transformer_engine_saves(run: Path, dst: Path) -> Path:
    """``run`` (megatron-core's local spec, TP 2) as its Transformer Engine spec saves the same model:
    the MLA down projections whole on every TP rank (``TELinear`` duplicated), the latent norms fused
    into the up projections and a dense layer's pre-MLP norm into ``linear_fc1`` (``layer_norm_weight``);
    names otherwise the same, in the same order. (Transformer Engine does not build on a CPU, so its
    files are made from megatron-core's own by its spec's rules.)"""
    shutil.copytree(run, dst)
    files = sorted(dst.rglob("model_optim_rng.pt"))
    states = {f: torch.load(f, weights_only=False) for f in files}
    rows: dict[str, list[Path]] = {}  # each EP rank's TP files, TP rank order
    for f in files:
        rows.setdefault(f.parent.name.split("_", 3)[-1], []).append(f)
    fused = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    for row in rows.values():
        for f in row:
            model, out = states[f]["model"], {}
            for k, v in model.items():
                if k.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
                    v = torch.cat([states[g]["model"][k] for g in row])
                name = next((k.replace(a, b) for a, b in fused.items() if k.endswith(a)), k)
                if k.endswith("pre_mlp_layernorm.weight") and k.replace("pre_mlp_layernorm", "mlp.linear_fc1") in model:
                    name = k.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
                out[name] = v
            states[f] = {**states[f], "te": out}
    for f, sd in states.items():
        torch.save({**{k: v for k, v in sd.items() if k != "te"}, "model": sd["te"]}, f)
    return dst


def test_a_transformer_engine_mla_checkpoint_is_read(mcore_written, tmp_path):
    """megatron-core's own MLA + MoE + MTP checkpoint (TP 2 x EP 2) as Transformer Engine's spec saves it
    exports to the same Hugging Face bytes as the local spec's, which transformers runs with megatron-core's
    logits; resharded to TP 1 it keeps Transformer Engine's names (the down projections whole, once)."""
    from safetensors.torch import load_file

    te = as_transformer_engine_saves(mcore_written / "write", tmp_path / "te")
    module = torch.load(te / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in module
    q_down = module["decoder.layers.0.self_attention.linear_q_down_proj.weight"]
    assert q_down.shape[0] == MCORE_MODEL["mla"]["q_lora_rank"]
    local = _run(mcore_written / "write", tmp_path / "local_hf", "--to", "hf")
    ours = _run(te, tmp_path / "te_hf", "--to", "hf")
    a, b = load_file(local / "model.safetensors"), load_file(ours / "model.safetensors")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    torch.testing.assert_close(hf_folder_logits(ours), torch.load(mcore_written / "write" / "logits.pt")[:, :128],
                               rtol=0, atol=TOL)
    one = _run(te, tmp_path / "te_tp1", "--target-tp", "1", "--target-ep", "1")
    m1 = torch.load(one / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    assert torch.equal(m1["decoder.layers.0.self_attention.linear_q_down_proj.weight"],
                       module["decoder.layers.0.self_attention.linear_q_down_proj.weight"])
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight" in m1
    back = load_file(_run(one, tmp_path / "te_tp1_hf", "--to", "hf") / "model.safetensors")
    assert all(torch.equal(a[k], back[k]) for k in a)
    two = _run(one, tmp_path / "te_tp2", "--target-tp", "2")  # TP 1 -> 2: the whole copy on both ranks
    down = "decoder.layers.1.self_attention.linear_kv_down_proj.weight"
    for t in range(2):
        m = torch.load(two / "iter_0000007" / f"mp_rank_{t:02d}" / "model_optim_rng.pt", weights_only=False)["model"]
        assert torch.equal(m[down], m1[down])


def test_mla_args_without_v_head_dim_split_linear_proj_by_its_columns_over_the_heads(mcore_written, tmp_path):
    """Args that lack ``v_head_dim`` (no Megatron-LM run's) leave the head width to ``linear_proj``'s
    columns over the heads — not kv_channels (8 here; MLA's is 6), nor Megatron-LM's default 128: TP
    2 -> 4 cuts each rank's heads apart exactly as with the args' width."""
    src = copy_with_args(mcore_written / "write", tmp_path / "src", v_head_dim=None)
    got = _rank_files(_run(src, tmp_path / "got", "--target-tp", "4", "--target-ep", "2"))
    want = _rank_files(_run(mcore_written / "write", tmp_path / "want", "--target-tp", "4", "--target-ep", "2"))
    assert list(got) == list(want) and len(got) == 8
    for name, module in want.items():
        assert list(got[name]) == list(module)
        assert all(torch.equal(got[name][k], v) for k, v in module.items() if isinstance(v, torch.Tensor)), name


def test_a_checkpoint_mixing_the_two_mla_layouts_is_refused(deepseek_runs, tmp_path, capsys):
    """Transformer Engine's fused latent norm names beside down projections split by rows (the local
    spec's): neither spec saves that, so it is not read."""
    src = shutil.copytree(deepseek_runs["runs"][("v3", 2, 2)], tmp_path / "mixed")
    for f in src.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = {k.replace("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj."
                                 "layer_norm_weight"): v for k, v in sd["model"].items()}
        torch.save(sd, f)
    err = _refused(src, tmp_path / "out", capsys, "--target-tp", "1", "--target-ep", "1")
    assert "linear_q_down_proj.weight holds 12 of its 24 rows" in err and "Transformer Engine" in err


def test_tied_embeddings_with_mtp_are_refused_on_export(deepseek_runs, tmp_path, capsys):
    """DeepSeek's MTP layers hold a copy of an untied head: a tied model with an MTP layer has no
    DeepseekV3 folder that computes it."""
    src = shutil.copytree(deepseek_runs["runs"][("v3_mtp", 2, 2)], tmp_path / "tied")
    for f in src.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].untie_embeddings_and_output_weights = False
        sd["model"] = {k: v for k, v in sd["model"].items() if not k.startswith("output_layer.")}
        torch.save(sd, f)
    err = _refused(src, tmp_path / "out", capsys, "--to", "hf")
    assert "tied embeddings with multi-token prediction layers" in err


def test_max_shard_size_counts_the_mtp_copies_of_the_embeddings(deepseek_runs, tmp_path):
    """--max-shard-size cuts by the bytes written: the embeddings and the head count once per copy
    (DeepSeek writes them again in every MTP layer), so no file passes the limit."""
    limit = 40_000  # above the embeddings and their copy (2 x 16 KiB), below what one file would hold with more
    out = _run(deepseek_runs["runs"][("v3_mtp", 2, 2)], tmp_path / "hf", "--to", "hf", "--max-shard-size",
               str(limit))
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2
    for f in files:
        raw = f.read_bytes()
        data = len(raw) - 8 - int.from_bytes(raw[:8], "little")  # the tensors' bytes, after the header
        assert data <= limit, (f.name, data)


def test_a_kimi_k2_config_is_read_as_deepseek_v3(deepseek_runs, tmp_path):
    """Kimi-K2 publishes DeepSeek-V3's architecture under ``model_type`` kimi_k2 (no group routing,
    its own scaling factor, the rope settings in transformers 4's ``rope_scaling``)."""
    src = tmp_path / "kimi"
    src.mkdir()
    config = json.loads((deepseek_runs["hf"]["v3"] / "config.json").read_text())
    rope = config.pop("rope_parameters")
    theta, rope_type = rope.pop("rope_theta"), rope.pop("rope_type")
    config.update(model_type="kimi_k2", n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_theta=theta,
                  rope_scaling={**rope, "type": rope_type})  # transformers 4's layout: "type", no "rope_type"
    del config["architectures"]
    (src / "config.json").write_text(json.dumps(config))
    shutil.copy(deepseek_runs["hf"]["v3"] / "model.safetensors", src)
    ranks = _run(src, tmp_path / "ranks", "--target-tp", "2", "--target-ep", "2")
    args = torch.load(ranks / "release" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["args"]
    assert (args.moe_router_num_groups, args.moe_router_topk_scaling_factor, args.rope_type,
            args.rotary_scaling_factor) == (None, 2.827, "yarn", 40.0)
    out = _run(ranks, tmp_path / "hf", "--to", "hf")
    got, want = hf_tensors(out), hf_tensors(src)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    back = json.loads((out / "config.json").read_text())
    assert (back["n_group"], back["routed_scaling_factor"], back["rope_parameters"]["factor"]) == (1, 2.827, 40.0)


def test_transformers_loads_the_fp8_export_of_a_deepseek_model_as_the_model_it_encodes(deepseek_runs, tmp_path):
    """transformers reads FP8 on a CPU by dequantizing whole blocks (4 x 4 divides every weight here):
    it loads the export, MLA's projections and the experts' included, and computes what the model
    computes with the formula's dequantized weights in place of its linear weights (float32 here: to
    the test's tolerance), which is not what the unquantized weights compute."""
    got, want = _fp8_export_logits(deepseek_runs["runs"][("v3", 2, 2)], deepseek_runs["hf"]["v3"], tmp_path)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert (deepseek_runs["want"]["v3"] - want).abs().max() > 100 * TOL  # the e4m3 rounding shows: not the weights


def test_transformers_loads_the_fp8_export_of_megatron_cores_own_mla_checkpoint(mcore_written, tmp_path):
    """The same for megatron-core's own checkpoint, whose args hold Megatron-LM's default kv_channels
    (hidden / heads, not v_head_dim)."""
    run = mcore_written / "write"
    got, want = _fp8_export_logits(run, _run(run, tmp_path / "hf", "--to", "hf"), tmp_path)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert (torch.load(run / "logits.pt")[:, :128] - want).abs().max() > 100 * TOL


def _fp8_export_logits(run: Path, plain: Path, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of ``run``'s FP8 export (blocks of 4 x 4), and of the model ``plain`` (its
    plain export) with each FP8 weight's dequantized values (DeepSeek's formula) in its place."""
    from safetensors.torch import save_file

    from test_fp8_export import dequantized

    out = _run(run, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8", "--fp8-block", "4")
    fp8, weights = hf_tensors(out), hf_tensors(plain)
    encoded = tmp_path / "encoded"
    encoded.mkdir()
    (encoded / "config.json").write_text((plain / "config.json").read_text())
    save_file({k: dequantized(fp8[k], fp8[k + "_scale_inv"], (4, 4)) if k + "_scale_inv" in fp8 else v
               for k, v in weights.items()}, str(encoded / "model.safetensors"), metadata={"format": "pt"})
    return hf_folder_logits(out), hf_folder_logits(encoded)


def test_mtp_layers_placed_by_a_layout_string_are_refused(deepseek_runs, tmp_path, capsys):
    err = _refused(deepseek_runs["runs"][("v3_mtp", 2, 2)], tmp_path / "out", capsys, "--target-tp", "2",
                   "--target-ep", "2", "--target-pp", "2", "--target-pipeline-layout", "Et|tL")
    assert "multi-token prediction layers with the pipeline layout 'Et|tL'" in err


def _rank_files(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.parent.name: torch.load(f, weights_only=False)["model"]
            for f in sorted(run.glob("*/mp_rank_*/model_optim_rng.pt"))}  # iter_* or release


def _same_keys(ours: Path, theirs: Path) -> None:
    """The same rank files, the same keys in the same order, the same shapes."""
    a, b = _rank_files(ours), _rank_files(theirs)
    assert list(a) == list(b)
    for name in a:
        assert list(a[name]) == list(b[name]), name
        assert all(a[name][k].shape == v.shape for k, v in b[name].items() if isinstance(v, torch.Tensor)), name


def test_an_mtp_model_over_pipeline_and_expert_ranks_comes_back_tensor_for_tensor(deepseek_runs, tmp_path):
    """HF -> PP 2 x EP 2 (the copy of the embeddings made on the MTP stage) -> PP 1 (read, checked,
    dropped) is the direct import at PP 1, key for key and bit for bit."""
    hf = deepseek_runs["hf"]["v3_mtp"]
    staged = _run(hf, tmp_path / "staged", "--target-tp", "1", "--target-ep", "2", "--target-pp", "2")
    assert list(_rank_files(staged)["mp_rank_00_001_001"])[0] == "embedding.word_embeddings.weight"
    back = _rank_files(_run(staged, tmp_path / "back", "--target-tp", "1", "--target-ep", "1", "--target-pp", "1"))
    direct = _rank_files(_run(hf, tmp_path / "direct", "--target-tp", "1"))
    assert list(back) == list(direct) == ["mp_rank_00"] and list(back["mp_rank_00"]) == list(direct["mp_rank_00"])
    assert all(torch.equal(back["mp_rank_00"][k], v) for k, v in direct["mp_rank_00"].items()
               if isinstance(v, torch.Tensor))


def test_mtp_layers_over_pipeline_stages_keep_megatron_cores_embedding_copy(mcore_written, tmp_path, capsys):
    """megatron-core at PP 2 keeps the MTP layer on the last stage with a copy of the embeddings
    there (the MTP layer embeds the shifted tokens with it), first in that stage's state dict. Read:
    its Hugging Face export (from the run folder or the iteration folder alike) has megatron-core's
    logits and MTP logits, and so has its conversion to TP 2 x EP 2 at PP 1 (the copy dropped once
    checked equal), run by megatron-core; written: TP 2 x EP 2 -> PP 2 has megatron-core's own PP 2
    keys in their order (the copy first on the last stage) and, run by megatron-core (which loads
    every stage strictly), the source's logits and MTP logits. A copy that differs from the
    embeddings is refused."""
    pp2, flat = mcore_written / "write_pp2", mcore_written / "write"
    assert "embedding.word_embeddings.weight" in _rank_files(pp2)["mp_rank_00_001"]  # what megatron-core saves
    out = _run(pp2, tmp_path / "hf", "--to", "hf")
    torch.testing.assert_close(hf_folder_logits(out), torch.load(pp2 / "logits.pt")[:, :128], rtol=0, atol=TOL)
    (mtp,) = torch.load(pp2 / "mtp_logits.pt")
    torch.testing.assert_close(mtp_reference(out), mtp[:-1, :128], rtol=0, atol=TOL)
    from safetensors.torch import load_file  # named by its iteration folder, the same stages read alike

    from_iter = load_file(_run(iteration_folder(pp2), tmp_path / "hf_iter", "--to", "hf") / "model.safetensors")
    whole = load_file(out / "model.safetensors")
    assert from_iter.keys() == whole.keys() and all(torch.equal(from_iter[k], whole[k]) for k in whole)
    runs = {pp2: (_run(pp2, tmp_path / "flat", "--target-tp", "2", "--target-ep", "2", "--target-pp", "1"), 2, 2, 1),
            flat: (_run(flat, tmp_path / "pp2", "--target-tp", "1", "--target-ep", "1", "--target-pp", "2"), 1, 1, 2)}
    _same_keys(runs[flat][0], pp2)
    jobs = [{"kind": "forward", "ckpt": str(run), "tp": tp, "ep": ep, "pp": pp, "from_args": True, "model": {},
             "tokens": TOKENS, "out": str(tmp_path / f"forward_{i}.pt")}
            for i, (run, tp, ep, pp) in enumerate(runs.values())]
    run_harness(jobs, tmp_path / "work")
    for src, job in zip(runs, jobs):
        torch.testing.assert_close(torch.load(job["out"]), torch.load(src / "logits.pt"), rtol=0, atol=TOL)
        (got,) = torch.load(job["out"] + ".mtp")
        (want,) = torch.load(src / "mtp_logits.pt")
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    capsys.readouterr()
    twin = tmp_path / "twin"
    shutil.copytree(pp2, twin)
    f = next(twin.glob("iter_*/mp_rank_00_001/model_optim_rng.pt"))
    sd = torch.load(f, weights_only=False)
    sd["model"]["embedding.word_embeddings.weight"][3, 0] += 1
    torch.save(sd, f)
    err = _refused(twin, tmp_path / "twin_out", capsys, "--target-tp", "1", "--target-pp", "1")
    assert "copy embedding.word_embeddings.weight differs from embedding.word_embeddings.weight" in err


def test_whole_down_projections_on_every_tp_rank_are_refused_as_transformer_engine(deepseek_runs, tmp_path, capsys):
    """Transformer Engine's MLA without latent norms: its names are the local spec's, but each TP rank
    holds the whole down projection — read as row splits it would double the latent."""
    from safetensors.torch import load_file

    whole = load_file(deepseek_runs["hf"]["v3"] / "model.safetensors")
    src = shutil.copytree(deepseek_runs["runs"][("v3", 2, 2)], tmp_path / "te")
    for f in src.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        for i in range(2):
            sd["model"][f"decoder.layers.{i}.self_attention.linear_q_down_proj.weight"] = \
                whole[f"model.layers.{i}.self_attn.q_a_proj.weight"]
        torch.save(sd, f)
    err = _refused(src, tmp_path / "out", capsys, "--target-tp", "1", "--target-ep", "1")
    assert "holds all 24 rows on each of 2 TP ranks" in err and "Transformer Engine" in err
    # at TP 1 the rows cannot tell: the saved args' transformer_impl, or a dense layer's fused pre-MLP norm, do
    one = shutil.copytree(deepseek_runs["runs"][("v3", 1, 1)], tmp_path / "te1")
    edit_saved_args(one, transformer_impl="transformer_engine")
    err = _refused(one, tmp_path / "out1", capsys, "--target-tp", "2")
    assert "transformer_impl transformer_engine" in err and "without latent norms" in err


def test_group_routing_without_a_group_top_k_exports_as_no_groups(deepseek_runs, tmp_path):
    """megatron-core routes over every expert when ``moe_router_group_topk`` is unset, whatever the
    number of groups: transformers' ``n_group`` 1."""
    src = copy_with_args(deepseek_runs["runs"][("v3", 2, 2)], tmp_path / "src", moe_router_group_topk=None)
    config = json.loads((_run(src, tmp_path / "hf", "--to", "hf") / "config.json").read_text())
    assert (config["n_group"], config["topk_group"]) == (1, 1)


def test_a_layer_beyond_num_hidden_layers_that_is_no_mtp_layer_is_refused(deepseek_runs, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((deepseek_runs["hf"]["v3"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}))
    shutil.copy(deepseek_runs["hf"]["v3"] / "model.safetensors", src)
    err = _refused(src, tmp_path / "out", capsys, "--target-tp", "1")
    assert "model.layers.1 is beyond num_hidden_layers 1" in err


def test_an_mtp_layer_declared_without_weights_is_dropped_in_one_line(tmp_path):
    """transformers declares DeepSeek-V3's MTP layer (``num_nextn_predict_layers`` 1) but saves no
    weights for it: the import and the export back say in one line that the output has none, and
    its ``config.json`` says 0 (vLLM's MTP drafting would look for weights that are not there);
    a folder that holds the layer keeps it without a word."""
    import reshard

    declared, held = tmp_path / "declared", tmp_path / "held"
    config = {k: v for k, v in _V3.items() if k != "num_mtp_layers"}  # transformers' default: DeepSeek-V3's one
    make_deepseek(config, declared)
    make_deepseek(config, held)
    add_mtp_layer(held)
    assert json.loads((declared / "config.json").read_text())["num_nextn_predict_layers"] == 1
    line = ("num_nextn_predict_layers 1 -> 0: config.json declares 1 multi-token prediction layer but the folder "
            "holds the weights of none (transformers saves DeepSeek-V3 without them)")
    for out, extra in (("hf", {"to": "hf"}), ("megatron", {"target_tp": 1})):
        result = reshard.convert(str(declared), str(tmp_path / out), **extra)
        assert result.warnings.count(line) == 1, result.warnings
        assert not any("num_nextn_predict_layers" in w for w in reshard.convert(
            str(held), str(tmp_path / f"{out}_held"), **extra).warnings)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert json.loads((tmp_path / "hf_held" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def _printed(capsys, *argv: str) -> list[str]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def test_inspect_says_what_an_fp8_deepseek_folder_is(tmp_path, capsys):
    """A DeepSeek-V3 folder in FP8 blocks with an MTP layer: its format and class, the dtypes it
    stores (not the float32 it is read as), the quantization and the tensors it encodes, MLA's
    ranks, the routing, the MTP layer; nothing it does not record (no checkpoint version, module
    key or ZeRO stage); its size in binary units (the JSON keeps the exact bytes)."""
    from safetensors import safe_open

    bf16 = tmp_path / "bf16"
    make_deepseek(_V3, bf16)
    add_mtp_layer(bf16)
    src = tmp_path / "fp8"
    make_fp8_folder(bf16, src, torch.bfloat16)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        encoded = [k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"]
    lines = _printed(capsys, "inspect", str(src))
    assert lines[0] == "format       hf (Hugging Face safetensors)"
    assert "architecture DeepseekV3ForCausalLM" in lines and "family       deepseek" in lines
    assert "dtypes       bfloat16, float32, float8_e4m3fn" in lines
    assert (f"quantization fp8 e4m3, float32 weight_scale_inv per 32 x 48 block, {len(encoded)} tensors:" in lines
            and "  model.layers.*.self_attn.kv_b_proj.weight" in lines and "  model.layers.*.eh_proj.weight" in lines)
    assert "mla          q_lora_rank 24, kv_lora_rank 16, qk_head_dim 8, qk_pos_emb_head_dim 4, v_head_dim 6" in lines
    moe = next(ln for ln in lines if ln.startswith("moe "))
    assert all(f in moe for f in ("experts 4", "topk 2", "score sigmoid", "groups 2", "group_topk 1", "scaling 2.5",
                                  "expert_bias True"))
    assert "mtp_layers   1" in lines
    assert not any(ln.startswith(("version", "module_key", "zero_stage", "bytes", "layout")) for ln in lines), lines
    size = (src / "model.safetensors").stat().st_size + (src / "config.json").stat().st_size
    assert f"size         {size / 1024:.1f} KiB in 2 files" in lines
    rec = json.loads("\n".join(_printed(capsys, "inspect", str(src), "--json")))
    assert rec["bytes"] == size and rec["quantization"]["tensors"] == len(encoded) > 0
    assert rec["version"] is None and rec["module_key"] is None and rec["format"] == "hf"


def test_the_run_summary_names_the_formats_every_changed_degree_and_the_quantization(tmp_path, capsys):
    """``hf fp8 -> megatron, TP 1 -> 2, EP 1 -> 2``; an EP change alone says EP, not TP; an export
    names the degrees it gathers and the FP8 it writes; Hugging Face to Hugging Face says so. The
    API's result gives the same line."""
    import reshard

    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    make_deepseek(_V3, bf16)
    make_fp8_folder(bf16, fp8, torch.bfloat16)

    def head(*argv: str) -> str:
        line = _printed(capsys, "run", "--direct", *argv)[0]
        assert line.startswith(f"committed {argv[1]}: ")
        return line.split(": ", 1)[1]

    ep2 = tmp_path / "ep2"
    assert head(str(fp8), str(ep2), "--target-tp", "2", "--target-ep", "2").startswith(
        "hf fp8 -> megatron, TP 1 -> 2, EP 1 -> 2, 5 files, ")
    assert head(str(ep2), str(tmp_path / "ep1"), "--target-tp", "2", "--target-ep", "1").startswith(
        "megatron -> megatron, EP 2 -> 1, 3 files, ")
    assert head(str(ep2), str(tmp_path / "hf8"), "--to", "hf", "--quantize", "fp8").startswith(
        "megatron (TP 2, EP 2) -> hf fp8, 2 files, ")
    # the weights, config.json and the generation config transformers saved
    assert head(str(bf16), str(tmp_path / "hf"), "--to", "hf").startswith("hf -> hf, 3 files, ")
    result = reshard.convert(str(fp8), str(tmp_path / "api"), target_tp=2, target_ep=2)
    assert result.summary.startswith("hf fp8 -> megatron, TP 1 -> 2, EP 1 -> 2, 5 files, ")


def _bridge_run_config(config: dict) -> dict:
    """The ``model`` section Megatron-Bridge 0.6.2 saves in ``run_config.yaml`` for a DeepSeek-V3
    ``config``: its MLA provider (megatron-core's MLATransformerConfig field names) as its
    ``CONFIG_MAPPING`` and ``MLA_ROPE_SCALING_MAPPING`` fill it from the Hugging Face config and
    ``DeepSeekV3Bridge.provider_bridge`` sets the rest (``kv_channels`` is transformers'
    ``head_dim``, the rope head width, as Megatron-Bridge maps it; the CPU-run settings its real
    fixtures record: local spec, no grouped GEMM)."""
    rope = config["rope_parameters"]
    return {"_target_": "megatron.bridge.models.mla_provider.MLAModelProvider",
            "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
            "ffn_hidden_size": config["intermediate_size"], "num_attention_heads": config["num_attention_heads"],
            "num_query_groups": config["num_key_value_heads"], "kv_channels": config["qk_rope_head_dim"],
            "vocab_size": config["vocab_size"], "seq_length": config["max_position_embeddings"],
            "layernorm_epsilon": config["rms_norm_eps"], "rotary_base": rope["rope_theta"], "rotary_percent": 1.0,
            "share_embeddings_and_output_weights": config["tie_word_embeddings"],
            "num_moe_experts": config["n_routed_experts"], "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": config["moe_intermediate_size"], "moe_router_score_function": "sigmoid",
            "moe_router_num_groups": config["n_group"], "moe_router_group_topk": config["topk_group"],
            "moe_router_topk_scaling_factor": config["routed_scaling_factor"],
            "q_lora_rank": config["q_lora_rank"], "kv_lora_rank": config["kv_lora_rank"],
            "qk_head_dim": config["qk_nope_head_dim"], "qk_pos_emb_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"], "mtp_num_layers": None, "rope_type": "yarn",
            "rotary_scaling_factor": rope["factor"], "original_max_position_embeddings":
                rope["original_max_position_embeddings"], "beta_fast": rope["beta_fast"],
            "beta_slow": rope["beta_slow"], "mscale": rope["mscale"], "mscale_all_dim": rope["mscale_all_dim"],
            "normalization": "RMSNorm", "gated_linear_unit": True,
            "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
            "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True, "multi_latent_attention": True,
            "moe_grouped_gemm": False, "moe_router_pre_softmax": True, "moe_router_enable_expert_bias": True,
            "moe_layer_freq": [0] * config["first_k_dense_replace"] + [1] * (config["num_hidden_layers"]
                                                                         - config["first_k_dense_replace"]),
            "moe_shared_expert_intermediate_size": config["moe_intermediate_size"] * config["n_shared_experts"],
            "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
            "params_dtype": {"_target_": "torch.float32", "_call_": False}, "tensor_model_parallel_size": 1}


def test_a_megatron_bridge_deepseek_v3_run_config_gives_every_mla_and_router_fact(tmp_path):
    """Megatron-Bridge's DeepSeek-V3 torch_dist (megatron-core 0.19: the common state in the index,
    no args) with its ``run_config.yaml``: the MLA widths, YaRN and group routing come from it
    (was: ``kv_channels`` taken for the head width and the checkpoint refused), and the export
    gives the source's tensors bit for bit and its config."""
    import yaml

    from mcore019 import as_019_dist

    want = make_deepseek(_V3, tmp_path / "hf")
    _run(tmp_path / "hf", tmp_path / "dist", "--to", "torch_dist")
    src = as_019_dist(tmp_path / "dist", tmp_path / "bridge", args=None)
    folder = next(p.parent for p in src.glob("*/.metadata"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (folder / "run_config.yaml").write_text(yaml.safe_dump({"model": _bridge_run_config(config)}))
    ranks = _run(src, tmp_path / "ranks", "--target-tp", "2", "--target-ep", "2")  # the facts go into its args
    source = hf_tensors(tmp_path / "hf")
    for out in (_run(src, tmp_path / "out", "--to", "hf"), _run(ranks, tmp_path / "out2", "--to", "hf")):
        got = hf_tensors(out)
        assert sorted(got) == sorted(source) and all(torch.equal(got[k], source[k]) for k in source)
        exported = json.loads((out / "config.json").read_text())
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                    "topk_group", "n_shared_experts", "routed_scaling_factor", "first_k_dense_replace",
                    "rms_norm_eps"):
            assert exported[key] == config[key], key
        torch.testing.assert_close(hf_folder_logits(out), want, rtol=0, atol=1e-6)
