"""Checkpoints written by real megatron-core, generated once per test session (test-only helper).

``mcore_checkpoints(root)`` runs ``mcore_harness.py`` once in a subprocess for every model below
at every TP (and a few PP layouts) and returns ``{(model, tp, pp): run folder}``; later calls
return the cache. ``mcore_forward(jobs, workdir)`` runs megatron-core's own forward on given
checkpoints (one subprocess for a batch). Nothing is downloaded.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shared_builds

if importlib.util.find_spec("megatron.core") is None:  # a required test dependency: fail, never skip
    raise ImportError("megatron-core is a required test dependency: pip install -e .[dev]")
HAVE_MCORE = True
#: Marks the tests that run real megatron-core (selectable with ``-m mcore``).
needs_mcore = pytest.mark.mcore

HARNESS = Path(__file__).with_name("mcore_harness.py")
TOKENS = [3, 17, 64, 95, 0, 42, 5, 77, 31, 8, 12, 90]
_BASE = {"layers": 2, "hidden": 64, "heads": 8, "seq": 16}

#: name -> (megatron-core model options, TP degrees written). ``vocab``/``divisible_by``: the true
#: vocabulary and Megatron's padding divisor; ``saved_vocab_size``: args.vocab_size (None: unknown).
MODELS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "mha": ({"ffn": 256, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128}, (1, 2, 4)),
    "gqa": ({"groups": 2, "ffn": 256, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "tied": False},
            (1, 2)),
    "swiglu": ({"ffn": 96, "swiglu": True, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128}, (1, 2, 4)),
    "gqa_swiglu": ({"groups": 4, "ffn": 96, "swiglu": True, "vocab": 128, "divisible_by": 32,
                    "saved_vocab_size": 128, "tied": False}, (1, 2, 4)),
    "llama": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
               "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128}, (1, 2)),
    "llama_tied": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
                    "tied": True, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128}, (2,)),
    # Qwen2-shaped: biases on the fused QKV only; a rotary base and epsilon other than the defaults
    "qwen": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "qkv_bias": True,
              "pos": "rope", "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128,
              "eps": 1e-6, "rope_base": 50000.0}, (2,)),
    # Qwen3-shaped: query/key RMSNorm per head (norms made distinct from ones), a head dim above hidden/heads
    "qwen3": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope", "tied": False,
               "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "eps": 1e-6, "rope_base": 1e6,
               "qk_norm": True, "norm_noise": True, "kv_channels": 16}, (2,)),
    # Mistral-shaped: Llama's with a sliding window (Megatron-LM's --window-size 3,0: each query sees
    # itself and the 3 keys before it) shorter than the test tokens
    "mistral": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
                 "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "window_size": [3, 0]},
                (2,)),
    # 12 heads in 6 query groups: TP 2 <-> 3 is not a divisor ratio
    "gqa12": ({"hidden": 96, "heads": 12, "groups": 6, "ffn": 192, "swiglu": True, "vocab": 96, "divisible_by": 16,
               "saved_vocab_size": 96, "tied": False}, (1, 2, 3)),
    # true vocabulary 100, padded to 112 at TP 1 and 128 at TP 2 and 4; args do not record 100
    "padded": ({"groups": 4, "ffn": 96, "swiglu": True, "tied": False, "vocab": 100, "divisible_by": 16,
                "saved_vocab_size": None}, (1, 2, 4)),
    "padded_tied": ({"ffn": 256, "vocab": 100, "divisible_by": 16, "saved_vocab_size": 100}, (1, 2, 4)),
}
#: (model, tp, pp) written with pipeline stages (no logits: megatron-core's pipeline schedule is not run).
PP_LAYOUTS: tuple[tuple[str, int, int], ...] = (("mha", 1, 2), ("mha", 2, 2), ("gqa", 2, 2), ("llama", 1, 2))


def model_options(name: str) -> dict[str, Any]:
    return {**_BASE, **MODELS[name][0]}


_CACHE: dict[str, dict[Any, Path]] = {}


#: The harness server of this test process (``mcore_harness.py --serve``), started on first use.
_SERVER: list[tuple[subprocess.Popen, Path]] = []
#: Seconds one jobs file may take.
HARNESS_TIMEOUT = 900


def _harness_server(workdir: Path) -> tuple[subprocess.Popen, Path]:
    """This process's harness server: megatron-core imported once per test process rather than once
    per jobs file (about 5 CPU-seconds each, and the suite runs dozens). A server that died is
    replaced; it ends when this process closes its stdin at exit. What it prints outside a job (an
    import failing) goes to ``harness-server.log`` in the workdir it was started for."""
    if not _SERVER or _SERVER[0][0].poll() is not None:
        # TORCHDYNAMO_DISABLE: megatron-core wraps a few helpers in torch.compile (``jit_fuser``; here the
        # MoE router's expert-bias token count, which no logit depends on); compiling them again in every
        # forked rank of every job costs seconds each and changes no output (logits equal, checked)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCHDYNAMO_DISABLE": "1"}
        server_log = workdir / "harness-server.log"
        with open(server_log, "w") as err:
            proc = subprocess.Popen([sys.executable, str(HARNESS), "--serve"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        _SERVER[:] = [(proc, server_log)]
        atexit.register(_stop_server, proc)
    return _SERVER[0]


def _stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_harness(jobs: list[dict[str, Any]], workdir: Path) -> None:
    """Run ``jobs`` (``mcore_harness.py``'s job dicts) in this process's harness server, megatron-core
    imported once for all of them; the job file, the harness's output (``jobs_N.log``) and the jobs'
    outputs go under ``workdir``. A failed run raises RuntimeError with the end of that output."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs_file = workdir / f"jobs_{len(list(workdir.glob('jobs_*.json')))}.json"
    jobs_file.write_text(json.dumps(jobs))
    log = jobs_file.with_suffix(".log")
    server, server_log = _harness_server(workdir)
    server.stdin.write(f"{jobs_file}\t{log}\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], HARNESS_TIMEOUT)
    reply = server.stdout.readline().strip() if ready else "timed out"
    if reply != "ok":
        if not ready:
            server.kill()
        output = (log if log.is_file() else server_log).read_text(errors="replace")[-6000:]
        raise RuntimeError(f"megatron-core harness failed ({reply or f'exit {server.wait()}'}):\n{output}")


def _written_once(key: str, root: Path, out: dict[Any, Path], job: Callable[[Any, Path], dict[str, Any]]
                  ) -> dict[Any, Path]:
    """``out`` (layout -> folder), each folder written by the harness job ``job(layout, folder)`` —
    all in one harness run, the first time ``key`` is asked for in this test run by any xdist worker
    (:func:`shared_builds.once`: the folders are moved from ``root`` to the run's shared folder)."""
    if key not in _CACHE:
        shared = shared_builds.shared_root() / f"mcore-{key}"
        moved = {lay: shared / folder.relative_to(root) for lay, folder in out.items()}
        shared_builds.once(f"mcore-{key}", lambda folder: run_harness(
            [job(lay, path) for lay, path in moved.items()], folder))
        _CACHE[key] = moved
    return _CACHE[key]


def mcore_checkpoints(root: Path) -> dict[tuple[str, int, int], Path]:
    """Every (model, tp, pp) checkpoint written by megatron-core, generated once under ``root``."""
    layouts = [(name, tp, 1) for name, (_, tps) in MODELS.items() for tp in tps] + list(PP_LAYOUTS)
    return _written_once("all", root, {lay: root / f"{lay[0]}_tp{lay[1]}_pp{lay[2]}" for lay in layouts},
                         lambda lay, folder: {"kind": "write", "out": str(folder), "tp": lay[1], "pp": lay[2],
                                              "model": model_options(lay[0]), "tokens": TOKENS})


#: (model, tp, pp, with Adam state) saved as Megatron-LM's ``--ckpt-format torch_dist`` (same seeds,
#: so the same logical weights as the per-rank checkpoints above).
DIST_LAYOUTS: tuple[tuple[str, int, int, bool], ...] = (
    ("mha", 2, 1, False), ("gqa_swiglu", 2, 1, True), ("swiglu", 4, 1, False), ("gqa", 1, 1, False),
    ("padded", 2, 1, False), ("mha", 1, 2, False))


def mcore_dist_checkpoints(root: Path) -> dict[tuple[str, int, int], Path]:
    """Every torch_dist run folder of :data:`DIST_LAYOUTS`, written once under ``root``."""
    adam = {lay[:3]: lay[3] for lay in DIST_LAYOUTS}
    return _written_once("dist", root, {lay: root / f"{lay[0]}_tp{lay[1]}_pp{lay[2]}_dist" for lay in adam},
                         lambda lay, folder: {"kind": "write_dist", "out": str(folder), "tp": lay[1], "pp": lay[2],
                                              "adam": adam[lay], "model": model_options(lay[0]), "tokens": TOKENS})


#: (model, tp) saved as mbridge and Megatron-Bridge save torch_dist: ``dist_checkpointing.save`` with no
#: Megatron-LM ``args`` in ``common.pt`` (same seeds as above).
FOREIGN_DIST_LAYOUTS: tuple[tuple[str, int], ...] = (("llama", 2), ("mha", 2), ("mistral", 2))


def mcore_foreign_dist_checkpoints(root: Path) -> dict[tuple[str, int], Path]:
    """Every torch_dist run folder of :data:`FOREIGN_DIST_LAYOUTS` (with ``logits.pt``), written once."""
    return _written_once("foreign_dist", root, {lay: root / f"{lay[0]}_tp{lay[1]}_noargs" for lay in
                                                FOREIGN_DIST_LAYOUTS},
                         lambda lay, folder: {"kind": "write_dist", "out": str(folder), "tp": lay[1], "pp": 1,
                                              "no_args": True, "model": model_options(lay[0]), "tokens": TOKENS})


def mcore_forward(cases: list[tuple[str | None, Path, int]], workdir: Path) -> list[torch.Tensor]:
    """megatron-core logits for each (model, checkpoint folder, tp): load strict, run, gather.
    Model None: the model the checkpoint's own ``args`` describe."""
    jobs = []
    for i, (name, ckpt, tp) in enumerate(cases):
        model = {"from_args": True, "model": {}} if name is None else {"model": model_options(name)}
        jobs.append({"kind": "forward", "ckpt": str(ckpt), "tp": tp, **model,
                     "tokens": TOKENS, "out": str(workdir / f"logits_{i}.pt")})
    run_harness(jobs, workdir)
    return [torch.load(j["out"]) for j in jobs]


def mcore_forward_dist(cases: list[tuple[str | None, Path, int]], workdir: Path) -> list[torch.Tensor]:
    """megatron-core logits for each (model, torch_dist folder, tp): ``dist_checkpointing.load`` of
    the model's sharded state dict at that TP, strict ``load_state_dict``, forward, gather."""
    jobs = [{"kind": "forward_dist", "ckpt": str(ckpt), "tp": tp, "tokens": TOKENS,
             **({"from_args": True, "model": {}} if name is None else {"model": model_options(name)}),
             "out": str(workdir / f"logits_dist_{i}.pt")} for i, (name, ckpt, tp) in enumerate(cases)]
    run_harness(jobs, workdir)
    return [torch.load(j["out"]) for j in jobs]


#: Mixture-of-experts models (SequentialMLP experts, megatron-core's ``allgather`` dispatcher) and
#: the (tp, ep, pp) layouts each is written at (expert TP = TP). ``moe``: Qwen-MoE-like (SwiGLU
#: experts, shared experts, a dense first layer: ``moe_layer_freq`` [0, 1]); ``moe_gelu``: every
#: layer MoE, plain GELU experts, top-1 routing on sigmoid scores with an expert bias;
#: ``moe_bias``: SwiGLU experts with linear biases.
MOE_MODELS: dict[str, tuple[dict[str, Any], tuple[tuple[int, int, int], ...]]] = {
    "moe": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope", "tied": False,
             "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "experts": 4, "moe_ffn": 48,
             "shared_ffn": 32, "moe_layer_freq": [0, 1]}, ((1, 2, 1), (2, 2, 1), (1, 1, 1), (1, 2, 2))),
    "moe_gelu": ({"ffn": 128, "bias": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "experts": 4,
                  "moe_ffn": 64, "topk": 1, "expert_bias": True}, ((2, 1, 1), (1, 4, 1))),
    # Hugging Face's MoE architectures: Mixtral (every layer MoE, no shared expert, top-2 renormalized) and
    # Qwen2-MoE (QKV bias, a dense first layer, a sigmoid-gated shared expert, top-2 not renormalized)
    "mixtral": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
                 "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "experts": 4,
                 "moe_ffn": 48, "eps": 1e-6, "rope_base": 50000.0}, ((2, 2, 1),)),
    "qwen_moe": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "qkv_bias": True,
                  "pos": "rope", "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128,
                  "experts": 4, "moe_ffn": 48, "shared_ffn": 32, "shared_gate": True, "pre_softmax": True,
                  "moe_layer_freq": [0, 1], "eps": 1e-6}, ((1, 2, 1),)),
    # Qwen3-MoE: query/key RMSNorm per head, a dense first layer, no shared expert, top-2 renormalized
    "qwen3_moe": ({"groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
                   "tied": False, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "experts": 4,
                   "moe_ffn": 48, "moe_layer_freq": [0, 1], "eps": 1e-6, "qk_norm": True, "norm_noise": True},
                  ((2, 2, 1),)),
    # linear biases in experts: megatron-core allows them at expert TP 1 only
    "moe_bias": ({"ffn": 128, "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "experts": 4, "moe_ffn": 64,
                  "swiglu": True}, ((1, 2, 1),)),
}


