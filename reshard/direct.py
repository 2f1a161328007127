"""The in-process conversion path (``reshard run --direct``): locate, plan, convert, commit.

No orchestration, retries or caching of results — the engine alone, for debugging and for
measuring it. The Prefect flow runs the same steps as separate tasks; what both share
(descriptor, manifest, ZeRO gate) is in :mod:`reshard.conversion`, so both write identical bytes.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import reshard.progress as progress
from reshard.conversion import (
    convert_streamed,
    manifest_for,
    side_files,
    source_folders,
    source_record,
    streams_sources,
    urls_in_errors,
    zero_gate,
)
from reshard.core import remote
from reshard.core.errors import DestinationError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import Plan
from reshard.core.zero_config import ZeroDecision
from reshard.core.zero_master import forget_optimizer_files
from reshard.discovery import LocalSource, discover, materialize
from reshard.execution.engine import TargetResult, convert_target, pick_device
from reshard.execution.planner import build_plan
from reshard.formats import get_format
from reshard.storage.cache import ShardCache
from reshard.storage.destination import Destination
from reshard.storage.destinations import open_destination
from reshard.storage.location import open_location
from reshard.tasks.identity import conversion_id


@dataclass
class RunReport:
    """What a finished run did: enough for the CLI summary and the docs. ``plan`` is None when
    the destination already held this exact conversion (``up_to_date``: nothing was read or
    written; ``manifest`` is the committed one)."""

    plan: Plan | None
    destination: str
    results: list[TargetResult] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    zero: ZeroDecision | None = None
    fetched: int = 0
    cached: int = 0
    seconds: float = 0.0
    up_to_date: bool = False


@dataclass
class Checked:
    """What the checks made before any byte is written found (:func:`check_conversion`). ``plan``
    is None when the destination holds this exact conversion already (``committed``: its manifest;
    nothing else was checked)."""

    conversion_id: str
    destination: Destination
    committed: dict[str, Any] | None = None
    plan: Plan | None = None
    local: LocalSource | None = None
    zero: ZeroDecision | None = None

    @property
    def up_to_date(self) -> bool:
        return self.plan is None


def check_conversion(src: str, dst: str, options: ReshardOptions, *, overwrite: bool = False,
                     storage_options: Mapping[str, Any] | None = None, cache: ShardCache | None = None,
                     workdir: Path | None = None, target_config: Mapping[str, Any] | None = None,
                     cache_sources: bool = False) -> Checked:
    """Every refusal a conversion can make before it writes a byte, in the order a run meets them:
    the source listed (a listing: sizes and ETags), the destination's committed checkpoint (this
    exact conversion: up to date, nothing more to check), the destination itself, every source
    file's structure planned (:func:`~reshard.execution.planner.build_plan`: layout, shapes, a
    truncated file), the ZeRO gate and the loading job's config, the destination outside the
    source's folders. ``workdir``: where a remote source's view (and a remote destination's local
    side) lies, needed unless both are local."""
    src_loc = open_location(src, storage_options)
    disc = discover(src, storage_options, options)
    cid = conversion_id([dataclasses.asdict(o) for o in disc.objects], options.to_record())
    dest = open_destination(dst, dict(storage_options or {}), overwrite=overwrite, workdir=workdir, source=src_loc,
                            check=False)
    committed = dest.committed_manifest()
    if committed and committed.get("conversion_id") == cid:  # this exact conversion is there already
        return Checked(cid, dest, committed=committed)
    dest.check(src_loc)
    local = materialize(src, storage_options, cache, workdir, disc=disc, stream=streams_sources(options, cache_sources))
    with urls_in_errors(local.path, src):
        plan = build_plan(str(local.path), options)
        zero = zero_gate(plan, target_config)
    dest.check_outside(src_loc, source_folders(plan, local))
    return Checked(cid, dest, plan=plan, local=local, zero=zero)


def preflight(src: str, dst: str, options: ReshardOptions, *, overwrite: bool = False,
              storage_options: Mapping[str, Any] | None = None, cache: ShardCache | None = None,
              target_config: Mapping[str, Any] | None = None, cache_sources: bool = False) -> dict[str, Any] | None:
    """:func:`check_conversion` for a conversion that runs elsewhere (the CLI's Prefect flow): its
    refusals come from this process, before an orchestrator has started, at ``--direct``'s speed.
    Returns the committed manifest when ``dst`` holds this exact conversion already, else None.
    Nothing is written but a remote source's structure, into the shard cache, where the flow's
    fetches find it."""
    src_local, dst_local = (open_location(u, storage_options).is_local for u in (src, dst))
    workdir = None if src_local and dst_local else (cache or ShardCache()).new_workdir("check")
    try:
        checked = check_conversion(src, dst, options, overwrite=overwrite, storage_options=storage_options,
                                   cache=cache, workdir=workdir, target_config=target_config,
                                   cache_sources=cache_sources)
    finally:
        if workdir is not None:
            remote.detach(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
    return checked.committed


def run_direct(src: str, dst: str, options: ReshardOptions, *, overwrite: bool = False,
               device: str | None = None, storage_options: Mapping[str, Any] | None = None,
               cache: ShardCache | None = None, target_config: Mapping[str, Any] | None = None,
               on_target_done: Callable[[TargetResult], None] | None = None,
               cache_sources: bool = False) -> RunReport:
    """Convert ``src`` into ``dst`` (any URLs) in this process; commits atomically or not at all.
    A remote source's weight files are read range by range while converting (only their
    structure is fetched first: :func:`reshard.discovery.fetch`), unless
    ``cache_sources`` (fetch them whole into the shard cache, for conversions that read them again)."""
    t0 = time.perf_counter()
    src_loc = open_location(src, storage_options)
    dst_loc = open_location(dst, storage_options)
    workdir = None
    if not (src_loc.is_local and dst_loc.is_local):
        cache = cache or ShardCache()
        workdir = cache.new_workdir("run")
    try:
        checked = check_conversion(src, dst, options, overwrite=overwrite, storage_options=storage_options,
                                   cache=cache, workdir=workdir, target_config=target_config,
                                   cache_sources=cache_sources)
        dest, cid = checked.destination, checked.conversion_id
        if checked.committed is not None:  # this exact conversion is there already
            return RunReport(None, dst, manifest=checked.committed, up_to_date=True,
                             seconds=time.perf_counter() - t0)
        plan, local = checked.plan, checked.local
        if plan is None or local is None:  # check_conversion gives both unless the output is up to date
            raise RuntimeError("check_conversion returned no plan for a conversion that is not up to date")
        report = RunReport(plan, dst, fetched=local.fetched, cached=local.cached, zero=checked.zero)
        dev = pick_device(device)
        try:
            dest.acquire(uuid.uuid4().hex, cid)  # before touching staging: it may be another run's
            dest.open()
            names, records = [], []
            # target t uploads while target t+1 converts (one upload at a time: disk holds two outputs at most)
            progress.planned((tp.name, tp.rank, tp.bytes_written) for tp in plan.targets)
            streams = dest.takes_streams and get_format(plan.output_format).writes_streams()
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-publish") as uploader:
                pending: list[Future[dict[str, Any]]] = []
                for tp in plan.targets:
                    # an upload while it is written
                    stream = dest.open_stream(tp.name, tp.bytes_written) if streams else None
                    if stream is not None:
                        res, record = convert_streamed(plan, tp.rank, dest.staged(tp.name), dev, stream,
                                                       local.path, src)
                        pending.append(Future())
                        pending[-1].set_result(record)
                    else:
                        with urls_in_errors(local.path, src):
                            res = convert_target(plan, tp.rank, dest.staged(tp.name), dev, sha256=True,
                                                 on_bytes=progress.bytes_reporter(tp.name))
                        if pending:
                            pending[-1].result()  # surface an upload error before converting on
                        pending.append(uploader.submit(dest.publish, tp.name, res.sha256))
                    dest.heartbeat()
                    report.results.append(res)
                    names.append(tp.name)
                    progress.target_done({"name": tp.name, "rank": res.rank, "sources": list(res.sources),
                                          "size": res.size, "seconds": res.seconds})
                    if on_target_done:
                        on_target_done(res)
                records.extend(f.result() for f in pending)
            for name, data in side_files(plan, list(names)).items():
                dest.staged(name).write_bytes(data)
                records.append(dest.publish(name))
                names.append(name)
            report.manifest = manifest_for(options, list(plan.warnings), source_record(plan, local), dst, records,
                                           cid, plan.target_pp, plan.output_format, target_ep=plan.target_ep,
                                           target_etp=plan.target_etp)
            dest.commit(names, report.manifest)
        except BaseException as exc:
            lost = not isinstance(exc, KeyboardInterrupt) and dest.lost_lock()
            dest.abort()
            if lost and not isinstance(exc, DestinationError):
                raise DestinationError("another conversion took over this destination while this one ran; "
                                       "nothing was committed", culprit=dst,
                                       hint="run the conversions to different destinations") from None
            raise
    finally:
        forget_optimizer_files()  # their mappings would keep evicted cache files' disk space
        if workdir is not None:
            remote.detach(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report

