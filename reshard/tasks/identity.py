"""Identities that make caching and resume safe (no Prefect imports here).

* ``code_version``: the tool version plus a hash of the core engine's sources — a change to
  the tensor math invalidates every cached conversion.
* ``conversion_id``: what decides the output bytes — the source shards' identities (URL + ETag
  or size + mtime), the options, and the code version. Two runs with the same id produce the
  same files, so finished work from one may be reused by the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from reshard import __version__


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<version>+<hash of reshard/core/*.py>``; computed on first use, not at import."""
    core = Path(__file__).resolve().parent.parent / "core"
    h = hashlib.sha256()
    for p in sorted(core.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


def digest(*parts: Any) -> str:
    """Stable short hash of JSON-able parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def conversion_id(source_objects: Iterable[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
    """Identity of a conversion's output bytes (destination-independent)."""
    objs = sorted((o["name"], o["size"], o.get("etag")) for o in source_objects)
    return digest("conversion", objs, dict(options), code_version())
