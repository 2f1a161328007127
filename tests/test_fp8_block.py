"""The FP8 block-scaled codec (reshard.core.fp8_block), bit for bit against DeepSeek's formula
written out block by block here, partial edge blocks in both dimensions included, and the wrong
answers a converter could plausibly give (a transposed scale grid, floor instead of ceil at the
edges, a missing scale, another quantization scheme) caught."""

from __future__ import annotations

import math

import pytest
import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.fp8_block import (
    E4M3,
    E4M3_MAX,
    Fp8BlockDequantized,
    check_scale,
    dequantize,
    quantization_config,
    quantize,
    quantize_chunks,
    read_quantization_config,
    scale_shape,
)

#: (weight shape, block): whole blocks, partial edges in rows, columns and both.
CASES = [((256, 256), (128, 128)), ((192, 96), (128, 128)), ((320, 256), (128, 128)), ((300, 200), (64, 48)),
         ((7, 5), (4, 3))]


def _stored(shape: tuple[int, int], block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight with varied magnitudes and its float32 scales, as a checkpoint holds them."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    s = torch.rand(scale_shape(shape, block), generator=g) * 1e-2 + 1e-4
    return q, s


def deepseek_reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's ``weight_dequant``, block by block: the float32 product, then one cast."""
    out = torch.empty(q.shape, dtype=dtype)
    b0, b1 = block
    for i in range(math.ceil(q.shape[0] / b0)):
        for j in range(math.ceil(q.shape[1] / b1)):
            blk = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            out[blk] = (q[blk].to(torch.float32) * s[i, j]).to(dtype)
    return out


@pytest.mark.parametrize("shape,block", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_deepseeks_formula_bit_for_bit(shape, block, dtype):
    q, s = _stored(shape, block)
    assert torch.equal(dequantize(q, s, block, dtype), deepseek_reference(q, s, block, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_e4m3_code_dequantizes_as_the_formula_nan_and_signed_zero_included(dtype):
    """All 256 codes (NaN at 0x7F and 0xFF, -0, subnormals) under scales that round each product
    differently in each block, into a fresh tensor and into a box of a larger buffer."""
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3)
    q = torch.stack([codes.roll(k) for k in range(6)])  # [6, 256]: each block row sees every code
    block = (4, 100)
    s = torch.tensor([[1.0, 3.7e-3, 0.3], [2.0 ** -20, 1e-7, 123.456]])
    want = deepseek_reference(q, s, block, dtype)
    got = dequantize(q, s, block, dtype)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 12
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))  # -0.0 stays -0.0, NaNs as DeepSeek's
    wider = torch.zeros(6, 300, dtype=dtype)
    Fp8BlockDequantized(q, s, block, dtype).read_box((0, 0), (6, 256), out=wider[:, 20:276])
    assert torch.equal(wider[:, 20:276].view(bits), want.view(bits)) and not wider[:, :20].any()


@pytest.mark.parametrize("shape,block", CASES)
def test_any_box_of_a_lazy_fp8_weight_is_that_box_of_the_whole(shape, block):
    q, s = _stored(shape, block, seed=1)
    whole = deepseek_reference(q, s, block, torch.bfloat16)
    lazy = Fp8BlockDequantized(q, s, block)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        r0, c0 = (int(torch.randint(0, d, (1,), generator=g)) for d in shape)
        m = int(torch.randint(1, shape[0] - r0 + 1, (1,), generator=g))
        n = int(torch.randint(1, shape[1] - c0 + 1, (1,), generator=g))
        assert torch.equal(lazy.read_box((r0, c0), (m, n)), whole[r0:r0 + m, c0:c0 + n])
    assert torch.equal(lazy.materialize(), whole)
    assert torch.equal(lazy.read(0, 3, 2), whole[3:5])


def test_a_mapped_fp8_weight_decodes_whole_rows_where_they_lie_and_gives_their_pages_back(tmp_path, monkeypatch):
    """From a mapped safetensors file: every box is that box of the whole; a box of whole rows is
    decoded from the mapping itself (no copy of the codes first) and released once decoded, any
    other box copied out of it."""
    from safetensors.torch import save_file

    from reshard.core import safetensors_read
    from reshard.core.safetensors_read import MappedSafetensors

    shape, block = (300, 200), (64, 48)
    q, s = _stored(shape, block, seed=4)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "m.safetensors"))
    file = MappedSafetensors(tmp_path / "m.safetensors")
    lazy = Fp8BlockDequantized(file.tensor("w"), file.tensor("w_scale_inv"), block)
    whole = deepseek_reference(q, s, block, torch.bfloat16)
    released, copied = [], []
    monkeypatch.setattr(MappedSafetensors, "release", lambda self, t: released.append((t.data_ptr(), t.numel())))
    read_box = safetensors_read.SafeTensor.read_box
    def recorded_read_box(self, o, z, out=None):
        copied.append((self.entry.name, o, z))
        return read_box(self, o, z, out)

    monkeypatch.setattr(safetensors_read.SafeTensor, "read_box", recorded_read_box)
    rows = file.tensor("w").view_box((70, 0), (100, 200))
    assert torch.equal(lazy.read_box((70, 0), (100, 200)), whole[70:170])
    assert (rows.data_ptr(), rows.numel()) in released and all(name != "w" for name, *_ in copied)
    assert torch.equal(lazy.read_box((70, 30), (100, 50)), whole[70:170, 30:80])
    assert ("w", (70, 30), (100, 50)) in copied
    assert torch.equal(lazy.materialize(), whole)


