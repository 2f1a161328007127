"""On-disk checkpoint formats, as plug-ins (see :mod:`reshard.formats.base`).

``locate(path)`` asks the registered formats, in priority order, which one holds ``path`` and
returns its :class:`~reshard.core.source.SourceCheckpoint`; ``listing_patterns()`` are the
object names remote discovery fetches. Built-in (:mod:`reshard.formats.registry`): megatron-core's
torch_dist, Megatron-LM folders (legacy and megatron-core per-rank), DeepSpeed pipeline layer files,
DeepSpeed ``mp_rank_XX`` files and descriptors, ZeRO stage 3 engine folders (read with ``--weights
master``), Hugging Face safetensors folders (FP8 blocks included) and DeepSpeed universal
checkpoints. Add one with :func:`register_format` or the ``reshard.formats`` entry-point group.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointFormatError
from reshard.core.options import ReshardOptions
from reshard.core.shard_check import METADATA
from reshard.core.source import SourceCheckpoint
from reshard.formats.base import CheckpointFormat
from reshard.formats.output import weights_read
from reshard.formats.registry import available, get_format, register_format, registry, unregister_format, writable

__all__ = ["CheckpointFormat", "ObjectClass", "available", "check_file", "classify", "descriptor_entries",
           "get_format", "listing_patterns", "locate", "needed_ranges", "register_format", "registry",
           "select_objects", "skeleton_ranges", "unregister_format", "writable"]


def locate(src: str | Path) -> SourceCheckpoint:
    """The checkpoint at ``src`` (a local folder or file), laid out by the format that holds it."""
    p = Path(src)
    if not p.exists():
        raise CheckpointFormatError("no such file or folder", culprit=str(p), hint="check the path")
    formats = available()
    if p.is_dir():
        for fmt in formats:
            if fmt.detect(p):
                return fmt.locate(p)
        raise _no_format(p)
    for fmt in formats:
        if fmt.detect_file(p):
            return fmt.locate(p)
    raise CheckpointFormatError("is a file that is no checkpoint descriptor", culprit=str(p),
                                hint=f"pass the folder that holds it ({p.parent}); a single file is read only as a "
                                     "DeepSpeed descriptor JSON")


def listing_patterns(options: ReshardOptions | None = None) -> tuple[re.Pattern[str], ...]:
    """Names (relative to a checkpoint's root) that some registered format reads (under ``options``:
    with the files only some options read)."""
    weights = weights_read(options) if options is not None else None
    extra = [p for fmt in available() for p in fmt.optional_patterns(weights)] if weights is not None else []
    return tuple(p for fmt in available() for p in (*fmt.patterns, *fmt.markers, *fmt.carries)) + tuple(extra)


def select_objects(names: Sequence[str], read: Callable[[str], bytes], url: Callable[[str], str]) -> list[str]:
    """The objects of a remote folder's listing a conversion needs: the first format whose markers
    narrow it decides (see :meth:`CheckpointFormat.select_objects`); else all of them."""
    for fmt in available():
        kept = fmt.select_objects(names, read, url)
        if kept is not None:
            return kept
    return list(names)


def descriptor_entries(raw: bytes, where: str) -> list[str]:
    """The objects a remote descriptor lists, relative to its folder (the first format that reads it)."""
    for fmt in available():
        entries = fmt.descriptor_entries(raw, where)
        if entries is not None:
            return entries
    raise CheckpointFormatError("is a file but no registered format reads it as a checkpoint descriptor",
                                culprit=where, hint="point at the folder that holds the checkpoint's files")


@dataclass(frozen=True)
class ObjectClass:
    """What one listed object is to a conversion, decided once, at discovery, by the registered
    formats; every later step (fetch order, byte ranges, streaming, per-shard checks) reads this
    record instead of asking the formats again.

    ===========  ==================================================================================
    field        meaning
    ===========  ==================================================================================
    ``marker``   a small file that tells where the weights are (``latest_checkpointed_iteration.txt``,
                 ``.metadata``, ``config.json``): fetched first and whole; the others' ranges need it.
                 Also a file the conversion copies into its output (a tokenizer: a format's ``carries``)
    ``reader``   the format whose ``patterns`` name it as weights (its :meth:`~CheckpointFormat.skeleton`
                 decides whether it streams); None for markers and files no format reads as weights
    ``checker``  the format that checks it on its own once fetched (:meth:`~CheckpointFormat.shard_role`);
                 None: read by the locator, not checked one by one
    ``role``     its role for ``checker`` (``rank``, ``pipe-rank``, ``layer``), or ``metadata``
    ===========  ==================================================================================
    """

    marker: bool
    reader: str | None
    checker: str | None
    role: str

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> ObjectClass:
        return cls(**rec)


def classify(names: Sequence[str]) -> dict[str, ObjectClass]:
    """Every name of a source's listing (relative to its root) classified once, in one pass over
    the registered formats in priority order (see :class:`ObjectClass`)."""
    formats = available()
    out: dict[str, ObjectClass] = {}
    for name in names:
        weights = [f for f in formats if any(p.search(name) for p in f.patterns)]
        marker = not weights and any(p.search(name) for f in formats for p in (*f.markers, *f.carries))
        checker, role = None, METADATA
        if not marker:
            for fmt in formats:
                claimed = fmt.shard_role(name, names)
                if claimed is not None:
                    checker, role = fmt.name, claimed
                    break
        out[name] = ObjectClass(marker=marker, reader=None if marker or not weights else weights[0].name,
                                checker=checker, role=role)
    return out


def needed_ranges(name: str, markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
    """``(offset, length)`` byte ranges of the object ``name`` that a conversion reads, decided by
    the first format that knows from the fetched ``markers`` (name -> local path); None: all of it."""
    for fmt in available():
        ranges = fmt.needed_ranges(name, markers)
        if ranges is not None:
            return ranges
    return None


def skeleton_ranges(name: str, kind: ObjectClass, size: int, pread: Callable[[int, int], bytes],
                    markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
    """The ranges of the weight file ``name`` (classified as ``kind``) to fetch when the rest is
    read while converting, as its reader decides (:meth:`CheckpointFormat.skeleton`); None: fetch
    it whole (a marker, an unclaimed file, a format that cannot stream it)."""
    if kind.reader is None:
        return None
    return get_format(kind.reader).skeleton(name, size, pread, markers)


def check_file(path: str, fmt: str | None, role: str, module_key: str, where: str) -> dict[str, Any]:
    """The per-shard check of one fetched file by its checker (see :class:`ObjectClass`)."""
    if fmt is None or role == METADATA:
        return {"kind": METADATA}
    return get_format(fmt).check_file(path, role, module_key, where)


def _no_format(folder: Path) -> CheckpointFormatError:
    """What a folder that no format holds most likely is (the first format that recognizes an
    incomplete checkpoint of its own says what is missing), and what to do."""
    for fmt in available():
        hint = fmt.near_miss(folder)
        if hint:
            return CheckpointFormatError("holds no complete checkpoint reshard reads", culprit=str(folder), hint=hint)
    return CheckpointFormatError("holds no checkpoint reshard reads", culprit=str(folder),
                                 hint="point at a Megatron-LM run or iteration folder, a DeepSpeed global_stepN "
                                      "folder, a torch_dist folder or a Hugging Face folder (config.json and "
                                      "*.safetensors); `reshard formats` lists what is read")
