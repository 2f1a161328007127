"""Checkpoints written by the real tools (megatron-core 0.19's Megatron-LM and Megatron-Bridge 0.6,
committed under ``tests/fixtures/realtools/``; see the README there and ``tests/realtools/``) convert
with their own logits: each to Hugging Face (transformers' forward of the export), to TP 1 / EP 1
per-rank files and to torch_dist (megatron-core's strict load and forward of each, the model built
from the output's own ``args``), and bit for bit where nothing is re-split (a Megatron-Bridge
checkpoint's export against the Hugging Face folder it was imported from; a torch_dist checkpoint's
per-rank output at the source's own layout against the per-rank checkpoint of the same run).

Everything is converted once (:func:`realtools`), in this process; megatron-core's forwards run in one
harness launch, transformers' in this process. The side environment is never needed.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_fixtures import needs_mcore, run_harness

pytestmark = needs_mcore

REALTOOLS = Path(__file__).resolve().parent / "fixtures" / "realtools"

def _adapters_only(fixture: Path) -> bool:
    """Issue #59's fixtures (``*-lora*``: a LoRA adapter checkpoint, adapters only) are no model of
    their own: tests/test_lora*.py convert them."""
    return "-lora" in fixture.name


FIXTURES = sorted(p.parent for p in REALTOOLS.glob("*/*/fixture.json") if not _adapters_only(p.parent))
IDS = [f"{f.parent.name.split('-')[1]}:{f.name}" for f in FIXTURES]
#: output name -> the conversion's options
OUTPUTS: dict[str, dict[str, Any]] = {"hf": {"to": "hf"}, "tp1": {"target_tp": 1, "target_ep": 1},
                                      "dist": {"to": "torch_dist"}}
#: logits of a float32 forward against the fixture's (float32) reference: the same weights, other kernels
TOL = 1e-5


def meta(fixture: Path) -> dict[str, Any]:
    return json.loads((fixture / "fixture.json").read_text())


def flag(fixture: Path, name: str, default: int = 1) -> int:
    """A Megatron-LM fixture's ``--name`` on its command line (a Megatron-Bridge fixture: ``default``)."""
    words = shlex.split(meta(fixture).get("command_line", ""))
    return int(words[words.index(name) + 1]) if name in words else default


@dataclass
class Converted:
    """What :func:`realtools` made of one fixture: output folders and their logits."""

    outputs: dict[str, Path] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)


def _hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="session")
def realtools(tmp_path_factory) -> dict[Path, Converted]:
    """Every fixture converted to every output of :data:`OUTPUTS` (and a torch_dist fixture also to
    its per-rank twin's layout, ``twin``); the per-rank and torch_dist outputs' logits from one
    megatron-core harness launch, the Hugging Face ones from transformers."""
    from reshard import api

    root = tmp_path_factory.mktemp("realtools")
    made: dict[Path, Converted] = {}
    jobs: list[tuple[Path, str, dict[str, Any]]] = []
    for i, fixture in enumerate(FIXTURES):
        c = made[fixture] = Converted()
        tokens = meta(fixture)["tokens"]
        for name, options in OUTPUTS.items():
            out = c.outputs[name] = root / f"{i}-{name}"
            api.convert(str(fixture / "checkpoint"), str(out), **options)
            if name != "hf":
                jobs.append((fixture, name, {"kind": "forward_dist" if name == "dist" else "forward", "ckpt": str(out),
                                             "tp": 1, "from_args": True, "model": {}, "tokens": tokens,
                                             "out": str(root / f"{i}-{name}.logits.pt")}))
        if twin_of(fixture) is not None:
            c.outputs["twin"] = root / f"{i}-twin"
            api.convert(str(fixture / "checkpoint"), str(c.outputs["twin"]), to="megatron",
                        target_tp=flag(fixture, "--tensor-model-parallel-size"),
                        target_ep=flag(fixture, "--expert-model-parallel-size"))
        c.logits["hf"] = _hf_logits(c.outputs["hf"], tokens)
    run_harness([job for _, _, job in jobs], root / "harness")
    for fixture, name, job in jobs:
        made[fixture].logits[name] = torch.load(job["out"])
    return made


def twin_of(fixture: Path) -> Path | None:
    """The per-rank fixture of the same Megatron-LM run as a torch_dist fixture (same flags and seed:
    the same weights), or None."""
    if not fixture.name.endswith("-torch-dist"):
        return None
    twin = fixture.with_name(fixture.name.removesuffix("-dist"))
    return twin if (twin / "fixture.json").is_file() else None


def _gap(fixture: Path, logits: torch.Tensor) -> float:
    """max |logits - the fixture's| over the model's vocabulary (padding columns are free)."""
    ref = torch.load(fixture / "logits.pt", weights_only=True)["logits"]
    v = meta(fixture)["vocab_size"]
    return (logits[:, :v].float() - ref[:, :v].float()).abs().max().item()


@pytest.mark.parametrize("fixture", FIXTURES, ids=IDS)
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_each_real_checkpoint_converts_with_its_logits(realtools, fixture, output):
    gap = _gap(fixture, realtools[fixture].logits[output])
    assert gap <= TOL, f"{fixture.name} -> {output}: max |logits - the source's| = {gap:.3g}"


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if (f / "hf").is_dir()],
                         ids=[i for f, i in zip(FIXTURES, IDS) if (f / "hf").is_dir()])
