"""``--merge-adapter``: the source as the planner and the engine read it, with a LoRA adapter merged
into its base weights (:func:`reshard.formats.megatron_peft.merged`: lazy, box by box, in float32).

Why here and not in the formats' ``opened``: reading the adapter is the torch_dist format's work,
and a format's base class may not import a format. Every place of the conversion that reads the
source's weights reads them through :func:`read` (the planner's view) or :func:`opened` (one file,
the engine's), so no output can be written from the unmerged base."""

from __future__ import annotations

import dataclasses
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import SourceRead
from reshard.core.source import SourceCheckpoint
from reshard.formats.base import CheckpointFormat
from reshard.formats.megatron_peft import merged


def opened(fmt: CheckpointFormat, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
    """``fmt.opened``, the adapter merged in where one is given."""
    state = fmt.opened(source, options, index)
    return state if options.merge_adapter is None else merged(state, source, options.merge_adapter)


def read(fmt: CheckpointFormat, source: SourceCheckpoint, options: ReshardOptions, *,
         headers_only: bool = False) -> SourceRead:
    """``fmt.read``, the adapter merged into the rows' module dicts where one is given (a source of
    one file: :func:`~reshard.formats.megatron_peft.merged` refuses shards)."""
    got = fmt.read(source, options, headers_only=headers_only)
    if options.merge_adapter is None:
        return got
    src = got.source or source
    shards = [merged(s, src, options.merge_adapter, got.module_key) for s in got.shards]
    if len(shards) != 1 or len(got.stages) != 1:
        raise LayoutError(f"the base is read as {len(shards)} files; the adapter is merged into whole weights",
                          culprit="--merge-adapter", hint="merge into the base's torch_dist or Hugging Face checkpoint")
    stages = [dataclasses.replace(got.stages[0], modules=[shards[0][got.module_key]])]
    return dataclasses.replace(got, shards=shards, stages=stages)
