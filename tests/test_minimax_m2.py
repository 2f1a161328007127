"""MiniMax-M2 (transformers' ``MiniMaxM2ForCausalLM``): Hugging Face folders to Hugging Face folders,
bf16 <-> FP8 blocks, checked against transformers; megatron-core refused both ways, naming the norm
it does not compute (one RMSNorm over all heads' queries / keys; megatron-core's is per head).

The source is a tiny random model made by transformers (fixed seed; norms, expert biases distinct),
saved in bf16 as the releases are, its ``config.json`` with the releases' ``rotary_dim`` (half of each
head's 8 dims rotate). Its FP8 copy is DeepSeek's block layout (what MiniMax-M2's FP8 release holds:
every attention projection and expert ``w1``/``w2``/``w3`` e4m3 with float32 ``weight_scale_inv``).
transformers loads every output at its default strictness (no missing or unexpected key) and computes
the logits of the model the output encodes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from mcore_fixtures import copy_with_args
from reshard.cli import main
from test_fp8_export import block_reference, dequantized
from test_hf_export import hf_logits, hf_tensors
from test_hf_import import make_fp8_folder, randomized, tensors_folder

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rotary_dim=4, num_local_experts=4, num_experts_per_tok=2,
              rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2)
#: MiniMax-M2's linear weights (what its FP8 release encodes): attention projections, experts.
LINEAR = r"\.(?:q_proj|k_proj|v_proj|o_proj|w1|w2|w3)\.weight$"
#: Blocks dividing every projection of the toy model (transformers dequantizes whole blocks on a CPU).
BLOCK = (16, 16)


#: What MiniMax-M2's FP8 release's config.json says beyond transformers' own fields (transformers
#: 4's rope layout with ``rotary_dim``, the fields its own code and vLLM read): carried through.
RELEASE_FIELDS = {"rope_theta": 5000000, "attn_type_list": [1, 1], "qk_norm_type": "per_layer", "use_qk_norm": True,
                  "scoring_func": "sigmoid", "use_routing_bias": True, "shared_intermediate_size": 0,
                  "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1}


def make_minimax(folder: Path, seed: int = 0) -> None:
    """Save a random MiniMaxM2ForCausalLM of :data:`CONFIG` in bf16 to ``folder``."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    model = randomized(MiniMaxM2ForCausalLM, MiniMaxM2Config(**CONFIG), seed)
    model.to(torch.bfloat16).save_pretrained(folder)


