"""``--quantize like-source --quantize-like DIR`` (:mod:`reshard.core.like_source`, written by the
``hf`` format): a model imported from a quantized release and exported comes back in the release's
format.

Releases: compressed-tensors pack-quantized INT4 by group and by channel, INT8 by channel,
float-quantized FP8 by channel and by tensor, and NVFP4A16 (with llm-compressor's fused global
scales, and with each weight's own), each written by compressed-tensors itself
(``tests/quantized_releases.py``, with ``ignore`` listing the head and every ``down_proj``);
DeepSeek FP8 blocks of 32 x 48 and GPT-OSS MXFP4 (the stacked plug-in architecture,
``tests/plugin_stacked_moe.py``), laid out by reshard's encoders and then given scales and codes
no quantizer's rule makes (FP8 scales times 1.37; MXFP4 codes of magnitude at most 3), so that
re-quantizing the dequantized weights does not give the release back and only copying does.
W4A4 NVFP4 releases: ModelOpt's (its own ``NVFP4QTensor``, ``weight_scale_2`` shared by q/k/v and
gate/up as its export fuses them) and compressed-tensors' ``NVFP4`` preset, each layer with a
calibrated activation scale, which like-source keeps from the release.

Proof: release -> bf16 -> like-source gives every stored tensor of the release back bit for bit
and its ``quantization_config``; with one weight edited only that weight's tensors differ, and
they are the scheme's fresh quantization (compressed-tensors' own compressor; DeepSeek's FP8
formula; the OCP MXFP4 rule); through megatron-core at TP 2 the release comes back bit for bit; a
model with a layer the release lacks gets it quantized afresh where the release's rule targets it
and left as it is where its ``ignore`` says; transformers loads the outputs; bad requests are
refused in one line with nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from plugin_stacked_moe import StackedMoe
from quantized_releases import (
    SCHEMES,
    ct_compress_fused,
    ct_compress_weight,
    ct_dequantized,
    differing,
    folder_tensors,
    make_ct_folder,
    make_modelopt_folder,
    modelopt_fused,
)
from reshard.cli import main
from reshard.core import fp8_block, like_source, mxfp4
from reshard.models.hf_registry import register_hf_architecture, unregister_hf_architecture

_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
#: compressed-tensors schemes written (``QuantizationArgs`` of the weights).
CT = {"int4-group": SCHEMES["w4a16"],
      "int4-channel": dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
      "int8-channel": SCHEMES["w8a16"],
      "fp8-channel": SCHEMES["fp8_channel"],
      "fp8-tensor": dict(num_bits=8, type="float", symmetric=True, strategy="tensor")}
IGNORE = ("lm_head", "re:.*down_proj")
BLOCK = (32, 48)
#: The stacked plug-in's model (GPT-OSS's expert names).
E, H, F, VOCAB = 4, 64, 32, 128
MOE = {"architectures": ["StackedMoeForCausalLM"], "model_type": "stacked_moe", "hidden_size": H,
       "intermediate_size": F, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 10000.0, "num_local_experts": E,
       "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
       "eos_token_id": 2, "dtype": "bfloat16", "attention_bias": True, "mlp_bias": True}
EDITED = {"mxfp4": "model.layers.0.mlp.experts.gate_up_proj"}
EDITED_DENSE = "model.layers.0.self_attn.q_proj.weight"


def _run(*argv: str) -> int:
    return main(["run", "--direct", *argv])




def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _llama(folder: Path) -> None:
    import transformers

    torch.manual_seed(58)
    config = transformers.LlamaConfig(**_LLAMA, initializer_range=0.1)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)


def _moe(folder: Path) -> None:
    """A bf16 folder of the stacked plug-in: experts ``[E, in, out]``, biases on every linear."""
    torch.manual_seed(5)

    def r(*shape):
        return (torch.randn(*shape) * 0.1).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H), "lm_head.weight": r(VOCAB, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
              p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(H // 2, H),
              p + "self_attn.v_proj.weight": r(H // 2, H), p + "self_attn.o_proj.weight": r(H, H),
              p + "mlp.router.weight": r(E, H), p + "mlp.experts.gate_up_proj": r(E, H, 2 * F),
              p + "mlp.experts.down_proj": r(E, F, H), p + "mlp.experts.down_proj_bias": r(E, H),
              p + "mlp.experts.gate_up_proj_bias": r(E, 2 * F)}
        t |= {p + f"self_attn.{x}_proj.bias": r(n) for x, n in (("q", H), ("k", H // 2), ("v", H // 2), ("o", H))}
    folder.mkdir()
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(MOE))


def _rewrite(folder: Path, change) -> None:
    """Each stored tensor of ``folder`` through ``change(key, tensor)`` (same shape and dtype)."""
    t = folder_tensors(folder)
    save_file({k: change(k, v) for k, v in t.items()}, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def moe_arch():
    register_hf_architecture(StackedMoe)
    yield
    unregister_hf_architecture(StackedMoe.name)


@pytest.fixture(scope="module")
def releases(tmp_path_factory, moe_arch) -> dict[str, Path]:
    """Every release, and each one's bf16 import (``NAME/mid``) and like-source export (``NAME/out``)."""
    root = tmp_path_factory.mktemp("like")
    _llama(root / "llama")
    rel = {}
    for name, spec in CT.items():
        rel[name] = root / name / "rel"
        make_ct_folder(root / "llama", rel[name], spec, ignore=IGNORE)
    rel["fp8"] = root / "fp8" / "rel"
    assert _run(str(root / "llama"), str(rel["fp8"]), "--to", "hf", "--quantize", "fp8", "--fp8-block", "32x48") == 0
    _rewrite(rel["fp8"], lambda k, v: v * 1.37 if k.endswith(fp8_block.SCALE_SUFFIX) else v)
    _moe(root / "moe")
    rel["mxfp4"] = root / "mxfp4" / "rel"
    assert _run(str(root / "moe"), str(rel["mxfp4"]), "--to", "hf", "--quantize", "mxfp4") == 0
    gen = torch.Generator().manual_seed(3)

    def small_codes(k, v):  # e2m1 magnitudes 0 .. 3 (nibbles 0-5, 8-13): the rule would double them
        if k.endswith(mxfp4.BLOCKS_SUFFIX):
            lo, hi = (torch.randint(0, 6, v.shape, generator=gen) | torch.randint(0, 2, v.shape, generator=gen) * 8
                      for _ in range(2))
            return (lo | hi << 4).to(torch.uint8)
        return v

    _rewrite(rel["mxfp4"], small_codes)
    for name, folder in rel.items():
        assert _run(str(folder), str(folder.parent / "mid"), "--to", "hf") == 0, name
        assert _run(str(folder.parent / "mid"), str(folder.parent / "out"), "--to", "hf", "--quantize", "like-source",
                    "--quantize-like", str(folder)) == 0, name
    return rel


