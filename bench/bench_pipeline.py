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

import shutil
import subprocess
import sys
from typing import Any

from bench_torch_dist import FLOOR, parse_bench_args, report, reshard, run_interleaved, size, source_for

TO_VPP = ("--target-tp", "2", "--target-pp", "2", "--target-vpp", "2")
TO_UNEVEN = ("--target-tp", "2", "--target-pp", "3", "--target-vpp", "2", "--target-first-stage-layers", "2",
             "--target-last-stage-layers", "2")


def main(argv: list[str] | None = None) -> int:
    ns, shape = parse_bench_args(sys.argv[1:] if argv is None else argv, __doc__.splitlines()[0])
    if ns.quick:  # PP 3 x VPP 2 with first/last ranks of 2 needs 8 layers (a middle rank of 4)
        ns.layers, ns.deep_layers = 8, 16
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
        results[f"layers={layers}"] = {"source GB": round(size(src) / 1e9, 2), "VPP GB": round(size(vpp) / 1e9, 2),
                                       **run_interleaved(ns, methods, work, layers)}
        shutil.rmtree(vpp, ignore_errors=True)
    report(ns, results, work, lambda name: "floor (per-rank TP 8 bytes)" if name.startswith(("TP 8", "floor (per-rank"))
           else "floor (VPP bytes)", [name for name in methods if "->" in name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
