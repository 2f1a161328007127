"""Quantized releases as users download them (:mod:`reshard.core.compressed_tensors`,
:mod:`reshard.core.modelopt`, read by the ``hf`` format through :mod:`reshard.core.release_codecs`):
compressed-tensors' pack-quantized INT, float-quantized FP8 and nvfp4-pack-quantized, and ModelOpt's
NVFP4.

Each folder is written by the reference library itself (``tests/quantized_releases.py``) from a
tiny transformers Llama; ``reshard run SRC DST --to hf`` must give every tensor bit for bit as the
library's own decompression gives it (compressed-tensors' decompressors through transformers'
``dequantize=True`` load; ModelOpt's ``NVFP4QTensor.dequantize``), and transformers must load the
output at default strictness. The imports into megatron-core at TP 2 with transformers' logits of
the dequantized model run in the import harness launches of ``tests/test_hf_import.py`` (Llama)
and ``tests/test_deepseek.py`` (DeepSeek-V3 with Kimi-K2.5's INT4 experts). Bad folders are refused
in one line naming the tensor, nothing written; a weight is decoded a band of rows at a time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantized_releases import (
    SCHEMES,
    ct_dequantized,
    differing,
    folder_tensors,
    make_ct_folder,
    make_modelopt_folder,
)
from reshard.cli import main
from reshard.core.lazy import RowsDecoded
from reshard.formats.hf import HFFormat

_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny random bf16 Llama saved by transformers (projections of 64 and 96 inputs: whole groups
    of 32 and of 16, and FP8 blocks of [32, 48] partial in both dimensions)."""
    import transformers

    folder = tmp_path_factory.mktemp("quantized") / "llama"
    torch.manual_seed(58)
    config = transformers.LlamaConfig(**_LLAMA, initializer_range=0.1)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def releases(llama) -> dict[str, Path]:
    """One compressed-tensors folder per scheme, and one ModelOpt NVFP4 folder (with its
    dequantization by ModelOpt)."""
    root = llama.parent
    out = {}
    for scheme in SCHEMES:
        out[scheme] = root / scheme
        make_ct_folder(llama, out[scheme], scheme)
    out["modelopt"] = root / "modelopt"
    out["modelopt_want"] = make_modelopt_folder(llama, out["modelopt"])
    return out


def _run(*argv: str) -> int:
    return main(["run", "--direct", *argv])




@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_compressed_tensors_release_goes_to_bf16_as_compressed_tensors_decompresses_it(releases, tmp_path, scheme):
    """Every weight bit for bit compressed-tensors' decompression (transformers' ``dequantize=True``
    load: the decompressor of the folder's format), the rest as stored; no quantization tensor or
    ``quantization_config`` left, and transformers loads the output at default strictness."""
    src, out = releases[scheme], tmp_path / "bf16"
    assert _run(str(src), str(out), "--to", "hf") == 0
    want = ct_dequantized(src)
    assert differing(folder_tensors(out), want) == []
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert differing({k: v.detach() for k, v in model.state_dict().items()}, want) == []


