"""Nemotron-H (transformers' ``NemotronHForCausalLM``) <-> megatron-core's hybrid ``MambaModel``: a tiny
model transformers builds (Mamba-2, MLP, attention and MoE layers, two groups of Mamba heads, 4 routed
experts and a shared one) is imported to megatron-core at TP 1, TP 2 and TP 2 x EP 2, whose forward
gives transformers' logits; a checkpoint megatron-core writes at TP 2 x EP 2 goes ``--to hf`` into a
folder transformers loads at default strictness with megatron-core's logits; HF -> TP 2 x EP 2
(x PP 2) -> HF gives back every tensor bit for bit.

The layout is checked tensor by tensor too: each rank's ``in_proj`` is its slice of each of
``[z; x; B; C; dt]`` (B and C whole groups), its ``conv1d`` its slice of each of ``[x; B; C]``, its
``A_log``, ``D``, ``dt_bias`` and gated-norm weight its heads' and groups' rows. megatron-core's
Mamba mixer needs ``mamba_ssm``'s Triton kernels and Transformer Engine: it runs here with the
stand-ins :mod:`mcore_mamba` names (the SSD scan and the gated norm written from their definitions),
all jobs in one launch (:func:`mamba`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_fixtures import TOKENS, needs_mcore
from reshard.cli import main
from reshard.core.safe_load import load_shard
from test_fp8_export import dequantized

TOL = 2e-5
#: Mamba, MLP, attention, MoE, Mamba, MoE: a pipeline split in two starts its second stage with MoE.
PATTERN = "M-*EME"
CONFIG = {"vocab_size": 96, "hidden_size": 32,
          "layers_block_type": ["mamba", "mlp", "attention", "moe", "mamba", "moe"],
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
          "ssm_state_size": 8, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2, "chunk_size": 4,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "moe_shared_expert_intermediate_size": 24, "max_position_embeddings": 64, "tie_word_embeddings": False}
#: The same architecture written by megatron-core itself (:func:`mcore_mamba.megatron_args`).
MCORE_MODEL = {"pattern": PATTERN, "hidden": 32, "ffn": 48, "heads": 4, "groups": 2, "head_dim": 8, "vocab": 96,
               "seq": 64, "state": 8, "mamba_head_dim": 8, "mamba_groups": 2, "mamba_heads": 8, "experts": 4,
               "topk": 2, "moe_ffn": 16, "shared_ffn": 24}
HARNESS = Path(__file__).with_name("mcore_mamba.py")
_M = "decoder.layers.{}.mixer."
#: Rows of each fused section in the whole model: in_proj's z, x, B, C, dt; conv1d's x, B, C.
D_INNER, GS, HEADS = 64, 16, 8
IN_PROJ = (D_INNER, D_INNER, GS, GS, HEADS)
CONV = (D_INNER, GS, GS)


def _run(*argv: str) -> None:
    assert main(["run", "--direct", *argv]) == 0


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _rank(folder: Path, rank_dir: str) -> dict:
    return load_shard(next(folder.glob(f"*/{rank_dir}/model_optim_rng.pt")))


def _transformers(folder: Path):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                    output_loading_info=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0], info


def _saved_model(folder: Path, config: dict, seed: int) -> torch.Tensor:
    """A model transformers builds and saves in ``folder`` (fp32; norms and the mixer's vectors drawn
    away from their initial values); its logits."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.NemotronHConfig(**config, initializer_range=0.1), dtype=torch.float32).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith((".D", "conv1d.bias")):
                p.add_(torch.rand_like(p))  # distinct from their initial values: a misplaced one must show
            elif key.endswith("A_log"):
                p.add_(torch.rand_like(p) * 0.3)
            elif key.endswith("dt_bias"):  # every step above time_step_min, where transformers would clamp it
                p.add_(3.0)  # (megatron-core does not clamp: hf_nemotron_h's docstring)
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):  # transformers zeroes it: a misplaced one must show
                b.normal_(0, 0.1)
        want = model(torch.tensor([TOKENS])).logits[0]
    model.save_pretrained(folder)
    return want


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    """The folder transformers saves (the hybrid model with MoE layers) and its logits."""
    root = tmp_path_factory.mktemp("nemotron_h")
    return {"root": root, "hf": root / "hf", "want": _saved_model(root / "hf", CONFIG, 3)}


