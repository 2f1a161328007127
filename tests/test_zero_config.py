"""ZeRO config validation: reshard's verdicts and normalized values against DeepSpeed's own.

DeepSpeed is a required test dependency: its ``DeepSpeedZeroConfig`` / ``get_zero_config`` are
the reference. Every table row states the expected verdict too, so a row where both sides
fail for the same wrong reason (a typo in the test) cannot pass silently.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DSZenFlowConfig
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
from pydantic import ValidationError

from reshard.core.errors import ConfigError, LayoutError
from reshard.core.zero_config import (
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZenFlowConfig,
    ZeroDecision,
    ZeroOptimizationConfig,
    ZeroPartitionedCheckpointError,
    decide_conversion,
    load_deepspeed_config_text,
    run_validate_config,
    validate_deepspeed_config,
    validate_zero_section,
)

DEPRECATED = {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
              "stage3_gather_fp16_weights_on_model_save"}
DS_ERRORS = (ValidationError, AssertionError, TypeError, ValueError)


def ds_reference(config: dict, whole: bool) -> dict | None:
    """DeepSpeed's normalized section (deprecated leftovers dropped), or None when it rejects."""
    try:
        model = get_zero_config(config) if whole else DeepSpeedZeroConfig(**config)
    except DS_ERRORS:
        return None
    return {k: v for k, v in model.model_dump(mode="json").items() if k not in DEPRECATED}


def ours(config: dict, whole: bool) -> dict | None:
    try:
        result = validate_deepspeed_config(config) if whole else validate_zero_section(config)
    except ConfigError as err:
        assert err.problems, "a ConfigError must list its problems"
        return None
    return result.normalized


