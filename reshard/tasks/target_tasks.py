"""Per-target-rank tasks: plan (cross-shard checks + ZeRO gate), convert, upload, commit, report.

A *job* is the small dict the plan step returns; every later task receives it (plus a target
name) and rebuilds what it needs from local paths, so tasks stay stateless and cheap to pickle.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from reshard.core.engine import convert_target, pick_device
from reshard.core.errors import DestinationError, StorageError
from reshard.core.plan import ReshardOptions, build_plan
from reshard.crashpoints import crash_point
from reshard.direct import manifest_for, side_files, source_record, zero_gate
from reshard.flows import progress
from reshard.storage.cache import RemoteObject, ShardCache
from reshard.storage.destination import Destination, LocalDestination, open_destination
from reshard.storage.location import open_location
from reshard.storage.manifest import file_record
from reshard.storage.source_view import Discovery, LocalSource, build_view
from reshard.tasks.cache_keys import target_key
from reshard.tasks.shard_tasks import TRANSIENT_RETRIES

GPU_TAG = "reshard-gpu"


def destination_for(job: dict[str, Any]) -> Destination:
    dest = open_destination(job["destination"], job["storage_options"], overwrite=job["overwrite"],
                            workdir=Path(job["workdir"]), check=False)
    if job.get("lock_token"):
        dest.adopt_lock(job["lock_token"], job["conversion_id"])
    return dest


def output_present(job: dict[str, Any], name: str, *, accept_local_file: bool) -> bool:
    """Is target ``name`` of this conversion already produced (staged or committed)?"""
    dest = destination_for(job)
    manifest = dest.committed_manifest()
    if manifest and manifest.get("conversion_id") == job["conversion_id"]:
        return any(r.get("path") == name for r in manifest.get("files", []))
    if isinstance(dest, LocalDestination) or accept_local_file:
        if dest.staged(name).is_file():
            return True
    if not isinstance(dest, LocalDestination):
        return dest.staged_remote_size(name) is not None
    return False


def _options(job: dict[str, Any]) -> ReshardOptions:
    return ReshardOptions(**job["options"])


@task(name="plan-conversion", **TRANSIENT_RETRIES)
def plan_conversion(base: dict[str, Any], discovery: dict[str, Any], fetched: dict[str, str],
                    conversion_id: str) -> dict[str, Any]:
    """Cross-shard checks (keys, shapes, replicated tensors, versions), the ZeRO gate and the
    destination checks — everything that can refuse the conversion, before any output."""
    disc = Discovery(discovery["url"], discovery["is_local"], [RemoteObject(**o) for o in discovery["objects"]],
                     discovery["descriptor_name"],
                     base64.b64decode(discovery["descriptor_b64"]) if discovery["descriptor_b64"] else None)
    workdir = Path(base["cache_dir"]) / "work" / conversion_id[:24]
    view = build_view(disc, {k: Path(v) for k, v in fetched.items()}, workdir / "source")
    local = LocalSource(disc.url, view, disc.objects)
    from reshard.direct import _source_folders, _urls_in_errors

    with _urls_in_errors(view, disc.url):
        plan = build_plan(str(view), ReshardOptions(**base["options"]))
        zero = zero_gate(plan, base["target_config"])
    job = dict(base, conversion_id=conversion_id, workdir=str(workdir), view_path=str(view))
    dest = destination_for(job)
    committed = dest.committed_manifest()
    up_to_date = bool(committed and committed.get("conversion_id") == conversion_id)
    if not up_to_date:
        if committed and not job["overwrite"]:
            raise DestinationError("already holds a committed checkpoint (of a different conversion)",
                                   culprit=job["destination"],
                                   hint="pass overwrite=True / --overwrite to replace it, or choose another destination")
        src_loc = open_location(disc.url, job["storage_options"])
        dest.check_outside(src_loc, _source_folders(plan, local, src_loc))
        from prefect.runtime import flow_run

        dest.acquire(str(flow_run.id or conversion_id), conversion_id)
        job["lock_token"] = str(flow_run.id or conversion_id)
        dest.open(clean_staging=False)
    names = [t.name for t in plan.targets]
    crash_point("planned")
    return dict(job, up_to_date=up_to_date,
                targets=[{"rank": t.rank, "name": t.name, "sources": list(t.sources),
                          "bytes_written": t.bytes_written} for t in plan.targets],
                warnings=list(plan.warnings), zero_stage=zero.source_stage,
                side_files=side_files(plan, names), source_record=source_record(plan, local),
                source_tp=plan.source_tp, target_pp=plan.target_pp, version=plan.version)


@task(name="convert-target", cache_key_fn=target_key("convert"), persist_result=True, tags=[GPU_TAG])
def convert_target_rank(job: dict[str, Any], name: str, rank: int) -> dict[str, Any]:
    """Merge/split/quantize one target rank from exactly the source shards it needs."""
    plan = build_plan(job["view_path"], _options(job))
    dest = destination_for(job)
    out = dest.staged(name)
    # same basename as the final file: torch.save records it inside the zip, so keeping it
    # makes the bytes identical to the direct path's
    partial = out.parent / ".partial" / out.name
    partial.parent.mkdir(parents=True, exist_ok=True)
    device = pick_device(job.get("device"))
    limit = job.get("gpu_concurrency_limit")
    t0 = time.perf_counter()
    if limit:
        from prefect.concurrency.sync import concurrency

        with concurrency(limit, occupy=1, strict=True):
            res = convert_target(plan, rank, partial, device)
    else:
        res = convert_target(plan, rank, partial, device)
    os.replace(partial, out)
    crash_point("converted")
    return {"rank": rank, "name": name, "size": res.size, "sources": list(res.sources),
            "seconds": round(time.perf_counter() - t0, 3)}


@task(name="upload-target", cache_key_fn=target_key("upload"), persist_result=True, **TRANSIENT_RETRIES)
def upload_target(job: dict[str, Any], name: str, converted: dict[str, Any]) -> dict[str, Any]:
    """Stage one output at the destination (multipart upload for remote stores) and record
    its size and sha256 for the manifest."""
    dest = destination_for(job)
    record = dest.publish(name)
    dest.heartbeat()
    crash_point("uploaded")
    progress.notify(dict(converted, sha256=record["sha256"]))
    return record


@task(name="commit-checkpoint", **TRANSIENT_RETRIES)
def commit_checkpoint(job: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the descriptor, verify every staged file, move them into place, manifest last."""
    dest = destination_for(job)
    if job["up_to_date"]:
        return dest.committed_manifest() or {}
    records = list(records)
    for name, text in job["side_files"].items():
        dest.staged(name).write_text(text)
        records.append(dest.publish(name))
    side = set(job["side_files"])
    if not isinstance(dest, LocalDestination):
        for rec in records:
            size = dest.staged_remote_size(rec["path"])
            if size != rec["size"]:
                raise StorageError(f"staged {rec['path']} has {size} bytes, expected {rec['size']}",
                                   culprit=job["destination"], hint="re-run; the staged copy will be redone",
                                   transient=False)
    else:
        for rec in records:
            actual = file_record(dest.staged(rec["path"]), rec["path"]) if rec["path"] not in side else rec
            if actual["sha256"] != rec["sha256"]:
                raise StorageError(f"staged {rec['path']} changed since it was hashed", culprit=job["destination"])
    manifest = manifest_for(_options(job), job["warnings"], job["source_record"], job["destination"], records,
                            job["conversion_id"], job["target_pp"])
    crash_point("staged-all")
    dest.commit([r["path"] for r in records], manifest)
    return manifest


@task(name="report")
def report(job: dict[str, Any], converted: list[dict[str, Any]], records: list[dict[str, Any]]) -> str:
    """A markdown artifact: one row per target rank (sources, bytes, time, sha256)."""
    by_name = {r["path"]: r for r in records}
    lines = [f"### reshard {job['source_record']['url']} -> {job['destination']}",
             f"TP {job['source_tp']} -> {job['options']['target_tp']}, checkpoint version {job['version']}, "
             f"{'already up to date (nothing written)' if job['up_to_date'] else 'committed'}", "",
             "| target rank | source ranks | bytes | seconds | sha256 |", "|---|---|---|---|---|"]
    for c in converted:
        rec = by_name.get(c["name"], {})
        lines.append(f"| {c['rank']} | {', '.join(map(str, c['sources']))} | {rec.get('size', c['size'])} | "
                     f"{c['seconds']} | `{rec.get('sha256', '')[:16]}` |")
    for w in job["warnings"]:
        lines.append(f"\n- warning: {w}")
    md = "\n".join(lines)
    create_markdown_artifact(md, key="reshard-report", description="reshard conversion report")
    return md


def cache_dir_of(cache_dir: str | None) -> str:
    return str(ShardCache(cache_dir).root)
