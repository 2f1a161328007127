"""Qwen3-Next and Qwen3.5 (transformers' ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``) <-> megatron-core's GPT model with gated DeltaNet layers, both ways.

Tiny models transformers builds (4 layers: three gated DeltaNet layers and one gated attention layer,
two value heads per key head; Qwen3-Next's with MoE layers, a gated shared expert and one dense layer)
are imported to megatron-core at TP 1 and TP 2 (x EP 2); megatron-core's forward of each (its own
``GPTModel`` from its hybrid block spec, with the stand-ins :mod:`mcore_gdn` names for Transformer
Engine and flash-linear-attention) gives transformers' logits. A checkpoint megatron-core writes itself
at TP 2 x EP 2 goes ``--to hf`` into a folder transformers loads with megatron-core's logits; HF -> TP 2
x EP 2 -> HF gives back every tensor bit for bit. All real-tool work runs in one harness launch
(:func:`harness`).

The layout is checked tensor by tensor too, from transformers' own reading of its tensors: each of the
six input-projection sections split over TP on its own, conv1d per section, the gated norm stored as
``w - 1``, ``A_log`` as it is, the attention's query and gate rows per query group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_fixtures import TOKENS, copy_with_args, needs_mcore, run_harness
from reshard.cli import main
from reshard.core.safe_load import load_shard

TOL = 2e-5
#: A tiny Qwen3-Next: layers 0-2 gated DeltaNet, 3 attention; layer 1 dense (mlp_only_layers).
CONFIG = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "intermediate_size": 48, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
          "mlp_only_layers": [1], "bos_token_id": 1, "eos_token_id": 2}
DENSE = {k: v for k, v in CONFIG.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                      "shared_expert_intermediate_size", "mlp_only_layers")}
#: The same architecture written by megatron-core itself (the harness's options).
MCORE_MODEL = {"layers": 4, "hidden": 32, "heads": 4, "groups": 2, "kv_channels": 8, "ffn": 48, "norm": "RMSNorm",
               "bias": False, "swiglu": True, "pos": "rope", "tied": False, "vocab": 128, "divisible_by": 128,
               "saved_vocab_size": 128, "seq": 64, "experts": 4, "topk": 2, "moe_ffn": 16, "shared_ffn": 24,
               "moe_layer_freq": [1, 0, 1, 1], "eps": 1e-6, "rotary_percent": 0.25, "norm_noise": True,
               "gdn": {"linear_attention_freq": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}}
_GDN = "decoder.layers.{}.self_attention."
#: A vision tower of one block (Qwen3.5's folders hold one beside the language model) and the language
#: model's rotary embedding as the releases state it: M-RoPE sections, which text tokens' equal
#: positions on the three axes make the plain rotary embedding.
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}
MROPE = {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                             "mrope_interleaved": True}}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _rank(folder: Path, rank_dir: str) -> dict:
    return load_shard(next(folder.glob(f"*/{rank_dir}/model_optim_rng.pt")))


def _transformers(folder: Path):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0], info


def _run(*argv: str) -> None:
    assert main(["run", "--direct", *argv]) == 0


def _made(root: Path, name: str, cls: str, config: dict) -> dict:
    """A folder transformers saves (fp32; norms, A_log and dt_bias drawn away from their initial
    values, the gated norm within [1, 1.5] where ``w - 1`` is exact) and its logits."""
    import transformers

    torch.manual_seed(3)
    cfg_cls = {"Qwen3NextForCausalLM": transformers.Qwen3NextConfig,
               "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
               "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig}[cls]
    model = getattr(transformers, cls)(cfg_cls(**config, initializer_range=0.1)).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith(("A_log", "dt_bias")):
                p.add_(torch.rand_like(p) * 0.5)
        want = model(torch.tensor([TOKENS])).logits[0]
    model.save_pretrained(root / name)
    return {"hf": root / name, "want": want}


def _made_vl(root: Path, name: str, cls: str, text: dict) -> dict:
    """A vision-language folder transformers saves (``cls``: ``Qwen3_5ForConditionalGeneration`` or
    the MoE one; ``text``: its language model's config, with :data:`MROPE`) and the logits of its
    forward on text tokens."""
    import transformers

    torch.manual_seed(5)
    config = getattr(transformers, cls.replace("ForConditionalGeneration", "Config"))(
        text_config={**text, **MROPE, "initializer_range": 0.1}, vision_config=VISION)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith(("A_log", "dt_bias")):
                p.add_(torch.rand_like(p) * 0.5)
        want = model(input_ids=torch.tensor([TOKENS])).logits[0]
    model.save_pretrained(root / name)
    return {"hf": root / name, "want": want}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """The two folders (``next``: Qwen3-Next with MoE, ``dense``: Qwen3.5) and reshard's outputs of them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("qwen3_next")
    out = {"root": root, "next": _made(root, "next_hf", "Qwen3NextForCausalLM", CONFIG),
           "dense": _made(root, "dense_hf", "Qwen3_5ForCausalLM", DENSE),
           "vl": _made_vl(root, "vl_hf", "Qwen3_5ForConditionalGeneration", DENSE)}
    paths = {name: root / name for name in ("tp1", "tp2", "back", "tp2pp2", "back_pp", "dense_tp2", "dense_back",
                                            "dense_dist", "dense_dist_back", "next_dist", "next_dist_back",
                                            "vl_tp2")}
    _run(str(out["next"]["hf"]), str(paths["tp1"]), "--target-tp", "1")
    _run(str(out["next"]["hf"]), str(paths["tp2"]), "--target-tp", "2", "--target-ep", "2")
    _run(str(paths["tp2"]), str(paths["back"]), "--to", "hf")
    # PP 2 from TP 2 x EP 2: stage 1 starts with a DeltaNet layer (2) and holds the attention layer (3)
    _run(str(paths["tp2"]), str(paths["tp2pp2"]), "--target-tp", "2", "--target-ep", "2", "--target-pp", "2")
    _run(str(paths["tp2pp2"]), str(paths["back_pp"]), "--to", "hf")
    _run(str(out["dense"]["hf"]), str(paths["dense_tp2"]), "--target-tp", "2")
    _run(str(paths["dense_tp2"]), str(paths["dense_back"]), "--to", "hf")
    _run(str(out["dense"]["hf"]), str(paths["dense_dist"]), "--to", "torch_dist")
    _run(str(paths["dense_dist"]), str(paths["dense_dist_back"]), "--to", "hf")
    _run(str(out["next"]["hf"]), str(paths["next_dist"]), "--to", "torch_dist")
    _run(str(paths["next_dist"]), str(paths["next_dist_back"]), "--to", "hf")
    _run(str(out["vl"]["hf"]), str(paths["vl_tp2"]), "--target-tp", "2")
    return {**out, **paths}


@pytest.fixture(scope="module")
def harness(made) -> dict:
    """One harness launch: megatron-core runs the imports (each model built from the checkpoint's own
    args; the torch_dist ones through its ``dist_checkpointing.load``) and writes its own Qwen3-Next at
    TP 2 x EP 2, per rank and in torch_dist, which then go ``--to hf``."""
    root = made["root"]
    work = root / "harness"
    forward = dict(kind="forward", from_args=True, model={}, tokens=TOKENS)
    jobs = [{"kind": "write", "out": str(root / "mcore"), "tp": 2, "ep": 2, "model": MCORE_MODEL, "tokens": TOKENS},
            {**forward, "ckpt": str(made["tp1"]), "tp": 1, "out": str(work / "tp1.pt")},
            {**forward, "ckpt": str(made["tp2"]), "tp": 2, "ep": 2, "out": str(work / "tp2.pt")},
            {**forward, "ckpt": str(made["tp2pp2"]), "tp": 2, "ep": 2, "pp": 2, "out": str(work / "tp2pp2.pt")},
            {**forward, "ckpt": str(made["dense_tp2"]), "tp": 2, "out": str(work / "dense_tp2.pt")},
            {**forward, "kind": "forward_dist", "ckpt": str(made["dense_dist"]), "tp": 2,
             "out": str(work / "dense_dist.pt")},
            {**forward, "kind": "forward_dist", "ckpt": str(made["next_dist"]), "tp": 2, "ep": 2,
             "out": str(work / "next_dist.pt")},
            {**forward, "ckpt": str(made["vl_tp2"]), "tp": 2, "out": str(work / "vl_tp2.pt")},
            {"kind": "write_dist", "out": str(root / "mcore_dist"), "tp": 2, "ep": 2, "model": MCORE_MODEL,
             "tokens": TOKENS}]
    work.mkdir()
    run_harness(jobs, work)
    _run(str(root / "mcore"), str(root / "mcore_hf"), "--to", "hf")
    _run(str(root / "mcore_dist"), str(root / "mcore_dist_hf"), "--to", "hf")
    # megatron-core's own checkpoint resharded in its layout: sections merged (TP 1), experts dealt to EP 4
    _run(str(root / "mcore"), str(root / "mcore_tp1"), "--target-tp", "1", "--target-ep", "4")
    run_harness([{**forward, "ckpt": str(root / "mcore_tp1"), "tp": 1, "ep": 4, "out": str(work / "mcore_tp1.pt")}],
                work)
    return {"logits": {k: torch.load(work / f"{k}.pt") for k in ("tp1", "tp2", "tp2pp2", "dense_tp2", "dense_dist",
                                                                 "next_dist", "vl_tp2", "mcore_tp1")},
            "mcore": torch.load(root / "mcore" / "logits.pt"), "mcore_hf": root / "mcore_hf",
            "mcore_dir": root / "mcore", "mcore_dist": torch.load(root / "mcore_dist" / "logits.pt"),
            "mcore_dist_hf": root / "mcore_dist_hf"}


# --- megatron-core computes what transformers computes --------------------------------------------

@needs_mcore
@pytest.mark.parametrize("layout,model", [("tp1", "next"), ("tp2", "next"), ("tp2pp2", "next"),
                                          ("dense_tp2", "dense"), ("dense_dist", "dense"), ("next_dist", "next"),
                                          ("vl_tp2", "vl")])
def test_megatron_core_runs_the_import_with_transformers_logits(made, harness, layout, model):
    got, want = harness["logits"][layout], made[model]["want"]
    diff = (got[:, :want.shape[1]] - want).abs().max().item()
    assert diff < TOL, f"{layout}: logits differ by {diff:.2e}"


@needs_mcore
def test_megatron_core_runs_its_own_checkpoint_resharded_with_its_logits(harness):
    """megatron-core's TP 2 x EP 2 checkpoint -> TP 1 x EP 4 (each section of the mixer merged on its
    own): megatron-core computes the logits it computed at TP 2 x EP 2."""
    got, want = harness["logits"]["mcore_tp1"], harness["mcore"]
    diff = (got[:, :128] - want[:, :128]).abs().max().item()  # the vocabulary, padded for TP 2 and for TP 1
    assert diff < TOL, f"logits differ by {diff:.2e}"


@needs_mcore
def test_a_megatron_core_checkpoint_goes_to_hf_with_its_logits(harness):
    """megatron-core's own TP 2 x EP 2 checkpoint, exported: transformers loads it with nothing missing
    or left over and computes megatron-core's logits."""
    got, info = _transformers(harness["mcore_hf"])
    assert not any(info.values()), info
    diff = (got - harness["mcore"][:, :got.shape[1]]).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"
    config = json.loads((harness["mcore_hf"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["mlp_only_layers"] == [1]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


@needs_mcore
def test_a_megatron_core_torch_dist_checkpoint_goes_to_hf_with_its_logits(harness):
    """megatron-core's own TP 2 x EP 2 torch_dist save (the mixer's split keys, the experts on their
    global axis, each MoE layer's ``pre_mlp_layernorm``), ``--to hf``: transformers loads it with nothing
    missing or left over and computes megatron-core's logits."""
    got, info = _transformers(harness["mcore_dist_hf"])
    assert not any(info.values()), info
    diff = (got - harness["mcore_dist"][:, :got.shape[1]]).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"


@needs_mcore
def test_an_import_holds_the_entries_megatron_core_saves(made, harness):
    """Every rank file of the TP 2 x EP 2 import holds the names (extra states included) and shapes
    megatron-core's own model of the same config saves there."""
    for rank_dir in ("mp_rank_00_000", "mp_rank_01_001"):
        ours, theirs = _rank(made["tp2"], rank_dir)["model"], _rank(harness["mcore_dir"], rank_dir)["model"]
        assert sorted(ours) == sorted(theirs)
        for key, t in theirs.items():
            assert t is None and ours[key] is None or ours[key].shape == t.shape, key


# --- both ways, bit for bit ------------------------------------------------------------------------

@pytest.mark.parametrize("src,back", [("next", "back"), ("next", "back_pp"), ("dense", "dense_back"),
                                      ("dense", "dense_dist_back")])
def test_hf_to_megatron_and_back_gives_every_tensor_bit_for_bit(made, src, back):
    want, got = _tensors(made[src]["hf"]), _tensors(made[back])
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    config, again = (json.loads((f / "config.json").read_text()) for f in (made[src]["hf"], made[back]))
    for key in ("architectures", "model_type", "layer_types", "rope_parameters", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "head_dim", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "bos_token_id"):
        assert again[key] == config[key], key
    if src == "next":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "mlp_only_layers", "norm_topk_prob"):
            assert again[key] == config[key], key


# --- the layout, tensor by tensor, from transformers' reading ----------------------------------------

def _sections(hf: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """q, k, v, z, b, a rows of a Qwen3-Next mixer as transformers' ``fix_query_key_value_ordering``
    reads them (all heads of each, in order)."""
    nk, nv, dk, dv = 2, 4, 8, 8
    r = nv // nk
    qkvz = hf[f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * r * dv, -1)
    ba = hf[f"model.layers.{layer}.linear_attn.in_proj_ba.weight"].view(nk, 2 * r, -1)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba, [r, r], dim=1)
    return {n: t.reshape(-1, t.shape[-1]) for n, t in zip("qkvzba", (q, k, v, z, b, a))}


def test_each_section_of_the_mixer_splits_over_tp_on_its_own(made):
    """TP rank ``t`` of 2 holds the ``t``-th half of each of q, k, v, z, beta, alpha (in_proj) and of q,
    k, v (conv1d), as megatron-core's ``GatedDeltaNet.sharded_state_dict`` shards them; A_log and
    dt_bias by value heads, the gated norm as ``w - 1``, whole."""
    hf = _tensors(made["next"]["hf"])
    for t in range(2):
        module = _rank(made["tp2"], f"mp_rank_{t:02d}_000")["model"]
        for layer in range(3):
            parts = _sections(hf, layer)
            want = torch.cat([p.chunk(2)[t] for p in parts.values()])
            assert torch.equal(module[_GDN.format(layer) + "in_proj.weight"], want), (t, layer)
            conv = hf[f"model.layers.{layer}.linear_attn.conv1d.weight"]
            want_conv = torch.cat([s.chunk(2)[t] for s in torch.split(conv, [16, 16, 32])])
            assert torch.equal(module[_GDN.format(layer) + "conv1d.weight"], want_conv), (t, layer)
            for name in ("A_log", "dt_bias"):
                assert torch.equal(module[_GDN.format(layer) + name],
                                   hf[f"model.layers.{layer}.linear_attn.{name}"].chunk(2)[t])
            assert torch.equal(module[_GDN.format(layer) + "out_norm.weight"],
                               hf[f"model.layers.{layer}.linear_attn.norm.weight"] - 1)
            assert torch.equal(module[_GDN.format(layer) + "in_proj.layer_norm_weight"],
                               hf[f"model.layers.{layer}.input_layernorm.weight"])


def test_the_gated_attention_holds_query_then_gate_per_query_group(made):
    """megatron-core's ``linear_qkv`` with the output gate: per query group, its query heads, their gate
    heads, the key, the value (transformers' ``q_proj``: per head, query then gate); TP rank ``t`` of 2
    holds query group ``t``; the attention layer's input norm is the fused ``linear_qkv`` one."""
    hf = _tensors(made["next"]["hf"])
    d, q = 8, 2
    qg = hf["model.layers.3.self_attn.q_proj.weight"].view(4, 2, d, -1)  # head, (query, gate), dim
    k = hf["model.layers.3.self_attn.k_proj.weight"].view(2, d, -1)
    v = hf["model.layers.3.self_attn.v_proj.weight"].view(2, d, -1)
    for t in range(2):
        module = _rank(made["tp2"], f"mp_rank_{t:02d}_000")["model"]
        heads = slice(t * q, (t + 1) * q)
        want = torch.cat([qg[heads, 0].reshape(-1, 32), qg[heads, 1].reshape(-1, 32), k[t], v[t]])
        assert torch.equal(module["decoder.layers.3.self_attention.linear_qkv.weight"], want), t
        assert torch.equal(module["decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"],
                           hf["model.layers.3.input_layernorm.weight"])
        assert torch.equal(module["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                           hf["model.layers.1.post_attention_layernorm.weight"])
        assert torch.equal(module["decoder.layers.0.pre_mlp_layernorm.weight"],
                           hf["model.layers.0.post_attention_layernorm.weight"])


def test_the_saved_args_build_the_hybrid_model(made):
    """The args an import writes are Megatron-LM's flags for these layers."""
    args = _rank(made["tp2"], "mp_rank_00_000")["args"]
    assert args.experimental_attention_variant == "gated_delta_net" and args.linear_attention_freq == 4
    assert args.attention_output_gate and args.qk_layernorm and args.layernorm_zero_centered_gamma
    assert args.rotary_percent == 0.25 and args.transformer_impl == "transformer_engine"
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
    assert args.moe_layer_freq == [1, 0, 1, 1] and args.moe_shared_expert_gate and not args.moe_router_pre_softmax


# --- refusals in one line ----------------------------------------------------------------------------

def _edited(made: dict, tmp_path: Path, **changes) -> Path:
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(made["next"]["hf"], dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("change,needle", [
    ({"hidden_act": "gelu"}, "activation gelu"),
    ({"attention_bias": True}, "attention biases"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}}, "rotary scaling yarn"),
])
def test_a_config_megatron_core_does_not_compute_is_refused_in_one_line(made, tmp_path, capsys, change, needle):
    src = _edited(made, tmp_path, **change)
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith("reshard: error:"), err
    assert not (tmp_path / "out").exists()


def test_a_cut_key_head_is_refused_naming_the_tps_that_work(made, tmp_path, capsys):
    """4 target ranks would cut the mixer's 2 key heads (q's rows of one head on two ranks)."""
    assert main(["run", "--direct", str(made["tp2"]), str(tmp_path / "out"), "--target-tp", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "self_attention." in err[0] and "fused section 0: 2 units of 8 rows" in err[0], err
    assert err[0].endswith("(fix: choose a target TP among 1, 2)"), err


# --- FP8 block releases out and in ---------------------------------------------------------------------

def test_fp8_export_loads_in_transformers_and_reads_back_as_the_model_it_encodes(made, tmp_path):
    """``--to hf --quantize fp8`` (blocks of 8: they divide every linear weight, as transformers' CPU
    path needs): transformers loads it with every key and computes what the plain export computes with
    the blocks' dequantized linear weights (the mixer's in_proj_qkvz, in_proj_ba, out_proj among them);
    the folder goes to megatron-core at TP 2 x EP 2 and back to the same dequantized weights."""
    from safetensors.torch import save_file

    from test_fp8_export import dequantized
    from test_hf_export import hf_logits

    fp8_dir = tmp_path / "fp8"
    _run(str(made["tp2"]), str(fp8_dir), "--to", "hf", "--quantize", "fp8", "--fp8-block", "8")
    fp8, plain = _tensors(fp8_dir), _tensors(made["back"])
    assert {k[:-len("_scale_inv")] for k in fp8 if k.endswith("_scale_inv")} >= {
        "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.linear_attn.out_proj.weight", "model.layers.3.self_attn.q_proj.weight"}
    want = {k: dequantized(fp8[k], fp8[k + "_scale_inv"], (8, 8)) if k + "_scale_inv" in fp8 else v
            for k, v in plain.items()}
    encoded = tmp_path / "encoded"
    encoded.mkdir()
    (encoded / "config.json").write_text((made["back"] / "config.json").read_text())
    save_file(want, str(encoded / "model.safetensors"), metadata={"format": "pt"})
    got, expect = hf_logits(fp8_dir), hf_logits(encoded)
    assert (got - expect).abs().max() < 1e-2 * expect.abs().max()
    _run(str(fp8_dir), str(tmp_path / "tp2"), "--target-tp", "2", "--target-ep", "2")
    _run(str(tmp_path / "tp2"), str(tmp_path / "again"), "--to", "hf")
    again = _tensors(tmp_path / "again")
    assert set(again) == set(want)
    for key, t in want.items():
        assert torch.equal(again[key], t), key


# --- Qwen3.5's MoE text model -------------------------------------------------------------------------

def test_qwen3_5_moe_goes_to_megatron_core_and_back_as_itself_or_as_qwen3_next(made, tmp_path):
    """Qwen3.5-MoE (every layer MoE, split projections) -> TP 2 x EP 2 -> HF: as Qwen3-Next's class by
    default (it computes the same model; transformers gives the same logits), bit for bit as
    ``Qwen3_5MoeForCausalLM`` under ``--hf-architecture``."""
    from test_hf_export import hf_logits

    config = {k: v for k, v in CONFIG.items() if k != "mlp_only_layers"}
    src = _made(tmp_path, "q35moe", "Qwen3_5MoeForCausalLM", config)
    _run(str(src["hf"]), str(tmp_path / "tp2"), "--target-tp", "2", "--target-ep", "2")
    _run(str(tmp_path / "tp2"), str(tmp_path / "as_next"), "--to", "hf")
    _run(str(tmp_path / "tp2"), str(tmp_path / "back"), "--to", "hf", "--hf-architecture", "Qwen3_5MoeForCausalLM")
    want, got = _tensors(src["hf"]), _tensors(tmp_path / "back")
    assert set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    as_next = json.loads((tmp_path / "as_next" / "config.json").read_text())
    assert as_next["architectures"] == ["Qwen3NextForCausalLM"] and as_next["mlp_only_layers"] == []
    assert (hf_logits(tmp_path / "as_next") - src["want"]).abs().max() < TOL


# --- export refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,needle", [
    ({"attention_output_gate": False}, "96 rows are not 2 query groups of 32 rows"),  # planned before the export
    ({"apply_layernorm_1p": False, "layernorm_zero_centered_gamma": False}, "args.apply_layernorm_1p is False"),
    ({"linear_attention_freq": 2}, "contradicts the gated DeltaNet layers"),
    ({"moe_router_score_function": "sigmoid"}, "router scores not by softmax"),
])
def test_an_export_the_classes_do_not_compute_is_refused_in_one_line(made, tmp_path, capsys, changes, needle):
    src = copy_with_args(made["tp2"], tmp_path / "src", **changes)
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_dense_model_is_not_written_as_qwen3_5_moe(made, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--direct", str(made["dense_tp2"]), str(out), "--to", "hf", "--hf-architecture",
                 "Qwen3_5MoeForCausalLM"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Qwen3_5MoeForCausalLM does not compute it" in err[0], err


def test_a_gated_norm_weight_whose_w_minus_1_is_not_exact_is_refused_in_one_line(made, tmp_path, capsys):
    """In bf16, ``w - 1`` of a gated norm weight below 0.5 rounds: refused naming the tensor, nothing
    committed."""
    from safetensors.torch import save_file

    src = tmp_path / "bf16"
    src.mkdir()
    tensors = {k: v.to(torch.bfloat16) for k, v in _tensors(made["dense"]["hf"]).items()}
    tensors["model.layers.0.linear_attn.norm.weight"][0] = 0.0123
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((made["dense"]["hf"] / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.layers.0.linear_attn.norm.weight" in err[0] and "w - 1" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_releases_multi_token_prediction_weights_are_left_out_with_a_warning(made, tmp_path, capsys):
    """A release's ``mtp.*`` tensors (``mtp_num_hidden_layers``), which transformers does not load:
    the import leaves them out and says so; the rest is the folder's."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "release"
    shutil.copytree(made["dense"]["hf"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    tensors = {**_tensors(src), "mtp.fc.weight": torch.ones(32, 64), "mtp.norm.weight": torch.ones(32)}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    _run(str(src), str(tmp_path / "tp1"), "--target-tp", "1")
    said = capsys.readouterr()
    assert "mtp_num_hidden_layers 1: the folder's multi-token prediction weights (mtp.*) are not imported" in \
        said.out + said.err
    module = _rank(tmp_path / "tp1", "mp_rank_00")["model"]
    assert not any("mtp" in k for k in module)


# --- the layer pattern both ways ------------------------------------------------------------------------

def test_an_irregular_layer_pattern_is_one_flag_per_layer_both_ways(tmp_path):
    """``layer_types`` that no ``linear_attention_freq`` int spells are one flag per layer in the args
    (megatron-core's list form) and come back as the same ``layer_types``."""
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    src = _made(tmp_path, "irregular", "Qwen3_5ForCausalLM", {**DENSE, "layer_types": types})
    _run(str(src["hf"]), str(tmp_path / "tp2"), "--target-tp", "2")
    assert _rank(tmp_path / "tp2", "mp_rank_00")["args"].linear_attention_freq == [0, 1, 1, 0]
    _run(str(tmp_path / "tp2"), str(tmp_path / "back"), "--to", "hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["layer_types"] == types
    want, got = _tensors(src["hf"]), _tensors(tmp_path / "back")
    assert set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


def test_a_release_config_without_layer_types_reads_full_attention_interval(made, tmp_path):
    """transformers 4's ``config.json`` of the releases: ``full_attention_interval`` (and the rotary's
    ``rope_theta``, ``partial_rotary_factor`` at the top), no ``layer_types``."""
    import shutil

    src = tmp_path / "release"
    shutil.copytree(made["next"]["hf"], src)
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config.update(full_attention_interval=4, rope_theta=rope["rope_theta"], rope_scaling=None,
                  partial_rotary_factor=rope["partial_rotary_factor"])
    (src / "config.json").write_text(json.dumps(config))
    _run(str(src), str(tmp_path / "tp1"), "--target-tp", "1")
    args = _rank(tmp_path / "tp1", "mp_rank_00")["args"]
    assert args.linear_attention_freq == 4 and args.rotary_percent == 0.25


@pytest.mark.parametrize("model", ["dense", "next"])
def test_torch_dist_holds_the_mixers_split_keys_and_the_experts(made, model):
    """torch_dist keys the mixer's fused tensors as megatron-core's sharded state dict does
    (``in_proj.weight.query`` ... ``conv1d.weight.value``), an MoE layer's experts on the global expert
    axis beside its own ``pre_mlp_layernorm`` (Transformer Engine's spec has no keys map folding it into
    ``mlp.linear_fc1``), and reads back bit for bit (megatron-core loads them above)."""
    from reshard.core.dcp_metadata import read_metadata

    meta = read_metadata(next(made[f"{model}_dist"].glob("iter_*/.metadata")))
    keys = set(meta.tensors)
    mixer = "decoder.layers.0.self_attention."
    assert {mixer + f"in_proj.weight.{p}" for p in ("query", "key", "value", "z", "beta", "alpha")} <= keys
    assert {mixer + f"conv1d.weight.{p}" for p in ("query", "key", "value")} <= keys
    assert mixer + "in_proj.weight" not in keys
    if model == "next":  # layer 1 dense (its norm fused into fc1), 0, 2, 3 MoE
        assert meta.tensors["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"].shape == (4, 32, 32)
        assert meta.tensors["decoder.layers.2.mlp.experts.experts.linear_fc2.weight"].shape == (4, 32, 16)
        assert {"decoder.layers.2.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.2.mlp.shared_experts.gate_weight"} <= keys
        assert not any(k.startswith("decoder.layers.2.mlp.linear_fc1.") for k in keys)
    want, got = _tensors(made[model]["hf"]), _tensors(made[f"{model}_dist_back"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], t) for k, t in want.items())


# --- Qwen3.5's vision-language folders ---------------------------------------------------------------

def test_a_vision_language_folder_imports_its_language_model_with_one_warning(tmp_path, capsys):
    """``Qwen3_5MoeForConditionalGeneration``'s folder (``model.language_model.*``, ``text_config``) at
    TP 2 x EP 2: its language model, said once to leave the vision tower out, back as a text class that
    transformers loads with the folder's logits on text tokens (megatron-core runs the dense one above);
    the vision-language class itself is refused as an export in one line."""
    moe = {k: v for k, v in CONFIG.items() if k != "mlp_only_layers"}
    src = _made_vl(tmp_path, "vl_moe", "Qwen3_5MoeForConditionalGeneration", moe)
    capsys.readouterr()
    assert main(["run", "--direct", str(src["hf"]), str(tmp_path / "tp2"), "--target-tp", "2", "--target-ep", "2"]) == 0
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "vision tower" in line]
    assert len(said) == 1 and "model.visual.*" in said[0] and "Qwen3_5MoeForCausalLM" in said[0], said
    ranks = _rank(tmp_path / "tp2", "mp_rank_00_000")
    assert not any("visual" in k for k in ranks["model"])
    assert ranks["args"].hf_token_ids == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}  # text_config's
    _run(str(tmp_path / "tp2"), str(tmp_path / "back"), "--to", "hf", "--hf-architecture", "Qwen3_5MoeForCausalLM")
    got, info = _transformers(tmp_path / "back")
    assert not any(info.values()), info
    diff = (got - src["want"]).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"
    argv = ["run", "--direct", str(tmp_path / "tp2"), str(tmp_path / "o"), "--to", "hf", "--hf-architecture",
            "Qwen3_5MoeForConditionalGeneration"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision tower" in err[0] and "Qwen3_5MoeForCausalLM" in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_vision_language_config_without_text_config_is_refused_in_one_line(made, tmp_path, capsys):
    import shutil

    src = shutil.copytree(made["vl"]["hf"], tmp_path / "vl")
    config = json.loads((src / "config.json").read_text())
    del config["text_config"]
    (src / "config.json").write_text(json.dumps(config))
    assert main(["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "text_config" in err[0] and err[0].startswith("reshard: error:"), err
    assert not (tmp_path / "o").exists()
