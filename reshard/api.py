"""reshard as a Python library: :func:`convert`, :func:`plan`, :func:`inspect`, :func:`verify`.

What the CLI's ``run --direct``, ``plan``, ``inspect`` and ``verify`` do, for a training script's
post-save hook, a notebook or a user's own pipeline. The options are the CLI's flags as keyword
arguments (``target_tp=2``, ``to="hf"``; :class:`~reshard.core.options.ReshardOptions` lists them),
validated once, by the same model; every expected failure raises a
:class:`~reshard.core.errors.ReshardError` subclass whose ``str()`` is the CLI's error line
(``culprit``, ``message``, ``fix`` as attributes). Nothing here touches logging, the environment
or signals, and nothing is started on import: the engine loads on the first call.

``convert`` runs the in-process engine (no Prefect). For retries, caching and resume in a
pipeline, run the Prefect flow (:func:`reshard.flows.reshard_flow.reshard_flow`) as a subflow.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.result import ConversionResult


@dataclass(frozen=True)
class Progress:
    """Where a conversion stands, given to ``convert(progress=...)`` after every step.

    ``total_bytes`` is the plan's estimate of every output (exact once each is ``files_done``)."""

    done_bytes: int
    total_bytes: int
    files_done: int
    files: int
    file: str | None  #: the output file this step was about
    finished: bool  #: this step finished ``file``


def convert(src: str, dst: str, *, overwrite: bool = False, device: str | None = None,
            storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
            target_config: Mapping[str, Any] | str | None = None, cache_sources: bool = False,
            progress: Callable[[Progress], None] | bool | None = None, **options: Any) -> ConversionResult:
    """Convert the checkpoint at ``src`` into ``dst`` (paths or fsspec URLs) in this process and
    commit it atomically, or raise and commit nothing.

    ``options``: the conversion, as the CLI's flags (``target_tp``, ``target_pp``, ``target_ep``,
    ``to``, ``weights``, ``quantize``, ``max_shard_size``, model facts such as ``num_heads``).
    ``target_config``: the loading job's DeepSpeed config (a dict or a JSON file), checked before
    any byte moves. ``progress``: a callable given a :class:`Progress` after every step, or True
    for the CLI's display on stderr. A destination that already holds this exact conversion is
    left as it is (``result.up_to_date``)."""
    from reshard.cli_progress import ProgressDisplay
    from reshard.direct import run_direct
    from reshard.storage.cache import ShardCache

    opts = checked_options("convert", options)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"convert() takes progress=True (the CLI's display on stderr), a callable given "
                        f"reshard.Progress records, or None; got {progress!r}")
    config = load_target_config(target_config)
    shown: Any = contextlib.nullcontext()
    if progress is True:
        shown = ProgressDisplay(status="reading the source")
    elif callable(progress):
        shown = _ProgressAdapter(progress)
    with shown:
        report = run_direct(src, dst, opts, overwrite=overwrite, device=device, storage_options=storage_options,
                            cache=ShardCache(cache_dir) if cache_dir else None, target_config=config,
                            cache_sources=cache_sources)
    return ConversionResult.from_manifest(report.manifest, report.destination, up_to_date=report.up_to_date,
                                          seconds=round(report.seconds, 3))


def plan(src: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
         **options: Any) -> dict[str, Any]:
    """What converting ``src`` under ``options`` would do, reading no tensor bytes: every output
    file with the source ranks it reads and the bytes read and written, the peak-memory
    estimate, the model facts and where each came from, warnings. Refusals raise as ``convert``
    would."""
    from reshard.execution.planner import build_plan

    opts = checked_options("plan", options)
    with local_view(src, storage_options, cache_dir, opts) as path:
        return plan_record(build_plan(path, opts))


