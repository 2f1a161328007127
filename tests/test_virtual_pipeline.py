"""Interleaved (virtual) and uneven pipeline stages, read and written (Megatron-LM per-rank files).

The sources are written by real megatron-core 0.16.1 on the CPU (``mcore_harness.py``: one process
per rank, gloo, each rank's model chunks built with ``vp_stage`` as Megatron-LM's ``get_model`` builds
them, saved as its legacy save does: ``model0 .. model{V-1}``, the args ``validate_args`` leaves) with
the logits of the pipeline's own forward, chunk by chunk. Every output is loaded strictly into
megatron-core models built from its own saved args at its layout and run the same way; its logits
must be the source's. The layer placement itself is megatron-core's (``stage_table``), and each
plausible wrong answer is shown caught by a twin.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from layout_helpers import convert
from mcore_fixtures import (
    PIPELINES,
    STAGE_CONFIGS,
    STAGE_TABLE,
    mcore_pipeline_checkpoints,
    mcore_pipeline_forward,
    needs_mcore,
)
from reshard.cli import main
from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.pipeline_stages import STAGE_ARG_NAMES, StageLayout, parse_layout

pytestmark = needs_mcore
TOL = 2e-5


def _files(run: Path) -> dict[str, dict[str, Any]]:
    """Every rank file of a run folder by its rank folder's name (``mp_rank_TT_PPP[_EEE]``)."""
    return {f.parent.name: torch.load(f, weights_only=False) for f in sorted(run.glob("iter_*/*/model_optim_rng.pt"))}


def _modules(sd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in sd.items() if k == "model" or (k.startswith("model") and k[5:].isdigit())}


def _same_tensors(ours: Path, theirs: Path) -> None:
    """The same rank files, each holding the same model entries (chunks), keys in the same order, equal tensors."""
    a, b = _files(ours), _files(theirs)
    assert list(a) == list(b)
    for name in a:
        ma, mb = _modules(a[name]), _modules(b[name])
        assert list(ma) == list(mb), name
        for chunk in ma:
            assert list(ma[chunk]) == list(mb[chunk]), (name, chunk)
            for k, v in mb[chunk].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(ma[chunk][k], v), (name, chunk, k)


def _stage_args(run: Path) -> dict[str, Any]:
    args = next(iter(_files(run).values()))["args"]
    return {n: getattr(args, n, None) for n in ("pipeline_model_parallel_size", *STAGE_ARG_NAMES)}


def _logits(run: Path) -> torch.Tensor:
    return torch.load(run / "logits.pt")


@pytest.fixture(scope="module")
def pipes(tmp_path_factory) -> dict[str, Path]:
    return mcore_pipeline_checkpoints(tmp_path_factory.mktemp("pipelines"))


