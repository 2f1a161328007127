"""Two threads for a band's work on a small CPU: how many (:func:`band_workers`) and the second one
(:func:`split_rows`).

Why: reshard's streaming conversions run torch at one intra-op thread (torch's idle OpenMP workers
busy-wait between ops, and that spinning is taken from the writer and hasher threads:
``reshard.execution.engine.streaming_threads``). The per-band encoding (FP8 blocks,
compressed-tensors' codecs) is then the critical path on one core while the writer and hasher leave
the other partly idle. A second Python thread that runs torch ops (which release the GIL) and waits
without spinning takes that idle time; the bytes are the same, as every row of a band is encoded
alone. Not for a LoRA merge: its rank-16 GEMM and add are memory-bound, and two threads were slower
than one (docs/performance.md, issue 59).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import torch

from reshard.core.cpus import usable_cores

#: Threads a band's work is shared among on a CPU whose torch runs one intra-op thread.
_BAND_WORKERS_ON_ONE_THREAD = 2

_helper: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_helper_lock = threading.Lock()


def band_workers(device: torch.device | None = None) -> int:
    """Threads to share a weight's bands among: two on a CPU with at least two cores whose torch
    runs one intra-op thread (a 2-core worker, where a streamed conversion keeps the other threads
    for the writer and the hasher), else one, torch's own pool spreading each op where it has more
    (the A/B runs are in docs/performance.md: session 26, issue 58)."""
    on_cpu = device is None or device.type == "cpu"
    one_thread = torch.get_num_threads() == 1 and usable_cores() >= 2
    return _BAND_WORKERS_ON_ONE_THREAD if on_cpu and one_thread else 1


def _second_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one helper thread, made at the first band that uses it and kept for the process (bands
    come by the thousand), running torch at one intra-op thread of its own."""
    with _helper_lock:
        if "pool" not in _helper:
            _helper["pool"] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="reshard-band", initializer=torch.set_num_threads, initargs=(1,))
        return _helper["pool"]


def split_rows(rows: int, work: Callable[[int, int], None], workers: int) -> None:
    """``work(first, stop)`` over rows ``0 .. rows``: with two ``workers`` (:func:`band_workers`)
    and two rows or more, the second half on the helper thread while this thread does the first;
    both done (or the first error raised) on return. ``work`` must write disjoint rows only."""
    if workers < 2 or rows < 2:
        work(0, rows)
        return
    cut = rows // 2
    other = _second_thread().submit(work, cut, rows)
    try:
        work(0, cut)
    finally:
        other.result()