def test_a_bridge_checkpoint_exports_the_hugging_face_tensors_it_was_imported_from(realtools, fixture):
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    source, export = tensors(fixture / "hf"), tensors(realtools[fixture].outputs["hf"])
    assert sorted(export) == sorted(source)
    # megatron-core keeps the router's expert bias in float32 (a buffer): the checkpoint holds the bf16
    # values widened, and the export writes what the checkpoint holds
    widened = {k for k in source if k.endswith(".e_score_correction_bias") and export[k].dtype == torch.float32}
    differ = [k for k in source if (source[k].dtype != export[k].dtype and k not in widened)
              or not torch.equal(source[k].to(export[k].dtype), export[k])]
    assert not differ, f"not bit-identical: {differ}"


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if twin_of(f)],
                         ids=[i for f, i in zip(FIXTURES, IDS) if twin_of(f)])
def test_torch_dist_at_its_runs_layout_is_that_runs_per_rank_checkpoint(realtools, fixture):
    """Megatron-LM's torch_dist and per-rank saves of one run hold the same weights: reshard's per-rank
    output of the torch_dist one at the same TP and EP holds the per-rank one's tensors, bit for bit."""
    from mcore_fixtures import iteration_folder
    from reshard.core.safe_load import load_shard

    twin = twin_of(fixture) / "checkpoint"
    ours = realtools[fixture].outputs["twin"]
    theirs = sorted(p.parent.name for p in iteration_folder(twin).glob("mp_rank_*/model_optim_rng.pt"))
    assert sorted(p.parent.name for p in iteration_folder(ours).glob("mp_rank_*/model_optim_rng.pt")) == theirs
    for rank in theirs:
        a = load_shard(iteration_folder(twin) / rank / "model_optim_rng.pt", mmap=False)["model"]
        b = load_shard(iteration_folder(ours) / rank / "model_optim_rng.pt", mmap=False)["model"]
        tensors = {k for k, v in a.items() if isinstance(v, torch.Tensor)}
        assert tensors == {k for k, v in b.items() if isinstance(v, torch.Tensor)}, rank
        differ = [k for k in tensors if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not differ, f"{rank}: not bit-identical: {differ}"


@pytest.mark.parametrize("fixture", FIXTURES, ids=IDS)
def test_inspect_describes_each_real_checkpoint(fixture):
    from reshard import api

    m = meta(fixture)
    info = api.inspect(str(fixture / "checkpoint"))
    assert info["format"] == ("torch_dist" if m["format"] == "torch_dist" else "megatron")
    if m["format"] == "torch":  # torch_dist holds global tensors: read (and reported) at TP 1, EP 1
        assert (info["tp"], info["ep"]) == (flag(fixture, "--tensor-model-parallel-size"),
                                            flag(fixture, "--expert-model-parallel-size"))
    hf = m.get("hf_config", {})  # DeepSeek-V3 and Qwen3-MoE name the routed experts apart
    experts = (hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts")
               or flag(fixture, "--num-experts", 0))
    assert info["experts"] == experts
    assert info["facts"]["vocab_size"] == m["vocab_size"]
    assert (info["facts"]["num_layers"], info["hidden"]) == (2, 64)


@pytest.mark.parametrize(("spec", "impl", "norm"), [
    ({"_call_": False, "_target_": "megatron.bridge.models.gpt_provider.local_layer_spec"}, "local",
     "decoder.layers.0.input_layernorm.weight"),
    ({"_call_": False, "_target_": "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec"},
     "transformer_engine", "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")])
def test_per_rank_names_follow_the_layer_spec_megatron_bridge_recorded(tmp_path, spec, impl, norm):
    """torch_dist names a layer norm as Transformer Engine's fused linear does whatever the spec;
    per-rank files name it as the spec builds it. A Megatron-Bridge checkpoint records its spec in
    ``run_config.yaml``: the per-rank output's names and ``args.transformer_impl`` follow it (with the
    local spec's names under Transformer Engine's, Megatron-LM leaves the norms at ones: its strict
    per-rank load falls back to non-strict)."""
    import shutil

    import yaml

    from mcore_fixtures import iteration_folder
    from reshard import api
    from reshard.core.safe_load import load_shard

    src = Path(shutil.copytree(REALTOOLS / "megatron-bridge-0.6.2" / "llama" / "checkpoint", tmp_path / "src"))
    run_config = src / "iter_0000000" / "run_config.yaml"
    config = yaml.safe_load(run_config.read_text())
    config["model"]["transformer_layer_spec"] = spec
    run_config.write_text(yaml.safe_dump(config))
    api.convert(str(src), str(tmp_path / "out"), target_tp=1)
    sd = load_shard(iteration_folder(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt", mmap=False)
    assert sd["args"].transformer_impl == impl
    assert norm in sd["model"]


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unpadded_bridge_vocabulary_is_padded_as_megatron_lm_pads_it(tmp_path, tp):
    """Megatron-Bridge's DeepSeek-V3 records ``make_vocab_size_divisible_by: 1280`` but pads nothing
    (``should_pad_vocab: false``: 128 rows for 128 tokens). Megatron-LM pads by its own divisor, 128 by
    default, times TP (``_vocab_size_with_padding``): 128 rows at TP 1, 256 at TP 2, which its default
    flags build (not 1280)."""
    from mcore_fixtures import iteration_folder
    from reshard import api
    from reshard.core.safe_load import load_shard

    api.convert(str(REALTOOLS / "megatron-bridge-0.6.2" / "deepseek-v3" / "checkpoint"), str(tmp_path / "out"),
                target_tp=tp)
    sd = load_shard(iteration_folder(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt", mmap=False)
    args = sd["args"]
    assert (args.vocab_size, args.make_vocab_size_divisible_by, args.padded_vocab_size) == (128, 128, 128 * tp)
    assert sd["model"]["embedding.word_embeddings.weight"].shape[0] == 128  # each rank's half at TP 2
