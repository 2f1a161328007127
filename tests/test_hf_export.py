"""Export to Hugging Face safetensors (``--to hf``), checked against transformers and megatron-core.

Sources are megatron-core checkpoints written by real megatron-core (0.16.1, CPU, gloo;
``mcore_fixtures``) with the logits of megatron-core's own forward. Each export must load in
transformers' ``AutoModelForCausalLM`` with no missing, unexpected or mismatched keys and give
those logits within 2e-5 (float32; here they agree to ~1e-7). The same comparison catches each
plausible wrong export far above that bound (wrong activation, rotary base, epsilon, swapped
projections, a misplaced row): :func:`test_the_logits_comparison_catches_each_plausible_wrong_export`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from legacy_twin import as_legacy, rewrite_run
from mcore_fixtures import TOKENS, mcore_checkpoints, needs_mcore, rank_module
from reshard.cli import main

pytestmark = needs_mcore
TOL = 2e-5


@pytest.fixture(scope="session")
def mcore(tmp_path_factory):
    return mcore_checkpoints(tmp_path_factory.mktemp("mcore"))


def hf_logits(folder: Path) -> torch.Tensor:
    """transformers' logits for the test tokens, after checking every key loaded."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def _export(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), "--to", "hf", *extra]) == 0
    return out


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files by name, each file's metadata
    checked to be transformers' (``format: pt``) and each name stored once."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            assert st.metadata() == {"format": "pt"}
            for k in st.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = st.get_tensor(k)
    return out


CASES = [  # (model, tp, pp, the architecture transformers must build, tied)
    ("llama", 2, 1, "LlamaForCausalLM", False), ("llama", 1, 1, "LlamaForCausalLM", False),
    ("llama_tied", 2, 1, "LlamaForCausalLM", True), ("qwen", 2, 1, "Qwen2ForCausalLM", False),
    ("qwen3", 2, 1, "Qwen3ForCausalLM", False),  # query/key norms, head dim 16 (not hidden / heads)
    ("mistral", 2, 1, "MistralForCausalLM", False),  # Llama's with megatron-core's window (3, 0): sliding_window 4
    # GPT-2-like: LayerNorm, exact GELU, learned positions, biases, multi-head; 100 of 128 rows real
    ("mha", 2, 1, "GPT2LMHeadModel", True), ("padded_tied", 4, 1, "GPT2LMHeadModel", True),
]


@pytest.mark.parametrize("name,tp,pp,arch,tied", CASES, ids=[f"{c[0]}-tp{c[1]}" for c in CASES])
def test_transformers_runs_the_export_with_megatron_cores_logits(mcore, tmp_path, name, tp, pp, arch, tied):
    out = _export(mcore[(name, tp, pp)], tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in hf_tensors(out)) is not tied
    want = torch.load(mcore[(name, tp, pp)] / "logits.pt")
    want = want[:, :config["vocab_size"]]  # Megatron's padding rows are not exported
    torch.testing.assert_close(hf_logits(out), want, atol=TOL, rtol=0)


def test_a_legacy_megatron_gpt_exports_as_gpt2(mcore, tmp_path):
    """A legacy-named GPT (LayerNorm, GELU, learned positions, biases) exports the tensors its
    megatron-core original does, which transformers' GPT-2 runs with megatron-core's logits."""
    legacy = rewrite_run(mcore[("mha", 2, 1)], tmp_path / "legacy", as_legacy())
    got = hf_tensors(_export(legacy, tmp_path / "from_legacy"))
    want = hf_tensors(_export(mcore[("mha", 2, 1)], tmp_path / "from_core"))
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    torch.testing.assert_close(hf_logits(tmp_path / "from_legacy"), torch.load(mcore[("mha", 2, 1)] / "logits.pt"),
                               atol=TOL, rtol=0)


def test_megatron_cores_window_is_exported_as_mistrals_sliding_window(mcore, tmp_path):
    """megatron-core's window_size (3, 0) (each query sees itself and 3 keys before it) is transformers'
    sliding_window 4, which runs with megatron-core's logits over 12 tokens; a window one token off
    either way, or none, moves transformers' logits far past the tolerance (the comparison sees it)."""
    out = _export(mcore[("mistral", 2, 1)], tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == ("mistral", 4)
    assert "attention_bias" not in config and "mlp_bias" not in config
    want = torch.load(mcore[("mistral", 2, 1)] / "logits.pt")[:, :config["vocab_size"]]
    torch.testing.assert_close(hf_logits(out), want, atol=TOL, rtol=0)
    for wrong in (3, 5, None):
        (out / "config.json").write_text(json.dumps({**config, "sliding_window": wrong}))
        assert (hf_logits(out) - want).abs().max() > 100 * TOL, wrong


def _as_019_args(run: Path, dst: Path) -> Path:
    """A copy of ``run`` whose args spell the epsilon as Megatron-LM 0.19 saves it: generated from
    megatron-core's TransformerConfig, ``layernorm_epsilon`` (no ``norm_epsilon``)."""
    dst = Path(shutil.copytree(run, dst))
    for f in dst.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].layernorm_epsilon = vars(sd["args"]).pop("norm_epsilon")
        torch.save(sd, f)
    return dst