# (id, zero_optimization section, expected valid?)
SECTIONS = [
    ("empty", {}, True),
    ("stage0", {"stage": 0}, True),
    ("stage1", {"stage": 1, "reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8}, True),
    ("stage2-typical", {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                        "allgather_partitions": True, "round_robin_gradients": True}, True),
    ("stage3-typical", {"stage": 3, "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
                        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                        "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9}, True),
    ("stage3-overlap-default", {"stage": 3}, True),
    ("overlap-explicit-null", {"stage": 3, "overlap_comm": None}, True),
    ("bare-names", {"stage": 3, "prefetch_bucket_size": 1000, "max_live_parameters": 7,
                    "gather_16bit_weights_on_model_save": True, "module_granularity_threshold": 5}, True),
    ("alias-and-bare", {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}, False),
    ("alias-and-bare-auto", {"prefetch_bucket_size": "auto", "stage3_prefetch_bucket_size": 2}, True),
    ("auto-values", {"stage": "auto", "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                     "overlap_comm": "auto", "offload_optimizer": "auto"}, True),
    ("auto-nested", {"stage": 3,
                     "offload_optimizer": {"device": "cpu", "ratio": "auto", "buffer_count": "auto"}}, True),
    ("float-int", {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5.0e8, "sub_group_size": 1e18}, True),
    ("float-int-fraction", {"reduce_bucket_size": 5.5}, False),
    ("int-from-string", {"reduce_bucket_size": "500"}, True),
    ("int-sci-string", {"reduce_bucket_size": "5e8"}, False),
    ("int-too-big", {"sub_group_size": 1e20}, False),
    ("int-inf", {"sub_group_size": float("inf")}, False),
    ("negative-ge0", {"allgather_bucket_size": -1}, False),
    ("reduce-bucket-zero", {"reduce_bucket_size": 0}, False),
    ("allgather-zero-ok", {"allgather_bucket_size": 0, "zero_hpz_partition_size": 0}, True),
    ("negative-hpz", {"zero_hpz_partition_size": -1}, False),
    ("negative-granularity-ok", {"stage3_module_granularity_threshold": -5}, True),
    ("bad-stage-4", {"stage": 4}, False),
    ("bad-stage-neg", {"stage": -1}, False),
    ("bad-stage-frac", {"stage": 1.5}, False),
    ("stage-as-string", {"stage": "3"}, True),
    ("stage-as-float", {"stage": 2.0}, True),
    ("bool-strings", {"overlap_comm": "yes", "contiguous_gradients": "off", "legacy_stage1": 1}, True),
    ("bool-bad", {"overlap_comm": 2}, False),
    ("unknown-key", {"stage": 2, "stag": 3}, False),
    ("unknown-nested", {"offload_optimizer": {"device": "cpu", "devise": "cpu"}}, False),
    ("removed-mics", {"mics_shard_size": 8}, False),
    ("removed-loco", {"zeropp_loco_param": {"err_beta": 0.8}}, False),
    ("dep-cpu-offload", {"stage": 2, "cpu_offload": True}, True),
    ("dep-cpu-offload-false", {"stage": 2, "cpu_offload": False}, True),
    ("dep-cpu-offload-string", {"cpu_offload": "yes"}, True),
    ("dep-cpu-offload-bad", {"cpu_offload": 5}, False),
    ("dep-cpu-offload-param", {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}, True),
    ("dep-fp16-gather", {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}, True),
    ("dep-fp16-gather-null", {"stage3_gather_fp16_weights_on_model_save": None}, False),
    ("dep-and-new", {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, False),
    ("dep-null-and-new", {"cpu_offload": None, "offload_optimizer": {}}, False),
    ("dep-and-new-auto", {"cpu_offload": True, "offload_optimizer": "auto"}, True),
    ("dep-param-and-new", {"cpu_offload_param": False, "offload_param": {"device": "cpu"}}, False),
    ("dep-fp16-and-alias", {"stage3_gather_fp16_weights_on_model_save": True,
                            "stage3_gather_16bit_weights_on_model_save": False}, False),
    ("ratio-partial-stage3", {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}, True),
    ("ratio-partial-stage2", {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}, False),
    ("ratio-zero-stage0", {"offload_optimizer": {"ratio": 0}}, False),
    ("ratio-too-big", {"stage": 3, "offload_optimizer": {"ratio": 1.5}}, False),
    ("ratio-nan", {"stage": 3, "offload_optimizer": {"ratio": float("nan")}}, False),
    ("offload-nvme", {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 6,
                                                    "buffer_size": 1e8, "max_in_cpu": 1e9, "pin_memory": False},
                      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pipeline_read": True,
                                            "fast_init": True, "super_offload": True, "cpuadam_cores_perc": 0.5}},
     True),
    ("offload-bad-device", {"offload_optimizer": {"device": "gpu"}}, False),
    ("offload-bad-path", {"offload_param": {"nvme_path": 5}}, False),
    ("offload-not-object", {"offload_optimizer": 5}, False),
    ("offload-negative-buffers", {"offload_param": {"buffer_count": -1, "buffer_size": -2}}, False),
    ("offload-null", {"offload_optimizer": None, "offload_param": None}, True),
    ("compute-grad-norm-stage2", {"stage": 2, "compute_grad_norm": False}, True),
    ("compute-grad-norm-stage3", {"stage": 3, "compute_grad_norm": False}, False),
    ("zenflow-ok", {"stage": 2, "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 10,
                                            "update_interval": 4, "full_warm_up_rounds": 2.0}}, True),
    ("zenflow-bad", {"zenflow": {"topk_ratio": 1.0, "select_interval": "x", "update_interval": 0}}, False),
    ("zenflow-bool-interval", {"zenflow": {"update_interval": True}}, True),
    ("leaf-module-string", {"leaf_module": {"classes": "my.Block", "names": ["a", "a", "auto"]}}, True),
    ("leaf-module-null", {"leaf_module": None}, True),
    ("leaf-module-bad", {"leaf_module": "x"}, False),
    ("all-flags", {"stage": 3, "use_multi_rank_bucket_allreduce": False, "load_from_fp32_weights": False,
                   "elastic_checkpoint": True, "ignore_unused_parameters": False, "parameter_alignment": True,
                   "zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True,
                   "zero_quantized_gradients": True, "memory_efficient_linear": False,
                   "pipeline_loading_checkpoint": True, "override_module_apply": False,
                   "log_trace_cache_warnings": True, "enable_sanity_checks": True,
                   "save_muon_momentum_buffer_in_memory": True, "stage3_use_all_reduce_for_fetch_params": True,
                   "stage3_allgather_sequential": True, "stage3_model_persistence_threshold": 10}, True),
    ("many-problems", {"stage": 9, "reduce_bucket_size": -1, "bogus": 1, "offload_optimizer": {"ratio": 7}}, False),
]

# (id, whole DeepSpeed config, expected valid?) — compared with get_zero_config
WHOLE = [
    ("no-zero-key", {"train_batch_size": 8}, True),
    ("legacy-true", {"zero_optimization": True}, True),
    ("legacy-true-allgather", {"zero_optimization": True, "allgather_size": 3e3}, True),
    ("legacy-true-allgather-auto", {"zero_optimization": True, "allgather_size": "auto"}, True),
    ("legacy-true-allgather-frac", {"zero_optimization": True, "allgather_size": 5.5}, False),
    ("legacy-false-ignores-allgather", {"zero_optimization": False, "allgather_size": -1}, True),
    ("zero-null", {"zero_optimization": None}, False),
    ("zero-number", {"zero_optimization": 1}, False),
    ("whole-stage2", {"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": True}}, True),
]


@pytest.mark.parametrize("config,expected", [pytest.param(c, e, id=i) for i, c, e in SECTIONS])
def test_section_matches_deepspeed(config: dict, expected: bool) -> None:
    reference = ds_reference(config, whole=False)
    mine = ours(config, whole=False)
    assert (reference is not None) == expected, "DeepSpeed's verdict is not the one this row expects"
    assert (mine is not None) == expected, "reshard's verdict differs from DeepSpeed's"
    if expected:
        assert mine == reference


@pytest.mark.parametrize("config,expected", [pytest.param(c, e, id=i) for i, c, e in WHOLE])
def test_whole_config_matches_get_zero_config(config: dict, expected: bool) -> None:
    reference = ds_reference(config, whole=True)
    mine = ours(config, whole=True)
    assert (reference is not None) == expected
    assert (mine is not None) == expected
    if expected:
        assert mine == reference


def test_table_is_big_and_mixed() -> None:
    assert len(SECTIONS) + len(WHOLE) >= 30
    verdicts = [e for _, _, e in SECTIONS + WHOLE]
    assert verdicts.count(True) >= 10 and verdicts.count(False) >= 10


@pytest.mark.parametrize("ours_cls,ds_cls", [
    (ZeroOptimizationConfig, DeepSpeedZeroConfig),
    (OffloadParamConfig, DeepSpeedZeroOffloadParamConfig),
    (OffloadOptimizerConfig, DeepSpeedZeroOffloadOptimizerConfig),
    (ZenFlowConfig, DSZenFlowConfig),
    (LeafModuleConfig, DeepSpeedZeroLeafModuleConfig),
])
def test_fields_aliases_and_defaults_match_deepspeed(ours_cls, ds_cls) -> None:
    ds_fields = {n: f for n, f in ds_cls.model_fields.items() if n not in DEPRECATED}
    assert list(ours_cls.model_fields) == list(ds_fields)
    for name, info in ds_fields.items():
        mine = ours_cls.model_fields[name]
        assert mine.alias == info.alias, name
        mine_default = mine.get_default(call_default_factory=True)
        ds_default = info.get_default(call_default_factory=True)
        if hasattr(ds_default, "model_dump"):
            mine_default, ds_default = mine_default.model_dump(), ds_default.model_dump()
        assert mine_default == ds_default, name
        assert sorted(map(repr, mine.metadata)) == sorted(map(repr, info.metadata)), name


def test_normalized_has_every_field_and_no_deprecated_key() -> None:
    normalized = validate_zero_section({"stage": 3, "cpu_offload": True}).normalized
    assert set(normalized) == set(DeepSpeedZeroConfig.model_fields) - DEPRECATED
    assert normalized["offload_optimizer"]["device"] == "cpu"


# ----------------------------------------------------------------- message quality


def problems_of(section, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_zero_section(section, **kwargs)
    return info.value


def test_all_problems_reported_at_once_with_paths_values_and_allowed() -> None:
    err = problems_of({"stage": 9, "reduce_bucket_size": 5.5, "stag": 3, "cpu_offload": True,
                       "offload_optimizer": {"device": "gpu", "ratio": 0.5}})
    joined = "\n".join(err.problems)
    assert len(err.problems) == 5, joined
    for expected in ("zero_optimization.stage = 9", "one of 0, 1, 2, 3",
                     "zero_optimization.reduce_bucket_size = 5.5", "whole number",
                     "zero_optimization.stag = 3", "zero_optimization.cpu_offload",
                     'zero_optimization.offload_optimizer.device = "gpu"', '"none", "cpu", "nvme"'):
        assert expected in joined, expected
    assert str(err).startswith("5 problems in zero_optimization: ")
    assert all(p in str(err) for p in err.problems)
    assert "\n" not in str(err)


def test_cross_field_rule_reported_alongside_field_errors() -> None:
    err = problems_of({"stage": 2, "reduce_bucket_size": -1, "offload_optimizer": {"ratio": 0.25}})
    assert len(err.problems) == 2
    ratio = [p for p in err.problems if p.startswith("zero_optimization.offload_optimizer.ratio = 0.25")]
    assert ratio and "stage 3" in ratio[0] and "stage is 2" in ratio[0]


@pytest.mark.parametrize("section,bad,suggested", [
    ({"stage3_prefetch_bucket_sise": 1}, "zero_optimization.stage3_prefetch_bucket_sise",
     "stage3_prefetch_bucket_size"),
    ({"overlap_com": True}, "zero_optimization.overlap_com", "overlap_comm"),
    ({"Stage": 2}, "zero_optimization.Stage", "stage"),
    ({"offload_optimizer": {"devise": "cpu"}}, "zero_optimization.offload_optimizer.devise", "device"),
    ({"offload_param": {"max_in_cpus": 1}}, "zero_optimization.offload_param.max_in_cpus", "max_in_cpu"),
])
def test_misspelt_key_suggests_closest_name(section: dict, bad: str, suggested: str) -> None:
    err = problems_of(section)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(bad)
    assert f"did you mean '{suggested}'" in err.problems[0]


def test_alias_and_bare_name_together_is_one_clear_problem() -> None:
    err = problems_of({"max_live_parameters": 1, "stage3_max_live_parameters": 2})
    assert len(err.problems) == 1
    assert "zero_optimization.max_live_parameters" in err.problems[0]
    assert "zero_optimization.stage3_max_live_parameters" in err.problems[0]


def test_deprecated_and_replacement_together() -> None:
    err = problems_of({"stage3_gather_fp16_weights_on_model_save": True, "gather_16bit_weights_on_model_save": True})
    assert len(err.problems) == 1 and "zero_optimization.stage3_gather_fp16_weights_on_model_save" in err.problems[0]
    assert "zero_optimization.gather_16bit_weights_on_model_save" in err.problems[0]


def test_deprecations_are_reported_and_migrated() -> None:
    result = validate_zero_section({"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": False})
    assert result.normalized["offload_optimizer"]["device"] == "cpu"
    assert len(result.deprecations) == 2
    assert any("cpu_offload is deprecated" in d and "offload_optimizer" in d for d in result.deprecations)
    assert result.model.offload_optimizer is not None and result.stage == 2


def test_legacy_boolean_warns_and_maps_allgather_size() -> None:
    result = validate_deepspeed_config({"zero_optimization": True, "allgather_size": 1234})
    assert result.stage == 1 and result.normalized["allgather_bucket_size"] == 1234
    assert any("boolean form" in d for d in result.deprecations)
    with pytest.raises(ConfigError) as info:
        validate_deepspeed_config({"zero_optimization": True, "allgather_size": -5})
    assert info.value.problems[0].startswith("allgather_size = -5")


def test_removed_key_explains_removal() -> None:
    err = problems_of({"mics_shard_size": 4, "mics_hierarchical_params_gather": True})
    assert len(err.problems) == 2 and all("removed from DeepSpeed" in p for p in err.problems)


def test_custom_path_prefix_is_used() -> None:
    err = problems_of({"stage": 7}, path="target.zero_optimization")
    assert err.problems[0].startswith("target.zero_optimization.stage = 7")


def test_model_used_directly_migrates_and_checks() -> None:
    with pytest.warns(UserWarning, match="cpu_offload"):
        model = ZeroOptimizationConfig.model_validate({"cpu_offload": True})
    assert model.offload_optimizer is not None and model.offload_optimizer.device == "cpu"
    with pytest.raises(ValidationError, match="stage 3"):
        ZeroOptimizationConfig.model_validate({"stage": 1, "offload_optimizer": {"ratio": 0.5}})


def test_misspelt_section_name_warns() -> None:
    result = validate_deepspeed_config({"zero_optimisation": {"stage": 3}})
    assert result.stage == 0
    assert any("did you mean 'zero_optimization'" in w for w in result.warnings)


# ----------------------------------------------------------------- JSON loading


def test_duplicate_json_keys_rejected_with_paths() -> None:
    text = '{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", ' \
           '"device": "nvme"}, "stage": 3}}'
    with pytest.raises(ValueError):  # DeepSpeed's own loader rejects it as well
        json.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    with pytest.raises(ConfigError) as info:
        load_deepspeed_config_text(text, "cfg.json")
    err = info.value
    assert err.culprit == "cfg.json"
    assert set(err.problems) == {
        "zero_optimization.offload_optimizer.device: key appears more than once (DeepSpeed rejects duplicate keys)",
        "zero_optimization.stage: key appears more than once (DeepSpeed rejects duplicate keys)",
    }


def test_json_loading_plain_and_errors() -> None:
    loaded = load_deepspeed_config_text('{"a": [{"b": 1}], "zero_optimization": {"stage": 1}}', "x")
    assert loaded == {"a": [{"b": 1}], "zero_optimization": {"stage": 1}} and type(loaded) is dict
    assert type(loaded["a"][0]) is dict
    with pytest.raises(ConfigError, match="line 1"):
        load_deepspeed_config_text('{"stage": 1,}', "x")
    with pytest.raises(ConfigError, match="JSON object"):
        load_deepspeed_config_text("[1, 2]", "x")
    with pytest.raises(ConfigError, match=r"\[1\]\.k"):
        load_deepspeed_config_text('{"l": [{}, {"k": 1, "k": 2}]}', "x")


# ----------------------------------------------------------------- CLI helper


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return str(path)


def test_run_validate_config_text_output(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, json.dumps({"train_batch_size": 16, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "reduce_bucket_size": "auto"}}))
    assert run_validate_config(path, as_json=False) == 0
    out = capsys.readouterr().out
    assert f"{path}: valid ZeRO config (stage 2)" in out
    assert "deprecated: zero_optimization.cpu_offload is deprecated" in out
    assert "  reduce_bucket_size: 500000000" in out


def test_run_validate_config_json_output_matches_deepspeed(tmp_path: Path, capsys) -> None:
    config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7,
                                    "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}
    path = write(tmp_path, json.dumps(config))
    assert run_validate_config(path, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True and report["stage"] == 3 and report["deprecations"] == []
    assert report["zero_optimization"] == ds_reference(config, whole=True)


def test_run_validate_config_invalid_raises(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5},
                                                             "overlap_comm": "sometimes"}}))
    with pytest.raises(ConfigError) as info:
        run_validate_config(path, as_json=True)
    assert info.value.culprit == path and info.value.exit_code == 2 and len(info.value.problems) == 2
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="cannot read"):
        run_validate_config(str(tmp_path / "missing.json"), as_json=False)
    dup = write(tmp_path, '{"zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        run_validate_config(dup, as_json=False)


# ----------------------------------------------------------------- pipeline decision


@pytest.mark.parametrize("ds_config,stage", [
    (None, 0),
    ({}, 0),
    ({"train_batch_size": 8}, 0),
    ({"zero_optimization": {"stage": 0}}, 0),
    ({"zero_optimization": {"stage": 1}}, 1),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 2),
    ({"zero_optimization": True}, 1),
    ({"stage": 2}, 2),  # a bare ZeRO section
    ({"zero_optimization": {"stage": "auto"}}, 0),
])
def test_decide_conversion_allows_stage_0_to_2(ds_config, stage: int) -> None:
    decision = decide_conversion(ds_config)
    assert isinstance(decision, ZeroDecision)
    assert decision.source_stage == stage and not decision.verify_full_tensors and decision.target is None