@pytest.fixture(scope="module")
def outs(pipes, tmp_path_factory) -> dict[str, Any]:
    """Every conversion of the proof, and megatron-core's forward of each output (one harness run)."""
    root = tmp_path_factory.mktemp("pipeline_outputs")
    out: dict[str, Any] = {"root": root}

    def run(name: str, src: Path, **options: Any) -> Path:
        out[f"plan:{name}"] = convert(src, root / name, **options)
        return root / name

    run("plain", pipes["vpp"], target_tp=1, target_pp=1)  # VPP -> one stage
    run("vpp4", pipes["vpp"], target_tp=2, target_vpp=4)  # VPP 2 -> VPP 4 (PP kept)
    run("back", root / "plain", target_tp=2, target_pp=2, target_vpp=2)  # plain -> VPP 2
    for fmt in ("torch_dist", "hf"):  # through the CLI: their index and side files too
        assert main(["run", "--direct", str(pipes["vpp"]), str(root / fmt), "--to", fmt]) == 0
    run("uneven_even", pipes["uneven_vpp"], target_tp=1, target_pp=2)  # uneven + VPP -> even, no VPP
    run("uneven_back", root / "uneven_even", target_tp=1, target_pp=3, target_vpp=2,  # and back
        target_first_stage_layers=2, target_last_stage_layers=2)
    run("first3", root / "plain", target_tp=1, target_pp=2, target_first_stage_layers=3)  # plain -> uneven
    run("account_plain", pipes["account"], target_tp=1, target_pp=1)
    run("layout_plain", pipes["layout"], target_tp=1, target_pp=1)
    run("layout_back", root / "layout_plain", target_tp=1, target_pp=2, target_pipeline_layout="Et|tt|tt|tL")
    run("moe_plain", pipes["moe_vpp"], target_tp=1, target_pp=1, target_ep=1)
    run("moe_ep", pipes["moe_vpp"], target_tp=1, target_vpp=1)  # PP 2 and EP 2 kept, chunks merged

    # twin: chunks (0, 1) and (1, 0) swapped, which is what a reader taking chunks pp-major would read
    twin = root / "pp_major_src"
    shutil.copytree(pipes["vpp"], twin)
    for t in range(2):
        f0, f1 = (twin / "iter_0000007" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt" for p in range(2))
        a, b = torch.load(f0, weights_only=False), torch.load(f1, weights_only=False)
        a["model1"], b["model0"] = b["model0"], a["model1"]
        torch.save(a, f0)
        torch.save(b, f1)
    run("pp_major", twin, target_tp=1, target_pp=1)
    # twin: the embedding written into the wrong chunk of the first rank
    emb = root / "emb_twin"
    shutil.copytree(root / "back", emb)
    for f in emb.glob("iter_*/mp_rank_*_000/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model1"] = {"embedding.word_embeddings.weight": sd["model0"].pop("embedding.word_embeddings.weight"),
                        **sd["model1"]}
        torch.save(sd, f)
    # twin: uneven stages written without the args that say so (megatron-core then builds 4 + 4)
    ignored = root / "first_ignored"
    shutil.copytree(root / "first3", ignored)
    for f in ignored.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].decoder_first_pipeline_num_layers = None
        torch.save(sd, f)

    # run by megatron-core: every output but those equal to megatron-core's own files (back, uneven_back,
    # layout_back: tensor for tensor, key order and args, checked below), and the twins
    cases = [("plain", root / "plain", 1, 1, 1), ("vpp4", root / "vpp4", 2, 2, 1),
             ("dist:vpp", root / "torch_dist", 2, 1, 1), ("uneven_even", root / "uneven_even", 1, 2, 1),
             ("first3", root / "first3", 1, 2, 1), ("account_plain", root / "account_plain", 1, 1, 1),
             ("layout_plain", root / "layout_plain", 1, 1, 1), ("moe_plain", root / "moe_plain", 1, 1, 1),
             ("moe_ep", root / "moe_ep", 1, 2, 2), ("pp_major", root / "pp_major", 1, 1, 1),
             ("fails:embedding", emb, 2, 2, 1), ("fails:first_ignored", ignored, 1, 2, 1)]
    out.update(mcore_pipeline_forward(cases, root / "work"))
    return out


def test_layer_placement_is_megatron_cores(pipes):
    """Layers per chunk (and each chunk's first layer) as megatron-core's own functions place them,
    for every way of setting the stages; what megatron-core refuses, reshard refuses. A placement
    with offsets off by a stage, or chunks taken rank-major, would differ from its table."""
    configs, theirs = STAGE_CONFIGS, json.loads(pipes[STAGE_TABLE].read_text())
    for c, table in zip(configs, theirs):
        st = c["stages"]
        build = dict(first=st.get("first"), last=st.get("last"), account_embedding=bool(st.get("account_embedding")),
                     account_loss=bool(st.get("account_loss")), layout=st.get("layout"))
        if isinstance(table, str):  # megatron-core refuses it
            with pytest.raises(LayoutError):
                StageLayout.build(c["layers"], c["pp"], st.get("vpp") or 1, **build)
            continue
        ours = StageLayout.build(c["layers"], c["pp"], st.get("vpp") or 1, **build)
        assert [list(x) for x in zip(ours.offsets(), ours.counts)] == table, c
    assert len(theirs) == len(configs)
    assert sum(isinstance(t, str) for t in theirs) == 7  # the refusals are megatron-core's too


