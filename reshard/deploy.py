"""Register (``reshard deploy``) or serve in-process (``reshard serve``) the deployments of
``deployments/prefect.yaml``.

* ``deploy`` makes sure the work pools the file names exist (type ``process``, like
  ``prefect work-pool create gpu --type process``), then runs Prefect's own
  ``prefect deploy --all --no-prompt`` on the file: what is registered is exactly what the file says.
* ``serve`` builds the same deployments (names, parameters, schedules, triggers, concurrency
  limits) with ``flow.to_deployment`` and serves them from this process with ``prefect.serve``:
  a single machine, no work pool and no worker. Runs start in subprocesses of this one.

``{{ $VAR }}`` placeholders are filled from the environment at deploy/serve time (Prefect's
rule); event-trigger ``parameters`` are left for the server to render with each event.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from reshard.core.errors import ConfigError

#: the file in a source checkout; ``--file`` or ``$RESHARD_DEPLOYMENTS_FILE`` point elsewhere
PACKAGED_FILE = Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"
_ENV_PLACEHOLDER = re.compile(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def prefect_file(path: str | os.PathLike[str] | None = None) -> Path:
    """The prefect.yaml to use: ``path``, ``$RESHARD_DEPLOYMENTS_FILE``, ``./deployments/prefect.yaml``,
    or the one next to this package (source checkouts)."""
    candidates = [Path(path)] if path else [
        Path(p) for p in (os.environ.get("RESHARD_DEPLOYMENTS_FILE"), "deployments/prefect.yaml") if p
    ] + [PACKAGED_FILE]
    for c in candidates:
        if c.is_dir():
            c = c / "prefect.yaml"
        if c.is_file():
            return c.resolve()
    raise ConfigError("no prefect.yaml found", culprit=str(candidates[0]),
                      hint="pass --file path/to/prefect.yaml (reshard's is deployments/prefect.yaml in the repository)")


def load_specs(path: str | os.PathLike[str] | None = None, names: list[str] | None = None, *,
               import_flows: bool = True) -> list[dict[str, Any]]:
    """The file's deployment entries (YAML anchors and merges resolved), each with ``flow_name``
    and ``full_name`` (``flow/deployment``) added; ``names`` filters by either name form.
    ``import_flows=False`` skips importing the entrypoints (``flow_name`` is then None and
    ``full_name`` the bare deployment name)."""
    import yaml

    file = prefect_file(path)
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read: {exc}", culprit=str(file)) from None
    specs = []
    for spec in (data or {}).get("deployments") or []:
        if not spec.get("name") or not spec.get("entrypoint"):
            raise ConfigError("every deployment needs a name and an entrypoint", culprit=str(file))
        flow_name = _load_flow(spec["entrypoint"]).name if import_flows else None
        short = spec["name"]
        full_name = f"{flow_name}/{short}" if flow_name else short
        spec = {**spec, "flow_name": flow_name, "full_name": full_name}
        if not names or any(n in (short, full_name) or (flow_name is None and n.rsplit("/", 1)[-1] == short)
                            for n in names):
            specs.append(spec)
    if names and not specs:
        raise ConfigError(f"no deployment named {', '.join(names)}", culprit=str(file))
    return specs


def _load_flow(entrypoint: str) -> Any:
    from prefect.utilities.importtools import import_object

    try:
        return import_object(entrypoint)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot import the entrypoint: {exc}", culprit=entrypoint) from None


def missing_env(specs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{VAR: [deployment, ...]}`` for ``{{ $VAR }}`` placeholders whose variable is unset."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        body = {k: v for k, v in spec.items() if k != "triggers"}
        for var in _ENV_PLACEHOLDER.findall(repr(body)):
            if var not in os.environ:
                out.setdefault(var, []).append(spec["full_name"])
    return out


def _warn_missing_env(specs: list[dict[str, Any]]) -> None:
    for var, where in missing_env(specs).items():
        print(f"reshard: warning: ${var} is not set; {', '.join(where)} keep(s) the literal placeholder and "
              f"its runs fail until you export {var} and deploy again (or pass the parameter per run)",
              file=sys.stderr)


def work_pools(specs: list[dict[str, Any]]) -> list[str]:
    return sorted({(s.get("work_pool") or {}).get("name") for s in specs} - {None})


def ensure_work_pool(name: str, pool_type: str = "process") -> bool:
    """Create work pool ``name`` (Prefect's default job template for ``pool_type``) unless it
    exists; returns whether it was created. Same as ``prefect work-pool create NAME --type process``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        if pool_type != "process":
            raise ConfigError(f"work pool {name!r} does not exist", culprit=name,
                              hint=f"prefect work-pool create {name} --type {pool_type}")
        template = ProcessWorker.get_default_base_job_template()
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        except ObjectAlreadyExists:
            return False
    return True


def _require_api() -> str:
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise ConfigError("PREFECT_API_URL is not set: deployments need a running Prefect server",
                          culprit="PREFECT_API_URL",
                          hint="prefect server start, then export PREFECT_API_URL=http://127.0.0.1:4200/api")
    return api


def deploy(path: str | os.PathLike[str] | None = None, names: list[str] | None = None, *,
           create_pools: bool = True) -> int:
    """Register the deployments of ``path`` with ``prefect deploy``; returns its exit code."""
    _require_api()
    file = prefect_file(path)
    specs = load_specs(file, names, import_flows=False)  # prefect deploy imports them itself
    _warn_missing_env(specs)
    if create_pools:
        for pool in work_pools(specs):
            if ensure_work_pool(pool):
                print(f"created work pool {pool!r} (type process)", file=sys.stderr)
    exe = Path(sys.executable).with_name("prefect")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "prefect"]
    cmd += ["deploy", "--no-prompt", "--prefect-file", str(file)]
    cmd += [a for n in names for a in ("--name", n)] if names else ["--all"]
    return subprocess.run(cmd, cwd=file.parent, check=False).returncode


