"""Side-by-side benchmark: reshard (--direct and the Prefect flow) vs DeepSpeed's MegatronSDLoader,
``cp -r`` and a byte-copy floor, on a ~3 GB fp16 legacy-GPT checkpoint at TP 8 -> 2.

    python bench/bench_reshard.py                 # full run (~6-9 minutes on 2 cores)
    python bench/bench_reshard.py --quick         # smoke test of the benchmark itself (tiny model)
    python bench/bench_reshard.py --cold          # drop the page cache before every run (needs root)
    python bench/bench_reshard.py --busy 6        # contention: 6 busy processes beside every run

Not part of the tests. Every measured command runs as its own process; wall time is measured
around it and peak RSS is its ``ru_maxrss`` from ``wait4`` — the number GNU ``time -v`` prints
as "Maximum resident set size" (the largest single process of the command's tree; no extra
tool needed). Methods run interleaved (floor, cp, direct, flow, DeepSpeed, then again), and
medians of ``--runs`` runs are reported. Before each run the previous output is deleted and
``sync`` flushes dirty pages, so one run's write-back does not slow the next; by default the
source is then read once so every run starts warm-cache (``--cold`` drops caches instead).

Source checkpoints are generated once under ``bench/data/`` (git-ignored; see make_source.py),
outputs go to ``bench/out/`` (git-ignored) and are deleted after each run; results are also
written to ``bench/out/results.json``. Needs about 3x the source size free on that disk.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contention import busy, load_note

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TARGET_TP = 2

FLOOR, CP, DIRECT, FLOW, DS = "byte-copy floor", "cp -r", "reshard --direct", "reshard (Prefect flow)", \
    "DeepSpeed MegatronSDLoader"
ENGINE = "reshard engine, hash in-stream"
EMPTY_FLOW = "empty Prefect flow (fixed cost)"
ALL = (FLOOR, CP, ENGINE, DIRECT, FLOW, EMPTY_FLOW, DS)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tool(name: str) -> list[str]:
    exe = BIN / name
    if exe.exists():
        return [str(exe)]
    if name == "reshard":
        return [sys.executable, "-c", "import sys; from reshard.cli import main; sys.exit(main())"]
    return [name]


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def sha_folder(p: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p.rglob("*.pt")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while b := fh.read(16 << 20):
                h.update(b)
        out[f.relative_to(p).as_posix()] = h.hexdigest()
    return out


def drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(src: Path) -> None:
    buf = bytearray(16 << 20)
    for f in sorted(src.glob("*.pt")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def measure(cmd: list[str], logfile: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd``; wall seconds and peak RSS (MiB) from wait4, like GNU time -v."""
    with open(logfile, "ab") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n".encode())
        lf.flush()
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env)
        _pid, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
    return {"wall": wall, "rss_mib": ru.ru_maxrss / 1024, "cpu": ru.ru_utime + ru.ru_stime, "user": ru.ru_utime,
            "sys": ru.ru_stime, "rc": p.returncode, "load1": load_before,
            # waits (a thread blocked: I/O, a lock, a queue) and preemptions (its time slice taken)
            "waits": ru.ru_nvcsw, "preempted": ru.ru_nivcsw}


