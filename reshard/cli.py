"""The ``reshard`` command line (the Python API is :mod:`reshard.api`).

Every expected failure is a :class:`~reshard.core.errors.ReshardError`: printed as one line
naming the file/key and the fix, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reshard.cli_progress import fmt_bytes
from reshard.core.errors import ReshardError
from reshard.version import __version__

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions

#: ``run --help`` in this order: the common groups first.
GROUPS = {"layout": "target layout", "output": "output", "execution": "execution", "storage": "storage",
          "quantization": "quantization (int8 per-rank, fp8, mxfp4, w4a16, fp8-channel, nvfp4 or like-source "
                          "with --to hf)",
          "model facts": "model facts (only when the checkpoint's saved args lack them)"}
#: The group of each :class:`~reshard.core.options.ReshardOptions` field (the CLI's own flags are
#: placed where they are added).
OPTION_GROUPS = {"target_tp": "layout", "target_pp": "layout", "target_vpp": "layout",
                 "target_first_stage_layers": "layout", "target_last_stage_layers": "layout",
                 "target_pipeline_layout": "layout", "target_ep": "layout", "target_etp": "layout",
                 "to": "output", "merge_adapter": "output", "hf_architecture": "output", "max_shard_size": "output",
                 "weights": "output",
                 "quantize": "quantization", "quantize_like": "quantization", "fp8_block": "quantization",
                 "group_size": "quantization",
                 "bits": "quantization", "groups": "quantization", "mlp_extra_grouping": "quantization",
                 "version": "model facts", "module_key": "model facts",
                 "num_heads": "model facts", "num_query_groups": "model facts", "swiglu": "model facts",
                 "vocab_size": "model facts", "make_vocab_size_divisible_by": "model facts",
                 "hf_model_config": "model facts", "normalization": "model facts",
                 "position_embedding_type": "model facts", "rotary_base": "model facts", "norm_epsilon": "model facts"}

SRC_HELP = ("the checkpoint: a Megatron-LM run or iteration folder (per-rank files or torch_dist), a folder of "
            "DeepSpeed mp_rank_XX files or its descriptor JSON, a DeepSpeed pipeline folder, a ZeRO checkpoint "
            "folder, or a Hugging Face folder (config.json + safetensors); a path or any fsspec URL "
            "(s3://, gs://, az://, memory://, ...)")
DST_HELP = "the output folder, a path or URL as SRC; must not hold a committed checkpoint (see --overwrite)"


def _groups(p: argparse.ArgumentParser) -> dict[str, Any]:
    return {key: p.add_argument_group(title) for key, title in GROUPS.items()}


def _add_layout_options(groups: dict[str, Any], *, target_required: bool) -> None:
    """One flag per :class:`~reshard.core.options.ReshardOptions` field, made from the field (name,
    type, default, help) into its group: the options are defined once, for the CLI, the Python API,
    the flow and the core."""
    import typing

    from reshard.core.options import ReshardOptions, flag_of

    for name in sorted(ReshardOptions.model_fields, key=lambda n: list(OPTION_GROUPS).index(n)):
        field = ReshardOptions.model_fields[name]
        p = groups[OPTION_GROUPS[name]]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        types = [t for t in typing.get_args(field.annotation) if t is not type(None)] or [field.annotation]
        if types[0] is bool:
            if field.default is not True:  # --flag sets True (None or False otherwise)
                p.add_argument(flag_of(name), dest=name, action="store_true", default=field.default,
                               help=field.description)
            if "negative_flag" in extra:
                p.add_argument(str(extra["negative_flag"]), dest=name, action="store_false",
                               help=str(extra["negative_help"]))
            continue
        kind = types[0] if types[0] in (int, float, str) else str  # a file's contents: its path here
        alone = {"nargs": "?", "const": extra["alone"]} if "alone" in extra else {}  # the flag without a value
        p.add_argument(flag_of(name), dest=name, type=kind, metavar=extra.get("metavar"), **alone,
                       default=None if field.is_required() else field.default, help=field.description,
                       required=field.is_required() and target_required)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, with ``--to``'s choices read from the format registry when help is shown (a
    plug-in's format appears; nothing is imported to parse a command)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if action.dest == "to" and text:
            from reshard.formats import writable

            text += f"; one of: {', '.join(writable())}"
        return text


def _add_storage_options(p: Any) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000, "
                        "key=..., secret=...; credentials otherwise come from the environment/profiles")
    p.add_argument("--cache-dir", default=None,
                   help="shard cache for remote sources (default $RESHARD_CACHE_DIR or ~/.cache/reshard)")


DESCRIPTION = ("Change the parallel layout (tensor, pipeline, expert) and the format of Megatron-LM, megatron-core, "
               "DeepSpeed and Hugging Face checkpoints: exactly, in bounded memory, from and to local folders or "
               "object storage. Run 'reshard COMMAND --help' for a command's options.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", "-V", action="version", version=f"reshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="convert SRC into DST at a new layout or in another format",
                       description="Convert SRC into DST at a new layout or in another format; the output is "
                                   "committed atomically with a manifest, or nothing is.",
                       formatter_class=_HelpFormatter)
    p.add_argument("src", help=SRC_HELP)
    p.add_argument("dst", help=DST_HELP)
    g = _groups(p)
    _add_layout_options(g, target_required=True)
    g["output"].add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    g["output"].add_argument("--target-config", default=None, metavar="FILE",
                             help="DeepSpeed config of the job that will load the output; validated before any "
                                  "transfer")
    g["execution"].add_argument("--direct", action="store_true",
                                help="run the engine in-process without Prefect (no retries, caching or UI)")
    g["execution"].add_argument("--device", default=None,
                                help="torch device for tensor work (default: cuda if present, else cpu)")
    g["execution"].add_argument("--dask-address", default=None, metavar="tcp://HOST:PORT",
                                help="run tensor tasks on this Dask scheduler (default: threads in this process)")
    g["execution"].add_argument("--dask-workers", type=int, default=None, metavar="N",
                                help="run tensor tasks on a local Dask cluster of N workers")
    g["execution"].add_argument("--json", action="store_true", help="print the summary as JSON")
    g["execution"].add_argument("--verbose", "-v", action="store_true", help="show Prefect's task logs on the console")
    _add_storage_options(g["storage"])
    g["storage"].add_argument("--cache-sources", action="store_true",
                              help="fetch a remote source's shards whole into the shard cache first (default: read "
                                   "them range by range while converting; only their structure is cached)")

    p = sub.add_parser("plan", help="dry run: which source ranks feed which output file, bytes, memory",
                       formatter_class=_HelpFormatter)
    p.add_argument("src", help=SRC_HELP)
    g = _groups(p)
    _add_layout_options(g, target_required=True)
    g["execution"].add_argument("--json", action="store_true", help="print the plan as JSON")
    g["execution"].add_argument("--verbose", "-v", action="store_true",
                                help="also list the model family's rules that matched no tensor")
    _add_storage_options(g["storage"])

    p = sub.add_parser("inspect", help="describe a checkpoint: format, version, TP, dtype, sizes")
    p.add_argument("src", help=SRC_HELP)
    p.add_argument("--module-key", default="auto", metavar="KEY",
                   help="state-dict entry holding the module ('auto': exactly one of module/model)")
    p.add_argument("--version", type=float, default=None, metavar="V",
                   help="override the checkpoint version that decides the QKV layout (0, 1.0, 2.0, 3.0)")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    _add_storage_options(p)

    p = sub.add_parser("verify", help="re-hash a committed output against its manifest")
    p.add_argument("dst", help="a committed output (path or URL)")
    _add_storage_options(p)

    sub.add_parser("formats", help="list the checkpoint formats and model families reshard reads and writes "
                                   "(plug-ins included)")

    p = sub.add_parser("validate-config", help="validate a DeepSpeed config's zero_optimization section")
    p.add_argument("file", help="the DeepSpeed config (JSON)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("sample", help="write a small sample legacy-GPT checkpoint (for demos and tests)",
                       description="Write a small legacy Megatron GPT checkpoint as DeepSpeed saves it "
                                   "(mp_rank_XX_model_states.pt files with random weights), to try reshard on.")
    p.add_argument("dst", help="the folder to write (created)")
    p.add_argument("--tp", type=int, default=8, metavar="N", help="tensor-parallel ranks (default 8)")
    p.add_argument("--version", type=float, default=2.0, metavar="V",
                   help="checkpoint version, which decides the QKV layout: 0, 1.0, 2.0 or 3.0 (default 2.0)")
    p.add_argument("--layers", type=int, default=2, metavar="L", help="transformer layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, metavar="H", help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=8, metavar="A", help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=None, metavar="V", help="vocabulary rows (default 128; 256 with --hf)")
    p.add_argument("--hf", action="store_true",
                   help="write a Hugging Face folder instead: a small MixtralForCausalLM (4 experts, top 2, bf16 "
                        "safetensors); --tp and --version do not apply")

    p = sub.add_parser("deploy",
                       help="register the Prefect deployments of deployments/prefect.yaml (prefect deploy)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these deployments (8to2 or reshard/8to2); default all")
    p.add_argument("--file", default=None,
                   help="prefect.yaml to use (default: the repository's deployments/prefect.yaml)")
    p.add_argument("--no-create-pool", dest="create_pool", action="store_false",
                   help="do not create missing work pools (type process)")

    p = sub.add_parser("serve", help="serve the deployments of deployments/prefect.yaml from this process (no worker)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these deployments; default all")
    p.add_argument("--file", default=None,
                   help="prefect.yaml to use (default: the repository's deployments/prefect.yaml)")
    p.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: Prefect's)")

    p = sub.add_parser("emit-training-completed",
                       help="emit the reshard.training.completed event that fires the conversion deployments")
    p.add_argument("url", help="the finished checkpoint (folder or descriptor URL)")
    p.add_argument("--tp", type=int, required=True, help="its tensor-parallel degree")
    p.add_argument("--step", type=int, default=None, help="its training step")
    p.add_argument("--target", dest="targets", action="append", default=None, metavar="M|FORMAT",
                   help="convert only to this TP, or only to this output format (hf) (repeatable; default: every "
                        "deployment for --tp)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the event to be sent")
    return parser


def parsed_options(ns: argparse.Namespace, target_tp: int | None) -> ReshardOptions:
    """The conversion options the parsed flags ``ns`` give (checked: a bad value is the flag's one
    error line), at the target TP ``target_tp``."""
    from reshard.core.options import ReshardOptions

    return ReshardOptions.from_fields({**vars(ns), "target_tp": target_tp})


def _storage(ns: argparse.Namespace) -> dict[str, Any]:
    from reshard.storage.location import parse_storage_options

    return parse_storage_options(ns.storage_option)


def _cache(ns: argparse.Namespace) -> Any:
    from reshard.storage.cache import ShardCache

    return ShardCache(ns.cache_dir) if ns.cache_dir else None


def _target_config(path: str | None) -> dict[str, Any] | None:
    from reshard.api import load_target_config

    return load_target_config(path)


def cmd_run(ns: argparse.Namespace) -> int:

    from reshard.cli_progress import ProgressDisplay

    display = ProgressDisplay(live=False if ns.json else None, status="reading the source")
    if ns.json:  # machine-readable: stdout holds the summary, stderr nothing but an error
        display = contextlib.nullcontext()  # type: ignore[assignment]
    if ns.to in ("hf-peft", "megatron-peft"):  # an adapter: no model to plan (reshard.adapters)
        return _run_adapter(ns)
    with display:
        summary = _run_direct(ns) if ns.direct else _run_with_prefect(ns)
    if ns.json:
        print(json.dumps(summary, indent=2))
        return 0
    from reshard.result import ConversionResult

    head = f"{summary['destination']}: {ConversionResult.model_validate(summary).summary}"
    steps, reused = summary.get("steps"), summary.get("reused", 0)
    if summary["up_to_date"]:
        how = (f"; {reused} of {steps} steps served from Prefect's cache" if steps else "")
        print(f"up to date {head} (already holds this exact conversion: nothing written{how})")
    else:
        resumed = _resumed_note(summary)
        took = f", {summary['seconds']:.2f}s" if summary.get("seconds") is not None else ""
        print(f"committed {head}{took}{resumed}")
    for w in [] if summary["up_to_date"] else summary["warnings"]:  # told when it was converted
        print(f"warning: {w}")
    return 0


def _run_adapter(ns: argparse.Namespace) -> int:
    """``--to hf-peft``: a LoRA adapter checkpoint written as a Hugging Face PEFT adapter;
    ``--to megatron-peft``: a Hugging Face PEFT adapter written as Megatron-Bridge's PEFT checkpoint
    (at ``--target-tp``, the base described by ``--model-config`` where the adapter's folder does not
    name a local one). Local folders only (an adapter is small: no streaming from or to object storage)."""
    from reshard.adapters import export_hf_peft, export_megatron_peft
    from reshard.core.errors import DestinationError, LayoutError
    from reshard.core.options import ReshardOptions, flag_of

    fields = ReshardOptions.model_fields
    takes = ("to", "target_tp", "hf_model_config") if ns.to == "megatron-peft" else ("to",)
    given = [flag_of(k) for k, v in _option_fields(ns).items() if k not in takes and v != fields[k].default]
    if given:  # an adapter is written as it is: nothing else of a model's layout applies
        raise LayoutError(f"{', '.join(given)} do(es) not apply to an adapter", culprit=f"--to {ns.to}",
                          hint="drop them; --merge-adapter merges into a base's conversion (--to hf)")
    for flag, url in (("SRC", ns.src), ("DST", ns.dst)):
        if "://" in url:
            raise DestinationError(f"{flag} is a URL; --to {ns.to} reads and writes local folders", culprit=url,
                                   hint="copy the adapter to a local folder first")
    if ns.to == "hf-peft":
        summary = export_hf_peft(ns.src, ns.dst, overwrite=ns.overwrite)
        what = f"Hugging Face PEFT adapter for {summary['architecture']}"
    else:
        options = parsed_options(ns, ns.target_tp)
        summary = export_megatron_peft(ns.src, ns.dst, target_tp=options.target_tp,
                                       model_config=options.hf_model_config, overwrite=ns.overwrite)
        what = f"Megatron-Bridge PEFT checkpoint at TP {summary['tp']} ({', '.join(summary['target_modules'])})"
    if ns.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"committed {summary['destination']}: {what} (r {summary['r']}, alpha {summary['lora_alpha']:g}, "
              f"{summary['tensors']} tensors, {', '.join(summary['dtypes'])})")
    return 0


def _checked_flags(ns: argparse.Namespace) -> None:
    """Refuse a bad option naming its flag (the API, which the CLI calls, names keywords)."""
    from reshard.core.options import ReshardOptions

    ReshardOptions.checked(**_option_fields(ns))


def _resumed_note(summary: dict[str, Any]) -> str:
    """What an earlier, interrupted run of this conversion had made that this one reused, and
    where it lay (a flow run's ``resumed``); nothing for a run that made every output itself."""
    resumed = summary.get("resumed") or {}
    if not resumed:
        return ""
    where = {"staged": "staged at the destination", "converted": "converted in the shard cache's work folder"}
    parts = [f"{n} {text}" for kind, text in where.items() if (n := list(resumed.values()).count(kind))]
    outputs = len(summary.get("converted_on") or resumed)
    return (f" (resumed an interrupted run of this conversion: {len(resumed)} of {outputs} outputs reused as it "
            f"left them, {' and '.join(parts)})")


def _run_direct(ns: argparse.Namespace) -> dict[str, Any]:
    from reshard.api import convert

    _checked_flags(ns)
    result = convert(ns.src, ns.dst, overwrite=ns.overwrite, device=ns.device, storage_options=_storage(ns),
                     cache_dir=ns.cache_dir, target_config=ns.target_config, cache_sources=ns.cache_sources,
                     **_option_fields(ns))
    return result.model_dump(exclude={"manifest"})


def _option_fields(ns: argparse.Namespace) -> dict[str, Any]:
    from reshard.core.options import ReshardOptions

    return {k: v for k, v in vars(ns).items() if k in ReshardOptions.model_fields}


def _credentials_to_env(options: dict[str, Any]) -> dict[str, Any]:
    """Move S3 key/secret given on the command line into this process's environment, where
    botocore finds them, so they never become Prefect flow parameters (stored and shown in the
    UI). Tasks run in this process (threads) or its local Dask cluster, which see the variables."""
    import os

    opts = dict(options)
    if "secret" in opts:
        os.environ["AWS_SECRET_ACCESS_KEY"] = str(opts.pop("secret"))
        if "key" in opts:
            os.environ["AWS_ACCESS_KEY_ID"] = str(opts.pop("key"))
    if "token" in opts:
        os.environ["AWS_SESSION_TOKEN"] = str(opts.pop("token"))
    return opts


def _run_with_prefect(ns: argparse.Namespace) -> dict[str, Any]:
    """The flow, with every input error it could meet refused first, in this process
    (:func:`reshard.direct.preflight`: at ``--direct``'s speed, before any server starts), and a
    destination that holds this conversion already told so at once: no flow runs for either.
    Only then is the embedded server spawned: it boots while the flow imports."""
    import os

    params = _flow_params(ns)
    committed = _preflight(params)
    if committed is not None:
        from reshard.result import ConversionResult
        from reshard.storage.cache import ShardCache

        ShardCache(ns.cache_dir).finish_work(committed["conversion_id"])  # what an earlier run may have left
        return ConversionResult.from_manifest(committed, ns.dst, up_to_date=True).model_dump(exclude={"manifest"})
    import reshard.progress as progress
    from reshard.flows.server import prefect_environment
    from reshard.storage.cache import ShardCache

    prefect_environment(ShardCache(ns.cache_dir).root)  # this process is the CLI's: its defaults
    server = None
    if os.environ.get("PREFECT_API_URL"):
        progress.status(f"connecting to Prefect at {os.environ['PREFECT_API_URL']}")
    else:
        from reshard.flows.server import start_embedded

        server = start_embedded(ShardCache(ns.cache_dir).root)
        if server.creates_database:
            progress.status("creating Prefect's database (first run only)")
            if not ns.json:
                print(f"reshard: first run: creating Prefect's database {server.database_path} (once; this takes "
                      f"a while)", file=sys.stderr, flush=True)
        else:
            progress.status("starting Prefect's embedded server")
    try:
        return _run_flow(ns, params, server)
    finally:
        if server is not None:
            server.stop()  # run_flow stops it once settled; here only when it never got there


def _flow_params(ns: argparse.Namespace) -> Any:
    """The flow's parameters from the command line (credentials moved to the environment first)."""
    from pydantic import ValidationError

    from reshard.core.options import option_error
    from reshard.flows.params import ReshardParams

    storage_options = _credentials_to_env(_storage(ns))
    try:
        return ReshardParams(source=ns.src, destination=ns.dst, **parsed_options(ns, ns.target_tp).to_record(),
                             storage_options=storage_options, overwrite=ns.overwrite, device=ns.device,
                             target_config=_target_config(ns.target_config), cache_dir=ns.cache_dir,
                             cache_sources=ns.cache_sources)
    except ValidationError as exc:
        raise option_error(exc) from None


def _preflight(params: Any) -> dict[str, Any] | None:
    from reshard.direct import preflight
    from reshard.storage.cache import ShardCache

    return preflight(params.source, params.destination, params.options(), overwrite=params.overwrite,
                     storage_options=params.storage_options, cache=ShardCache(params.cache_dir),
                     target_config=params.target_config, cache_sources=params.cache_sources)


def _run_flow(ns: argparse.Namespace, params: Any, server: Any) -> dict[str, Any]:
    from reshard.flows.runner import run_flow

    summary = run_flow(params, dask_address=ns.dask_address, dask_workers=ns.dask_workers,
                       console_level="INFO" if ns.verbose else "WARNING", server=server)
    summary.pop("manifest", None)
    return summary


def cmd_plan(ns: argparse.Namespace) -> int:
    from reshard.api import plan

    _checked_flags(ns)
    rec = plan(ns.src, storage_options=_storage(ns), cache_dir=ns.cache_dir, **_option_fields(ns))
    if ns.json:
        print(json.dumps(rec, indent=2))
        return 0
    from reshard.formats import get_format
    from reshard.result import conversion_head

    recorded = rec["version"] is not None and get_format(rec["source_format"]).state_dicts  # not a Hugging Face folder
    version = f" (checkpoint version {rec['version']})" if recorded else ""
    print(f"{ns.src}: {conversion_head(rec)}{version}")
    if rec["source_stages"] and (rec["source_pp"] > 1 or rec["target_pp"] > 1):
        print(f"  stages: {rec['source_stages']} -> {rec['target_stages']}")
    for t in rec["targets"]:
        print(f"  {t['name']}: reads source ranks {t['sources']} "
              f"({fmt_bytes(t['bytes_read'])}), writes ~{fmt_bytes(t['bytes_written'])}")
    print(f"total read {fmt_bytes(rec['bytes_read'])}, written ~{fmt_bytes(rec['bytes_written'])}, "
          f"peak memory ~{fmt_bytes(rec['peak_memory_estimate'])}")
    if rec["unused_rules"] and ns.verbose:  # normal (e.g. no final_linear in GPT): a detail, not news
        print(f"rules that matched nothing: {', '.join(rec['unused_rules'])}")
    for w in rec["warnings"]:
        print(f"warning: {w}")
    return 0


def cmd_inspect(ns: argparse.Namespace) -> int:
    from reshard.api import inspect

    rec = inspect(ns.src, storage_options=_storage(ns), cache_dir=ns.cache_dir, module_key=ns.module_key,
                  version=ns.version)
    if ns.json:
        print(json.dumps(rec, indent=2))
    else:
        print("\n".join(_inspect_lines(rec)))
    return 0


def _inspect_lines(rec: dict[str, Any]) -> list[str]:
    """``inspect``'s record as the lines ``reshard inspect`` prints: one ``name value`` line per
    fact it has (none for what the checkpoint does not record), sizes in binary units, the model's
    facts indented, what a conversion drops last."""
    from reshard.formats import get_format

    lines: list[str] = []
    for k, v in rec.items():
        if v is None or k in ("files", "warnings"):
            continue
        if k == "format":
            title = get_format(v).title
            lines.append(f"{k:12} {v}" + (f" ({title})" if title else ""))
        elif k == "bytes":
            lines.append(f"{'size':12} {fmt_bytes(v)} in {len(rec['files'])} files")
        elif k == "dtypes":
            lines.append(f"{k:12} {', '.join(v)}")
        elif k == "quantization":
            scales = f", {v['scales']} per {v['block'][0]} x {v['block'][1]} block" if "block" in v else ""
            held = f", {v['tensors']} tensors:" if "tensors" in v else ""
            lines.append(f"{k:12} {v['method']} {v.get('format', '')}".rstrip() + scales + held)
            lines += [f"  {name}" for name in v.get("names", [])]
        elif k == "facts":
            lines.append("facts")
            origin = v.get("origin", {})
            for fk, fv in {**{n: x for n, x in v.items() if n != "family_facts"}, **v.get("family_facts", {})}.items():
                if fk != "origin" and fv is not None:
                    lines.append(f"  {fk:28} {fv}" + (f"  (from {origin[fk]})" if fk in origin else ""))
        elif k == "optimizer":
            stage = "BF16_Optimizer" if v["zero_stage"] == 0 else f"ZeRO stage {v['zero_stage']}"
            lines.append(f"{k:12} {stage}, {v['dp']} data-parallel ranks, {v['groups']} parameter groups, "
                         f"{v['master_elements']} {v['master_dtype']} master weights per TP rank (step {v['step']}; "
                         "convert them with --weights master, or --to universal)")
        elif isinstance(v, dict):  # what the family tells of the model (ModelFamily.summary): name value, ...
            lines.append(f"{k:12} " + ", ".join(f"{name} {value}" for name, value in v.items()))
        elif k == "skipped":
            if v:
                lines.append(f"{k:12} {', '.join(v)} (training state of the old layout: a conversion drops it)")
        elif k == "carried":
            if v:
                lines.append(f"{k:12} {', '.join(v)} (a conversion copies them unchanged)")
        elif k in ("ep", "etp", "experts") and not rec["experts"]:
            continue  # a dense model: no expert axis to show
        elif k in ("vpp", "stages") and rec["pp"] == 1:
            continue  # no pipeline: no stages to show
        else:
            lines.append(f"{k:12} {v}")
    return lines + [f"warning: {w}" for w in rec.get("warnings", [])]


def cmd_verify(ns: argparse.Namespace) -> int:
    from reshard.api import verify

    result = verify(ns.dst, storage_options=_storage(ns))
    print(f"ok: {len(result.files)} files match the manifest of {ns.dst}")
    return 0


def cmd_formats(ns: argparse.Namespace) -> int:
    """The registered formats and model families (built-ins and plug-ins), what each reads and writes."""
    from reshard.formats import available
    from reshard.models.hf_registry import hf_architectures
    from reshard.models.registry import families

    print("Checkpoint formats (reshard run --to NAME writes those marked 'writes'):")
    for fmt in available():
        does = "/".join(w for w, yes in (("reads", fmt.reads), ("writes", fmt.writes)) if yes)
        kind = "per-rank files" if fmt.per_rank else "global tensors"
        print(f"  {fmt.name:26} {does:13} {kind:15} {_first_line(fmt)}")
    print("Model families:")
    for family in families():
        print(f"  {family.name:26} {_first_line(family)}")
        for line in family.describe():
            print(f"  {'':26} {line}")
    names = ", ".join(a.name for a in hf_architectures())
    print(f"Hugging Face architectures (written with --to hf, read from a Hugging Face folder):\n  {names}")
    return 0


def _first_line(obj: Any) -> str:
    """The first sentence of an object's class docstring, on one line, in plain words for a
    terminal (a plug-in's docstring may carry reStructuredText markup)."""
    doc = plain_text(" ".join((type(obj).__doc__ or "").split()))
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


#: A Sphinx cross-reference (``:class:`~pkg.mod.Name```, ``:data:`NAME```), its target in group 2.
_SPHINX_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")


def plain_text(doc: str) -> str:
    """``doc`` without reStructuredText markup: a cross-reference becomes the name it shows (the
    last part of a ``~``-shortened path), literals lose their backquotes."""
    doc = _SPHINX_ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    return doc.replace("``", "").replace("`", "")


def cmd_validate_config(ns: argparse.Namespace) -> int:
    from reshard.core.zero_config import run_validate_config

    return run_validate_config(ns.file, ns.json)


def cmd_sample(ns: argparse.Namespace) -> int:
    from reshard.sample import GPTConfig, MixtralConfig, write_mixtral_sample, write_sample_checkpoint

    if ns.hf:
        mix = MixtralConfig(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, vocab=ns.vocab or MixtralConfig.vocab)
        write_mixtral_sample(ns.dst, mix)
        print(f"wrote a Hugging Face MixtralForCausalLM folder to {ns.dst} ({mix.layers} layers, {mix.experts} "
              f"experts, top {mix.topk})")
        return 0
    cfg = GPTConfig(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, vocab=ns.vocab or GPTConfig.vocab)
    paths = write_sample_checkpoint(ns.dst, tp=ns.tp, cfg=cfg, version=ns.version)
    print(f"wrote {len(paths)} rank files to {ns.dst} (TP {ns.tp}, version {ns.version})")
    return 0


def cmd_deploy(ns: argparse.Namespace) -> int:
    from reshard.deploy import deploy

    return deploy(ns.file, ns.names or None, create_pools=ns.create_pool)


def cmd_serve(ns: argparse.Namespace) -> int:
    import os

    from reshard.flows.server import prefect_environment, server_database
    from reshard.storage.cache import ShardCache

    prefect_environment(ShardCache().root)
    # this process is the command: Prefect's own temporary server (no PREFECT_API_URL) starts from it
    os.environ.update(server_database(ShardCache().root))
    from reshard.deploy import serve

    serve(ns.file, ns.names or None, limit=ns.limit)
    return 0


def cmd_emit_training_completed(ns: argparse.Namespace) -> int:
    from reshard.events import emit_training_completed

    event_id = emit_training_completed(ns.url, ns.tp, ns.step, ns.targets, timeout=ns.timeout)
    print(f"emitted reshard.training.completed for {ns.url} (event {event_id})")
    return 0


#: Exit code for transient failures (sysexits EX_TEMPFAIL): the same command may succeed later.
EX_TEMPFAIL = 75
#: Exit code when the reader of standard output went away (``reshard formats | head -2``): what a
#: shell reports for a Unix tool that SIGPIPE ended, 128 + 13.
EX_PIPE_CLOSED = 141


def stdout_closed(exc: BaseException) -> bool:
    """Whether ``exc`` is this process's standard output losing its reader, not a storage error.

    Both raise :class:`BrokenPipeError`; a pipe whose read end is closed polls as ``POLLERR`` on
    its write end, a socket to S3 is another descriptor."""
    import select

    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's captured stdout)
        return False


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that nothing left in its buffer raises again when the
    interpreter flushes it on the way out."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

COMMANDS = {"run": cmd_run, "plan": cmd_plan, "inspect": cmd_inspect, "verify": cmd_verify, "formats": cmd_formats,
            "validate-config": cmd_validate_config, "sample": cmd_sample}
COMMANDS.update({"deploy": cmd_deploy, "serve": cmd_serve, "emit-training-completed": cmd_emit_training_completed})


def _alone_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each flag that also stands alone (``--quantize``: int8) given its value when the
    next word is none of its own: argparse would take ``SRC`` in ``--quantize SRC DST`` as the
    value. A bare word that is no path is left to be refused as a value (``--quantize fp4``)."""
    from reshard.core.options import ReshardOptions, flag_of

    alone = {}
    for name, field in ReshardOptions.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "alone" in extra:
            alone[flag_of(name)] = str(extra["alone"])
    out = list(argv)
    for i, word in enumerate(out):
        if word not in alone:
            continue
        nxt = out[i + 1] if i + 1 < len(out) else None
        is_value = nxt is not None and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", nxt) and not os.path.exists(nxt)
        if not is_value:
            out[i] = f"{word}={alone[word]}"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reshard`` console script; returns the exit code."""
    ns = build_parser().parse_args(_alone_values(sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[ns.command](ns)
    except ReshardError as err:
        print(f"reshard: error: {err.one_line()}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # transient storage failures left after every retry: one line, EX_TEMPFAIL
        from reshard.storage.location import is_transient_error

        if stdout_closed(exc):  # the reader has what it wanted (``| head``): quiet, as Unix tools end
            _silence_stdout()
            return EX_PIPE_CLOSED
        if not is_transient_error(exc):
            raise
        text = " ".join(str(exc).split())[:300]
        print(f"reshard: error: storage kept failing after all retries ({type(exc).__name__}: {text}); nothing "
              f"was committed (fix: retry later; check the endpoint and network)", file=sys.stderr)
        return EX_TEMPFAIL


def console() -> None:
    """The ``reshard`` console script: :func:`main`, then the process ends at once. Its work is
    done and flushed by then (outputs committed, Prefect's server stopped, its event and log
    queues drained), and the interpreter's teardown of torch's and Prefect's modules alone took
    half a second of every run."""
    import logging
    import os

    code = main()
    logging.shutdown()
    try:
        sys.stdout.flush()
    except BrokenPipeError as exc:  # what was left in the buffer had no reader any more
        if not stdout_closed(exc):
            raise
        _silence_stdout()
        code = code or EX_PIPE_CLOSED
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