@pytest.fixture(scope="module")
def converted(hf) -> dict[str, Path]:
    """reshard's outputs: TP 1, TP 2, TP 2 x EP 2 (expert TP 1; and x PP 2), TP 2 x EP 2 at the default
    expert TP (2), PP 2 with one layer on the first stage, the first two back to HF; torch_dist and back."""
    root, src = hf["root"], str(hf["hf"])
    out = {name: root / name for name in ("tp1", "tp2", "tp2ep2", "tp2ep2pp2", "etp2", "uneven", "back", "back_pp",
                                          "dist", "back_dist")}
    _run(src, str(out["tp1"]), "--target-tp", "1")
    _run(src, str(out["tp2"]), "--target-tp", "2")
    ep2 = ("--target-tp", "2", "--target-ep", "2", "--target-etp", "1")
    _run(src, str(out["tp2ep2"]), *ep2)
    _run(src, str(out["tp2ep2pp2"]), *ep2, "--target-pp", "2")
    _run(src, str(out["etp2"]), "--target-tp", "2", "--target-ep", "2")  # the expert TP: the TP, by default
    _run(src, str(out["uneven"]), "--target-tp", "1", "--target-pp", "2", "--target-first-stage-layers", "1")
    _run(str(out["tp2ep2"]), str(out["back"]), "--to", "hf")
    _run(str(out["tp2ep2pp2"]), str(out["back_pp"]), "--to", "hf")
    _run(src, str(out["dist"]), "--to", "torch_dist")
    _run(str(out["dist"]), str(out["back_dist"]), "--to", "hf")
    return out