def test_layout_strings_parse_as_megatron_lm_writes_them():
    assert parse_layout("Ett|tt|tt|ttL") == ["Ett", "tt", "tt", "ttL"]
    assert parse_layout("E(t|)*2,tL") == ["Et", "t", "tL"]
    assert parse_layout("Et*3|t*3L") == ["Ettt", "tttL"]
    with pytest.raises(LayoutError, match="holds 'x'"):
        parse_layout("Etx|tL")


def test_interleaved_source_gives_the_pipelines_logits_at_every_output(pipes, outs):
    """VPP (TP 2, PP 2, VPP 2, tied embeddings) -> one stage, -> VPP 4, -> torch_dist: megatron-core's
    logits; -> Hugging Face: transformers' logits."""
    from test_hf_export import hf_logits

    ref = _logits(pipes["vpp"])
    assert ref.abs().max() > 0.5
    for label in ("plain", "vpp4", "dist:vpp"):
        torch.testing.assert_close(outs[label], ref, atol=TOL, rtol=0, msg=label)
    torch.testing.assert_close(hf_logits(outs["root"] / "hf"), ref, atol=TOL, rtol=0)
    plan = outs["plan:vpp4"]
    assert (plan.target_pp, plan.target_vpp, plan.target_stages.counts) == (2, 4, (1,) * 8)
    assert _stage_args(outs["root"] / "vpp4")["virtual_pipeline_model_parallel_size"] == 4
    assert _stage_args(outs["root"] / "vpp4")["num_layers_per_virtual_pipeline_stage"] == 1
    files = _files(outs["root"] / "vpp4")
    assert list(_modules(files["mp_rank_00_000"])) == ["model0", "model1", "model2", "model3"]
    assert "embedding.word_embeddings.weight" in files["mp_rank_00_000"]["model0"]
    assert "output_layer.weight" in files["mp_rank_00_001"]["model3"]  # the tied head's copy, last chunk


def test_plain_to_interleaved_is_the_source_bit_for_bit(pipes, outs):
    """One stage -> TP 2, PP 2, VPP 2 writes megatron-core's own files again: every chunk, key and
    tensor (the tied head copy recreated in the last chunk), with the args Megatron-LM saved."""
    _same_tensors(outs["root"] / "back", pipes["vpp"])
    assert _stage_args(outs["root"] / "back") == _stage_args(pipes["vpp"])
    plain = _stage_args(outs["root"] / "plain")
    assert plain["pipeline_model_parallel_size"] == 1 and not any(plain[n] for n in STAGE_ARG_NAMES)
    common = torch.load(next((outs["root"] / "torch_dist").glob("iter_*/common.pt")), weights_only=False)
    assert not any(getattr(common["args"], n, None) for n in STAGE_ARG_NAMES)  # torch_dist: no pipeline


def test_uneven_stages_to_even_and_back(pipes, outs):
    """Uneven first/last ranks with VPP -> even PP 2 (megatron-core's logits), and back with
    --target-first/last-stage-layers and --target-vpp: megatron-core's own files and args again. One
    stage -> an uneven first stage of 3 layers: megatron-core's logits."""
    for label, src in (("uneven_even", "uneven_vpp"), ("first3", "vpp")):
        torch.testing.assert_close(outs[label], _logits(pipes[src]), atol=TOL, rtol=0, msg=label)
    _same_tensors(outs["root"] / "uneven_back", pipes["uneven_vpp"])
    assert _stage_args(outs["root"] / "uneven_back") == _stage_args(pipes["uneven_vpp"])
    even = _stage_args(outs["root"] / "uneven_even")
    assert even["decoder_first_pipeline_num_layers"] is None and even["virtual_pipeline_model_parallel_size"] is None
    assert outs["plan:uneven_even"].source_stages.counts == (1, 4, 1, 1, 4, 1)
    assert _stage_args(outs["root"] / "first3")["decoder_first_pipeline_num_layers"] == 3


