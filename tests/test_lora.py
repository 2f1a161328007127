"""LoRA adapters (issue #59): Megatron-Bridge's PEFT checkpoints -> Hugging Face PEFT adapters.

The sources are adapters Megatron-Bridge 0.6.2 itself trained-and-saved on a CPU
(``tests/fixtures/realtools/megatron-bridge-0.6.2/llama-lora*``, written by
``tests/realtools/write_fixtures.py``): at TP 1 (bf16 adapters, with Bridge's own Hugging Face export
beside it) and at TP 2 (float32 adapters on the bf16 model, each rank's shards drawn apart). The
reference is megatron-core's forward of the base plus the adapters, recorded by that run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.cli import main

peft = pytest.importorskip("peft", reason="dev extra: the adapters are checked by loading them in peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

BRIDGE = Path(__file__).resolve().parent / "fixtures" / "realtools" / "megatron-bridge-0.6.2"
BASE = BRIDGE / "llama" / "hf"
LORA = {"tp1": BRIDGE / "llama-lora", "tp2": BRIDGE / "llama-lora-tp2"}
#: logits of a float32 forward against megatron-core's float32 one: the same weights, other kernels
TOL = 1e-5


def _export(src: Path, dst: Path, *extra: str) -> int:
    return main(["run", str(src / "checkpoint"), str(dst), "--to", "hf-peft", *extra])


def _peft_logits(adapter: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """transformers' base in float32 with the adapter loaded by peft at its default strictness; the
    adapter's keys that peft did not place (none allowed)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    placed = set(peft.get_peft_model_state_dict(model))
    with torch.no_grad():
        return model(tokens[None]).logits[0].float(), placed


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, src in LORA.items():
        dst = tmp_path_factory.mktemp("hf-peft") / name
        assert _export(src, dst) == 0
        out[name] = dst
    return out


def test_the_iteration_folder_and_the_run_folder_export_alike(exported: dict[str, Path], tmp_path: Path) -> None:
    """Megatron-Bridge's run folder (``checkpoint/`` with ``latest_checkpointed_iteration.txt``) and
    the ``iter_*`` folder inside it are the same adapter checkpoint."""
    iteration = next((LORA["tp2"] / "checkpoint").glob("iter_*"))
    assert main(["run", str(iteration), str(tmp_path / "from-iter"), "--to", "hf-peft"]) == 0
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "from-iter" / name).read_bytes() == (exported["tp2"] / name).read_bytes(), name


@pytest.mark.parametrize("name", sorted(LORA))
def test_hf_peft_logits_equal_megatron_core(exported: dict[str, Path], name: str) -> None:
    """peft loads every tensor reshard wrote onto transformers' base, and the logits are megatron-core's
    forward of the base plus Megatron-Bridge's adapters (a wrong q/k/v split or alpha scale breaks this)."""
    ref = torch.load(LORA[name] / "logits.pt", weights_only=True)
    logits, placed = _peft_logits(exported[name], ref["tokens"])
    written = set(load_file(str(exported[name] / "adapter_model.safetensors")))
    assert written == {k.replace(".weight", ".default.weight") for k in placed} or written == placed
    gap = (logits - ref["megatron_logits"][:, : logits.shape[-1]]).abs().max().item()
    assert gap < TOL, gap


