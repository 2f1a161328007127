"""megatron-core ``torch_dist`` checkpoints in: checked against real megatron-core (0.16.1, CPU, gloo).

The torch_dist checkpoints are written by megatron-core's own ``dist_checkpointing.save`` of
``GPTModel.sharded_state_dict()`` (``mcore_harness.py``, job ``write_dist``) with the same seeds
as the per-rank checkpoints of ``test_megatron_core.py``, so they hold the same logical weights.
Reading one at TP M must give, entry for entry and in megatron-core's module order, the shards
megatron-core itself wrote at TP M; megatron-core's forward on them must give the saved logits.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from layout_helpers import convert
from legacy_twin import as_legacy, perturbed_norms, rewrite_run
from mapped_pages import resident_bytes
from mcore019 import CudaGraphModule, InferenceCudaGraphScope, as_019_dist, load_019_common_state, serve_019_enums
from mcore_fixtures import mcore_checkpoints, mcore_dist_checkpoints, mcore_forward, needs_mcore, rank_module
from reshard.cli import main
from reshard.core.dcp_metadata import ChunkRef, DcpTensor, check_tiling, read_metadata
from reshard.core.errors import CorruptCheckpointError
from reshard.core.safe_load import load_shard

pytestmark = needs_mcore


@pytest.fixture(scope="session")
def dist(tmp_path_factory):
    return mcore_dist_checkpoints(tmp_path_factory.mktemp("mcore_dist"))


@pytest.fixture(scope="session")
def mcore(tmp_path_factory):
    return mcore_checkpoints(tmp_path_factory.mktemp("mcore"))


def _module(folder: Path, tp_rank: int, pp_rank: int | None = None) -> dict:
    return rank_module(folder, tp_rank, pp_rank)


def _assert_same_module(got: dict, want: dict, where: str) -> None:
    assert list(got) == list(want), where  # same entries, in megatron-core's module order
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{where}: {k}"
        else:
            assert got[k] == v, f"{where}: {k}"


CASES = [  # (model, source tp, target tp, extra options)
    ("mha", 2, 1, {}), ("mha", 2, 2, {}), ("mha", 2, 4, {}),
    ("gqa_swiglu", 2, 1, {}), ("gqa_swiglu", 2, 4, {}),
    ("swiglu", 4, 1, {}), ("swiglu", 4, 2, {}),
    ("gqa", 1, 2, {}),
    # true vocabulary 100 (args do not say), padded to 128 at the saving TP 2 and at TP 4
    ("padded", 2, 4, {"vocab_size": 100}), ("padded", 2, 4, {}),
]


@pytest.mark.parametrize("name,n,m,extra", CASES,
                         ids=[f"{c[0]}-tp{c[1]}-to{c[2]}{'-v' if c[3] else ''}" for c in CASES])
def test_read_equals_megatron_cores_own_shards(dist, mcore, tmp_path, name, n, m, extra):
    out = tmp_path / "out"
    plan = convert(dist[(name, n, 1)], out, target_tp=m, **extra)
    assert plan.source.format == "torch_dist" and plan.output_format == "megatron"
    for r in range(m):
        _assert_same_module(_module(out, r), _module(mcore[(name, m, 1)], r), f"{name} tp{n}->{m} rank {r}")
    args = load_shard(out / "iter_0000007/mp_rank_00/model_optim_rng.pt", mmap=False)["args"]
    assert args.tensor_model_parallel_size == m and args.ckpt_format == "torch"


def test_pipeline_stages_read_into_megatron_cores_per_rank_stages(dist, mcore, tmp_path):
    out = tmp_path / "out"
    convert(dist[("mha", 1, 2)], out, target_tp=1, target_pp=2)
    for stage in range(2):
        _assert_same_module(_module(out, 0, stage), _module(mcore[("mha", 1, 2)], 0, stage), f"stage {stage}")


def test_megatron_core_runs_the_converted_model_with_the_saved_logits(dist, tmp_path):
    """Also when the vocabulary padding changes (padded: 128 rows at TP 2, megatron-core's 112 at TP 1;
    the logits of the 100 real tokens must not change)."""
    runs = (("mha", 2, 1, {}), ("gqa_swiglu", 2, 2, {}), ("swiglu", 4, 2, {}), ("padded", 2, 1, {"vocab_size": 100}))
    cases = []
    for name, n, m, extra in runs:
        out = tmp_path / f"{name}_{m}"
        convert(dist[(name, n, 1)], out, target_tp=m, **extra)
        cases.append((name, out, m))
    got = mcore_forward(cases, tmp_path / "fwd")
    for (name, n, m, extra), logits in zip(runs, got):
        want = torch.load(dist[(name, n, 1)] / "logits.pt")
        cols = extra.get("vocab_size", want.shape[-1])
        torch.testing.assert_close(logits[:, :cols], want[:, :cols], atol=1e-5, rtol=0, msg=f"{name} at TP {m}")


def test_optimizer_state_is_skipped_reported_and_never_read(dist, mcore, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("gqa_swiglu", 2, 1)], tmp_path / "src"))
    folder = src / "iter_0000007"
    meta = read_metadata(folder / ".metadata")
    optim = [c for k, t in meta.tensors.items() if k.startswith("optimizer.") for c in t.chunks]
    assert optim, "the fixture carries Adam state"
    for c in optim:  # wreck every optimizer blob: a reader that touches one fails
        with open(folder / c.file, "r+b") as f:
            f.seek(c.offset)
            f.write(b"\xff" * c.length)
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--target-tp", "2"]) == 0
    cap = capsys.readouterr()
    said = cap.out + cap.err
    assert "dropped" in said and "optimizer" in said
    for r in range(2):
        _assert_same_module(_module(tmp_path / "out", r), _module(mcore[("gqa_swiglu", 2, 1)], r), f"rank {r}")


def test_inspect_and_plan_describe_a_torch_dist_checkpoint(dist, capsys):
    import json

    src = dist[("gqa_swiglu", 2, 1)]
    assert main(["inspect", str(src), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["format"] == "torch_dist" and "optimizer" in rec["skipped"]
    assert rec["facts"]["query_groups"] == 4 and rec["facts"]["swiglu"] is True
    assert any(f.endswith(".distcp") for f in rec["files"]) and rec["bytes"] > 100_000
    assert main(["plan", str(src), "--target-tp", "4"]) == 0


def test_megatron_core_019s_common_state_in_the_index_is_read_as_common_pt_was(dist, mcore, tmp_path, monkeypatch):
    """megatron-core >= 0.19 writes no common.pt: the common state is the byte item
    ``common_state/shard_0_1`` of the index (args with 0.19's enums, content_metadata). Read as the
    common state (refused before as a parameter matching no rule), the shards equal megatron-core's
    own and the args are carried as they were."""
    serve_019_enums(monkeypatch)
    new = as_019_dist(dist[("gqa_swiglu", 2, 1)], tmp_path / "v019",
                      args__inference_cuda_graph_scope=InferenceCudaGraphScope.none,
                      args__cuda_graph_modules=[CudaGraphModule.attn],
                      content_metadata={"singleton_local_shards": False, "chained_optim_avoid_prefix": True})
    folder = new / "iter_0000007"
    assert not (folder / "common.pt").exists()
    assert load_019_common_state(folder)["args"].inference_cuda_graph_scope is InferenceCudaGraphScope.none
    plan = convert(new, tmp_path / "out", target_tp=4)
    assert "common_state" not in {p.key.split("/")[0] for p in plan.params}
    for r in range(4):
        _assert_same_module(_module(tmp_path / "out", r), _module(mcore[("gqa_swiglu", 4, 1)], r), f"rank {r}")
    out = torch.load(tmp_path / "out/iter_0000007/mp_rank_00/model_optim_rng.pt", weights_only=False)
    assert out["args"].inference_cuda_graph_scope is InferenceCudaGraphScope.none
    assert out["args"].cuda_graph_modules == [CudaGraphModule.attn] and out["iteration"] == 7
    assert out["args"].tensor_model_parallel_size == 4 and "optimizer" not in out


def test_a_refused_global_in_the_common_state_is_named_in_plain_words(dist, tmp_path, capsys):
    import datetime

    new = as_019_dist(dist[("mha", 2, 1)], tmp_path / "v019", args__when=datetime.date(2024, 1, 1))
    assert main(["run", "--direct", str(new), str(tmp_path / "out"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "add_safe_globals" not in err, err
    assert "common_state/shard_0_1" in err and "global datetime.date is outside reshard's allowlist" in err, err
    assert not (tmp_path / "out").exists()


# --- refusals -------------------------------------------------------------------------------------


def _cli(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def _refused(capsys, src: Path, dst: Path, *needles: str) -> None:
    code, err = _cli(capsys, ["run", "--direct", str(src), str(dst), "--target-tp", "1"])
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not dst.exists()


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_index_never_runs_code(dist, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("mha", 2, 1)], tmp_path / "src"))
    marker = tmp_path / "pwned"
    (src / "iter_0000007" / ".metadata").write_bytes(pickle.dumps({"x": _Boom(str(marker))}))
    before = sorted(p.name for p in (src / "iter_0000007").iterdir())
    _refused(capsys, src, tmp_path / "out", "refused to unpickle", "posix.system")
    assert not marker.exists()
    assert sorted(p.name for p in (src / "iter_0000007").iterdir()) == before


def test_a_truncated_distcp_file_is_refused(dist, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("mha", 2, 1)], tmp_path / "src"))
    f = src / "iter_0000007" / "__1_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    _refused(capsys, src, tmp_path / "out", "__1_0.distcp is truncated")


def test_an_index_naming_a_missing_file_is_refused(dist, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("mha", 2, 1)], tmp_path / "src"))
    (src / "iter_0000007" / "__0_1.distcp").unlink()
    _refused(capsys, src, tmp_path / "out", "__0_1.distcp, which does not exist")


def test_a_run_folder_naming_a_missing_iteration_is_refused(dist, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("mha", 2, 1)], tmp_path / "src"))
    (src / "latest_checkpointed_iteration.txt").write_text("9")
    _refused(capsys, src, tmp_path / "out", "names iteration 9", "iter_0000009/ does not exist")


def test_a_corrupt_chunk_blob_is_refused_naming_the_file(dist, tmp_path, capsys):
    src = Path(shutil.copytree(dist[("mha", 2, 1)], tmp_path / "src"))
    meta = read_metadata(src / "iter_0000007" / ".metadata")
    c = meta.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks[0]
    with open(src / "iter_0000007" / c.file, "r+b") as f:
        f.seek(c.offset)
        f.write(struct.pack("<I", 0))  # the zip's first local header
    _refused(capsys, src, tmp_path / "out", c.file, "linear_qkv.weight")


def _t(*chunks: tuple[tuple[int, ...], tuple[int, ...]], shape=(4, 6)) -> DcpTensor:
    return DcpTensor("w", shape, torch.float32, tuple(ChunkRef(o, s, "__0_0.distcp", 0, 1) for o, s in chunks))


@pytest.mark.parametrize("chunks,problem", [
    ((((0, 0), (4, 6)),), None),
    ((((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 3))), None),
    ((((0, 0), (2, 6)), ((1, 0), (3, 6))), "overlap"),
    ((((0, 0), (2, 6)), ((2, 0), (2, 3))), "uncovered"),
    ((((0, 0), (4, 3)), ((0, 2), (4, 4))), "overlap"),
    ((((0, 0), (4, 6)), ((3, 5), (2, 2))), "outside"),
])
def test_chunks_must_tile_the_tensor_exactly(chunks, problem):
    if problem is None:
        check_tiling(_t(*chunks), "idx")
    else:
        with pytest.raises(CorruptCheckpointError, match=problem):
            check_tiling(_t(*chunks), "idx")


# --- torch_dist out -------------------------------------------------------------------------------


def _global_tensors(folder: Path, tmp: Path) -> dict:
    """What plain torch.distributed.checkpoint reads from a torch_dist folder (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp / "plain.pt"))
    return torch.load(tmp / "plain.pt", weights_only=False)


