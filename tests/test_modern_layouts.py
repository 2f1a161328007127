"""Modern layouts on sample checkpoints (fast, no megatron-core needed): megatron-core and legacy
Megatron-LM names, GQA, SwiGLU, vocabulary re-padding, any N -> M, the Megatron-LM run folder,
carried ``_extra_state`` and foreign objects, and every refusal with its message.

``reshard.sample.write_core_sample_checkpoint`` lays ranks out from the full weights with its own
reshape code (independent of ``reshard.core``) and pads the vocabulary with zeros, so a correct
reshard of the TP=N sample equals the TP=M sample bit for bit — padding rows included.
"""

from __future__ import annotations

import argparse
import enum
import io
import itertools
import json
import pickle
import shutil
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from layout_helpers import convert, converted_args, legacy_names
from mcore019 import CudaGraphModule, InferenceCudaGraphScope, serve_019_enums
from mcore_reference import Arch, core_logits
from reshard.cli import main
from reshard.core import foreign
from reshard.core.errors import CheckpointFormatError, LayoutError, MissingModelFactError, UnsafeCheckpointError
from reshard.core.layouts import pieces_for_target
from reshard.core.quantize import QUANT_KEY, dequantize_piece
from reshard.core.safe_load import load_shard
from reshard.execution.plan import ReshardOptions
from reshard.execution.planner import build_plan
from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint

# 48 heads in 24 query groups: every TP in {2, 3, 4, 6, 8} holds whole groups
GQA = CoreGPTConfig(layers=2, hidden=192, heads=48, groups=24, ffn=96, swiglu=True, rmsnorm=True, bias=False,
                    rope=True, tied=False, vocab=200, divisible_by=8, seq=16)
MHA = CoreGPTConfig(layers=2, hidden=96, heads=24, ffn=96, vocab=200, divisible_by=8, seq=16)
CONFIGS = {"gqa": GQA, "mha": MHA}
PAIRS = [(8, 6), (6, 4), (4, 3), (3, 2), (2, 3), (6, 8), (8, 2), (2, 8), (1, 6), (6, 1)]
TOKENS = torch.tensor([3, 17, 64, 199, 0, 42, 5, 77, 31, 8, 150, 90])

_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("core_samples")

    def make(name: str, tp: int, pp: int = 1, **kw) -> Path:
        key = (name, tp, pp, tuple(sorted(kw.items())))
        if key not in _CACHE:
            folder = root / f"{name}_tp{tp}_pp{pp}_{len(_CACHE)}"
            write_core_sample_checkpoint(folder, tp=tp, pp=pp, cfg=CONFIGS[name], **kw)
            _CACHE[key] = folder
        return _CACHE[key]

    return make


def _iter(run: Path) -> Path:
    return run / "iter_0000100"


