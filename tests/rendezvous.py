"""The one port picker of the tests' multi-process launchers (the megatron-core harness, the
DeepSpeed engine's fork server) and servers (Prefect, Dask), imported as a sibling module."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port for the ranks' rendezvous, below Linux's ephemeral range (32768-60999): a port the kernel
    hands out (a bind to 0) lies in that range, where every outgoing connection of the suite (S3,
    Prefect) takes its local port too, so one could take it before rank 0 listens (EADDRINUSE)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000 for the ranks' rendezvous")
