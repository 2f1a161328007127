"""The ``reshard-sweep`` flow: find finished training checkpoints under a prefix and convert each
one that lacks a committed output, for every configured target TP.

A checkpoint counts as *finished* when training says so:

* DeepSpeed: a ``latest`` file naming the tag folder next to it (``run/latest`` -> ``run/global_step1000``);
* Megatron-LM: ``latest_checkpointed_iteration.txt`` naming the iteration (``run/iter_0001000`` or
  ``run/release``);
* any folder holding a completion marker (default ``reshard.complete``), written by the training
  job after its last save.

The checkpoint folder must hold rank files (DeepSpeed, Megatron-LM per-rank) or a torch_dist index
(``.metadata``; its ``source_tp`` is reported as None: global tensors, converted for every target).

Only the checkpoint a marker names is converted (for ``latest`` files: the newest one). The output
of checkpoint ``<source_root>/<relative_path>`` for target ``M`` goes to the ``destination``
template, by default ``{dest_root}/{relative_path}/tp{target_tp}``; an output is *done* when
``reshard_manifest.json`` exists there (the commit marker, written last). So a sweep is idempotent:
the second one converts nothing. Folders that are reshard outputs (hold a manifest), staging folders
and everything under ``dest_root`` are never taken for sources, even when ``dest_root`` lies inside
``source_root``. Each conversion is a nested ``reshard`` flow run; one failing conversion does not
stop the others, but fails the sweep at the end.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.task_runners import ThreadPoolTaskRunner

from reshard.core.source import MEGATRON_LATEST, iteration_dir
from reshard.flows.params import ReshardParams

DS_LATEST = "latest"
COMPLETE_MARKER = "reshard.complete"
DEFAULT_MARKERS = (DS_LATEST, MEGATRON_LATEST, COMPLETE_MARKER)
DEFAULT_DESTINATION = "{dest_root}/{relative_path}/tp{target_tp}"

#: A torch_dist checkpoint's index (megatron-core ``--ckpt-format torch_dist``); its TP is not in its names.
DIST_INDEX = ".metadata"
_RANK_FILE = re.compile(r"^mp_rank_(\d+)(?:_\d+)?(?:_model_states\.pt|/model_optim_rng\.pt)$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _read_text(fs: Any, path: str) -> str:
    return fs.cat_file(path).decode("utf-8", "replace").strip()


def find_finished_checkpoints(source_root: str, storage_options: dict[str, Any] | None = None,
                              markers: tuple[str, ...] | list[str] = DEFAULT_MARKERS,
                              exclude: tuple[str, ...] | list[str] = (),
                              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finished checkpoints under ``source_root`` (one recursive listing) and what was passed over.

    Returns ``(found, ignored)``: ``found`` items are ``{"source", "relative_path", "marker",
    "source_tp"}``; ``ignored`` items are ``{"path", "reason"}``. ``exclude``: URLs whose subtrees
    are never taken for sources (the destination root).
    """
    from reshard.core.errors import StorageError
    from reshard.storage.destination import STAGING_DIR
    from reshard.storage.location import open_location, storage_errors
    from reshard.storage.manifest import MANIFEST_NAME

    loc = open_location(source_root, storage_options)
    base = loc.path.rstrip("/")
    with storage_errors(source_root):
        loc.fs.invalidate_cache()
        if not loc.fs.exists(loc.path):
            raise StorageError("no such bucket or prefix", culprit=source_root,
                               hint="check source_root and the storage credentials")
        listed = loc.fs.find(loc.path)
    rels = sorted(p[len(base):].lstrip("/") for p in listed if p.startswith(base + "/"))
    skip_prefixes = []
    for url in exclude:
        other = open_location(url, storage_options)
        if type(other.fs) is type(loc.fs):
            path = other.path.rstrip("/")
            if path == base:
                skip_prefixes.append("")
            elif path.startswith(base + "/"):
                skip_prefixes.append(path[len(base) + 1:] + "/")
    outputs = {posixpath.dirname(r) for r in rels if posixpath.basename(r) == MANIFEST_NAME}

    def ignored_reason(rel: str) -> str | None:
        parts = rel.split("/")
        if STAGING_DIR in parts:
            return "staging folder"
        if any(rel.startswith(p) for p in skip_prefixes):
            return "under the destination root"
        if any("/".join(parts[:i]) in outputs for i in range(len(parts))):
            return "inside a reshard output"
        return None

    files = [r for r in rels if ignored_reason(r) is None]
    by_folder: dict[str, list[str]] = {}
    for r in files:
        folder = posixpath.dirname(r)
        while True:
            by_folder.setdefault(folder, []).append(r[len(folder) + 1:] if folder else r)
            if not folder:
                break
            folder = posixpath.dirname(folder)

    found: dict[str, dict[str, Any]] = {}
    ignored: list[dict[str, Any]] = []
    for rel in files:
        folder, name = posixpath.split(rel)
        if name not in markers:
            continue
        if name in (DS_LATEST, MEGATRON_LATEST):
            with storage_errors(loc.child_url(rel)):
                text = _read_text(loc.fs, loc.join(rel))
            tag = (iteration_dir(text) or text) if name == MEGATRON_LATEST else text
            if not tag or not _SAFE_NAME.match(tag) or tag in (".", ".."):
                ignored.append({"path": loc.child_url(rel), "reason": f"names {text[:60]!r}, not a folder"})
                continue
            ckpt = posixpath.join(folder, tag) if folder else tag
        else:
            ckpt = folder
        ranks = {int(m.group(1)) for f in by_folder.get(ckpt, []) if (m := _RANK_FILE.match(f))}
        if DIST_INDEX in by_folder.get(ckpt, []):  # torch_dist: global tensors, no per-rank files
            found.setdefault(ckpt, {"source": loc.child_url(ckpt) if ckpt else source_root.rstrip("/"),
                                    "relative_path": ckpt, "marker": name, "source_tp": None,
                                    "marker_folder": folder})
            continue
        if not ranks:
            ignored.append({"path": loc.child_url(ckpt) if ckpt else source_root, "marker_folder": folder,
                            "reason": f"{name} present but no model-state files"})
            continue
        found.setdefault(ckpt, {"source": loc.child_url(ckpt) if ckpt else source_root.rstrip("/"),
                                "relative_path": ckpt, "marker": name, "source_tp": len(ranks),
                                "marker_folder": folder})
    # Megatron-DeepSpeed writes both trackers; one of them naming a missing folder is no news
    done = {f["marker_folder"] for f in found.values()}
    ignored = [{k: v for k, v in i.items() if k != "marker_folder"} for i in ignored
               if i.get("marker_folder") not in done]
    return [{k: v for k, v in found[k].items() if k != "marker_folder"} for k in sorted(found)], ignored