@pytest.mark.parametrize("name", [*CT, "fp8", "mxfp4"])
def test_an_unchanged_model_comes_back_as_the_release_bit_for_bit(releases, name):
    rel = releases[name]
    assert differing(folder_tensors(rel.parent / "out"), folder_tensors(rel)) == []
    assert _config(rel.parent / "out")["quantization_config"] == _config(rel)["quantization_config"]


def _fresh(name: str, key: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scheme's own fresh quantization of HF weight ``key`` (``w`` as the output holds it), by
    stored name: compressed-tensors' compressor, DeepSeek's formula, the OCP MXFP4 rule."""
    if name in CT:
        module = key.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in ct_compress_weight(CT[name], w).items()}
    if name == "fp8":
        q, s = fp8_block.quantize(w, BLOCK)
        return {key: q, fp8_block.scale_name(key): s}
    blocks, scales = zip(*(mxfp4.quantize(w[e].t().contiguous()) for e in range(w.shape[0])))
    return {key + mxfp4.BLOCKS_SUFFIX: torch.stack(blocks), key + mxfp4.SCALES_SUFFIX: torch.stack(scales)}


def test_recomputing_the_releases_scales_would_not_give_them_back(releases):
    """The releases are such that only copying passes: a fresh quantization of an unchanged
    weight's dequantized values differs from what the release stores, except for
    compressed-tensors' FP8 (a row's largest value codes as 448 exactly, so its scale comes
    back); and compressed-tensors' compressor of the original weights gives the release's
    tensors (the oracle is right)."""
    llama = folder_tensors(releases["int4-group"].parent.parent / "llama")
    lossy = []
    for name in [*CT, "fp8", "mxfp4"]:
        rel = releases[name]
        key = EDITED.get(name, "model.layers.1.self_attn.k_proj.weight")
        fresh = _fresh(name, key, folder_tensors(rel.parent / "mid")[key])
        stored = folder_tensors(rel)
        if differing(fresh, {k: stored[k] for k in fresh}):
            lossy.append(name)
        if name in CT:
            again = _fresh(name, key, llama[key])
            assert differing(again, {k: stored[k] for k in again}) == [], name
    assert lossy == ["int4-group", "int4-channel", "int8-channel", "fp8", "mxfp4"]


@pytest.mark.parametrize("edit", ["plus-quarter", "one-ulp"])
@pytest.mark.parametrize("name", [*CT, "fp8", "mxfp4"])
def test_an_edited_weight_alone_is_quantized_afresh(releases, tmp_path, name, edit):
    """One value of one weight changed in the bf16 model (by 0.25, or by one bfloat16 ulp, which a
    comparison after any lossy cast misses): that weight's stored tensors are the scheme's fresh
    quantization of it (an MXFP4 stack: of the expert changed, the others the release's), every
    other stored tensor the release's."""
    rel = releases[name]
    key = EDITED.get(name, EDITED_DENSE)
    mid = tmp_path / "mid"
    shutil.copytree(rel.parent / "mid", mid)
    t = folder_tensors(mid)
    w = t[key].clone()
    at = (1, 0, 0) if w.dim() == 3 else (0, 0)
    if edit == "plus-quarter":
        w[at] += 0.25
    else:
        w.view(torch.int16)[at] += 1
    t[key] = w
    for f in mid.glob("*.safetensors"):
        f.unlink()
    save_file(t, mid / "model.safetensors", metadata={"format": "pt"})
    if (mid / "model.safetensors.index.json").exists():
        (mid / "model.safetensors.index.json").unlink()
    out = tmp_path / "out"
    assert _run(str(mid), str(out), "--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)) == 0
    got, stored = folder_tensors(out), folder_tensors(rel)
    fresh = _fresh(name, key, w)
    if name == "mxfp4":  # the changed expert's slab afresh, the others copied
        for k in fresh:
            fresh[k] = torch.cat([stored[k][:1], fresh[k][1:2], stored[k][2:]])
    assert differing(got, stored) == sorted(k for k in fresh if not torch.equal(fresh[k], stored[k]))
    assert differing({k: got[k] for k in fresh}, fresh) == []


@pytest.mark.parametrize("name", ["fp8", "int4-group"])
def test_through_megatron_core_at_tp2_the_release_comes_back(releases, tmp_path, name):
    rel = releases[name]
    assert _run(str(rel), str(tmp_path / "mcore"), "--target-tp", "2") == 0
    assert len(list((tmp_path / "mcore").rglob("*.pt"))) >= 2
    assert _run(str(tmp_path / "mcore"), str(tmp_path / "out"), "--to", "hf", "--quantize", "like-source",
                "--quantize-like", str(rel)) == 0
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(rel)) == []
    assert _config(tmp_path / "out")["quantization_config"] == _config(rel)["quantization_config"]


@pytest.mark.parametrize("ignore", ["as-saved", "pattern"])
def test_a_layer_the_release_lacks_follows_its_rule_and_its_ignore_list(releases, tmp_path, ignore):
    """A third layer (layer 1's weights, one changed): its linear weights are quantized afresh as
    compressed-tensors compresses them, except what the release's ``ignore`` names; layers 0 and 1
    are the release's. compressed-tensors saves ``ignore`` as the module names it matched
    (``model.layers.0.mlp.down_proj``, ...), which leave layer 2's ``down_proj`` targeted; the
    same release with ``ignore`` as the pattern ``re:.*down_proj`` leaves it as it is."""
    name = "int4-group"
    rel = releases[name]
    if ignore == "pattern":
        shutil.copytree(rel, tmp_path / "rel")
        rel = tmp_path / "rel"
        config = _config(rel)
        config["quantization_config"]["ignore"] = list(IGNORE)
        (rel / "config.json").write_text(json.dumps(config))
    mid = tmp_path / "mid"
    mid.mkdir()
    t = folder_tensors(releases[name].parent / "mid")
    t |= {k.replace("layers.1.", "layers.2."): v.clone() for k, v in t.items() if "layers.1." in k}
    t["model.layers.2.self_attn.q_proj.weight"][0, 0] += 0.25
    save_file(t, mid / "model.safetensors", metadata={"format": "pt"})
    for f in (releases[name].parent / "mid").iterdir():
        if not f.name.startswith("model.safetensors"):
            shutil.copy(f, mid / f.name)
    (mid / "config.json").write_text(json.dumps({**_config(releases[name].parent / "mid"), "num_hidden_layers": 3}))
    out = tmp_path / "out"
    assert _run(str(mid), str(out), "--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)) == 0
    got, stored = folder_tensors(out), folder_tensors(rel)
    assert differing({k: v for k, v in got.items() if "layers.2." not in k}, stored) == []
    want = {}
    for k, v in t.items():
        if "layers.2." not in k:
            continue
        if k.endswith("_proj.weight") and not (ignore == "pattern" and "down_proj" in k):
            want |= _fresh(name, k, v)
        else:
            want[k] = v
    assert differing({k: v for k, v in got.items() if "layers.2." in k}, want) == []
    assert _config(out)["quantization_config"] == _config(rel)["quantization_config"]


def test_transformers_loads_the_outputs_as_it_loads_the_release(releases):
    """transformers loads each output at default strictness (compressed-tensors' compressed
    modules, nothing missing or unexpected) with the release's logits, and compressed-tensors'
    decompression of it (``dequantize=True``) is that of its release."""
    import transformers

    ids = torch.tensor([[1, 5, 9, 77, 3]])
    for name in ("int4-group", "fp8-channel"):
        rel = releases[name]
        logits = []
        for folder in (rel, rel.parent / "out"):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
            assert not any(info.values()), info
            with torch.no_grad():
                logits.append(model(ids).logits)
        assert torch.equal(logits[0], logits[1]), name
        assert differing(ct_dequantized(rel.parent / "out"), ct_dequantized(rel)) == []


def _refused(capsys, argv: list[str], needle: str, out: Path) -> None:
    capsys.readouterr()
    assert _run(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_bad_requests_are_refused_in_one_line_with_nothing_written(releases, tmp_path, capsys):
    mid, rel = releases["int4-group"].parent / "mid", releases["int4-group"]
    out = tmp_path / "o"
    like = ["--to", "hf", "--quantize", "like-source", "--quantize-like"]
    _refused(capsys, [str(mid), str(out), "--to", "hf", "--quantize", "like-source"],
             "--quantize: --quantize like-source and --quantize-like DIR go together", out)
    _refused(capsys, [str(mid), str(out), "--to", "hf", "--quantize-like", str(rel)],
             "--quantize-like: --quantize like-source and --quantize-like DIR go together", out)
    _refused(capsys, [str(mid), str(out), *like, str(tmp_path / "nowhere")], "has no config.json", out)
    _refused(capsys, [str(mid), str(out), *like, "s3://bucket/release"], "is a URL: the release folder is read "
             "from a local disk", out)
    _refused(capsys, [str(mid), str(out), *like, str(mid)], "declares no quantization", out)
    _refused(capsys, [str(mid), str(out), "--to", "torch_dist", "--quantize", "like-source", "--quantize-like",
                      str(rel)], "has no place for a release's quantized weights", out)
    _refused(capsys, [str(mid), str(out), *like, str(releases["mxfp4"])],
             "is a StackedMoeForCausalLM, not the LlamaForCausalLM written", out)
    llama = releases["int4-group"].parent.parent / "llama"
    for scheme, needle in (("w4a16_asym", "asymmetric pack-quantized int4 (config group group_0)"),
                           ("fp8_tensor", "config group group_0 quantizes input_activations with calibrated "
                                          "(static) scales")):
        other = tmp_path / scheme
        make_ct_folder(llama, other, scheme)
        _refused(capsys, [str(mid), str(out), *like, str(other)],
                 f"--quantize-like: {other} is quantized with {needle}, which --quantize like-source cannot write", out)
    g_idx = tmp_path / "g_idx"
    shutil.copytree(rel, g_idx)
    g = torch.arange(64, dtype=torch.int32) // 32
    t = folder_tensors(g_idx) | {"model.layers.0.self_attn.q_proj.weight_g_idx": g}
    save_file(t, g_idx / "model.safetensors", metadata={"format": "pt"})
    _refused(capsys, [str(mid), str(out), *like, str(g_idx)],
             "model.layers.0.self_attn.q_proj.weight_g_idx (a g_idx: activation-order groups", out)


def test_a_weight_is_compared_a_band_at_a_time_and_the_first_difference_ends_it(releases, monkeypatch):
    """The release's dequantized weight is read a band of rows at a time (here a row), never whole,
    and a difference in the first row ends the comparison there."""
    monkeypatch.setattr(like_source, "BAND_ELEMENTS", 1)
    rel = releases["int4-group"]
    like = like_source.open_like(rel)
    bands = []
    rows = like.scheme.rows
    monkeypatch.setattr(like.scheme, "rows", lambda deq, slab: (lambda first, n: bands.append(n) or
                                                                rows(deq, slab)(first, n)))
    key = "model.layers.0.mlp.gate_proj.weight"
    w = folder_tensors(rel.parent / "mid")[key]
    assert like.unchanged(key, w) and bands == [1] * w.shape[0]
    bands.clear()
    edited = w.clone()
    edited.view(torch.int16)[0, 5] += 1
    assert not like.unchanged(key, edited) and bands == [1]


# --- compressed-tensors NVFP4: the global scale q/k/v, and gate/up, share decides per export ---

#: The weights under one global scale (llm-compressor's fused groups) of a Llama layer.
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def _modules(layer: int, names: tuple[str, ...]) -> list[str]:
    part = "self_attn" if names == QKV else "mlp"
    return [f"model.layers.{layer}.{part}.{n}" for n in names]


def _stored_of(modules: list[str], t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in t.items() if k.rpartition(".")[0] in modules}


def _like(mid: Path, out: Path, rel: Path) -> None:
    assert _run(str(mid), str(out), "--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)) == 0


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> dict[str, Path]:
    """Two NVFP4A16 releases written by compressed-tensors (``fused``: llm-compressor's shared global
    scales of q/k/v and gate/up; ``own``: each weight's own), each one's bf16 import (``NAME/mid``)
    and like-source export (``NAME/out``)."""
    root = tmp_path_factory.mktemp("nvfp4")
    _llama(root / "llama")
    rel = {}
    for name, fused in (("fused", True), ("own", False)):
        rel[name] = root / name / "rel"
        make_ct_folder(root / "llama", rel[name], "nvfp4a16", ignore=IGNORE, fused=fused)
        assert _run(str(rel[name]), str(rel[name].parent / "mid"), "--to", "hf") == 0
        _like(rel[name].parent / "mid", rel[name].parent / "out", rel[name])
    return rel


def test_an_unchanged_nvfp4_release_comes_back_bit_for_bit(nvfp4):
    """Every stored tensor and the quantization_config; the release's q/k/v and gate/up do share
    one global scale, and compressed-tensors compressing the original weights with fused scales
    gives the release (the oracle of the next tests is right)."""
    rel = nvfp4["fused"]
    stored = folder_tensors(rel)
    assert differing(folder_tensors(rel.parent / "out"), stored) == []
    assert _config(rel.parent / "out")["quantization_config"] == _config(rel)["quantization_config"]
    llama = folder_tensors(rel.parent.parent / "llama")
    for layer in range(2):
        for group in (QKV, GATE_UP):
            modules = _modules(layer, group)
            scales = {stored[m + ".weight_global_scale"].item() for m in modules}
            assert len(scales) == 1, modules
            want = ct_compress_fused("nvfp4a16", {m: llama[m + ".weight"] for m in modules})
            assert differing(want, _stored_of(modules, stored)) == []


@pytest.mark.parametrize("edit", ["new-maximum", "one-ulp"])
def test_an_edited_q_re_encodes_q_k_v_under_a_fresh_shared_scale(nvfp4, tmp_path, edit):
    """One value of layer 0's q changed (to twice the q/k/v maximum, which moves their global
    scale; or by one bfloat16 ulp): layer 0's q, k and v are compressed-tensors' compression of
    the three with fused scales, every other stored tensor (layer 0's gate/up, layer 1) the
    release's. Copying k and v because they alone are unchanged keeps the release's global scale
    beside q's fresh one: caught by the new-maximum edit."""
    rel = nvfp4["fused"]
    t = folder_tensors(rel.parent / "mid")
    qkv = _modules(0, QKV)
    w = t[qkv[0] + ".weight"].clone()
    if edit == "new-maximum":
        w[0, 0] = 2 * max(t[m + ".weight"].abs().max() for m in qkv)
    else:
        w.view(torch.int16)[0, 0] += 1
    t[qkv[0] + ".weight"] = w
    mid = tmp_path / "mid"
    shutil.copytree(rel.parent / "mid", mid)
    save_file(t, mid / "model.safetensors", metadata={"format": "pt"})
    _like(mid, tmp_path / "out", rel)
    got, stored = folder_tensors(tmp_path / "out"), folder_tensors(rel)
    fresh = ct_compress_fused("nvfp4a16", {m: t[m + ".weight"] for m in qkv})
    assert differing({k: got[k] for k in fresh}, fresh) == []
    assert differing({k: v for k, v in got.items() if k not in fresh}, {k: v for k, v in stored.items()
                                                                          if k not in fresh}) == []
    moved = {k for k in fresh if k.endswith(".weight_global_scale") and not torch.equal(fresh[k], stored[k])}
    assert len(moved) == (3 if edit == "new-maximum" else 0)


def test_a_release_whose_fused_weights_have_their_own_scales_is_re_encoded_with_one(nvfp4):
    """A release whose q/k/v and gate/up each carry their own global scale (no fused observers):
    unchanged, every fused group is quantized afresh under one scale, as compressed-tensors
    compresses them with fused scales; o_proj (fused with nothing) is the release's, copied."""
    rel = nvfp4["own"]
    got, stored = folder_tensors(rel.parent / "out"), folder_tensors(rel)
    mid = folder_tensors(rel.parent / "mid")
    fresh: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for group in (QKV, GATE_UP):
            modules = _modules(layer, group)
            assert len({stored[m + ".weight_global_scale"].item() for m in modules}) > 1, modules
            fresh |= ct_compress_fused("nvfp4a16", {m: mid[m + ".weight"] for m in modules})
    assert differing({k: got[k] for k in fresh}, fresh) == []
    assert differing({k: v for k, v in got.items() if k not in fresh}, {k: v for k, v in stored.items()
                                                                          if k not in fresh}) == []
    assert _config(rel.parent / "out")["quantization_config"] == _config(rel)["quantization_config"]


def test_transformers_loads_an_nvfp4_output_as_it_loads_the_release(nvfp4):
    """At default strictness, with compressed-tensors' decompression of the release's."""
    import transformers

    rel = nvfp4["fused"]
    _model, info = transformers.AutoModelForCausalLM.from_pretrained(rel.parent / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert differing(ct_dequantized(rel.parent / "out"), ct_dequantized(rel)) == []


def test_the_release_folder_is_part_of_the_conversions_identity(releases, tmp_path):
    """The same model re-quantized like a release whose files changed is another conversion, not an
    output already up to date (its codes and scales are copied from those files)."""
    import os
    import shutil

    from reshard import api

    rel = tmp_path / "rel"
    shutil.copytree(releases["int4-group"], rel)
    run = dict(to="hf", quantize="like-source", quantize_like=str(rel), overwrite=True)
    mid = str(releases["int4-group"].parent / "mid")
    assert not api.convert(mid, str(tmp_path / "out"), **run).up_to_date
    assert api.convert(mid, str(tmp_path / "out"), **run).up_to_date
    blob = next(rel.glob("*.safetensors"))
    os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 10**9))
    assert not api.convert(mid, str(tmp_path / "out"), **run).up_to_date


def test_an_nvfp4_release_through_megatron_core_at_tp2_comes_back(nvfp4, tmp_path):
    """Imported to megatron-core at TP 2 (q/k/v fused per query group and split over the ranks,
    gate/up into fc1's halves) and exported like the release: every stored tensor back bit for bit."""
    rel = nvfp4["fused"]
    assert _run(str(rel), str(tmp_path / "mcore"), "--target-tp", "2") == 0
    assert len(list((tmp_path / "mcore").rglob("*.pt"))) >= 2
    _like(tmp_path / "mcore", tmp_path / "out", rel)
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(rel)) == []
    assert _config(tmp_path / "out")["quantization_config"] == _config(rel)["quantization_config"]


#: W4A4 NVFP4 releases: (name, the stored tensor of each layer's calibrated activation scale).
W4A4 = {"modelopt": ".input_scale", "ct-w4a4": ".input_global_scale"}
RE_ENCODED = "quantized layer(s) changed from"


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory) -> dict[str, Path]:
    """W4A4 NVFP4 releases, each with each layer's calibrated activation scale: ModelOpt's (its
    own ``NVFP4QTensor`` quantizing, q/k/v and gate/up under one ``weight_scale_2``) and
    compressed-tensors' NVFP4 preset (llm-compressor's fused global scales); each one's bf16
    import (``NAME/mid``) and like-source export (``NAME/out``)."""
    root = tmp_path_factory.mktemp("w4a4")
    _llama(root / "llama")
    rel = {name: root / name / "rel" for name in W4A4}
    make_modelopt_folder(root / "llama", rel["modelopt"], exclude=("lm_head", "*down_proj"))
    make_ct_folder(root / "llama", rel["ct-w4a4"], "nvfp4", ignore=IGNORE)
    for folder in rel.values():
        assert _run(str(folder), str(folder.parent / "mid"), "--to", "hf") == 0
        _like(folder.parent / "mid", folder.parent / "out", folder)
    return rel


@pytest.mark.parametrize("name", W4A4)
def test_an_unchanged_w4a4_release_comes_back_bit_for_bit_with_its_activation_scales(w4a4, name):
    """Every stored tensor (the calibrated activation scales among them), config.json's
    quantization_config and ModelOpt's hf_quant_config.json, as the release has them."""
    rel = w4a4[name]
    got, stored = folder_tensors(rel.parent / "out"), folder_tensors(rel)
    assert sum(k.endswith(W4A4[name]) for k in stored) == 2 * 6
    assert differing(got, stored) == []
    assert _config(rel.parent / "out")["quantization_config"] == _config(rel)["quantization_config"]
    sidecar = rel / "hf_quant_config.json"
    assert (rel.parent / "out" / sidecar.name).exists() == sidecar.exists() == (name == "modelopt")
    if sidecar.exists():
        assert (rel.parent / "out" / sidecar.name).read_bytes() == sidecar.read_bytes()


def test_the_modelopt_release_is_modelopts_own_fused_quantization(w4a4):
    """The oracle of the next test is right: ModelOpt quantizing each layer's q/k/v and gate/up
    under one weight_scale_2 gives the release's tensors."""
    rel = w4a4["modelopt"]
    stored, llama = folder_tensors(rel), folder_tensors(rel.parent.parent / "llama")
    for layer in range(2):
        for group in (QKV, GATE_UP):
            modules = _modules(layer, group)
            assert len({stored[m + ".weight_scale_2"].item() for m in modules}) == 1, modules
            want = modelopt_fused({m: llama[m + ".weight"] for m in modules})
            assert differing(want, {k: v for k, v in _stored_of(modules, stored).items() if k in want}) == []


@pytest.mark.parametrize("name", W4A4)
def test_an_edited_q_re_encodes_q_k_v_and_keeps_the_releases_activation_scales(w4a4, tmp_path, capsys, name):
    """Layer 0's q given a new maximum: layer 0's q, k and v are the scheme's own quantization of
    the three under one fresh shared weight scale (ModelOpt's NVFP4QTensor; compressed-tensors'
    compressor with llm-compressor's fused scale), their activation scales the release's, every
    other stored tensor the release's; one warning line counts the three re-encoded layers."""
    rel = w4a4[name]
    t = folder_tensors(rel.parent / "mid")
    qkv = _modules(0, QKV)
    w = t[qkv[0] + ".weight"].clone()
    w[0, 0] = 2 * max(t[m + ".weight"].abs().max() for m in qkv)
    t[qkv[0] + ".weight"] = w
    mid = tmp_path / "mid"
    shutil.copytree(rel.parent / "mid", mid)
    save_file(t, mid / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    _like(mid, tmp_path / "out", rel)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if RE_ENCODED in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: 3 quantized layer(s) changed from"), lines
    got, stored = folder_tensors(tmp_path / "out"), folder_tensors(rel)
    weights = {m: t[m + ".weight"] for m in qkv}
    fresh = modelopt_fused(weights) if name == "modelopt" else ct_compress_fused("nvfp4", weights)
    assert differing({k: got[k] for k in fresh}, fresh) == []
    moved = {k for k in fresh if k.endswith(("_scale_2", "_global_scale")) and not torch.equal(fresh[k], stored[k])}
    assert len(moved) == 3
    assert differing({k: v for k, v in got.items() if k not in fresh},
                      {k: v for k, v in stored.items() if k not in fresh}) == []
    assert all(m + W4A4[name] in got for m in qkv)


@pytest.mark.parametrize("name", W4A4)
def test_a_layer_the_w4a4_release_lacks_is_refused(w4a4, tmp_path, capsys, name):
    """A quantized layer with no counterpart in the release has no calibrated activation scale to
    keep: refused in one line naming it, nothing written."""
    rel = tmp_path / "rel"
    shutil.copytree(w4a4[name], rel)
    gone = "model.layers.1.self_attn.o_proj"
    save_file({k: v for k, v in folder_tensors(rel).items() if not k.startswith(gone + ".")}, rel / "model.safetensors",
              metadata={"format": "pt"})
    mid, out = w4a4[name].parent / "mid", tmp_path / "out"
    _refused(capsys, [str(mid), str(out), "--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)],
             f"{gone}.weight is quantized with calibrated activation scales, but {rel} holds no {gone}{W4A4[name]} "
             "to keep", out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_modelopts_weight_rule_is_nvfp4qtensors_bit_for_bit(dtype):
    """:func:`reshard.core.nvfp4.quantize_modelopt` under one shared ``scale_2_modelopt`` against
    ModelOpt's own ``NVFP4QTensor`` (:func:`modelopt_fused`) on a fused group with an all-zero
    block (its scale 1.0 before the clamp), a block far below the group's maximum (clamped at
    2**-9), ties and negative zeros."""
    from reshard.core import nvfp4 as fp4

    g = torch.Generator().manual_seed(5)
    parts = {f"p{i}": (torch.randn(32, 64, generator=g) * s).to(dtype) for i, s in enumerate((1.0, 0.25, 4.0))}
    parts["p0"][0, :16] = 0
    parts["p0"][1, :16] = -0.0
    parts["p1"][2, :16] *= 1e-7
    parts["p2"][3, :16] = torch.tensor([0.75, 1.75, 3.5, 0.25, 2.5, 5.0, -0.75, -1.25] * 2, dtype=dtype)
    want = modelopt_fused({m + ".x": w for m, w in parts.items()})
    amax = torch.stack([fp4.absmax(w) for w in parts.values()]).max()
    scale_2 = fp4.scale_2_modelopt(amax)
    for m, w in parts.items():
        packed, scale = fp4.quantize_modelopt(w, scale_2)
        got = {m + ".x.weight": packed, m + ".x.weight_scale": scale, m + ".x.weight_scale_2": scale_2}
        assert differing(got, {k: v for k, v in want.items() if k.startswith(m + ".")}) == [], (m, dtype)


@pytest.mark.usefixtures("prefect_env")
def test_through_the_prefect_flow_the_warning_and_the_bytes_are_the_direct_runs(w4a4, tmp_path, capsys):
    """The flow plans from the headers first and reads the values in its cross-rank task: the
    re-encoding warning (which needs the values) reaches its summary too, and the files equal the
    in-process run's."""
    rel = w4a4["modelopt"]
    t = folder_tensors(rel.parent / "mid")
    q = _modules(0, QKV)[0] + ".weight"
    t[q] = t[q] * 2
    mid = tmp_path / "mid"
    shutil.copytree(rel.parent / "mid", mid)
    save_file(t, mid / "model.safetensors", metadata={"format": "pt"})
    like = ["--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)]
    assert main(["run", str(mid), str(tmp_path / "direct"), "--direct", *like]) == 0
    capsys.readouterr()
    assert main(["run", str(mid), str(tmp_path / "flow"), "--cache-dir", str(tmp_path / "cache"), *like]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if RE_ENCODED in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: 3 quantized layer(s) changed from"), lines
    assert differing(folder_tensors(tmp_path / "flow"), folder_tensors(tmp_path / "direct")) == []


@pytest.mark.parametrize(("kept", "words"), [
    ("lm_head", "modules_to_not_convert is 'lm_head'"),
    (["lm_head", "model.layers.*.mlp.("], "modules_to_not_convert holds 'model.layers.*.mlp.(', no regular expression"),
])
def test_a_malformed_modules_to_not_convert_is_refused(releases, tmp_path, capsys, kept, words):
    """transformers matches the FP8 release's ``modules_to_not_convert`` as regular expressions: a
    value that is no list of them is refused in one line, nothing written."""
    rel = tmp_path / "rel"
    shutil.copytree(releases["fp8"], rel)
    config = _config(rel)
    config["quantization_config"]["modules_to_not_convert"] = kept
    (rel / "config.json").write_text(json.dumps(config))
    mid, out = releases["fp8"].parent / "mid", tmp_path / "out"
    _refused(capsys, [str(mid), str(out), "--to", "hf", "--quantize", "like-source", "--quantize-like", str(rel)],
             words, out)