def moe_options(name: str) -> dict[str, Any]:
    return {**_BASE, **MOE_MODELS[name][0]}


def mcore_moe_checkpoints(root: Path) -> dict[tuple[str, int, int, int], Path]:
    """Every (model, tp, ep, pp) MoE checkpoint of :data:`MOE_MODELS`, written once under ``root``
    (with pp == 1 also ``logits.pt``: megatron-core's forward at the layout it was written at)."""
    lays = [(name, *lay) for name, (_, lays) in MOE_MODELS.items() for lay in lays]
    return _written_once("moe", root, {lay: root / f"{lay[0]}_tp{lay[1]}_ep{lay[2]}_pp{lay[3]}" for lay in lays},
                         lambda lay, folder: {"kind": "write", "out": str(folder), "tp": lay[1], "ep": lay[2],
                                              "pp": lay[3], "model": moe_options(lay[0]), "tokens": TOKENS})


#: (MoE model, tp, ep) saved as Megatron-LM's ``--ckpt-format torch_dist`` (same seeds as the per-rank
#: ones): ``moe`` mixes dense and MoE layers (per-layer keys, a global expert axis leading),
#: ``moe_gelu`` is MoE in every layer (keys stacked over layers, then experts).
MOE_DIST_LAYOUTS: tuple[tuple[str, int, int], ...] = (("moe", 2, 2), ("moe_gelu", 1, 4))


