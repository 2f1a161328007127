"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``) everywhere reshard goes: torch_dist in and out,
pipeline stages together with expert parallelism, FP8 block releases in, checked against
transformers and megatron-core 0.16.1 (``--quantize fp8`` out: ``tests/test_fp8_export.py``).

Sources: a tiny random Qwen3-MoE made by transformers (float32, fixed seed, norms distinct from
ones: query/key norms per head, a head dim above hidden / heads, a dense first layer and three MoE
layers of 4 experts, top-2 renormalized), its FP8 block copy, and megatron-core's own model of the
same kind written by megatron-core at TP 1 x EP 2 x PP 2 (per-rank files) and TP 2 x EP 2
(torch_dist). megatron-core builds each output from its saved ``args``, loads it strictly (per-rank
``load_state_dict(strict=True)``; torch_dist through ``dist_checkpointing.load``) and must give
transformers' logits; transformers loads each ``--to hf`` output at default strictness and must give
megatron-core's. Two harness runs: megatron-core's writes, then every forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_fixtures import TOKENS, moe_options, needs_mcore, run_harness
from reshard.cli import main
from reshard.core.safe_load import load_shard
from test_hf_export import hf_logits, hf_tensors
from test_hf_import import make_fp8_folder, tensors_folder

pytestmark = needs_mcore
TOL = 2e-5
VOCAB = 256
CONFIG = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
          "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
          "mlp_only_layers": [0], "norm_topk_prob": True, "head_dim": 16}
#: megatron-core's own Qwen3-MoE-like model (the harness's options): query/key norms, a dense first layer.
MCORE_MODEL = {**moe_options("qwen3_moe"), "layers": 4, "moe_layer_freq": [0, 1, 1, 1]}


