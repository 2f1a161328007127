"""Quantization: bit-exact with DeepSpeed's per-group math, correct where DeepSpeed is not."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.weight_quantizer import WeightQuantization

from conftest import CFG, load_modules
from reshard.core.errors import LayoutError
from reshard.core.quantize import QUANT_KEY, dequantize_piece, quantize_groups
from reshard.core.rules import QUANT_SLOT_ORDER
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions
from reshard.sample import GPTConfig

SLOT_SUFFIX = {"qkv": "query_key_value.weight", "dense": "attention.dense.weight",
               "h_to_4h": "dense_h_to_4h.weight", "4h_to_h": "dense_4h_to_h.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,groups", [(8, 1), (8, 16), (4, 8), (2, 4)])
def test_quantize_groups_bit_exact_with_deepspeed(dtype, bits, groups):
    g = torch.Generator().manual_seed(bits * 100 + groups)
    x = (torch.randn(64, 48, generator=g) * 3).to(dtype)
    x[0, 0] = 0.0
    ref_q, ref_s = WeightQuantization().quantize_data(x, bits, groups)
    q, s = quantize_groups(x, bits, groups)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q)
    assert torch.equal(s, ref_s.view(-1))


def test_quantize_refuses_uneven_groups():
    with pytest.raises(LayoutError, match="equal groups"):
        quantize_groups(torch.ones(10), 8, 3, key="w")


def _dequant_error_ok(q: torch.Tensor, scales: torch.Tensor, ref: torch.Tensor, bits: int = 8) -> None:
    """Error <= half a step wherever the value is representable. DeepSpeed's scale maps max|x|
    to 2**(B-1), one past the int8 maximum, so only values clamped to 2**(B-1)-1 may be off by
    up to one step; they are checked separately."""
    deq = dequantize_piece(q, scales)
    step = scales.unsqueeze(1)
    err = (deq - ref.float()).abs().reshape(scales.numel(), -1)
    at_max = q.reshape(scales.numel(), -1) == (1 << (bits - 1)) - 1
    clamped = at_max & (ref.float().reshape(err.shape) > deq.reshape(err.shape))
    tol = 1e-6 * step + 1e-7
    assert torch.all(err[~clamped] <= (step / 2 + tol).expand_as(err)[~clamped])
    assert torch.all(err[clamped] <= (step + tol).expand_as(err)[clamped])


@pytest.mark.parametrize("n,m", [(1, 4), (2, 8), (1, 2)], ids=["1to4", "2to8", "1to2"])
@pytest.mark.parametrize("version", [0, 2.0])
def test_split_quantization_dequantizes_within_half_a_step(sample_factory, tmp_path, n, m, version):
    """Splits: each target weight is one piece in G (MLP: 2G) groups — DeepSpeed's split path is broken."""
    src = sample_factory(n, version)
    groups = 4
    run_direct(str(src), str(tmp_path / "q"), ReshardOptions(target_tp=m, quantize=True, groups=groups))
    run_direct(str(src), str(tmp_path / "f"), ReshardOptions(target_tp=m))
    fulls = load_modules(tmp_path / "f")
    for t in range(m):
        sd = torch.load(tmp_path / "q" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)
        table = sd[QUANT_KEY]["scales"]
        assert table.shape[:2] == (CFG.layers, 4)
        for layer in range(CFG.layers):
            for si, slot in enumerate(QUANT_SLOT_ORDER):
                key = next(k for k in sd["module"] if f"layers.{layer}." in k and k.endswith(SLOT_SUFFIX[slot.value]))
                g = groups * (2 if "mlp" in key else 1)
                scales = table[layer, si]
                assert torch.count_nonzero(scales) == g and torch.all(scales[g:] == 0)
                assert sd["module"][key].dtype == torch.int8
                _dequant_error_ok(sd["module"][key], scales[:g], fulls[t][key])


def test_merge_scale_layout_dequantizes_within_half_a_step(sample_factory, tmp_path):
    """Merges: piece-major scales for column weights, group-major for row weights (documented)."""
    src = sample_factory(8, 2.0)
    groups, k = 4, 4
    run_direct(str(src), str(tmp_path / "q"), ReshardOptions(target_tp=2, quantize=True, groups=groups))
    sources = load_modules(src)
    for t in range(2):
        sd = torch.load(tmp_path / "q" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)
        table = sd[QUANT_KEY]["scales"]
        for si, slot in enumerate(QUANT_SLOT_ORDER):
            key = next(kk for kk in sd["module"] if "layers.1." in kk and kk.endswith(SLOT_SUFFIX[slot.value]))
            g = groups * (2 if "mlp" in key else 1)
            vec = table[1, si, : g * k]
            row = slot.value in ("dense", "4h_to_h")
            per_piece = vec.reshape(g, k).T if row else vec.reshape(k, g)
            q = sd["module"][key]
            for j in range(k):
                src_t = sources[t * k + j][key]
                piece = q.chunk(k, dim=1 if row else 0)[j]
                _dequant_error_ok(piece, per_piece[j], src_t)


def test_mlp_groups_follow_the_rule_not_a_shape_heuristic(tmp_path):
    """With ffn = 2*hidden DeepSpeed's shape test misses the MLP; reshard doubles groups by name."""
    from reshard.sample import write_sample_checkpoint

    cfg = GPTConfig(layers=1, hidden=64, heads=8, vocab=128, seq=16, ffn_mult=2)
    write_sample_checkpoint(tmp_path / "src", tp=4, cfg=cfg)
    assert not WeightQuantization(mp_size=2).is_mlp(torch.empty(32, 64), merge_count=2)
    run_direct(str(tmp_path / "src"), str(tmp_path / "q"), ReshardOptions(target_tp=2, quantize=True, groups=4))
    table = torch.load(tmp_path / "q" / "mp_rank_00_model_states.pt", weights_only=False)[QUANT_KEY]["scales"]
    nonzero = [int(torch.count_nonzero(table[0, i])) for i in range(4)]
    assert nonzero == [8, 8, 16, 16]  # 2 pieces x (4 | 8 groups)


def test_quantized_descriptor_records_settings(sample_factory, tmp_path):
    import json

    run_direct(str(sample_factory(8, 2.0)), str(tmp_path / "q"),
               ReshardOptions(target_tp=4, quantize=True, bits=8, groups=2))
    desc = json.loads((tmp_path / "q" / "ds_checkpoint.json").read_text())
    assert desc["quantized"] is True
    assert desc["quantization"]["groups"] == 2 and desc["mp_size"] == 4


def test_groups_that_do_not_divide_are_refused_before_writing(sample_factory, tmp_path):
    with pytest.raises(LayoutError, match="groups"):
        run_direct(str(sample_factory(8, 2.0)), str(tmp_path / "q"),
                   ReshardOptions(target_tp=2, quantize=True, groups=7))
    assert not (tmp_path / "q").exists()