def mcore_moe_dist_checkpoints(root: Path) -> dict[tuple[str, int, int], Path]:
    """Every torch_dist run folder of :data:`MOE_DIST_LAYOUTS` (with ``logits.pt``), written once."""
    return _written_once("moe_dist", root, {lay: root / f"{lay[0]}_tp{lay[1]}_ep{lay[2]}_dist" for lay in
                                            MOE_DIST_LAYOUTS},
                         lambda lay, folder: {"kind": "write_dist", "out": str(folder), "tp": lay[1], "ep": lay[2],
                                              "model": moe_options(lay[0]), "tokens": TOKENS})


#: (MoE model, tp, expert tp, ep) written with the experts split over fewer ranks than the dense
#: layers (``--expert-tensor-parallel-size``): not every (TP rank, EP rank) folder exists then.
MOE_ETP_LAYOUTS: tuple[tuple[str, int, int, int], ...] = (("moe", 2, 1, 2), ("moe_gelu", 4, 2, 2))


def mcore_moe_etp_checkpoints(root: Path) -> dict[tuple[str, int, int, int], Path]:
    """Every per-rank checkpoint of :data:`MOE_ETP_LAYOUTS` (with ``logits.pt``), written once."""
    return _written_once("moe_etp", root, {lay: root / f"{lay[0]}_tp{lay[1]}_etp{lay[2]}_ep{lay[3]}" for lay in
                                           MOE_ETP_LAYOUTS},
                         lambda lay, folder: {"kind": "write", "out": str(folder), "tp": lay[1], "etp": lay[2],
                                              "ep": lay[3], "model": moe_options(lay[0]), "tokens": TOKENS})