def test_hf_peft_config(exported: dict[str, Path]) -> None:
    config = json.loads((exported["tp1"] / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_dora"]) == ("LORA", 4, 8, False)
    assert isinstance(config["lora_alpha"], int)  # as Megatron-Bridge's export and LoraConfig write it
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"].endswith("llama/hf")


def test_hf_peft_equals_bridge_export_at_tp1(exported: dict[str, Path]) -> None:
    """The bf16 adapters: bit for bit what Megatron-Bridge's own export_adapter_ckpt wrote."""
    ours = load_file(str(exported["tp1"] / "adapter_model.safetensors"))
    bridge = load_file(str(LORA["tp1"] / "hf_adapter" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(bridge)
    for k, v in bridge.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


def test_hf_peft_keeps_float32_adapters(exported: dict[str, Path], tmp_path: Path) -> None:
    """float32 adapters stay float32; cast to bf16 (as Megatron-Bridge 0.6.2's export writes them)
    the logits move by far more than the tolerance."""
    ours = load_file(str(exported["tp2"] / "adapter_model.safetensors"))
    assert {v.dtype for v in ours.values()} == {torch.float32}
    from safetensors.torch import save_file

    shutil.copy(exported["tp2"] / "adapter_config.json", tmp_path / "adapter_config.json")
    save_file({k: v.to(torch.bfloat16) for k, v in ours.items()}, str(tmp_path / "adapter_model.safetensors"))
    ref = torch.load(LORA["tp2"] / "logits.pt", weights_only=True)
    logits, _ = _peft_logits(tmp_path, ref["tokens"])
    gap = (logits - ref["megatron_logits"][:, : logits.shape[-1]]).abs().max().item()
    assert gap > 10 * TOL, gap


def _copy_with_run_config(src: Path, dst: Path, edit: dict[str, Any], section: str = "peft") -> Path:
    """A copy of an adapter fixture whose run_config.yaml's ``section`` is edited."""
    import yaml

    shutil.copytree(src / "checkpoint", dst / "checkpoint")
    rc = next((dst / "checkpoint").glob("iter_*/run_config.yaml"))
    data = yaml.safe_load(rc.read_text())
    data[section].update(edit)
    rc.write_text(yaml.safe_dump(data))
    return dst


@pytest.mark.parametrize(("section", "edit", "words"), [
    ("peft", {"_target_": "megatron.bridge.peft.dora.DoRA"}, "DoRA"),
    ("peft", {"_target_": "megatron.bridge.peft.canonical_lora.CanonicalLoRA"}, "CanonicalLoRA"),
    ("peft", {"dim": 8}, "peft.dim is 8"),
    # a dense model's adapters under a MoE model's config: its MLP is experts, no linear_fc1 of its own
    ("model", {"num_moe_experts": 4}, "a model of its run_config.yaml does not hold"),
])
def test_hf_peft_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str, edit: dict[str, Any],
                          words: str) -> None:
    src = _copy_with_run_config(LORA["tp1"], tmp_path / "src", edit, section)
    assert _export(src, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_hf_peft_refuses_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _export(BRIDGE / "llama", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "no LoRA adapter's" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_formats_lists_hf_peft(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    assert any(line.split()[:2] == ["hf-peft", "writes"] for line in capsys.readouterr().out.splitlines())


# -- --merge-adapter ---------------------------------------------------------------------------------
def _peft_merged(adapter: Path) -> dict[str, torch.Tensor]:
    """PEFT's ``merge_and_unload`` of ``adapter`` on transformers' base in float32, cast once to the
    base's bf16: the weights a float32 merge gives."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def _merge(base: Path, lora: Path, dst: Path, *extra: str) -> int:
    return main(["run", str(base), str(dst), "--merge-adapter", str(lora / "checkpoint"), "--direct", *extra])


@pytest.mark.parametrize("name", sorted(LORA))
@pytest.mark.parametrize("base", ["hf", "torch_dist"])
def test_merge_adapter_equals_peft_merge_and_unload(exported: dict[str, Path], tmp_path: Path, name: str,
                                                    base: str) -> None:
    """Every weight of the merged Hugging Face output is bit-equal to PEFT's float32 merge (of
    Megatron-Bridge's own export at TP 1, of reshard's at TP 2), from the Hugging Face base and from
    Megatron-Bridge's torch_dist import of it; so are the logits."""
    src = BASE if base == "hf" else BRIDGE / "llama" / "checkpoint"
    assert _merge(src, LORA[name], tmp_path / "out", "--to", "hf") == 0
    adapter = LORA[name] / "hf_adapter" if name == "tp1" else exported[name]
    want = _peft_merged(adapter)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


def test_merge_adapter_into_megatron_core_tp2(tmp_path: Path) -> None:
    """Merged into megatron-core per-rank files at TP 2, then read back to Hugging Face: the same
    bytes as the merge written to Hugging Face directly."""
    assert _merge(BASE, LORA["tp2"], tmp_path / "tp2", "--target-tp", "2") == 0
    assert main(["run", str(tmp_path / "tp2"), str(tmp_path / "back"), "--to", "hf", "--direct"]) == 0
    assert _merge(BASE, LORA["tp2"], tmp_path / "hf", "--to", "hf") == 0
    back, direct = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("back", "hf"))
    assert sorted(back) == sorted(direct) and all(torch.equal(back[k], direct[k]) for k in direct)


@pytest.mark.parametrize("scheme", ["w4a16", "fp8-channel"])
def test_merge_adapter_then_quantize(tmp_path: Path, scheme: str) -> None:
    """``--quantize`` after the merge encodes the merged weights: the same files as quantizing the
    merged bf16 model in a second run, and codes that differ from quantizing the unmerged base (so
    the merge is not lost between the two)."""
    assert _merge(BASE, LORA["tp2"], tmp_path / "merged", "--to", "hf") == 0
    assert _merge(BASE, LORA["tp2"], tmp_path / "once", "--to", "hf", "--quantize", scheme) == 0
    for src, dst in ((tmp_path / "merged", "twice"), (BASE, "unmerged")):
        assert main(["run", str(src), str(tmp_path / dst), "--to", "hf", "--quantize", scheme, "--direct"]) == 0
    once, twice, unmerged = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("once", "twice", "unmerged"))
    assert sorted(once) == sorted(twice) and [k for k in once if not torch.equal(once[k], twice[k])] == []
    codes = [k for k in once if k.endswith((".weight_packed", "proj.weight")) and "layers.0." in k]
    assert codes and all(not torch.equal(once[k].view(torch.uint8), unmerged[k].view(torch.uint8)) for k in codes)
    config = json.loads((tmp_path / "once" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


@pytest.mark.parametrize(("base", "words"), [
    ("megatron-bridge-0.6.2/deepseek-v3/hf", "weight(s) the base does not hold"),
    ("megatron-core-0.19.2/llama-tp2-torch/checkpoint", "merged into whole weights"),
])
def test_merge_adapter_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str, words: str) -> None:
    assert _merge(BRIDGE.parent / base, LORA["tp1"], tmp_path / "out", "--target-tp", "1") == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_merge_adapter_refuses_another_shape(tmp_path: Path) -> None:
    """A base whose adapted weight has another shape than B @ A (a model of another width)."""
    from reshard.core.errors import LayoutError
    from reshard.core.source import SourceCheckpoint
    from reshard.formats.megatron_peft import merged

    shapes = {"self_attention.linear_qkv": (128, 64), "self_attention.linear_proj": (64, 64),
              "mlp.linear_fc1": (256, 64), "mlp.linear_fc2": (64, 128)}
    module = {f"decoder.layers.{i}.{m}.weight": torch.zeros(shape, dtype=torch.bfloat16)
              for i in range(2) for m, shape in shapes.items()}
    module["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(96, 64, dtype=torch.bfloat16)
    state = {"model": module}
    source = SourceCheckpoint((tmp_path / "x",), origin=str(tmp_path), format="torch_dist", pp=1)
    with pytest.raises(LayoutError, match="is 128 x 64; the base's .* is 96 x 64"):
        merged(state, source, str(LORA["tp1"] / "checkpoint"))


def test_merge_adapter_is_part_of_the_conversions_identity(tmp_path: Path) -> None:
    """The same base with a changed adapter is another conversion, not an output already up to date."""
    import os

    from reshard import api

    lora = tmp_path / "lora"
    shutil.copytree(LORA["tp1"] / "checkpoint", lora)
    run = dict(to="hf", merge_adapter=str(lora), overwrite=True)
    assert not api.convert(str(BASE), str(tmp_path / "out"), **run).up_to_date
    assert api.convert(str(BASE), str(tmp_path / "out"), **run).up_to_date
    blob = next(lora.glob("iter_*/__0_0.distcp"))
    os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 10**9))
    assert not api.convert(str(BASE), str(tmp_path / "out"), **run).up_to_date


def test_merge_adapter_refuses_dora(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DoRA's magnitude vector is another arithmetic than W + alpha/r * B A: refused, not merged as LoRA."""
    src = _copy_with_run_config(LORA["tp1"], tmp_path / "src", {"_target_": "megatron.bridge.peft.dora.DoRA"})
    assert _merge(BASE, src, tmp_path / "out", "--to", "hf") == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: ") and err.count("\n") == 1 and "DoRA" in err, err
    assert not (tmp_path / "out").exists()


def test_hf_peft_refuses_layout_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter is written as it is: a layout flag is refused, not silently ignored."""
    assert _export(LORA["tp1"], tmp_path / "out", "--target-tp", "2") == 2
    err = capsys.readouterr().err
    assert "--target-tp do(es) not apply to an adapter" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_an_adapter_checkpoint_converted_as_a_model_is_named_so(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`reshard run LORA_CKPT DST --to hf` (a model's conversion) says what the folder is and what to do."""
    assert main(["run", str(LORA["tp1"] / "checkpoint"), str(tmp_path / "out"), "--to", "hf", "--direct"]) == 2
    err = capsys.readouterr().err
    assert "a LoRA adapter checkpoint, not a model" in err and "--to hf-peft" in err and err.count("\n") == 1, err