class Bench:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.work = ns.work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.logfile = self.work / "bench.log"
        self.logfile.write_text("")
        self.tmp = Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=self.work))
        self.cold_ok: bool | None = None
        self.flow_env: dict[str, str] | None = None

    # -- setup ---------------------------------------------------------------------------------
    def source(self, layers: int) -> Path:
        tag = "quick" if self.ns.quick else "h4096"
        out = self.ns.data_dir / f"gpt_{tag}_l{layers}_tp8_fp16"
        if not (out / ".complete").exists():
            log(f"generating {out} (once; reused later)")
            cmd = [sys.executable, str(HERE / "make_source.py"), "--layers", str(layers), "--out", str(out)]
            if self.ns.quick:
                cmd.append("--quick")
            r = measure(cmd, self.logfile)
            if r["rc"]:
                sys.exit(f"source generation failed; see {self.logfile}")
            log(f"generated in {r['wall']:.1f} s")
        return out

    def prefect_env(self) -> dict[str, str]:
        if self.flow_env is None:
            home = self.tmp / "prefect-home"
            env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                       DO_NOT_TRACK="1")
            env.pop("PREFECT_API_URL", None)
            log("pre-migrating a temporary Prefect database (not timed)")
            r = measure(tool("prefect") + ["server", "database", "upgrade", "-y"], self.logfile, env)
            if r["rc"]:
                sys.exit(f"prefect database upgrade failed; see {self.logfile}")
            self.flow_env = env
        return self.flow_env

    def command(self, method: str, src: Path, dst: Path, run_dir: Path) -> tuple[list[str], dict[str, str] | None]:
        tp = ["--target-tp", str(TARGET_TP)]
        if method == FLOOR:
            return [sys.executable, str(HERE / "copy_floor.py"), str(src), str(dst)], None
        if method == CP:
            return ["cp", "-r", str(src), str(dst)], None
        if method == DIRECT:
            return tool("reshard") + ["run", "--direct", str(src), str(dst), *tp], None
        if method == FLOW:
            env = dict(self.prefect_env(), PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(run_dir / "results"))
            return tool("reshard") + ["run", str(src), str(dst), *tp, "--cache-dir", str(run_dir / "cache")], env
        if method == DS:
            return [sys.executable, str(HERE / "ds_reshard.py"), str(src), str(dst), *tp], None
        if method == ENGINE:
            return [sys.executable, str(HERE / "engine_only.py"), str(src), str(dst), *tp], None
        if method == EMPTY_FLOW:
            env = dict(self.prefect_env(), PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(run_dir / "results"))
            return [sys.executable, str(HERE / "empty_flow.py")], env
        raise ValueError(method)

    def prepare(self, src: Path) -> None:
        subprocess.run(["sync"], check=False)
        if self.ns.cold:
            if self.cold_ok is None:
                self.cold_ok = drop_caches()
                if not self.cold_ok:
                    log("cannot drop the page cache here: runs are warm-cache")
            elif self.cold_ok:
                drop_caches()
            if self.cold_ok:
                self.settle()
                return
        warm(src)
        self.settle()

    def settle(self) -> None:
        """Let memory freed by the previous run (its deleted output, its heap) go back to the host
        before the next run starts. In a VM with free-page reporting (virtio-balloon; Linux
        reports free pages after ~2 s) a run that starts at once writes into pages the guest still
        holds, one that starts later faults fresh ones in from the host — 1-3 s per GB here. With
        the pause every method starts from the same state instead of from whatever ran before it."""
        if self.ns.settle > 0:
            time.sleep(self.ns.settle)

    def run_one(self, method: str, src: Path, keep: bool = False) -> tuple[dict[str, Any], Path]:
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.tmp))
        dst = run_dir / "out"
        cmd, env = self.command(method, src, dst, run_dir)
        self.prepare(src)
        with busy(self.ns.busy):  # the same load beside every method (none by default)
            r = measure(cmd, self.logfile, env)
        if r["rc"]:
            tail = self.logfile.read_text()[-3000:]
            sys.exit(f"{method} failed (exit {r['rc']}):\n{tail}")
        r["out_bytes"] = folder_bytes(dst)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        log(f"{method:28s} {r['wall']:7.2f} s  {r['user']:6.2f} user  {r['sys']:6.2f} sys  {r['rss_mib']:7.0f} MiB  "
            f"(load {r['load1']:.1f})")
        return r, run_dir

    # -- the benchmark --------------------------------------------------------------------------
    def series(self, src: Path, methods: list[str], runs: int, check_identical: bool) -> dict[str, list[dict]]:
        results: dict[str, list[dict]] = {m: [] for m in methods}
        hashes: dict[str, dict[str, str]] = {}
        for i in range(runs):
            for m in methods:
                keep = check_identical and i == 0 and m in (DIRECT, FLOW)
                r, run_dir = self.run_one(m, src, keep=keep)
                results[m].append(r)
                if keep:
                    hashes[m] = sha_folder(run_dir / "out")
                    shutil.rmtree(run_dir, ignore_errors=True)
        if check_identical and DIRECT in hashes and FLOW in hashes:
            same = hashes[DIRECT] == hashes[FLOW]
            log(f"--direct and flow outputs byte-identical: {same}")
            results["_identical"] = [{"direct_equals_flow": same, "files": len(hashes[DIRECT])}]
        return results

    def quant(self, src: Path) -> dict[str, Any]:
        log("quantization throughput")
        out = subprocess.run([sys.executable, str(HERE / "quant_throughput.py"), str(src),
                              "--seconds", "1" if self.ns.quick else "3"],
                             capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"quant_throughput failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def med(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def spread(rs: list[dict], key: str) -> str:
    vals = [r[key] for r in rs]
    return f"{min(vals):.2f}–{max(vals):.2f}" if len(vals) > 1 else "–"


def finish(res: dict[str, Any], path: Path, report: Callable[[dict[str, Any]], str]) -> None:
    """Record a benchmark's results (``res``, with its ``machine``, ``date`` and ``seconds``) as JSON
    at ``path``, then print the machine line and ``report(res)``."""
    path.write_text(json.dumps(res, indent=2))
    m = res["machine"]
    print(f"\nMachine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, torch {m['torch']}, "
          f"Python {m['python']}, Linux {m['kernel']}; {res['date']}; benchmark took {res['seconds']:.0f} s\n")
    print(report(res))


def machine() -> dict[str, Any]:
    import torch  # only for its version string, after every measured run

    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_gib": round(mem / 2**30, 1), "torch": torch.__version__,
            "python": platform.python_version(), "kernel": platform.release()}