@pytest.fixture(scope="module")
def mamba(hf, converted) -> dict:
    """One launch of megatron-core's MambaModel (:mod:`mcore_mamba`): it writes its own model at TP 2 x
    EP 2 and runs the imports at TP 1, TP 2 and TP 2 x EP 2, each built from the checkpoint's own args;
    and in torch_dist; then its checkpoints go ``--to hf``, the torch_dist one to its per-rank layout too."""
    root = hf["root"]
    work = root / "harness"
    work.mkdir()
    forward = {"kind": "forward", "tokens": TOKENS}
    ep2 = {"tp": 2, "ep": 2, "etp": 1}
    jobs = [{"kind": "write", "out": str(root / "mcore"), **ep2, "model": MCORE_MODEL, "tokens": TOKENS},
            {**forward, "ckpt": str(converted["tp1"]), "tp": 1, "out": str(work / "tp1.pt")},
            {**forward, "ckpt": str(converted["tp2"]), "tp": 2, "out": str(work / "tp2.pt")},
            {**forward, "ckpt": str(converted["tp2ep2"]), **ep2, "out": str(work / "tp2ep2.pt")},
            {**forward, "ckpt": str(converted["tp2ep2pp2"]), **ep2, "pp": 2, "out": str(work / "tp2ep2pp2.pt")},
            {**forward, "ckpt": str(converted["uneven"]), "tp": 1, "pp": 2, "out": str(work / "uneven.pt")},
            {**forward, "ckpt": str(converted["etp2"]), "tp": 2, "ep": 2, "etp": 2, "out": str(work / "etp2.pt")},
            {**forward, "kind": "forward_dist", "ckpt": str(converted["dist"]), **ep2, "out": str(work / "dist.pt")},
            {"kind": "write_dist", "out": str(root / "mcore_dist"), **ep2, "model": MCORE_MODEL, "tokens": TOKENS}]
    (work / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(HARNESS), str(work / "jobs.json")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    _run(str(root / "mcore"), str(root / "mcore_hf"), "--to", "hf")
    _run(str(root / "mcore_dist"), str(root / "mcore_dist_hf"), "--to", "hf")
    _run(str(root / "mcore_dist"), str(root / "mcore_dist_ranks"), "--target-tp", "2", "--target-ep", "2",
         "--target-etp", "1")
    return {"logits": {k: torch.load(work / f"{k}.pt") for k in ("tp1", "tp2", "tp2ep2", "tp2ep2pp2", "etp2",
                                                                       "uneven", "dist")},
            "mcore": torch.load(root / "mcore" / "logits.pt"), "mcore_hf": root / "mcore_hf",
            "mcore_dist": torch.load(root / "mcore_dist" / "logits.pt"), "mcore_dist_hf": root / "mcore_dist_hf",
            "mcore_dist_ranks": root / "mcore_dist_ranks"}


# --- megatron-core computes what transformers computes --------------------------------------------

@needs_mcore
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2ep2", "tp2ep2pp2", "etp2", "uneven", "dist"])
def test_megatron_core_runs_the_import_with_transformers_logits(hf, mamba, layout):
    """The per-rank imports strict-loaded (at PP 2 the second stage starts with an MoE layer, or, one
    layer on the first stage (``decoder_first_pipeline_num_layers``), with the MLP: megatron-core's
    ``MambaStack`` choosing its layers of the pattern); the torch_dist output loaded by megatron-core's
    ``dist_checkpointing`` (in_proj and conv1d as their split keys, the grouped experts as
    ``TEGroupedMLP.sharded_state_dict`` keys them) at TP 2 x EP 2."""
    got, want = mamba["logits"][layout], hf["want"]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()


@needs_mcore
def test_a_megatron_core_torch_dist_checkpoint_goes_to_hf_with_its_logits(mamba):
    """megatron-core's own TP 2 x EP 2 torch_dist save (``in_proj.weight.z`` ... ``conv1d.bias.C`` fused
    back on reading; the grouped experts on the expert axis), ``--to hf``: transformers' logits are
    megatron-core's."""
    got, info = _transformers(mamba["mcore_dist_hf"])
    assert not any(info.values()), info
    assert torch.allclose(got, mamba["mcore_dist"], atol=TOL, rtol=0), (got - mamba["mcore_dist"]).abs().max()


def test_torch_dist_holds_the_split_keys_and_the_grouped_experts(hf, converted):
    """The torch_dist output keys each layer apart, the mixer's fused tensors as megatron-core's
    sharded state dict splits them, an MoE layer's grouped experts as ``TEGroupedMLP``'s (SequentialMLP's
    keys: the global expert axis leading, one extra state per expert) beside its own
    ``pre_mlp_layernorm``, and reads back bit for bit."""
    from reshard.core.dcp_metadata import read_metadata

    meta = read_metadata(next(converted["dist"].glob("iter_*/.metadata")))
    keys = set(meta.tensors)
    assert {f"decoder.layers.0.mixer.in_proj.weight.{p}" for p in ("z", "x", "B", "C", "dt")} <= keys
    assert {f"decoder.layers.4.mixer.conv1d.bias.{p}" for p in ("x", "B", "C")} <= keys
    assert "decoder.layers.0.mixer.in_proj.weight" not in keys
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in keys
    experts = "decoder.layers.3.mlp.experts.experts."
    assert meta.tensors[experts + "linear_fc1.weight"].shape == (4, 16, 32)
    assert meta.tensors[experts + "linear_fc2.weight"].shape == (4, 32, 16)
    extra = {experts + f"linear_fc{i}._extra_state/shard_{e}_4" for i in (1, 2) for e in range(4)}
    assert extra <= set(meta.byte_items)
    assert "decoder.layers.3.pre_mlp_layernorm.weight" in keys
    want, got = _tensors(hf["hf"]), _tensors(converted["back_dist"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], t) for k, t in want.items())


@needs_mcore
def test_a_megatron_core_torch_dist_checkpoint_reads_into_its_own_rank_files(hf, mamba):
    """megatron-core's TP 2 x EP 2 torch_dist save, written in its per-rank layout at that layout: every
    rank file holds what megatron-core's own per-rank save of the same model holds (the same seed), the
    experts under grouped GEMM's names with the linear layer's one extra state."""
    for folder in sorted((hf["root"] / "mcore").glob("*/mp_rank_*")):
        theirs = torch.load(folder / "model_optim_rng.pt", weights_only=False)["model"]
        ours = _rank(mamba["mcore_dist_ranks"], folder.name)["model"]
        assert set(ours) == set(theirs), set(ours) ^ set(theirs)
        for key, value in theirs.items():
            assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key


@needs_mcore
def test_a_megatron_core_checkpoint_goes_to_hf_with_its_logits(mamba):
    """megatron-core's own TP 2 x EP 2 checkpoint, ``--to hf``: transformers loads it at default strictness
    and computes megatron-core's logits (the export's ``time_step_min`` 0: no clamp of the steps)."""
    got, info = _transformers(mamba["mcore_hf"])
    assert not any(info.values()), info
    assert torch.allclose(got, mamba["mcore"], atol=TOL, rtol=0), (got - mamba["mcore"]).abs().max()
    config = json.loads((mamba["mcore_hf"] / "config.json").read_text())
    assert (config["hybrid_override_pattern"], config["n_groups"], config["time_step_min"]) == (PATTERN, 2, 0.0)