def inspect(src: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
            module_key: str = "auto", version: float | None = None) -> dict[str, Any]:
    """Describe the checkpoint at ``src``: its format and the architecture it names, degrees (TP,
    PP, virtual stages, EP), its pipeline's layers per model chunk, the dtypes and quantization it
    stores, parameter count, bytes, the model (facts, and what its family tells of it:
    ``ModelFamily.summary``), files, the files a conversion copies unchanged (``carried``:
    its tokenizer), what converting it drops (``warnings``), and the ZeRO optimizer state beside
    it. ``version`` and ``module_key`` are None for a layout that records neither (a Hugging Face
    folder)."""
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import dropped_warning
    from reshard.execution.planner import build_plan
    from reshard.formats import get_format, locate
    from reshard.models import resolve_family
    from reshard.models.megatron_gpt import experts_per_layer

    with local_view(src, storage_options, cache_dir, ReshardOptions()) as path:
        source = locate(path)
        built = build_plan(source, ReshardOptions.checked(target_tp=source.tp, version=version, module_key=module_key,
                                                          to=get_format(source.format).inspected_as(source)))
        total_bytes = sum(f.stat().st_size for f in source.distinct_files)
        fmt = get_format(built.source.format)
        stored = fmt.stored(built.source)
        quantization = stored.get("quantization") or fmt.quantization(built.source)
        args = fmt.opened(built.source, built.options, 0).get("args")
        carried = sorted(fmt.carried(built.source))
    keys = [p.key for p in built.params]
    dtypes = stored.get("dtypes") or sorted({str(p.dtype).replace("torch.", "") for p in built.params})
    n_params = sum(_numel(p.shape) * (built.degrees.of(p.rule)[0] if p.spec is not None else 1) for p in built.params)
    zero = (built.ds_config or {}).get("zero_optimization")
    experts = max(experts_per_layer(keys, src).values(), default=0)
    family, _ = resolve_family(keys, src)
    return {"format": built.source.format, "source": src, "architecture": stored.get("architecture"),
            "family": family.name, "tp": source.tp, "pp": built.source_pp, "vpp": built.source.chunks,
            "stages": built.source_stages.describe() if built.source_stages is not None else None,
            "ep": built.source.ep, "etp": built.source.expert_tp, "experts": experts,
            "dtypes": dtypes, "quantization": quantization, "parameters": n_params, "tensors": len(built.params),
            "bytes": total_bytes, "version": built.version if fmt.state_dicts else None,
            "module_key": built.module_key if fmt.state_dicts else None,
            "num_heads": built.facts.heads, "hidden": built.facts.hidden,
            **family.summary(args, built.facts, experts),
            "zero_stage": zero.get("stage") if isinstance(zero, dict) else None,
            "skipped": sorted(built.dropped), "optimizer": _optimizer(source), "facts": built.facts.to_record(),
            # what a conversion would drop is ``skipped``; said once, not again as a warning
            "warnings": [w for w in built.warnings if w not in dropped_warning(built.dropped)],
            "carried": carried, "files": list(source.relative_distinct_files)}


def verify(dst: str, *, storage_options: Mapping[str, Any] | None = None) -> ConversionResult:
    """Re-hash every file of the committed output at ``dst`` against its manifest; its record
    when all match, else :class:`~reshard.core.errors.ManifestMismatchError` naming the file."""
    from reshard.discovery import check_source_exists
    from reshard.storage.location import open_location
    from reshard.storage.manifest import verify as verify_manifest

    check_source_exists(open_location(dst, dict(storage_options or {})))  # a wrong path is no missing manifest
    manifest = verify_manifest(dst, dict(storage_options or {}))
    return ConversionResult.from_manifest(manifest, dst, up_to_date=True)


# --- shared with the CLI ------------------------------------------------------------------------