def report(ns: argparse.Namespace, res: dict[str, Any]) -> str:
    main_ = res["main"]
    floor_w, ds_w = med(main_[FLOOR], "wall"), med(main_.get(DS, main_[FLOOR]), "wall")
    loads = [r["load1"] for rs in main_.values() for r in rs if "load1" in r]
    lines = [f"Source: {res['source_gb']:.2f} GB, {res['layers']} layers, fp16, TP 8 -> {TARGET_TP}; "
             f"{load_note(res.get('busy', 0))}; "
             f"{ns.runs} runs each, interleaved, {'cold' if res['cold'] else 'warm'} page cache, "
             f"{ns.settle:g} s pause before each run (memory back with the host); "
             f"median (min–max); user / sys s = CPU time of the command's process tree (sys: mostly the "
             f"kernel copying into the page cache, which varies run to run on this VM for every method alike); "
             f"1-min load average before each run {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} CPUs.", "",
             "| method | wall s | range s | user s | sys s | CPU / wall | waits | preempted | peak RSS MiB | "
             "vs byte-copy floor | vs DeepSpeed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in ALL:
        if m not in main_:
            continue
        w = med(main_[m], "wall")
        ds = f"{w / ds_w:.2f}x" if DS in main_ else "–"
        cores = med(main_[m], "cpu") / w
        lines.append(f"| {m} | {w:.2f} | {spread(main_[m], 'wall')} | {med(main_[m], 'user'):.2f} | "
                     f"{med(main_[m], 'sys'):.2f} | {cores:.2f} | {med(main_[m], 'waits'):.0f} | "
                     f"{med(main_[m], 'preempted'):.0f} | {med(main_[m], 'rss_mib'):.0f} | {w / floor_w:.2f}x | {ds} |")
    deep = res.get("deep")
    if deep:
        lines += ["", f"Depth scaling ({res['layers']} -> {res['deep_layers']} layers, "
                      f"{res['source_gb']:.2f} -> {res['deep_source_gb']:.2f} GB):", "",
                  "| method | layers | wall s | peak RSS MiB | vs byte-copy floor |", "|---|---:|---:|---:|---:|"]
        for layers, block in ((res["layers"], main_), (res["deep_layers"], deep)):
            fw = med(block[FLOOR], "wall")
            for m in (FLOOR, CP, DIRECT):
                if m not in block:
                    continue
                lines.append(f"| {m} | {layers} | {med(block[m], 'wall'):.2f} | {med(block[m], 'rss_mib'):.0f} | "
                             f"{med(block[m], 'wall') / fw:.2f}x |")
    q = res.get("quant")
    if q:
        lines += ["", "int8 quantization (8 bits, 64 groups, MLP 128), layer-0 weights of one source rank "
                      f"({q['bytes'] / 2**20:.0f} MiB fp16), bit-identical results:", "",
                  "| quantizer | GB/s | speedup |", "|---|---:|---:|",
                  f"| reshard `quantize_groups_blocked` (the engine's) | {q['reshard_gbps']:.2f} | "
                  f"{q['speedup']:.1f}x |",
                  f"| reshard `quantize_groups` (one vectorized expression) | {q['reshard_vectorized_gbps']:.2f} | "
                  f"{q['vectorized_speedup']:.1f}x |",
                  f"| DeepSpeed `WeightQuantization.quantize_data` | {q['deepspeed_gbps']:.3f} | 1x |"]
    lines += ["", "Targets:", ""] + [f"- {t}" for t in targets(res)]
    return "\n".join(lines)


def targets(res: dict[str, Any]) -> list[str]:
    main_ = res["main"]
    out = []
    floor_w = med(main_[FLOOR], "wall")
    d_w, d_rss = med(main_[DIRECT], "wall"), med(main_[DIRECT], "rss_mib")
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    out.append(f"direct within 1.2x of the byte-copy floor: {d_w / floor_w:.2f}x — {ok(d_w / floor_w <= 1.2)}")
    paired = sorted(d["wall"] / f["wall"] for d, f in zip(main_[DIRECT], main_[FLOOR]))
    out.append("(same, per round — each --direct run over the floor run of its round: "
               + " / ".join(f"{r:.2f}x" for r in paired) + f", median {statistics.median(paired):.2f}x)")
    out.append(f"peak RSS <= 1 GiB: {d_rss:.0f} MiB — {ok(d_rss <= 1024)}")
    if res.get("deep"):
        g = med(res["deep"][DIRECT], "rss_mib") / d_rss - 1
        out.append(f"peak RSS grows < 10% when layers double: {100 * g:+.1f}% — {ok(g < 0.10)}")
        deep = res["deep"]
        if CP in deep and CP in main_:
            d_add = med(deep[DIRECT], "wall") - d_w
            cp_add = med(deep[CP], "wall") - med(main_[CP], "wall")
            gb = res["deep_source_gb"] - res["source_gb"]
            r = d_add / cp_add if cp_add > 0 else float("inf")
            out.append(f"added time for {gb:.2f} GB more within 1.2x of what cp adds: direct +{d_add:.2f} s, "
                       f"cp +{cp_add:.2f} s = {r:.2f}x — {ok(r <= 1.2)}")
    if res.get("quant"):
        s = res["quant"]["speedup"]
        out.append(f"quantization >= 10x DeepSpeed: {s:.1f}x — {ok(s >= 10)}")
    if ENGINE in main_:
        e_w = med(main_[ENGINE], "wall")
        out.append(f"(engine alone, no destination protocol: {e_w / floor_w:.2f}x the floor)")
    if FLOW in main_:
        f_w = med(main_[FLOW], "wall")
        out.append(f"flow - direct: {f_w - d_w:.1f} s in all")
        if EMPTY_FLOW in main_:
            fixed = med(main_[EMPTY_FLOW], "wall")
            var = f_w - fixed
            out.append(f"flow fixed cost (an empty one-task flow, embedded server start included) <= ~15 s: "
                       f"{fixed:.1f} s — {ok(fixed <= 15)}")
            out.append(f"flow beyond its fixed cost <= 10% over --direct: {var:.1f} s vs {d_w:.1f} s = "
                       f"{100 * (var / d_w - 1):+.0f}% — {ok(var <= 1.1 * d_w)}")
    ident = main_.get("_identical")
    if ident:
        out.append(f"--direct and flow outputs byte-identical: {ident[0]['direct_equals_flow']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--deep-layers", type=int, default=12, help="second depth for memory scaling (0: skip)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deep-runs", type=int, default=None, help="runs at --deep-layers (default: --runs)")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--settle", type=float, default=4.0,
                    help="seconds to wait before each run so memory freed by the previous one is back with "
                         "the host (VM free-page reporting); 0: start at once, as before")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="contention mode: N busy processes (compute and memory traffic) run beside every "
                         "measured run, started before it and stopped after it (default 0: a quiet machine)")
    ap.add_argument("--skip-flow", action="store_true")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--skip-quant", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 run: checks the benchmark runs")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.runs = 1
        ns.settle = min(ns.settle, 0.5)
    t_start = time.perf_counter()
    b = Bench(ns)
    try:
        src = b.source(ns.layers)
        src_bytes = folder_bytes(src)
        free = shutil.disk_usage(b.work).free
        if free < 3 * src_bytes:
            sys.exit(f"need ~{3 * src_bytes / 1e9:.1f} GB free under {b.work}, have {free / 1e9:.1f} GB")
        methods = [FLOOR, CP, ENGINE, DIRECT] + ([] if ns.skip_flow else [FLOW, EMPTY_FLOW]) + \
            ([] if ns.skip_deepspeed else [DS])
        res: dict[str, Any] = {"layers": ns.layers, "source_gb": src_bytes / 1e9, "target_tp": TARGET_TP,
                               "busy": ns.busy,
                               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        res["main"] = b.series(src, methods, ns.runs, check_identical=not ns.skip_flow)
        if ns.deep_layers:
            deep_src = b.source(ns.deep_layers)
            res["deep_layers"] = ns.deep_layers
            res["deep_source_gb"] = folder_bytes(deep_src) / 1e9
            res["deep"] = b.series(deep_src, [FLOOR, CP, DIRECT], ns.deep_runs or ns.runs, check_identical=False)
        if not ns.skip_quant and not ns.skip_deepspeed:
            res["quant"] = b.quant(src)
        res["cold"] = bool(ns.cold and b.cold_ok)
        res["machine"] = machine()
        res["machine"]["disk_free_gb"] = round(shutil.disk_usage(b.work).free / 1e9, 1)
        res["seconds"] = time.perf_counter() - t_start
        finish(res, b.work / "results.json", lambda r: report(ns, r))
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