def committed(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` holds a committed checkpoint (its ``reshard_manifest.json`` exists)."""
    from reshard.storage.location import open_location, storage_errors
    from reshard.storage.manifest import MANIFEST_NAME

    loc = open_location(url, storage_options)
    with storage_errors(url):
        return bool(loc.fs.exists(loc.join(MANIFEST_NAME)))


def _check_template_resolved(name: str, value: str) -> None:
    if "{{" in value or not value.strip():
        from reshard.core.errors import ConfigError

        raise ConfigError(f"is {value!r}", culprit=name,
                          hint="set it in the deployment (e.g. export RESHARD_SWEEP_SOURCE/RESHARD_SWEEP_DEST "
                               "before `reshard deploy`) or pass it as a parameter")


def _render(template: str, dest_root: str, rel: str, target_tp: int, source_tp: int | None) -> str:
    values = {"dest_root": dest_root.rstrip("/"), "relative_path": rel, "name": posixpath.basename(rel),
              "target_tp": target_tp, "source_tp": source_tp}
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError) as exc:
        from reshard.core.errors import ConfigError

        raise ConfigError(f"bad template {template!r} ({exc!r})", culprit="destination",
                          hint=f"use only the fields {', '.join('{' + f + '}' for f in values)}") from None


@task(name="scan-checkpoints", retries=2, retry_delay_seconds=[2, 10])
def scan(source_root: str, dest_root: str, targets: list[int], storage_options: dict[str, Any],
         destination: str, markers: list[str], stages_asked: bool) -> dict[str, Any]:
    """Finished checkpoints x targets, each marked ``pending``, ``committed`` or ``skipped`` (a
    checkpoint already at a target TP, unless ``stages_asked``: the options change its pipeline stages)."""
    found, ignored = find_finished_checkpoints(source_root, storage_options, markers, exclude=[dest_root])
    plan = []
    for ckpt in found:
        rel = ckpt["relative_path"] or posixpath.basename(ckpt["source"].rstrip("/"))
        for m in targets:
            item = {**ckpt, "target_tp": m, "destination": _render(destination, dest_root, rel, m, ckpt["source_tp"])}
            if ckpt["source_tp"] == m and not stages_asked:
                item.update(state="skipped", reason=f"already TP {m}")
            elif committed(item["destination"], storage_options):
                item.update(state="committed", reason="output committed")
            else:
                item.update(state="pending", reason="")
            plan.append(item)
    return {"items": plan, "ignored": ignored}


@flow(name="reshard-sweep", validate_parameters=True)
def reshard_sweep(
    source_root: str,
    dest_root: str,
    targets: list[int] = [2],  # noqa: B006 - never mutated; shown as the default in the UI
    storage_options: dict[str, Any] | None = None,
    destination: str = DEFAULT_DESTINATION,
    markers: list[str] = list(DEFAULT_MARKERS),  # noqa: B006
    options: dict[str, Any] | None = None,
    max_conversions: int | None = None,
) -> dict[str, Any]:
    """Convert every finished checkpoint under ``source_root`` that lacks a committed output
    for one of ``targets``. ``options``: further ``ReshardParams`` fields for every conversion
    (``quantize``, ``device``, ``cache_dir``, ``target_pp``, ...)."""
    from prefect.artifacts import create_markdown_artifact

    from reshard.flows.reshard_flow import reshard_flow

    log = get_run_logger()
    _check_template_resolved("source_root", source_root)
    _check_template_resolved("dest_root", dest_root)
    storage_options = storage_options or {}
    options = dict(options or {})
    reserved = {"source", "destination", "target_tp", "storage_options"} & set(options)
    if reserved:
        from reshard.core.errors import ConfigError

        raise ConfigError(f"options may not set {sorted(reserved)}", culprit="options",
                          hint="use the sweep's own parameters for these")
    ReshardParams(source="x", destination="y", target_tp=1, **options)  # invalid options fail before any work
    _render(destination, dest_root, "run/step", 1, 1)  # so does a bad destination template

    stage_options = ("target_pp", "target_vpp", "target_first_stage_layers", "target_last_stage_layers",
                     "target_pipeline_layout")
    result = scan(source_root, dest_root, list(targets), storage_options, destination, list(markers),
                  any(options.get(k) is not None for k in stage_options))
    items = result["items"]
    pending = [i for i in items if i["state"] == "pending"]
    log.info("%d finished checkpoint(s) x %d target(s): %d pending, %d committed, %d skipped",
             len({i["source"] for i in items}), len(targets), len(pending),
             sum(i["state"] == "committed" for i in items), sum(i["state"] == "skipped" for i in items))
    if max_conversions is not None and len(pending) > max_conversions:
        for i in pending[max_conversions:]:
            i.update(state="deferred", reason=f"max_conversions={max_conversions}")
        pending = pending[:max_conversions]

    convert = reshard_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=4))
    for item in pending:
        params = ReshardParams(source=item["source"], destination=item["destination"], target_tp=item["target_tp"],
                               storage_options=storage_options, **options)
        run_name = f"{item['relative_path'] or item['source']} -> tp{item['target_tp']}"
        state = convert.with_options(flow_run_name=run_name)(params, return_state=True)
        if state.is_completed():
            summary = state.result()
            item.update(state="converted", flow_run_id=summary.flow_run_id)
        else:
            item.update(state="failed", reason=(state.message or state.name)[:500])
            log.error("converting %s to TP %d failed: %s", item["source"], item["target_tp"], item["reason"])

    lines = ["| source | target TP | destination | state | note |", "|---|---|---|---|---|"]
    lines += [f"| {i['source']} | {i['target_tp']} | {i['destination']} | {i['state']} | {i.get('reason', '')} |"
              for i in items]
    lines += [f"| {g['path']} | | | ignored | {g['reason']} |" for g in result["ignored"]]
    create_markdown_artifact("\n".join(lines), key="reshard-sweep", description="reshard sweep")
    summary = {state: [i for i in items if i["state"] == state]
               for state in ("converted", "committed", "skipped", "deferred", "failed")}
    summary["ignored"] = result["ignored"]
    if summary["failed"]:
        failures = "; ".join(f"{i['source']} -> tp{i['target_tp']}: {i['reason']}" for i in summary["failed"])
        raise RuntimeError(f"{len(summary['failed'])} conversion(s) failed: {failures}")
    return summary
