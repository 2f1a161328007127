"""Which format a conversion's output is written in (one place for the planners and the front ends)."""

from __future__ import annotations

from pathlib import Path

from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.source import SourceCheckpoint
from reshard.formats.base import CheckpointFormat
from reshard.formats.registry import get_format, registry, writable


def output_format(source: SourceCheckpoint, options: ReshardOptions) -> CheckpointFormat:
    """``--to``, else the format the source's format writes as (itself, unless read-only).

    A per-rank layout is only written from its own kind of source (its top-level entries and
    file naming are the source's); a layout of global tensors (torch_dist) from any."""
    out = _chosen(source, options)
    if options.max_shard_size is not None and not out.cuts_files():
        raise LayoutError(f"the {out.title or out.name} layout is not written in size-limited shards",
                          culprit="--max-shard-size",
                          hint="drop --max-shard-size (it sizes --to hf and --to torch_dist files)")
    return out


def _chosen(source: SourceCheckpoint, options: ReshardOptions) -> CheckpointFormat:
    fmt = get_format(source.format)
    own = get_format(fmt.writes_as or source.format)
    if options.to is None or options.to == own.name:
        return own
    if options.to not in registry or not get_format(options.to).writes:
        known = "unknown output format" if options.to not in registry else "reshard reads but does not write"
        raise LayoutError(f"{known} {options.to!r}", culprit="--to", hint=f"choose one of {', '.join(writable())}")
    out = get_format(options.to)
    if out.per_rank:
        raise LayoutError(f"cannot write a {fmt.title or fmt.name} checkpoint in the {out.title or out.name} layout",
                          culprit="--to", hint=f"use --to {own.name}, or --to a layout of global tensors (torch_dist)")
    return out


def weights_read(options: ReshardOptions) -> frozenset[str]:
    """The weights (``--weights`` values) a conversion under ``options`` reads: its own, and those
    its output format is written from (a universal checkpoint's optimizer states). A source format
    fetches and opens the ZeRO optimizer files only when this holds more than ``module``."""
    sets = {options.weights}
    if options.to is not None and options.to in registry:
        sets.update(get_format(options.to).weight_sets(options))
    return frozenset(sets)


def carried_files(source: SourceCheckpoint, out: CheckpointFormat) -> tuple[dict[str, Path], list[str]]:
    """The source's carried files (its tokenizer and generation config: ``Locating.carried``) as the
    output holds them (output name -> source file, copied unchanged), and the warning naming those
    the output's layout has no place for (none, or one line)."""
    kept: dict[str, Path] = {}
    lost: list[str] = []
    for name, path in sorted(get_format(source.format).carried(source).items()):
        where = out.carried_name(source, name)
        if where is None:
            lost.append(name)
        else:
            kept[where] = path
    if not lost:
        return kept, []
    more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
    return kept, [f"dropped {', '.join(lost[:3])}{more} of the source: the {out.title or out.name} layout has no "
                  "place for them"]
