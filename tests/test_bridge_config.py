"""A ``--to torch_dist`` output is an iteration folder Megatron-LM and Megatron-Bridge both load: an
``iter_`` folder (Megatron-Bridge's ``load_megatron_model`` finds no other), ``args`` saying it holds
no optimizer or RNG state (so Megatron-LM's torch_dist loader reads the weights alone, with no flag),
and Megatron-Bridge's ``run_config.yaml`` of the model (without one Megatron-Bridge 0.6 loads no
Megatron-LM checkpoint). The ``run_config.yaml`` is checked against the one Megatron-Bridge itself wrote
importing the same Hugging Face model (the real-tool fixtures); that both tools load these outputs is
``make check-realtools`` (side environment)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from reshard import api
from reshard.core.safe_load import load_shard

REALTOOLS = Path(__file__).resolve().parent / "fixtures" / "realtools"
BRIDGE = REALTOOLS / "megatron-bridge-0.6.2"
MLM = REALTOOLS / "megatron-core-0.19.2"

#: Fields reshard writes otherwise than Megatron-Bridge's import, and why: the layer spec (megatron-core's
#: whole-decoder spec, the local or Transformer Engine one as the names are, for every model: Bridge's
#: ``local_layer_spec`` builds the same dense layers); Megatron-Bridge's DeepSeek-V3 recipe settings that
#: change no weight (its vocabulary divisor 1280, unused with ``should_pad_vocab`` off, reshard's being
#: Megatron-LM's; its training loss ``seq_aux_loss``, reshard's import recording none).
OURS = {"transformer_layer_spec", "make_vocab_size_divisible_by", "moe_router_load_balancing_type"}


@pytest.mark.parametrize("model", ["llama", "deepseek-v3"])
def test_a_torch_dist_import_is_an_iteration_folder_with_megatron_bridges_run_config(model, tmp_path):
    api.convert(str(BRIDGE / model / "hf"), str(tmp_path / "out"), to="torch_dist")
    it = tmp_path / "out" / "iter_0000000"
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert not (tmp_path / "out" / "release").exists()
    assert {"__0_0.distcp", ".metadata", "common.pt", "metadata.json", "run_config.yaml", "tokenizer"} <= \
        {p.name for p in it.iterdir()}
    args = load_shard(it / "common.pt", mmap=False)["args"]
    assert (args.no_save_optim, args.no_save_rng) == (True, True)
    ours = yaml.safe_load((it / "run_config.yaml").read_text())["model"]
    theirs = yaml.safe_load((BRIDGE / model / "checkpoint" / "iter_0000000" / "run_config.yaml").read_text())
    theirs = theirs["model"]
    differ = {f: (v, theirs.get(f, "<absent>")) for f, v in ours.items()
              if f not in OURS and theirs.get(f, "<absent>") != v}
    assert not differ, f"(reshard's, Megatron-Bridge's): {differ}"
    spec = ours["transformer_layer_spec"]
    assert (spec["_target_"].rsplit(".", 1)[-1], spec["use_transformer_engine"]) == \
        ("get_gpt_decoder_block_spec", False)


def test_a_torch_dist_output_keeps_its_sources_iteration(tmp_path):
    api.convert(str(MLM / "llama-tp2-torch" / "checkpoint"), str(tmp_path / "out"), to="torch_dist")
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "20"
    model = yaml.safe_load((tmp_path / "out" / "iter_0000020" / "run_config.yaml").read_text())["model"]
    assert (model["_target_"], model["num_layers"], model["num_query_groups"], model["vocab_size"]) == \
        ("megatron.bridge.models.gpt_provider.GPTModelProvider", 2, 2, 128)  # 100 tokens padded at TP 1