def _load(run: Path, tp: int, pp: int = 1) -> list[dict]:
    subs = [f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{s:03d}" for s in range(pp) for r in range(tp)]
    return [load_shard(_iter(run) / sub / "model_optim_rng.pt", mmap=False) for sub in subs]


def _assert_same_checkpoint(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert list(a["model"]) == list(b["model"])
        for k, v in b["model"].items():
            if isinstance(v, torch.Tensor):
                assert a["model"][k].dtype == v.dtype and torch.equal(a["model"][k], v), k
            else:
                assert type(a["model"][k]) is type(v), k
        assert vars(a["args"]) == converted_args(b["args"])


def _arch(cfg: CoreGPTConfig) -> Arch:
    return Arch(cfg.layers, cfg.heads, cfg.query_groups, cfg.swiglu, cfg.rmsnorm, cfg.rope)


def _logits(run: Path, tp: int, cfg: CoreGPTConfig) -> torch.Tensor:
    return core_logits([sd["model"] for sd in _load(run, tp)], _arch(cfg), TOKENS)[:, :cfg.vocab]


def test_core_sample_is_the_same_model_at_every_tp(samples):
    for name, cfg in CONFIGS.items():
        ref = _logits(samples(name, 1), 1, cfg)
        for tp in (2, 3, 4, 6, 8):
            torch.testing.assert_close(_logits(samples(name, tp), tp, cfg), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("n,m", PAIRS, ids=[f"{n}to{m}" for n, m in PAIRS])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_any_n_to_m_equals_the_sample_written_at_m(samples, tmp_path, name, n, m):
    cfg = CONFIGS[name]
    plan = convert(samples(name, n), tmp_path / "out", target_tp=m)
    _assert_same_checkpoint(_load(tmp_path / "out", m), _load(samples(name, m), m))
    assert (plan.facts.padded_vocab_source, plan.facts.padded_vocab_target) == (cfg.padded_vocab(n),
                                                                             cfg.padded_vocab(m))
    # the plan names the source ranks whose rows each target holds (vocab re-padding can add one)
    for t in plan.targets:
        overlap = [s for s in range(n) if s * m < (t.tp_rank + 1) * n and (s + 1) * m > t.tp_rank * n]
        assert set(overlap) <= set(t.sources) and len(t.sources) <= len(overlap) + 1
    torch.testing.assert_close(_logits(tmp_path / "out", m, cfg), _logits(samples(name, n), n, cfg),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("n,m", [(8, 6), (2, 3)], ids=["8to6", "2to3"])
def test_bf16_any_n_to_m(samples, tmp_path, n, m):
    convert(samples("gqa", n, dtype=torch.bfloat16), tmp_path / "out", target_tp=m)
    _assert_same_checkpoint(_load(tmp_path / "out", m), _load(samples("gqa", m, dtype=torch.bfloat16), m))


def test_plan_lists_sources_for_8_to_6(samples):
    plan = build_plan(str(samples("gqa", 8)), ReshardOptions(target_tp=6, vocab_size=200))
    # target 3 holds layer rows of sources 4-5 and, re-padded 256 -> 240, vocabulary rows 120..159 of 3-4
    assert [list(t.sources) for t in plan.targets] == [[0, 1], [1, 2], [2, 3], [3, 4, 5], [5, 6], [6, 7]]
    assert [t.base_rank for t in plan.targets] == [0, 1, 2, 4, 5, 6]
    assert [t.name for t in plan.targets] == [f"iter_0000100/mp_rank_{r:02d}/model_optim_rng.pt" for r in range(6)]
    assert dict(plan.extra_files) == {"latest_checkpointed_iteration.txt": "100"}


def _legacy_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = legacy_names(sd["model"])
        torch.save(sd, f)
    return dst


@pytest.mark.parametrize("n,m", [(8, 6), (4, 3), (2, 8)], ids=["8to6", "4to3", "2to8"])
def test_legacy_megatron_lm_names_with_gqa_and_swiglu(samples, tmp_path, n, m):
    src = _legacy_copy(samples("gqa", n), tmp_path / "src")
    want = _legacy_copy(samples("gqa", m), tmp_path / "want")
    plan = convert(src, tmp_path / "out", target_tp=m)
    assert plan.facts.naming == "legacy" and "language_model.encoder.layers.0.input_norm.weight" in \
        [p.key for p in plan.params]
    _assert_same_checkpoint(_load(tmp_path / "out", m), _load(want, m))


def test_swiglu_merge_regroups_gate_and_up(samples, tmp_path):
    """[W0;V0;W1;V1] is not [W0;W1;V0;V1]: the TP=1 fc1 is all gates, then all ups."""
    convert(samples("gqa", 2), tmp_path / "out", target_tp=1)
    fc1 = _load(tmp_path / "out", 1)[0]["model"]["decoder.layers.0.mlp.linear_fc1.weight"]
    ranks = [sd["model"]["decoder.layers.0.mlp.linear_fc1.weight"] for sd in _load(samples("gqa", 2), 2)]
    w = [r.chunk(2)[0] for r in ranks]
    v = [r.chunk(2)[1] for r in ranks]
    assert torch.equal(fc1, torch.cat(w + v)) and not torch.equal(fc1, torch.cat(ranks))


@pytest.mark.parametrize("n,m", [(8, 2), (8, 6), (2, 4)], ids=["8to2", "8to6", "2to4"])
def test_quantized_swiglu_fc1_dequantizes_to_the_resharded_weight(samples, tmp_path, n, m):
    src = samples("gqa", n)
    convert(src, tmp_path / "plain", target_tp=m)
    plan = convert(src, tmp_path / "q", target_tp=m, quantize=True, groups=4)
    key = "decoder.layers.1.mlp.linear_fc1.weight"
    p = next(x for x in plan.params if x.key == key)
    assert p.spec.parts == 2 and p.quant_slot.value == "h_to_4h"
    for t in range(m):
        q = _load(tmp_path / "q", m)[t]
        plain = _load(tmp_path / "plain", m)[t]["model"][key]
        scales = q[QUANT_KEY]["scales"][1, 2]  # layer 1, slot h_to_4h
        per_part = p.shape[0] // 2
        pieces = pieces_for_target(per_part, n, m, t)
        g = 8  # 2x groups for MLP weights (extra grouping)
        qw, back = q["model"][key], torch.empty_like(plain)
        rows = [0, 0]
        for i, pc in enumerate(pieces):
            idx = [torch.arange(rows[0], rows[0] + pc.length),
                   plain.shape[0] // 2 + torch.arange(rows[1], rows[1] + pc.length)]
            piece_q = torch.cat([qw[idx[0]], qw[idx[1]]])
            deq = dequantize_piece(piece_q, scales[i * g:(i + 1) * g])
            back[idx[0]], back[idx[1]] = deq[:pc.length], deq[pc.length:]
            rows = [rows[0] + pc.length, rows[1] + pc.length]
        step = scales.max()
        assert (back - plain).abs().max() <= step + 1e-6
        assert q["args"].tensor_model_parallel_size == m


def test_extra_state_bytesio_and_tensors_are_carried_as_is(tmp_path):
    cfg = CoreGPTConfig(groups=4, swiglu=True)
    write_core_sample_checkpoint(tmp_path / "src", tp=2, cfg=cfg, extra_state=io.BytesIO(b"te-fp8-meta"))
    convert(tmp_path / "src", tmp_path / "out", target_tp=4)
    for sd in _load(tmp_path / "out", 4):
        es = sd["model"]["decoder.layers.1.mlp.linear_fc2._extra_state"]
        assert isinstance(es, io.BytesIO) and es.getvalue() == b"te-fp8-meta"
    # newer Transformer Engine saves a uint8 tensor; carried too, never compared across ranks
    write_core_sample_checkpoint(tmp_path / "t", tp=2, cfg=cfg, extra_state=torch.arange(5, dtype=torch.uint8))
    f1 = _iter(tmp_path / "t") / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(f1, weights_only=False)
    sd["model"]["output_layer._extra_state"] = torch.arange(9, dtype=torch.uint8)  # per-rank state may differ
    torch.save(sd, f1)
    plan = convert(tmp_path / "t", tmp_path / "t_out", target_tp=1)
    assert not any(p.key.endswith("_extra_state") for p in plan.params)
    assert {p.rule.kind.value for p in plan.carried} == {"carried"} and plan.carried[0].dtype == torch.uint8
    assert torch.equal(_load(tmp_path / "t_out", 1)[0]["model"]["output_layer._extra_state"], torch.arange(5).byte())


def test_foreign_objects_load_safely_and_are_written_back_as_they_were(tmp_path):
    """Megatron-LM saves numpy RNG state and numpy/megatron objects in args: loaded as inert
    stand-ins (nothing imported or run), carried entries re-pickled under their real names."""
    write_core_sample_checkpoint(tmp_path / "src", tp=2)
    for f in (tmp_path / "src").rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].lr = np.float64(3e-4)
        sd["args"].seed_array = np.arange(3, dtype=np.int64)
        sd["rng_state"][0]["np_rng_state"] = np.random.get_state()
        torch.save(sd, f)
    convert(tmp_path / "src", tmp_path / "out", target_tp=1)
    out = torch.load(_iter(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert type(out["args"].lr) is np.float64 and out["args"].lr == np.float64(3e-4)
    assert isinstance(out["args"].seed_array, np.ndarray) and out["args"].seed_array.tolist() == [0, 1, 2]
    assert "rng_state" not in out
    safe = load_shard(_iter(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt")
    assert type(safe["args"].lr).__name__.startswith("Foreign_")


class _EnumByNamePickler(pickle.Pickler):
    """Pickles enum members as ``getattr(EnumClass, name)``, as Python 3.11.2 does (3.11.7 does
    not), so the by-name form is tested whichever Python runs the tests."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if obj is _GETATTR_ON_NAMESPACE:
            return getattr, (argparse.Namespace, "__init__")
        return NotImplemented


_GETATTR_ON_NAMESPACE = object()
_ENUM_BY_NAME = types.ModuleType("enum_by_name_pickle")  # the pickle_module torch.save takes
_ENUM_BY_NAME.Pickler, _ENUM_BY_NAME.Unpickler = _EnumByNamePickler, pickle.Unpickler  # type: ignore[attr-defined]


def test_enum_members_pickled_by_name_load_as_stand_ins_and_are_written_back(tmp_path):
    from megatron.core.transformer.enums import AttnBackend

    write_core_sample_checkpoint(tmp_path / "src", tp=2)
    for f in (tmp_path / "src").rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].attention_backend = AttnBackend.auto
        torch.save(sd, f, pickle_module=_ENUM_BY_NAME)
        with zipfile.ZipFile(f) as z:
            assert b"getattr" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    safe = load_shard(next((tmp_path / "src").rglob("model_optim_rng.pt")))
    member = safe["args"].attention_backend
    assert isinstance(member, foreign.ForeignMember) and member.foreign_args[1] == "auto"
    assert member.foreign_args[0] is foreign.STAND_INS["megatron.core.transformer.enums.AttnBackend"]
    convert(tmp_path / "src", tmp_path / "out", target_tp=1)
    out = torch.load(_iter(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert out["args"].attention_backend is AttnBackend.auto


def test_loads_resolve_to_stand_ins_whatever_else_is_in_torchs_allowlist(tmp_path):
    """Importing megatron.core adds its real classes to torch's process-wide allowlist under the
    names our stand-ins use; torch then picks either entry by set order. Decoys are added here
    until a plain ``safe_globals(SAFE_GLOBALS)`` load *would* pick one, so the test cannot pass by
    luck; reshard's load must still give the stand-in, and leave the caller's allowlist as it was."""
    from megatron.core.transformer.enums import AttnBackend
    from torch._weights_only_unpickler import _get_user_allowed_globals

    from reshard.core.safe_load import SAFE_GLOBALS

    name = "megatron.core.transformer.enums.AttnBackend"
    write_core_sample_checkpoint(tmp_path / "src", tp=1)
    f = _iter(tmp_path / "src") / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["args"].attention_backend = AttnBackend.auto  # by value or by name, as this Python pickles enums
    torch.save(sd, f)
    saved = torch.serialization.get_safe_globals()
    try:
        for i in range(64):
            decoy = type(f"Decoy{i}", (), {"__init__": lambda self, *a: None})
            torch.serialization.add_safe_globals([(decoy, name)])
            with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
                if _get_user_allowed_globals()[name] is not foreign.STAND_INS[name]:
                    break
        else:
            pytest.fail("could not make a decoy win torch's lookup")
        before = torch.serialization.get_safe_globals()
        got = load_shard(f)["args"].attention_backend
        if isinstance(got, foreign.ForeignMember):  # this Python pickles enum members by name
            assert got.foreign_args == (foreign.STAND_INS[name], "auto")
        else:
            assert type(got) is foreign.STAND_INS[name] and got.foreign_args == (5,)
        assert set(torch.serialization.get_safe_globals()) == set(before)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def test_getattr_on_anything_but_a_stand_in_class_is_refused(tmp_path):
    write_core_sample_checkpoint(tmp_path / "src", tp=1)
    f = _iter(tmp_path / "src") / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["args"].hook = _GETATTR_ON_NAMESPACE
    torch.save(sd, f, pickle_module=_ENUM_BY_NAME)
    with pytest.raises(UnsafeCheckpointError, match="getattr"):
        build_plan(str(tmp_path / "src"), ReshardOptions(target_tp=1))


def test_unlisted_foreign_class_is_still_refused(tmp_path):
    write_core_sample_checkpoint(tmp_path / "src", tp=1)
    f = _iter(tmp_path / "src") / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["args"].when = __import__("datetime").date(2024, 1, 1)
    torch.save(sd, f)
    with pytest.raises(UnsafeCheckpointError) as err:
        build_plan(str(tmp_path / "src"), ReshardOptions(target_tp=1))
    msg = str(err.value)
    assert "refused to unpickle: global datetime.date is outside reshard's allowlist; nothing" in msg, msg
    assert "\x1b" not in msg and "add_safe_globals" not in msg and "weights_only" not in msg, msg


@pytest.fixture
def mcore_019_enums(monkeypatch):
    serve_019_enums(monkeypatch)


def test_megatron_lm_019_args_and_rng_state_load_as_stand_ins_and_are_written_back(tmp_path, mcore_019_enums):
    """Megatron-LM 0.19's validate_args always saves ``args.inference_cuda_graph_scope`` as its enum
    and ``args.cuda_graph_modules`` as a list of CudaGraphModule, ``args.exit_signal`` as a signal;
    with CUDA-graph-safe RNG the tracker states are torch generators. All load as inert stand-ins
    (refused before: outside the allowlist), carried args come out as they went in."""
    import signal

    write_core_sample_checkpoint(tmp_path / "src", tp=2)
    for f in (tmp_path / "src").rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].inference_cuda_graph_scope = InferenceCudaGraphScope.none
        sd["args"].cuda_graph_modules = [CudaGraphModule.attn, CudaGraphModule.moe_router]
        sd["args"].exit_signal = signal.SIGTERM
        sd["rng_state"][0]["rng_tracker_states"] = {"model-parallel-rng": torch.Generator().manual_seed(7)}
        torch.save(sd, f)
    safe = load_shard(next((tmp_path / "src").rglob("model_optim_rng.pt")))
    scope = safe["args"].inference_cuda_graph_scope
    assert scope.qualname == "megatron.core.transformer.enums.InferenceCudaGraphScope" and scope.foreign_args == (1,)
    assert safe["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"].qualname == "torch._C.Generator"
    convert(tmp_path / "src", tmp_path / "out", target_tp=1)
    out = torch.load(_iter(tmp_path / "out") / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert out["args"].inference_cuda_graph_scope is InferenceCudaGraphScope.none
    assert out["args"].cuda_graph_modules == [CudaGraphModule.attn, CudaGraphModule.moe_router]
    assert out["args"].exit_signal is signal.SIGTERM and "rng_state" not in out


@pytest.mark.parametrize("entry", ["output_layer._extra_state", "decoder.final_layernorm.weight"])
def test_an_allowlisted_object_in_place_of_a_weight_is_refused(tmp_path, entry):
    """The stand-ins are for what is saved beside the model; in the module (a weight, a Transformer
    Engine extra state) one is refused, naming the entry and the class (carried before)."""
    from megatron.core.transformer.enums import AttnBackend

    write_core_sample_checkpoint(tmp_path / "src", tp=1)
    f = _iter(tmp_path / "src") / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["model"][entry] = {"recipe": AttnBackend.flash}
    torch.save(sd, f)
    with pytest.raises(UnsafeCheckpointError, match=f"module entry {entry} holds a "
                                                    r"megatron\.core\.transformer\.enums\.AttnBackend"):
        build_plan(str(tmp_path / "src"), ReshardOptions(target_tp=1))


# --- Megatron-LM run folders --------------------------------------------------------------------


def test_run_folder_iteration_folder_and_release(samples, tmp_path):
    run = samples("mha", 2)
    a = build_plan(str(run), ReshardOptions(target_tp=1))
    b = build_plan(str(_iter(run)), ReshardOptions(target_tp=1))
    assert a.source.files == b.source.files and a.source.iteration == "iter_0000100"
    assert a.source.relative_names == ("iter_0000100/mp_rank_00/model_optim_rng.pt",
                                       "iter_0000100/mp_rank_01/model_optim_rng.pt")
    assert b.source.relative_names == ("mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt")
    assert a.facts.to_record()["origin"]["vocab_size"] == "args" and a.output_format == "megatron"
    rel = tmp_path / "rel"
    shutil.copytree(_iter(run), rel / "release")
    (rel / "latest_checkpointed_iteration.txt").write_text("release")
    plan = build_plan(str(rel), ReshardOptions(target_tp=1))
    assert plan.targets[0].name == "release/mp_rank_00/model_optim_rng.pt"
    assert dict(plan.extra_files) == {"latest_checkpointed_iteration.txt": "release"}


def _refuses(tmp_path, src, exc, match, **opts):
    with pytest.raises(exc, match=match) as info:
        convert(src, tmp_path / "never", **opts)
    assert info.value.hint and not (tmp_path / "never").exists()


def test_megatron_folder_errors(samples, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(samples("mha", 2), run)
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    _refuses(tmp_path, run, CheckpointFormatError, "names iteration 200 but iter_0000200/ does not exist",
             target_tp=1)
    (run / "latest_checkpointed_iteration.txt").write_text("100")
    shutil.rmtree(_iter(run) / "mp_rank_01")
    _refuses(tmp_path, run, CheckpointFormatError, "args.tensor_model_parallel_size is 2 but 1", target_tp=1)
    moe = tmp_path / "moe" / "iter_0000100" / "mp_rank_00_000_001"
    moe.mkdir(parents=True)
    _refuses(tmp_path, moe.parent, CheckpointFormatError, "mp_rank_00_000_001/ holds no model_optim_rng.pt",
             target_tp=1)
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "__0_0.distcp").write_bytes(b"x")
    _refuses(tmp_path, dist, CheckpointFormatError, "holds no complete checkpoint reshard reads", target_tp=1)
    with pytest.raises(CheckpointFormatError) as info:
        build_plan(str(dist), ReshardOptions(target_tp=1))
    assert "torch_dist" in info.value.hint
    vpp = tmp_path / "vpp"
    shutil.copytree(samples("mha", 1), vpp)
    f = _iter(vpp) / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["model0"] = sd.pop("model")
    torch.save(sd, f)
    _refuses(tmp_path, vpp, CheckpointFormatError, "interleaved \\(virtual\\) pipeline", target_tp=1)


# --- refusals -----------------------------------------------------------------------------------


def _strip_args(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        del sd["args"]
        torch.save(sd, f)
    return dst


def test_group_count_must_divide_the_target_tp(samples, tmp_path):
    _refuses(tmp_path, samples("gqa", 8), LayoutError,
             r"24 query groups \(48 heads\) cannot be divided over 16 target ranks", target_tp=16)
    _refuses(tmp_path, samples("mha", 8), LayoutError, "24 attention heads cannot be divided over 16",
             target_tp=16)


def test_split_without_args_needs_heads_then_groups(samples, tmp_path):
    src = _strip_args(samples("gqa", 2), tmp_path / "noargs")
    _refuses(tmp_path, src, MissingModelFactError, "head count is unknown", target_tp=4)
    _refuses(tmp_path, src, MissingModelFactError, "number of query groups is unknown.*--num-query-groups",
             target_tp=4, num_heads=48)
    _refuses(tmp_path, src, LayoutError, "do not hold 16 query groups", target_tp=4, num_heads=48,
             num_query_groups=16)
    plan = convert(src, tmp_path / "ok", target_tp=4, num_heads=48, num_query_groups=24)
    assert plan.facts.origin["query_groups"] == "--num-query-groups"
    want = _load(samples("gqa", 4), 4)
    for ours, theirs in zip(_load(tmp_path / "ok", 4), want):  # no args: the vocabulary stays padded as is
        for k, v in theirs["model"].items():
            if isinstance(v, torch.Tensor) and "word_embeddings" not in k and "output_layer" not in k:
                assert torch.equal(ours["model"][k], v), k
    # a merge of whole ranks needs no facts at all
    convert(src, tmp_path / "merge", target_tp=1)


def test_contradicting_flags_are_refused(samples, tmp_path):
    src = samples("gqa", 2)
    _refuses(tmp_path, src, LayoutError, "--num-query-groups 12 contradicts", target_tp=1, num_query_groups=12)
    _refuses(tmp_path, src, LayoutError, "args.swiglu says gated|--swiglu/--no-swiglu says plain", target_tp=1,
             swiglu=False)
    _refuses(tmp_path, src, LayoutError, "--vocab-size 150 contradicts", target_tp=1, vocab_size=150)


def test_unknown_swiglu_is_refused_when_the_layout_changes(samples, tmp_path):
    """Without args and without fc2 to compare with, gating is unknown: refused unless N == M."""
    src = _strip_args(samples("gqa", 2), tmp_path / "s")
    for f in src.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["model"] = {k: v for k, v in sd["model"].items() if "linear_fc2" not in k}
        torch.save(sd, f)
    _refuses(tmp_path, src, MissingModelFactError, "gated \\(SwiGLU\\) is unknown.*", target_tp=1)
    with pytest.raises(MissingModelFactError) as info:
        build_plan(str(src), ReshardOptions(target_tp=1))
    assert "--swiglu or --no-swiglu" in info.value.hint
    plan = build_plan(str(src), ReshardOptions(target_tp=1, swiglu=True))
    assert plan.facts.swiglu is True and plan.facts.origin["swiglu"] == "--swiglu/--no-swiglu"
    build_plan(str(src), ReshardOptions(target_tp=2))  # N == M: the gate/up order is untouched


def _vocab_rows(run: Path, tp: int) -> torch.Tensor:
    return torch.cat([sd["model"]["embedding.word_embeddings.weight"] for sd in _load(run, tp)])


def _vocab_warnings(plan) -> list[str]:
    return [w for w in plan.warnings if "vocabulary rows" in w]


def test_vocab_padding_without_the_true_size_keeps_the_rows_and_warns(samples, tmp_path):
    """Megatron-LM rarely saves the true vocabulary size: the rows the checkpoint has are kept
    when they remain a valid padding at the target, zero rows are appended up to the next valid
    multiple when they do not, and one warning names the assumption and ``--vocab-size``."""
    src = samples("mha", 4, save_vocab_size=False)  # 200 tokens padded to 224 rows (8 x 4)
    ref_logits, ref_rows = _logits(src, 4, MHA), _vocab_rows(src, 4)
    # 4 -> 2 (a merge): 224 is a multiple of 8 x 2 -> kept as they are (Megatron's own would be 208)
    plan = convert(src, tmp_path / "merge", target_tp=2)
    assert plan.facts.padded_vocab_target == 224
    [w] = _vocab_warnings(plan)
    assert "kept the 224 vocabulary rows at TP 2" in w and "--vocab-size V" in w
    assert torch.equal(_vocab_rows(tmp_path / "merge", 2), ref_rows)
    assert _load(tmp_path / "merge", 2)[0]["args"].padded_vocab_size == 224
    torch.testing.assert_close(_logits(tmp_path / "merge", 2, MHA), ref_logits, atol=1e-4, rtol=0)
    # 4 -> 3: 224 is no multiple of 8 x 3 -> zero rows up to 240
    plan = convert(src, tmp_path / "odd", target_tp=3)
    assert plan.facts.padded_vocab_target == 240
    [w] = _vocab_warnings(plan)
    assert "padded the 224 vocabulary rows with zero rows to 240 at TP 3" in w
    rows = _vocab_rows(tmp_path / "odd", 3)
    assert torch.equal(rows[:224], ref_rows) and torch.count_nonzero(rows[224:]) == 0
    torch.testing.assert_close(_logits(tmp_path / "odd", 3, MHA), ref_logits, atol=1e-4, rtol=0)
    # and back to TP 4: 240 is no multiple of 32 -> 256; rows are never dropped without --vocab-size
    assert build_plan(str(tmp_path / "odd"), ReshardOptions(target_tp=4)).facts.padded_vocab_target == 256
    # the true size given: Megatron's exact padding, no warning
    plan = convert(src, tmp_path / "ok", target_tp=2, vocab_size=200)
    assert plan.facts.padded_vocab_target == 208 and not _vocab_warnings(plan)
    # a split is unambiguous: every candidate true size pads to the same rows, no warning
    plan = build_plan(str(src), ReshardOptions(target_tp=8))
    assert plan.facts.padded_vocab_target == 256 and not _vocab_warnings(plan)
    _refuses(tmp_path, src, LayoutError, "vocabulary size 300 exceeds the 224", target_tp=2, vocab_size=300)


def test_vocab_padding_decision_reaches_the_manifest_and_the_cli(samples, tmp_path, capsys):
    src = samples("mha", 4, save_vocab_size=False)
    assert main(["run", "--direct", str(src), str(tmp_path / "out"), "--target-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "warning: kept the 224 vocabulary rows at TP 2" in out
    manifest = json.loads((tmp_path / "out" / "reshard_manifest.json").read_text())
    assert any("kept the 224 vocabulary rows" in w for w in manifest["warnings"])


def test_legacy_version_without_groups_refuses_gqa(sample_factory, tmp_path):
    src = sample_factory(2, 0)
    _refuses(tmp_path, src, LayoutError, "stores QKV without query groups", target_tp=1, num_query_groups=4,
             version=0)


def test_cli_flags_reach_the_plan(samples, capsys):
    src = str(samples("gqa", 8))
    assert main(["plan", src, "--target-tp", "6", "--vocab-size", "200", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", src, "--target-tp", "6", "--no-swiglu"]) == 2
    assert "shapes are gated" in capsys.readouterr().err
    assert main(["plan", src, "--target-tp", "6", "--num-query-groups", "8"]) == 2
    assert "contradicts" in capsys.readouterr().err
    for flags in (["--make-vocab-size-divisible-by", "4"], ["--target-pp", "3"]):
        assert main(["plan", src, "--target-tp", "6", *flags]) == 2
        capsys.readouterr()


@pytest.mark.parametrize("n,m", list(itertools.permutations((1, 2, 4), 2)))
def test_round_trip_with_repadding_is_bit_identical(samples, tmp_path, n, m):
    src = samples("gqa", n)
    convert(src, tmp_path / "mid", target_tp=m)
    convert(tmp_path / "mid", tmp_path / "back", target_tp=n)
    _assert_same_checkpoint(_load(tmp_path / "back", n), _load(src, n))