def test_megatron_core_loads_the_written_torch_dist_at_every_tp_with_the_saved_logits(dist, mcore, tmp_path):
    """From megatron-core per-rank files (TP 2) and from torch_dist itself (TP 4): megatron-core's
    ``dist_checkpointing.load`` at TP 1, 2 and 4 gives the source model's logits."""
    from mcore_fixtures import mcore_forward_dist

    sources = {"per-rank": (mcore[("gqa_swiglu", 2, 1)], "gqa_swiglu", []),
               "torch_dist": (dist[("swiglu", 4, 1)], "swiglu", []),
               # cut into many files: every stacked key's layers and each layer's tensors spread over them
               "cut": (mcore[("gqa_swiglu", 2, 1)], "gqa_swiglu", ["--max-shard-size", "8KB"])}
    cases, wants = [], []
    for label, (src, name, extra) in sources.items():
        out = tmp_path / label
        assert main(["run", "--direct", str(src), str(out), "--to", "torch_dist", *extra]) == 0
        assert len(list(out.rglob("*.distcp"))) >= (8 if extra else 1)
        for tp in (1, 2, 4):
            cases.append((name, out, tp))
            wants.append(torch.load(src / "logits.pt"))
    for (name, out, tp), got, want in zip(cases, mcore_forward_dist(cases, tmp_path / "fwd"), wants):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{out.name} {name} loaded at TP {tp}")


