"""What an on-disk checkpoint format answers, without reading tensor bytes.

A format is one module holding one :class:`CheckpointFormat` subclass, registered in
:mod:`reshard.formats.registry`. Locating a checkpoint asks every registered format, in
``priority`` order, whether a folder (or file) holds it; the first that does lays the files out
as a :class:`~reshard.core.source.SourceCheckpoint` grid for the planner. Remote discovery
fetches exactly the objects some format's ``patterns`` name.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.safe_load import load_shard
from reshard.core.shard_check import RANK, check_shard_file
from reshard.core.source import SourceCheckpoint

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan
    from reshard.core.torch_writer import SaveStats


class CheckpointFormat(ABC):
    """One on-disk layout. Subclasses set the class attributes and implement :meth:`detect` and
    :meth:`locate` (and :meth:`detect_file` if the format is a single file, like a descriptor)."""

    #: Registry key, also ``SourceCheckpoint.format`` of what it locates (unless it delegates).
    name: ClassVar[str]
    #: Detection order: lower first (a Megatron-LM run folder before a plain folder of files).
    priority: ClassVar[int] = 100
    #: Names (relative to the checkpoint's root) of the files holding the weights; remote
    #: discovery fetches the objects that match any registered format's patterns or markers.
    patterns: ClassVar[tuple[re.Pattern[str], ...]] = ()
    #: Names of small files that tell where the weights are (``latest`` markers, descriptors):
    #: fetched whole before the checkpoint is located.
    markers: ClassVar[tuple[re.Pattern[str], ...]] = ()

    def detect(self, folder: Path) -> bool:
        """Does this local folder hold a checkpoint of this format? (Names only.)"""
        return False

    def detect_file(self, path: Path) -> bool:
        """Is this local file a checkpoint of this format (e.g. a descriptor)? (Names only.)"""
        return False

    @abstractmethod
    def locate(self, path: Path) -> SourceCheckpoint:
        """The checkpoint at ``path`` as a validated grid of files; raises
        :class:`~reshard.core.errors.CheckpointFormatError` naming the file and the fix."""

    # -- reading -----------------------------------------------------------------------------
    def shard_role(self, name: str, listing: Sequence[str]) -> str | None:
        """The role of ``name`` (relative to the checkpoint's root) in this format, given the whole
        ``listing``; None when it is not this format's file. Default: a weight file is a rank file."""
        return RANK if any(p.search(name) for p in self.patterns) else None

    def needed_ranges(self, name: str, markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
        """The ``(offset, length)`` byte ranges of object ``name`` (relative to the checkpoint's
        root) a conversion reads, known from the fetched ``markers`` (name -> local path); None:
        the whole object (or not this format's file)."""
        return None

    def check_file(self, path: str, role: str, module_key: str, where: str) -> dict[str, Any]:
        """The per-shard check of one fetched file (see :mod:`reshard.core.shard_check`)."""
        return check_shard_file(path, role, module_key, where, load=self.load)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """One file's state dict (tensors may be lazy: memory-mapped), the module under ``module``
        or ``model``. Default: a torch zip file through the weights-only loader and allowlist."""
        return load_shard(path)

    def check_saved_degrees(self, args: Any, source: SourceCheckpoint) -> None:
        """Refuse a partial copy when the saved ``args`` name more ranks than were found."""

    #: Megatron's vocabulary padding divisor when neither ``--make-vocab-size-divisible-by`` nor the
    #: saved ``args`` give one (None: keep the source's rows). A format of unpadded vocabularies
    #: (Hugging Face) sets Megatron-LM's default, so its import pads as Megatron-LM would.
    vocab_divisor: ClassVar[int | None] = None

    def padding_tp(self, args: Any, source: SourceCheckpoint) -> int:
        """The TP degree the vocabulary rows were padded for (Megatron pads to a multiple of
        ``make_vocab_size_divisible_by * TP``): the grid's TP, unless the format stores global
        tensors saved at another TP."""
        return source.tp

    # -- writing (outputs are written in the format they were read in, or in ``writes_as``) ------
    #: The format outputs are written in when this one is read (None: this one).
    writes_as: ClassVar[str | None] = None
    #: Does this layout hold one file per tensor-parallel rank (else global tensors, TP-free)?
    per_rank: ClassVar[bool] = True
    #: Can this layout hold several pipeline stages of per-rank files?
    writes_pipeline_stages: ClassVar[bool] = False
    #: Megatron-LM's ``args.ckpt_format`` for this layout (written into the output's ``args``).
    ckpt_format: ClassVar[str | None] = None
    #: How errors name the layout (default: ``name``).
    title: ClassVar[str] = ""

    def check_target(self, target_pp: int) -> None:
        """Refuse a target layout this format cannot write."""
        if target_pp != 1 and not self.writes_pipeline_stages:
            raise LayoutError(f"cannot write {target_pp} pipeline stages in the {self.title or self.name} layout",
                              culprit="--target-pp", hint="pipeline stages can be changed for Megatron-LM "
                                                          "(iter_*/mp_rank_XX_YYY) checkpoints; use --target-pp 1")

    def check_plan(self, plan: Plan) -> None:
        """Refuse a validated plan this format cannot write (e.g. a naming it has no place for)."""

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        """Path, relative to the destination, of the output file of (tp_rank, pp_rank)."""
        raise LayoutError(f"the {self.name} format is read-only here: reshard cannot write it", culprit=source.origin,
                          hint="convert to a format reshard writes (DeepSpeed or Megatron-LM layout)")

    def file_groups(self, sizes: Sequence[int], options: ReshardOptions) -> list[int]:
        """A layout of global tensors written as several files: where its one target is cut, as the
        index of each file's first parameter (``sizes``: the parameters' bytes, in order). Default:
        one file."""
        return [0]

    def part_name(self, name: str, part: int, parts: int) -> str:
        """The name of file ``part`` of ``parts`` of target ``name`` (see :meth:`file_groups`)."""
        return name

    def prepare(self, plan: Plan, tgt: int, sd: dict[str, Any]) -> Any:
        """What :meth:`write` is given for target ``tgt``, from its state dict (tensors pending).
        Default: the state dict itself; a format that renames or splits tensors does it here."""
        return sd

    def describe(self, plan: Plan) -> list[str]:
        """Lines about what this output is, for the run's summary and the flow's report (e.g. the
        architecture a Hugging Face export was given, and why). Default: none."""
        return []

    def extra_files(self, source: SourceCheckpoint) -> dict[str, str]:
        """Small text files the output needs whatever its targets (e.g. a ``latest`` marker)."""
        return {}

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str | bytes]:
        """Small files written beside the outputs once their names are known (a descriptor, an index)."""
        return {}

    def write(self, obj: Any, path: str | os.PathLike[str], *, pickle_module: Any = None, sha256: bool = False,
              on_bytes: Callable[[int], None] | None = None) -> SaveStats:
        """Write one output file from ``obj`` (a state dict whose tensors may be pending, see
        :mod:`reshard.core.torch_writer`). Default: exactly the bytes ``torch.save`` writes, streamed."""
        from reshard.core import torch_writer

        return torch_writer.save(obj, path, pickle_module=pickle_module, sha256=sha256, on_bytes=on_bytes)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_contiguous(ranks: list[int], where: str) -> None:
    """Ranks must be exactly 0..N-1 (a gap is a missing file, an extra one a stray)."""
    expected = list(range(len(ranks)))
    if ranks != expected:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(
            f"rank files are not 0..N-1: found ranks {ranks}" + (f", missing {missing}" if missing else ""),
            culprit=where, hint="copy the missing rank files, or remove stray extra ones")