@pytest.mark.parametrize("spelling", ["norm_epsilon", "layernorm_epsilon"], ids=["0.16", "0.19"])
def test_the_saved_rotary_base_and_epsilon_are_exported(mcore, tmp_path, spelling):
    src = mcore[("qwen", 2, 1)] if spelling == "norm_epsilon" else _as_019_args(mcore[("qwen", 2, 1)], tmp_path / "s")
    config = json.loads((_export(src, tmp_path / "hf") / "config.json").read_text())
    assert config["rope_theta"] == 50000.0 and config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == 1e-6


@pytest.mark.parametrize("spelling", ["norm_epsilon", "layernorm_epsilon"], ids=["0.16", "0.19"])
def test_a_flag_contradicting_the_saved_epsilon_is_refused_whatever_its_spelling(mcore, tmp_path, capsys, spelling):
    """``--norm-epsilon`` fills in an epsilon the args lack; under 0.19's name the args have one
    (was: the flag silently overrode the saved 1e-6 in the export)."""
    src = mcore[("qwen", 2, 1)] if spelling == "norm_epsilon" else _as_019_args(mcore[("qwen", 2, 1)], tmp_path / "s")
    _refused(capsys, src, tmp_path / "out", "norm_epsilon=1e-05 from the flags contradicts the checkpoint's saved "
             "args (1e-06)", "--norm-epsilon", "1e-5")
    assert main(["run", "--direct", str(src), str(tmp_path / "same"), "--to", "hf", "--norm-epsilon", "1e-6"]) == 0


def test_pipeline_stages_export_with_global_layer_numbers(mcore, tmp_path):
    src = mcore[("llama", 1, 2)]
    got = hf_tensors(_export(src, tmp_path / "hf"))
    first, last = rank_module(src, 0, 0), rank_module(src, 0, 1)
    assert torch.equal(got["model.embed_tokens.weight"], first["embedding.word_embeddings.weight"])
    assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"],
                       first["decoder.layers.0.self_attention.linear_proj.weight"])
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"],
                       last["decoder.layers.0.self_attention.linear_proj.weight"])
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], last["decoder.layers.0.mlp.linear_fc2.weight"])
    assert torch.equal(got["lm_head.weight"], last["output_layer.weight"])


def test_every_source_format_exports_the_same_tensors(mcore, tmp_path):
    """torch_dist and a legacy-named twin export exactly the per-rank TP 2 files' tensors."""
    want = hf_tensors(_export(mcore[("llama", 2, 1)], tmp_path / "direct"))
    dist = tmp_path / "dist"
    assert main(["run", "--direct", str(mcore[("llama", 2, 1)]), str(dist), "--to", "torch_dist"]) == 0
    legacy = rewrite_run(mcore[("llama", 2, 1)], tmp_path / "legacy", as_legacy())
    for label, src in (("torch_dist", dist), ("legacy names", legacy)):
        got = hf_tensors(_export(src, tmp_path / label.replace(" ", "_")))
        assert list(got) == list(want), label
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{label}: {k}"


def test_a_sharded_export_loads_with_the_same_logits(mcore, tmp_path):
    """Shards of at most the limit (here the last one holds the output layer alone: a file of only
    non-layer tensors is still named and split as megatron-core's)."""
    limit = 100_000
    out = _export(mcore[("llama", 2, 1)], tmp_path / "hf", "--max-shard-size", f"{limit}B")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = hf_tensors(out)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in files:
        in_file = [tensors[k] for k, v in index["weight_map"].items() if v == f]
        if len(in_file) > 1:  # a shard holds more than one tensor only when they fit the limit together
            assert sum(t.numel() * t.element_size() for t in in_file) <= limit, f
    assert [k for k, v in index["weight_map"].items() if v == files[-1]] == ["lm_head.weight"]
    assert main(["verify", str(out)]) == 0  # the digests hashed while writing are the files' own
    torch.testing.assert_close(hf_logits(out), torch.load(mcore[("llama", 2, 1)] / "logits.pt"), atol=TOL, rtol=0)


