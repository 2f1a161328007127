"""DeepSpeed pipeline-parallel checkpoints: ``layer_LL-model_TT-model_states.pt`` plus module-less
``mp_rank_KK_model_states.pt`` files (``KK = stage * TP + TT``).

Sources are written two ways: by real DeepSpeed (``PipelineModule`` + ``deepspeed.initialize`` +
``save_checkpoint`` in a subprocess, world size 1, gloo) and by a test writer that lays out the
independent sample weights (``reshard.sample``) the way Megatron-DeepSpeed's GPTModelPipe saves them.
Outputs are checked against that writer at the target TP (bit for bit), against DeepSpeed's own
reader (``deepspeed.checkpoint.DeepSpeedCheckpoint``, merging all ranks), by byte-identical round
trips, and by loading them back into a real DeepSpeed pipeline engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conftest import upload_to_s3
from layout_helpers import convert
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError, MissingModelFactError
from reshard.core.safe_load import load_shard
from reshard.sample import GPTConfig, full_weights, shard_state_dicts

CFG = GPTConfig(layers=4, hidden=32, heads=4, vocab=64, seq=16)
EMB, FIRST_BLOCK = 1, 2  # Megatron-DeepSpeed: layer 0 is a function (no file), 1 the embedding
NORM = FIRST_BLOCK + CFG.layers


def write_pipeline(folder: Path, tp: int, pp: int, cfg: GPTConfig = CFG, args: bool = True) -> Path:
    """The sample GPT as a DeepSpeed pipeline saves it (test-side writer, independent of reshard.core)."""
    folder.mkdir(parents=True, exist_ok=True)
    for t, sd in enumerate(shard_state_dicts(cfg, full_weights(cfg), tp, 3.0, attention="self_attention")):
        layers = {EMB: [("word_embeddings.weight", "word_embeddings.weight"),
                        ("position_embeddings.weight", "position_embeddings.weight")],
                  NORM: [("weight", "transformer.final_layernorm.weight"),
                         ("bias", "transformer.final_layernorm.bias")]}
        for i in range(cfg.layers):
            p = f"transformer.layers.{i}."
            layers[FIRST_BLOCK + i] = [(k[len(p):], k) for k in sd if k.startswith(p)]
        for idx, keys in layers.items():
            torch.save(OrderedDict((k, sd[src]) for k, src in keys),
                       folder / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
    for k in range(tp * pp):
        state = {"module": None, "buffer_names": [], "optimizer": {"state": {}}, "lr_scheduler": None,
                 "global_steps": 10, "global_samples": 80, "dp_world_size": 1, "mp_world_size": tp * pp,
                 "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp}, "ds_version": "0.19.8",
                 "checkpoint_version": 3.0, "iteration": 10}
        if args:
            state["args"] = argparse.Namespace(num_layers=cfg.layers, hidden_size=cfg.hidden,
                                               num_attention_heads=cfg.heads, tensor_model_parallel_size=tp,
                                               pipeline_model_parallel_size=pp, padded_vocab_size=cfg.vocab)
        torch.save(state, folder / f"mp_rank_{k:02d}_model_states.pt")
    return folder


_CACHE: dict[tuple[int, int], Path] = {}


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_pipe")

    def make(tp: int, pp: int) -> Path:
        if (tp, pp) not in _CACHE:
            _CACHE[(tp, pp)] = write_pipeline(root / f"tp{tp}_pp{pp}", tp, pp)
        return _CACHE[(tp, pp)]

    return make


def layer_names(tp: int, ids: list[int] | None = None) -> list[str]:
    ids = ids if ids is not None else list(range(EMB, NORM + 1))
    return [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in ids for t in range(tp)]


def reader(folder: Path, **degrees: int):
    """DeepSpeed's own checkpoint reader over ``folder`` (it also wants ZeRO files: empty stand-ins
    beside links to the real files, in a separate view folder)."""
    from deepspeed.checkpoint import DeepSpeedCheckpoint

    view = folder.parent / (folder.name + "_dsview")
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for f in folder.iterdir():
        (view / f.name).symlink_to(f)
        if f.name.startswith("mp_rank_"):
            torch.save({}, view / ("zero_pp_rank_0_" + f.name.replace("model_states", "optim_states")))
    return DeepSpeedCheckpoint(str(view), **degrees)


def merged(folder: Path) -> dict[str, torch.Tensor]:
    """Every layer merged over all TP ranks by DeepSpeed's reader, keyed by role."""
    ck = reader(folder, tp_degree=1, pp_degree=1)
    out = {f"emb.{k}": v for k, v in ck.get_embedding_state(0).items()}
    for i, sd in enumerate(ck.get_transformer_state(0, 0)):
        out |= {f"{i}.{k}": v for k, v in sd.items()}
    return out | {f"norm.{k}": v for k, v in ck.get_final_norm_state(0).items()}


