"""GPT-OSS (transformers' ``GptOssForCausalLM``) in bf16's layout, both ways: a tiny model transformers
builds (2 layers, one sliding and one full, 4 experts with biases, YaRN as the release has it) is
imported to megatron-core at TP 1, at TP 2 x EP 2 and as torch_dist, and megatron-core's forward of
each gives transformers' logits; a checkpoint megatron-core writes at TP 2 x EP 2 goes ``--to hf``
into a folder transformers loads at default strictness with megatron-core's logits; HF -> TP 2 x EP 2
(x PP 2) -> HF gives back every tensor bit for bit.

The layout is checked tensor by tensor too (gate and up interleaved in ``gate_up_proj``, ``down_proj``
transposed, the sinks split by heads over TP), so a mistake in any of them fails here twice.

In MXFP4, the release's format: a model whose expert widths are whole 32-value groups goes ``--to hf
--quantize mxfp4`` into a folder transformers loads (it dequantizes on a CPU) at default strictness;
that folder goes to bf16 (``--to hf``) with transformers' own dequantized weights and logits, to
megatron-core at TP 2 x EP 2 with transformers' logits, and from there back to MXFP4 code for code.

All real-tool work runs in one harness launch (:func:`gpt_oss`). megatron-core 0.16.1's local
attention builds its sliding-window mask with ``device="cuda"``: the harness runs that one function
(``get_sliding_window_causal_mask``) with its tensors made on the CPU (``mcore_harness._cpu_window_mask``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_fixtures import TOKENS, copy_with_args, needs_mcore, run_harness
from reshard.cli import main
from reshard.core.safe_load import load_shard

TOL = 2e-5
#: The release's rotary (``rope_scaling`` of openai/gpt-oss-20b, transformers 5's ``rope_parameters``).
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
CONFIG = {"hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
          "vocab_size": 256, "max_position_embeddings": 131072, "sliding_window": 4, "tie_word_embeddings": False,
          "rope_parameters": ROPE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
#: The same architecture written by megatron-core itself (the harness's options are Megatron-LM's args).
MCORE_MODEL = {"layers": 2, "hidden": 64, "heads": 8, "groups": 2, "kv_channels": 16, "ffn": 48, "norm": "RMSNorm",
               "bias": True, "qkv_bias": True, "pos": "yarn", "rope_base": 150000.0, "tied": False, "vocab": 256,
               "divisible_by": 128, "saved_vocab_size": 256, "seq": 131072, "experts": 4, "moe_ffn": 48, "topk": 2,
               "softmax_type": "learnable", "quick_geglu": True, "glu_linear_offset": 1.0,
               "activation_func_clamp_value": 7.0, "window_size": [3, 0], "window_attn_skip_freq": 2,
               "norm_noise": True,
               "yarn": {"rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
                        "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                        "yarn_correction_range_round_to_int": False}}
_LAYER = "decoder.layers.{}."
_EXPERT = _LAYER + "mlp.experts.local_experts.{}."


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _saved(folder: Path, rank_dir: str) -> dict:
    """A rank file (reshard's allowlisted loader: megatron-core's enums as stand-ins, not imported)."""
    return load_shard(next(folder.glob(f"*/{rank_dir}/model_optim_rng.pt")))


def _transformers(folder: Path):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0], info


def _run(*argv: str) -> None:
    assert main(["run", "--direct", *argv]) == 0


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    """The Hugging Face folder transformers saves (fp32; norms, biases and sinks drawn away from their
    initial values) and its logits."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG, initializer_range=0.1),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))  # distinct from ones: a misplaced norm must show
            elif key.endswith(("_bias", "router.bias")):
                p.normal_(0, 0.1)  # transformers zeroes the experts' biases: a misplaced one must show
        want = model(torch.tensor([TOKENS])).logits[0]
    model.save_pretrained(root / "hf")
    return {"root": root, "hf": root / "hf", "want": want}


@pytest.fixture(scope="module")
def converted(hf) -> dict[str, Path]:
    """reshard's outputs of the folder: TP 1, TP 2 x EP 2 (and x PP 2), torch_dist, and back to HF."""
    root, src = hf["root"], str(hf["hf"])
    out = {name: root / name for name in ("tp1", "tp2", "tp2pp2", "dist", "back", "back_pp", "back_dist")}
    _run(src, str(out["tp1"]), "--target-tp", "1")
    _run(src, str(out["tp2"]), "--target-tp", "2", "--target-ep", "2")
    _run(src, str(out["tp2pp2"]), "--target-tp", "2", "--target-ep", "2", "--target-pp", "2")
    _run(src, str(out["dist"]), "--to", "torch_dist")
    _run(str(out["tp2"]), str(out["back"]), "--to", "hf")
    _run(str(out["tp2pp2"]), str(out["back_pp"]), "--to", "hf")
    _run(str(out["dist"]), str(out["back_dist"]), "--to", "hf")
    return out


