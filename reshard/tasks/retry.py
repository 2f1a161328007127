"""Which failures are worth retrying a whole shard task for.

Request-level retries already happened inside botocore/s3fs by the time a task fails; a task
retry re-runs the whole fetch or upload. Only transient failures qualify: a corrupt shard,
a validation error, a permission error or a missing bucket fails at once with its message.
"""

from __future__ import annotations

from typing import Any

from reshard.storage.location import is_transient_error

__all__ = ["is_transient_error", "retry_if_transient"]


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only transient failures."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as err:  # reading the result itself failed
        exc = err
    return is_transient_error(exc if isinstance(exc, BaseException) else None)