def without_extra_state(sd: dict) -> dict:
    """A rank file as converters and older saves write one: megatron-core names, no ``_extra_state``."""
    sd["model"] = {k: v for k, v in sd["model"].items() if not k.endswith("_extra_state")}
    return sd


@pytest.mark.parametrize("model", ["mha", "gqa_swiglu"])
def test_a_source_without_extra_states_becomes_torch_dist_megatron_core_loads(mcore, tmp_path, model):
    """A megatron-core-named per-rank source with no ``_extra_state`` entries: the torch_dist
    output still holds every object megatron-core's model asks for (its default strictness refused
    ``decoder.layers.self_attention.linear_proj._extra_state/shard_0_2`` before), loaded at TP 1, 2
    and 4 with the source's logits; and its index equals the one made from the source with them."""
    from mcore_fixtures import mcore_forward_dist

    src = mcore[(model, 2, 1)]
    bare = rewrite_run(src, tmp_path / "bare", without_extra_state)
    assert not [k for k in _module(bare, 0) if k.endswith("_extra_state")]
    for label, folder in (("bare", bare), ("full", src)):
        assert main(["run", "--direct", str(folder), str(tmp_path / f"{label}_dist"), "--to", "torch_dist"]) == 0
    it = "iter_0000007"
    for name in (".metadata", "__0_0.distcp"):
        assert (tmp_path / "bare_dist" / it / name).read_bytes() == (tmp_path / "full_dist" / it / name).read_bytes()
    cases = [(model, tmp_path / "bare_dist", tp) for tp in (1, 2, 4)]
    for (_, _, tp), got in zip(cases, mcore_forward_dist(cases, tmp_path / "fwd")):
        torch.testing.assert_close(got, torch.load(src / "logits.pt"), atol=1e-5, rtol=0, msg=f"loaded at TP {tp}")