def _schedule(raw: dict[str, Any]) -> Any:
    from prefect.schedules import Cron, Interval, RRule

    common = {k: raw[k] for k in ("timezone", "active", "parameters", "slug") if raw.get(k) is not None}
    if raw.get("cron"):
        if raw.get("day_or") is not None:
            common["day_or"] = raw["day_or"]
        return Cron(raw["cron"], **common)
    if raw.get("interval"):
        if raw.get("anchor_date"):
            from prefect.types._datetime import parse_datetime

            common["anchor_date"] = parse_datetime(raw["anchor_date"])
        return Interval(raw["interval"], **common)
    if raw.get("rrule"):
        return RRule(raw["rrule"], **common)
    raise ConfigError(f"unknown schedule {raw!r}", culprit="schedules", hint="use cron, interval or rrule")


def runner_deployments(path: str | os.PathLike[str] | None = None, names: list[str] | None = None) -> list[Any]:
    """The file's deployments as ``RunnerDeployment`` objects for ``prefect.serve``."""
    from prefect.deployments.runner import EntrypointType
    from prefect.events import DeploymentTriggerTypes
    from prefect.utilities.templating import apply_values
    from pydantic import TypeAdapter

    triggers_adapter: TypeAdapter[Any] = TypeAdapter(DeploymentTriggerTypes)
    out = []
    for spec in load_specs(path, names):
        triggers = spec.get("triggers") or []
        spec = apply_values({k: v for k, v in spec.items() if k != "triggers"}, os.environ, remove_notset=False)
        limit = spec.get("concurrency_limit")
        if isinstance(limit, dict):
            from prefect.client.schemas.objects import ConcurrencyLimitConfig

            limit = ConcurrencyLimitConfig(**limit)
        flow = _load_flow(spec["entrypoint"])
        trigger_objs = []
        for i, t in enumerate(triggers, start=1):
            t = dict(t)
            params = t.pop("parameters", None)  # rendered per event by the server, not here
            t = apply_values(t, os.environ, remove_notset=False)
            if params is not None:
                t["parameters"] = params
            t.setdefault("name", f"{spec['name']}__automation_{i}")
            trigger_objs.append(triggers_adapter.validate_python(t))
        out.append(flow.to_deployment(
            name=spec["name"], parameters=spec.get("parameters") or {}, description=spec.get("description"),
            tags=spec.get("tags"), schedules=[_schedule(s) for s in spec.get("schedules") or []],
            triggers=trigger_objs, concurrency_limit=limit, paused=spec.get("paused"),
            enforce_parameter_schema=spec.get("enforce_parameter_schema", True),
            entrypoint_type=EntrypointType.MODULE_PATH))
    return out


def serve(path: str | os.PathLike[str] | None = None, names: list[str] | None = None, *,
          limit: int | None = None) -> None:
    """Serve the file's deployments from this process until interrupted (SIGINT/SIGTERM pause
    their schedules, as ``prefect.serve`` does)."""
    _require_api()
    from prefect import serve as prefect_serve

    _warn_missing_env(load_specs(path, names, import_flows=False))
    deployments = runner_deployments(path, names)
    prefect_serve(*deployments, limit=limit)