def same_tensors(a: Path, b: Path) -> None:
    x, y = load_shard(a, mmap=False), load_shard(b, mmap=False)
    assert type(x) is OrderedDict and list(x) == list(y), a.name
    for k, v in y.items():
        assert x[k].dtype == v.dtype and torch.equal(x[k], v), (a.name, k)


MOVES = [((4, 1), (2, 1)), ((2, 1), (4, 1)), ((2, 1), (1, 1)), ((2, 2), (1, 4)), ((1, 4), (4, 2)), ((4, 2), (2, 1))]


@pytest.mark.parametrize("move", MOVES, ids=[f"tp{a}pp{b}-tp{c}pp{d}" for (a, b), (c, d) in MOVES])
def test_tp_and_pp_change_equals_the_pipeline_written_there(pipe, tmp_path, move):
    (n, spp), (m, tpp) = move
    out = tmp_path / "out"
    plan = convert(pipe(n, spp), out, target_tp=m, target_pp=tpp)
    ranks = [f"mp_rank_{k:02d}_model_states.pt" for k in range(m * tpp)]
    assert [t.name for t in plan.targets] == ranks + layer_names(m)
    assert sorted(p.name for p in out.iterdir()) == sorted(ranks + layer_names(m))
    assert plan.output_format == "deepspeed-pipeline" and plan.facts.target_pp_layers == (4 // tpp,) * tpp
    want = pipe(m, tpp)
    for name in layer_names(m):
        same_tensors(out / name, want / name)
    for name in ranks:
        sd = load_shard(out / name, mmap=False)
        assert sd["module"] is None and "optimizer" not in sd
        assert sd["mp_world_size"] == m * tpp and sd["checkpoint_parallel_dimensions"] == {"pp_degree": tpp,
                                                                                          "tp_degree": m}
        assert vars(sd["args"]) == vars(load_shard(want / name, mmap=False)["args"])
        assert sd["iteration"] == 10 and sd["checkpoint_version"] == 3.0
    # DeepSpeed's own reader sees the new degrees and merges our ranks into the source's model
    ck = reader(out)
    assert (ck.tp_degree, ck.pp_degree) == (m, tpp)
    ours, theirs = merged(out), merged(pipe(n, spp))
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())


def _bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("move", [((2, 1), (4, 1)), ((4, 1), (1, 1)), ((2, 2), (2, 1)), ((2, 1), (1, 4))],
                         ids=["tp2-4-2", "tp4-1-4", "pp2-1-2", "tp2pp1-tp1pp4-back"])
def test_round_trip_is_bit_identical(pipe, tmp_path, move):
    """N -> M -> N gives the source's layer files byte for byte, and the rank files the same-layout
    conversion writes (that one drops the optimizer state, as every conversion does)."""
    (n, spp), (m, tpp) = move
    src = pipe(n, spp)
    convert(src, tmp_path / "mid", target_tp=m, target_pp=tpp)
    convert(tmp_path / "mid", tmp_path / "back", target_tp=n, target_pp=spp)
    convert(src, tmp_path / "same", target_tp=n, target_pp=spp)
    back, same, orig = _bytes(tmp_path / "back"), _bytes(tmp_path / "same"), _bytes(src)
    assert back == same
    assert {k: v for k, v in back.items() if k.startswith("layer_")} == \
        {k: v for k, v in orig.items() if k.startswith("layer_")}


