"""The ``reshard`` Prefect flow: a per-shard DAG with retries, per-shard caching and resume.

::

    discover ─┬─ fetch(shard 0) ─ check(shard 0) ─┐
              ├─ fetch(shard 1) ─ check(shard 1) ─┤
              └─ ...                              ┴─ plan (cross-shard checks, ZeRO gate, destination)
                                                      ├─ convert(target 0) ─ upload(target 0) ─┐
                                                      └─ convert(target 1) ─ upload(target 1) ─┴─ commit ─ report

Caching: fetch/check are keyed by the shard's identity, convert/upload by the conversion's
identity (sources + options + code version) and stay valid while their output exists, so a
re-run — after success, failure or a SIGKILL — skips every finished step and produces the same
bytes. Results are persisted under ``$PREFECT_RESULTS_LOCAL_STORAGE_PATH`` (the CLI sets it to
``<cache>/prefect-results``); clearing the cache folder clears both.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import flow, get_run_logger

from reshard.flows.params import ReshardParams
from reshard.storage.cache import RemoteObject, ShardCache
from reshard.tasks.identity import conversion_id
from reshard.tasks.shard_tasks import check_shard, discover_shards, fetch_shard
from reshard.tasks.target_tasks import (cache_dir_of, commit_checkpoint, convert_target_rank, output_present,
                                        plan_conversion, report, upload_target)


@flow(name="reshard", validate_parameters=True)
def reshard_flow(params: ReshardParams) -> dict[str, Any]:
    """Reshard ``params.source`` into ``params.destination`` at ``params.target_tp``."""
    log = get_run_logger()
    cache_dir = cache_dir_of(params.cache_dir)
    options = params.options().to_record()
    base = {"destination": params.destination, "storage_options": params.storage_options,
            "overwrite": params.overwrite, "device": params.device, "options": options,
            "target_config": params.target_config, "cache_dir": cache_dir,
            "gpu_concurrency_limit": params.gpu_concurrency_limit}

    disc = discover_shards(params.source, params.storage_options)
    objects = disc["objects"]
    log.info("discovered %d objects under %s", len(objects), params.source)
    cache = ShardCache(cache_dir)
    fetches = {o["name"]: fetch_shard.with_options(
        refresh_cache=not (disc["is_local"] or cache.entry(RemoteObject(**o)).is_file())
    ).submit(params.source, o, params.storage_options, cache_dir, disc["is_local"]) for o in objects}
    checks = [check_shard.submit(fetches[o["name"]], _identity(o), params.module_key) for o in objects]
    fetched = {name: fut.result() for name, fut in fetches.items()}
    for c in checks:
        c.result()

    job = plan_conversion(base, disc, {} if disc["is_local"] else fetched, conversion_id(objects, options))
    if job["up_to_date"]:
        log.info("%s already holds this exact conversion; nothing new will be written", params.destination)
    converts, uploads = {}, {}
    for t in job["targets"]:
        name = t["name"]
        staged = output_present(job, name, accept_local_file=False)  # uploaded or committed
        converted = staged or output_present(job, name, accept_local_file=True)
        with _gpu_annotation(params.gpu_resource):
            converts[name] = convert_target_rank.with_options(refresh_cache=not converted).submit(
                job, name, t["rank"])
        uploads[name] = upload_target.with_options(refresh_cache=not staged).submit(job, name, converts[name])
    records = [uploads[name].result() for name in converts]
    converted = [converts[name].result() for name in converts]
    manifest = commit_checkpoint(job, records)
    report(job, converted, records)
    from prefect.runtime import flow_run

    return {"flow_run_id": str(flow_run.id), "source": params.source, "destination": params.destination, "source_tp": job["source_tp"],
            "target_tp": params.target_tp, "version": job["version"], "quantized": params.quantize,
            "up_to_date": job["up_to_date"], "conversion_id": job["conversion_id"],
            "files": manifest.get("files", []), "warnings": job["warnings"]}


def _identity(obj: dict[str, Any]) -> str:
    return RemoteObject(**obj).identity


def _gpu_annotation(enabled: bool) -> Any:
    """Dask resource annotation for tensor tasks (workers must declare ``GPU``), else a no-op."""
    if not enabled:
        return contextlib.nullcontext()
    import dask

    return dask.annotate(resources={"GPU": 1})