def test_accounting_and_layout_strings(pipes, outs):
    """Stages balanced by counting the embedding and loss, and by a layout string, read (megatron-core's
    logits at one stage); a layout string written (--target-pipeline-layout) is the source again."""
    for label, src in (("account_plain", "account"), ("layout_plain", "layout")):
        torch.testing.assert_close(outs[label], _logits(pipes[src]), atol=TOL, rtol=0, msg=label)
    assert outs["plan:account_plain"].source_stages.counts == (1, 2, 2, 1)
    _same_tensors(outs["root"] / "layout_back", pipes["layout"])
    assert _stage_args(outs["root"] / "layout_back") == _stage_args(pipes["layout"])


def test_interleaved_mixture_of_experts(pipes, outs):
    """MoE at EP 2 with a dense first layer, PP 2 x VPP 2 -> one stage at EP 1, and -> PP 2 without
    virtual stages at EP 2: megatron-core's logits (each chunk's spec is dense or MoE by global layer)."""
    for label in ("moe_plain", "moe_ep"):
        torch.testing.assert_close(outs[label], _logits(pipes["moe_vpp"]), atol=TOL, rtol=0, msg=label)


def test_wrong_answers_are_caught(pipes, outs):
    """Chunks read rank-major (chunks (0,1) and (1,0) swapped) give other logits; the embedding in the
    wrong chunk, and uneven stages whose args are missing, do not load into megatron-core."""
    ref = _logits(pipes["vpp"])
    assert (outs["pp_major"] - ref).abs().max() > 100 * TOL
    emb = [e for e in outs["fails:embedding"] if e]
    assert emb and all("embedding.word_embeddings.weight" in e for e in emb)
    ignored = [e for e in outs["fails:first_ignored"] if e]
    assert ignored and any("Missing key" in e or "Unexpected key" in e for e in ignored)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_refusals(pipes, tmp_path):
    """One line naming the file or flag, nothing written."""
    with pytest.raises(LayoutError, match="holds 4 layers, which 3 virtual stages do not divide"):
        convert(pipes["vpp"], tmp_path / "x", target_tp=1, target_vpp=3)
    with pytest.raises(LayoutError, match="3 stages, not a multiple of PP 2"):
        convert(pipes["vpp"], tmp_path / "x", target_tp=1, target_pipeline_layout="Et|tt|tL")
    with pytest.raises(LayoutError, match="places 5 layers; the model has 8"):
        convert(pipes["vpp"], tmp_path / "x", target_tp=1, target_pipeline_layout="Ett|t|t|tL")
    with pytest.raises(LayoutError, match="has no pipeline stages"):
        convert(pipes["vpp"], tmp_path / "x", to="hf", target_vpp=2)
    with pytest.raises(LayoutError, match="need more than one pipeline rank"):
        convert(pipes["vpp"], tmp_path / "x", target_tp=1, target_pp=1, target_vpp=2)
    assert not (tmp_path / "x").exists()
    # a chunk missing from a rank file
    missing = _copy(pipes["vpp"], tmp_path / "missing")
    f = missing / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    del sd["model1"]
    torch.save(sd, f)
    with pytest.raises(CheckpointFormatError, match="lacks model1") as info:
        convert(missing, tmp_path / "x", target_tp=1)
    assert "mp_rank_01_001" in info.value.culprit
    # a chunk the args do not explain
    extra = _copy(pipes["vpp"], tmp_path / "extra")
    for f in extra.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model2"] = {}
        torch.save(sd, f)
    with pytest.raises(CheckpointFormatError, match="3 model chunks .* args say 2 virtual pipeline stages"):
        convert(extra, tmp_path / "x", target_tp=1)
    # args whose uneven stages are not what the files hold
    wrong = _copy(pipes["uneven_vpp"], tmp_path / "wrong")
    for f in wrong.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].decoder_first_pipeline_num_layers, sd["args"].decoder_last_pipeline_num_layers = 4, None
        torch.save(sd, f)
    with pytest.raises(CheckpointFormatError, match=r"model chunk \(pipeline rank 0, virtual stage 0\) holds 1 "
                                                    r"layers; the saved args .* give it 2"):
        convert(wrong, tmp_path / "x", target_tp=1)
    # a layout string cannot be kept over another number of virtual stages
    with pytest.raises(LayoutError, match="layout string .* another number of virtual stages"):
        convert(pipes["layout"], tmp_path / "x", target_tp=1, target_vpp=1)
    # the CLI: exit 2, one line
    assert main(["run", "--direct", str(pipes["vpp"]), str(tmp_path / "cli"), "--target-tp", "1",
                 "--target-vpp", "3"]) == 2
    assert not (tmp_path / "cli").exists()


