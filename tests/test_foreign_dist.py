"""torch_dist written by other tools: mbridge and Megatron-Bridge save megatron-core's
``dist_checkpointing`` with no Megatron-LM ``args`` in ``common.pt`` (here: megatron-core 0.16.1's
own ``dist_checkpointing.save`` of ``GPTModel.sharded_state_dict()``, as they call it). The model
facts come from the model's Hugging Face ``config.json`` (``--model-config``, made here by
transformers), Megatron-Bridge's ``run_config.yaml`` in the iteration folder, or flags; every
output is checked by megatron-core's strict load or transformers with the source's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_fixtures import mcore_checkpoints, mcore_foreign_dist_checkpoints, needs_mcore
from reshard.cli import main

pytestmark = needs_mcore
TOL = 2e-5
ITER = "iter_0000007"


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    return mcore_foreign_dist_checkpoints(tmp_path_factory.mktemp("foreign_dist"))


def _llama_config(folder: Path, **change) -> Path:
    """The ``config.json`` transformers writes for the harness's "llama" model."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    LlamaConfig(**{**kw, **change}).save_pretrained(folder)
    return folder / "config.json"


def _hf_logits(folder: Path) -> torch.Tensor:
    from test_hf_export import hf_logits

    return hf_logits(folder)


def _one_line(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_without_saved_args_the_missing_facts_are_named_with_the_ways_to_give_them(foreign, tmp_path, capsys):
    src = foreign[("llama", 2)]
    line = _one_line(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "2"])
    assert "--num-heads" in line and "--model-config" in line, line
    line = _one_line(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--to", "hf", "--num-heads", "8",
                              "--num-query-groups", "2", "--swiglu"])
    assert "--normalization" in line and "--model-config" in line, line  # was: "LayerNorm with a SwiGLU MLP"
    assert not (tmp_path / "o").exists()


def test_model_config_gives_megatron_core_and_transformers_the_sources_logits(foreign, tmp_path):
    """``--model-config config.json``: a torch_dist whose ``common.pt`` args rebuild the model in
    megatron-core (``dist_checkpointing.load`` at TP 1 and 2, the model made from those args
    alone), per-rank files whose args export to Hugging Face with no further fact, and a Hugging
    Face export transformers runs."""
    from mcore_fixtures import mcore_forward_dist

    src, cfg = foreign[("llama", 2)], _llama_config(tmp_path / "cfg")
    want = torch.load(src / "logits.pt")
    assert main(["run", "--direct", str(src), str(tmp_path / "dist"), "--to", "torch_dist",
                 "--model-config", str(cfg)]) == 0
    got = mcore_forward_dist([(None, tmp_path / "dist", 1), (None, tmp_path / "dist", 2)], tmp_path / "fwd")
    for tp, logits in zip((1, 2), got):
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0, msg=f"megatron-core at TP {tp}, from its args")
    assert main(["run", "--direct", str(src), str(tmp_path / "tp2"), "--target-tp", "2",
                 "--model-config", str(cfg)]) == 0
    assert main(["run", "--direct", str(tmp_path / "tp2"), str(tmp_path / "hf2"), "--to", "hf"]) == 0
    torch.testing.assert_close(_hf_logits(tmp_path / "hf2"), want, atol=TOL, rtol=0)
    assert main(["run", "--direct", str(src), str(tmp_path / "hf"), "--to", "hf", "--model-config", str(cfg)]) == 0
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, atol=TOL, rtol=0)


def test_megatron_bridges_common_state_in_the_index_without_args_reads(foreign, tmp_path):
    """Megatron-Bridge on megatron-core 0.19 keeps its common state (checkpoint_version, iteration,
    content_metadata; no args) as the index's ``common_state/shard_0_1`` item, not in common.pt
    (refused before: "1 parameter(s) match no rule: common_state")."""
    from mcore019 import as_019_dist, load_019_common_state

    src = as_019_dist(foreign[("llama", 2)], tmp_path / "v019", content_metadata={"singleton_local_shards": False})
    assert sorted(load_019_common_state(src / ITER)) == ["checkpoint_version", "content_metadata", "iteration"]
    assert main(["run", "--direct", str(src), str(tmp_path / "hf"), "--to", "hf", "--model-config",
                 str(_llama_config(tmp_path / "cfg"))]) == 0
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), torch.load(src / "logits.pt"), atol=TOL, rtol=0)


