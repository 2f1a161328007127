"""A Hugging Face architecture added in one module (``tests/plugin_phi3.py``, registered here, nothing of
reshard edited): Phi-3 as transformers makes it, imported to megatron-core at TP 2 — megatron-core's
forward gives transformers' logits — and exported back tensor for tensor, bit for bit, into a folder
transformers loads to the same logits. A Phi-3 import that misreads the fused QKV changes the logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_fixtures import TOKENS, mcore_forward, needs_mcore
from plugin_phi3 import Phi3, PhiQKV
from reshard.cli import main
from reshard.core.lazy import RowConcat
from reshard.models.hf_registry import register_hf_architecture, registry, unregister_hf_architecture

pytestmark = needs_mcore
TOL = 2e-5
CONFIG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "rope_theta": 50000.0,
          "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(folder: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def _misread_qkv(self, names, parts, facts):
    """The plausible wrong import: Phi-3's rows taken in megatron-core's order (no regrouping)."""
    return RowConcat([(parts[0], 0, parts[0].shape[0])])


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("phi3")
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(**CONFIG, initializer_range=0.1))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))  # distinct from ones: a misplaced norm must show
    model.eval()
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        want = model(torch.tensor([TOKENS])).logits[0]
    register_hf_architecture(Phi3)
    try:
        assert main(["run", "--direct", str(root / "hf"), str(root / "tp2"), "--target-tp", "2"]) == 0
        assert main(["run", "--direct", str(root / "tp2"), str(root / "back"), "--to", "hf",
                     "--hf-architecture", "Phi3ForCausalLM"]) == 0
        assert main(["run", "--direct", str(root / "tp2"), str(root / "fp8"), "--to", "hf", "--hf-architecture",
                     "Phi3ForCausalLM", "--quantize", "fp8", "--fp8-block", "16", "--max-shard-size", "40KB"]) == 0
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PhiQKV, "gather", _misread_qkv)
            assert main(["run", "--direct", str(root / "hf"), str(root / "wrong"), "--target-tp", "2"]) == 0
    finally:
        unregister_hf_architecture(Phi3.name)
    got, wrong = mcore_forward([(None, root / "tp2", 2), (None, root / "wrong", 2)], root / "forward")
    return {"root": root, "want": want, "got": got, "wrong": wrong}


def test_megatron_core_runs_the_phi3_import_with_transformers_logits(phi3):
    diff = (phi3["got"][:, :phi3["want"].shape[1]] - phi3["want"]).abs().max().item()
    assert diff < TOL, f"logits differ by {diff:.2e}"


def test_a_phi3_import_that_misreads_the_fused_qkv_changes_the_logits(phi3):
    assert (phi3["wrong"][:, :phi3["want"].shape[1]] - phi3["want"]).abs().max().item() > 1e-3


def test_the_export_gives_back_every_phi3_tensor_bit_for_bit(phi3):
    root = phi3["root"]
    want, got = _tensors(root / "hf"), _tensors(root / "back")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    config = json.loads((root / "back" / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["model_type"] == "phi3"
    assert torch.equal(_logits(root / "back"), _logits(root / "hf"))


def test_a_plugins_linear_rows_are_written_in_fp8(phi3):
    """The plug-in marks its fused rows linear: they are encoded like every built-in linear weight."""
    from test_fp8_export import block_reference

    plain, fp8 = _tensors(phi3["root"] / "back"), _tensors(phi3["root"] / "fp8")
    linear = sorted(k for k in plain if k.endswith(("qkv_proj.weight", "gate_up_proj.weight", "o_proj.weight",
                                                      "down_proj.weight")))
    assert sorted(fp8) == sorted([*plain, *(k + "_scale_inv" for k in linear)])
    for key in linear:
        q, s = block_reference(plain[key], (16, 16))
        assert torch.equal(fp8[key].view(torch.uint8), q.view(torch.uint8)) and torch.equal(fp8[key + "_scale_inv"], s)


def test_the_plugin_was_unregistered_after_use(phi3):
    assert Phi3.name not in registry


def test_an_architecture_that_is_not_registered_is_refused_in_one_line(phi3, tmp_path, capsys):
    capsys.readouterr()
    assert main(["run", "--direct", str(phi3["root"] / "hf"), str(tmp_path / "o"), "--target-tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "architecture ['Phi3ForCausalLM'] is not imported" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