# --- the layout, tensor by tensor ---------------------------------------------------------------

def _sections(full: torch.Tensor, rows: tuple[int, ...], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank`` of ``tp``'s rows: its slice of each section, as megatron-core's mixer holds them."""
    out, first = [], 0
    for n in rows:
        out.append(full[first + rank * n // tp:first + (rank + 1) * n // tp])
        first += n
    return torch.cat(out)


def test_each_rank_holds_its_slice_of_every_section(hf, converted):
    """TP 2: ``in_proj`` per section (z, x by heads; B, C by whole groups; dt by heads), ``conv1d``
    per section (x, B, C), ``A_log`` (not A), ``D``, ``dt_bias`` by heads, the gated norm by groups;
    the layer norms of every kind under Transformer Engine's fused names."""
    src = _tensors(hf["hf"])
    for rank in range(2):
        module = _rank(converted["tp2"], f"mp_rank_{rank:02d}")["model"]
        for layer in (0, 4):
            h, m = f"backbone.layers.{layer}.mixer.", _M.format(layer)
            assert torch.equal(module[m + "in_proj.weight"], _sections(src[h + "in_proj.weight"], IN_PROJ, 2, rank))
            for p in ("weight", "bias"):
                assert torch.equal(module[m + f"conv1d.{p}"], _sections(src[h + f"conv1d.{p}"], CONV, 2, rank))
            for p in ("A_log", "D", "dt_bias"):
                assert torch.equal(module[m + p], src[h + p].chunk(2)[rank]), p
            assert torch.equal(module[m + "norm.weight"], src[h + "norm.weight"].chunk(2)[rank])
            assert torch.equal(module[m + "out_proj.weight"], src[h + "out_proj.weight"].chunk(2, dim=1)[rank])
            assert torch.equal(module[m + "in_proj.layer_norm_weight"], src[f"backbone.layers.{layer}.norm.weight"])
        assert torch.equal(module["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                           src["backbone.layers.1.norm.weight"])
        assert torch.equal(module["decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"],
                           src["backbone.layers.2.norm.weight"])
        assert torch.equal(module["decoder.layers.3.pre_mlp_layernorm.weight"], src["backbone.layers.3.norm.weight"])
        assert torch.equal(module["decoder.final_norm.weight"], src["backbone.norm_f.weight"])


def test_expert_parallel_ranks_hold_their_experts_grouped(hf, converted):
    """TP 2 x EP 2 (world 2: the files of TP rank r and EP rank r, as Megatron-LM saves them): EP rank
    e holds experts 2e and 2e + 1 as megatron-core's stack spec names them (``linear_fc1.weight{i}``,
    local numbers), whole (expert TP 1); the router and its expert bias and the shared expert (split
    over TP) on every rank."""
    src = _tensors(hf["hf"])
    for tp_rank in range(2):
        module = _rank(converted["tp2ep2"], f"mp_rank_{tp_rank:02d}_{tp_rank:03d}")["model"]
        h, m = "backbone.layers.5.mixer.", "decoder.layers.5.mlp."
        for local, expert in ((0, 2 * tp_rank), (1, 2 * tp_rank + 1)):
            assert torch.equal(module[m + f"experts.linear_fc1.weight{local}"],
                               src[h + f"experts.{expert}.up_proj.weight"])
            assert torch.equal(module[m + f"experts.linear_fc2.weight{local}"],
                               src[h + f"experts.{expert}.down_proj.weight"])
        assert torch.equal(module[m + "router.weight"], src[h + "gate.weight"])
        assert torch.equal(module[m + "router.expert_bias"], src[h + "gate.e_score_correction_bias"])
        assert torch.equal(module[m + "shared_experts.linear_fc1.weight"],
                           src[h + "shared_experts.up_proj.weight"].chunk(2)[tp_rank])


@needs_mcore
def test_the_import_holds_megatron_cores_own_entries_and_args(converted, mamba, hf):
    """The TP 2 x EP 2 import's rank files hold the entries megatron-core's own TP 2 x EP 2 checkpoint
    holds, with the args that rebuild the model (``--use-checkpoint-args``) and the vocabulary padded
    as Megatron-LM pads it."""
    for rank in range(2):
        ours = _rank(converted["tp2ep2"], f"mp_rank_{rank:02d}_{rank:03d}")
        folder = next((hf["root"] / "mcore").glob(f"*/mp_rank_{rank:02d}_{rank:03d}"))
        theirs = torch.load(folder / "model_optim_rng.pt", weights_only=False)
        assert set(ours["model"]) == set(theirs["model"])
        assert {k: tuple(v.shape) for k, v in ours["model"].items() if v is not None} == \
               {k: tuple(v.shape) for k, v in theirs["model"].items() if v is not None}
    args = _rank(converted["tp2ep2"], "mp_rank_00_000")["args"]
    assert (args.hybrid_override_pattern, args.is_hybrid_model, args.mamba_num_heads, args.mamba_head_dim,
            args.mamba_num_groups, args.mamba_state_dim) == (PATTERN, True, 8, 8, 2, 8)
    assert (args.squared_relu, args.swiglu, args.position_embedding_type, args.add_bias_linear) == \
           (True, False, "none", False)
    assert args.spec == ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    assert (args.num_experts, args.moe_router_topk, args.moe_router_score_function, args.moe_router_enable_expert_bias,
            args.moe_shared_expert_intermediate_size, args.expert_model_parallel_size) == (4, 2, "sigmoid", True, 24, 2)


@pytest.mark.parametrize("back", ["back", "back_pp"])
def test_hf_to_megatron_and_back_gives_every_tensor_bit_for_bit(hf, converted, back):
    want, got = _tensors(hf["hf"]), _tensors(converted[back])
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    logits, info = _transformers(converted[back])
    assert not any(info.values()), info


def test_pipeline_stages_split_the_hybrid_pattern(converted):
    """PP 2 over ``M-*EME``: stage 1 starts with an MoE layer, its layers numbered from 0."""
    second = _rank(converted["tp2ep2pp2"], "mp_rank_01_001_001")["model"]
    assert "decoder.layers.0.mlp.router.weight" in second
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight1" in second
    assert "decoder.layers.1.mixer.in_proj.weight" in second and "decoder.final_norm.weight" in second
    assert not any(k.startswith("decoder.layers.3.") for k in second)


def test_the_older_pattern_spelling_reads_alike(hf, converted, tmp_path):
    """A config.json with ``hybrid_override_pattern`` (no ``layers_block_type``) imports to the same files."""
    src = shutil.copytree(hf["hf"], tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    del config["layers_block_type"]
    (src / "config.json").write_text(json.dumps({**config, "hybrid_override_pattern": PATTERN}))
    _run(str(src), str(tmp_path / "tp2"), "--target-tp", "2")
    for rank in range(2):
        a, b = (_rank(f, f"mp_rank_{rank:02d}") for f in (converted["tp2"], tmp_path / "tp2"))
        assert a["model"].keys() == b["model"].keys()
        assert all(v is None or torch.equal(v, b["model"][k]) for k, v in a["model"].items())


#: Megatron-LM's own args for this model from megatron-core 0.19's parser (``--hybrid-layer-pattern``;
#: ``tests/realtools/args_snapshots.py``), and the keys a checkpoint's layout and vocabulary decide.
V019_ARGS = Path(__file__).parent / "fixtures" / "realtools" / "megatron-lm-args" / "nemotron-h.json"
CHECKPOINT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size", "ckpt_format", "transformer_impl", "vocab_size",
                   "padded_vocab_size", "hf_token_ids")


def _with_v019_args(checkpoint: Path, dst: Path, **changes: object) -> Path:
    """A copy of ``checkpoint`` whose rank files hold megatron-core 0.19's args for the model (its layout
    and vocabulary kept), with ``changes``."""
    import argparse

    from reshard.core import foreign
    from reshard.models.megatron_args import decode

    snap = {k: decode(v) for k, v in json.loads(V019_ARGS.read_text())["args"].items()}
    assert (snap["hybrid_layer_pattern"], snap["hybrid_override_pattern"]) == (PATTERN, None)
    shutil.copytree(checkpoint, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        state = load_shard(f, mmap=False)
        own = vars(state["args"])
        state["args"] = argparse.Namespace(**{**snap, **{k: own[k] for k in CHECKPOINT_KEYS if k in own}, **changes})
        foreign.save(state, f)
    return dst


def test_megatron_core_0_19s_args_read_alike(hf, converted, tmp_path):
    """megatron-core 0.19 saves the layer pattern as ``hybrid_layer_pattern`` (``hybrid_override_pattern``
    None): the TP 2 x EP 2 import with its args replaced by 0.19's own is read as the same model, its
    pattern and mixer sizes from them, and goes back to HF bit for bit."""
    from reshard import api

    src = _with_v019_args(converted["tp2ep2"], tmp_path / "v019")
    described = api.inspect(str(src))
    assert (described["hybrid_override_pattern"], described["mixer"]) == (
        PATTERN, {"mamba_num_heads": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, "mamba_state_dim": 8})
    _run(str(src), str(tmp_path / "back"), "--to", "hf")
    want, got = _tensors(hf["hf"]), _tensors(tmp_path / "back")
    assert want.keys() == got.keys()
    assert all(torch.equal(v, got[k]) for k, v in want.items())


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    ({"conv_kernel": 3}, "conv_kernel 3 (megatron-core's causal conv has kernel 4)"),
    ({"use_bias": True}, "use_bias True (megatron-core's mixer has no linear biases)"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu' (megatron-core's mixer activation is SiLU)"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06 (transformers' mixer norm takes it"),
    ({"layers_block_type": ["mamba", "mlp", "attention"]}, "layer pattern 'M-*' has 3"),
    ({"norm_topk_prob": False}, "norm_topk_prob False with top-2 (megatron-core normalises"),
    ({"n_group": 2, "topk_group": 1}, "n_group 2 (transformers scores a group by its top 2"),
])
def test_a_config_megatron_core_does_not_compute_is_refused_in_one_line(hf, tmp_path, capsys, change, needle):
    src = shutil.copytree(hf["hf"], tmp_path / "hf")
    config = {**json.loads((hf["hf"] / "config.json").read_text()), **change}
    if "layers_block_type" in change:
        config["num_hidden_layers"] = 6
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(tmp_path / "o"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("pattern", ["M-*|EME", "M-*EME/ME"])
@pytest.mark.parametrize("target", [("--to", "hf"), ("--target-tp", "1")])
def test_a_pattern_with_0_19s_stage_or_mtp_separators_is_refused_in_one_line(converted, tmp_path, capsys, pattern,
                                                                             target):
    """megatron-core 0.19's ``|`` (pipeline segments: the source's stages, not an even split) and ``/``
    (multi-token prediction depths) are not read: refused, naming the arg, before anything is written
    (a TP change used to pass, its args keeping segments the output does not have)."""
    src = _with_v019_args(converted["tp2"], tmp_path / "v019", hybrid_layer_pattern=pattern)
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(tmp_path / "o"), *target]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reshard: error: args.hybrid_layer_pattern:") and len(err.splitlines()) == 1, err
    assert f"the saved layer pattern {pattern!r} lays out pipeline segments" in err, err
    assert not (tmp_path / "o").exists()


def test_a_tp_the_groups_do_not_divide_by_is_refused_in_one_line(hf, tmp_path, capsys):
    """2 groups over 4 ranks: megatron-core asserts ``ngroups % tp_size == 0``; refused before writing."""
    capsys.readouterr()
    assert main(["run", "--direct", str(hf["hf"]), str(tmp_path / "o"), "--target-tp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reshard: error: --target-tp:") and len(err.splitlines()) == 1, err
    assert "2 groups (args.mamba_num_groups, n_groups) and 8 heads do not divide over 4" in err, err
    assert "(fix: choose a target TP among 1, 2)" in err, err
    assert not (tmp_path / "o").exists()


# --- FP8 blocks out and in -------------------------------------------------------------------------

#: The linear layers' weights ``--quantize fp8`` encodes (the mixer's projections, attention, MLPs,
#: routed and shared experts); the conv, the mixer's vectors, norms, router, embeddings and head keep
#: their dtype.
FP8_LINEAR = re.compile(r"\.(?:in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)\.weight$")


def test_fp8_blocks_out_and_back_in(converted, tmp_path):
    """``--to hf --quantize fp8`` (blocks of 8): exactly the linear weights become e4m3 blocks with their
    scales; transformers loads the folder at default strictness with the logits of the model the
    blocks encode; reshard reads it to megatron-core at TP 2 x EP 2 and back as that model, bit for bit."""
    fp8_dir, encoded = tmp_path / "fp8", tmp_path / "encoded"
    _run(str(converted["tp2ep2"]), str(fp8_dir), "--to", "hf", "--quantize", "fp8", "--fp8-block", "8")
    fp8, plain = _tensors(fp8_dir), _tensors(converted["back"])
    linear = {k for k in plain if FP8_LINEAR.search(k)}
    assert {k for k, v in fp8.items() if v.dtype == torch.float8_e4m3fn} == linear
    assert set(fp8) == set(plain) | {k + "_scale_inv" for k in linear}
    want = {k: dequantized(fp8[k], fp8[k + "_scale_inv"], (8, 8)) if k in linear else v for k, v in plain.items()}
    encoded.mkdir()
    (encoded / "config.json").write_text((converted["back"] / "config.json").read_text())
    save_file(want, str(encoded / "model.safetensors"), metadata={"format": "pt"})
    got, info = _transformers(fp8_dir)
    assert not any(info.values()), info
    ref = _transformers(encoded)[0]
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()  # transformers runs FP8 models in bf16 on a CPU
    _run(str(fp8_dir), str(tmp_path / "tp2ep2"), "--target-tp", "2", "--target-ep", "2", "--target-etp", "1")
    _run(str(tmp_path / "tp2ep2"), str(tmp_path / "again"), "--to", "hf")
    again = _tensors(tmp_path / "again")
    assert sorted(again) == sorted(want)
    assert all(torch.equal(again[k], t) for k, t in want.items())


def test_a_bf16_folder_keeps_its_float32_router_both_ways(hf, tmp_path):
    """A bf16 folder as transformers saves it (the router's ``gate.weight`` and
    ``e_score_correction_bias`` kept in float32, as megatron-core makes its router's) goes to TP 2 x
    EP 2 and back bit for bit, every dtype kept, ``config.json`` saying bfloat16."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf["hf"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    _run(str(tmp_path / "bf16"), str(tmp_path / "tp2ep2"), "--target-tp", "2", "--target-ep", "2",
         "--target-etp", "1")
    _run(str(tmp_path / "tp2ep2"), str(tmp_path / "back"), "--to", "hf")
    want, got = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "back")
    assert want["backbone.layers.3.mixer.gate.weight"].dtype == torch.float32
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_names_under_transformers_5s_in_memory_prefix_read_alike(hf, converted, tmp_path):
    """A folder whose names start ``model.`` (transformers 5's module path, which its loader maps from
    the release's ``backbone.``) imports to the same files."""
    src = shutil.copytree(hf["hf"], tmp_path / "hf")
    tensors = _tensors(src)
    (src / "model.safetensors").unlink()
    save_file({("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in tensors.items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    _run(str(src), str(tmp_path / "tp2"), "--target-tp", "2")
    for rank in range(2):
        a, b = (_rank(f, f"mp_rank_{rank:02d}") for f in (converted["tp2"], tmp_path / "tp2"))
        assert a["model"].keys() == b["model"].keys()
        assert all(v is None or torch.equal(v, b["model"][k]) for k, v in a["model"].items())


def test_grouped_extra_states_a_source_lacks_are_made_up_per_expert(converted, tmp_path):
    """A per-rank source without the grouped experts' extra states (written before reshard kept Transformer
    Engine's one per linear layer) goes to torch_dist with the one object per expert megatron-core's
    ``TEGroupedMLP`` asks for, each None."""
    from reshard.core.dcp_metadata import read_metadata
    from reshard.formats.torch_dist import common_state, per_rank_module

    src = shutil.copytree(converted["tp2ep2"], tmp_path / "src")
    for f in src.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = {k: v for k, v in sd["model"].items() if not re.search(r"experts\.linear_fc\d\._extra_state", k)}
        torch.save(sd, f)
    _run(str(src), str(tmp_path / "dist"), "--to", "torch_dist")
    index = next((tmp_path / "dist").glob("iter_*/.metadata"))
    meta = read_metadata(index)
    for layer in (3, 5):
        experts = f"decoder.layers.{layer}.mlp.experts.experts."
        assert {experts + f"linear_fc{i}._extra_state/shard_{e}_4" for i in (1, 2) for e in range(4)} <= \
            set(meta.byte_items)
    module = per_rank_module(meta, index.parent, "transformer_engine", grouped=True)
    assert common_state(meta, index.parent)["args"].moe_grouped_gemm
    assert module["decoder.layers.3.mlp.experts.linear_fc1._extra_state"] is None
    assert "decoder.layers.3.mlp.experts.linear_fc1.weight3" in module
