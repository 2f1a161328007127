"""The ``reshard`` Prefect flow: a per-shard DAG with retries, per-shard caching and resume.

::

    discover ─┬─ fetch(shard 0) ─ check(shard 0) ─┐
              ├─ fetch(shard 1) ─ check(shard 1) ─┤
              └─ ...                              │
    locate (view; header = first rank file per stage)
    plan-layout (header files only: every target's sources; ZeRO gate)
      convert(target t)  <- waits only for fetch+check of *its* source shards
    plan-conversion (cross-rank checks over all shards, destination checks, claim) <- all checks
      upload(target t)   <- convert(t) and plan-conversion
    commit (sizes, descriptor, manifest last) ─ report

A target converts into the conversion's private work folder, so it can start before every
shard is fetched and before the cross-rank checks ran; it is only published (uploaded, or moved
into the destination's staging folder) after they passed. Where the destination takes an
output while it is written (S3: a multipart upload to its final key, invisible until the
commit), convert(t) waits for plan-conversion instead and uploads as it converts: the output
never lies whole on local disk, and upload(t) only records it. A remote source's weight files
are fetched as skeletons (their structure: directories, pickles, headers) and read range by range
while converting, unless ``cache_sources`` asks for whole copies in the shard cache.

Caching: fetch/check are keyed by the shard's identity, convert/upload by the conversion's
identity (sources + options + code version) and stay valid while their output exists, so a
re-run — after success, failure or a SIGKILL — skips every finished step and produces the same
bytes. Results are persisted under ``$PREFECT_RESULTS_LOCAL_STORAGE_PATH`` (the CLI sets it to
``<cache>/prefect-results``); clearing the cache folder clears both.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import Flow, get_run_logger
from prefect.futures import wait

import reshard.progress as progress
from reshard.conversion import streams_sources
from reshard.flows.params import ReshardParams
from reshard.result import ConversionResult
from reshard.storage.cache import RemoteObject, ShardCache
from reshard.storage.workdirs import WorkUse
from reshard.tasks.identity import conversion_id
from reshard.tasks.shard_tasks import check_shard, discover_shards, fetch_shard
from reshard.tasks.target_tasks import (
    GPU_TAG,
    abandon_claim,
    commit_checkpoint,
    convert_target_rank,
    locate_source,
    output_present,
    plan_conversion,
    plan_layout,
    report,
    upload_target,
)


class ReshardFlow(Flow[Any, Any]):
    """Prefect's flow, called from plain Python (no flow run around the call) on the Prefect
    :func:`~reshard.flows.session.prefect_session` picks: the caller's server when
    ``PREFECT_API_URL`` names one, else reshard's embedded server with the CLI's quiet, isolated
    defaults instead of Prefect's temporary one on ``~/.prefect``. As a subflow, or run by a
    deployment, it is Prefect's flow unchanged."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from reshard.flows.session import prefect_session

        params = args[0] if args else kwargs.get("params")
        cache_dir = params.get("cache_dir") if isinstance(params, dict) else getattr(params, "cache_dir", None)
        with prefect_session(cache_dir):
            return super().__call__(*args, **kwargs)

    def with_options(self, **kwargs: Any) -> ReshardFlow:
        new = super().with_options(**kwargs)
        new.__class__ = type(self)  # Prefect builds a plain Flow
        return new


def _reshard_flow(**options: Any) -> Any:
    """``@flow(**options)``, making a :class:`ReshardFlow`."""
    return lambda fn: ReshardFlow(fn, **options)


