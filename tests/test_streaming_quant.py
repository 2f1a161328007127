"""The engine's cache-blocked quantizer equals reshard's vectorized reference and DeepSpeed's
``WeightQuantization.quantize_data`` bit for bit (int8 values and scales), including the edges."""

from __future__ import annotations

import logging

import pytest
import torch
from deepspeed.runtime.weight_quantizer import WeightQuantization
from deepspeed.utils import logger as ds_logger

from reshard.core import quantize_blocked
from reshard.core.errors import LayoutError
from reshard.core.quantize import quantize_groups
from reshard.core.quantize_blocked import quantize_groups_blocked

ds_logger.setLevel(logging.WARNING)

CASES = [((64, 48), 4), ((96, 32), 8), ((3, 5, 8), 5), ((1024,), 1), ((256, 64), 256), ((7, 9), 3)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("block", [64, 1 << 20], ids=["one_group_per_block", "many_groups_per_block"])
def test_blocked_equals_reference_and_deepspeed(monkeypatch, dtype, bits, block):
    monkeypatch.setattr(quantize_blocked, "BLOCK_BYTES", block)
    g = torch.Generator().manual_seed(bits)
    ds = WeightQuantization()
    for shape, groups in CASES:
        x = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
        x.view(-1)[0] = 0.3  # a clear maximum, and a group of exact zeros
        x.view(groups, -1)[-1] = 0
        q, s = quantize_groups_blocked(x, bits, groups)
        q_ref, s_ref = quantize_groups(x, bits, groups)
        assert q.dtype == torch.int8 and q.shape == x.shape
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (shape, groups)
        q_ds, s_ds = ds.quantize_data(x, bits, groups)
        assert torch.equal(q, q_ds) and torch.equal(s, s_ds.reshape(-1)), (shape, groups)


def test_other_inputs_take_the_reference_path_with_its_errors():
    x64 = torch.randn(8, 4, dtype=torch.float64)
    assert torch.equal(quantize_groups_blocked(x64, 8, 2)[0], quantize_groups(x64, 8, 2)[0])
    with pytest.raises(LayoutError, match="equal groups"):
        quantize_groups_blocked(torch.randn(10), 8, 3)
    with pytest.raises(LayoutError, match="does not fit int8"):
        quantize_groups_blocked(torch.randn(8), 9, 2)