def mcore_forward_moe(cases: list[tuple[Any, ...]], workdir: Path, *, dist: bool = False
                      ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """megatron-core logits and routing decisions (router name -> tokens x experts) for each (MoE
    model, checkpoint folder, tp, ep[, expert tp]): built at that layout, strict ``load_state_dict``
    of its own rank file (``dist``: of ``dist_checkpointing.load`` of a torch_dist folder), forward,
    logits gathered over TP. Model None: the one the checkpoint's own ``args`` describe."""
    n = len(list(workdir.glob("logits_moe_*.pt"))) if workdir.exists() else 0
    jobs = [{"kind": "forward_dist" if dist else "forward", "ckpt": str(c[1]), "tp": c[2], "ep": c[3],
             "etp": c[4] if len(c) > 4 else None, "tokens": TOKENS,
             **({"from_args": True, "model": {}} if c[0] is None else {"model": moe_options(c[0])}),
             "out": str(workdir / f"logits_moe_{n + i}.pt")} for i, c in enumerate(cases)]
    run_harness(jobs, workdir)
    return [(torch.load(j["out"]), torch.load(j["out"] + ".routing")) for j in jobs]


def edit_saved_args(run: Path, **changes: Any) -> Path:
    """Set ``changes`` on the saved ``args`` of every rank file under ``run`` (a Megatron-LM run or
    iteration folder this session wrote); returns ``run``."""
    for f in run.rglob("model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        for k, v in changes.items():
            setattr(sd["args"], k, v)
        torch.save(sd, f)
    return run


def copy_with_args(run: Path, dst: Path, **changes: Any) -> Path:
    """A copy of ``run`` at ``dst`` whose rank files' saved args carry ``changes``."""
    return edit_saved_args(Path(shutil.copytree(run, dst)), **changes)


def iteration_folder(run: Path) -> Path:
    return run / f"iter_{int((run / 'latest_checkpointed_iteration.txt').read_text()):07d}"


def rank_module(run: Path, tp_rank: int, pp_rank: int | None = None) -> dict[str, Any]:
    sub = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    from reshard.core.safe_load import load_shard  # stand-ins: megatron is never imported here

    return load_shard(iteration_folder(run) / sub / "model_optim_rng.pt", mmap=False)["model"]



#: Pipelines written as Megatron-LM's interleaved and uneven stages (Llama-shaped, 8-12 layers; the
#: logits are the pipeline's own forward, chunk by chunk): name -> (model options, tp, pp, ep).
_PIPE_BASE = {**_BASE, "groups": 2, "ffn": 96, "swiglu": True, "norm": "RMSNorm", "bias": False, "pos": "rope",
              "vocab": 128, "divisible_by": 32, "saved_vocab_size": 128, "eps": 1e-5}
PIPELINES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    # even interleaved: 2 layers per chunk, tied embeddings (the last chunk holds the head's copy)
    "vpp": ({**_PIPE_BASE, "layers": 8, "tied": True, "stages": {"vpp": 2}}, 2, 2, 1),
    # uneven first/last ranks (2 layers each, so 1 per chunk) around a middle rank of 8 (4 per chunk)
    "uneven_vpp": ({**_PIPE_BASE, "layers": 12, "tied": False, "stages": {"vpp": 2, "first": 2, "last": 2}}, 1, 3, 1),
    # the embedding and the loss counted as layers: the first and last chunks hold one layer fewer
    "account": ({**_PIPE_BASE, "layers": 6, "tied": True,
                 "stages": {"vpp": 2, "account_embedding": True, "account_loss": True}}, 1, 2, 1),
    # a layout string: the first and last chunks hold one layer, the middle ones two
    "layout": ({**_PIPE_BASE, "layers": 6, "tied": False, "stages": {"layout": "Et|tt|tt|tL"}}, 1, 2, 1),
    # MoE at EP 2 with a dense first layer: each chunk's spec picks dense or MoE by the global layer number
    "moe_vpp": ({**_PIPE_BASE, "layers": 4, "tied": False, "experts": 4, "moe_ffn": 48, "moe_layer_freq": [0, 1, 1, 1],
                 "stages": {"vpp": 2}}, 1, 2, 2),
}


#: Stage settings whose layer placement is asked of megatron-core itself (``layers``, ``pp``, ``stages``).
STAGE_CONFIGS: list[dict[str, Any]] = [
    {"layers": 8, "pp": 2, "stages": {"vpp": 2}}, {"layers": 8, "pp": 2, "stages": {"vpp": 4}},
    {"layers": 12, "pp": 3, "stages": {"vpp": 2, "first": 2, "last": 2}},
    {"layers": 6, "pp": 2, "stages": {"vpp": 2, "account_embedding": True, "account_loss": True}},
    {"layers": 7, "pp": 2, "stages": {"account_embedding": True}},
    {"layers": 6, "pp": 2, "stages": {"first": 4}}, {"layers": 10, "pp": 3, "stages": {"last": 2}},
    {"layers": 9, "pp": 3, "stages": {"first": 1, "last": 2}}, {"layers": 16, "pp": 4, "stages": {"vpp": 2}},
    {"layers": 12, "pp": 2, "stages": {"vpp": 3, "first": 6}},
    {"layers": 6, "pp": 2, "stages": {"layout": "Et|tt|tt|tL"}},
    {"layers": 5, "pp": 2, "stages": {"layout": "Ettt|ttL"}},
    {"layers": 4, "pp": 2, "stages": {"layout": "E|tt|tt|L"}},
    # refused by megatron-core (and reshard): a VPP not dividing a rank's layers, an empty first stage,
    # middle ranks left without layers, first+last at PP 2 with VPP, stages beyond one pipeline rank
    {"layers": 8, "pp": 2, "stages": {"vpp": 3}}, {"layers": 12, "pp": 3, "stages": {"vpp": 2, "first": 3}},
    {"layers": 6, "pp": 2, "stages": {"first": 0}}, {"layers": 4, "pp": 3, "stages": {"first": 2, "last": 2}},
    {"layers": 4, "pp": 2, "stages": {"vpp": 2, "first": 2, "last": 2}},
    {"layers": 4, "pp": 1, "stages": {"layout": "Ett|ttL"}}, {"layers": 4, "pp": 1, "stages": {"first": 2}},
    # at PP 1 megatron-core builds every layer whatever the accounting, and a first stage of all of them
    {"layers": 4, "pp": 1, "stages": {"account_embedding": True, "account_loss": True}},
    {"layers": 4, "pp": 1, "stages": {"first": 4}},
]
STAGE_TABLE = "stage_table"


def mcore_pipeline_checkpoints(root: Path) -> dict[str, Path]:
    """Every run folder of :data:`PIPELINES` (with ``logits.pt``), written once under ``root``, and
    under :data:`STAGE_TABLE` megatron-core's placement of :data:`STAGE_CONFIGS` (a JSON file: see
    the harness's ``stage_table`` job) from the same harness run."""
    def job(name: str, out: Path) -> dict[str, Any]:
        if name == STAGE_TABLE:
            return {"kind": "stage_table", "configs": STAGE_CONFIGS, "tp": 1, "out": str(out)}
        model, tp, pp, ep = PIPELINES[name]
        return {"kind": "write", "out": str(out), "tp": tp, "pp": pp, "ep": ep, "model": model, "tokens": TOKENS}

    folders = {name: root / name for name in PIPELINES} | {STAGE_TABLE: root / "stage_table.json"}
    return _written_once("pipelines", root, folders, job)


def mcore_pipeline_forward(cases: list[tuple[str, Path, int, int, int]], workdir: Path) -> dict[str, Any]:
    """megatron-core's logits of each ``(label, Megatron-LM run folder, tp, pp, ep)``, the model built
    from the folder's own saved args at that layout (model chunks as they say) and loaded strictly
    chunk by chunk, the pipeline run in order (a label starting with ``dist:``: a torch_dist folder,
    through ``dist_checkpointing.load``). A label starting with ``fails:`` is a twin that must not
    load: its value is each rank's load error ("" where the rank loaded). One harness run."""
    jobs = [{"kind": "forward_dist" if label.startswith("dist:") else "forward", "ckpt": str(ckpt),
             "tp": tp, "pp": pp, "ep": ep, "from_args": True, "model": {},
             "expect_failure": label.startswith("fails:"), "tokens": TOKENS,
             "out": str(workdir / f"pipe_logits_{i}.pt")} for i, (label, ckpt, tp, pp, ep) in enumerate(cases)]
    run_harness(jobs, workdir)
    return {label: json.loads(Path(j["out"]).read_text()) if j["expect_failure"] else torch.load(j["out"])
            for (label, *_), j in zip(cases, jobs)}
