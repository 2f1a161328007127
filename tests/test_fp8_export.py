"""``--quantize fp8`` on ``--to hf``: FP8 block-scaled Hugging Face folders (DeepSeek's format, which
vLLM and transformers load), written from megatron-core checkpoints made by real megatron-core.

Each export is checked against the plain export of the same checkpoint: every linear weight of
attention, the dense MLP, routed and shared experts is the block formula written out below (bit for
bit: e4m3 values and float32 scales, partial blocks in both dimensions) and within e4m3's rounding
bound of the plain weight per block; every other tensor (embeddings, output layer, norms, routers,
the shared expert's gate, biases) is the plain export's, byte for byte; ``config.json`` is the plain
one plus ``quantization_config``. transformers loads the export (no missing or unexpected key) and
computes what it computes from the formula's dequantized weights.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from mcore_fixtures import mcore_checkpoints, mcore_moe_checkpoints, needs_mcore
from reshard.cli import main
from reshard.formats import hf as hf_format
from test_hf_export import hf_logits, hf_tensors

pytestmark = needs_mcore

#: Partial blocks in both dimensions of the small models' projections: hidden 64 = 48 + 16 columns,
#: key/value projections of 16 rows, experts of 48 rows = 32 + 16.
BLOCK = (32, 48)
#: The Hugging Face names of linear layers' weights (attention, dense MLP, Mixtral's and Qwen's
#: experts and shared expert): what FP8 encodes. A router (``mlp.gate``, ``block_sparse_moe.gate``)
#: and Qwen2-MoE's ``shared_expert_gate`` are not.
LINEAR = re.compile(r"\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
E4M3_MAX = 448.0


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8src")
    dense, moe = mcore_checkpoints(root / "dense"), mcore_moe_checkpoints(root / "moe")
    return {"llama": dense[("llama", 2, 1)], "qwen": dense[("qwen", 2, 1)], "qwen3": dense[("qwen3", 2, 1)],
            "mixtral": moe[("mixtral", 2, 2, 1)], "qwen_moe": moe[("qwen_moe", 1, 2, 1)],
            "qwen3_moe": moe[("qwen3_moe", 2, 2, 1)],
            "mha": dense[("mha", 2, 1)]}


def block_reference(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block scaling, one block at a time: ``s = amax / 448`` (1 for an all-zero block),
    ``q = e4m3(clamp(w / s))``."""
    b0, b1 = block
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(m / b0), math.ceil(n / b1), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            x = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            amax = x.abs().max()
            s[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (x / s[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(
                torch.float8_e4m3fn)
    return q, s


def dequantized(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    per = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return q.float() * per


def _export(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), "--to", "hf", *extra]) == 0
    return out


CASES = ["llama", "qwen", "qwen3", "mixtral", "qwen_moe", "qwen3_moe"]


@pytest.mark.parametrize("name", CASES)
def test_fp8_export_is_the_block_formula_of_the_plain_export(sources, tmp_path, name, monkeypatch):
    plain_dir = _export(sources[name], tmp_path / "plain")
    # the codes streamed out two block rows at a time (a real export's chunks are ~16 MiB), so these
    # small weights go through the chunking, partial last block rows included, and on two cores each
    # chunk's two bands through the two quantizing threads
    monkeypatch.setattr(hf_format, "fp8_chunk_rows", lambda columns, block_rows: 2 * block_rows)
    fp8_dir = _export(sources[name], tmp_path / "fp8", "--quantize", "fp8", "--fp8-block", "32x48",
                      "--max-shard-size", "60KB")
    plain, fp8 = hf_tensors(plain_dir), hf_tensors(fp8_dir)
    linear = sorted(k for k in plain if LINEAR.search(k))
    assert linear and sorted(fp8) == sorted([*plain, *(k + "_scale_inv" for k in linear)])
    for key, w in plain.items():
        if key not in linear:
            assert fp8[key].dtype == w.dtype and torch.equal(fp8[key], w), key
            continue
        q, s = fp8[key], fp8[key + "_scale_inv"]
        want_q, want_s = block_reference(w, BLOCK)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, key
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), key
        # e4m3 keeps 3 mantissa bits: within half a step of the top binade [256, 448] (16 scales) per block
        per = s.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:w.shape[0], :w.shape[1]]
        assert ((dequantized(q, s, BLOCK) - w.float()).abs() <= 16 * per).all(), key
    plain_cfg, cfg = (json.loads((d / "config.json").read_text()) for d in (plain_dir, fp8_dir))
    quant = cfg.pop("quantization_config")
    assert cfg == plain_cfg
    kept = sorted(k.removesuffix(".weight") for k, v in plain.items()
                  if v.dim() == 2 and k.endswith(".weight") and k not in linear)
    assert quant == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": list(BLOCK), "modules_to_not_convert": kept}
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(fp8)
    # shards cut by the bytes written (FP8 and scales), as Hugging Face cuts them: filled, not half empty
    files, total = len(set(index["weight_map"].values())), index["metadata"]["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in fp8.values())
    assert 1 < files < 1.5 * math.ceil(total / 60_000), (files, total)


@pytest.mark.parametrize("name", ["llama", "qwen_moe", "qwen3_moe"])
def test_transformers_loads_the_fp8_export_as_the_model_it_encodes(sources, tmp_path, name):
    """transformers (which reads FP8 on a CPU by dequantizing whole blocks: the blocks must divide
    the weights there) loads the export with every key, and computes what the plain model computes
    with the formula's dequantized weights in place of its linear weights — not the plain model."""
    plain_dir = _export(sources[name], tmp_path / "plain")
    fp8_dir = _export(sources[name], tmp_path / "fp8", "--quantize", "fp8", "--fp8-block", "16")
    from safetensors.torch import save_file

    fp8, plain = hf_tensors(fp8_dir), hf_tensors(plain_dir)
    encoded = tmp_path / "encoded"  # the plain export with the formula's dequantized linear weights
    encoded.mkdir()
    (encoded / "config.json").write_text((plain_dir / "config.json").read_text())
    save_file({k: dequantized(fp8[k], fp8[k + "_scale_inv"], (16, 16)) if LINEAR.search(k) else v
               for k, v in plain.items()}, str(encoded / "model.safetensors"), metadata={"format": "pt"})
    got = hf_logits(fp8_dir)
    want = hf_logits(encoded)
    assert (got - want).abs().max() < 1e-2 * want.abs().max()  # transformers runs FP8 models in bf16 on a CPU
    assert (hf_logits(plain_dir) - want).abs().max() > 0  # the encoding is not the identity


def test_reshard_reads_its_fp8_export_back_as_the_model_it_encodes(sources, tmp_path):
    fp8_dir = _export(sources["mixtral"], tmp_path / "fp8", "--quantize", "fp8", "--fp8-block", "32x48")
    back = hf_tensors(_export(fp8_dir, tmp_path / "back"))
    fp8 = hf_tensors(fp8_dir)
    assert sorted(back) == sorted(k for k in fp8 if not k.endswith("_scale_inv"))
    for key, t in back.items():
        want = dequantized(fp8[key], fp8[key + "_scale_inv"], BLOCK) if LINEAR.search(key) else fp8[key]
        assert t.dtype == torch.float32 and torch.equal(t, want), key


def _refused(capsys, argv: list[str], dst: Path, needle: str) -> None:
    capsys.readouterr()
    assert main(["run", "--direct", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not dst.exists()


def test_fp8_where_it_cannot_be_held_is_refused(sources, tmp_path, capsys):
    llama = str(sources["llama"])
    _refused(capsys, [llama, str(tmp_path / "a"), "--target-tp", "1", "--quantize", "fp8"], tmp_path / "a",
             "--quantize fp8: the megatron layout has no place for FP8 block-scaled weights")
    _refused(capsys, [llama, str(tmp_path / "b"), "--to", "torch_dist", "--quantize", "fp8"], tmp_path / "b",
             "--quantize fp8: the torch_dist layout has no place for FP8")
    _refused(capsys, [str(sources["mha"]), str(tmp_path / "c"), "--to", "hf", "--quantize", "fp8"], tmp_path / "c",
             "--quantize fp8: GPT2LMHeadModel has no linear layer")
    _refused(capsys, [llama, str(tmp_path / "d"), "--to", "hf", "--fp8-block", "64"], tmp_path / "d",
             "--fp8-block: applies only with --quantize fp8")
    _refused(capsys, [llama, str(tmp_path / "h"), "--to", "hf", "--quantize", "fp8", "--groups", "4"], tmp_path / "h",
             "--groups: sets int8 quantization, not FP8's")
    _refused(capsys, [llama, str(tmp_path / "e"), "--to", "hf", "--quantize", "fp8", "--fp8-block", "0x8"],
             tmp_path / "e", "--fp8-block: '0x8' is not a block size")
    _refused(capsys, [llama, str(tmp_path / "f"), "--to", "hf", "--quantize", "fp4"], tmp_path / "f",
             "--quantize: 'fp4' is not one of int8, fp8")
    _refused(capsys, [llama, str(tmp_path / "g"), "--to", "hf", "--quantize", "int8"], tmp_path / "g",
             "--quantize fp8 for FP8 block-scaled weights")
    # the flag alone is int8, as before it took a value, wherever it stands
    _refused(capsys, ["--quantize", llama, str(tmp_path / "i"), "--to", "hf"], tmp_path / "i",
             "--quantize: Hugging Face safetensors has no place for reshard's int8")


def test_a_weight_fp8_cannot_scale_is_refused_in_one_line_naming_it(sources, tmp_path, capsys, monkeypatch):
    """A NaN in a linear weight, found while its codes stream out (one block row per chunk here, the
    NaN in a later one): one line naming the Hugging Face tensor and its rows, exit 2, no output."""
    from safetensors.torch import load_file, save_file

    hf = _export(sources["llama"], tmp_path / "hf")
    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][40, 3] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    monkeypatch.setattr(hf_format, "FP8_CHUNK_BYTES", 1)
    _refused(capsys, [str(hf), str(tmp_path / "fp8"), "--to", "hf", "--quantize", "fp8", "--fp8-block", "32x48"],
             tmp_path / "fp8", f"{name}: rows 32..63 hold a NaN or an infinity, which FP8 cannot scale")


def test_fp8_through_the_flow_to_and_from_s3_equals_direct(sources, tmp_path, s3_server, s3_bucket, monkeypatch,
                                                           prefect_env):
    """``--quantize fp8`` streamed into multipart uploads (each e4m3 weight and its scales in file
    order), and an FP8 folder read from S3 by ranged reads: the same files as ``--direct``."""
    import s3fs

    from conftest import output_bytes, upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.direct import run_direct
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    opts = {"to": "hf", "quantize": "fp8", "fp8_block": "32x48", "max_shard_size": "60KB"}
    run_direct(str(sources["llama"]), str(tmp_path / "direct"), ReshardOptions(**opts))
    url, so = upload_to_s3(sources["llama"], s3_server, s3_bucket, monkeypatch)
    run_flow(ReshardParams(source=url, destination=f"{s3_bucket}/fp8", storage_options=so,
                           cache_dir=str(tmp_path / "cache"), **opts))
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    fs.get(f"{s3_bucket}/fp8/", str(tmp_path / "flow"), recursive=True)
    assert output_bytes(tmp_path / "flow") == output_bytes(tmp_path / "direct")
    run_direct(str(tmp_path / "direct"), str(tmp_path / "bf16_direct"), ReshardOptions(to="hf"))
    run_flow(ReshardParams(source=f"{s3_bucket}/fp8", destination=str(tmp_path / "bf16_flow"), storage_options=so,
                           cache_dir=str(tmp_path / "cache2"), to="hf"))
    assert output_bytes(tmp_path / "bf16_flow") == output_bytes(tmp_path / "bf16_direct")