#: The MXFP4 model: expert widths of whole 32-value groups (the release's are 2880 = 90 x 32).
MX_CONFIG = {**CONFIG, "intermediate_size": 32}


@pytest.fixture(scope="module")
def mx(hf) -> dict:
    """A GPT-OSS transformers builds, quantized by reshard into the release's layout (``rel``), and
    what the acceptance commands make of it: bf16 (``bf16``), megatron-core TP 2 x EP 2 (``tp2``) and
    that checkpoint back in MXFP4 (``again``); with the logits transformers computes from ``rel``."""
    import transformers

    root = hf["root"] / "mx"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(**MX_CONFIG, initializer_range=0.1), dtype=torch.float32)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("_bias", "router.bias")):
                p.normal_(0, 0.1)
    model.save_pretrained(root / "src")
    out = {name: root / name for name in ("rel", "bf16", "tp2", "again")}
    _run(str(root / "src"), str(out["rel"]), "--to", "hf", "--quantize", "mxfp4")
    _run(str(out["rel"]), str(out["bf16"]), "--to", "hf")
    _run(str(out["rel"]), str(out["tp2"]), "--target-tp", "2", "--target-ep", "2")
    _run(str(out["tp2"]), str(out["again"]), "--to", "hf", "--quantize", "mxfp4")
    return {**out, "root": root}


@pytest.fixture(scope="module")
def gpt_oss(hf, converted, mx) -> dict:
    """One harness launch: megatron-core writes its own GPT-OSS at TP 2 x EP 2 (expert TP 1) and runs
    the imports (TP 1; TP 2 x EP 2, also x PP 2; the torch_dist output loaded at TP 2 x EP 2), each model built
    from the checkpoint's own args (``--use-checkpoint-args``); then its checkpoint goes ``--to hf``."""
    root = hf["root"]
    work = root / "harness"
    forward = dict(kind="forward", from_args=True, model={}, tokens=TOKENS)
    jobs = [{"kind": "write", "out": str(root / "mcore"), "tp": 2, "ep": 2, "etp": 1, "model": MCORE_MODEL,
             "tokens": TOKENS},
            {**forward, "ckpt": str(converted["tp1"]), "tp": 1, "out": str(work / "tp1.pt")},
            {**forward, "ckpt": str(converted["tp2"]), "tp": 2, "ep": 2, "etp": 1, "out": str(work / "tp2.pt")},
            {**forward, "ckpt": str(converted["tp2pp2"]), "tp": 2, "ep": 2, "etp": 1, "pp": 2,
             "out": str(work / "tp2pp2.pt")},
            {**forward, "kind": "forward_dist", "ckpt": str(converted["dist"]), "tp": 2, "ep": 2, "etp": 1,
             "out": str(work / "dist.pt")},
            {**forward, "ckpt": str(mx["tp2"]), "tp": 2, "ep": 2, "etp": 1, "out": str(work / "mx_tp2.pt")}]
    work.mkdir()
    run_harness(jobs, work)
    _run(str(root / "mcore"), str(root / "mcore_hf"), "--to", "hf")
    return {"logits": {k: torch.load(work / f"{k}.pt") for k in ("tp1", "tp2", "tp2pp2", "dist", "mx_tp2")},
            "mcore": torch.load(root / "mcore" / "logits.pt"), "mcore_hf": root / "mcore_hf"}


# --- megatron-core computes what transformers computes --------------------------------------------

@needs_mcore
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2", "dist"])
def test_megatron_core_runs_the_import_with_transformers_logits(hf, gpt_oss, layout):
    got, want = gpt_oss["logits"][layout], hf["want"]
    diff = (got[:, :want.shape[1]] - want).abs().max().item()
    assert diff < TOL, f"{layout}: logits differ by {diff:.2e}"


