"""Give back the pages of memory-mapped shards once read, so peak memory follows what is in use.

Shards are loaded memory-mapped (``safe_load``): reading a tensor maps its file pages into the
process, and they count toward its RSS until unmapped. A touch maps more than the page touched:
its fault-around window (64 KiB by default) or, with large page-cache folios (recent kernels,
files read sequentially into a roomy page cache), the whole folio — up to 2 MiB — so checking a
few hundred small replicated tensors can map hundreds of MiB, and the first touch of a range maps
pages before it that were already given back.

:class:`PageDropper` unmaps such pages with ``madvise(MADV_DONTNEED)``: the file stays in the
page cache, the pages stop counting toward this process, and they are read again from the file
if touched again. Only ranges inside a file mapping of one of the given paths — as listed in
``/proc/self/maps`` when the dropper is made, i.e. while the caller holds the loaded shards — are
ever dropped: never anonymous memory, whose contents that would erase. (torch maps shards
private copy-on-write; reshard never writes to a source tensor, so no page holds anything but
the file's bytes.) Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
#: The largest page-cache folio a touch may map (see the module doc).
FOLIO = 2 << 20


def file_mappings(paths: Iterable[Any]) -> list[tuple[int, int, int]]:
    """This process's current mappings of the files ``paths``, as ``(start, end, file offset of
    start)`` from ``/proc/self/maps`` (Linux; elsewhere none)."""
    wanted = {os.path.realpath(p) for p in paths}
    out: list[tuple[int, int, int]] = []
    if not wanted or not sys.platform.startswith("linux"):
        return out
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].rstrip("\n") in wanted:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16)))
    return out


class PageDropper:
    """Drops pages of the current file mappings of ``paths`` (see the module doc)."""

    def __init__(self, paths: Iterable[Any]) -> None:
        self.ranges: list[tuple[int, int, int]] = []  # (start, end, file offset of start)
        self.page = mmap.PAGESIZE
        self._madvise: Any = None
        if not sys.platform.startswith("linux"):
            return
        try:
            self.ranges = file_mappings(paths)
            if not self.ranges:
                return
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
        except (OSError, AttributeError, ValueError):
            self.ranges = []

    def drop(self, addr: int, nbytes: int, within: tuple[int, int] | None = None) -> None:
        """Drop the pages covering ``[addr, addr + nbytes)`` if they lie in one of the mappings, and
        the pages before them in the same folio-sized, folio-aligned window.

        Why before: a fault maps more than the page touched — its fault-around window (64 KiB by
        default) or its whole folio, both aligned, so also pages *before* it. Readers go forward
        through a source, so those pages were read and dropped already; the fault that starts the
        next range maps them again, and with nothing to give them back a conversion leaked part
        of every window a range boundary fell in, in proportion to the source (docs/performance.md,
        session 15). A page dropped too early is only mapped again from the page cache.

        ``within``: the bytes ``[start, end)`` of the entry the range belongs to. Reaching its last
        page also drops the rest of the folio after it: the neighbouring entry's pages came with
        the touch, and when that entry is never read (another EP rank's copy of a dense weight)
        nothing else would give them back."""
        if self._madvise is None or nbytes <= 0:
            return
        lo = addr - addr % self.page
        hi = addr + nbytes
        hi += -hi % self.page
        for a, b, offset in self.ranges:
            if a <= lo and hi <= b:
                origin = a - offset  # where the file's byte 0 would be: folios are aligned in the file
                lo = max(a, origin + (lo - origin) // FOLIO * FOLIO)
                if within is not None:
                    last = within[1] + -within[1] % self.page
                    if hi >= last:
                        hi = min(b, origin + -(-(hi - origin) // FOLIO) * FOLIO)
                self._madvise(lo, hi - lo, MADV_DONTNEED)
                return

    def dropper(self, addr: int, nbytes: int, within: tuple[int, int] | None = None) -> Callable[[], None]:
        """:meth:`drop` of this range, to call later (e.g. once a writer is done with it)."""
        return functools.partial(self.drop, addr, nbytes, within)

    def drop_tensor(self, t: Any) -> None:
        """Drop the pages of ``t``'s whole storage (a CPU tensor of a mapped shard)."""
        if self._madvise is None or not isinstance(t, torch.Tensor):
            return
        try:
            if t.device.type != "cpu":
                return
            st = t.untyped_storage()
            self.drop(st.data_ptr(), st.nbytes(), (st.data_ptr(), st.data_ptr() + st.nbytes()))
        except (AttributeError, RuntimeError):
            return
