"""LoRA adapters back (issue #59): a Hugging Face PEFT adapter -> Megatron-Bridge's PEFT checkpoint
(``reshard run HF_ADAPTER DST --to megatron-peft --target-tp N``).

The references are Megatron-Bridge 0.6.2's own PEFT saves of the Llama fixture
(``tests/fixtures/realtools/megatron-bridge-0.6.2/llama-lora``: TP 1, bf16;
``llama-lora-tp2``: TP 2, float32; written by ``tests/realtools/write_fixtures.py``): the adapters
reshard exports from them (``--to hf-peft``, which keeps their dtype) are written back and compared
with Bridge's files chunk for chunk; an adapter peft itself trained-and-saved (``get_peft_model``
on the fixture's transformers Llama, ``save_pretrained``) makes the round trip too."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.cli import main
from reshard.core.dcp_metadata import read_metadata

peft = pytest.importorskip("peft", reason="dev extra: an adapter written by peft itself is converted")
transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")
from safetensors.torch import load_file, save_file  # noqa: E402

BRIDGE = Path(__file__).resolve().parent / "fixtures" / "realtools" / "megatron-bridge-0.6.2"
BASE = BRIDGE / "llama" / "hf"
CONFIG = BASE / "config.json"
LORA = {1: BRIDGE / "llama-lora", 2: BRIDGE / "llama-lora-tp2"}
COMMON = "common_state/shard_0_1"


def _to_megatron(src: Path, dst: Path, *extra: str, config: bool = True) -> int:
    return main(["run", str(src), str(dst), "--to", "megatron-peft", *extra,
                 *(["--model-config", str(CONFIG)] if config else [])])


def _to_hf(src: Path, dst: Path) -> int:
    return main(["run", str(src), str(dst), "--to", "hf-peft"])


def _iteration(ckpt: Path) -> Path:
    return next(ckpt.glob("iter_*"))


def _peft_written(root: Path, r: int = 4) -> Path:
    """An adapter saved by peft itself: LoRA on every projection of the fixture's transformers Llama,
    B drawn at random (peft starts it at zero), A shared by q/k/v and by gate/up (so that a fused
    adapter holds it), float32, ``save_pretrained`` (its base the local fixture folder)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(59)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for shared in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                           (layer.mlp.gate_proj, layer.mlp.up_proj)):
                for m in shared:
                    m.lora_A["default"].weight.copy_(shared[0].lora_A["default"].weight)
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                w = m.lora_B["default"].weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.1)
    out = root / "peft-adapter"
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Hugging Face adapters converted here: Megatron-Bridge's own export (TP 1 fixture, bf16),
    reshard's exports of both Bridge checkpoints (bf16, float32) and peft's own save (float32)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {"bridge-export": LORA[1] / "hf_adapter", "peft": _peft_written(root)}
    for tp, src in LORA.items():
        assert _to_hf(src / "checkpoint", root / f"reshard-tp{tp}") == 0
        out[f"reshard-tp{tp}"] = root / f"reshard-tp{tp}"
    return out


def _blob(folder: Path, file: str, offset: int, length: int) -> bytes:
    with open(folder / file, "rb") as f:
        f.seek(offset)
        return f.read(length)


