"""Per-target-rank tasks: plan (cross-shard checks + ZeRO gate), convert, upload, commit, report.

A *job* is the small dict the plan step returns; every later task receives it (plus a target
name) and rebuilds what it needs, so tasks stay stateless and cheap to pickle. A task may run on
another machine than the one that fetched its shards (Dask workers that share nothing but the
object store): its local files — the work folder, the source's view, the fetched shards — are
found (or fetched again) in *its own* shard cache, by names that are the same everywhere
(:func:`_ensure_view`), never by another machine's paths.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

import reshard.progress as progress
from reshard.conversion import (
    convert_streamed,
    manifest_for,
    side_files,
    side_files_from_record,
    side_files_record,
    source_folders,
    source_record,
    urls_in_errors,
    zero_gate,
)
from reshard.core.errors import DestinationError, StorageError
from reshard.core.options import ReshardOptions
from reshard.core.zero_master import forget_optimizer_files
from reshard.crashpoints import crash_point
from reshard.discovery import Discovery, LocalSource, attach_streamed, fetch, link_into_view, skeleton_view
from reshard.execution.engine import convert_target, pick_device
from reshard.execution.planner import build_plan
from reshard.formats import get_format, locate
from reshard.formats.output import weights_read
from reshard.storage.cache import ShardCache, is_skeleton
from reshard.storage.destination import Destination, LocalDestination
from reshard.storage.destinations import open_destination
from reshard.storage.location import open_location
from reshard.storage.workdirs import scratch_folder
from reshard.tasks.cache_keys import target_key
from reshard.tasks.shard_tasks import TRANSIENT_RETRIES

GPU_TAG = "reshard-gpu"
#: Under a conversion's ``out`` folder: each attempt's scratch folder for the output it writes.
PARTIAL_DIR = ".partial"


def _workdir(job: dict[str, Any]) -> Path:
    """This conversion's private work folder in this process's shard cache."""
    return ShardCache(job["cache_dir"]).conversion_work(job["conversion_id"])


def _view_root(job: dict[str, Any]) -> Path:
    return _workdir(job) / "source"


def _view_path(job: dict[str, Any]) -> Path:
    """What ``locate`` is given: the source itself when local, else its view in this process's cache."""
    return Path(job["view_path"]) if job["is_local"] else _view_root(job) / job["view_rel"]


def destination_for(job: dict[str, Any]) -> Destination:
    dest = open_destination(job["destination"], job["storage_options"], overwrite=job["overwrite"],
                            workdir=_workdir(job), check=False)
    if job.get("lock_token"):
        dest.adopt_lock(job["lock_token"], job["conversion_id"])
    return dest


def abandon_claim(job: dict[str, Any]) -> None:
    """After a failed run: release this run's destination lock and what a resume cannot reuse
    (an empty staging folder, incomplete uploads); nothing when the run never claimed it."""
    if job.get("lock_token"):
        destination_for(job).abandon()


def converted_path(job: dict[str, Any], name: str) -> Path:
    """Where convert writes target ``name``: this conversion's private work folder (for a remote
    destination that is also its local staging path), never the destination itself — a target
    may be converted before the destination is claimed."""
    return _workdir(job) / "out" / name


def output_present(job: dict[str, Any], name: str, *, accept_local_file: bool) -> bool:
    """Is target ``name`` of this conversion already produced (staged, committed, or — with
    ``accept_local_file`` — converted and waiting in the work folder)?"""
    dest = destination_for(job)
    manifest = dest.committed_manifest()
    if manifest and manifest.get("conversion_id") == job["conversion_id"]:
        return any(r.get("path") == name for r in manifest.get("files", []))
    if accept_local_file and converted_path(job, name).is_file():
        return True
    return dest.staged_size(name) is not None


def _options(job: dict[str, Any]) -> ReshardOptions:
    return ReshardOptions(**job["options"])


def _ensure_view(job: dict[str, Any], fetched: dict[str, str]) -> None:
    """Make this process's view of the source hold the ``fetched`` shards (name -> the path a
    fetch task returned) and the checkpoint's markers, replacing placeholders. A path that is not
    on this machine (fetched by another worker) is fetched again into this process's cache, the
    same way (a skeleton, a range set or the whole object); a skeleton reads the rest from the
    source while converting (attached here, in this process)."""
    if job["is_local"]:
        return
    root = _view_root(job)
    disc = Discovery.from_record(job["discovery"])
    skeleton_view(disc, root)  # placeholders where nothing is linked yet
    by_name = {o.name: o for o in disc.objects}
    cache, loc = ShardCache(job["cache_dir"]), open_location(job["source"], job["storage_options"])
    markers: dict[str, Path] = {}
    wanted = {**job.get("markers", {}), **fetched}
    for name in sorted(wanted, key=lambda n: not disc.is_marker(n)):  # markers first: the others' ranges need them
        path = Path(wanted[name])
        try:
            link_into_view(path, root / name)
        except FileNotFoundError:  # not on this machine, or gone from the cache meanwhile: fetch it here
            path = fetch(loc, by_name[name], disc.classes[name], cache, None if disc.is_marker(name) else markers,
                         stream=is_skeleton(path))
            link_into_view(path, root / name)
        if disc.is_marker(name):
            markers[name] = path
        attach_streamed(root / name, path, loc, by_name[name])


