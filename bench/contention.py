"""A busy machine for the benchmarks' contention mode (``--busy N``).

Conversions rarely run on an idle machine: a training job's data loaders, another conversion, a
build share the cores. ``busy(n)`` starts ``n`` processes that keep one core each busy — a Python
loop that alternates pure computation with touching a 64 MiB buffer, so they compete for the
memory bus as well as for time slices — for the duration of a ``with`` block, and stops them
(SIGKILL to their process group) when it ends, however it ends. Every method of a benchmark runs
inside the same kind of block, so the ratios compare like with like.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

#: What each busy process runs: compute, then stream through its buffer, forever.
_LOOP = r"""
import time
buf = bytearray(64 << 20)
view = memoryview(buf)
x = 0
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    for off in range(0, len(buf), 1 << 20):
        view[off:off + (1 << 20)] = view[off:off + (1 << 20)]
"""


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[int]]:
    """``n`` busy processes (none when ``n`` is 0) for the block; their pids are yielded."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _LOOP], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        if procs:
            time.sleep(0.5)  # they have started and hold their buffers before the run begins
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def load_note(n: int) -> str:
    """How a report names the mode."""
    return f"contention: {n} busy processes beside every run" if n else "quiet machine"
