"""Pipeline benchmark: Megatron-LM per-rank files into and out of the interleaved (virtual) and
uneven pipeline layouts, against the byte-copy floor of each source, on the ~3 GB fp16
Llama-shaped megatron-core checkpoint of ``bench_torch_dist.py`` (TP 8, 12 layers).

    python bench/bench_pipeline.py               # full run
    python bench/bench_pipeline.py --quick       # smoke test of the benchmark itself (tiny model)

Not part of the tests. Same method as ``bench_torch_dist.py`` (its helpers): every command its own
process, wall time around it and peak RSS its ``ru_maxrss``, methods interleaved, medians of
``--runs``, warm cache, a pause before each run; ``--deep-layers`` repeats the reshard runs on a
model with twice the layers: peak RSS must stay flat. No peer writes these layouts (Megatron-LM's
converter reads virtual stages but writes none), so the floor is the comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_torch_dist import FLOOR, log, measure, parse_bench_args, reshard, settle, size, source_for, warm
from contention import busy, load_note

TO_VPP = ("--target-tp", "2", "--target-pp", "2", "--target-vpp", "2")
TO_UNEVEN = ("--target-tp", "2", "--target-pp", "3", "--target-vpp", "2", "--target-first-stage-layers", "2",
             "--target-last-stage-layers", "2")


def main(argv: list[str] | None = None) -> int:
    ns, shape = parse_bench_args(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])
    if ns.quick:  # PP 2 x VPP 2 needs 4 layers
        ns.layers, ns.deep_layers = 4, 8
    work = ns.work_dir / "pipeline"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for layers in [ns.layers] + ([ns.deep_layers] if ns.deep_layers else []):
        src = source_for(ns, layers, shape)
        vpp = work / f"vpp_l{layers}"
        subprocess.run(reshard(str(src), str(vpp), *TO_VPP), check=True, capture_output=True)
        methods = {
            "floor (per-rank TP 8 bytes)": (FLOOR + [str(src)], src),
            "TP 8 -> TP 2 x PP 2 x VPP 2": (reshard(str(src), "{out}", *TO_VPP), src),
            "floor (VPP bytes)": (FLOOR + [str(vpp)], vpp),
            "VPP 2 -> TP 8, one stage": (reshard(str(vpp), "{out}", "--target-tp", "8", "--target-pp", "1"), vpp),
            "VPP 2 -> PP 3 x VPP 2, first/last 2": (reshard(str(vpp), "{out}", *TO_UNEVEN), vpp),
        }
        if layers != ns.layers:  # the deep model: memory scaling of reshard only
            methods = {k: v for k, v in methods.items() if "->" in k}
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
        for i in range(ns.runs):
            for name, (cmd, source) in methods.items():
                out = work / "run_out"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                warm(source)
                settle(ns.settle)
                log(f"L{layers} run {i + 1}/{ns.runs}: {name}")
                cmd = [c.replace("{out}", str(out)) for c in cmd] + ([str(out)] if "floor" in name else [])
                with busy(ns.busy):
                    runs[name].append(measure(cmd))
        shutil.rmtree(work / "run_out", ignore_errors=True)
        results[f"layers={layers}"] = {
            "source GB": round(size(src) / 1e9, 2), "VPP GB": round(size(vpp) / 1e9, 2),
            **{m: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                   "peak_rss_mib": round(statistics.median(r["rss_mib"] for r in rs))} for m, rs in runs.items()}}
        shutil.rmtree(vpp, ignore_errors=True)
    base = results[f"layers={ns.layers}"]
    lines = [load_note(ns.busy), f"{'method':40} {'seconds':>8} {'x floor':>8} {'peak RSS':>10}"]
    for name, rec in base.items():
        if not isinstance(rec, dict):
            continue
        floor = base["floor (per-rank TP 8 bytes)" if name.startswith(("TP 8", "floor (per-rank")) else
                     "floor (VPP bytes)"]["seconds"]
        lines.append(f"{name:40} {rec['seconds']:8.2f} {rec['seconds'] / floor:8.2f} {rec['peak_rss_mib']:8d} MiB")
    if ns.deep_layers:
        deep = results[f"layers={ns.deep_layers}"]
        for name in (n for n in base if "->" in n):
            lines.append(f"peak RSS {name}: {base[name]['peak_rss_mib']} MiB at {ns.layers} layers, "
                         f"{deep[name]['peak_rss_mib']} MiB at {ns.deep_layers} layers")
    print("\n".join(lines))
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