def test_plain_dcp_reads_the_global_tensors(mcore, tmp_path):
    """The torch_dist output holds, under megatron-core's global keys, the TP 1 tensors: stacked
    layers, fused layer-norm names, SwiGLU fc1 as [all gate; all up]."""
    out = tmp_path / "out"
    assert main(["run", "--direct", str(mcore[("gqa_swiglu", 2, 1)]), str(out), "--to", "torch_dist"]) == 0
    plain = _global_tensors(out / "iter_0000007", tmp_path)
    want = _module(mcore[("gqa_swiglu", 1, 1)], 0)  # megatron-core's own TP 1 shard
    assert torch.equal(plain["embedding.word_embeddings.weight"], want["embedding.word_embeddings.weight"])
    for i in range(2):
        assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"][i],
                           want[f"decoder.layers.{i}.mlp.linear_fc1.weight"])
        assert torch.equal(plain["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                           want[f"decoder.layers.{i}.input_layernorm.weight"])
        assert torch.equal(plain["decoder.layers.self_attention.linear_qkv.weight"][i],
                           want[f"decoder.layers.{i}.self_attention.linear_qkv.weight"])
    assert not [k for k in plain if k.startswith("optimizer")]


@pytest.mark.parametrize("model", ["gqa_swiglu", "mha"])
def test_an_output_cut_into_files_holds_the_same_global_tensors(mcore, tmp_path, model):
    """``--max-shard-size``: the same global tensors as the one-file output, for plain DCP and for
    reshard reading it back (per-rank TP 2 files byte-identical); no file over the limit unless it
    is one entry; file ``i`` named ``__i_0.distcp``; refused for a per-rank output."""
    src = mcore[(model, 2, 1)]
    one, cut = tmp_path / "one", tmp_path / "cut"
    assert main(["run", "--direct", str(src), str(one), "--to", "torch_dist"]) == 0
    assert main(["run", "--direct", str(src), str(cut), "--to", "torch_dist", "--max-shard-size", "20KB"]) == 0
    files = sorted((cut / "iter_0000007").glob("*.distcp"))
    assert [f.name for f in files] == sorted(f"__{i}_0.distcp" for i in range(len(files))) and len(files) >= 4
    meta = read_metadata(cut / "iter_0000007" / ".metadata")
    held: dict[str, list[int]] = {f.name: [] for f in files}  # tensor bytes per chunk, by file
    for t in meta.tensors.values():
        for c in t.chunks:
            held[c.file].append(math.prod(c.sizes) * t.dtype.itemsize)
    assert all(sum(b) <= 20_000 or len(b) == 1 for b in held.values()), held  # tensor bytes, as Hugging Face counts
    assert all(len(b) for b in held.values()), held
    want = _global_tensors(one / "iter_0000007", tmp_path)
    got = _global_tensors(cut / "iter_0000007", tmp_path)
    assert list(got) == list(want) and all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
                                           for k, v in want.items())
    for label, folder in (("one", one), ("cut", cut)):
        assert main(["run", "--direct", str(folder), str(tmp_path / f"{label}-tp2"), "--target-tp", "2"]) == 0
    for f in sorted((tmp_path / "one-tp2").rglob("*.pt")):
        assert f.read_bytes() == (tmp_path / "cut-tp2" / f.relative_to(tmp_path / "one-tp2")).read_bytes(), f


def test_pipeline_stages_become_one_torch_dist_checkpoint(mcore, tmp_path):
    out = tmp_path / "out"
    assert main(["run", "--direct", str(mcore[("mha", 1, 2)]), str(out), "--to", "torch_dist"]) == 0
    plain = _global_tensors(out / "iter_0000007", tmp_path)
    first, last = _module(mcore[("mha", 1, 2)], 0, 0), _module(mcore[("mha", 1, 2)], 0, 1)
    assert torch.equal(plain["decoder.layers.self_attention.linear_proj.weight"][0],
                       first["decoder.layers.0.self_attention.linear_proj.weight"])
    assert torch.equal(plain["decoder.layers.self_attention.linear_proj.weight"][1],
                       last["decoder.layers.0.self_attention.linear_proj.weight"])
    assert torch.equal(plain["decoder.final_layernorm.weight"], last["decoder.final_layernorm.weight"])


def test_round_trips_are_byte_stable(dist, tmp_path):
    """torch_dist -> torch_dist -> torch_dist: the second and third outputs are identical files;
    torch_dist -> per-rank -> torch_dist gives the same files as torch_dist -> torch_dist."""
    src = dist[("gqa_swiglu", 2, 1)]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["run", "--direct", str(src), str(a), "--to", "torch_dist"]) == 0
    assert main(["run", "--direct", str(a), str(b), "--to", "torch_dist"]) == 0
    assert main(["run", "--direct", str(src), str(tmp_path / "ranks"), "--target-tp", "2"]) == 0
    assert main(["run", "--direct", str(tmp_path / "ranks"), str(c), "--to", "torch_dist"]) == 0
    for name in ("__0_0.distcp", ".metadata", "common.pt", "metadata.json"):
        assert (a / "iter_0000007" / name).read_bytes() == (b / "iter_0000007" / name).read_bytes(), name
        if name != "common.pt":  # args differ by what the per-rank hop wrote (ckpt_format kept, TP)
            assert (a / "iter_0000007" / name).read_bytes() == (c / "iter_0000007" / name).read_bytes(), name