def layout_plan(job: dict[str, Any]) -> Any:
    """The headers-only plan of this conversion, built once per worker process (every convert
    task of a run needs it; rebuilding it per task cost seconds on large models)."""
    return _layout_plan(str(_view_path(job)), job["conversion_id"], job["source"], json.dumps(job["options"]))


@functools.lru_cache(maxsize=4)
def _layout_plan(view_path: str, _conversion_id: str, source_url: str, options_json: str) -> Any:
    with urls_in_errors(Path(view_path), source_url):
        return build_plan(view_path, ReshardOptions(**json.loads(options_json)), headers_only=True)


@task(name="locate-source", **TRANSIENT_RETRIES)
def locate_source(base: dict[str, Any], discovery: dict[str, Any], metadata: dict[str, str],
                  conversion_id: str) -> dict[str, Any]:
    """Lay out the source as a local view (placeholders for shards not fetched yet) and name
    the *header* files — the first rank file of each pipeline stage — that the layout plan reads."""
    disc = Discovery.from_record(discovery)
    job = dict(base, conversion_id=conversion_id, is_local=disc.is_local, source=disc.url, discovery=discovery,
               markers=dict(metadata))
    view = skeleton_view(disc, _view_root(job))
    if disc.is_local:
        job["view_path"] = str(view)
    else:
        job["view_rel"] = view.relative_to(_view_root(job)).as_posix()
    _ensure_view(job, {})
    with urls_in_errors(view, disc.url):
        source = locate(str(view))
    names = _object_names(job, source.files)
    # read by every target
    read_too = source.aux + get_format(source.format).companions(source, weights_read(_options(job)))
    aux = _object_names(job, read_too)
    if None in names or None in aux:  # a local descriptor may list files outside its folder: no per-shard early start
        names = [o.name for o in disc.objects if not disc.is_marker(o.name)]
        headers, aux = names, []
    elif source.layer_ids:  # DeepSpeed pipeline layer files: the layout is planned from all of them
        headers = list(names)
    else:
        headers = [names[source.index(r, 0)] for r in range(source.rows)]
    return dict(job, source_files=names, source_aux=aux, headers=headers + aux)


def _object_names(job: dict[str, Any], paths: Sequence[Path]) -> list[str | None]:
    """The source object behind each local path of the view (None: a file outside the listing)."""
    disc = Discovery.from_record(job["discovery"])
    view_root = _view_root(job)
    by_path = {os.path.realpath(o.path if disc.is_local else view_root / o.name): o.name for o in disc.objects}
    return [by_path.get(os.path.realpath(f)) for f in paths]


