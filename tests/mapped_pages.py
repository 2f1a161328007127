"""How much of a file this process holds mapped: the measure of the tests that check a reader
gives a mapped source's pages back (:class:`reshard.core.pages.PageDropper`)."""

from __future__ import annotations

from pathlib import Path


def resident_bytes(path: Path) -> int:
    """Bytes of this process's mappings of ``path`` that are resident (``/proc/self/smaps``, Linux)."""
    want = str(Path(path).resolve())
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header line
                inside = len(head) == 6 and head[5].rstrip("\n") == want
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total
