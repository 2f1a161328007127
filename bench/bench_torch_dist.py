"""torch_dist benchmark: megatron-core per-rank TP 8 -> torch_dist, and torch_dist -> per-rank TP 2,
against the byte-copy floor of each source and torch's ``dcp_to_torch_save`` (the peer's first step:
the whole state dict in one process), on a ~3 GB fp16 Llama-shaped megatron-core checkpoint.

    python bench/bench_torch_dist.py               # full run
    python bench/bench_torch_dist.py --quick       # smoke test of the benchmark itself (tiny model)

Not part of the tests. Every command runs as its own process: wall time around it, peak RSS its
``ru_maxrss`` (as in bench_reshard.py). Methods run interleaved, medians of ``--runs`` reported;
the source is read once before each run (warm cache), outputs are deleted and synced between
runs, and each run starts after a pause (``--settle``, see :func:`settle`). ``--deep-layers``
repeats the reshard runs on a model with twice the layers: peak RSS must stay flat. Sources are
generated under ``bench/data/`` (git-ignored) by this script, rank by rank (random tensors of the
right shapes; replicated ones equal on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from contention import busy, load_note

HERE = Path(__file__).resolve().parent
FLOOR = [sys.executable, "-c", """
import sys, torch  # the floor pays the same interpreter + torch start-up
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
buf = bytearray(1 << 20); mv = memoryview(buf)  # as bench/copy_floor.py
for f in sorted(p for p in src.rglob('*') if p.is_file()):
    out = dst / f.relative_to(src); out.parent.mkdir(parents=True, exist_ok=True)
    with open(f, 'rb', buffering=0) as fi, open(out, 'wb', buffering=0) as fo:
        while n := fi.readinto(buf):
            v = mv[:n]
            while v:
                v = v[fo.write(v):]
"""]
DCP_TO_TORCH = [sys.executable, "-c", """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2] + '/all.pt')
"""]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_source(folder: Path, layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int,
                tp: int) -> Path:
    """A megatron-core Llama-shaped run folder at TP ``tp``, fp16, written one rank at a time."""
    import argparse as ap

    import torch

    if (folder / "latest_checkpointed_iteration.txt").is_file():
        return folder
    hd = hidden // heads
    qkv_rows = (heads + 2 * groups) * hd
    args = ap.Namespace(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                        kv_channels=hd, group_query_attention=True, num_query_groups=groups, swiglu=True,
                        normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                        untie_embeddings_and_output_weights=True, vocab_size=vocab, padded_vocab_size=vocab,
                        make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=1, transformer_impl="local", ckpt_format="torch")
    norm = torch.ones(hidden, dtype=torch.float16)
    for r in range(tp):
        g = torch.Generator().manual_seed(r)

        def rnd(*shape: int, g: torch.Generator = g) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.float16)

        model: dict[str, Any] = {"embedding.word_embeddings.weight": rnd(vocab // tp, hidden)}
        for i in range(layers):
            p = f"decoder.layers.{i}."
            model[p + "input_layernorm.weight"] = norm
            model[p + "self_attention.linear_proj.weight"] = rnd(hidden, hidden // tp)
            model[p + "self_attention.linear_proj._extra_state"] = None
            model[p + "self_attention.linear_qkv.weight"] = rnd(qkv_rows // tp, hidden)
            model[p + "self_attention.linear_qkv._extra_state"] = None
            model[p + "pre_mlp_layernorm.weight"] = norm
            model[p + "mlp.linear_fc1.weight"] = rnd(2 * ffn // tp, hidden)
            model[p + "mlp.linear_fc1._extra_state"] = None
            model[p + "mlp.linear_fc2.weight"] = rnd(hidden, ffn // tp)
            model[p + "mlp.linear_fc2._extra_state"] = None
        model["decoder.final_layernorm.weight"] = norm
        model["output_layer.weight"] = rnd(vocab // tp, hidden)
        model["output_layer._extra_state"] = None
        f = folder / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}, f)
        del model
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


def reshard(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from reshard.cli import main; sys.exit(main())", "run", "--direct",
            *args]


def measure(cmd: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:4]}... failed: {err[-2000:]}")
    return {"seconds": wall, "rss_mib": usage.ru_maxrss / 1024, "cpu": usage.ru_utime + usage.ru_stime}


#: Seconds to wait before each run (``--settle``), as ``bench_reshard.py`` does.
SETTLE = 4.0


def settle(seconds: float) -> None:
    """Let memory the previous run freed (its deleted output, its heap) go back to the host before
    the next run starts: in this VM (virtio-balloon free-page reporting) a run that starts at once
    writes into pages the guest still holds, one that starts later faults fresh ones in from the
    host, so without the pause a method's time depends on what ran before it (the floor right
    after ``dcp_to_torch_save`` most of all; measured in docs/performance.md, session 15)."""
    if seconds > 0:
        time.sleep(seconds)


def warm(folder: Path) -> None:
    """Read every file once, so each run starts with the source in the page cache."""
    with open(os.devnull, "wb") as null:
        for f in folder.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    shutil.copyfileobj(fh, null, 1 << 24)


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def parse_bench_args(argv: list[str], description: str) -> tuple[argparse.Namespace, dict[str, int]]:
    """The options these benchmarks share, and the model shape (``--quick``: a tiny one)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--deep-layers", type=int, default=24, help="second depth for memory scaling (0: skip)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--settle", type=float, default=SETTLE, help="seconds to pause before each run (0: none)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="contention mode: N busy processes beside every measured run (see contention.py)")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    shape = dict(hidden=3072, ffn=8192, heads=24, groups=8, vocab=32768, tp=8)
    if ns.quick:
        shape = dict(hidden=256, ffn=512, heads=16, groups=8, vocab=1024, tp=8)
        ns.layers, ns.deep_layers, ns.runs = 2, 4, 1
        ns.settle = min(ns.settle, 0.5)
    return ns, shape


