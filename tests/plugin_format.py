"""A checkpoint format defined outside reshard (the tests' proof that adding one is one module):
``shard-XX-of-YY.pt`` files, one per tensor-parallel rank, each a DeepSpeed-style state dict.

Registered with ``reshard.formats.register_format(ShardOfFormat)``; nothing in reshard names it.
"""

from __future__ import annotations

import re
from pathlib import Path

from reshard.core.errors import CheckpointFormatError
from reshard.core.source import SourceCheckpoint
from reshard.formats import CheckpointFormat
from reshard.formats.base import check_contiguous

_FILE = re.compile(r"^shard-(\d+)-of-(\d+)\.pt$")


class ShardOfFormat(CheckpointFormat):
    name = "test-shard-of"
    priority = 50
    patterns = (re.compile(r"(^|/)shard-\d+-of-\d+\.pt$"),)

    def detect(self, folder: Path) -> bool:
        return any(_FILE.match(c.name) for c in folder.iterdir())

    def locate(self, path: Path) -> SourceCheckpoint:
        found = {int(m.group(1)): (c, int(m.group(2))) for c in sorted(path.iterdir()) if (m := _FILE.match(c.name))}
        check_contiguous(sorted(found), str(path))
        totals = {total for _, total in found.values()}
        if totals != {len(found)}:
            raise CheckpointFormatError(f"files say {sorted(totals)} shards but {len(found)} are here",
                                        culprit=str(path), hint="copy every shard-XX-of-YY.pt file")
        # read like DeepSpeed's mp_rank files (module under "module"), written in DeepSpeed's layout
        return SourceCheckpoint(tuple(found[r][0] for r in sorted(found)), origin=str(path))


def write_as_shard_of(src: Path, dst: Path) -> Path:
    """The sample's ``mp_rank_XX_model_states.pt`` files renamed into this format."""
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("mp_rank_*_model_states.pt"))
    for r, f in enumerate(files):
        (dst / f"shard-{r:02d}-of-{len(files):02d}.pt").write_bytes(f.read_bytes())
    return dst