@pytest.mark.parametrize("declared", ["config", "sidecar"])
def test_a_modelopt_nvfp4_release_goes_to_bf16_as_modelopt_dequantizes_it(releases, tmp_path, declared):
    """ModelOpt's NVFP4 (its own ``NVFP4QTensor`` quantization and dequantization), declared in
    ``config.json`` as its exporter writes it, or only by ``hf_quant_config.json`` (older exports);
    ``exclude_modules`` (lm_head) stays as stored."""
    src = releases["modelopt"]
    if declared == "sidecar":
        src = tmp_path / "src"
        shutil.copytree(releases["modelopt"], src)
        config = json.loads((src / "config.json").read_text())
        del config["quantization_config"]
        (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "bf16"
    assert _run(str(src), str(out), "--to", "hf") == 0
    assert differing(folder_tensors(out), releases["modelopt_want"]) == []
    assert not (out / "hf_quant_config.json").exists()


def test_inspect_counts_the_encoded_weights(releases, capsys):
    capsys.readouterr()
    assert main(["inspect", str(releases["w4a16"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    quantization = json.dumps(report)
    assert "compressed-tensors" in quantization and "pack-quantized" in quantization


def test_a_weight_is_decoded_a_band_of_rows_at_a_time(releases, monkeypatch):
    """Each quantized weight reaches the planner as a lazy tensor; a box of rows decodes only the
    bands it covers (memory: the box and one band, never the whole weight)."""
    decoded: list[tuple[int, int]] = []
    state = HFFormat().load(releases["w4a16"] / "config.json")
    lazy = [v for v in _flatten(state) if isinstance(v, RowsDecoded)]
    assert lazy, "no weight is decoded lazily"
    w = lazy[0]
    original = w.decode
    monkeypatch.setattr(w, "decode", lambda first, n: decoded.append((first, n)) or original(first, n))
    monkeypatch.setattr(w, "band", 8)
    box = w.read_box((16, 0), (12, w.shape[1]))
    assert decoded == [(16, 8), (24, 4)] and tuple(box.shape) == (12, w.shape[1])


def _flatten(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(obj=v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)
    else:
        yield obj
        for v in getattr(obj, "segments", ()):  # a fused QKV / fc1 of lazy tensors
            yield v[0]


# --- refusals: one line naming the tensor, nothing written ------------------------------------------

_MOD = "model.layers.0.self_attn.k_proj"  # [16, 64]


def _variant(src: Path, dst: Path, put: dict | None = None, drop: str | None = None,
             config: dict | None = None) -> Path:
    """A copy of the one-file folder ``src`` with tensors replaced or added (``put``), one dropped,
    or ``quantization_config`` entries changed."""
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(dst / "model.safetensors").items() if k != drop}
    save_file({**tensors, **(put or {})}, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {**cfg["quantization_config"], **config}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _refused(capsys, src: Path, out: Path, needle: str) -> None:
    capsys.readouterr()
    assert _run(str(src), str(out), "--to", "hf") == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("scheme, edit, needle", [
    ("w4a16", {"put": {f"{_MOD}.weight_scale": torch.ones(16, 3, dtype=torch.bfloat16)}},
     f"{_MOD}.weight_scale is bfloat16 [16, 3], not a float [16, 2] (group scales of [16, 64])"),
    ("w4a16", {"put": {f"{_MOD}.weight_packed": torch.zeros(16, 16, dtype=torch.int32)}},
     f"{_MOD}.weight_packed is [16, 16], not [16, 8] (4-bit codes of weight_shape [16, 64], 8 a word)"),
    ("w4a16", {"drop": f"{_MOD}.weight_scale"}, f"{_MOD}.weight_scale is missing"),
    ("w4a16", {"put": {f"{_MOD}.weight_g_idx": torch.arange(64, dtype=torch.int32) % 2}},
     f"{_MOD}.weight_g_idx places columns in groups out of order"),
    ("w4a16_asym", {"drop": f"{_MOD}.weight_zero_point"}, f"{_MOD}.weight_zero_point is missing"),
    ("w4a16", {"config": {"format": "marlin-24", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}},
     "config_groups.group_0 has format 'marlin-24', which reshard does not read"),
    ("fp8_channel", {"put": {f"{_MOD}.weight_scale": torch.ones(1, 16, dtype=torch.bfloat16)}},
     f"{_MOD}.weight_scale is [1, 16], not [16, 1] (channel scales of [16, 64])"),
    ("nvfp4", {"put": {f"{_MOD}.weight_packed": torch.zeros(16, 16, dtype=torch.uint8)}},
     f"{_MOD}.weight_scale is float8_e4m3fn [16, 4], not float8_e4m3fn [16, 2]"),
    ("nvfp4", {"drop": f"{_MOD}.weight_global_scale"}, f"{_MOD}.weight_global_scale is missing"),
    ("nvfp4", {"put": {f"{_MOD}.weight": torch.ones(16, 64, dtype=torch.bfloat16)}},
     f"{_MOD} is stored both as {_MOD}.weight and as {_MOD}.weight_packed"),
    ("w4a16", {"put": {"model.norm.weight_scale": torch.ones(1, dtype=torch.bfloat16)}},
     "model.norm.weight_scale belongs to no quantized weight"),
    ("w4a16", {"config": {"ignore": ["lm_head", _MOD]}},
     f"{_MOD} is stored quantized but quantization_config.ignore lists it"),
    ("modelopt", {"put": {f"{_MOD}.weight_scale": torch.ones(16, 2, dtype=torch.float8_e4m3fn)}},
     f"{_MOD}.weight_scale is float8_e4m3fn [16, 2], not float8_e4m3fn [16, 4]"),
    ("modelopt", {"config": {"quant_algo": "W4A8_AWQ"}},
     "holds ModelOpt quant_algo 'W4A8_AWQ', which reshard does not read"),
])
def test_a_bad_quantized_folder_is_refused_in_one_line_naming_the_tensor(releases, tmp_path, capsys, scheme, edit,
                                                                         needle):
    _refused(capsys, _variant(releases[scheme], tmp_path / "bad", **edit), tmp_path / "o", needle)


@pytest.mark.parametrize("release, needle", [
    ("w4a16", ".weight_packed holds packed codes but config.json declares no quantization_config"),
    ("nvfp4", ".weight_packed holds packed codes but config.json declares no quantization_config"),
    ("modelopt", ".weight holds NVFP4 codes but the folder declares no quantization"),
])
def test_codes_in_a_folder_that_declares_no_quantization_are_refused(releases, tmp_path, capsys, release, needle):
    """Without its declaration a release's codes would be read as they are: another model."""
    src = shutil.copytree(releases[release], tmp_path / "bare")
    (src / "hf_quant_config.json").unlink(missing_ok=True)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    _refused(capsys, src, tmp_path / "o", needle)


def test_an_unread_quantization_method_is_refused_naming_it(releases, tmp_path, capsys):
    src = _variant(releases["w4a16"], tmp_path / "bad", config={"quant_method": "gptq"})
    _refused(capsys, src, tmp_path / "o", "holds quant_method 'gptq', which reshard does not read")


# --- out: --quantize w4a16 / fp8-channel / nvfp4, as compressed-tensors compresses --------------

#: ``--quantize`` (and its flags) -> the scheme of :data:`quantized_releases.SCHEMES` it writes.
_OUT = {("w4a16",): "w4a16", ("w4a16", "--group-size", "16"): "w4a16_g16", ("fp8-channel",): "fp8_channel",
        ("nvfp4",): "nvfp4a16"}


@pytest.fixture(scope="module")
def compressed(llama) -> dict[str, Path]:
    """compressed-tensors' own compression of the tiny Llama, one folder per scheme written out."""
    out = {}
    for scheme in _OUT.values():
        out[scheme] = llama.parent / f"out_{scheme}"
        make_ct_folder(llama, out[scheme], scheme)
    return out


@pytest.mark.parametrize("quantize", list(_OUT), ids=" ".join)
def test_quantize_writes_what_compressed_tensors_compresses(llama, compressed, tmp_path, quantize):
    """Every tensor bit for bit compressed-tensors' (its min-max ``calculate_qparams`` and its
    compressor, in bf16 as it computes), the config as it writes it (less its version);
    transformers loads the output at default strictness, and its dequantized load (and reshard's
    own reading of it) is compressed-tensors' decompression of its own folder."""
    want = compressed[_OUT[quantize]]
    out = tmp_path / "out"
    assert _run(str(llama), str(out), "--to", "hf", "--quantize", *quantize) == 0
    assert differing(folder_tensors(out), folder_tensors(want)) == []
    config = json.loads((want / "config.json").read_text())["quantization_config"]
    config.pop("version")
    assert json.loads((out / "config.json").read_text())["quantization_config"] == config
    import transformers

    _model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    want_model = ct_dequantized(want)
    assert differing(ct_dequantized(out), want_model) == []
    assert _run(str(out), str(tmp_path / "back"), "--to", "hf") == 0  # and reshard reads its own output back
    assert differing(folder_tensors(tmp_path / "back"), want_model) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_encoders_are_compressed_tensors_compressors(dtype):
    """The codecs' encode side against compressed-tensors' ``calculate_qparams`` and compressor
    on the edges a random model seldom holds: an all-zero row and group (the ``eps`` scale), an
    all-positive row, values on halves of a step, in each dtype it computes in."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from quantized_releases import SCHEMES
    from reshard.core import fp8_scaled, int_packed

    torch.manual_seed(5)
    w = (torch.randn(40, 128) * 0.05).to(dtype)
    w[3], w[5, :32], w[7] = 0, 0, w[7].abs()
    w[9] = (torch.arange(128) - 64).to(dtype) / 15
    for scheme, fmt in (("w4a16", "pack-quantized"), ("fp8_channel", "float-quantized")):
        args = QuantizationArgs(**SCHEMES[scheme])
        if args.strategy == "group":
            grouped = w.unflatten(-1, (w.shape[1] // args.group_size, args.group_size))
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        want = BaseCompressor.get_value_from_registry(fmt).compress(
            {"weight": w, "weight_scale": scale.to(dtype), "weight_zero_point": zero},
            QuantizationScheme(targets=["Linear"], weights=args))
        if scheme == "w4a16":
            codes, s = int_packed.quantize_symmetric(w, 4, 32)
            got = {"weight_packed": int_packed.pack_rows(codes, 4), "weight_scale": s}
            assert torch.equal(int_packed.unpack_rows(got["weight_packed"], 4, w.shape[1]), codes)
        else:
            q, s = fp8_scaled.quantize_channel(w)
            got = {"weight": q, "weight_scale": s}
        for name, t in got.items():
            assert t.dtype == want[name].dtype and torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name


@pytest.mark.parametrize("flags, needle", [
    (("--quantize", "w4a16", "--group-size", "64"),
     "--quantize w4a16: model.layers.0.mlp.down_proj.weight has 96 inputs, not a multiple of the group size 64"),
    (("--quantize", "w4a16", "--bits", "4"), "--bits: sets int8 quantization, not w4a16's"),
    (("--quantize", "fp8-channel", "--group-size", "16"), "--group-size: applies only with --quantize w4a16"),
    (("--quantize", "fp8-channel", "--to", "torch_dist"), "has no place for compressed-tensors' quantized weights"),
    (("--quantize", "w4a16", "--to", "megatron", "--target-tp", "2"),
     "has no place for compressed-tensors' quantized weights"),
    (("--quantize", "nvfp4", "--group-size", "16"), "--group-size: applies only with --quantize w4a16"),
    (("--quantize", "nvfp4", "--groups", "8"), "--groups: sets int8 quantization, not nvfp4's"),
    (("--quantize", "nvfp4", "--to", "torch_dist"), "has no place for compressed-tensors' quantized weights"),
])
def test_what_a_compressed_tensors_output_cannot_hold_is_refused_in_one_line(llama, tmp_path, capsys, flags, needle):
    capsys.readouterr()
    to = () if "--to" in flags else ("--to", "hf")
    assert _run(str(llama), str(tmp_path / "o"), *to, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_width_that_fills_no_whole_word_is_refused():
    """A group of 4 divides 100 inputs, but 100 int4 codes are 12.5 int32 words."""
    from reshard.core.compressed_tensors_out import Encoding

    assert "do not fill whole int32 words" in Encoding("w4a16", 4).refusal((16, 100), torch.bfloat16)[0]
    assert Encoding("w4a16", 4).refusal((16, 96), torch.bfloat16) is None
    assert "quantizes float16, bfloat16 or float32" in Encoding("fp8-channel").refusal((16, 96), torch.int8)[0]


@pytest.mark.parametrize("quantize, scheme", [("w4a16", "w4a16"), ("nvfp4", "nvfp4a16")])
def test_a_weight_is_encoded_a_band_of_rows_at_a_time(llama, compressed, tmp_path, monkeypatch, quantize, scheme):
    """Bands of one row (each weight in many bands) give the bytes of the whole weight's compression
    (nvfp4: the fused global scale found over the bands of q, k and v, or of gate and up, first)."""
    from reshard.formats import hf

    monkeypatch.setattr(hf, "FP8_CHUNK_BYTES", 1)
    bands = []
    original = hf.Encoding.encode_rows
    monkeypatch.setattr(hf.Encoding, "encode_rows",
                        lambda self, w, *rest: bands.append(w.shape[0]) or original(self, w, *rest))
    assert _run(str(llama), str(tmp_path / "out"), "--to", "hf", "--quantize", quantize) == 0
    assert set(bands) == {1}
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(compressed[scheme])) == []


#: A Llama written by Megatron-Bridge 0.6.2 (megatron-core 0.19) on a CPU: its torch_dist run folder
#: and Bridge's own Hugging Face export of it.
BRIDGE_LLAMA = Path(__file__).parent / "fixtures/realtools/megatron-bridge-0.6.2/llama"


@pytest.mark.parametrize("scheme", ["w4a16", "nvfp4a16", "fp8_channel"])
def test_a_megatron_bridge_checkpoint_is_written_as_compressed_tensors_compresses_its_export(tmp_path, scheme):
    """From the torch_dist run folder Megatron-Bridge wrote (its fused QKV and fc1 streamed by row
    bands): every tensor bit for bit compressed-tensors' compression of Bridge's own Hugging Face
    export of the same model."""
    quantize = next(q for q, name in _OUT.items() if name == scheme)
    make_ct_folder(BRIDGE_LLAMA / "hf", tmp_path / "want", scheme)
    assert _run(str(BRIDGE_LLAMA / "checkpoint"), str(tmp_path / "out"), "--to", "hf", "--quantize", *quantize) == 0
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "want")) == []


@pytest.mark.parametrize("source", ["hf", "tp2", "bridge"])
@pytest.mark.parametrize("quantize", [["w4a16"], ["nvfp4"], ["fp8-channel"], ["fp8", "--fp8-block", "32x48"]],
                         ids=["w4a16", "nvfp4", "fp8-channel", "fp8-block"])
def test_no_weight_is_whole_in_memory_while_it_is_encoded(llama, tmp_path, monkeypatch, quantize, source):
    """Each fused megatron-core weight (QKV, fc1) streams into bands of its outputs' rows
    (``reshard.core.row_bands``), whether its rows lie mapped in a file (``hf``), are gathered from
    two TP ranks (``tp2``) or are read from the torch_dist shards Megatron-Bridge wrote (``bridge``):
    it is never borrowed or materialized whole, and no band handed to an encoder is over about
    ``FP8_CHUNK_BYTES`` of the weight. The
    output is the same as with the default band size (many bands per weight here), each band's
    rows shared by two threads."""
    import threading

    from reshard.core.torch_writer import PendingTensor
    from reshard.formats import hf

    src = BRIDGE_LLAMA / "checkpoint" if source == "bridge" else llama
    if source == "tp2":
        src = tmp_path / "tp2"
        assert _run(str(llama), str(src), "--target-tp", "2") == 0
    assert _run(str(src), str(tmp_path / "want"), "--to", "hf", "--quantize", *quantize) == 0
    whole, largest = [], [0]
    borrowed, materialize = PendingTensor.borrowed, PendingTensor.materialize
    monkeypatch.setattr(PendingTensor, "borrowed", lambda self: whole.append(self.name) or borrowed(self))
    monkeypatch.setattr(PendingTensor, "materialize", lambda self: whole.append(self.name) or materialize(self))
    monkeypatch.setattr(hf, "FP8_CHUNK_BYTES", 1024)
    monkeypatch.setattr(hf, "band_workers", lambda *a: 2)  # as on a 2-core machine
    threads: set[str] = set()
    encoders = [(hf.Encoding, "encode_rows"), (hf, "quantize_chunks")]
    for owner, name in encoders:
        original = getattr(owner, name)

        def counted(*args, original=original, **kwargs):
            w = args[1] if original.__name__ == "encode_rows" else args[0]
            largest[0] = max(largest[0], w.numel() * w.element_size())
            threads.add(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    assert _run(str(src), str(tmp_path / "out"), "--to", "hf", "--quantize", *quantize) == 0
    assert whole == []
    config = json.loads(((BRIDGE_LLAMA / "hf") if source == "bridge" else llama).joinpath("config.json").read_text())
    widest = max(config["hidden_size"], config["intermediate_size"])
    assert 0 < largest[0] <= max(1024, 32 * widest * 2)  # 1 KiB of rows; whole block rows of 32 for FP8 blocks
    if quantize[0] != "fp8":  # compressed-tensors' bands are shared with the second thread (band_threads)
        assert any(t.startswith("reshard-band") for t in threads), threads
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "want")) == []


def test_a_moe_model_quantizes_its_experts_and_keeps_its_routers(tmp_path):
    """A Qwen2-MoE model: each routed and shared expert's projections bit for bit compressed-tensors'
    compression of each module (its model-free, per-module path: transformers fuses the experts,
    so no ``Linear`` of theirs is there to quantize), the routers and the head kept and in
    ``ignore``; transformers loads the folder at default strictness."""
    import transformers

    from quantized_releases import compress_folder_ct

    config = transformers.Qwen2MoeConfig(**{**_LLAMA, "intermediate_size": 96}, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    assert _run(str(tmp_path / "src"), str(tmp_path / "bf16"), "--to", "hf") == 0
    assert _run(str(tmp_path / "src"), str(tmp_path / "out"), "--to", "hf", "--quantize", "w4a16") == 0
    compress_folder_ct(tmp_path / "bf16", tmp_path / "want", "w4a16", r".*_proj", ["lm_head"], dtype=torch.bfloat16)
    got = folder_tensors(tmp_path / "out")
    assert any(".experts.3.down_proj.weight_packed" in k for k in got)
    assert differing(got, folder_tensors(tmp_path / "want")) == []
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head"] + [f"model.layers.{i}.mlp.{g}" for i in (0, 1) for g in ("gate", "shared_expert_gate")]
    _model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("quantize", ["w4a16", "fp8-channel", "nvfp4"])
def test_a_weight_that_is_not_finite_is_refused_naming_it(llama, tmp_path, capsys, quantize):
    """An inf would make a scale inf and every code of its group NaN or 0: another model."""
    src = shutil.copytree(llama, tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][5, 7] = float("inf")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert _run(str(src), str(tmp_path / "o"), "--to", "hf", "--quantize", quantize) == 2
    err = capsys.readouterr().err.strip()
    assert f"--quantize {quantize}: model.layers.1.mlp.up_proj." in err and "not finite" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


# --- out: --quantize nvfp4's global scales, fused as llm-compressor fuses them ----------------------

def _own_scales(folder: Path) -> dict[str, torch.Tensor]:
    return {k.removesuffix(".weight_global_scale"): v for k, v in folder_tensors(folder).items()
            if k.endswith(".weight_global_scale")}


def test_nvfp4_q_k_v_and_gate_up_share_one_global_scale(llama, compressed, tmp_path):
    """One global scale per fused group, the one llm-compressor's fused observers give (from the
    largest absolute value over the group), where each projection's own would differ; the model
    transformers builds from the folder (compressed-tensors' NVFP4 on a CPU) gives the logits of
    the model compressed-tensors' own folder gives."""
    import transformers
    from compressed_tensors.quantization.utils import generate_gparam

    out = tmp_path / "out"
    assert _run(str(llama), str(out), "--to", "hf", "--quantize", "nvfp4") == 0
    scales, src = _own_scales(out), folder_tensors(llama)
    for layer in (0, 1):
        for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            names = [f"model.layers.{layer}.{group[0]}.{p}" for p in group[1]]
            own = [generate_gparam(src[n + ".weight"].amin(), src[n + ".weight"].amax()) for n in names]
            assert all(torch.equal(scales[n], min(own)) for n in names), names
            assert len({float(o) for o in own}) > 1, names  # not shared by chance
    tokens = torch.tensor([[1, 5, 9, 33, 2, 77]])
    logits = [transformers.AutoModelForCausalLM.from_pretrained(f)(tokens).logits
              for f in (out, compressed["nvfp4a16"])]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_nvfp4_encoder_is_compressed_tensors_compressor(dtype):
    """:func:`reshard.core.nvfp4.quantize_ct` / :func:`~reshard.core.nvfp4.global_scale_ct` against
    compressed-tensors' ``generate_gparam``, ``calculate_qparams`` and ``NVFP4PackedCompressor``,
    in each dtype it computes scales in, on what a random model seldom holds: every e2m1 tie
    (``0.25``, ``0.75``, ... ``5``) and its neighbours, small negatives (code 8, -0.0), a -0.0
    weight (code 0), an all-zero group and row (the 0.125 scale), values far below and above
    the global scale's range, an all-zero tensor (global scale 1); any band of rows encodes as
    the whole."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from quantized_releases import ct_scheme
    from reshard.core import nvfp4

    scheme = ct_scheme("nvfp4a16")
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    torch.manual_seed(5)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.2, 0.3, 1.3, 2.6, 4.9, 5.1, -0.1, -0.25])
    for magnitude in (0.05, 1e-3, 300.0, 1e-30, 0.0):
        w = (torch.randn(40, 128) * magnitude).to(dtype)
        w[3], w[5, :32], w[7] = 0, 0, w[7].abs()
        w[9] = (torch.arange(128) - 64).to(dtype) / 15
        w[11, :16] = -0.0
        w[12, :16] = ties.to(dtype)  # group maximum 6: each value its own scaled value
        w[13, 16:32] = -ties.to(dtype)
        grouped = w.unflatten(-1, (8, 16))
        g = generate_gparam(w.amin(), w.amax())
        scale, _zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights, global_scale=g)
        want = compressor.compress({"weight": w, "weight_scale": scale.to(dtype), "weight_global_scale": g}, scheme)
        got_g = nvfp4.global_scale_ct(nvfp4.absmax(w))
        packed, s = nvfp4.quantize_ct(w, got_g)
        assert torch.equal(got_g, want["weight_global_scale"]) and got_g.dtype == torch.float32, magnitude
        assert torch.equal(packed, want["weight_packed"]), magnitude
        assert s.dtype == torch.float8_e4m3fn
        assert torch.equal(s.view(torch.uint8), want["weight_scale"].view(torch.uint8)), magnitude
        bands = [nvfp4.quantize_ct(w[r:r + 7], got_g) for r in range(0, 40, 7)]
        assert torch.equal(torch.cat([b[0] for b in bands]), packed)
        assert torch.equal(nvfp4.unpack_rows(packed), nvfp4.unpack_rows(nvfp4.pack_rows(nvfp4.unpack_rows(packed))))
    assert float(nvfp4.global_scale_ct(torch.zeros((), dtype=dtype))) == 1.0


def _tiny(tmp_path: Path, name: str, **config) -> Path:
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "mixtral": transformers.MixtralConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig, "llama": transformers.LlamaConfig}[name]
    torch.manual_seed(11)
    folder = tmp_path / name
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**_LLAMA, **config}))
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_a_qwen3_model_is_written_as_compressed_tensors_compresses_it(tmp_path):
    """Qwen3 (q/k norms beside the fused QKV): every tensor and the config bit for bit compressed-
    tensors' compression with llm-compressor's fused global scales; transformers loads it."""
    import transformers

    src = _tiny(tmp_path, "qwen3", head_dim=16, num_attention_heads=4)
    assert _run(str(src), str(tmp_path / "out"), "--to", "hf", "--quantize", "nvfp4") == 0
    make_ct_folder(src, tmp_path / "want", "nvfp4a16")
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "want")) == []
    config = json.loads((tmp_path / "want" / "config.json").read_text())["quantization_config"]
    config.pop("version")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == config
    _model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("family, config, fused", [
    ("mixtral", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), ("w1", "w3")),
    ("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2), ("gate_proj", "up_proj")),
])
def test_each_experts_gate_and_up_share_a_global_scale(tmp_path, family, config, fused):
    """Each routed (and shared) expert's gate and up projections share their own global scale, as
    llm-compressor's model-free path fuses them; every tensor bit for bit compressed-tensors'
    compression of each module; transformers loads the folder at default strictness."""
    import transformers

    from quantized_releases import compress_folder_ct

    src = _tiny(tmp_path, family, **config)
    assert _run(str(src), str(tmp_path / "bf16"), "--to", "hf") == 0
    assert _run(str(src), str(tmp_path / "out"), "--to", "hf", "--quantize", "nvfp4") == 0
    compress_folder_ct(tmp_path / "bf16", tmp_path / "want", "nvfp4a16", r".*(_proj|\.w[123])", ["lm_head"],
                       dtype=torch.bfloat16)
    assert differing(folder_tensors(tmp_path / "out"), folder_tensors(tmp_path / "want")) == []
    scales = _own_scales(tmp_path / "out")
    experts = sorted({k.rsplit(".", 1)[0] for k in scales if ".experts." in k or "shared_expert." in k})
    assert len(experts) == 4 * 2 + (2 if family == "qwen2_moe" else 0)
    for expert in experts:
        assert torch.equal(scales[f"{expert}.{fused[0]}"], scales[f"{expert}.{fused[1]}"]), expert
    assert len({float(scales[f"{e}.{fused[0]}"]) for e in experts}) > 1  # one scale per expert, not per layer
    _model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info


def test_an_nvfp4_refusal_names_the_tensor_and_writes_nothing(tmp_path, capsys):
    """An input width NVFP4's group of 16 does not divide, and an attention whose fused layers
    (DeepSeek's q_a_proj and kv_a_proj_with_mqa) megatron-core holds as two tensors: one line,
    nothing written. A weight of a dtype compressed-tensors does not quantize is refused too."""
    from reshard.core.compressed_tensors_out import Encoding

    src = _tiny(tmp_path, "llama", intermediate_size=72)
    capsys.readouterr()
    assert _run(str(src), str(tmp_path / "o"), "--to", "hf", "--quantize", "nvfp4") == 2
    err = capsys.readouterr().err.strip()
    assert ("--quantize nvfp4: model.layers.0.mlp.down_proj.weight has 72 inputs, not a multiple of NVFP4's "
            "group of 16") in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    deepseek = Path(__file__).parent / "fixtures/realtools/megatron-bridge-0.6.2/deepseek-v3/hf"
    assert _run(str(deepseek), str(tmp_path / "o"), "--to", "hf", "--quantize", "nvfp4") == 2
    err = capsys.readouterr().err.strip()
    assert ("model.layers.0.self_attn.q_a_proj and model.layers.0.self_attn.kv_a_proj_with_mqa share one NVFP4 "
            "global scale") in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    assert "quantizes float16, bfloat16 or float32" in Encoding("nvfp4").refusal((16, 96), torch.int8)[0]