@_reshard_flow(name="reshard", validate_parameters=True)
def reshard_flow(params: ReshardParams) -> ConversionResult:
    """Reshard ``params.source`` into ``params.destination`` at ``params.target_tp``; usable as a
    subflow of a user's own flow (``reshard_flow(ReshardParams(...))``), its result a typed record;
    called on its own from Python, it runs as the CLI runs it (:class:`ReshardFlow`)."""
    log = get_run_logger()
    # None: each process (a Dask worker on another machine, say) uses its own default cache
    cache_dir = params.cache_dir
    options = params.options().to_record()
    base = {"destination": params.destination, "storage_options": params.storage_options,
            "overwrite": params.overwrite, "device": params.device, "options": options,
            "target_config": params.target_config, "cache_dir": cache_dir,
            "gpu_concurrency_limit": params.gpu_concurrency_limit}

    disc = discover_shards(params.source, params.storage_options, options)
    objects, kinds = disc["objects"], disc["classes"]  # each object classified once, by discovery
    log.info("discovered %d objects under %s", len(objects), params.source)
    cache = ShardCache(cache_dir)

    stream = streams_sources(params.options(), params.cache_sources)  # weight files read while converting

    def fetch(o: dict[str, Any], markers: dict[str, Any] | None = None) -> Any:
        obj = RemoteObject(**o)
        held = cache.entry(obj).is_file() or (stream and cache.skeleton_entry(obj).is_file())
        return fetch_shard.with_options(refresh_cache=not (disc["is_local"] or held)).submit(
            params.source, o, kinds[o["name"]], params.storage_options, cache_dir, disc["is_local"], markers,
            stream and markers is not None)

    # markers first: they say which byte ranges the other objects are needed for
    fetches = {o["name"]: fetch(o) for o in objects if kinds[o["name"]]["marker"]}
    markers = dict(fetches)
    fetches.update({o["name"]: fetch(o, markers) for o in objects if o["name"] not in markers})
    checks = {o["name"]: check_shard.submit(fetches[o["name"]], _identity(o), params.module_key, o["url"],
                                            kinds[o["name"]]["checker"], kinds[o["name"]]["role"],
                                            None if disc["is_local"] else {"source": params.source, "obj": o,
                                                                           "kind": kinds[o["name"]],
                                                                           "storage_options": params.storage_options,
                                                                           "cache_dir": cache_dir})
              for o in objects}

    cid = conversion_id(objects, options)
    # this run's hold on the conversion's work folder: the run that commits it removes it,
    # unless another run of it is using it (storage/workdirs.py)
    work = WorkUse(cache.conversion_work(cid))
    try:
        metadata = {name: fut.result() for name, fut in fetches.items() if kinds[name]["marker"]}
        located = locate_source(base, disc, metadata, cid)
        headers = located["headers"]
        _raise_first_failure([fetches[h] for h in headers] + [checks[h] for h in headers], wait_all=False)
        layout = plan_layout(located, {h: fetches[h].result() for h in headers})
        progress.planned((t["name"], t["rank"], t["bytes_written"]) for t in layout["targets"])
        # cross-rank checks and the destination claim run alongside the conversions; nothing is
        # published (uploaded, moved into staging) before they pass
        job_f = plan_conversion.submit(layout, fetches, wait_for=list(checks.values()))
        converts, uploads = {}, {}
        # the GPU tag only when GPU handling was asked for: Prefect makes every tagged task acquire a
        # concurrency slot per tag from the server first (measured: ~2 s before a conversion starts)
        gpu_tags = [GPU_TAG] if (params.gpu_concurrency_limit or params.gpu_resource
                                 or (params.device or "cpu") != "cpu") else []
        # an output for a remote destination is published by the task that converts it (S3: uploaded
        # while it is written), so only once the destination is claimed; one for a local folder is
        # converted into the work folder as soon as *its* source shards are fetched and checked, and
        # moved into staging after the checks
        streams = layout["publishes"]
        for t in layout["targets"]:
            name = t["name"]
            staged = output_present(layout, name, accept_local_file=False)  # uploaded or committed
            converted = staged or (not streams and output_present(layout, name, accept_local_file=True))
            with _gpu_annotation(params.gpu_resource):
                converts[name] = convert_target_rank.with_options(refresh_cache=not converted, tags=gpu_tags).submit(
                    job_f if streams else layout, name, t["rank"],
                    {s: fetches[s] for s in (*t["sources"], *headers)},  # the headers: its layout plan reads them
                    wait_for=[checks[s] for s in t["sources"]])
            uploads[name] = upload_target.with_options(refresh_cache=not staged).submit(job_f, name, converts[name])
        # on a failure, let what is running finish (its results are cached for the re-run) and
        # report the root cause — the first failed step in DAG order — not a downstream "not ready"
        try:
            _raise_first_failure([*fetches.values(), *checks.values(), job_f, *converts.values(), *uploads.values()])
            steps = [*fetches.values(), *checks.values(), *converts.values(), *uploads.values()]
            reused = sum(1 for fut in steps if fut.state.name == "Cached")  # served from an earlier run's records
            resumed = _resumed(converts, uploads, streams)
            records = [uploads[name].result() for name in converts]
            converted = [converts[name].result() for name in converts]
            job = job_f.result()
            if job["up_to_date"]:
                log.info("%s already holds this exact conversion; nothing new will be written", params.destination)
            manifest = commit_checkpoint(job, records)
            work.finish()  # committed: nothing in the work folder is needed anymore
        except BaseException:
            # give up the destination claim (staged outputs stay for the resume); a SIGKILL skips
            # this, and the resumed run takes its own claim over
            if job_f.state.is_completed():
                abandon_claim(job_f.result())
            raise
        report(job, converted, records)
        from prefect.runtime import flow_run

        return ConversionResult.from_manifest(
            manifest, params.destination, up_to_date=job["up_to_date"], source=params.source,
            target_tp=params.target_tp, target_format=job["output_format"], version=job["version"],
            quantized=params.quantize, conversion_id=job["conversion_id"], warnings=job["warnings"],
            flow_run_id=str(flow_run.id), steps=len(steps), reused=reused,
            resumed={} if job["up_to_date"] else resumed,
            converted_on={c["name"]: c.get("worker") for c in converted})
    finally:
        work.close()


def _raise_first_failure(futures: list[Any], *, wait_all: bool = True) -> None:
    """Wait for ``futures`` (all of them, or each in turn) and re-raise the first failed one's
    own exception, in the order given."""
    if wait_all:
        wait(futures)
    for fut in futures:
        fut.wait()
        state = fut.state
        if state.is_failed() or state.is_crashed():
            fut.result()  # raises the task's exception


def _resumed(converts: dict[str, Any], uploads: dict[str, Any], streams: bool) -> dict[str, str]:
    """Each output an earlier run of this conversion to this destination had made, served from
    its cached step instead of made again: "staged" (published at the destination: an upload's
    record, or a conversion that publishes what it writes) or "converted" (its file waited in the
    work folder, and was published now). Per-shard steps served from the cache (shared by every
    conversion of the same source) do not make a run a resume."""
    out = {}
    for name in converts:
        if uploads[name].state.name == "Cached" or (streams and converts[name].state.name == "Cached"):
            out[name] = "staged"
        elif converts[name].state.name == "Cached":
            out[name] = "converted"
    return out


def _identity(obj: dict[str, Any]) -> str:
    return RemoteObject(**obj).identity


def _gpu_annotation(enabled: bool) -> Any:
    """Dask resource annotation for tensor tasks (workers must declare ``GPU``), else a no-op."""
    if not enabled:
        return contextlib.nullcontext()
    import dask

    return dask.annotate(resources={"GPU": 1})