def _unrecorded_vocab(sd: dict) -> dict:
    sd["args"].vocab_size = None
    return sd


def test_the_vocabulary_is_trimmed_to_its_true_size(mcore, tmp_path):
    """Rows past the true vocabulary (100 of the 128 here) are Megatron's padding: not exported."""
    src = rewrite_run(mcore[("llama", 2, 1)], tmp_path / "src", _unrecorded_vocab)
    out = _export(src, tmp_path / "hf", "--vocab-size", "100")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 100
    assert hf_tensors(out)["model.embed_tokens.weight"].shape[0] == 100
    want = torch.load(mcore[("llama", 2, 1)] / "logits.pt")[:, :100]
    torch.testing.assert_close(hf_logits(out), want, atol=TOL, rtol=0)


def mutated_copy(src: Path, dst: Path, *, config: dict | None = None, tensors=None) -> Path:
    """A copy of the Hugging Face folder ``src`` at ``dst`` with ``config`` entries replaced and
    ``tensors(state_dict)`` applied to its tensors (saved back as one file): a plausible wrong
    export, for checks that must tell it from the right one."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            cfg[k] = v
            if k == "rope_theta":
                cfg["rope_parameters"]["rope_theta"] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        sd = hf_tensors(dst)
        tensors(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _swap(a: str, b: str):
    def edit(sd: dict) -> None:
        sd[a], sd[b] = sd[b], sd[a]
    return edit


def _misplace_row(key: str):
    def edit(sd: dict) -> None:
        sd[key] = sd[key][torch.tensor([1, 0, *range(2, sd[key].shape[0])])]
    return edit


WRONG = {
    "gelu instead of silu": {"config": {"hidden_act": "gelu"}},
    "rotary base 10000 instead of 50000": {"config": {"rope_theta": 10000.0}},
    "epsilon 1e-5 instead of 1e-6": {"config": {"rms_norm_eps": 1e-5}},
    "K and V swapped": {"tensors": _swap("model.layers.0.self_attn.k_proj.weight",
                                         "model.layers.0.self_attn.v_proj.weight")},
    "gate and up swapped": {"tensors": _swap("model.layers.1.mlp.gate_proj.weight",
                                             "model.layers.1.mlp.up_proj.weight")},
    "a misplaced query row": {"tensors": _misplace_row("model.layers.0.self_attn.q_proj.weight")},
}


WRONG_QWEN3 = {
    "query and key norms swapped": {"tensors": _swap("model.layers.0.self_attn.q_norm.weight",
                                                     "model.layers.0.self_attn.k_norm.weight")},
    "no query norm (a Llama export)": {"tensors": lambda sd: sd["model.layers.1.self_attn.q_norm.weight"].fill_(1.0)},
    "rotary base 10000 instead of 1e6": {"config": {"rope_theta": 10000.0}},
}


WRONG_GPT2 = {  # the GELU variant: see test_the_gelu_variant_is_caught_where_it_matters
    "c_attn as Megatron's per-head rows, not q|k|v": {"tensors": lambda sd: sd.__setitem__(
        "transformer.h.0.attn.c_attn.weight", sd["transformer.h.0.attn.c_attn.weight"].reshape(64, 3, 8, 8)
        .transpose(1, 2).reshape(64, 192))},
    "c_fc's bytes in Megatron's [out, in] order, not transposed": {"tensors": lambda sd: sd.__setitem__(
        "transformer.h.1.mlp.c_fc.weight", sd["transformer.h.1.mlp.c_fc.weight"].t().contiguous().reshape(64, 256))},
}


@pytest.mark.parametrize("model,wrong", [("qwen", WRONG), ("qwen3", WRONG_QWEN3), ("mha", WRONG_GPT2)],
                         ids=["qwen", "qwen3", "gpt2"])
def test_the_logits_comparison_catches_each_plausible_wrong_export(mcore, tmp_path, model, wrong):
    src = mcore[(model, 2, 1)]
    good = _export(src, tmp_path / "good")
    want = torch.load(src / "logits.pt")
    assert (hf_logits(good) - want).abs().max() < TOL
    for i, (label, change) in enumerate(wrong.items()):
        diff = (hf_logits(mutated_copy(good, tmp_path / f"wrong{i}", **change)) - want).abs().max().item()
        assert diff > 10 * TOL, f"{label}: logits moved only {diff:.2e}"


def _refused(capsys, src: Path, dst: Path, needle: str, *extra: str) -> None:
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(dst), "--to", "hf", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not dst.exists()


@pytest.mark.parametrize("saved_as", ["apply_layernorm_1p", "layernorm_zero_centered_gamma"], ids=["0.16", "0.19"])
def test_norm_weights_stored_off_by_one_are_refused(mcore, tmp_path, capsys, saved_as):
    """Megatron's ``--apply-layernorm-1p`` stores every norm weight as ``w - 1``: exported as they are,
    every norm would be off by one (an approximate export). Megatron-LM 0.19 saves the flag as
    ``layernorm_zero_centered_gamma``."""
    from mcore_fixtures import copy_with_args

    src = copy_with_args(mcore[("llama", 2, 1)], tmp_path / "src", **{saved_as: True})
    _refused(capsys, src, tmp_path / "out", "norm weights stored as w - 1 (layernorm 1p) (apply_layernorm_1p)")


def test_models_no_architecture_computes_exactly_are_refused(mcore, tmp_path, capsys):
    _refused(capsys, mcore[("gqa", 2, 1)], tmp_path / "a", "2 query groups for 8 heads (GPT-2 has multi-head")
    _refused(capsys, mcore[("swiglu", 2, 1)], tmp_path / "e", "LayerNorm with a SwiGLU MLP")
    _refused(capsys, mcore[("llama", 2, 1)], tmp_path / "b", "--quantize: Hugging Face safetensors has no place",
             "--quantize")
    _refused(capsys, mcore[("llama", 2, 1)], tmp_path / "c", "--target-tp: the Hugging Face safetensors layout",
             "--target-tp", "2")
    _refused(capsys, mcore[("llama", 2, 1)], tmp_path / "d", "--max-shard-size: 'big' is not a size",
             "--max-shard-size", "big")


def test_the_flow_exports_from_s3_like_direct_and_reports_the_architecture(mcore, tmp_path, s3_server, s3_bucket,
                                                                           monkeypatch, prefect_env):
    """Through the Prefect flow, from S3, in shards: the same files as ``--direct``, and the run's
    report artifact names the architecture and why."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from conftest import output_bytes, upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.direct import run_direct
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    src, opts = mcore[("qwen", 2, 1)], {"to": "hf", "max_shard_size": "100KB"}
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(**opts))
    url, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch)
    out = run_flow(ReshardParams(source=url, destination=str(tmp_path / "flow"), storage_options=so,
                                 cache_dir=str(tmp_path / "cache"), **opts))
    assert output_bytes(tmp_path / "flow") == output_bytes(tmp_path / "direct")
    assert (tmp_path / "flow" / "model.safetensors.index.json").is_file()
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(str(out["flow_run_id"]))])))
    report = next(a.data for a in arts if a.key == "reshard-report")
    assert "architecture Qwen2ForCausalLM: RMSNorm, SwiGLU, rotary, biases on the fused QKV only" in report
    assert "rope_theta 50000" in report and "model-00001-of-" in report