def test_decide_conversion_refuses_zero3() -> None:
    with pytest.raises(ZeroPartitionedCheckpointError) as info:
        decide_conversion({"train_batch_size": 8, "zero_optimization": {"stage": 3}})
    err = info.value
    assert isinstance(err, LayoutError) and err.exit_code == 2
    text = str(err)
    for needle in ("placeholders", "zero_pp_rank_", "zero_to_fp32.py", "gather_16bit_weights_on_model_save=true"):
        assert needle in text, needle


@pytest.mark.parametrize("key", ["gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save"])
def test_decide_conversion_allows_zero3_gathered(key: str) -> None:
    decision = decide_conversion({"zero_optimization": {"stage": 3, key: True}})
    assert decision.source_stage == 3 and decision.source_gathered_16bit and decision.verify_full_tensors
    with pytest.raises(ZeroPartitionedCheckpointError):
        decide_conversion({"zero_optimization": {"stage": 3, key: False}})


def test_decide_conversion_source_is_lenient_but_not_about_stage() -> None:
    decision = decide_conversion({"zero_optimization": {"stage": 2, "mics_shard_size": 4}})
    assert decision.source_stage == 2 and any("mics_shard_size" in n for n in decision.notes)
    with pytest.raises(ConfigError, match="stage"):
        decide_conversion({"zero_optimization": {"stage": "three"}})
    with pytest.raises(ConfigError):
        decide_conversion("ds_config.json")  # type: ignore[arg-type]