def make_qwen3_moe(folder: Path) -> torch.Tensor:
    """Save a random Qwen3MoeForCausalLM of :data:`CONFIG` to ``folder``; its logits for the test tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG, initializer_range=0.1)).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def _run(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), *extra]) == 0
    return out


def _layout(tp: int, ep: int, pp: int = 1) -> tuple[str, ...]:
    return "--target-tp", str(tp), "--target-ep", str(ep), "--target-pp", str(pp)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The conversions and megatron-core's logits of each (``got``), transformers' (``want``)."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    mcore_pp, mcore_dist = root / "mcore_tp1_ep2_pp2", root / "mcore_dist_tp2_ep2"
    run_harness([{"kind": "write", "out": str(mcore_pp), "tp": 1, "ep": 2, "pp": 2, "model": MCORE_MODEL,
                  "tokens": TOKENS},
                 {"kind": "write_dist", "out": str(mcore_dist), "tp": 2, "ep": 2, "model": MCORE_MODEL,
                  "tokens": TOKENS}], root)
    hf, fp8 = root / "hf", root / "hf_fp8"
    want = {"hf": make_qwen3_moe(hf)}
    encoded = make_fp8_folder(hf, fp8, torch.float32)
    want["fp8"] = hf_logits(tensors_folder(encoded, hf, root / "hf_fp8_dequantized"))
    runs = {  # name -> (folder, (tp, ep, pp) megatron-core loads it at, torch_dist, the logits it must give)
        "hf_pp2_ep2": (_run(hf, root / "hf_pp2_ep2", *_layout(1, 2, 2)), (1, 2, 2), False, want["hf"]),
        "hf_dist": (_run(hf, root / "hf_dist", "--to", "torch_dist"), (2, 2, 1), True, want["hf"]),
        "fp8_tp2_ep2": (_run(fp8, root / "fp8_tp2_ep2", *_layout(2, 2)), (2, 2, 1), False, want["fp8"]),
    }
    runs["hf_dist_pp2_ep2"] = (_run(runs["hf_dist"][0], root / "hf_dist_pp2_ep2", *_layout(1, 2, 2)), (1, 2, 2),
                               False, want["hf"])
    mcore_logits = torch.load(mcore_dist / "logits.pt")
    runs["mcore_dist_ep4"] = (_run(mcore_dist, root / "mcore_dist_ep4", *_layout(1, 4)), (1, 4, 1), False,
                              mcore_logits)
    runs["mcore_pp2_ep2_dist"] = (_run(mcore_pp, root / "mcore_pp2_ep2_dist", "--to", "torch_dist"), (2, 2, 1),
                                  True, torch.load(mcore_pp / "logits.pt"))
    jobs = [{"kind": "forward_dist" if dist else "forward", "ckpt": str(folder), "tp": tp, "ep": ep, "pp": pp,
             "from_args": True, "model": {}, "tokens": TOKENS, "out": str(root / f"forward_{i}.pt")}
            for i, (folder, (tp, ep, pp), dist, _) in enumerate(runs.values())]
    run_harness(jobs, root)
    got = {name: torch.load(job["out"]) for name, job in zip(runs, jobs)}
    return {"root": root, "hf": hf, "fp8": fp8, "encoded": encoded, "want": want, "runs": runs, "got": got,
            "mcore_pp": mcore_pp, "mcore_dist": mcore_dist}


@pytest.mark.parametrize("name", ["hf_pp2_ep2", "hf_dist", "hf_dist_pp2_ep2", "fp8_tp2_ep2", "mcore_dist_ep4",
                                  "mcore_pp2_ep2_dist"])
def test_megatron_core_loads_each_output_strictly_with_the_sources_logits(qwen3, name):
    *_, want = qwen3["runs"][name]
    got = qwen3["got"][name][:, :want.shape[-1]]
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_the_fp8_comparison_is_not_the_full_precision_model(qwen3):
    assert (qwen3["want"]["fp8"] - qwen3["want"]["hf"]).abs().max() > 100 * TOL
    assert (qwen3["got"]["fp8_tp2_ep2"][:, :VOCAB] - qwen3["want"]["hf"]).abs().max() > 100 * TOL


@pytest.mark.parametrize("name", ["hf_pp2_ep2", "hf_dist", "hf_dist_pp2_ep2"])
def test_every_output_exports_back_to_the_same_tensors(qwen3, tmp_path, name):
    out = _run(qwen3["runs"][name][0], tmp_path / "hf", "--to", "hf")
    want, got = hf_tensors(qwen3["hf"]), hf_tensors(out)
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((qwen3["hf"] / "config.json").read_text())
    for key in ("num_experts_per_tok", "mlp_only_layers", "norm_topk_prob", "head_dim", "moe_intermediate_size",
                "intermediate_size"):
        assert config[key] == source[key], key
    assert config["num_experts"] == source["num_local_experts"]  # transformers reads either


def test_an_fp8_release_is_read_as_the_model_it_encodes(qwen3, tmp_path):
    got = hf_tensors(_run(qwen3["fp8"], tmp_path / "hf", "--to", "hf"))
    assert sorted(got) == sorted(qwen3["encoded"])
    assert all(torch.equal(got[k], v) for k, v in qwen3["encoded"].items())


@pytest.mark.parametrize("name", ["mcore_pp", "mcore_dist"])
def test_transformers_runs_megatron_cores_own_checkpoints_with_their_logits(qwen3, tmp_path, name):
    """megatron-core's TP 1 x EP 2 x PP 2 per-rank files and TP 2 x EP 2 torch_dist folder -> --to hf."""
    src = qwen3[name]
    out = _run(src, tmp_path / "hf", "--to", "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    torch.testing.assert_close(hf_logits(out), torch.load(src / "logits.pt")[:, :128], rtol=0, atol=TOL)


def test_both_spellings_of_the_expert_count_read_alike(qwen3, tmp_path):
    """transformers 5 writes ``num_local_experts``; Qwen's releases (transformers 4) ``num_experts``."""
    config = json.loads((qwen3["hf"] / "config.json").read_text())
    assert config["num_local_experts"] == 4 and "num_experts" not in config
    old = tmp_path / "num_experts"
    shutil.copytree(qwen3["hf"], old)
    config["num_experts"] = config.pop("num_local_experts")
    (old / "config.json").write_text(json.dumps(config))
    a = _run(qwen3["hf"], tmp_path / "a", *_layout(1, 2))
    b = _run(old, tmp_path / "b", *_layout(1, 2))
    for f in sorted(a.rglob("model_optim_rng.pt")):
        x, y = load_shard(f), load_shard(b / f.relative_to(a))
        assert x["args"].num_experts == y["args"].num_experts == 4
        assert x["model"].keys() == y["model"].keys()
        assert all(torch.equal(v, y["model"][k]) for k, v in x["model"].items() if isinstance(v, torch.Tensor))
