"""Run the ``reshard`` flow from the CLI or Python: reshard's embedded server by default, a
configured server when ``PREFECT_API_URL`` is set (:mod:`reshard.flows.session`); threads by
default, Dask on request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reshard.flows.params import ReshardParams


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
             console_level: str | None = None, server: Any = None) -> dict[str, Any]:
    """Run the flow in this process and return its summary, the flow's
    :class:`~reshard.result.ConversionResult` as plain data (raises the first task error), on the
    Prefect :func:`~reshard.flows.session.prefect_session` picks: the configured server, else
    reshard's embedded one. ``server``: that embedded server when the caller started it already
    (the CLI does, before it imports the flow, so it boots meanwhile)."""
    import reshard.progress as progress
    from reshard.flows.reshard_flow import reshard_flow
    from reshard.flows.session import prefect_session

    if console_level:
        quiet_console(console_level)

    flow = reshard_flow.with_options(task_runner=task_runner(dask_address, dask_workers,
                                                             1 if params.gpu_resource else 0))

    def done_only(event: dict[str, Any]) -> None:
        if on_target_done is not None and event.get("event") == progress.TARGET_DONE:
            on_target_done(event)

    unsubscribe = progress.subscribe(done_only) if on_target_done else (lambda: None)
    try:
        with prefect_session(params.cache_dir, server=server):
            return flow(params).model_dump()
    finally:
        unsubscribe()


class _ConsoleFilter:
    """For the CLI: what Prefect's console handlers print.

    The CLI reports a run itself: a progress line per target, then one summary line or one
    ``reshard: error:`` line. So, unless ``run_logs`` (``-v``), the flow's and tasks' own log
    records (loggers ``prefect.flow_runs`` / ``prefect.task_runs``: states such as Failed,
    NotReady or Crashed, retries, exceptions) stay off the console; they still reach the API/UI
    in full. Prefect's other warnings (e.g. an unreachable API) are printed. Tracebacks are never
    printed, and a record carrying a reshard error is left to the CLI's final line.
    """

    RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self, run_logs: bool = False) -> None:
        self.run_logs = run_logs

    def filter(self, record: Any) -> bool:
        from reshard.core.errors import ReshardError

        if not self.run_logs and any(record.name == n or record.name.startswith(n + ".") for n in self.RUN_LOGGERS):
            return False
        if record.exc_info and isinstance(record.exc_info[1], ReshardError):
            return False
        if "Finished in state Failed" in record.getMessage():
            return False
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_console(level: str = "WARNING", *, run_logs: bool | None = None) -> None:
    """Limit Prefect's console handlers to ``level`` and drop tracebacks (logs still reach
    the Prefect API/UI in full). ``run_logs`` (default: ``level`` is INFO or lower) keeps the
    flow's and tasks' own records on the console (see :class:`_ConsoleFilter`)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    numeric = level if isinstance(level, int) else logging.getLevelName(str(level).upper())
    if run_logs is None:
        run_logs = isinstance(numeric, int) and numeric <= logging.INFO
    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in logging.root.manager.loggerDict]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(level)
                mine = [f for f in handler.filters if isinstance(f, _ConsoleFilter)]
                if mine:
                    for f in mine:
                        f.run_logs = run_logs
                else:
                    handler.addFilter(_ConsoleFilter(run_logs))