def _large_mlp_inputs(sd: dict) -> dict:
    """fc1 weights x 10 (on every rank alike): pre-activations of order 1, where exact GELU and its
    tanh form differ (at megatron-core's small initial weights they move the logits by ~1e-5 only);
    the tied embedding x 20 (the input layer norm undoes it; the logits grow to ~30)."""
    for k, v in sd["model"].items():
        if k.endswith("mlp.linear_fc1.weight"):
            sd["model"][k] = v * 10
        elif k == "embedding.word_embeddings.weight":
            sd["model"][k] = v * 20
    return sd


def test_the_gelu_variant_is_caught_where_it_matters(mcore, tmp_path):
    """GPT-2 export of a model whose MLP inputs are large: transformers' logits equal the
    independent megatron-core forward (``mcore_reference``, itself checked against megatron-core),
    and with the tanh GELU (``gelu_new``) they do not."""
    from mcore_fixtures import model_options
    from mcore_reference import Arch, core_logits

    src = rewrite_run(mcore[("mha", 2, 1)], tmp_path / "src", _large_mlp_inputs)
    o = model_options("mha")
    want = core_logits([rank_module(src, r) for r in range(2)], Arch(o["layers"], o["heads"], o["heads"]),
                       torch.tensor(TOKENS))
    good = _export(src, tmp_path / "good")
    assert (hf_logits(good) - want).abs().max() < TOL
    bad = mutated_copy(good, tmp_path / "bad", config={"activation_function": "gelu_new"})
    diff = (hf_logits(bad) - want).abs().max().item()
    assert diff > 10 * TOL, f"gelu_new moved the logits only {diff:.2e}"


