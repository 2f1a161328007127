"""The floor: a Python process that imports torch and copies the source's bytes once
(read into a buffer, write it out) — what any converter must at least do.

    python bench/copy_floor.py SRC_DIR DST_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # noqa: F401  (the floor pays the same interpreter + torch start-up as the tools)

CHUNK = 1 << 20  # a buffer that stays in the CPU's caches: the stricter floor (docs/performance.md, session 14)


def main(argv: list[str] | None = None) -> int:
    src, dst = (Path(a) for a in (argv or sys.argv[1:]))
    dst.mkdir(parents=True, exist_ok=True)
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    for f in sorted(src.glob("*.pt")):
        with open(f, "rb", buffering=0) as fi, open(dst / f.name, "wb", buffering=0) as fo:
            while n := fi.readinto(buf):
                view = mv[:n]
                while view:
                    view = view[fo.write(view):]
    return 0


if __name__ == "__main__":
    sys.exit(main())
