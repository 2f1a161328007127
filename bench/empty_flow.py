"""The fixed cost of a Prefect flow on this machine: one flow with one trivial task on the
embedded (ephemeral) server, started the way ``reshard run`` starts it — the part of the
flow's overhead that does not depend on reshard or on the checkpoint size.

    PREFECT_HOME=<pre-migrated> python bench/empty_flow.py
"""

from __future__ import annotations

import sys

from prefect import flow, task


@task
def one() -> int:
    return 1


@flow(name="bench-empty")
def empty() -> int:
    return one.submit().result()


if __name__ == "__main__":
    sys.exit(0 if empty() == 1 else 1)