def _one_norm_in_half_precision(sd: dict) -> dict:
    key = "decoder.layers.0.input_layernorm.weight"
    sd["model"][key] = sd["model"][key].half()
    return sd


def test_mixed_dtypes_are_refused_and_plan_names_the_shards(mcore, tmp_path, capsys):
    mixed = rewrite_run(mcore[("llama", 2, 1)], tmp_path / "mixed", _one_norm_in_half_precision)
    _refused(capsys, mixed, tmp_path / "out", "--to hf: the weights mix dtypes")
    capsys.readouterr()
    assert main(["plan", str(mcore[("llama", 2, 1)]), "--to", "hf", "--max-shard-size", "100KB"]) == 0
    out = capsys.readouterr().out
    assert "-> hf" in out and "model-00001-of-00004.safetensors: reads source ranks [0, 1]" in out, out


@pytest.mark.parametrize("shard", [None, "100KB"])
def test_the_manifest_hashes_are_the_files_hashes(mcore, tmp_path, shard):
    """Each file's SHA-256 is computed while writing (a fused QKV's K and V rows land ahead of the
    hashed prefix and are read back); it must be the hash of the bytes on disk."""
    import hashlib

    out = _export(mcore[("qwen", 2, 1)], tmp_path / "hf", *(["--max-shard-size", shard] if shard else []))
    records = json.loads((out / "reshard_manifest.json").read_text())["files"]
    weights = [r for r in records if r["path"].endswith(".safetensors")]
    assert len(weights) == (1 if shard is None else 4)
    for r in weights:
        assert r["sha256"] == hashlib.sha256((out / r["path"]).read_bytes()).hexdigest(), r["path"]


@pytest.mark.parametrize("runs", [[(0, 8, 100), (0, 8, 200)], [(0, 8, 100), (2, 3, 200)], [(0, 6, 100), (4, 6, 200)],
                                  [(0, 3, 100), (5, 3, 200)], [(0, 8, 100), (0, 8, 200), (3, 2, 300)]],
                         ids=["duplicate", "nested", "partial", "disjoint", "three"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_every_byte_reaches_every_run_that_covers_it(runs, chunk):
    """The writer's scatter of a tensor's bytes (in chunks of any size) to its outputs' byte runs,
    where runs overlap (DeepSeek's copies of the embeddings are runs of the same bytes)."""
    from reshard.formats.hf import ScatterSink

    class Writer:
        def __init__(self) -> None:
            self.file: dict[int, int] = {}

        def put(self, item) -> None:
            piece, offset, _release, _keep = item
            for i, byte in enumerate(bytes(piece)):
                assert offset + i not in self.file, "a byte written twice"
                self.file[offset + i] = byte

    data = bytes(range(1, 13))
    writer = Writer()
    sink = ScatterSink(writer, sorted(runs), "t")
    for lo in range(0, len(data), chunk):
        sink.write(torch.frombuffer(bytearray(data[lo:lo + chunk]), dtype=torch.uint8))
    sink.finish(len(data))
    want = {dst + i: data[src + i] for src, length, dst in runs for i in range(length)}
    assert writer.file == want



def test_a_decision_asked_again_of_edited_args_is_decided_again():
    """The built-ins that claim a model by its shape share one answer per model
    (``hf_common.asked_in_turn``); the same ``args`` object edited in place is another model."""
    import argparse

    from reshard.core.errors import LayoutError
    from reshard.core.plan_types import ModelFacts
    from reshard.models.hf_registry import decide_export

    layer = "decoder.layers.0."
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
            *(layer + k for k in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                  "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                                  "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"))}
    facts = ModelFacts(naming="megatron-core", num_layers=1, hidden=32, heads=4, query_groups=4, head_dim=8,
                       swiglu=True, tied_embeddings=False, vocab_size=64, padded_vocab_source=64,
                       padded_vocab_target=None, make_vocab_size_divisible_by=None, source_pp_layers=(1,),
                       target_pp_layers=(1,))
    args = argparse.Namespace(normalization="RMSNorm", position_embedding_type="rope", norm_epsilon=1e-5)
    widths = {"dense": 64}
    assert decide_export(args, facts, keys, torch.float32, widths).config["rms_norm_eps"] == 1e-5
    args.norm_epsilon = 1e-6
    assert decide_export(args, facts, keys, torch.float32, widths).config["rms_norm_eps"] == 1e-6
    args.squared_relu = True
    with pytest.raises(LayoutError, match=r"squared ReLU \(squared_relu\)"):
        decide_export(args, facts, keys, torch.float32, widths)