def release_like(encoded: dict[str, torch.Tensor], bf16: Path, fp8: Path) -> dict[str, torch.Tensor]:
    """Make the FP8 folder ``fp8`` (of the bf16 folder ``bf16``) what MiniMax-M2's release holds: the
    router and the expert bias in float32, ``fmt`` the dtype's name, the modules it keeps, its
    config.json's own fields (:data:`RELEASE_FIELDS`, ``rotary_dim`` without ``rope_parameters``);
    returns ``encoded`` (the tensors the model computes with) as changed."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(fp8 / "model.safetensors")
    for key in tensors:
        if key.endswith(("block_sparse_moe.gate.weight", "e_score_correction_bias")):
            tensors[key] = encoded[key] = tensors[key].float()
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["rope_parameters"]
    config["quantization_config"].update(fmt="float8_e4m3fn",
                                         modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])
    (fp8 / "config.json").write_text(json.dumps({**config, **RELEASE_FIELDS}))
    return encoded


def _run(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """The bf16 folder, its FP8 copy (and the tensors that copy encodes) and their conversions."""
    root = tmp_path_factory.mktemp("minimax_m2")
    bf16, fp8 = root / "bf16", root / "fp8"
    make_minimax(bf16)
    encoded = release_like(make_fp8_folder(bf16, fp8, torch.bfloat16, linear=LINEAR), bf16, fp8)
    return {"bf16": bf16, "fp8": fp8, "encoded": encoded, "root": root,
            "bf16_to_hf": _run(bf16, root / "bf16_to_hf", "--to", "hf"),
            "fp8_to_hf": _run(fp8, root / "fp8_to_hf", "--to", "hf"),
            "quantized": _run(bf16, root / "quantized", "--to", "hf", "--quantize", "fp8", "--fp8-block", "16")}


def test_the_folder_names_its_experts_as_the_releases_do(minimax):
    names = set(hf_tensors(minimax["bf16"]))
    assert {"model.layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.e_score_correction_bias"} <= names
    assert hf_tensors(minimax["bf16"])["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 8,)  # all heads


def test_a_bf16_folder_is_written_back_bit_for_bit_with_its_config(minimax):
    want, got = hf_tensors(minimax["bf16"]), hf_tensors(minimax["bf16_to_hf"])
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    source = json.loads((minimax["bf16"] / "config.json").read_text())
    assert json.loads((minimax["bf16_to_hf"] / "config.json").read_text()) == source
    torch.testing.assert_close(hf_logits(minimax["bf16_to_hf"]), hf_logits(minimax["bf16"]), rtol=0, atol=0)


def test_the_expert_counts_other_name_reads_alike(minimax, tmp_path):
    """``num_experts`` is transformers' alias of ``num_local_experts``: the same folder, and its own
    config.json written back."""
    src = shutil.copytree(minimax["bf16"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (src / "config.json").write_text(json.dumps(config))
    out = _run(src, tmp_path / "out", "--to", "hf")
    assert json.loads((out / "config.json").read_text()) == config
    want, got = hf_tensors(minimax["bf16"]), hf_tensors(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_inspect_describes_the_folder_as_its_hugging_face_conversion_reads_it(minimax, capsys):
    """``reshard inspect`` plans what it describes; for a model megatron-core does not compute that
    is the one conversion there is (``--to hf``), not a refusal."""
    assert main(["inspect", str(minimax["fp8"]), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["architecture"] == "MiniMaxM2ForCausalLM" and rec["experts"] == 4, rec
    assert rec["quantization"]["method"] == "fp8", rec


def test_a_folder_whose_config_contradicts_its_weights_is_refused(minimax, tmp_path, capsys):
    src = shutil.copytree(minimax["bf16"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 5}))
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "num_experts_per_tok 5 of 4 experts" in err, err


def test_an_fp8_folder_is_written_as_the_bf16_model_it_encodes(minimax):
    got, stored = hf_tensors(minimax["fp8_to_hf"]), hf_tensors(minimax["fp8"])
    assert sorted(got) == sorted(minimax["encoded"])
    fp8 = [k for k in stored if re.search(LINEAR, k)]
    assert len(fp8) == 2 * (4 + 3 * 4)  # two layers: q, k, v, o and four experts' w1, w2, w3
    for key, want in minimax["encoded"].items():  # the linear weights dequantized by DeepSeek's formula
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    assert got["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32  # as the release
    config = json.loads((minimax["fp8_to_hf"] / "config.json").read_text())
    release = json.loads((minimax["fp8"] / "config.json").read_text())
    assert config == {**{k: v for k, v in release.items() if k != "quantization_config"}, "dtype": "bfloat16"}
    assert "rope_parameters" not in config and config["rotary_dim"] == 4
    want_logits = hf_logits(tensors_folder(minimax["encoded"], minimax["fp8_to_hf"], minimax["root"] / "encoded"))
    torch.testing.assert_close(hf_logits(minimax["fp8_to_hf"]), want_logits, rtol=0, atol=0)
    assert (want_logits - hf_logits(minimax["bf16"])).abs().max() > 0  # FP8 is not the bf16 model


def test_quantize_fp8_writes_the_block_formula_that_transformers_loads(minimax, tmp_path):
    plain, fp8 = hf_tensors(minimax["bf16"]), hf_tensors(minimax["quantized"])
    linear = sorted(k for k in plain if re.search(LINEAR, k))
    assert sorted(fp8) == sorted([*plain, *(k + "_scale_inv" for k in linear)])
    for key, w in plain.items():
        if key not in linear:  # router, expert bias, norms, embeddings, head: as they were
            assert fp8[key].dtype == w.dtype and torch.equal(fp8[key], w), key
            continue
        want_q, want_s = block_reference(w, BLOCK)
        assert torch.equal(fp8[key + "_scale_inv"], want_s), key
        assert torch.equal(fp8[key].view(torch.uint8), want_q.view(torch.uint8)), key
    config = json.loads((minimax["quantized"] / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == json.loads((minimax["bf16"] / "config.json").read_text())
    assert quant["weight_block_size"] == list(BLOCK) and quant["quant_method"] == "fp8"
    assert {"lm_head", "model.embed_tokens"} <= set(quant["modules_to_not_convert"])
    assert any(m.endswith("block_sparse_moe.gate") for m in quant["modules_to_not_convert"])
    encoded = tensors_folder({k: dequantized(fp8[k], fp8[k + "_scale_inv"], BLOCK).to(v.dtype) if k in linear else v
                       for k, v in plain.items()}, minimax["bf16"], tmp_path / "encoded")  # what the codes encode
    got, want = hf_logits(minimax["quantized"]), hf_logits(encoded)  # transformers: default strictness
    assert (got - want).abs().max() < 1e-2 * want.abs().max()  # transformers runs FP8 in bf16 on a CPU
    assert (hf_logits(minimax["bf16"]) - want).abs().max() > 0  # the encoding is not the identity


def test_an_fp8_folder_requantized_is_the_block_formula_of_the_model_it_encodes(minimax, tmp_path):
    """FP8 in, ``--quantize fp8`` out at the release's blocks: the codes and scales of the block
    formula applied to the bf16 weights the release encodes (what reshard reads it as), bit for bit;
    everything else as stored."""
    out = _run(minimax["fp8"], tmp_path / "fp8", "--to", "hf", "--quantize", "fp8", "--fp8-block", "32x48")
    got, stored = hf_tensors(out), hf_tensors(minimax["fp8"])
    assert sorted(got) == sorted(stored)
    for key, value in stored.items():
        if key.endswith("_scale_inv"):
            continue
        if not re.search(LINEAR, key):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
            continue
        want_q, want_s = block_reference(minimax["encoded"][key], (32, 48))
        assert torch.equal(got[key + "_scale_inv"], want_s), key
        assert torch.equal(got[key].view(torch.uint8), want_q.view(torch.uint8)), key
    config, release = (json.loads((d / "config.json").read_text()) for d in (out, minimax["fp8"]))
    quant = config.pop("quantization_config")
    assert config == {**{k: v for k, v in release.items() if k != "quantization_config"}, "dtype": "bfloat16"}
    assert (quant["fmt"], quant["weight_block_size"]) == ("e4m3", [32, 48])


@pytest.mark.parametrize("extra", [("--target-tp", "1"), ("--to", "torch_dist")], ids=["megatron", "torch_dist"])
def test_megatron_core_outputs_are_refused_naming_the_norm(minimax, tmp_path, capsys, extra):
    dst = tmp_path / "out"
    assert main(["run", "--direct", str(minimax["bf16"]), str(dst), *extra]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"reshard: error: {minimax['bf16'] / 'config.json'}: "), err
    assert "q_norm / k_norm" in err and "per head" in err and "(fix: " in err


@pytest.fixture(scope="module")
def qwen3_moe_core(tmp_path_factory):
    """A Qwen3-MoE folder imported into megatron-core's layout, and a copy of MiniMax-M2's kind (per-head
    query/key norms, the MoE layer's router sigmoid with an expert bias, no shared expert)."""
    from test_moe import make_hf_moe

    root = tmp_path_factory.mktemp("minimax_core")
    make_hf_moe("qwen3_moe", root / "hf")
    plain = _run(root / "hf", root / "core", "--target-tp", "1")
    sigmoid = copy_with_args(plain, root / "sigmoid", moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True)
    for f in sigmoid.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"]["decoder.layers.1.mlp.router.expert_bias"] = torch.zeros(4)  # layer 0 is dense
        torch.save(sd, f)
    return {"plain": plain, "sigmoid": sigmoid}


@pytest.mark.parametrize("src,extra", [("sigmoid", ()), ("plain", ("--hf-architecture", "MiniMaxM2ForCausalLM"))],
                         ids=["decided", "asked"])
def test_a_megatron_core_model_is_not_written_as_minimax_m2(qwen3_moe_core, tmp_path, capsys, src, extra):
    dst = tmp_path / "hf"
    assert main(["run", "--direct", str(qwen3_moe_core[src]), str(dst), "--to", "hf", *extra]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "q_norm / k_norm" in err and "per head" in err, err


def test_its_config_json_describes_no_megatron_checkpoint(minimax, qwen3_moe_core, tmp_path, capsys):
    """``--model-config`` (the facts of a checkpoint that saves none) with MiniMax-M2's config.json:
    no megatron-core model is it, so it is refused naming the norm."""
    config = json.loads((minimax["bf16"] / "config.json").read_text())  # at the checkpoint's sizes
    config.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  num_local_experts=4, intermediate_size=48, vocab_size=256, rms_norm_eps=1e-6)
    (tmp_path / "config.json").write_text(json.dumps(config))
    src = shutil.copytree(qwen3_moe_core["plain"], tmp_path / "src")
    for f in src.rglob("model_optim_rng.pt"):  # a checkpoint that saves no args
        sd = torch.load(f, weights_only=False)
        del sd["args"]
        torch.save(sd, f)
    dst = tmp_path / "hf"
    assert main(["run", "--direct", str(src), str(dst), "--to", "hf", "--model-config",
                 str(tmp_path / "config.json")]) == 2
    assert not dst.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "q_norm / k_norm" in err and "config.json" in err, err
