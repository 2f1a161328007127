"""Bit-exact equality with DeepSpeed's own MegatronSDLoader (the independent reference)."""

from __future__ import annotations

import logging

import pytest
import torch
from deepspeed.runtime.state_dict_factory import SDLoaderFactory
from deepspeed.runtime.weight_quantizer import WeightQuantization
from deepspeed.utils import logger as ds_logger

from conftest import rank_files
from reshard.core.quantize import QUANT_KEY
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions

ds_logger.setLevel(logging.WARNING)

RATIOS = [(8, 1), (8, 2), (8, 4), (2, 8), (1, 4)]
DROPPED = {"optimizer", "lr_scheduler", "random_rng_state"}


def _ds_load(src, m, t, version, **kw):
    loader = SDLoaderFactory.get_sd_loader(rank_files(src), None, "Megatron", version)
    return loader, loader.load(m, t, **kw)


def _assert_module_equal(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype, k
        assert ours[k].shape == theirs[k].shape, k
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.parametrize("n,m", RATIOS, ids=[f"{n}to{m}" for n, m in RATIOS])
@pytest.mark.parametrize("version", [0, 1.0, 2.0])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_matches_megatron_sd_loader(sample_factory, tmp_path, n, m, version, dtype):
    src = sample_factory(n, version, dtype)
    run_direct(str(src), str(tmp_path / "out"), ReshardOptions(target_tp=m))
    for t in range(m):
        _, (_, ds_sd, _) = _ds_load(src, m, t, None)
        ours = torch.load(tmp_path / "out" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)
        _assert_module_equal(ours["module"], ds_sd["module"])
        # non-module entries come from the first source rank of the group, mp_world_size updated
        assert ours["mp_world_size"] == m
        assert set(ds_sd) - set(ours) == DROPPED
        for k in set(ours) - {"module", "mp_world_size", "args"}:
            assert ours[k] == ds_sd[k], k
        assert ours["args"].tensor_model_parallel_size == m


def test_output_tensors_own_their_storage(sample_factory, tmp_path):
    src = sample_factory(1, 2.0)
    run_direct(str(src), str(tmp_path / "out"), ReshardOptions(target_tp=4))
    sd = torch.load(tmp_path / "out" / "mp_rank_01_model_states.pt", weights_only=False)["module"]
    for k, v in sd.items():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
    # file is ~1/4 of the source plus replicated tensors, not the whole source again
    size = (tmp_path / "out" / "mp_rank_01_model_states.pt").stat().st_size
    assert size < 0.5 * (src / "mp_rank_00_model_states.pt").stat().st_size


@pytest.mark.parametrize("n,m", [(8, 2), (8, 1), (4, 2), (8, 8)], ids=["8to2", "8to1", "4to2", "8to8"])
@pytest.mark.parametrize("version", [1.0, 2.0])
@pytest.mark.parametrize("extra", [True, False], ids=["mlpx2", "nomlpx2"])
def test_quantized_merge_matches_deepspeed(sample_factory, tmp_path, n, m, version, extra):
    src = sample_factory(n, version, "fp16")
    opts = ReshardOptions(target_tp=m, quantize=True, bits=8, groups=4, mlp_extra_grouping=extra)
    run_direct(str(src), str(tmp_path / "out"), opts)
    for t in range(m):
        _, (_, ds_sd, (ds_scales, merge_count)) = _ds_load(
            src, m, t, None, quantize=True, quantize_bits=8, quantize_groups=4, mlp_extra_grouping=extra)
        ours = torch.load(tmp_path / "out" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)
        _assert_module_equal(ours["module"], ds_sd["module"])
        q = ours[QUANT_KEY]
        assert q["scales"].dtype == ds_scales.dtype
        assert q["scales"].shape == ds_scales.shape
        assert torch.equal(q["scales"], ds_scales)
        assert q["merge_count"] == merge_count
        assert (q["bits"], q["groups"], q["mlp_extra_grouping"]) == (8, 4, extra)


def test_quantized_merge_version0_regroups_qkv(sample_factory, tmp_path):
    """DeepSpeed's quantized merge concatenates version-0 QKV without regrouping (wrong rows);
    reshard regroups. Reference: DeepSpeed's own quantizer + its own version-0 regroup."""
    src = sample_factory(8, 0)
    run_direct(str(src), str(tmp_path / "out"),
               ReshardOptions(target_tp=2, quantize=True, groups=4))
    for t in range(2):
        loader, (_, ds_sd, (ds_scales, _)) = _ds_load(src, 2, t, None, quantize=True, quantize_groups=4)
        ours = torch.load(tmp_path / "out" / f"mp_rank_{t:02d}_model_states.pt", weights_only=False)
        srcs = [torch.load(f, weights_only=False)["module"] for f in rank_files(src)[4 * t: 4 * t + 4]]
        for k in ours["module"]:
            if "query_key_value" in k:
                vals = [s[k] for s in srcs]
                if k.endswith("weight"):
                    vals = WeightQuantization(mp_size=2).Quantize(vals, 8, 4, key=k)
                expected = loader.merge_query_key_value(vals, 0)
                assert torch.equal(ours["module"][k], expected), k
                assert not torch.equal(ours["module"][k], ds_sd["module"][k]), "DeepSpeed's bug is visible"
            else:
                assert torch.equal(ours["module"][k], ds_sd["module"][k]), k
        assert torch.equal(ours[QUANT_KEY]["scales"], ds_scales)
