"""What the two ways of running a conversion share: ``reshard run --direct`` (:mod:`reshard.direct`)
and the Prefect tasks (:mod:`reshard.tasks`).

Both must write identical bytes and the same side files and manifest, refuse the same inputs
(the ZeRO gate) and name the user's URLs in errors, so each of these facts lives here, once.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import reshard.progress as progress
from reshard.core.errors import LayoutError, ReshardError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import Plan
from reshard.core.zero_config import ZeroDecision, decide_conversion
from reshard.crashpoints import crash_point
from reshard.discovery import LocalSource
from reshard.execution.engine import TargetResult, convert_target
from reshard.formats.output import weights_read
from reshard.formats.registry import get_format
from reshard.storage.manifest import MANIFEST_FORMAT
from reshard.tasks.identity import code_version
from reshard.version import __version__


def side_files(plan: Plan, names: list[str]) -> dict[str, bytes]:
    """Small files written beside the outputs, as the output's format wants them (Megatron's
    ``latest_checkpointed_iteration.txt``, DeepSpeed's descriptor, torch_dist's index), and the
    source's files the output carries unchanged (its tokenizer and generation config)."""
    copied = {name: path.read_bytes() for name, path in plan.copied_files.items()}
    files = {**plan.extra_files, **copied, **get_format(plan.output_format).side_files(plan, names)}
    return {name: v.encode() if isinstance(v, str) else v for name, v in files.items()}


def side_files_record(files: dict[str, bytes]) -> dict[str, str]:
    """:func:`side_files` as task-result data (base64), and back with :func:`side_files_from_record`."""
    return {name: base64.b64encode(v).decode() for name, v in files.items()}


def side_files_from_record(record: dict[str, str]) -> dict[str, bytes]:
    return {name: base64.b64decode(v) for name, v in record.items()}


def source_record(plan: Plan, local: LocalSource) -> dict[str, Any]:
    """What the manifest says about the source: URL, TP, and each file's size (and ETag)."""
    root = local.path if local.path.is_dir() else local.path.parent
    etags = {o.name: o.etag for o in local.objects}
    files = []
    for f in plan.source.distinct_files:
        rel = f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name
        rec: dict[str, Any] = {"path": rel, "size": f.stat().st_size}
        if rel in etags:
            rec["etag"] = etags[rel]
        files.append(rec)
    quantization = get_format(plan.source.format).quantization(plan.source)
    return {"url": local.url, "tp": plan.source_tp, "pp": plan.source_pp, "ep": plan.source.ep,
            "etp": plan.source.expert_tp, "format": plan.source.format, "version": plan.version,
            "quantized": quantization["method"] if quantization else None, "files": files}


def manifest_for(options: ReshardOptions, warnings: list[str], source: dict[str, Any], dst: str,
                 records: list[dict[str, Any]], conversion_id: str, target_pp: int = 1,
                 output_format: str | None = None, *, target_ep: int = 1,
                 target_etp: int | None = None) -> dict[str, Any]:
    """The commit marker. ``conversion_id`` lets a later identical run see it is up to date.
    ``target_etp``: the output's expert TP (None without experts)."""
    return {
        "format": MANIFEST_FORMAT,
        "tool": "reshard",
        "tool_version": __version__,
        "code_version": code_version(),
        "conversion_id": conversion_id,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "target": {"url": dst, "format": output_format, "tp": options.target_tp, "pp": target_pp, "ep": target_ep,
                   "etp": target_etp},
        "options": options.to_record(),
        "warnings": list(warnings),
        "files": records,
    }


def zero_gate(plan: Plan, target_config: Mapping[str, Any] | None) -> ZeroDecision:
    """Validate the source's saved ZeRO config (and the user's target config) before any
    transfer; ZeRO-3 placeholders are refused."""
    read = weights_read(plan.options) - {"module"}
    elsewhere = f"the weights are read from the optimizer partitions ({', '.join(sorted(read))})" if read else None
    decision = decide_conversion(plan.ds_config, dict(target_config) if target_config else None,
                                 weights_elsewhere=elsewhere)
    if decision.verify_full_tensors:
        empty = [p.key for p in plan.params if 0 in p.shape]
        if empty:
            raise LayoutError(f"ZeRO-3 checkpoint holds empty placeholder tensors ({empty[0]}, ...)",
                              culprit=plan.source.origin,
                              hint="consolidate with DeepSpeed's zero_to_fp32.py first")
    return decision


def source_folders(plan: Plan, local: LocalSource) -> list[str]:
    """Folders (on the source's filesystem) holding the files the plan reads."""
    if local.objects:
        return sorted({o.path.rsplit("/", 1)[0] for o in local.objects})
    return sorted({f.resolve().parent.as_posix() for f in plan.source.files})


@contextlib.contextmanager
def urls_in_errors(local: Path, url: str) -> Iterator[None]:
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


def streams_sources(options: ReshardOptions, cache_sources: bool) -> bool:
    """Are a remote source's weight files read while converting (only their structure fetched
    first)? Unless asked to cache them whole, yes — except where the optimizer files are read too
    (``--weights master``, ``--to universal``): those are fetched whole, and so are the rank files
    their layout is read with."""
    return not cache_sources and weights_read(options) == {"module"}


def convert_streamed(plan: Plan, rank: int, scratch: Path, device: Any, stream: Any, view: Path,
                     src: str) -> tuple[TargetResult, dict[str, Any]]:
    """Convert target ``rank`` while ``stream`` (a destination's ``open_stream``) uploads it;
    ``scratch`` holds only what the writer reads back and is removed after. The upload is
    aborted if anything fails; else returns the result and the output's manifest record."""
    name = plan.targets[rank].name
    try:
        with urls_in_errors(view, src):
            res = convert_target(plan, rank, scratch, device, sha256=True, on_bytes=progress.bytes_reporter(name),
                                 stream=stream)
        crash_point("converted")  # every part sent but the last: a kill leaves an upload no record names
        record = stream.finish(res.sha256)
    except BaseException:
        stream.abort()
        raise
    finally:
        scratch.unlink(missing_ok=True)
    crash_point("uploaded")
    return res, record