@pytest.mark.parametrize("tp", [1, 2])
def test_equals_megatron_bridges_checkpoint(adapters: dict[str, Path], tmp_path: Path, tp: int) -> None:
    """reshard's checkpoint of Bridge's adapters (as reshard exported them, dtype kept) is Bridge's own
    save at that TP: the same keys, global shapes, dtypes and chunks (each rank's boxes, in the same
    file at the same place), every chunk's bytes, the files' bytes but for the common state's
    iteration, and the same ``peft`` section of run_config.yaml."""
    assert _to_megatron(adapters[f"reshard-tp{tp}"], tmp_path / "out", "--target-tp", str(tp)) == 0
    ours, theirs = _iteration(tmp_path / "out"), _iteration(LORA[tp] / "checkpoint")
    a, b = read_metadata(ours / ".metadata"), read_metadata(theirs / ".metadata")
    assert sorted(a.keys) == sorted(b.keys)
    assert a.tensors == b.tensors and a.byte_items == b.byte_items
    assert sorted(p.name for p in ours.glob("*.distcp")) == [f"__{t}_0.distcp" for t in range(tp)]
    for t in a.tensors.values():
        assert t.dtype == (torch.bfloat16 if tp == 1 else torch.float32)
        for c in t.chunks:
            assert _blob(ours, c.file, c.offset, c.length) == _blob(theirs, c.file, c.offset, c.length), t.key
    common = a.byte_items[COMMON]
    for f in ours.glob("*.distcp"):
        mine, bridge = bytearray(f.read_bytes()), bytearray((theirs / f.name).read_bytes())
        if f.name == common.file:
            states = [torch.load(io.BytesIO(bytes(x[common.offset:common.offset + common.length])),
                                 weights_only=True) for x in (mine, bridge)]
            assert states[0] == [{**states[1][0], "iteration": 0}]
            mine[common.offset:common.offset + common.length] = bridge[common.offset:common.offset + common.length]
        assert mine == bridge, f.name
    rc = [yaml.safe_load((d / "run_config.yaml").read_text()) for d in (ours, theirs)]
    assert rc[0]["peft"] == rc[1]["peft"]
    assert rc[0]["model"]["tensor_model_parallel_size"] == tp
    assert torch.load(ours / "train_state.pt", weights_only=True).keys() == \
        torch.load(theirs / "train_state.pt", weights_only=True).keys()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["bridge-export", "reshard-tp2", "peft"])