@task(name="plan-layout", **TRANSIENT_RETRIES)
def plan_layout(located: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """Every tensor's fate from the header files alone (see ``build_plan(headers_only=True)``)
    plus the ZeRO gate: which source shards each target rank reads, so its conversion can start
    as soon as those are fetched. Cross-rank checks follow in ``plan-conversion``."""
    job = dict(located)
    _ensure_view(job, headers)
    plan = layout_plan(job)
    zero = zero_gate(plan, job["target_config"])
    names = [t.name for t in plan.targets]
    # the grid as the plan reads it: the saved args may fill positions the located grid only
    # stood in for (Megatron-LM files at an expert TP below the TP)
    files = _object_names(job, plan.source.files)
    files = job["source_files"] if None in files else files
    aux = job.get("source_aux") or []  # read by every target (a torch_dist checkpoint's blobs)
    return dict(job, targets=[{"rank": t.rank, "name": t.name,
                               "sources": list(dict.fromkeys(files[i] for i in t.sources)) + aux,
                               "bytes_written": t.bytes_written} for t in plan.targets],
                publishes=not isinstance(destination_for(job), LocalDestination),
                warnings=list(plan.warnings), zero_stage=zero.source_stage,
                side_files=side_files_record(side_files(plan, names)),
                source_tp=plan.source_tp, target_pp=plan.target_pp, target_ep=plan.target_ep,
                target_etp=plan.target_etp, version=plan.version,
                output_format=plan.output_format, notes=get_format(plan.output_format).describe(plan))


@task(name="plan-conversion", **TRANSIENT_RETRIES)
def plan_conversion(layout: dict[str, Any], fetched: dict[str, str]) -> dict[str, Any]:
    """Cross-shard checks over every rank (keys, shapes, replicated tensors, versions) and the
    destination checks — everything that can still refuse the conversion — then claim the
    destination. No output is published before this succeeds."""
    job = dict(layout)
    _ensure_view(job, fetched)
    disc = Discovery.from_record(job["discovery"])
    view = _view_path(job)
    local = LocalSource(disc.url, view, disc.objects)
    with urls_in_errors(view, disc.url):
        plan = build_plan(str(view), _options(job))
    dest = destination_for(job)
    committed = dest.committed_manifest()
    up_to_date = bool(committed and committed.get("conversion_id") == job["conversion_id"])
    if not up_to_date:
        if committed and not job["overwrite"]:
            raise DestinationError("already holds a committed checkpoint (of a different conversion)",
                                   culprit=job["destination"],
                                   hint="pass overwrite=True / --overwrite to replace it, "
                                        "or choose another destination")
        src_loc = open_location(disc.url, job["storage_options"])
        dest.check_outside(src_loc, source_folders(plan, local))
        from prefect.runtime import flow_run

        token = str(flow_run.id or job["conversion_id"])
        dest.acquire(token, job["conversion_id"])
        job["lock_token"] = token
        dest.open(clean_staging=False)
    crash_point("planned")
    # the layout's plan read headers only; this one read the values, which some warnings need
    # (a format's plan_warnings: like-source's re-encoded layers)
    warnings = list(dict.fromkeys([*job["warnings"], *plan.warnings]))
    return dict(job, up_to_date=up_to_date, source_record=source_record(plan, local), warnings=warnings)


@task(name="convert-target", cache_key_fn=target_key("convert"), persist_result=True)
def convert_target_rank(job: dict[str, Any], name: str, rank: int, sources: dict[str, str]) -> dict[str, Any]:
    """Merge/split/quantize one target rank from exactly the source shards it needs, into the
    work folder (published by ``upload-target`` once the cross-rank checks passed) — or, for a
    remote destination (``job["publishes"]``: then ``job`` is plan-conversion's, the destination
    claimed), published by this task itself (S3: uploaded while it is written), so no other
    machine needs this one's files; recorded under ``record``."""
    _ensure_view(job, sources)
    plan = layout_plan(job)
    if job.get("publishes"):
        return _convert_and_publish(job, plan, name, rank)
    out = converted_path(job, name)
    device = pick_device(job.get("device"))
    t0 = time.perf_counter()
    # a private folder per attempt (two runs of one conversion may convert the same target at
    # once; a killed attempt's is reclaimed by the next), and the final basename: torch.save
    # records it inside the zip, so keeping it makes the bytes identical to the direct path's
    with scratch_folder(out.parent / PARTIAL_DIR) as scratch:
        partial = scratch / out.name
        with urls_in_errors(_view_path(job), job["source"]), _gpu_slot(job):
            res = convert_target(plan, rank, partial, device, sha256=True, on_bytes=_on_bytes(name))
        os.replace(partial, out)
    crash_point("converted")
    return {"rank": rank, "name": name, "size": res.size, "sources": list(res.sources), "sha256": res.sha256,
            "seconds": round(time.perf_counter() - t0, 3), "worker": worker_label()}


def _on_bytes(name: str) -> Any:
    """The writer's progress callback for output ``name``: the progress display's, and the crash
    point ``writing`` (a run killed with the output half-written)."""
    report = progress.bytes_reporter(name)

    def on_bytes(done: int) -> None:
        crash_point("writing")
        if report is not None:
            report(done)

    return on_bytes


def worker_label() -> str:
    """Which process converted a target (host and pid), for the report: on a cluster, where each
    file was made."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _convert_and_publish(job: dict[str, Any], plan: Any, name: str, rank: int) -> dict[str, Any]:
    """Convert one target and publish it (the destination is claimed: ``job`` is plan-conversion's):
    uploaded while it is written where the destination takes streams, else written here and
    published right after."""
    if job["up_to_date"]:  # committed by an earlier run: nothing to convert
        rec = _committed_record(job, name)
        return {"rank": rank, "name": name, "size": rec["size"], "sources": list(plan.targets[rank].sources),
                "sha256": rec["sha256"], "seconds": 0.0, "record": rec}
    dest = destination_for(job)
    device = pick_device(job.get("device"))
    t0 = time.perf_counter()
    if not (dest.takes_streams and get_format(plan.output_format).writes_streams()):
        with urls_in_errors(_view_path(job), job["source"]), _gpu_slot(job):
            res = convert_target(plan, rank, dest.staged(name), device, sha256=True,
                                 on_bytes=progress.bytes_reporter(name))
        crash_point("converted")
        record = dest.publish(name, res.sha256)
    else:
        with scratch_folder(converted_path(job, name).parent / PARTIAL_DIR) as scratch, _gpu_slot(job):
            res, record = convert_streamed(plan, rank, scratch / Path(name).name, device,
                                           dest.open_stream(name, plan.targets[rank].bytes_written),
                                           _view_path(job), job["source"])
    return {"rank": rank, "name": name, "size": res.size, "sources": list(res.sources), "sha256": res.sha256,
            "seconds": round(time.perf_counter() - t0, 3), "record": record, "worker": worker_label()}


def _gpu_slot(job: dict[str, Any]) -> Any:
    """A slot of the Prefect concurrency limit ``gpu_concurrency_limit`` names (none: no limit)."""
    limit = job.get("gpu_concurrency_limit")
    if not limit:
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(limit, occupy=1, strict=True)


def _committed_record(job: dict[str, Any], name: str) -> dict[str, Any]:
    manifest = destination_for(job).committed_manifest() or {}
    return next(r for r in manifest.get("files", []) if r.get("path") == name)


@task(name="upload-target", cache_key_fn=target_key("upload"), persist_result=True, **TRANSIENT_RETRIES)
def upload_target(job: dict[str, Any], name: str, converted: dict[str, Any]) -> dict[str, Any]:
    """Stage one output at the destination (a move for local folders, a multipart upload for
    object stores) and record its size and sha256 (computed while it was written); an output
    streamed while it was converted is staged already (its ``record``)."""
    if job["up_to_date"]:  # already committed by an earlier run: its manifest has the record
        return _committed_record(job, name)
    dest = destination_for(job)
    if converted.get("record"):
        record = converted["record"]
        dest.heartbeat()
        progress.target_done(dict(converted, sha256=record["sha256"]))
        return record
    if isinstance(dest, LocalDestination):
        _move_into(converted_path(job, name), dest.staged(name))
    record = dest.publish(name, converted.get("sha256"))
    dest.heartbeat()
    crash_point("uploaded")
    progress.target_done(dict(converted, sha256=record["sha256"]))
    return record


def _move_into(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` atomically (copy to a temporary name first across file systems)."""
    if not src.exists():
        return  # moved by an earlier attempt (the staged file is checked by size at commit)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        src.unlink()


@task(name="commit-checkpoint", **TRANSIENT_RETRIES)
def commit_checkpoint(job: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the descriptor, verify every staged file, move them into place, manifest last."""
    dest = destination_for(job)
    if job["up_to_date"]:
        return dest.committed_manifest() or {}
    records = list(records)
    for name, data in side_files_from_record(job["side_files"]).items():
        dest.staged(name).write_bytes(data)
        records.append(dest.publish(name))
    for rec in records:  # sizes only: the sha256 were computed while writing and are not re-read
        size = dest.staged_size(rec["path"])
        if size != rec["size"]:
            raise StorageError(f"staged {rec['path']} has {size} bytes, expected {rec['size']}",
                               culprit=job["destination"], hint="re-run; the staged copy will be redone",
                               transient=False)
    manifest = manifest_for(_options(job), job["warnings"], job["source_record"], job["destination"], records,
                            job["conversion_id"], job["target_pp"], job["output_format"],
                            target_ep=job["target_ep"], target_etp=job["target_etp"])
    crash_point("staged-all")
    dest.commit([r["path"] for r in records], manifest)
    forget_optimizer_files()  # this process's targets are done: their mappings would keep disk space
    return manifest


@task(name="report")
def report(job: dict[str, Any], converted: list[dict[str, Any]], records: list[dict[str, Any]]) -> str:
    """A markdown artifact: what the output is (the format's notes, e.g. a Hugging Face export's
    architecture and why), then one row per written file (sources, bytes, time, sha256)."""
    by_name = {r["path"]: r for r in records}
    lines = [f"### reshard {job['source_record']['url']} -> {job['destination']}",
             f"TP {job['source_tp']} -> {job['options']['target_tp'] or job['output_format']}, checkpoint version "
             f"{job['version']}, "
             f"{'already up to date (nothing written)' if job['up_to_date'] else 'committed'}", "",
             *[f"- {note}" for note in job.get("notes", [])],
             "", "| target | source ranks | bytes | seconds | sha256 | converted on |", "|---|---|---|---|---|---|"]
    for c in converted:
        rec = by_name.get(c["name"], {})
        lines.append(f"| {c.get('name', c['rank'])} | {', '.join(map(str, c['sources']))} | "
                     f"{rec.get('size', c['size'])} | "
                     f"{c['seconds']} | `{rec.get('sha256', '')[:16]}` | {c.get('worker') or 'an earlier run'} |")
    for w in job["warnings"]:
        lines.append(f"\n- warning: {w}")
    md = "\n".join(lines)
    create_markdown_artifact(md, key="reshard-report", description="reshard conversion report")
    return md