@needs_mcore
def test_a_megatron_core_checkpoint_goes_to_hf_with_its_logits(gpt_oss):
    """megatron-core's own TP 2 x EP 2 checkpoint, exported: transformers loads it with nothing
    missing or left over and computes megatron-core's logits."""
    got, info = _transformers(gpt_oss["mcore_hf"])
    assert not any(info.values()), info
    diff = (got - gpt_oss["mcore"][:, :got.shape[1]]).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"
    config = json.loads((gpt_oss["mcore_hf"] / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 4
    assert config["rope_parameters"] == {**ROPE, "factor": 32.0} and config["swiglu_limit"] == 7.0


# --- MXFP4: the release's format, in and out -------------------------------------------------------

def test_transformers_loads_reshards_mxfp4_release_and_its_bf16_export_alike(mx):
    """transformers loads the ``--quantize mxfp4`` folder at default strictness (dequantizing it: no
    triton here) and reshard's bf16 export of that folder: the same parameters bit for bit, the same
    logits; the export holds no ``*_blocks``/``*_scales`` and no ``quantization_config``."""
    import transformers

    rel = json.loads((mx["rel"] / "config.json").read_text())["quantization_config"]
    assert rel == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "lm_head", "model.embed_tokens", "model.layers.*.mlp.router", "model.layers.*.self_attn"]}, rel
    assert sorted(k for k in _tensors(mx["rel"]) if k.startswith("model.layers.0.mlp.experts.")) == [
        f"model.layers.0.mlp.experts.{n}" for n in ("down_proj_bias", "down_proj_blocks", "down_proj_scales",
                                                    "gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales")]
    models = {}
    for name in ("rel", "bf16"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(mx[name], dtype=torch.float32,
                                                                        output_loading_info=True)
        assert not any(info.values()), (name, info)
        models[name] = model.eval()
    want, got = (models[n].state_dict() for n in ("rel", "bf16"))
    assert sorted(got) == sorted(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    with torch.no_grad():
        a, b = (models[n](torch.tensor([TOKENS])).logits for n in ("rel", "bf16"))
    assert torch.equal(a, b)
    exported = _tensors(mx["bf16"])
    assert not [k for k in exported if k.endswith(("_blocks", "_scales"))]
    assert "quantization_config" not in json.loads((mx["bf16"] / "config.json").read_text())


@needs_mcore
def test_megatron_core_runs_the_mxfp4_import_with_transformers_logits(mx, gpt_oss):
    """The MXFP4 folder straight to TP 2 x EP 2 (dequantized as it streams): megatron-core's forward
    gives the logits transformers computes from the MXFP4 folder."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(mx["rel"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([TOKENS])).logits[0]
    got = gpt_oss["logits"]["mx_tp2"]
    diff = (got[:, :want.shape[1]] - want).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"


def test_megatron_core_back_to_mxfp4_gives_the_release_code_for_code(mx):
    """TP 2 x EP 2 -> ``--to hf --quantize mxfp4``: every code, scale and bf16 tensor of the release
    back, and its ``config.json``."""
    want, got = _tensors(mx["rel"]), _tensors(mx["again"])
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert json.loads((mx["again"] / "config.json").read_text()) == json.loads((mx["rel"] / "config.json").read_text())


# --- the layout, tensor by tensor ------------------------------------------------------------------

@pytest.mark.parametrize("back", ["back", "back_pp", "back_dist"])
def test_hf_to_megatron_and_back_gives_every_tensor_bit_for_bit(hf, converted, back):
    want, got = _tensors(hf["hf"]), _tensors(converted[back])
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    source, config = (json.loads((f / "config.json").read_text()) for f in (hf["hf"], converted[back]))
    for key in ("layer_types", "sliding_window", "rope_parameters", "num_local_experts", "num_experts_per_tok",
                "head_dim", "swiglu_limit", "attention_bias", "rms_norm_eps", "bos_token_id", "eos_token_id"):
        assert config[key] == source[key], key


def test_a_bf16_folder_goes_to_megatron_core_and_back_bit_for_bit(tmp_path):
    """The release's dtype: transformers saves every tensor bf16 (norms too); TP 2 x EP 2 and back gives
    each one back, dtype and bits, and ``config.json`` says bfloat16."""
    import transformers

    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG, initializer_range=0.1),
                                                          dtype=torch.bfloat16)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("_bias", "router.bias")):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    _run(str(tmp_path / "hf"), str(tmp_path / "tp2"), "--target-tp", "2", "--target-ep", "2")
    _run(str(tmp_path / "tp2"), str(tmp_path / "back"), "--to", "hf")
    want, got = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert {v.dtype for v in want.values()} == {torch.bfloat16} and sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_import_holds_gate_then_up_transposed_and_the_sinks_by_head(hf, converted):
    """Expert ``e``'s ``linear_fc1`` is ``[gate; up]`` (``gate_up_proj``'s even, then odd columns,
    transposed), its ``linear_fc2`` is ``down_proj[e]`` transposed, the biases likewise; TP rank ``t``
    holds the sinks of heads ``4t .. 4t + 3``; EP rank ``r`` holds experts ``2r, 2r + 1`` as 0, 1."""
    want = _tensors(hf["hf"])
    for tp_rank, ep_rank in ((0, 0), (1, 1)):
        module = _saved(converted["tp2"], f"mp_rank_{tp_rank:02d}_{ep_rank:03d}")["model"]
        for layer in range(2):
            h = f"model.layers.{layer}."
            sinks = want[h + "self_attn.sinks"]
            assert torch.equal(module[_LAYER.format(layer) + "self_attention.core_attention.softmax_offset"],
                               sinks[4 * tp_rank:4 * tp_rank + 4])
            for local in range(2):
                e, p = 2 * ep_rank + local, _EXPERT.format(layer, local)
                gate_up, bias = want[h + "mlp.experts.gate_up_proj"][e], want[h + "mlp.experts.gate_up_proj_bias"][e]
                fc1 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1).t()  # [gate; up]
                assert torch.equal(module[p + "linear_fc1.weight"], fc1)
                assert torch.equal(module[p + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
                assert torch.equal(module[p + "linear_fc2.weight"], want[h + "mlp.experts.down_proj"][e].t())
                assert torch.equal(module[p + "linear_fc2.bias"], want[h + "mlp.experts.down_proj_bias"][e])


def test_the_saved_args_are_megatron_lms_for_gpt_oss(converted):
    """What ``--use-checkpoint-args`` rebuilds the model from (the forward above builds it so)."""
    args = _saved(converted["tp2"], "mp_rank_00_000")["args"]
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size) \
        == (2, 2, 1)
    assert (args.softmax_type, args.quick_geglu, args.swiglu, args.glu_linear_offset,
            args.activation_func_clamp_value) == ("learnable", True, False, 1.0, 7.0)
    assert (args.window_size, args.window_attn_skip_freq) == ((3, 0), 2)
    assert (args.position_embedding_type, args.rotary_base, args.rotary_scaling_factor,
            args.yarn_original_max_position_embeddings, args.yarn_correction_range_round_to_int) == \
        ("yarn", 150000.0, 32.0, 4096, False)
    assert (args.add_bias_linear, args.add_qkv_bias, args.num_experts, args.moe_router_topk, args.kv_channels) == \
        (True, True, 4, 2, 16)
    assert sorted(p.name for p in converted["tp2"].glob("*/mp_rank_*")) == ["mp_rank_00_000", "mp_rank_01_001"]


def test_the_releases_config_layout_reads_as_transformers_5s(hf, converted, tmp_path):
    """openai's config.json spells transformers 4's layout (``rope_scaling`` + ``rope_theta``, both
    ``experts_per_token`` and ``num_experts_per_tok``, ``initial_context_length``): the same args."""
    src = shutil.copytree(hf["hf"], tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=2,
                  initial_context_length=4096)
    (src / "config.json").write_text(json.dumps(config))
    _run(str(src), str(tmp_path / "tp1"), "--target-tp", "1")
    got, want = (_saved(f, "mp_rank_00")["args"] for f in (tmp_path / "tp1", converted["tp1"]))
    assert vars(got) == vars(want)


# --- refusals --------------------------------------------------------------------------------------

def test_an_expert_tp_megatron_core_cannot_build_is_refused_in_one_line(hf, tmp_path, capsys):
    capsys.readouterr()
    assert main(["run", "--direct", str(hf["hf"]), str(tmp_path / "o"), "--target-tp", "2", "--target-ep", "2",
                 "--target-etp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reshard: error: --target-etp:") and len(err.splitlines()) == 1, err
    assert "expert tensor parallelism 1 only" in err and "pass --target-etp 1" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("change,needle", [
    ({"moe_router_pre_softmax": True}, "the softmax over all experts before the top-k"),
    ({"glu_linear_offset": 0.0}, "args.glu_linear_offset is 0.0 (GPT-OSS's experts: 1.0)"),
    ({"window_size": (3, 1)}, "window_size (3, 1) looks 1 tokens ahead"),
])
def test_an_export_transformers_gpt_oss_does_not_compute_is_refused_in_one_line(converted, tmp_path, capsys, change,
                                                                              needle):
    src = copy_with_args(converted["tp1"], tmp_path / "src", **change)
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(tmp_path / "o"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_windows_on_other_layers_are_written_as_layer_types(converted, tmp_path):
    """The args' windows, layer by layer (a flag per layer: the full layer first), are ``layer_types``."""
    src = copy_with_args(converted["tp1"], tmp_path / "src", window_size=(5, 0), window_attn_skip_freq=[0, 1])
    _run(str(src), str(tmp_path / "o"), "--to", "hf")
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (["full_attention", "sliding_attention"], 6)


@pytest.mark.parametrize("change,needle", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 (megatron-core's quick_gelu is x sigmoid(1.702 x))"),
    ({"attention_bias": False}, "attention without biases"),
    ({"layer_types": ["sliding_attention"]}, "layer_types ['sliding_attention'] is not 2 of"),
    ({"rope_parameters": {**ROPE, "rope_type": "linear"}}, "rotary scaling linear"),
])
def test_a_config_megatron_core_does_not_compute_is_refused_in_one_line(hf, tmp_path, capsys, change, needle):
    src = shutil.copytree(hf["hf"], tmp_path / "hf")
    (src / "config.json").write_text(json.dumps({**json.loads((hf["hf"] / "config.json").read_text()), **change}))
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