def checked_options(function: str, options: Mapping[str, Any]) -> Any:
    """The :class:`~reshard.core.options.ReshardOptions` of ``function``'s keyword arguments. A
    keyword that is no option is Python's :class:`TypeError` for an unexpected keyword argument,
    with the option it was most likely meant to be."""
    import difflib

    from reshard.core.errors import LayoutError
    from reshard.core.options import ReshardOptions, in_keywords

    for name in options:
        if name not in ReshardOptions.model_fields:
            near = difflib.get_close_matches(name, list(ReshardOptions.model_fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}{hint} (the options are "
                            f"ReshardOptions' fields: {', '.join(ReshardOptions.model_fields)})")
    try:
        return ReshardOptions.checked(**options)
    except LayoutError as err:  # worded for the CLI's flags: named as this function's keywords
        raise in_keywords(err) from None


def load_target_config(config: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """A DeepSpeed config given as a dict, or as the path of its JSON file (validated)."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    from reshard.core.errors import ConfigError
    from reshard.core.zero_config import load_deepspeed_config_text

    try:
        text = Path(config).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", culprit=str(config)) from None
    return load_deepspeed_config_text(text, str(config))


@contextlib.contextmanager
def local_view(src: str, storage_options: Mapping[str, Any] | None, cache_dir: str | None,
               options: Any) -> Iterator[str]:
    """The source as a local path: a remote one as skeletons read range by range (what a
    conversion under ``options`` would fetch; planning reads the structure and a few small
    tensors, not the checkpoint), through the shard cache."""
    from reshard.conversion import streams_sources
    from reshard.core import remote
    from reshard.discovery import check_source_exists, materialize
    from reshard.storage.cache import ShardCache
    from reshard.storage.location import open_location

    so = dict(storage_options or {})
    loc = open_location(src, so)
    if loc.is_local:
        check_source_exists(loc)
        yield str(loc.path)
        return
    cache = ShardCache(cache_dir) if cache_dir else ShardCache()
    work = cache.new_workdir("inspect")
    try:
        yield str(materialize(src, so, cache, work, stream=streams_sources(options, False)).path)
    finally:
        remote.detach(work)
        shutil.rmtree(work, ignore_errors=True)


def plan_record(built: Any) -> dict[str, Any]:
    """JSON-able description of a plan (``plan``'s result, the CLI's ``plan --json``)."""
    from reshard.formats import get_format

    source_quant = get_format(built.source.format).quantization(built.source)
    return {
        "source": built.source.origin, "layout": built.source.format, "source_format": built.source.format,
        "target_format": built.output_format, "source_tp": built.source_tp,
        "target_tp": built.target_tp if get_format(built.output_format).per_rank else None,
        "source_pp": built.source_pp, "target_pp": built.target_pp,
        "source_ep": built.source.ep, "target_ep": built.target_ep, "source_etp": built.source.expert_tp,
        "target_etp": built.target_etp, "source_quantized": (source_quant or {}).get("method"),
        "quantized": built.options.quantize,
        "source_vpp": built.source.chunks, "target_vpp": built.target_vpp,
        "source_stages": built.source_stages.describe() if built.source_stages is not None else None,
        "target_stages": built.target_stages.describe() if built.target_stages is not None else None,
        "version": built.version, "module_key": built.module_key, "num_heads": built.facts.heads,
        "hidden": built.facts.hidden,
        "output_format": built.output_format,
        "targets": [{"rank": t.rank, "name": t.name, "sources": list(t.sources), "bytes_read": t.bytes_read,
                     "bytes_written": t.bytes_written} for t in built.targets],
        "bytes_read": sum(f.stat().st_size for f in built.source.distinct_files),
        "bytes_written": sum(t.bytes_written for t in built.targets),
        "peak_memory_estimate": built.peak_memory_estimate,
        "facts": built.facts.to_record(),
        "rules": {p.key: p.rule.name for p in built.params},
        "unused_rules": list(built.unused_rules),
        "dropped": dict(built.dropped),
        "warnings": list(built.warnings),
    }


def _optimizer(source: Any) -> dict[str, Any] | None:
    """The ZeRO optimizer state beside the checkpoint's files, if its format reads any (a remote
    source's optimizer files are not fetched to inspect it: None)."""
    from reshard.core.zero_master import optimizer_summary
    from reshard.formats import get_format

    return optimizer_summary(get_format(source.format).companions(source, frozenset({"master"})))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _ProgressAdapter:
    """reshard's progress events, for the duration of a ``with`` block, as :class:`Progress`
    records given to a user's callable."""

    def __init__(self, fn: Callable[[Progress], None]) -> None:
        self.fn = fn
        self.planned: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.finished: set[str] = set()
        self._unsubscribe: Callable[[], None] = lambda: None

    def __enter__(self) -> _ProgressAdapter:
        import reshard.progress as progress

        self._unsubscribe = progress.subscribe(self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._unsubscribe()

    def handle(self, event: dict[str, Any]) -> None:
        import reshard.progress as progress

        kind, name = event.get("event"), event.get("name")
        if kind == progress.PLANNED:
            self.planned = {t["name"]: int(t["bytes"]) for t in event["targets"]}
        elif kind == progress.BYTES:
            self.written[name] = int(event["done"])
        elif kind == progress.TARGET_DONE:
            self.written[name] = self.planned[name] = int(event["size"])
            self.finished.add(name)
        else:
            return
        self.fn(Progress(done_bytes=sum(self.written.values()), total_bytes=sum(self.planned.values()),
                         files_done=len(self.finished), files=len(self.planned), file=name,
                         finished=kind == progress.TARGET_DONE))