def test_a_megatron_bridge_run_config_beside_the_checkpoint_is_read(foreign, tmp_path):
    """Megatron-Bridge's ``run_config.yaml`` (its ``model`` section: megatron-core's field names)
    in the iteration folder supplies the facts with no flag; a wrong one changes the answer."""
    import yaml

    src = Path(shutil.copytree(foreign[("llama", 2)], tmp_path / "bridge"))
    model = {"_target_": "megatron.bridge.models.llama.llama_provider.LlamaModelProvider", "num_layers": 2,
             "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 8, "num_query_groups": 2,
             "kv_channels": 8, "normalization": "RMSNorm", "layernorm_epsilon": 1e-5, "gated_linear_unit": True,
             "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
             "add_bias_linear": False, "add_qkv_bias": False, "position_embedding_type": "rope",
             "rotary_base": 10000, "rotary_percent": 1.0, "share_embeddings_and_output_weights": False,
             "vocab_size": 128, "make_vocab_size_divisible_by": 32, "seq_length": 16,
             "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    (src / ITER / "run_config.yaml").write_text(yaml.safe_dump({"_target_": "megatron.bridge.training.config."
                                                                            "ConfigContainer", "model": model,
                                                                "train": {"train_iters": 7}}))
    assert main(["run", "--direct", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    want = torch.load(src / "logits.pt")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, atol=TOL, rtol=0)
    model["rotary_base"] = 500000  # a plausible wrong fact is not silently harmless
    (src / ITER / "run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    assert main(["run", "--direct", str(src), str(tmp_path / "wrong"), "--to", "hf"]) == 0
    assert (_hf_logits(tmp_path / "wrong") - want).abs().max() > 10 * TOL  # the comparison above catches it


def test_a_megatron_bridge_run_config_gives_the_sliding_window(foreign, tmp_path):
    """Megatron-Bridge's ``window_size`` (a list in its YAML) is megatron-core's: a windowed model without
    args exports as Mistral with its window and transformers gives megatron-core's logits; the same
    run_config without the window exports Llama, whose logits differ (the window is no detail)."""
    import yaml

    src = Path(shutil.copytree(foreign[("mistral", 2)], tmp_path / "bridge"))
    model = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 8,
             "num_query_groups": 2, "kv_channels": 8, "normalization": "RMSNorm", "layernorm_epsilon": 1e-5,
             "gated_linear_unit": True, "add_bias_linear": False, "add_qkv_bias": False,
             "position_embedding_type": "rope", "rotary_base": 10000, "rotary_percent": 1.0,
             "share_embeddings_and_output_weights": False, "vocab_size": 128, "make_vocab_size_divisible_by": 32,
             "seq_length": 16, "window_size": [3, 0], "window_attn_skip_freq": None}
    (src / ITER / "run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    assert main(["run", "--direct", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 4)
    want = torch.load(src / "logits.pt")
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), want, atol=TOL, rtol=0)
    del model["window_size"]
    (src / ITER / "run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    assert main(["run", "--direct", str(src), str(tmp_path / "llama"), "--to", "hf"]) == 0
    assert (_hf_logits(tmp_path / "llama") - want).abs().max() > 10 * TOL


def test_flags_alone_give_every_fact_an_export_needs(foreign, tmp_path):
    src = foreign[("llama", 2)]
    assert main(["run", "--direct", str(src), str(tmp_path / "hf"), "--to", "hf", "--num-heads", "8",
                 "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--rotary-base", "10000", "--norm-epsilon", "1e-5"]) == 0
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), torch.load(src / "logits.pt"), atol=TOL, rtol=0)


def test_a_model_config_that_contradicts_the_saved_args_is_refused(tmp_path, capsys):
    """Given facts fill in what the saved args lack, never override them."""
    src = mcore_checkpoints(tmp_path / "m")[("llama", 2, 1)]
    cfg = _llama_config(tmp_path / "cfg", num_key_value_heads=4)
    line = _one_line(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1",
                              "--model-config", str(cfg)])
    assert "num_query_groups=4 from --model-config contradicts the checkpoint's saved args (2)" in line, line
    line = _one_line(capsys, ["run", "--direct", str(src), str(tmp_path / "o"), "--to", "hf",
                              "--normalization", "LayerNorm"])
    assert "normalization='LayerNorm' from the flags contradicts the checkpoint's saved args ('RMSNorm')" in line, line
    assert main(["run", "--direct", str(src), str(tmp_path / "ok"), "--target-tp", "1", "--model-config",
                 str(_llama_config(tmp_path / "same"))]) == 0


def test_a_model_config_that_is_no_config_is_one_line(foreign, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    line = _one_line(capsys, ["run", "--direct", str(foreign[("mha", 2)]), str(tmp_path / "o"), "--to", "hf",
                              "--model-config", str(tmp_path / "bad.json")])
    assert line == f"reshard: error: {tmp_path / 'bad.json'}: is not valid JSON (fix: --model-config takes a " \
                   "Hugging Face config.json)"
