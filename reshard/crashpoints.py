"""Named crash points for reliability tests: ``RESHARD_CRASH_AT=name:n`` makes the process
SIGKILL itself the n-th time it passes ``name`` — a real, unclean death at a precise point.

Unset (the normal case) this is one dictionary lookup. Points, in pipeline order: ``fetching``
(a remote shard download is about to start), ``fetched``, ``planned``, ``writing`` (a flow's
output for a local destination, after each tensor record written), ``converted``,
``uploading`` (a staged output is about to be uploaded), ``uploaded``, ``staged-all`` (every
output staged, nothing moved), ``copying`` (the first output moved into place),
``committed-files`` (all moved, manifest not yet written).

``RESHARD_CRASH_ONCE=FILE`` beside it: only the first process to reach the point dies (it
creates FILE; the others find it there and go on) — one of several workers killed, not all.
"""

from __future__ import annotations

import os
import signal
import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if ``RESHARD_CRASH_AT`` names this point and its count is reached."""
    spec = os.environ.get("RESHARD_CRASH_AT")
    if not spec:
        return
    point, _, n = spec.partition(":")
    if point != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] >= int(n or 1)
    if hit:
        once = os.environ.get("RESHARD_CRASH_ONCE")
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # another process died here already
        os.kill(os.getpid(), signal.SIGKILL)