def test_plan_and_inspect_show_the_chunks(pipes, capsys):
    assert main(["inspect", str(pipes["uneven_vpp"])]) == 0
    out = capsys.readouterr().out
    assert "vpp          2" in out
    assert "PP 3 x VPP 2, layers per chunk (rank,virtual) (0,0):1 (1,0):4 (2,0):1 (0,1):1 (1,1):4 (2,1):1" in out
    assert main(["plan", str(pipes["vpp"]), "--target-tp", "2", "--target-vpp", "4"]) == 0
    out = capsys.readouterr().out
    assert ("stages: PP 2 x VPP 2, layers per chunk (rank,virtual) (0,0):2 (1,0):2 (0,1):2 (1,1):2 "
            "-> PP 2 x VPP 4") in out


def test_fixture_layouts_are_what_they_claim(pipes):
    """The harness wrote what the proof assumes: model chunks per rank file, the saved args of each way."""
    files = _files(pipes["uneven_vpp"])
    assert list(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002"]
    assert [len({k.split(".")[2] for k in files["mp_rank_00_001"][c] if k.startswith("decoder.layers.")})
            for c in ("model0", "model1")] == [4, 4]
    assert _stage_args(pipes["uneven_vpp"])["num_virtual_stages_per_pipeline_rank"] == 2
    assert _stage_args(pipes["layout"])["pipeline_model_parallel_layout"] == "Et|tt|tt|tL"
    assert set(PIPELINES) | {STAGE_TABLE} == set(pipes)


def test_torch_dist_of_an_interleaved_run(pipes, outs, tmp_path):
    """A torch_dist checkpoint saved by an interleaved run (its common.pt args say PP 2 x VPP 2; its
    tensors are global) is read as the one stage it holds and written at any pipeline: back at
    PP 2 x VPP 2 it is the run's own per-rank files; at one stage its args describe no pipeline."""
    src = _copy(outs["root"] / "torch_dist", tmp_path / "dist")
    common = next(src.glob("iter_*/common.pt"))
    sd = torch.load(common, weights_only=False)
    for name, value in (("pipeline_model_parallel_size", 2), ("virtual_pipeline_model_parallel_size", 2),
                        ("num_layers_per_virtual_pipeline_stage", 2)):
        setattr(sd["args"], name, value)
    torch.save(sd, common)
    assert main(["run", "--direct", str(src), str(tmp_path / "vpp"), "--target-tp", "2", "--target-pp", "2",
                 "--target-vpp", "2"]) == 0
    _same_tensors(tmp_path / "vpp", pipes["vpp"])
    assert _stage_args(tmp_path / "vpp") == _stage_args(pipes["vpp"])
    assert main(["run", "--direct", str(src), str(tmp_path / "one"), "--target-tp", "1"]) == 0
    one = _stage_args(tmp_path / "one")
    assert one["pipeline_model_parallel_size"] == 1 and not any(one[n] for n in STAGE_ARG_NAMES)


def test_only_the_virtual_stages_change(pipes, tmp_path):
    """--target-vpp alone at the source's PP keeps its uneven first/last ranks (2 + 8 + 2 layers)."""
    plan = convert(pipes["uneven_vpp"], tmp_path / "v1", target_tp=1, target_vpp=1)
    assert plan.target_stages.counts == (2, 8, 2)
    args = _stage_args(tmp_path / "v1")
    assert (args["decoder_first_pipeline_num_layers"], args["decoder_last_pipeline_num_layers"]) == (2, 2)
    assert args["virtual_pipeline_model_parallel_size"] is None and args["num_virtual_stages_per_pipeline_rank"] is None


def test_saved_stage_args_stay_as_saved_when_the_stages_do(pipes, outs, tmp_path):
    """A TP change keeps the source's own stage fields (Megatron-LM refuses two ways of giving the virtual
    stages, so one written beside the user's own would break a resume); a PP 1 checkpoint trained with the
    embedding/loss counted (megatron-core builds every layer there) is read."""
    src = _copy(pipes["vpp"], tmp_path / "vspr")
    for f in src.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].num_virtual_stages_per_pipeline_rank, sd["args"].num_layers_per_virtual_pipeline_stage = 2, None
        torch.save(sd, f)
    convert(src, tmp_path / "tp1", target_tp=1)
    assert _stage_args(tmp_path / "tp1") == _stage_args(src)
    one = _copy(outs["root"] / "plain", tmp_path / "account")
    for f in one.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].account_for_embedding_in_pipeline_split = sd["args"].account_for_loss_in_pipeline_split = True
        torch.save(sd, f)
    plan = convert(one, tmp_path / "account_tp2", target_tp=2)
    assert plan.target_stages.counts == (8,) and _stage_args(tmp_path / "account_tp2") == _stage_args(one)


