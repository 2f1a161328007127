"""The in-process conversion path (``reshard run --direct``): locate, plan, convert, commit.

No orchestration, retries or caching of results — the engine alone, for debugging and for
measuring it. The Prefect flow runs the same steps as separate tasks and reuses the helpers
here (descriptor, manifest, ZeRO gate), so both paths write identical bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard import __version__, progress
from reshard.core.engine import TargetResult, convert_target, pick_device
from reshard.core.errors import DestinationError, LayoutError, ReshardError
from reshard.core.plan import Plan, ReshardOptions, build_plan
from reshard.core.source import DEEPSPEED
from reshard.core.zero_config import ZeroDecision, decide_conversion
from reshard.storage.cache import ShardCache
from reshard.storage.destination import open_destination
from reshard.storage.location import open_location
from reshard.storage.manifest import MANIFEST_FORMAT
from reshard.storage.source_view import LocalSource, discover, materialize
from reshard.tasks.identity import code_version, conversion_id

DESCRIPTOR_NAME = "ds_checkpoint.json"


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


def side_files(plan: Plan, names: list[str]) -> dict[str, str]:
    """Small files written beside the shards: the DeepSpeed descriptor (DeepSpeed layout) or
    Megatron's ``latest_checkpointed_iteration.txt`` (Megatron-LM layout)."""
    files = dict(plan.extra_files)
    if plan.output_format == DEEPSPEED:
        files[DESCRIPTOR_NAME] = json.dumps(descriptor_for(plan, names), indent=2)
    return files


def descriptor_for(plan: Plan, names: list[str]) -> dict[str, Any]:
    """DeepSpeed checkpoint descriptor of the new layout (loadable by DeepSpeed's factory)."""
    d: dict[str, Any] = {"type": "Megatron", "version": plan.version, "checkpoints": names,
                         "parallelization": "tp", "mp_size": plan.target_tp, "quantized": plan.options.quantize}
    if plan.options.quantize:
        d["quantization"] = {"bits": plan.options.bits, "groups": plan.options.groups,
                             "mlp_extra_grouping": plan.options.mlp_extra_grouping,
                             "key": "reshard_quantization"}
    return d


def source_record(plan: Plan, local: LocalSource) -> dict[str, Any]:
    """What the manifest says about the source: URL, TP, and each file's size (and ETag)."""
    root = local.path if local.path.is_dir() else local.path.parent
    etags = {o.name: o.etag for o in local.objects}
    files = []
    for f in plan.source.files:
        rel = f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name
        rec: dict[str, Any] = {"path": rel, "size": f.stat().st_size}
        if rel in etags:
            rec["etag"] = etags[rel]
        files.append(rec)
    return {"url": local.url, "tp": plan.source_tp, "pp": plan.source_pp, "format": plan.source.format,
            "version": plan.version, "files": files}


def manifest_for(options: ReshardOptions, warnings: list[str], source: dict[str, Any], dst: str,
                 records: list[dict[str, Any]], conversion_id: str, target_pp: int = 1) -> dict[str, Any]:
    """The commit marker. ``conversion_id`` lets a later identical run see it is up to date."""
    return {
        "format": MANIFEST_FORMAT,
        "tool": "reshard",
        "tool_version": __version__,
        "code_version": code_version(),
        "conversion_id": conversion_id,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "target": {"url": dst, "tp": options.target_tp, "pp": target_pp},
        "options": options.to_record(),
        "warnings": list(warnings),
        "files": records,
    }


def zero_gate(plan: Plan, target_config: Mapping[str, Any] | None) -> ZeroDecision:
    """Validate the source's saved ZeRO config (and the user's target config) before any
    transfer; ZeRO-3 placeholders are refused."""
    decision = decide_conversion(plan.ds_config, dict(target_config) if target_config else None)
    if decision.verify_full_tensors:
        empty = [p.key for p in plan.params if 0 in p.shape]
        if empty:
            raise LayoutError(f"ZeRO-3 checkpoint holds empty placeholder tensors ({empty[0]}, ...)",
                              culprit=plan.source.origin,
                              hint="consolidate with DeepSpeed's zero_to_fp32.py first")
    return decision


def _source_folders(plan: Plan, local: LocalSource, src_loc: Any) -> list[str]:
    """Folders (on the source's filesystem) holding the files the plan reads."""
    if local.objects:
        return sorted({o.path.rsplit("/", 1)[0] for o in local.objects})
    return sorted({f.resolve().parent.as_posix() for f in plan.source.files})


@contextlib.contextmanager
def _urls_in_errors(local: Path, url: str) -> Iterator[None]:
    """Errors raised on the local view of a remote source name the user's URL instead."""
    try:
        yield
    except ReshardError as err:
        if local.as_posix() != url:
            base = local.as_posix() if local.is_dir() else local.parent.as_posix()
            target = url if local.is_dir() else url.rsplit("/", 1)[0]
            if err.culprit:
                err.culprit = err.culprit.replace(base, target)
            err.message = err.message.replace(base, target)
            err.args = (err.one_line(),)
        raise


def run_direct(src: str, dst: str, options: ReshardOptions, *, overwrite: bool = False,
               device: str | None = None, storage_options: Mapping[str, Any] | None = None,
               cache: ShardCache | None = None, target_config: Mapping[str, Any] | None = None,
               on_target_done: Callable[[TargetResult], None] | None = None) -> RunReport:
    """Convert ``src`` into ``dst`` (any URLs) in this process; commits atomically or not at all."""
    t0 = time.perf_counter()
    src_loc = open_location(src, storage_options)
    dst_loc = open_location(dst, storage_options)
    workdir = None
    if not (src_loc.is_local and dst_loc.is_local):
        cache = cache or ShardCache()
        workdir = cache.new_workdir("run")
    try:
        disc = discover(src, storage_options)  # a listing: sizes and ETags, no tensor bytes
        cid = conversion_id([dataclasses.asdict(o) for o in disc.objects], options.to_record())
        dest = open_destination(dst, dict(storage_options or {}), overwrite=overwrite, workdir=workdir,
                                source=src_loc, check=False)
        committed = dest.committed_manifest()
        if committed and committed.get("conversion_id") == cid:  # this exact conversion is there already
            return RunReport(None, dst, manifest=committed, up_to_date=True,
                             seconds=time.perf_counter() - t0)
        dest.check(src_loc)
        local = materialize(src, storage_options, cache, workdir, disc=disc)
        with _urls_in_errors(local.path, src):
            plan = build_plan(str(local.path), options)
            report = RunReport(plan, dst, fetched=local.fetched, cached=local.cached)
            report.zero = zero_gate(plan, target_config)
        dest.check_outside(src_loc, _source_folders(plan, local, src_loc))
        dev = pick_device(device)
        try:
            dest.acquire(uuid.uuid4().hex, cid)  # before touching staging: it may be another run's
            dest.open()
            names, records = [], []
            # target t uploads while target t+1 converts (one upload at a time: disk holds two outputs at most)
            progress.planned((tp.name, tp.rank, tp.bytes_written) for tp in plan.targets)
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-publish") as uploader:
                pending = []
                for tp in plan.targets:
                    with _urls_in_errors(local.path, src):
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
            for name, text in side_files(plan, list(names)).items():
                dest.staged(name).write_text(text)
                records.append(dest.publish(name))
                names.append(name)
            report.manifest = manifest_for(options, list(plan.warnings), source_record(plan, local), dst, records,
                                           cid, plan.target_pp)
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
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report