def test_each_distcp_file_is_written_through_one_pipeline_and_hashed_as_written(mcore, tmp_path, monkeypatch):
    """The blobs of a ``.distcp`` file (an archive per tensor, byte items between them) share one
    write pipeline — not one started and drained per blob — and the manifest's SHA-256, computed
    as the bytes went out, is the file's."""
    import hashlib
    import json

    from reshard.core import torch_writer

    made = []
    real = torch_writer.writer_pipeline
    monkeypatch.setattr(torch_writer, "writer_pipeline", lambda *a, **k: made.append(1) or real(*a, **k))
    out = tmp_path / "out"
    assert main(["run", "--direct", str(mcore[("gqa_swiglu", 2, 1)]), str(out), "--to", "torch_dist",
                 "--max-shard-size", "100KB"]) == 0
    files = sorted((out / "iter_0000007").glob("*.distcp"))
    assert len(files) >= 2 and len(made) == len(files)
    meta = read_metadata(out / "iter_0000007" / ".metadata")
    assert sum(len(t.chunks) for t in meta.tensors.values()) > 2 * len(files)  # several blobs per file
    recorded = {f["path"]: f["sha256"] for f in json.loads((out / "reshard_manifest.json").read_text())["files"]}
    for f in files:
        assert recorded[f"iter_0000007/{f.name}"] == hashlib.sha256(f.read_bytes()).hexdigest(), f.name


@pytest.mark.parametrize("args,needle", [
    (["--to", "torch_dist", "--target-tp", "2"], "--target-tp: the torch_dist layout holds global tensors"),
    (["--to", "torch_dist", "--quantize"], "--quantize: torch_dist has no place"),
    (["--to", "deepspeed"], "--to: cannot write a torch_dist checkpoint in the DeepSpeed"),
    (["--to", "nope"], "--to: unknown output format 'nope'"),
    (["--target-tp", "2", "--max-shard-size", "1MB"],
     "--max-shard-size: the megatron layout is not written in size-limited shards"),
    ([], "--target-tp: needs a target tensor-parallel degree to write the megatron layout"),
])
def test_output_requests_that_cannot_be_written_are_refused(dist, tmp_path, capsys, args, needle):
    code, err = _cli(capsys, ["run", "--direct", str(dist[("mha", 2, 1)]), str(tmp_path / "out"), *args])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", [0.0, 1.0])
def test_legacy_qkv_layouts_megatron_core_does_not_use_are_refused_for_torch_dist(sample_factory, tmp_path, capsys,
                                                                                  version):
    code, err = _cli(capsys, ["run", "--direct", str(sample_factory(2, version)), str(tmp_path / "out"),
                              "--to", "torch_dist"])
    assert code == 2 and f"checkpoint_version {version:g} orders the fused QKV rows" in err, err
    assert not (tmp_path / "out").exists()


# --- legacy Megatron names in, torch_dist out -------------------------------------------------------

@pytest.mark.parametrize("model", ["gqa_swiglu", "mha"])  # untied GQA SwiGLU; tied MHA with learned positions
def test_legacy_names_become_the_torch_dist_megatron_core_writes(mcore, tmp_path, model):
    """A legacy-named twin of a megatron-core checkpoint (names mapped back by this test's own
    table, extra states dropped, layer norms made distinct) converts to a torch_dist whose storage
    and index are byte for byte the megatron-core original's, and reads back as megatron-core's
    own per-rank shards; swapping the two layer norms in the twin is caught."""
    core = rewrite_run(mcore[(model, 2, 1)], tmp_path / "core", perturbed_norms)
    legacy = rewrite_run(core, tmp_path / "legacy", as_legacy())
    wrong = rewrite_run(core, tmp_path / "wrong", as_legacy(swap_norms=True))
    outs = {}
    for label, src in (("core", core), ("legacy", legacy), ("wrong", wrong)):
        outs[label] = tmp_path / f"{label}_dist"
        assert main(["run", "--direct", str(src), str(outs[label]), "--to", "torch_dist"]) == 0
    it = "iter_0000007"
    for name in ("__0_0.distcp", ".metadata"):
        assert (outs["legacy"] / it / name).read_bytes() == (outs["core"] / it / name).read_bytes(), name
    assert (outs["wrong"] / it / "__0_0.distcp").read_bytes() != (outs["core"] / it / "__0_0.distcp").read_bytes()
    args = load_shard(outs["legacy"] / it / "common.pt")["args"]
    assert args.transformer_impl == "local" and args.use_legacy_models is False
    back = tmp_path / "back"
    assert main(["run", "--direct", str(outs["legacy"]), str(back), "--target-tp", "2"]) == 0
    for r in range(2):
        _assert_same_module(_module(back, r), _module(core, r), f"rank {r}")


