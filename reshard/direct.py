"""The in-process conversion path (``reshard run --direct``): plan, convert, commit.

No orchestration, retries or caching — the engine alone, for debugging and for measuring it.
The Prefect flow runs the same steps as separate tasks.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard import __version__
from reshard.core.engine import TargetResult, convert_target, pick_device
from reshard.core.plan import Plan, ReshardOptions, build_plan
from reshard.storage.commit import LocalDestination
from reshard.storage.manifest import MANIFEST_FORMAT, file_record

DESCRIPTOR_NAME = "ds_checkpoint.json"


@dataclass
class RunReport:
    """What a finished run did: enough for the CLI summary and the docs."""

    plan: Plan
    destination: str
    results: list[TargetResult] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def descriptor_for(plan: Plan, names: list[str]) -> dict[str, Any]:
    """DeepSpeed checkpoint descriptor of the new layout (loadable by DeepSpeed's factory)."""
    d: dict[str, Any] = {"type": "Megatron", "version": plan.version, "checkpoints": names,
                         "parallelization": "tp", "mp_size": plan.target_tp, "quantized": plan.options.quantize}
    if plan.options.quantize:
        d["quantization"] = {"bits": plan.options.bits, "groups": plan.options.groups,
                             "mlp_extra_grouping": plan.options.mlp_extra_grouping,
                             "key": "reshard_quantization"}
    return d


def manifest_for(plan: Plan, dest: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    src_files = [{"path": f.name, "size": f.stat().st_size} for f in plan.source.files]
    return {
        "format": MANIFEST_FORMAT,
        "tool": "reshard",
        "tool_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {"origin": plan.source.origin, "tp": plan.source_tp, "files": src_files,
                   "version": plan.version},
        "target": {"location": str(dest), "tp": plan.target_tp},
        "options": plan.options.to_record(),
        "warnings": list(plan.warnings),
        "files": records,
    }


def run_direct(src: str, dst: str, options: ReshardOptions, *, overwrite: bool = False,
               device: str | None = None,
               on_target_done: Callable[[TargetResult], None] | None = None) -> RunReport:
    """Convert ``src`` into ``dst`` in this process; commits atomically or leaves no commit."""
    t0 = time.perf_counter()
    plan = build_plan(src, options)
    dest = LocalDestination(dst, overwrite=overwrite, source_paths=plan.source.files)
    report = RunReport(plan, str(dst))
    dev = pick_device(device)
    dest.open()
    try:
        names = []
        for tp in plan.targets:
            name = tp.name
            res = convert_target(plan, tp.rank, dest.staged(name), dev)
            report.results.append(res)
            names.append(name)
            if on_target_done:
                on_target_done(res)
        dest.staged(DESCRIPTOR_NAME).write_text(json.dumps(descriptor_for(plan, names), indent=2))
        all_names = names + [DESCRIPTOR_NAME]
        records = [file_record(dest.staged(n), n) for n in all_names]
        report.manifest = manifest_for(plan, Path(dst), records)
        dest.commit(all_names, report.manifest)
    except BaseException:
        dest.abort()
        raise
    report.seconds = time.perf_counter() - t0
    return report
