"""reshard's engine alone, as ``reshard run --direct`` would run it if the manifest hashes came
from the writer (``convert_target(..., sha256=True)``) instead of a second read of every
output: plan, convert each target with the SHA-256 computed while writing, print the hashes.
No destination protocol (staging, lock, manifest) — a bound, not a replacement.

    python bench/engine_only.py SRC_DIR DST_DIR --target-tp 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reshard.execution.engine import convert_target
from reshard.execution.plan import ReshardOptions
from reshard.execution.planner import build_plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst", type=Path)
    ap.add_argument("--target-tp", type=int, required=True)
    ns = ap.parse_args(argv)
    plan = build_plan(ns.src, ReshardOptions(target_tp=ns.target_tp))
    hashes = {}
    for t in plan.targets:
        out = ns.dst / t.name
        out.parent.mkdir(parents=True, exist_ok=True)
        hashes[t.name] = convert_target(plan, t.rank, out, sha256=True).sha256
    print(json.dumps(hashes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