def test_megatron_core_runs_a_legacy_checkpoint_written_as_torch_dist_with_the_saved_logits(mcore, tmp_path):
    from mcore_fixtures import mcore_forward_dist

    legacy = rewrite_run(mcore[("gqa_swiglu", 2, 1)], tmp_path / "legacy", as_legacy())
    out = tmp_path / "out"
    assert main(["run", "--direct", str(legacy), str(out), "--to", "torch_dist"]) == 0
    want = torch.load(mcore[("gqa_swiglu", 2, 1)] / "logits.pt")
    cases = [("gqa_swiglu", out, tp) for tp in (1, 2)]
    for (_, _, tp), got in zip(cases, mcore_forward_dist(cases, tmp_path / "fwd")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"loaded at TP {tp}")


# --- through the Prefect flow, from S3 ------------------------------------------------------------


@pytest.mark.parametrize("direction", ["in", "out"])
def test_the_flow_reads_and_writes_torch_dist_from_s3_like_direct(direction, dist, mcore, tmp_path, s3_server,
                                                                  s3_bucket, monkeypatch, prefect_env):
    """in: a torch_dist run folder on S3 -> per-rank TP 2; out: megatron-core per-rank files on S3 ->
    torch_dist. The flow's output equals ``--direct``'s, file for file (side files included)."""
    from conftest import output_bytes, task_states, upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.direct import run_direct
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    src, opts = ((dist[("gqa_swiglu", 2, 1)], {"target_tp": 2}) if direction == "in"
                 else (mcore[("gqa_swiglu", 2, 1)], {"to": "torch_dist"}))
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(**opts))
    url, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch)
    out = run_flow(ReshardParams(source=url, destination=str(tmp_path / "flow"), storage_options=so,
                                 cache_dir=str(tmp_path / "cache"), **opts))
    assert output_bytes(tmp_path / "flow") == output_bytes(tmp_path / "direct")
    assert set(task_states(out["flow_run_id"], expect={"check-shard": 1})["check-shard"]) == {"Completed"}
    if direction == "out":
        assert (tmp_path / "flow" / "iter_0000007" / ".metadata").is_file()


def test_a_hop_through_torch_dist_changes_no_byte(mcore, tmp_path):
    """per-rank TP 2 -> torch_dist -> per-rank TP 4 writes the very files per-rank TP 2 -> TP 4 writes."""
    src = mcore[("gqa_swiglu", 2, 1)]
    assert main(["run", "--direct", str(src), str(tmp_path / "dist"), "--to", "torch_dist"]) == 0
    assert main(["run", "--direct", str(tmp_path / "dist"), str(tmp_path / "hop"), "--target-tp", "4"]) == 0
    assert main(["run", "--direct", str(src), str(tmp_path / "straight"), "--target-tp", "4"]) == 0
    for r in range(4):
        name = f"iter_0000007/mp_rank_{r:02d}/model_optim_rng.pt"
        assert (tmp_path / "hop" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


def _allocated(paths: list[Path]) -> int:
    """Bytes the files hold on disk (a sparse file's holes hold none)."""
    return sum(min(p.stat().st_size, p.stat().st_blocks * 512) for p in paths)


@pytest.mark.parametrize("cache_sources", [False, True], ids=["streamed", "cached"])
def test_from_s3_only_the_models_byte_ranges_are_fetched(dist, tmp_path, s3_server, s3_bucket, monkeypatch,
                                                         prefect_env, cache_sources):
    """megatron-core writes optimizer state into the same .distcp files as the model: a remote
    source's files are fetched as the model's byte ranges only (sparse cache entries) with
    ``cache_sources``, and by default as the model's blobs' structure only (skeletons: the tensors
    are read while converting), by the direct path and by the flow; the output is what the local
    source gives."""
    from conftest import output_bytes, upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.direct import run_direct
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow
    from reshard.storage.cache import ShardCache

    src = dist[("gqa_swiglu", 2, 1)]  # carries Adam moments: two thirds of its .distcp bytes
    meta = read_metadata(src / "iter_0000007" / ".metadata")
    model = sum(c.length for k, t in meta.tensors.items() if not k.startswith("optimizer.") for c in t.chunks)
    total = sum(p.stat().st_size for p in (src / "iter_0000007").glob("*.distcp"))
    assert model < total / 2
    run_direct(str(src), str(tmp_path / "local"), ReshardOptions(target_tp=2))
    url, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch)
    run_direct(url, str(tmp_path / "direct"), ReshardOptions(target_tp=2), storage_options=so,
               cache=ShardCache(tmp_path / "dcache"), cache_sources=cache_sources)
    run_flow(ReshardParams(source=url, destination=str(tmp_path / "flow"), storage_options=so,
                           cache_dir=str(tmp_path / "fcache"), target_tp=2, cache_sources=cache_sources))
    for out, cache in (("direct", "dcache"), ("flow", "fcache")):
        assert output_bytes(tmp_path / out) == output_bytes(tmp_path / "local"), out
        entries = [p for p in (tmp_path / cache / "shards").iterdir() if p.is_file()]
        parted = [p for p in entries if (".ranges-" if cache_sources else ".skeleton") in p.name]  # the .distcp files
        assert len(parted) == len(list((src / "iter_0000007").glob("*.distcp"))), out
        if cache_sources:
            assert model <= _allocated(parted) < model + total / 10, (out, _allocated(parted), model, total)
        else:  # this model's blobs are small, so fetched whole (edges of larger ones: test_streamed_sources)
            assert _allocated(parted) < model + total / 10, (out, _allocated(parted), model, total)
        small = {(src / "iter_0000007" / n).stat().st_size for n in (".metadata", "common.pt", "metadata.json")}
        assert {p.stat().st_size for p in entries if p not in parted} <= small | {1}, out  # fetched whole: these


