"""The ``reshard.training.completed`` event: how a training job tells Prefect a checkpoint is ready.

A training script calls, after its last checkpoint is fully written::

    from reshard.events import emit_training_completed
    emit_training_completed("s3://ckpt/run7/global_step1000", tp=8, step=1000)            # every matching target
    emit_training_completed("s3://ckpt/run7/global_step1000", tp=8, step=1000, targets=[2])  # only TP 2
    emit_training_completed("s3://ckpt/run7/global_step1000", tp=8, step=1000, targets=[2, "hf"])  # and HF

or, from a shell: ``reshard emit-training-completed s3://ckpt/run7/global_step1000 --tp 8 --step 1000``.
``PREFECT_API_URL`` must name the Prefect server that holds the reshard deployments.

The event (what the deployment triggers in ``deployments/prefect.yaml`` match)::

    event:    reshard.training.completed
    resource: prefect.resource.id    reshard.checkpoint.<url>
              prefect.resource.name  <url>
              reshard.url            <url>
              reshard.tp             "8"        (labels are strings)
              reshard.step           "1000"
    related:  one per requested target: prefect.resource.id reshard.target.tp<M> (a TP degree) or
              reshard.target.<format> (an output format, e.g. hf), prefect.resource.role
              reshard-target; without ``targets``: reshard.target.all
    payload:  {"url": <url>, "tp": 8, "step": 1000, "targets": [2] or null, ...extra}

A conversion deployment ``reshard/<N>to<M>`` fires when ``reshard.tp`` is ``N`` and a related
resource is ``reshard.target.tp<M>`` or ``reshard.target.all``; ``reshard/to-hf`` fires for any TP
on ``reshard.target.hf`` or ``reshard.target.all``. Each run gets
``source = {{ event.resource['reshard.url'] }}``. Storage credentials never travel in events
(events are stored and shown in the UI): workers get them from their environment, profile or
the deployment's ``storage_options``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

from reshard.core.errors import ConfigError

TRAINING_COMPLETED = "reshard.training.completed"
RESOURCE_PREFIX = "reshard.checkpoint."
TARGET_PREFIX = "reshard.target."
ALL_TARGETS = TARGET_PREFIX + "all"
TARGET_ROLE = "reshard-target"


def training_completed_event(url: str, tp: int, step: int | None = None, targets: Iterable[int | str] | None = None,
                             payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of ``prefect.events.emit_event`` for this event (no I/O)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("must be a non-empty checkpoint URL", culprit="url")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"must be a positive integer (got {tp!r})", culprit="tp")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"must be a non-negative integer (got {step!r})", culprit="step")
    wanted = None if targets is None else _targets(targets)
    resource = {"prefect.resource.id": RESOURCE_PREFIX + url, "prefect.resource.name": url,
                "reshard.url": url, "reshard.tp": str(tp)}
    if step is not None:
        resource["reshard.step"] = str(step)
    related = ([{"prefect.resource.id": target_resource(m), "prefect.resource.role": TARGET_ROLE} for m in wanted]
               if wanted is not None else [{"prefect.resource.id": ALL_TARGETS, "prefect.resource.role": TARGET_ROLE}])
    body = {**(payload or {}), "url": url, "tp": tp, "step": step, "targets": wanted}
    return {"event": TRAINING_COMPLETED, "resource": resource, "related": related, "payload": body}


def target_resource(target: int | str) -> str:
    """The related-resource id of a requested target: ``reshard.target.tp<M>`` for a TP degree,
    ``reshard.target.<format>`` for an output format (``hf``)."""
    return f"{TARGET_PREFIX}tp{target}" if isinstance(target, int) else TARGET_PREFIX + target


def _targets(targets: Iterable[int | str]) -> list[int | str]:
    """TP degrees (positive integers, also as digit strings) first, then format names, each once."""
    degrees: set[int] = set()
    formats: set[str] = set()
    for t in targets:
        if isinstance(t, str) and t.isdigit():
            t = int(t)
        if isinstance(t, int) and not isinstance(t, bool) and t >= 1:
            degrees.add(t)
        elif isinstance(t, str) and _FORMAT_RE.match(t):
            formats.add(t)
        else:
            raise ConfigError(f"{t!r} is neither a tensor-parallel degree nor an output format name",
                              culprit="targets", hint="give positive integers (TP) or format names such as hf")
    if not degrees and not formats:
        raise ConfigError("is empty", culprit="targets", hint="leave targets out to request every target")
    return [*sorted(degrees), *sorted(formats)]


_FORMAT_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def emit_training_completed(url: str, tp: int, step: int | None = None, targets: Iterable[int | str] | None = None, *,
                            payload: dict[str, Any] | None = None, timeout: float = 30.0) -> str:
    """Emit ``reshard.training.completed`` for the checkpoint at ``url`` and wait until it is sent.

    Returns the event id. Raises :class:`~reshard.core.errors.ConfigError` when no Prefect server
    is configured or reachable (the event would go nowhere), or when sending did not finish within
    ``timeout`` seconds. Call it from synchronous code (a training script's last lines).
    """
    kwargs = training_completed_event(url, tp, step, targets, payload)
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise ConfigError("PREFECT_API_URL is not set: the event would reach no server", culprit="PREFECT_API_URL",
                          hint="export PREFECT_API_URL=http://<prefect-server>:4200/api")
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise ConfigError(f"the Prefect server does not answer ({error})", culprit=api,
                          hint="start it (`prefect server start`) or fix PREFECT_API_URL")
    event = emit_event(**kwargs)
    if event is None:
        raise ConfigError("Prefect events are disabled in this environment", culprit="PREFECT_API_ENABLE_EVENTS",
                          hint="unset PREFECT_API_ENABLE_EVENTS / PREFECT_EVENTS_* overrides")
    if not flush_worker(EventsWorker.instance(), timeout):
        raise ConfigError(f"sending the event did not finish within {timeout:.0f}s", culprit=api)
    return str(event.id)


def flush_worker(worker: Any, timeout: float, *, wait_empty: bool = True) -> bool:
    """Send what a Prefect queue worker (events, logs) holds, then drain (stop) it, within
    ``timeout`` seconds; a later use starts a new worker. True when done in time.

    Waiting for an empty queue first (``wait_empty``) matters: a worker drained while it still
    holds items reports "Still processing items: N items remaining..." on the console, and right
    after ``emit_event`` the item is still queued (the worker is connecting). Both steps run in a
    helper thread (no event loop there, so Prefect's calls block), left behind as a daemon if the
    timeout passes."""
    done = threading.Event()

    def flush() -> None:
        if wait_empty:
            worker.wait_until_empty()
        worker.drain()
        done.set()

    threading.Thread(target=flush, name="reshard-flush", daemon=True).start()
    return done.wait(max(timeout, 0.0))
