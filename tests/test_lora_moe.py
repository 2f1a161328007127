"""LoRA adapters on a mixture-of-experts base (issue #59): Megatron-Bridge's PEFT checkpoints of a
Qwen3-MoE -> Hugging Face PEFT adapters (``--to hf-peft``) and merged models (``--merge-adapter``).

The sources are adapters Megatron-Bridge 0.6.2 itself applied and saved on a CPU
(``tests/fixtures/realtools/megatron-bridge-0.6.2/qwen3-moe-lora*``, written by
``tests/realtools/write_fixtures.py``): its default ``LoRA`` targets wrap the attention's
``linear_qkv``/``linear_proj`` and, with ``SequentialMLP`` experts, every routed expert's
``linear_fc1``/``linear_fc2`` (one adapter per expert; the router is no default target and
Qwen3-MoE has no shared expert). At TP 1 the model (and so the adapters) is bf16; at EP 2 (two gloo
ranks, two experts each) and at TP 2 x EP 2 (four) it is float32, and each rank's experts (and, at
TP 2, shards) were drawn apart, so an expert read under another number shows. Beside each lies
Megatron-Bridge's own ``export_adapter_ckpt`` of it (run in one process: it loads the torch_dist
checkpoint at TP 1 / EP 1), which writes the adapters as bf16.

The reference is megatron-core's forward of the base plus the adapters, recorded by the run that
saved them (``logits.pt``'s ``megatron_logits``), as in ``tests/test_lora.py``. transformers 5 holds
Qwen3-MoE's experts as fused 3-D parameters (``mlp.experts.gate_up_proj``, ``down_proj``); the
adapter names each expert's modules as the Hugging Face checkpoint does (``mlp.experts.{e}.gate_proj``)
and peft 0.21.2 converts them on load (its transformers-v5 weight conversion: A of gate and up
concatenated, B block-diagonal, rank and alpha doubled), as it does Megatron-Bridge's own export.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.cli import main

peft = pytest.importorskip("peft", reason="dev extra: the adapters are checked by loading them in peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

BRIDGE = Path(__file__).resolve().parent / "fixtures" / "realtools" / "megatron-bridge-0.6.2"
BASE = BRIDGE / "qwen3-moe"
LORA = {"tp1": BRIDGE / "qwen3-moe-lora", "ep2": BRIDGE / "qwen3-moe-lora-ep2",
        "tp2-ep2": BRIDGE / "qwen3-moe-lora-tp2-ep2"}
#: logits of a float32 forward against megatron-core's float32 one: the same weights, other kernels
TOL = 1e-5
#: a merged bf16 model's logits against megatron-core's forward of bf16 base + unmerged adapters
MERGED_BF16_TOL = 0.05
LAYERS, EXPERTS = 2, 4


def _peft_model(adapter: Path) -> Any:
    """transformers' base in float32 with ``adapter`` loaded by peft at its default strictness; a
    warning of missing or unexpected adapter keys fails (peft warns, it does not raise)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE / "hf"), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    bad = [str(w.message) for w in caught if re.search(r"missing|unexpected", str(w.message), re.I)]
    assert not bad, bad
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, src in LORA.items():
        dst = tmp_path_factory.mktemp("hf-peft-moe") / name
        assert main(["run", str(src / "checkpoint"), str(dst), "--to", "hf-peft"]) == 0
        out[name] = dst
    return out


def test_hf_peft_names_every_experts_modules(exported: dict[str, Path]) -> None:
    """One A and one B per expert and projection, named as the Hugging Face checkpoint names the
    expert's weights; A shared by gate and up (Megatron-Bridge's fused ``linear_fc1`` adapter)."""
    ours = load_file(str(exported["ep2"] / "adapter_model.safetensors"))
    experts = {k for k in ours if ".mlp.experts." in k}
    want = {f"base_model.model.model.layers.{i}.mlp.experts.{e}.{m}.lora_{s}.weight"
            for i in range(LAYERS) for e in range(EXPERTS) for m in ("gate_proj", "up_proj", "down_proj")
            for s in "AB"}
    assert experts == want
    for i in range(LAYERS):
        for e in range(EXPERTS):
            p = f"base_model.model.model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(ours[p + "gate_proj.lora_A.weight"], ours[p + "up_proj.lora_A.weight"])
            assert ours[p + "gate_proj.lora_B.weight"].shape == (32, 4) and ours[p + "down_proj.lora_A.weight"].shape \
                == (4, 32)


@pytest.mark.parametrize("name", sorted(LORA))
def test_hf_peft_logits_equal_megatron_core(exported: dict[str, Path], name: str) -> None:
    """peft places every tensor reshard wrote on transformers' Qwen3-MoE, and the logits are
    megatron-core's forward of the base plus Megatron-Bridge's adapters (an expert under another
    number, gate and up swapped, or a wrong alpha scale breaks this)."""
    ref = torch.load(LORA[name] / "logits.pt", weights_only=True)
    model = _peft_model(exported[name])
    with torch.no_grad():
        logits = model(ref["tokens"][None]).logits[0].float()
    gap = (logits - ref["megatron_logits"][:, : logits.shape[-1]]).abs().max().item()
    assert gap < TOL, gap
    config = json.loads((exported[name] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4, 8, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])