def source_for(ns: argparse.Namespace, layers: int, shape: dict[str, int]) -> Path:
    """The per-rank TP 8 source of ``layers`` layers under ``--data-dir``, generated once."""
    src = ns.data_dir / f"core_{'quick' if ns.quick else 'llama3k'}_l{layers}_tp8_fp16"
    # in its own process: a child forked from a big parent would report the parent's peak RSS
    subprocess.run([sys.executable, str(HERE / "bench_torch_dist.py"), "--make-source", str(src), str(layers),
                    json.dumps(shape)], check=True)
    return src


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-source"]:
        make_source(Path(argv[1]), int(argv[2]), **json.loads(argv[3]))
        return 0
    ns, shape = parse_bench_args(argv, __doc__.splitlines()[0])
    work = ns.work_dir / "torch_dist"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for layers in [ns.layers] + ([ns.deep_layers] if ns.deep_layers else []):
        src = source_for(ns, layers, shape)
        dist = work / f"dist_l{layers}"
        subprocess.run(reshard(str(src), str(dist), "--to", "torch_dist"), check=True, capture_output=True)
        methods = {
            "floor (per-rank TP 8 bytes)": (FLOOR + [str(src)], src),
            "per-rank TP 8 -> torch_dist": (reshard(str(src), "{out}", "--to", "torch_dist"), src),
            # the same output cut into ~4 files (targets of their own: one after the other here, in
            # parallel in the flow and over its workers)
            "per-rank TP 8 -> torch_dist, 4 files": (reshard(str(src), "{out}", "--to", "torch_dist",
                                                             "--max-shard-size", str(max(1, size(src) // 4))), src),
            "floor (torch_dist bytes)": (FLOOR + [str(dist)], dist),
            "torch_dist -> per-rank TP 2": (reshard(str(dist), "{out}", "--target-tp", "2"), dist),
            "torch dcp_to_torch_save": (DCP_TO_TORCH + [str(dist / "iter_0000001"), "{out}"], dist),
        }
        if layers != ns.layers:  # the deep model: memory scaling of reshard only
            methods = {k: v for k, v in methods.items() if "->" in k}
        results[f"layers={layers}"] = {
            "source GB": round(size(src) / 1e9, 2), "torch_dist GB": round(size(dist) / 1e9, 2),
            **run_interleaved(ns, methods, work, layers, out_dir_for=lambda name: "dcp" in name)}
        shutil.rmtree(dist, ignore_errors=True)
    report(ns, results, work, lambda name: "floor (per-rank TP 8 bytes)" if "TP 8 ->" in name or "TP 8 bytes" in name
           else "floor (torch_dist bytes)", ("per-rank TP 8 -> torch_dist", "torch_dist -> per-rank TP 2"))
    return 0


def run_interleaved(ns: argparse.Namespace, methods: dict[str, tuple[list[str], Path]], work: Path, layers: int,
                    out_dir_for: Callable[[str], bool] = lambda _name: False) -> dict[str, dict[str, float]]:
    """Every method (name -> (command with ``{out}``, the source it reads)) ``--runs`` times, the
    methods interleaved; each run from a synced disk, a warm source and after :func:`settle`, its
    output deleted before the next (a floor gets the output folder as its last argument;
    ``out_dir_for(name)``: create the folder first). Medians of wall seconds and peak RSS."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for i in range(ns.runs):
        for name, (cmd, source) in methods.items():
            out = work / "run_out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True) if out_dir_for(name) else None
            os.sync()
            warm(source)
            settle(ns.settle)
            log(f"L{layers} run {i + 1}/{ns.runs}: {name}")
            cmd = [c.replace("{out}", str(out)) for c in cmd] + ([str(out)] if "floor" in name else [])
            with busy(ns.busy):  # the same load beside every method (none by default)
                runs[name].append(measure(cmd))
    shutil.rmtree(work / "run_out", ignore_errors=True)
    return {m: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                "peak_rss_mib": round(statistics.median(r["rss_mib"] for r in rs))} for m, rs in runs.items()}


def report(ns: argparse.Namespace, results: dict[str, Any], work: Path, floor_of: Callable[[str], str],
           scaled: Sequence[str]) -> None:
    """Print each method's seconds, ratio to its floor (``floor_of(name)``: the floor row it is
    compared with) and peak RSS, and the peak RSS of the ``scaled`` methods at both depths; write
    ``results.json``."""
    base = results[f"layers={ns.layers}"]
    lines = [load_note(ns.busy), f"{'method':40} {'seconds':>8} {'x floor':>8} {'peak RSS':>10}"]
    for name, rec in base.items():
        if isinstance(rec, dict):
            floor = base[floor_of(name)]["seconds"]
            lines.append(f"{name:40} {rec['seconds']:8.2f} {rec['seconds'] / floor:8.2f} {rec['peak_rss_mib']:8d} MiB")
    if ns.deep_layers:
        deep = results[f"layers={ns.deep_layers}"]
        for name in scaled:
            lines.append(f"peak RSS {name}: {base[name]['peak_rss_mib']} MiB at {ns.layers} layers, "
                         f"{deep[name]['peak_rss_mib']} MiB at {ns.deep_layers} layers")
    print("\n".join(lines))
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