def test_untied_lm_head_and_missing_args(tmp_path):
    """An untied output layer (``LMHeadPipe``: ``lm_head.weight``, after the final norm) is split
    like the word embeddings; without saved args the head count must be given to split QKV."""
    src = write_pipeline(tmp_path / "src", 2, 1, args=False)
    head = torch.randn(CFG.vocab, CFG.hidden)
    for t in range(2):
        torch.save(OrderedDict({"lm_head.weight": head.chunk(2)[t].clone()}),
                   src / f"layer_{NORM + 1:02d}-model_{t:02d}-model_states.pt")
    with pytest.raises(MissingModelFactError, match="head count"):
        convert(src, tmp_path / "x", target_tp=4)
    plan = convert(src, tmp_path / "out", target_tp=4, num_heads=CFG.heads)
    assert plan.facts.tied_embeddings is False
    for t in range(4):
        got = load_shard(tmp_path / "out" / f"layer_{NORM + 1:02d}-model_{t:02d}-model_states.pt", mmap=False)
        assert list(got) == ["lm_head.weight"] and torch.equal(got["lm_head.weight"], head.chunk(4)[t])
    convert(tmp_path / "out", tmp_path / "back", target_tp=2, num_heads=CFG.heads)
    for name in layer_names(2, list(range(EMB, NORM + 2))):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes()