def test_decide_conversion_target_config() -> None:
    decision = decide_conversion({"zero_optimization": {"stage": 1}},
                                 {"train_batch_size": 4, "zero_optimization": {"stage": 2, "overlap_comm": False}})
    assert decision.target_stage == 2 and decision.target.normalized["overlap_comm"] is False
    with pytest.raises(ConfigError) as info:
        decide_conversion({"zero_optimization": {"stage": 2}},
                          {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert info.value.problems[0].startswith("zero_optimization.offload_optimizer.ratio = 0.5")
    with pytest.raises(ConfigError, match="did you mean 'stage'"):
        decide_conversion(None, {"zero_optimization": {"stge": 2}})
    with pytest.raises(ConfigError, match="zero_pp_rank"):
        decide_conversion(None, {"zero_optimization": {"stage": 3}})
    assert decide_conversion(None, {"stage": 3}, allow_zero3_target=True).target_stage == 3
    assert decide_conversion(None, {"zero_optimization": True}).target_stage == 1


def test_source_refusal_happens_before_target_check() -> None:
    with pytest.raises(ZeroPartitionedCheckpointError):
        decide_conversion({"zero_optimization": {"stage": 3}}, {"zero_optimization": {"stage": 9}})


def test_module_is_pure() -> None:
    code = ("import sys, reshard.core.zero_config; "
            "print(sorted(m for m in ('deepspeed', 'fsspec', 'prefect', 'torch') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