@pytest.mark.parametrize("name", sorted(LORA))
def test_hf_peft_equals_bridge_export(exported: dict[str, Path], name: str) -> None:
    """Bit for bit what Megatron-Bridge's own export_adapter_ckpt wrote, after its cast to bf16,
    and the same config's rank, alpha and targets. At TP 1 the model is bf16 and Megatron-Bridge
    casts the adapters to it at build time, so reshard's are bf16 already and compared without a
    cast; the float32 adapters of EP 2 and TP 2 x EP 2 are compared cast to bf16, as Bridge writes them
    (reshard keeps them float32: the test below)."""
    ours = load_file(str(exported[name] / "adapter_model.safetensors"))
    bridge = load_file(str(LORA[name] / "hf_adapter" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(bridge) and {v.dtype for v in bridge.values()} == {torch.bfloat16}
    if name == "tp1":
        assert {v.dtype for v in ours.values()} == {torch.bfloat16}
    assert [k for k, v in bridge.items() if not torch.equal(ours[k].to(torch.bfloat16), v)] == []
    mine, theirs = (json.loads((d / "adapter_config.json").read_text())
                    for d in (exported[name], LORA[name] / "hf_adapter"))
    assert {k: mine[k] for k in ("r", "lora_alpha", "target_modules", "peft_type", "use_dora")} == \
        {k: theirs[k] for k in ("r", "lora_alpha", "target_modules", "peft_type", "use_dora")}


@pytest.mark.parametrize("name", ["ep2", "tp2-ep2"])
def test_hf_peft_keeps_float32_expert_adapters(exported: dict[str, Path], name: str) -> None:
    ours = load_file(str(exported[name] / "adapter_model.safetensors"))
    assert {v.dtype for v in ours.values()} == {torch.float32}


# -- --merge-adapter ---------------------------------------------------------------------------------
def _merge(base: Path, lora: Path, dst: Path, *extra: str) -> int:
    return main(["run", str(base), str(dst), "--merge-adapter", str(lora / "checkpoint"), "--direct", *extra])


def _state(folder: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """transformers' state dict of a Hugging Face folder (experts fused as transformers 5 holds them:
    a concatenation, so every value is the file's own bits)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def peft_merged(exported: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT's ``merge_and_unload`` on transformers' float32 base, cast once to the base's bf16 (of
    Megatron-Bridge's own export at TP 1; of reshard's float32 one on several ranks, which Bridge's
    bf16 export would round)."""
    out = {}
    for name in LORA:
        adapter = LORA[name] / "hf_adapter" if name == "tp1" else exported[name]
        merged = _peft_model(adapter).merge_and_unload()
        out[name] = {k: v.to(torch.bfloat16) for k, v in merged.state_dict().items()}
    return out


@pytest.mark.parametrize("name", sorted(LORA))
@pytest.mark.parametrize("base", ["hf", "torch_dist"])
def test_merge_adapter_equals_peft_merge_and_unload(peft_merged: dict[str, dict[str, torch.Tensor]],
                                                    tmp_path: Path, name: str, base: str) -> None:
    """Every weight of the merged Hugging Face output, each expert's included, is bit-equal to
    PEFT's float32 merge (both compute W + alpha / r * B A in float32 and cast once), from the Hugging
    Face base and from Megatron-Bridge's torch_dist import of it."""
    src = BASE / "hf" if base == "hf" else BASE / "checkpoint"
    assert _merge(src, LORA[name], tmp_path / "out", "--to", "hf") == 0
    got, want = _state(tmp_path / "out"), peft_merged[name]
    assert sorted(got) == sorted(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert not torch.equal(got["model.layers.1.mlp.experts.gate_up_proj"],
                           _state(BASE / "hf")["model.layers.1.mlp.experts.gate_up_proj"])
    if base == "hf":
        # independently of PEFT (whose reference at EP 2 is reshard's own export): the merged bf16
        # model's logits are megatron-core's within the merged weights' bf16 rounding (about 1e-2
        # here; the base without the adapters is over 1 away)
        ref = torch.load(LORA[name] / "logits.pt", weights_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
        with torch.no_grad():
            logits = model(ref["tokens"][None]).logits[0]
        assert (logits - ref["megatron_logits"][:, : logits.shape[-1]]).abs().max().item() < MERGED_BF16_TOL


def test_merge_adapter_into_megatron_core_tp2_ep2(tmp_path: Path) -> None:
    """Merged into megatron-core per-rank files at TP 2 x EP 2 (each rank's experts under their local
    numbers), then read back to Hugging Face: the same bytes as the merge written directly."""
    lora = LORA["tp2-ep2"]
    assert _merge(BASE / "hf", lora, tmp_path / "mc", "--target-tp", "2", "--target-ep", "2") == 0
    assert main(["run", str(tmp_path / "mc"), str(tmp_path / "back"), "--to", "hf", "--direct"]) == 0
    assert _merge(BASE / "hf", lora, tmp_path / "hf", "--to", "hf") == 0
    back, direct = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("back", "hf"))
    assert sorted(back) == sorted(direct) and [k for k in direct if not torch.equal(back[k], direct[k])] == []


def test_moe_adapter_on_a_dense_base_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The experts' adapters merged into the dense Llama: refused in one line, nothing written."""
    assert _merge(BRIDGE / "llama" / "hf", LORA["tp1"], tmp_path / "out", "--to", "hf") == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: ") and err.count("\n") == 1 and "does not hold" in err, err
    assert not (tmp_path / "out").exists()
