"""The C allocator's hold on freed buffers: a conversion's large buffers go back to the system
when they are freed, instead of staying in glibc's arenas.

Why: glibc serves a request of at least its mmap threshold (128 KiB at first) with a mapping of
its own, unmapped at ``free`` — but each time such a mapping is freed it raises the threshold to
that size (up to 32 MiB), so from then on every buffer below it comes from an arena, and an arena
keeps what is freed there for later requests (it gives back only what lies at its top). Each
thread allocates from an arena of its own, up to eight per core. A conversion that reads or
writes object storage makes multi-MiB buffers on many threads, one set per block read and per
part uploaded — the read blocks, the event loop's copies of request and response bodies, the
upload parts — beside the codec's bands and slabs, of sizes that vary with the tensor and the
file. The arenas then held several times what was in use, more the more was converted (issue 55:
MXFP4 -> bf16 S3 -> S3 of GPT-OSS-120B-shaped layers, where what was in use stayed bounded). With
the threshold set it stays fixed: every buffer from :data:`MMAP_THRESHOLD` up is a mapping, given
back the moment it is freed, and the arenas hold only smaller ones.

Process-wide and idempotent: :func:`return_large_buffers` is called where a conversion starts, not
at import. Elsewhere than glibc (musl, macOS) there is no such threshold to set, and nothing is
done.
"""

from __future__ import annotations

import ctypes
import functools
import platform

#: glibc's ``mallopt`` parameter for the mmap threshold (``M_MMAP_THRESHOLD`` in ``<malloc.h>``).
M_MMAP_THRESHOLD = -3
#: Buffers from this size up are mapped and unmapped on their own: a read block (4 MiB), an upload
#: part (8 MiB), a decoded slab; the many small ones stay in the arenas, where they are cheap.
MMAP_THRESHOLD = 4 << 20


@functools.cache
def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` for this process (see the module
    docstring); whether it was set (False where the C library is not glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)))
