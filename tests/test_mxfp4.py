"""MXFP4 (:mod:`reshard.core.mxfp4`, read and written by the ``hf`` format through
:mod:`reshard.core.release_codecs`): GPT-OSS's release format.

The codec is checked against transformers' own dequantization (``convert_moe_packed_tensors``,
every code under every scale) and against both directions written out here independently (per
element with Python floats; the quantizer as the nearest e2m1 value by distance, ties to the even
code); dequantizing and quantizing again gives the codes back wherever the scales follow the
rule. Folders of the stacked plug-in architecture (``tests/plugin_stacked_moe.py``: GPT-OSS's
expert names and layout) go bf16 -> ``--quantize mxfp4`` -> back, MXFP4 -> bf16 (bit-equal to
transformers), MXFP4 -> megatron-core TP 2 x EP 2 -> MXFP4 (the same codes), and bad folders and
impossible requests are refused in one line with nothing written.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugin_stacked_moe import StackedMoe
from reshard.cli import main
from reshard.core import mxfp4
from reshard.core.fp8_block import NonFiniteWeightError
from reshard.core.lazy import LazyTensor
from reshard.core.release_codecs import ReleaseCodec, register_release_codec, unregister_release_codec
from reshard.models.hf_registry import register_hf_architecture, unregister_hf_architecture

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

#: e2m1 by code, written out: the sign bit 8 over {0, .5, 1, 1.5, 2, 3, 4, 6}.
LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _transformers(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """transformers' dequantization: ``[E, in, out]`` (the bf16 release's layout)."""
    return transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def _formula_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The module table's dequantization, one element at a time: column ``c`` of row ``r`` is the
    low nibble of byte ``(c % 32) // 2`` of group ``c // 32`` when ``c`` is even, else the high
    one; ``LUT[code] * 2**(s - 127)`` in Python floats (exact), rounded once to ``dtype``."""
    rows, groups, _ = blocks.shape
    out = []
    for r in range(rows):
        row = []
        for c in range(groups * 32):
            byte = int(blocks[r, c // 32, (c % 32) // 2])
            code = byte & 15 if c % 2 == 0 else byte >> 4
            row.append(math.ldexp(LUT[code], int(scales[r, c // 32]) - 127))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).to(dtype)


def _formula_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP Microscaling rule written out: per 32 inputs ``e = floor(log2(amax)) - 2`` (float64
    ``log2``; -127 for an all-zero group), clamped to [-127, 127]; each value the nearest e2m1
    magnitude to ``|w| / 2**e`` by distance (ties to the even code: the even ones are looked at
    first, and ``argmin`` keeps the first), the sign bit from the sign; packed low nibble first."""
    rows, width = w.shape
    x = w.double().view(rows, width // 32, 32)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    a = x.abs() / torch.pow(2.0, e).unsqueeze(-1)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    grid = torch.tensor([LUT[i] for i in order], dtype=torch.float64)
    index = torch.tensor(order)[(a.unsqueeze(-1) - grid).abs().argmin(-1)]
    codes = index + 8 * torch.signbit(x).long()
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (e + 127).to(torch.uint8)


def _rule_groups(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[*, out, in/32]``: the groups whose scale is the rule's for their own dequantized values:
    the largest magnitude code is 4 or 6 (``floor(log2(amax)) - 2`` is then the scale), or the
    group is all zeros under scale 0."""
    codes = torch.stack([blocks & 7, (blocks >> 4) & 7], -1).amax((-1, -2))
    return (codes >= 6) | ((codes == 0) & (scales == 0))


# --- the codec ------------------------------------------------------------------------------------

def _every_code_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, 256, 16, 16]`` blocks, ``[1, 256, 16]`` scales: row ``s`` holds every byte under scale ``s``."""
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256).to(torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantization_is_transformers_for_every_code_under_every_scale(dtype):
    blocks, scales = _every_code_under_every_scale()
    want = _transformers(blocks, scales, dtype)  # [1, in, out]
    got = mxfp4.dequantize(blocks, scales, dtype)  # [1, out, in]
    assert torch.equal(_bits(got.transpose(1, 2)), _bits(want))
    # the lazy tensor reads the release's layout [E, in, out], any box
    lazy = mxfp4.Mxfp4Dequantized(blocks, scales, dtype)
    assert lazy.shape == tuple(want.shape)
    assert torch.equal(_bits(lazy.materialize()), _bits(want))
    assert torch.equal(_bits(lazy.read_box((0, 37, 3), (1, 70, 200))), _bits(want[:, 37:107, 3:203]))


def test_dequantization_of_a_stack_is_transformers_and_the_formula_written_out():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 24, 4), dtype=torch.uint8)
    want = _transformers(blocks, scales)
    got = mxfp4.dequantize(blocks, scales)
    assert torch.equal(_bits(got.transpose(1, 2)), _bits(want))
    for e in range(3):
        assert torch.equal(_bits(got[e]), _bits(_formula_dequantize(blocks[e], scales[e], torch.bfloat16)))
    lazy = mxfp4.Mxfp4Dequantized(blocks, scales)
    out = torch.empty(2, 50, 9, dtype=torch.bfloat16)
    assert lazy.read_box((1, 5, 11), (2, 50, 9), out=out) is out
    assert torch.equal(_bits(out), _bits(want[1:3, 5:55, 11:20]))


def _special_weights() -> torch.Tensor:
    """Rows that hit every rounding tie, both signs, saturation, subnormals, zero and -0 groups."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.0, 7.99, 0.2499, 0.2501, 4.5, 5.5])
    row = torch.cat([ties, -ties, torch.tensor([4.0, -0.0, 0.0, 1.0])])  # amax 7.99: scale 2**0 after the -2
    assert row.numel() == 32
    tiny = torch.tensor([2.0 ** -130, -(2.0 ** -140)] + [0.0] * 30)  # subnormal float32: the smallest scale
    return torch.stack([row, row * 2.0 ** -20, row * 2.0 ** 60, torch.zeros(32), -torch.zeros(32), tiny,
                        torch.linspace(-3, 3, 32)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_the_ocp_rule_written_out(dtype):
    torch.manual_seed(1)
    w = torch.cat([_special_weights().repeat(1, 2), torch.randn(40, 64) * 3, torch.randn(8, 64).pow(5)]).to(dtype)
    blocks, scales = mxfp4.quantize(w)
    want_blocks, want_scales = _formula_quantize(w)
    assert torch.equal(scales, want_scales)
    assert torch.equal(blocks, want_blocks)
    # transposed weights (a slab stored [in, out]) quantize the same
    b2, s2 = mxfp4.quantize(w.t().contiguous().t())
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_every_bfloat16_under_every_scale_quantizes_as_its_float32_copy():
    """bfloat16 weights are quantized from their bits (a table of every bfloat16 under every scale),
    float32 ones through arithmetic checked against the rule above: each finite bfloat16 magnitude,
    both signs, in a group whose largest magnitude puts it at each scale where its code can be
    other than 0 (its exponent field from the largest's minus 5 up; subnormals under scales 0 to 3),
    gets its float32 copy's code and scale."""
    groups = []
    for top in range(255):  # the largest magnitude's exponent field: scale byte max(top - 2, 0)
        amax = top << 7 | 0x7F
        first = 0 if top <= 8 else (top - 5) << 7
        magnitudes = torch.arange(first, amax + 1, dtype=torch.int32)
        values = torch.cat([magnitudes, magnitudes | 0x8000])
        values = torch.cat([values, torch.zeros(-values.numel() % 31, dtype=torch.int32)])
        body = values.view(-1, 31)
        groups.append(torch.cat([torch.full((body.shape[0], 1), amax, dtype=torch.int32), body], dim=1))
    bits = torch.cat(groups)
    bits = torch.cat([bits, bits.new_zeros(-bits.shape[0] % 8, 32)]).view(-1, 8 * 32)
    w = bits.to(torch.uint16).view(torch.bfloat16)
    assert torch.isfinite(w).all() and w.numel() > 400_000
    blocks, scales = mxfp4.quantize(w)
    want_blocks, want_scales = mxfp4.quantize(w.float())
    assert torch.equal(scales, want_scales) and set(scales.unique().tolist()) == set(range(253))
    assert torch.equal(blocks, want_blocks)


def test_an_all_zero_group_has_the_smallest_scale_and_zero_codes():
    w = torch.zeros(2, 64)
    w[1, 32:] = -0.0
    w[0, 32] = 1.0
    blocks, scales = mxfp4.quantize(w)
    assert scales.tolist() == [[0, 125], [0, 0]]  # 1.0 = 4 * 2**-2: 127 - 2
    assert blocks[0, 0].tolist() == [0] * 16 and blocks[1, 0].tolist() == [0] * 16
    assert blocks[1, 1].tolist() == [0x88] * 16  # -0 keeps its sign
    assert blocks[0, 1, 0] == 0x06  # 1.0 / 2**-2 = 4: code 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_an_infinity_is_refused(bad):
    w = torch.randn(4, 64)
    w[2, 40] = bad
    with pytest.raises(NonFiniteWeightError, match="row 2 holds a NaN or an infinity"):
        mxfp4.quantize(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantizing_and_quantizing_again_gives_the_codes_back_where_the_scales_follow_the_rule(dtype):
    torch.manual_seed(2)
    blocks = torch.randint(0, 256, (2, 64, 8, 16), dtype=torch.uint8)
    scales = torch.randint(0, 250, (2, 64, 8), dtype=torch.uint8)
    blocks[0, :4] = 0  # all-zero groups under several scales (only scale 0 is the rule's)
    blocks[1, 3, 2] = 0x11  # largest code 1: a scale the rule would not pick
    again_b, again_s = mxfp4.quantize(mxfp4.dequantize(blocks, scales, dtype))
    rule = _rule_groups(blocks, scales)
    assert rule.float().mean() > 0.9 and not rule.all()
    assert torch.equal(again_s[rule], scales[rule])
    assert torch.equal(again_b[rule], blocks[rule])
    # where the scale is not the rule's, the values still are: dequantized again they agree
    assert torch.equal(_bits(mxfp4.dequantize(again_b, again_s, dtype)), _bits(mxfp4.dequantize(blocks, scales, dtype)))


def test_a_realistic_weight_round_trips_exactly():
    torch.manual_seed(3)
    w = (torch.randn(128, 256) * 0.02).to(torch.bfloat16)
    blocks, scales = mxfp4.quantize(w)
    assert torch.equal(mxfp4.quantize(mxfp4.dequantize(blocks, scales))[0], blocks)
    err = (mxfp4.dequantize(blocks, scales).float() - w.float()).abs()
    # within half the coarsest e2m1 spacing (2, between 4 and 6) under each group's scale, but for
    # the saturated values in (6, 8): at most 2 from 6
    unit = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1)
    assert (err <= 2 * unit).all() and (err[err > unit] >= 0).all()
    assert ((err <= unit) | (w.float().abs() > 6 * unit)).all()



def _round_up_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of the quantizer transformers calls to make an MXFP4 model (``quantize_to_mxfp4``:
    triton_kernels' ``downcast_to_mxfp_torch`` at its default ``DequantScaleRoundingMode.ROUND_UP``),
    as its source states it; it is fetched from the Hugging Face hub at run time and cannot run
    here, so it is written out: per 32 inputs the scale is ``amax / 6`` (float32) rounded *up* to a
    power of two (OCP: ``floor(log2(amax)) - 2``, rounded down), and each value over it is rounded
    to the nearest e2m1 magnitude with ties away from zero, saturated at 6; the sign bit from the sign."""
    rows, width = w.shape
    x = w.float().view(rows, width // 32, 32)
    ds = x.abs().amax(-1) / 6.0
    mant, exp = torch.frexp(ds)
    e = torch.where(ds == 0, torch.full_like(exp, -127), torch.where(mant == 0.5, exp - 1, exp))
    a = x / torch.pow(2.0, e.float()).unsqueeze(-1)
    ties_up = torch.tensor([(lo + hi) / 2 for lo, hi in zip(LUT[:7], LUT[1:8])])
    codes = torch.searchsorted(ties_up, a.abs().contiguous(), right=True) + 8 * torch.signbit(a).long()
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (e + 127).to(torch.uint8)


def test_a_release_by_transformers_quantizer_reads_exactly_and_quantizes_back_where_its_scales_are_the_rules():
    """How often reshard's ``--quantize mxfp4`` (the OCP rule) gives a release made by transformers'
    quantizer back byte for byte: on GPT-OSS-sized rows of N(0, 0.02) weights its scales differ from
    the OCP rule's on about 42% of the groups (rounded up, not down); quantizing its dequantized
    values again gives its codes and scales back on every group whose largest code is 4 or 6 (about
    73%), and on the others (largest code 3: one scale lower, codes doubled) the same values."""
    torch.manual_seed(4)
    w = (torch.randn(256, 2880) * 0.02).to(torch.bfloat16)
    blocks, scales = _round_up_quantize(w)
    want = _transformers(blocks.unsqueeze(0), scales.unsqueeze(0))[0].t()  # [in, out] -> [out, in]
    assert torch.equal(_bits(mxfp4.dequantize(blocks, scales)), _bits(want))
    differ = (scales != mxfp4.quantize(w)[1]).float().mean().item()
    assert 0.35 < differ < 0.5
    again_b, again_s = mxfp4.quantize(mxfp4.dequantize(blocks, scales))
    rule = _rule_groups(blocks, scales)
    same = (again_s == scales) & (again_b == blocks).all(-1)
    assert torch.equal(same, rule) and 0.65 < rule.float().mean().item() < 0.8
    assert torch.equal(again_s[~rule], scales[~rule] - 1)
    assert torch.equal(_bits(mxfp4.dequantize(again_b, again_s)), _bits(want))

# --- folders of the stacked plug-in (GPT-OSS's expert names) ------------------------------------------

E, H, F, LAYERS, VOCAB = 4, 64, 32, 2, 128
CONFIG = {"architectures": ["StackedMoeForCausalLM"], "model_type": "stacked_moe", "hidden_size": H,
          "intermediate_size": F, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 10000.0, "num_local_experts": E,
          "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
          "eos_token_id": 2, "dtype": "bfloat16", "attention_bias": True, "mlp_bias": True}
#: GPT-OSS's release: what stays bf16.
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.router", "model.layers.*.self_attn"]
STACKED = ("gate_up_proj", "down_proj")


def _bf16_folder(root: Path, hidden: int = H) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    q, kv = hidden, hidden // 2

    def r(*shape):
        return torch.randn(*shape).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(VOCAB, hidden), "model.norm.weight": r(hidden),
         "lm_head.weight": r(VOCAB, hidden)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": r(hidden), p + "post_attention_layernorm.weight": r(hidden),
              p + "self_attn.q_proj.weight": r(q, hidden), p + "self_attn.k_proj.weight": r(kv, hidden),
              p + "self_attn.v_proj.weight": r(kv, hidden), p + "self_attn.o_proj.weight": r(hidden, q),
              p + "mlp.router.weight": r(E, hidden), p + "mlp.experts.gate_up_proj": r(E, hidden, 2 * F) * 0.1,
              p + "mlp.experts.down_proj": r(E, F, hidden), p + "mlp.experts.down_proj_bias": r(E, hidden),
              p + "mlp.experts.gate_up_proj_bias": r(E, 2 * F)}
        t |= {p + f"self_attn.{x}_proj.bias": r(n) for x, n in (("q", q), ("k", kv), ("v", kv), ("o", hidden))}
    t[f"model.layers.0.mlp.experts.{STACKED[1]}"][1, :, :32] = 0  # an expert's first group of inputs all zero
    root.mkdir()
    save_file(t, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": hidden}))
    return t


def _read(folder: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(folder.glob("*.safetensors")):
        got |= load_file(f)
    return got


def _run(*argv: str) -> int:
    return main(["run", "--direct", *argv])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """bf16 -> MXFP4 (``--quantize mxfp4``) -> bf16, and MXFP4 -> megatron-core TP 2 x EP 2 (and
    torch_dist) -> MXFP4."""
    root = tmp_path_factory.mktemp("mxfp4")
    want = _bf16_folder(root / "bf16")
    seen = {"quantize": [], "dequantize": []}  # the elements of each call: a slab's at most, never a stack's
    quantize, dequantize = mxfp4.quantize, mxfp4.dequantize

    def quantize_counted(w, **kw):
        seen["quantize"].append(w.numel())
        return quantize(w, **kw)

    def dequantize_counted(blocks, scales, *a, **kw):
        seen["dequantize"].append(blocks.numel() * 2)
        return dequantize(blocks, scales, *a, **kw)

    register_hf_architecture(StackedMoe)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mxfp4, "quantize", quantize_counted)
            mp.setattr(mxfp4, "dequantize", dequantize_counted)
            _conversions(root)
    finally:
        unregister_hf_architecture(StackedMoe.name)
    return root, want, seen


def _conversions(root: Path) -> None:
    for src, dst, *rest in (("bf16", "mx", "--to", "hf", "--quantize", "mxfp4"),
                                ("mx", "back", "--to", "hf"),
                                ("mx", "mcore", "--target-tp", "2", "--target-ep", "2"),
                                ("mcore", "mx2", "--to", "hf", "--quantize", "mxfp4", "--max-shard-size", "40KB"),
                                ("mx", "dist", "--to", "torch_dist"),
                                ("dist", "mx3", "--to", "hf", "--quantize", "mxfp4")):
        assert _run(str(root / src), str(root / dst), *rest) == 0, dst


def test_a_stack_is_quantized_and_dequantized_a_slab_at_most_at_a_time(folders):
    """Every expert of every stacked tensor went through the codec, never more than one slab
    (one expert's ``[out, in]``) at once: the 3-D tensor is never whole in memory."""
    *_, seen = folders
    slab = H * 2 * F  # the largest slab (gate and up), in elements
    # three exports, each of both stacked tensors of every layer (gate_up and down: 3 slabs' worth)
    assert sum(seen["quantize"]) == 3 * LAYERS * E * (slab + F * H)
    assert max(seen["quantize"]) == slab and max(seen["dequantize"]) <= slab
    assert sum(seen["dequantize"]) >= 3 * LAYERS * E * (slab + F * H)  # three imports of the MXFP4 folder

def test_each_code_is_decoded_once_per_import(folders):
    """An import reads megatron-core's ``[gate; up]`` a half at a time, and the gate and up rows of
    GPT-OSS's slab are interleaved: read box by box, each code row was decoded twice, once for each
    half. The slab is decoded once for both: the three imports decode each stored code once."""
    *_, seen = folders
    assert sum(seen["dequantize"]) == 3 * LAYERS * E * (H * 2 * F + F * H)


def test_quantize_mxfp4_writes_the_releases_layout_by_the_rule(folders):
    root, want, _ = folders
    got = _read(root / "mx")
    stacked = {f"model.layers.{i}.mlp.experts.{n}" for i in range(LAYERS) for n in STACKED}
    assert sorted(got) == sorted((set(want) - stacked) | {s + suffix for s in stacked for suffix in ("_blocks",
                                                                                                     "_scales")})
    for name in stacked:  # [E, in, out] -> blocks [E, out, in/32, 16], scales [E, out, in/32]
        w = want[name]
        blocks, scales = got[name + "_blocks"], got[name + "_scales"]
        assert blocks.shape == (E, w.shape[2], w.shape[1] // 32, 16) and blocks.dtype == torch.uint8
        assert scales.shape == (E, w.shape[2], w.shape[1] // 32) and scales.dtype == torch.uint8
        for e in range(E):
            b, s = _formula_quantize(w[e].t())
            assert torch.equal(blocks[e], b) and torch.equal(scales[e], s), (name, e)
    assert all(torch.equal(got[k], want[k]) for k in set(want) - stacked)
    config = json.loads((root / "mx" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        json.loads((root / "back" / "config.json").read_text())


def test_transformers_converts_exactly_the_stacked_weights_and_keeps_the_rest():
    """transformers' own matching of ``modules_to_not_convert`` against GPT-OSS's module names."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    for module, converted in (("model.layers.11.mlp.experts", True), ("model.layers.11.self_attn", False),
                              ("model.layers.3.self_attn.q_proj", False), ("model.layers.0.mlp.router", False),
                              ("model.embed_tokens", False), ("lm_head", False)):
        assert should_convert_module(module, NOT_CONVERTED) is converted, module


def test_an_mxfp4_folder_reads_as_transformers_dequantizes_it(folders):
    root, want, _ = folders
    mx, back = _read(root / "mx"), _read(root / "back")
    assert sorted(back) == sorted(want)
    for name in back:
        if name.endswith(STACKED):
            ref = _transformers(mx[name + "_blocks"], mx[name + "_scales"])
            assert torch.equal(_bits(back[name]), _bits(ref)), name
        else:
            assert torch.equal(back[name], want[name]), name
    config = json.loads((root / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}


def test_a_sharded_mxfp4_export_keeps_each_pair_in_one_file_and_inspect_counts_it(folders):
    """``--max-shard-size`` counts half a byte a value and a byte a group for the encoded slabs;
    each stack's blocks and scales share its file."""
    from reshard.api import inspect
    from reshard.core.options import ReshardOptions
    from reshard.formats.hf import HFFormat

    root, *_ = folders
    files = sorted((root / "mx2").glob("*.safetensors"))
    index = json.loads((root / "mx2" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) >= 3 and set(index.values()) == {f.name for f in files}
    assert max(sum(v["data_offsets"][1] - v["data_offsets"][0] for v in _header(f).values()) for f in files) <= 40_000
    for name in (f"model.layers.{i}.mlp.experts.{n}" for i in range(LAYERS) for n in STACKED):
        assert index[name + "_blocks"] == index[name + "_scales"]
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc{}.{}"
    options = ReshardOptions(to="hf", quantize="mxfp4")
    register_hf_architecture(StackedMoe)
    try:
        quantization = inspect(str(root / "mx2"))["quantization"]
        # what the cut counts: an encoded slab's codes and scales, anything else as it is
        sizes = [HFFormat().stored_bytes(expert.format(n, w), 2 * 4096, torch.bfloat16, options)
                 for n, w in ((1, "weight"), (2, "weight"), (1, "bias"))]
    finally:
        unregister_hf_architecture(StackedMoe.name)
    assert sizes == [2048 + 128, 2048 + 128, 2 * 4096]
    assert quantization == {"method": "mxfp4", "format": "e2m1", "group": 32, "scales": "e8m0 uint8 weight_scales",
                            "tensors": 2 * LAYERS, "names": [f"model.layers.*.mlp.experts.{n}_blocks"
                                                             for n in sorted(STACKED)]}


@pytest.mark.parametrize("back", ["mx2", "mx3"], ids=["per-rank-tp2-ep2", "torch_dist"])
def test_mxfp4_through_megatron_core_gives_the_same_codes_back(folders, back):
    root, *_ = folders
    # TP 2 x EP 2 at expert TP 1 (megatron-core builds MoE layers with biases at that degree only):
    # two ranks, each holding half the experts
    assert len(list((root / "mcore").rglob("model_optim_rng.pt"))) == 2
    first, again = _read(root / "mx"), _read(root / back)
    assert sorted(first) == sorted(again)
    assert [k for k in first if not torch.equal(first[k], again[k])] == []
    assert json.loads((root / "mx" / "config.json").read_text()) == \
        json.loads((root / back / "config.json").read_text())


def test_an_mxfp4_release_made_elsewhere_reads_bit_equal_to_transformers(tmp_path):
    """Codes and scales drawn at random (scales not the rule's), any byte: the import is
    transformers' dequantization, the source untouched."""
    _bf16_folder(tmp_path / "bf16")
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    torch.manual_seed(9)
    for i in range(LAYERS):
        for n in STACKED:
            name = f"model.layers.{i}.mlp.experts.{n}"
            w = tensors.pop(name)
            tensors[name + "_blocks"] = torch.randint(0, 256, (E, w.shape[2], w.shape[1] // 32, 16), dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(115, 135, (E, w.shape[2], w.shape[1] // 32), dtype=torch.uint8)
    (tmp_path / "rel").mkdir()
    save_file(tensors, tmp_path / "rel" / "model.safetensors", metadata={"format": "pt"})
    config = {**CONFIG, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}
    (tmp_path / "rel" / "config.json").write_text(json.dumps(config))
    before = (tmp_path / "rel" / "model.safetensors").read_bytes()
    register_hf_architecture(StackedMoe)
    try:
        assert _run(str(tmp_path / "rel"), str(tmp_path / "out"), "--to", "hf") == 0
    finally:
        unregister_hf_architecture(StackedMoe.name)
    got = _read(tmp_path / "out")
    assert not [k for k in got if k.endswith(("_blocks", "_scales"))]
    for i in range(LAYERS):
        for n in STACKED:
            name = f"model.layers.{i}.mlp.experts.{n}"
            assert torch.equal(_bits(got[name]), _bits(_transformers(tensors[name + "_blocks"],
                                                                     tensors[name + "_scales"]))), name
    assert (tmp_path / "rel" / "model.safetensors").read_bytes() == before


# --- refusals ---------------------------------------------------------------------------------------

def _refused(capsys, argv: list[str], needle: str, out: Path) -> None:
    register_hf_architecture(StackedMoe)
    try:
        capsys.readouterr()
        assert _run(*argv) == 2
    finally:
        unregister_hf_architecture(StackedMoe.name)
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.fixture(scope="module")
def release(folders):
    root, *_ = folders
    return load_file(root / "mx" / "model.safetensors"), json.loads((root / "mx" / "config.json").read_text())


def _edited(tmp_path: Path, release, drop: str | None = None, put: dict | None = None,
            config: dict | None = None) -> Path:
    tensors, cfg = release
    tensors = {k: v for k, v in tensors.items() if k != drop} | (put or {})
    folder = tmp_path / "bad"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return folder


_NAME = "model.layers.1.mlp.experts.down_proj"


@pytest.mark.parametrize("case, needle", [
    ("no-scales", f"{_NAME}_blocks has no {_NAME}_scales"),
    ("scales-shape", f"{_NAME}_scales is uint8 [4, 64, 2], not uint8 [4, 64, 1]"),
    ("blocks-width", f"{_NAME}_blocks is uint8 [4, 64, 1, 8], not uint8 [*, out, in/32, 16]"),
    ("method", "holds quant_method 'nvfp4', which reshard does not read"),
])
def test_a_bad_mxfp4_folder_is_refused_in_one_line_naming_the_tensor(tmp_path, capsys, release, case, needle):
    edits = {"no-scales": {"drop": _NAME + "_scales"},
             "scales-shape": {"put": {_NAME + "_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}},
             "blocks-width": {"put": {_NAME + "_blocks": torch.zeros(4, 64, 1, 8, dtype=torch.uint8)}},
             "method": {"config": {"quantization_config": {"quant_method": "nvfp4"}}}}[case]
    folder = _edited(tmp_path, release, **edits)
    _refused(capsys, [str(folder), str(tmp_path / "o"), "--to", "hf"], needle, tmp_path / "o")


def test_quantize_mxfp4_is_refused_without_stacked_weights_or_for_a_width_not_of_32s(tmp_path, capsys, folders):
    root, *_ = folders
    _refused(capsys, [str(root / "mcore"), str(tmp_path / "o"), "--quantize", "mxfp4", "--target-tp", "1"],
             "has no place for MXFP4 weights (fix: write a Hugging Face folder (--to hf))", tmp_path / "o")
    _bf16_folder(tmp_path / "w48", hidden=48)
    _refused(capsys, [str(tmp_path / "w48"), str(tmp_path / "o"), "--to", "hf", "--quantize", "mxfp4"],
             "--quantize mxfp4: model.layers.0.mlp.experts.gate_up_proj has input width 48, not a multiple of 32",
             tmp_path / "o")


def test_quantize_mxfp4_is_refused_for_a_model_without_stacked_weights(tmp_path, capsys):
    """A dense Llama-like folder: nothing for MXFP4 to encode."""
    torch.manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, H), "model.norm.weight": torch.ones(H),
         "lm_head.weight": torch.randn(VOCAB, H)}
    for i in range(1):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
              p + "self_attn.q_proj.weight": torch.randn(H, H), p + "self_attn.k_proj.weight": torch.randn(H, H),
              p + "self_attn.v_proj.weight": torch.randn(H, H), p + "self_attn.o_proj.weight": torch.randn(H, H),
              p + "mlp.gate_proj.weight": torch.randn(96, H), p + "mlp.up_proj.weight": torch.randn(96, H),
              p + "mlp.down_proj.weight": torch.randn(H, 96)}
    (tmp_path / "llama").mkdir()
    save_file(t, tmp_path / "llama" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "llama" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "float32"}))
    _refused(capsys, [str(tmp_path / "llama"), str(tmp_path / "o"), "--to", "hf", "--quantize", "mxfp4"],
             "--quantize mxfp4: LlamaForCausalLM stores no stacked [in, out] weights", tmp_path / "o")


def test_the_header_lists_blocks_then_scales_of_each_stacked_tensor(folders):
    root, *_ = folders
    header = _header(root / "mx" / "model.safetensors")
    a, b = (header[f"model.layers.0.mlp.experts.{STACKED[0]}{s}"] for s in ("_blocks", "_scales"))
    assert a["dtype"] == b["dtype"] == "U8" and a["data_offsets"][1] == b["data_offsets"][0]


# --- the seam: a quantization method is a codec registered, not a branch ----------------------------

class _RowScaled(LazyTensor):
    """``q * scale`` per row, any box."""

    def __init__(self, q, scale):
        self.q, self.scale, self.shape, self.dtype = q, scale, tuple(q.shape), torch.float32

    def read_box(self, offsets, sizes, out=None):
        (r, c), (m, n) = offsets, sizes
        got = self.q.read_box((r, c), (m, n)).float() * self.scale.read_box((r,), (m,)).unsqueeze(1)
        return got if out is None else out.copy_(got)


class _ToyCodec(ReleaseCodec):
    """A method of the tests' own: ``X_q`` int8 and ``X_row_scale`` float32 per row."""

    method = "toy-int8-rows"
    title = "the tests' int8 rows"

    def settings(self, config, where):
        return None

    def dequantized(self, tensors, settings, dtype, where):
        out = {k: v for k, v in tensors.items() if not k.endswith(("_q", "_row_scale"))}
        for k in tensors:
            if k.endswith("_q"):
                base = k.removesuffix("_q")
                out[base] = _RowScaled(tensors[k], tensors[base + "_row_scale"])
        return out

    def summary(self, settings):
        return {"method": self.method}

    def encoded(self, key, dtype):
        return key.endswith("_q")


def test_a_quantization_method_is_one_registered_codec(tmp_path, capsys):
    """A folder whose ``lm_head.weight`` is stored by a method of the tests' own is refused by
    name until its codec is registered, then read dequantized; nothing in reshard changes."""
    tensors = {k: v.float() for k, v in _bf16_folder(tmp_path / "src").items()}
    head = tensors.pop("lm_head.weight")
    scale = head.abs().amax(1) / 127
    q = torch.round(head / scale.unsqueeze(1)).to(torch.int8)
    tensors |= {"lm_head.weight_q": q, "lm_head.weight_row_scale": scale}
    (tmp_path / "toy").mkdir()
    save_file(tensors, tmp_path / "toy" / "model.safetensors", metadata={"format": "pt"})
    config = {**CONFIG, "dtype": "float32", "quantization_config": {"quant_method": _ToyCodec.method}}
    (tmp_path / "toy" / "config.json").write_text(json.dumps(config))
    _refused(capsys, [str(tmp_path / "toy"), str(tmp_path / "o"), "--to", "hf"],
             "holds quant_method 'toy-int8-rows', which reshard does not read", tmp_path / "o")
    register_release_codec(_ToyCodec())
    try:
        register_hf_architecture(StackedMoe)
        try:
            assert _run(str(tmp_path / "toy"), str(tmp_path / "o"), "--to", "hf") == 0
        finally:
            unregister_hf_architecture(StackedMoe.name)
    finally:
        unregister_release_codec(_ToyCodec.method)
    got = _read(tmp_path / "o")
    assert torch.equal(got["lm_head.weight"], q.float() * scale.unsqueeze(1))
    assert torch.equal(got["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