def test_a_transposed_or_floor_edged_scale_grid_is_refused_and_would_change_the_weights():
    q, s = _stored((192, 96), (128, 128))
    good = (192, 96), E4M3, tuple(s.shape), torch.float32, (128, 128), "model.safetensors"
    check_scale("w.weight", *good)
    with pytest.raises(CheckpointFormatError, match=r"w.weight_scale_inv has shape \[1, 2\], not \[2, 1\]"):
        check_scale("w.weight", (192, 96), E4M3, (1, 2), torch.float32, (128, 128), "f")  # transposed
    with pytest.raises(CheckpointFormatError, match=r"not \[2, 1\]"):
        check_scale("w.weight", (192, 96), E4M3, (1, 0), torch.float32, (128, 128), "f")  # floor at the edges
    with pytest.raises(CheckpointFormatError, match="w.weight_scale_inv is missing"):
        check_scale("w.weight", (192, 96), E4M3, None, None, (128, 128), "f")
    with pytest.raises(CheckpointFormatError, match="not float32"):
        check_scale("w.weight", (192, 96), E4M3, (2, 1), torch.bfloat16, (128, 128), "f")
    # where the grid is square a transposed scale has the right shape: only the values tell
    q, s = _stored((256, 256), (128, 128))
    assert not torch.equal(dequantize(q, s.T.contiguous(), (128, 128)), dequantize(q, s, (128, 128)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,block", CASES)
def test_quantize_takes_block_amax_over_448_and_rounds_within_e4m3s_bound(shape, block, dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
    w[: min(block[0], shape[0]), : min(block[1], shape[1])] = 0  # an all-zero block stays zero
    q, s = quantize(w, block)
    assert q.dtype == E4M3 and tuple(s.shape) == scale_shape(shape, block) and s.dtype == torch.float32
    b0, b1 = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            amax = w[blk].float().abs().max()
            want = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            assert s[i, j] == want
            want_q = (w[blk].float() / want).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            assert torch.equal(q[blk].view(torch.uint8), want_q.view(torch.uint8))  # the sign of zero too
    back = dequantize(q, s, block, torch.float32)
    per = s.repeat_interleave(b0, 0)[: shape[0]].repeat_interleave(b1, 1)[:, : shape[1]]
    # e4m3 keeps 3 mantissa bits (relative error <= 2**-4); below 2**-6 it is subnormal (step 2**-9)
    bound = torch.maximum(w.float().abs() * 2.0 ** -4, per * 2.0 ** -10)
    assert bool(((back - w.float()).abs() <= bound).all())
    assert not back[: min(b0, shape[0]), : min(b1, shape[1])].any()


@pytest.mark.parametrize("workers", [2, 3, 5])
@pytest.mark.parametrize("shape,block", CASES + [((1030, 70), (128, 32))])
def test_quantize_shared_among_workers_writes_the_same_bytes_and_reports_the_first_bad_band(shape, block, workers):
    """Bands shared among threads (each its own run of block rows and its own buffers) give the
    one-thread bytes, with fewer bands than workers and a partial last band too; a weight bad in
    two workers' bands is refused naming the first in row order."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(torch.bfloat16)
    q1, s1 = quantize(w, block)
    q, s = quantize(w, block, workers=workers)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    if shape[0] > block[0]:
        w[-1, 0] = float("nan")
        w[block[0], 1] = float("inf")  # the second band: an earlier one than the last
        first = f"rows {block[0]}..{min(2 * block[0], shape[0]) - 1} hold a NaN or an infinity"
        with pytest.raises(ValueError, match=first):
            quantize(w, block, workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("shape,block,chunk_rows", [((1030, 70), (128, 32), 256), ((1030, 70), (128, 32), 128),
                                                    ((1030, 70), (128, 32), 2048), ((7, 5), (4, 3), 4),
                                                    ((300, 200), (64, 48), 192)])
def test_quantized_chunks_are_the_whole_weights_codes_and_name_the_bad_rows_of_the_whole(shape, block, chunk_rows,
                                                                                        workers):
    """Chunks of whole block rows, yielded in row order as they are made, are the whole weight's
    codes; the scales are complete after the last; a bad row is named by its row in the weight, not in
    its chunk; a chunk that would cut a block row, or scales of another shape, are refused."""
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(torch.bfloat16)
    q1, s1 = quantize(w, block)
    s = torch.full(s1.shape, float("nan"))
    got = list(quantize_chunks(w, s, block, chunk_rows=chunk_rows, workers=workers))
    assert [r for r, _ in got] == list(range(0, shape[0], chunk_rows))
    assert all(q.shape[0] == min(chunk_rows, shape[0] - r) for r, q in got)
    assert torch.equal(torch.cat([q for _, q in got]).view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s, s1)
    w[-1, 2] = float("nan")
    last = (shape[0] - 1) // block[0] * block[0]
    with pytest.raises(ValueError, match=f"rows {last}..{shape[0] - 1} hold a NaN"):
        list(quantize_chunks(w, s, block, chunk_rows=chunk_rows, workers=workers))
    with pytest.raises(ValueError, match="not a positive multiple of the block's"):
        list(quantize_chunks(w, s, block, chunk_rows=block[0] + 1))
    with pytest.raises(ValueError, match="scales are"):
        list(quantize_chunks(w, s[:-1], block, chunk_rows=chunk_rows))  # a block row short


def test_band_workers_are_two_on_a_one_thread_cpu_and_one_where_torchs_pool_or_a_device_works(monkeypatch):
    from reshard.core import band_threads
    from reshard.core.band_threads import band_workers

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(band_threads, "usable_cores", lambda: 2)
        torch.set_num_threads(1)
        assert band_workers() == band_workers(torch.device("cpu")) == 2 and band_workers(torch.device("cuda")) == 1
        torch.set_num_threads(3)
        assert band_workers() == 1
        monkeypatch.setattr(band_threads, "usable_cores", lambda: 1)  # one core: a second thread only waits its turn
        torch.set_num_threads(1)
        assert band_workers() == 1
    finally:
        torch.set_num_threads(before)


def test_quantize_divides_only_by_tensors_so_a_gpu_writes_the_cpus_bytes():
    """CUDA computes ``x / 448.0`` (a Python number as divisor) as ``x * (1 / 448)``, which is off by
    one bit for about half the scales (seen on an H100: 506 of 896 blocks of one expert weight, and
    the codes at rounding ties with them); a tensor divisor gets the correctly rounded quotient on
    every device. A CPU computes both exactly, so the test looks at what the quantizer asks torch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    divisors = []

    class Divisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_):
                divisors.append(args[1])
            return func(*args, **(kwargs or {}))

    w = (torch.randn(300, 200, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    with Divisions():
        q, s = quantize(w, (128, 128))
    assert divisors, "the quantizer divides (the scale, then the weight by it)"
    assert all(isinstance(d, torch.Tensor) and d.dim() >= 1 for d in divisors), \
        [type(d).__name__ if not isinstance(d, torch.Tensor) else f"{d.dim()}-D tensor" for d in divisors]
    amax = torch.tensor([[w[i:i + 128, j:j + 128].float().abs().max() for j in (0, 128)] for i in (0, 128, 256)])
    assert torch.equal(s, (amax.double() / E4M3_MAX).float())  # the correctly rounded quotient
    assert not torch.equal(s, amax * (1 / E4M3_MAX))  # what the reciprocal gives on these weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_refuses_what_fp8_cannot_scale_and_keeps_tiny_blocks_finite(dtype):
    for bad in (float("nan"), float("inf"), -float("inf")):  # the maxima are taken on the bits: both signs
        w = torch.zeros(4, 8, dtype=dtype)
        w[2, 5] = bad
        with pytest.raises(ValueError, match="rows 0..3 hold a NaN or an infinity"):
            quantize(w, (4, 4))
    with pytest.raises(ValueError, match="takes a floating-point weight, not torch.int16"):
        quantize(torch.ones(4, 8, dtype=torch.int16), (4, 4))  # integer bits are no magnitudes to scale
    tiny = torch.full((4, 4), 1e-43)  # amax / 448 underflows to 0 in float32: scale 1, values 0, no NaN
    q, s = quantize(tiny, (4, 4))
    assert s.item() == 1.0 and not dequantize(q, s, (4, 4), torch.float32).isnan().any()


def test_a_subnormal_scale_is_clamped_before_the_cast_and_a_normal_one_needs_no_clamp():
    """The quantizer clamps only a band whose scale is subnormal. There the scale keeps few bits and
    ``W / S`` can pass e4m3's range: a block whose largest magnitude is 1523 of float32's smallest
    subnormals gets the scale 3 of them (1523 / 448 = 3.4 rounds to 3), and 1523 / 3 = 507.7, above
    464, where the cast rounds no value to 448 (torch 2.13's CPU cast saturates, others give NaN),
    so the clamp must come first. With a normal scale the quotient stays within
    ``448 * (1 + 2**-23)`` and a clamp could change no code: none is asked for. The test looks at
    the clamps the quantizer asks torch for, as this torch's cast would hide a missing one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    clamps = []

    class Clamps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clamp, torch.ops.aten.clamp_):
                clamps.append(args[1:])
            return func(*args, **(kwargs or {}))

    ulp = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # float32's smallest subnormal
    w = torch.zeros(8, 8)
    w[:4, :4] = torch.tensor([1523.0, -700.0, 3.0, 0.0]) * ulp  # band 0: one block with a subnormal scale
    w[:, 4:] = torch.randn(8, 4, generator=torch.Generator().manual_seed(11))
    w[4:, :4] = torch.randn(4, 4, generator=torch.Generator().manual_seed(12))  # band 1: normal scales
    with Clamps():
        q, s = quantize(w, (4, 4))
    assert s[0, 0] == 3 * ulp and bool((s.view(-1)[1:] >= torch.finfo(torch.float32).tiny).all())
    per = s.repeat_interleave(4, 0).repeat_interleave(4, 1)
    assert (w / per)[0, 0] > 464
    assert clamps == [(-E4M3_MAX, E4M3_MAX)], "exactly one clamp: band 0's"
    want = (w / per).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_weights_quantize_as_the_formula(dtype):
    """Blocks of subnormal and near-subnormal weights (scales subnormal, or 1 where amax / 448
    underflows) against the formula, clamp included."""
    g = torch.Generator().manual_seed(12)
    for magnitude in (1e-36, 1e-39, 1e-41, 1e-43):
        w = (torch.randn(256, 192, generator=g, dtype=torch.float64) * magnitude).to(dtype)
        q, s = quantize(w, (128, 64))
        per = s.repeat_interleave(128, 0).repeat_interleave(64, 1)
        want = (w.float() / per).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), magnitude


def test_quantization_config_reads_fp8_and_refuses_every_other_scheme_by_name():
    assert read_quantization_config({}, "config.json") is None
    qc = quantization_config((128, 64))
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}
    assert read_quantization_config({"quantization_config": qc}, "config.json") == (128, 64)
    for method in ("gptq", "awq", "mxfp4", "compressed-tensors"):
        with pytest.raises(CheckpointFormatError, match=f"quant_method '{method}'"):
            read_quantization_config({"quantization_config": {"quant_method": method}}, "config.json")
    with pytest.raises(CheckpointFormatError, match="weight_block_size"):  # per-tensor FP8
        read_quantization_config({"quantization_config": {"quant_method": "fp8"}}, "config.json")
    with pytest.raises(CheckpointFormatError, match="fmt"):
        read_quantization_config({"quantization_config": dict(qc, fmt="e5m2")}, "config.json")
    # MiniMax-M2's release names the format by its dtype
    assert read_quantization_config({"quantization_config": dict(qc, fmt="float8_e4m3fn")}, "config.json") == (128, 64)