def test_overlap_p2p_comm_follows_the_virtual_stages_and_bad_stage_args_are_refused(pipes, outs, tmp_path):
    """Megatron-LM's validate_args turns overlap_p2p_comm off without virtual stages and needs PP > 2 with
    them unless it is on: the output's args say what the output is. A stage arg that is no number is
    refused in one line, nothing written."""
    one = _copy(outs["root"] / "plain", tmp_path / "one")
    src = _copy(pipes["vpp"], tmp_path / "vpp")
    for folder, value in ((one, False), (src, True)):
        for f in folder.glob("iter_*/*/model_optim_rng.pt"):
            sd = torch.load(f, weights_only=False)
            sd["args"].overlap_p2p_comm = value
            torch.save(sd, f)
    convert(one, tmp_path / "to_vpp", target_tp=1, target_pp=2, target_vpp=2)
    convert(src, tmp_path / "to_one", target_tp=1, target_pp=1)
    assert next(iter(_files(tmp_path / "to_vpp").values()))["args"].overlap_p2p_comm is True
    assert next(iter(_files(tmp_path / "to_one").values()))["args"].overlap_p2p_comm is False
    for f in src.glob("iter_*/*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].decoder_first_pipeline_num_layers = "2"
        torch.save(sd, f)
    with pytest.raises(CheckpointFormatError, match="decoder_first_pipeline_num_layers is '2', not a number"):
        convert(src, tmp_path / "x", target_tp=1)
    assert not (tmp_path / "x").exists()


def test_iteration_folder_and_deepspeed_pipeline_folders(pipes, tmp_path, capsys):
    """An iteration folder of the interleaved run reads as its run folder does; DeepSpeed's pipeline
    layer files have no virtual or uneven stages to write (refused, nothing written)."""
    from test_deepspeed_pipeline import write_pipeline

    iteration = next(pipes["uneven_vpp"].glob("iter_*"))
    assert main(["inspect", str(iteration)]) == 0
    assert "(0,0):1 (1,0):4 (2,0):1 (0,1):1 (1,1):4 (2,1):1" in capsys.readouterr().out
    plan = convert(iteration, tmp_path / "even", target_tp=1, target_pp=2)
    assert plan.source_stages.counts == (1, 4, 1, 1, 4, 1) and plan.target_stages.counts == (6, 6)
    ds = write_pipeline(tmp_path / "pipe", tp=2, pp=2)
    with pytest.raises(LayoutError, match="DeepSpeed pipeline layer files have no virtual or uneven stages"):
        convert(ds, tmp_path / "x", target_tp=2, target_vpp=2)
    assert not (tmp_path / "x").exists()

