"""Identities that make caching and resume safe (no Prefect imports here).

* ``code_version``: the tool version plus a hash of the code that decides output bytes — every
  module of the reshard package (the core's tensor math, the formats' readers and writers, the
  model families' rules and name tables, the planner) and the module of every format and model
  family registered from outside it (a plugin). Any change to them invalidates every cached
  conversion: a resumed flow never reuses an output written by other code, and ``--direct``
  never calls such an output up to date. (Hashing the whole package over-invalidates on a change
  to, say, the CLI's help text: a re-conversion, never a stale output.)
* ``conversion_id``: what decides the output bytes — the source shards' identities (URL + ETag
  or size + mtime), the options, and the code version. Two runs with the same id produce the
  same files, so finished work from one may be reused by the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from reshard.version import __version__

#: The reshard package's folder.
PACKAGE = Path(__file__).resolve().parent.parent


def code_version() -> str:
    """``<version>+<hash>`` of the reshard package's sources and of the registered plugins'
    modules (see the module docstring); the package is hashed on first use, not at import."""
    h = hashlib.sha256(_package_hash().encode())
    for path in sorted(_plugin_sources()):
        h.update(path.encode())
        h.update(_file_hash(path, *_stamp(path)).encode())
    return f"{__version__}+{h.hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def _package_hash() -> str:
    """Every ``*.py`` file under the package, by relative path (renaming a module counts)."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE.rglob("*.py")):
        h.update(p.relative_to(PACKAGE).as_posix().encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def _plugin_sources() -> set[str]:
    """The source files of the registered formats, model families and Hugging Face architectures
    defined outside the package (third parties': entry points or ``register_*`` calls)."""
    from reshard.formats.registry import registry as formats
    from reshard.models.hf_registry import registry as hf_architectures
    from reshard.models.registry import registry as families

    files = set()
    for item in (*formats.values(), *families.values(), *hf_architectures.values()):
        module = sys.modules.get(type(item).__module__)
        path = getattr(module, "__file__", None)
        if path and not Path(path).resolve().is_relative_to(PACKAGE):
            files.add(str(Path(path).resolve()))
    return files


def _stamp(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest(*parts: Any) -> str:
    """Stable short hash of JSON-able parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def conversion_id(source_objects: Iterable[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
    """Identity of a conversion's output bytes (destination-independent)."""
    objs = sorted((o["name"], o["size"], o.get("etag")) for o in source_objects)
    for option, flag in (("merge_adapter", "--merge-adapter"), ("quantize_like", "--quantize-like")):
        folder = options.get(option)
        if folder:  # the adapter's, the release's files change the output bytes as the source's do
            root = Path(folder)
            objs += sorted((f"{flag}/{p.relative_to(root)}", p.stat().st_size, p.stat().st_mtime_ns)
                           for p in root.rglob("*") if p.is_file())
    return digest("conversion", objs, dict(options), code_version())