def test_round_trip_is_bit_identical(adapters: dict[str, Path], tmp_path: Path, name: str, tp: int) -> None:
    """Hugging Face PEFT -> Megatron PEFT (TP 1, TP 2) -> Hugging Face PEFT: every tensor bit for bit,
    its dtype kept, and the same rank, alpha, targets and base."""
    src = adapters[name]
    assert _to_megatron(src, tmp_path / "meg", "--target-tp", str(tp), config=name != "peft") == 0
    assert _to_hf(tmp_path / "meg", tmp_path / "back") == 0
    want, got = (load_file(str(d / "adapter_model.safetensors")) for d in (src, tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (src, tmp_path / "back")]
    for field in ("peft_type", "r", "lora_alpha", "lora_dropout", "base_model_name_or_path"):
        assert configs[0][field] == configs[1][field], field
    assert sorted(configs[0]["target_modules"]) == configs[1]["target_modules"]


def test_attention_only_adapter(tmp_path: Path) -> None:
    """An adapter of q/k/v/o alone wraps linear_qkv and linear_proj (run_config's target_modules) and
    comes back as it was."""
    attention = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    src = _edited(LORA[1] / "hf_adapter", tmp_path / "src", attention,
                  lambda w: {k: v for k, v in w.items() if ".self_attn." in k})
    assert _to_megatron(src, tmp_path / "meg", "--target-tp", "2") == 0
    rc = yaml.safe_load((_iteration(tmp_path / "meg") / "run_config.yaml").read_text())
    assert rc["peft"]["target_modules"] == ["linear_qkv", "linear_proj"]
    assert _to_hf(tmp_path / "meg", tmp_path / "back") == 0
    want, got = (load_file(str(d / "adapter_model.safetensors")) for d in (src, tmp_path / "back"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_adapter_takes_the_written_checkpoint(adapters: dict[str, Path], tmp_path: Path) -> None:
    """``--merge-adapter`` of reshard's TP 2 checkpoint gives the bytes the merge of Bridge's own gives."""
    assert _to_megatron(adapters["reshard-tp2"], tmp_path / "meg", "--target-tp", "2") == 0
    for name, lora in (("ours", tmp_path / "meg"), ("bridge", LORA[2] / "checkpoint")):
        assert main(["run", str(BASE), str(tmp_path / name), "--merge-adapter", str(lora), "--direct",
                     "--to", "hf"]) == 0
    ours, bridge = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ours", "bridge"))
    base = load_file(str(BASE / "model.safetensors"))
    assert sorted(ours) == sorted(bridge)
    assert [k for k in bridge if not torch.equal(ours[k], bridge[k])] == []
    assert sum(not torch.equal(ours[k], base[k]) for k in base) == 2 * 7  # every adapted weight moved


def _edited(src: Path, dst: Path, config: dict[str, Any] | None = None,
            tensors: Any = None) -> Path:
    """A copy of the adapter at ``src`` with its config updated and its tensors mapped."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "adapter_config.json").read_text())
        data.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(str(src / "adapter_model.safetensors"))
        save_file(tensors(weights), str(dst / "adapter_model.safetensors"))
    return dst


def _k_a_changed(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    w[k] = w[k].clone()
    w[k][0, 0] += 1
    return w


def _rank_3(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v[:3] if ".lora_A." in k else v[:, :3]).contiguous() for k, v in w.items()}


def _q_only(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in w.items() if ".k_proj." not in k and ".v_proj." not in k}


def _gate_a_changed(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    w[k] = w[k] * 2
    return w


@pytest.mark.parametrize(("edit", "tensors", "extra", "words"), [
    ({}, _k_a_changed, (), "LoRA A of model.layers.1.self_attn.k_proj differs from model.layers.1.self_attn.q_proj's"),
    ({}, _gate_a_changed, (), "LoRA A of model.layers.0.mlp.up_proj differs"),
    ({"r": 3}, _rank_3, ("--target-tp", "2"), "rank r=3 of linear_qkv does not split over TP 2"),
    ({}, None, ("--target-tp", "4"), "2 query groups do not split over TP 4"),
    ({"use_dora": True}, None, (), "use_dora is True: DoRA"),
    ({"use_rslora": True}, None, (), "use_rslora is True: rsLoRA scales the update by alpha / sqrt(r)"),
    ({"peft_type": "IA3"}, None, (), "the adapter is PEFT's IA3"),
    ({"rank_pattern": {"q_proj": 8}}, None, (), "rank_pattern gives q_proj 8 beside 4"),
    ({"alpha_pattern": {"o_proj": 16}}, None, (), "alpha_pattern gives o_proj 16 beside 8"),
    ({"target_modules": ["q_proj"]}, _q_only, (), "k_proj.lora_A.weight is missing beside"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}, None, ("--no-config",),
     "the base model (meta-llama/Llama-3.2-1B) is no local folder with a config.json"),
    ({}, None, ("--target-pp", "2"), "--target-pp do(es) not apply to an adapter"),
])
def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, Any], tensors: Any,
                  extra: tuple[str, ...], words: str) -> None:
    """Each refused in one line, naming what (and exit 2), nothing written."""
    src = _edited(LORA[1] / "hf_adapter", tmp_path / "src", edit, tensors)
    no_config = "--no-config" in extra
    args = tuple(x for x in extra if x != "--no-config")
    assert _to_megatron(src, tmp_path / "out", *args, config=not no_config) == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no staged folder left either


def test_a_rank_that_divides_is_written(tmp_path: Path) -> None:
    """The rank-3 adapter the TP 2 case refuses is written at TP 1 (the refusal is the TP's)."""
    src = _edited(LORA[1] / "hf_adapter", tmp_path / "src", {"r": 3}, _rank_3)
    assert _to_megatron(src, tmp_path / "out") == 0
    meta = read_metadata(_iteration(tmp_path / "out") / ".metadata")
    assert meta.tensors["decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"].shape == (2, 3, 64)


def test_formats_lists_megatron_peft(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    assert any(line.split()[:2] == ["megatron-peft", "writes"] for line in capsys.readouterr().out.splitlines())
