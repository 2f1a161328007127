"""The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
``--cpus``, a Kubernetes CPU limit), which the affinity alone does not show."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Where cgroup v2 states this process's CPU quota (``"<quota> <period>"`` or ``"max <period>"``).
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpu_limit(text: str) -> int | None:
    """The whole CPUs a cgroup v2 ``cpu.max`` line allows (rounded up, at least 1); None when it
    sets no quota (``max``) or is not such a line.

    ==================  ======
    ``cpu.max``         CPUs
    ==================  ======
    ``max 100000``      None
    ``200000 100000``   2
    ``150000 100000``   2
    ``50000 100000``    1
    ==================  ======
    """
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a scheduler's or a cpuset's share; all
    CPUs where the platform has no affinity call), capped by the cgroup's CPU quota where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cores = os.cpu_count() or 1
    try:
        limit = cgroup_cpu_limit(CPU_MAX.read_text())
    except OSError:  # no cgroup v2 here
        limit = None
    return min(cores, limit) if limit is not None else cores
