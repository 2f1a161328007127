"""Run the ``reshard`` flow from the CLI or Python: ephemeral server by default, a configured
server when ``PREFECT_API_URL`` is set; threads by default, Dask on request."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reshard.flows.params import ReshardParams


def prefect_environment(cache_root: Path) -> None:
    """Defaults for running offline on a small machine; an explicit setting always wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(cache_root / "prefect-results"))


def task_runner(dask_address: str | None = None, dask_workers: int | None = None, gpus_per_worker: int = 0) -> Any:
    """Threads (default), a Dask scheduler at ``dask_address``, or a local Dask cluster."""
    if dask_address is None and not dask_workers:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=4)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    kwargs: dict[str, Any] = {"n_workers": dask_workers, "processes": False, "threads_per_worker": 2}
    if gpus_per_worker:
        kwargs["resources"] = {"GPU": gpus_per_worker}
    return DaskTaskRunner(cluster_kwargs=kwargs)


def run_flow(params: ReshardParams, *, dask_address: str | None = None, dask_workers: int | None = None,
             on_target_done: Callable[[dict[str, Any]], None] | None = None,
             console_level: str | None = None) -> dict[str, Any]:
    """Run the flow in this process and return its summary (raises the first task error)."""
    from reshard.storage.cache import ShardCache

    prefect_environment(ShardCache(params.cache_dir).root)
    from reshard import progress
    from reshard.flows.reshard_flow import reshard_flow

    if console_level:
        quiet_console(console_level)

    flow = reshard_flow.with_options(task_runner=task_runner(dask_address, dask_workers,
                                                             1 if params.gpu_resource else 0))

    def done_only(event: dict[str, Any]) -> None:
        if on_target_done is not None and event.get("event") == progress.TARGET_DONE:
            on_target_done(event)

    unsubscribe = progress.subscribe(done_only) if on_target_done else (lambda: None)
    try:
        return flow(params)
    finally:
        unsubscribe()


class _ConsoleFilter:
    """For the CLI: Prefect's console shows warnings and errors without tracebacks, and
    reshard's own typed errors are left to the CLI's single final line."""

    def filter(self, record: Any) -> bool:
        from reshard.core.errors import ReshardError

        if record.exc_info and isinstance(record.exc_info[1], ReshardError):
            return False
        if "Finished in state Failed" in record.getMessage():
            return False
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_console(level: str = "WARNING") -> None:
    """Limit Prefect's console handlers to ``level`` and drop tracebacks (logs still reach
    the Prefect API/UI in full)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in logging.root.manager.loggerDict]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(level)
                if not any(isinstance(f, _ConsoleFilter) for f in handler.filters):
                    handler.addFilter(_ConsoleFilter())