def test_inspect_and_plan_show_the_layout(pipe, capsys):
    from reshard.cli import main

    assert main(["inspect", str(pipe(2, 2)), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["format"], rec["tp"], rec["pp"]) == ("deepspeed-pipeline", 2, 2)
    assert rec["files"][:4] == [f"mp_rank_{k:02d}_model_states.pt" for k in range(4)]
    assert main(["plan", str(pipe(2, 2)), "--target-tp", "1", "--target-pp", "1"]) == 0
    assert ": deepspeed-pipeline -> deepspeed-pipeline, TP 2 -> 1, PP 2 -> 1" in capsys.readouterr().out


def _copy(pipe, tmp_path: Path, tp: int = 2, pp: int = 2) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(pipe(tp, pp), dst)
    return dst


def _refused(src: Path, tmp_path: Path, err: type, match: str, **options) -> pytest.ExceptionInfo:
    options.setdefault("target_tp", 1)
    with pytest.raises(err, match=match) as info:
        convert(src, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()
    return info


def test_refusals_name_the_culprit_and_write_nothing(pipe, tmp_path):
    bad = _copy(pipe, tmp_path)
    (bad / "layer_03-model_01-model_states.pt").unlink()
    info = _refused(bad, tmp_path, CheckpointFormatError, r"layer 03 lacks the files of tensor-parallel ranks \[1\]")
    assert info.value.culprit.endswith("layer_03-model_01-model_states.pt")

    bad = _copy(pipe, tmp_path / "a")
    for f in bad.glob("mp_rank_*"):
        f.unlink()
    _refused(bad, tmp_path, CheckpointFormatError, "no mp_rank_XX_model_states.pt files")

    bad = _copy(pipe, tmp_path / "b")
    (bad / "mp_rank_03_model_states.pt").unlink()
    _refused(bad, tmp_path, CheckpointFormatError, "3 mp_rank files are not a multiple of the 2")

    bad = _copy(pipe, tmp_path / "c")
    for f in list(bad.glob("mp_rank_0[23]*")):
        f.unlink()
    info = _refused(bad, tmp_path, CheckpointFormatError, "says PP 2 x TP 2 but the folder holds PP 1 x TP 2")
    assert "every layer and rank file" in info.value.hint

    bad = _copy(pipe, tmp_path / "d")
    for t in range(2):
        (bad / f"layer_{NORM:02d}-model_{t:02d}-model_states.pt").unlink()
    _refused(bad, tmp_path, CheckpointFormatError, "0 final-norm layers: found no layer file where a final norm")
    shutil.copy(bad / "layer_02-model_00-model_states.pt", bad / "layer_00-model_00-model_states.pt")
    shutil.copy(bad / "layer_02-model_01-model_states.pt", bad / "layer_00-model_01-model_states.pt")
    _refused(bad, tmp_path, CheckpointFormatError, r"found a transformer layer \(layer_00-model_00-model_states.pt\) "
             "where a embedding layer belongs")

    bad = _copy(pipe, tmp_path / "e", tp=1, pp=1)
    (bad / "layer_02-model_00-model_states.pt").rename(bad / "layer_02-model_states.pt")
    _refused(bad, tmp_path, CheckpointFormatError, "has no model-parallel rank in its name")

    bad = _copy(pipe, tmp_path / "f")
    f = bad / "layer_04-model_01-model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["input_layernorm.weight"] = sd["input_layernorm.weight"] + 1
    torch.save(sd, f)
    info = _refused(bad, tmp_path, InconsistentShardsError,
                    "replicated parameter input_layernorm.weight differs from rank 0")
    assert info.value.culprit == str(f)

    bad = _copy(pipe, tmp_path / "g")
    f = bad / "layer_02-model_01-model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["mlp.dense_h_to_4h.weight"] = sd["mlp.dense_h_to_4h.weight"][:-1].clone()
    torch.save(sd, f)
    _refused(bad, tmp_path, InconsistentShardsError, "dense_h_to_4h.weight: shape/dtype")

    bad = _copy(pipe, tmp_path / "h")
    f = bad / "mp_rank_01_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["module"] = {"word_embeddings.weight": torch.zeros(2)}
    torch.save(sd, f)
    _refused(bad, tmp_path, CheckpointFormatError, "holds weights beside pipeline layer files")

    _refused(pipe(2, 2), tmp_path, LayoutError, "4 layers cannot be split evenly over 3 pipeline stages",
             target_pp=3)
    _refused(pipe(2, 2), tmp_path, LayoutError, "--quantize is not supported", quantize=True)


# --- real DeepSpeed ---------------------------------------------------------------------------------

_DS_SCRIPT = textwrap.dedent('''
    import os, sys, json
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, torch.nn as nn
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo's all-reduce (tests/zero_engine.py)
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    H, V, S, L = 32, 64, 16, 4

    class EmbeddingPipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings, self.position_embeddings = nn.Embedding(V, H), nn.Embedding(S, H)

        def forward(self, x):
            return self.word_embeddings(x) + self.position_embeddings(torch.arange(x.shape[-1]))

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value, self.dense = nn.Linear(H, 3 * H), nn.Linear(H, H)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    class ParallelTransformerLayerPipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.self_attention = nn.LayerNorm(H), Attention()
            self.post_attention_layernorm, self.mlp = nn.LayerNorm(H), MLP()

        def forward(self, x):
            return x + self.mlp.dense_4h_to_h(self.mlp.dense_h_to_4h(self.post_attention_layernorm(x)))

    def to_float16(x):
        return x

    def logits(embedding, x):
        return x @ embedding.word_embeddings.weight.t()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    specs = ([to_float16, TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="word_embeddings.weight")]
             + [LayerSpec(ParallelTransformerLayerPipe) for _ in range(L)] + [LayerSpec(nn.LayerNorm, H)]
             + [TiedLayerSpec("embed", EmbeddingPipe, forward_fn=logits, tied_weight_attr="word_embeddings.weight")])
    module = PipelineModule(layers=specs, topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    mode, folder = sys.argv[1], sys.argv[2]
    if mode == "save":
        engine.save_checkpoint(folder, tag="global_step5", client_state={"checkpoint_version": 3.0})
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, os.path.join(folder, "weights.pt"))
    else:  # load another checkpoint into the same model and report whether every weight matches
        want = torch.load(os.path.join(folder, "weights.pt"))
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        engine.load_checkpoint(folder, tag=sys.argv[4], load_optimizer_states=False, load_lr_scheduler_states=False)
        got = module.state_dict()
        same = sorted(want) == sorted(got) and all(torch.equal(got[k], v) for k, v in want.items())
        print(json.dumps({"same": same}))
''')


def _deepspeed(*argv: str) -> str:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    port = str(29500 + os.getpid() % 400)
    proc = subprocess.run([sys.executable, "-c", _DS_SCRIPT, argv[0], argv[1], port, *argv[2:]], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_checkpoint_saved_by_real_deepspeed(tmp_path):
    import deepspeed  # noqa: F401  (the reference: a missing DeepSpeed fails here, never skips)
    root = tmp_path / "run"
    _deepspeed("save", str(root))
    src = root / "global_step5"
    assert sorted(p.name for p in src.iterdir()) == sorted(["mp_rank_00_model_states.pt"] + layer_names(1))
    # no args saved: the head count comes from the user; TP 1 -> 2 equals DeepSpeed's reader merging it back
    plan = convert(src, tmp_path / "tp2", target_tp=2, num_heads=4)
    assert plan.facts.tied_embeddings is True and plan.facts.num_layers == 4
    assert sorted(p.name for p in (tmp_path / "tp2").iterdir()) == \
        sorted(["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"] + layer_names(2))
    ours, theirs = merged(tmp_path / "tp2"), merged(src)
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
    qkv = load_shard(tmp_path / "tp2" / "layer_02-model_01-model_states.pt", mmap=False)
    assert torch.equal(qkv["self_attention.query_key_value.weight"],
                       theirs["0.self_attention.query_key_value.weight"][48:])  # heads 2, 3 of 4 (x 3 x 8 rows)
    # back to TP 1 and to PP 2 and back: DeepSpeed's own layer files, byte for byte
    convert(tmp_path / "tp2", tmp_path / "tp1", target_tp=1, num_heads=4)
    convert(src, tmp_path / "pp2", target_tp=1, target_pp=2)
    assert load_shard(tmp_path / "pp2" / "mp_rank_01_model_states.pt")["checkpoint_parallel_dimensions"] == \
        {"pp_degree": 2, "tp_degree": 1}
    convert(tmp_path / "pp2", tmp_path / "pp1", target_tp=1, target_pp=1)
    for out in ("tp1", "pp1"):
        for name in layer_names(1):
            assert (tmp_path / out / name).read_bytes() == (src / name).read_bytes(), (out, name)
    # and a real DeepSpeed pipeline engine loads the round-tripped checkpoint (rank file included)
    shutil.copytree(tmp_path / "tp1", root / "resharded")
    assert json.loads(_deepspeed("load", str(root), "resharded").strip().splitlines()[-1]) == {"same": True}


def test_run_direct_commits_layer_and_rank_files(pipe, tmp_path):
    from reshard.direct import run_direct
    from reshard.execution.plan import ReshardOptions

    report = run_direct(str(pipe(2, 2)), str(tmp_path / "out"), ReshardOptions(target_tp=1, target_pp=1))
    assert [r["path"] for r in report.manifest["files"]] == ["mp_rank_00_model_states.pt"] + layer_names(1)
    assert report.manifest["source"]["format"] == "deepspeed-pipeline" and report.manifest["source"]["pp"] == 2
    for name in layer_names(1):
        same_tensors(tmp_path / "out" / name, pipe(1, 1) / name)


def test_prefect_flow_s3_to_s3_equals_direct(pipe, tmp_path, s3_server, s3_bucket, prefect_env, monkeypatch):
    """The pipeline path on a real S3 server: layer files fetched into the view, planned from
    all of them (not the headers-only shortcut), the same bytes as --direct on local files."""
    import s3fs

    from reshard.direct import run_direct
    from reshard.execution.plan import ReshardOptions
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    src = pipe(2, 2)
    source, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch, prefix="pipe")
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    out = run_flow(ReshardParams(source=source, destination=f"{s3_bucket}/out", target_tp=1,
                                 target_pp=1, storage_options=so, cache_dir=str(tmp_path / "cache")))
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(target_tp=1, target_pp=1))
    expected = {p.name for p in (tmp_path / "direct").iterdir() if p.suffix == ".pt"}
    assert expected and expected <= {r["path"] for r in out["files"]}
    for p in (tmp_path / "direct").iterdir():
        if p.suffix == ".pt":
            assert fs.cat_file(f"{s3_bucket[5:]}/out/{p.name}") == p.read_bytes(), p.name


@pytest.mark.parametrize("to", ["hf", "torch_dist"])
def test_pipeline_layer_files_are_written_only_as_layer_files(pipe, tmp_path, capsys, to):
    """--to another layout is refused in one line (the pipeline planner used to ignore it and write
    layer files anyway)."""
    from reshard.cli import main

    capsys.readouterr()
    assert main(["run", "--direct", str(pipe(2, 2)), str(tmp_path / "out"), "--to", to]) == 2
    err = capsys.readouterr().err.strip()
    assert "--to: DeepSpeed pipeline layer files are written back only as layer files" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