def test_a_wrecked_common_state_blob_is_one_line_saying_what_torch_found(dist, tmp_path, capsys):
    new = as_019_dist(dist[("mha", 2, 1)], tmp_path / "v019")
    item = read_metadata(new / "iter_0000007/.metadata").byte_items["common_state/shard_0_1"]
    with open(new / "iter_0000007" / item.file, "r+b") as f:
        f.seek(item.offset)
        f.write(b"\0" * item.length)
    assert main(["run", "--direct", str(new), str(tmp_path / "out"), "--target-tp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(common_state/shard_0_1): refused to unpickle: Unsupported operand 0;" in err, err


@pytest.mark.parametrize("cache_sources", [False, True], ids=["streamed", "ranges"])
def test_megatron_core_019s_common_state_is_read_from_s3(dist, tmp_path, s3_server, s3_bucket, monkeypatch,
                                                          cache_sources):
    """The common state's blob (megatron-core >= 0.19) is one of the byte ranges a remote .distcp
    is fetched as, and is read through a streamed file's source: from S3 the output is the local one."""
    from conftest import output_bytes, upload_to_s3
    from reshard.core.options import ReshardOptions
    from reshard.direct import run_direct
    from reshard.storage.cache import ShardCache

    src = as_019_dist(dist[("gqa_swiglu", 2, 1)], tmp_path / "v019")
    run_direct(str(src), str(tmp_path / "local"), ReshardOptions(target_tp=1))
    url, so = upload_to_s3(src, s3_server, s3_bucket, monkeypatch, prefix=f"v019_{cache_sources}")
    run_direct(url, str(tmp_path / "s3"), ReshardOptions(target_tp=1), storage_options=so,
               cache=ShardCache(tmp_path / "cache"), cache_sources=cache_sources)
    assert output_bytes(tmp_path / "s3") == output_bytes(tmp_path / "local")


def test_chunks_are_read_as_views_of_the_mapped_file_equal_to_torch_load(dist):
    """The fast path: a box inside one chunk is a view of the mapped .distcp (no copy), with the
    values ``torch.load`` of the chunk's blob gives; a box across chunks is gathered."""
    import io

    from reshard.formats.torch_dist import TorchDistFormat

    folder = dist[("mha", 2, 1)] / "iter_0000007"
    qkv = TorchDistFormat().load(folder / ".metadata")["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    c = next(c for c in qkv.t.chunks if c.offsets == (1, 0, 0))
    blob = (folder / c.file).read_bytes()[c.offset:c.offset + c.length]
    want = torch.load(io.BytesIO(blob), weights_only=True)[0]
    view = qkv.view(0, 0, c.sizes[1])
    assert view is not None and torch.equal(view, want)
    mapped = qkv.files[c.file].mm
    assert torch.frombuffer(mapped, dtype=torch.uint8).data_ptr() <= view.data_ptr()  # inside the mapping
    assert qkv.view(0, 0, qkv.shape[0]) is None  # both ranks' rows: two chunks
    assert torch.equal(qkv.read(0, 0, qkv.shape[0])[:c.sizes[1]], want)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_chunk_read_from_the_mapped_file_gives_its_pages_back(tmp_path):
    """Reading a chunk maps its pages into the process; once copied out they are given back, so
    a conversion's memory follows the tensor in hand, not the file (a dropper made before the file
    was mapped found nothing to give back: RSS grew to the whole checkpoint)."""
    from reshard.formats.torch_dist import TorchDistFormat
    from reshard.sample import GPTConfig, write_sample_checkpoint

    write_sample_checkpoint(tmp_path / "src", tp=1, cfg=GPTConfig(layers=1, hidden=1024, heads=8, vocab=8192, seq=16))
    assert main(["run", "--direct", str(tmp_path / "src"), str(tmp_path / "dist"), "--to", "torch_dist"]) == 0
    folder = next((tmp_path / "dist").glob("*/.metadata")).parent
    emb = TorchDistFormat().load(folder / ".metadata")["model"]["embedding.word_embeddings.weight"]
    distcp = folder / emb.t.chunks[0].file
    mapped = emb.files  # filled on first read
    view = emb.view(0, 0, emb.shape[0])  # a view of the mapping: touching it maps its pages
    assert view is not None
    want = view.clone()
    assert resident_bytes(distcp) >= want.numel() * want.element_size() // 2 and mapped
    copy = emb.read(0, 0, emb.shape[0], out=torch.empty(want.shape, dtype=want.dtype))  # copied, pages given back
    assert resident_bytes(distcp) < 4 << 20, resident_bytes(distcp)  # at most a folio or two, not the 32 MiB chunk
    assert torch.equal(copy, want)


def test_the_tensor_only_unpickler_describes_views_and_refuses_anything_else():
    import io
    import zipfile

    from reshard.core.safe_load import tensor_record

    def pkl(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")

    rec = tensor_record(pkl(torch.randn(4, 3).t()))
    assert (rec.size, rec.stride, rec.dtype) == ((3, 4), (1, 3), torch.float32)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|not allowed"):
        tensor_record(pickle.dumps(_Boom("/nonexistent")))
    with pytest.raises(pickle.UnpicklingError, match="not a tensor|holds a"):
        tensor_record(pkl({"a": 1}))


def _sample_index():
    from reshard.core.dcp_metadata import DcpBytes, DcpMetadata

    w = DcpTensor("w", (4, 6), torch.bfloat16, (ChunkRef((0, 0), (2, 6), "__0_0.distcp", 0, 100),
                                                 ChunkRef((2, 0), (2, 6), "__0_1.distcp", 7, 90)))
    return DcpMetadata({"w": w}, {"w._extra_state/shard_0_1": DcpBytes("w._extra_state/shard_0_1", "__0_0.distcp",
                                                                         100, 33)},
                       ("w", "w._extra_state/shard_0_1"))


def test_the_written_index_is_torchs_own_metadata_and_reads_back(tmp_path):
    """metadata_bytes names torch's DCP records without importing them; torch's unpickling of it
    equals the Metadata torch builds itself, and the safe reader gets the records back."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from reshard.core.dcp_metadata import metadata_bytes

    meta = _sample_index()
    want = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 6]),
                                       [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                                        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]),
            "w._extra_state/shard_0_1": BytesStorageMetadata()},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 100),
                      MetadataIndex("w", torch.Size([2, 0])): _StorageInfo("__0_1.distcp", 7, 90),
                      MetadataIndex("w._extra_state/shard_0_1"): _StorageInfo("__0_0.distcp", 100, 33)})
    data = metadata_bytes(meta)
    got = pickle.loads(data)
    assert got == want and list(got.state_dict_metadata) == list(meta.keys)
    assert list(got.storage_data.values()) == list(want.storage_data.values())
    assert got.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format
    (tmp_path / ".metadata").write_bytes(data)
    assert read_metadata(tmp_path / ".metadata") == meta


def test_writing_an_index_does_not_import_torch_distributed_checkpoint():
    import subprocess
    import sys

    code = ("import sys, test_torch_dist as t; from reshard.core.dcp_metadata import metadata_bytes; "
            "metadata_bytes(t._sample_index()); "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_index_torch_itself_writes_records_its_folder_as_a_path_and_reads(tmp_path):
    """torch 2.13's ``torch.distributed.checkpoint.save`` pickles the folder it wrote to as a
    ``pathlib.PosixPath`` (``storage_meta.checkpoint_id``); the index reads with it (as a pure
    path, nothing imported or run), a path of anything but strings is still refused, and so is
    every other global beside it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from reshard.core.errors import UnsafeCheckpointError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
                 checkpoint_id=tmp_path / "ck")
    data = (tmp_path / "ck" / ".metadata").read_bytes()
    assert b"PosixPath" in data
    meta = read_metadata(tmp_path / "ck" / ".metadata")
    assert {k: (t.shape, t.dtype) for k, t in meta.tensors.items()} == {"w": ((2, 3), torch.float32),
                                                                       "b": ((3,), torch.bfloat16)}
    path_of_int = b"\x80\x04\x8c\x07pathlib\x8c\tPosixPath\x93K\x07\x85R."  # PosixPath(7)
    for bad, what in ((data.replace(b"PosixPath", b"PosixPatx"), "pathlib.PosixPatx"),
                      (path_of_int, "not of strings")):
        (tmp_path / ".metadata").write_bytes(bad)
        with pytest.raises(UnsafeCheckpointError, match=what):
            read_metadata(tmp_path / ".metadata")
