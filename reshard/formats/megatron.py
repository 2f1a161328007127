"""Megatron-LM's own layout: a run folder (``latest_checkpointed_iteration.txt`` naming the
iteration) or one iteration folder (``iter_XXXXXXX`` / ``release``), with one
``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per tensor-parallel rank ``TT``, pipeline stage
``PPP`` (only when PP > 1) and expert-parallel rank ``EEE`` (only when EP > 1: MoE), the module
under ``model`` and Megatron's ``args`` beside it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointFormatError
from reshard.core.experts import check_expert_tp, rank_files
from reshard.core.options import ReshardOptions
from reshard.core.pipeline_stages import STAGE_ARG_NAMES, StageLayout, chunk_keys
from reshard.core.source import (
    ITER_DIR_RE,
    MEGATRON,
    MEGATRON_FILE,
    MEGATRON_LATEST,
    MEGATRON_RANK_DIR_RE,
    SourceCheckpoint,
    iteration_dir,
    iteration_text,
    megatron_file_name,
)
from reshard.formats.base import CheckpointFormat
from reshard.models.facts import int_arg

#: The folder of tokenizer files in a Megatron-LM iteration folder (Megatron-LM's and Megatron-Bridge's
#: ``save_tokenizer_assets``; Megatron-LM's ``HuggingFaceTokenizer`` loads it as ``--tokenizer-model``):
#: where a Megatron layout holds the files a conversion carries (a Hugging Face import's tokenizer
#: and generation config), in either Megatron-LM layout.
TOKENIZER_DIR = "tokenizer"
#: A file of it (a chat template folder one level down), relative to a run or iteration folder.
TOKENIZER_FILE = re.compile(rf"(^|/){TOKENIZER_DIR}/[^/.][^/]*(/[^/.][^/]*)?$")


def tokenizer_files(iteration: Path) -> dict[str, Path]:
    """The files of an iteration folder's :data:`TOKENIZER_DIR` (name inside it -> path)."""
    folder = iteration / TOKENIZER_DIR
    if not folder.is_dir():
        return {}
    found = sorted((*folder.glob("*"), *folder.glob("*/*")))
    return {p.relative_to(folder).as_posix(): p for p in found
            if p.is_file() and TOKENIZER_FILE.search(p.relative_to(iteration).as_posix())}


def tokenizer_name(source: SourceCheckpoint, name: str) -> str:
    """Where a Megatron-LM output holds the carried file ``name``: its iteration's :data:`TOKENIZER_DIR`."""
    return f"{source.iteration or 'release'}/{TOKENIZER_DIR}/{name}"


class MegatronFormat(CheckpointFormat):
    """Megatron-LM per-rank files: a run folder or one iteration folder of mp_rank_XX[_YYY]/model_optim_rng.pt."""

    name = MEGATRON
    priority = 10
    patterns = (re.compile(r"(^|/)mp_rank_\d+(_\d+){0,2}/model_optim_rng\.pt$"),)
    markers = (re.compile(r"(^|/)latest_checkpointed_iteration\.txt$"),)
    carries = (TOKENIZER_FILE,)

    def detect(self, folder: Path) -> bool:
        return (folder / MEGATRON_LATEST).is_file() or any(
            MEGATRON_RANK_DIR_RE.match(c.name) and c.is_dir() for c in folder.iterdir())

    def near_miss(self, folder: Path) -> str | None:
        """A run folder without its ``latest_checkpointed_iteration.txt``."""
        iters = sorted(c.name for c in folder.iterdir() if c.is_dir() and ITER_DIR_RE.match(c.name))
        if not iters:
            return None
        return f"a Megatron-LM run folder needs {MEGATRON_LATEST}, or point at one iteration folder ({iters[-1]})"

    def select_objects(self, names: Sequence[str], read: Callable[[str], bytes],
                       url: Callable[[str], str]) -> list[str] | None:
        """A run folder: only the iteration its ``latest_checkpointed_iteration.txt`` names (and the
        marker), whatever the layout inside (per-rank files or torch_dist)."""
        if MEGATRON_LATEST not in names:
            return None
        text = read(MEGATRON_LATEST).decode(errors="replace").strip()
        prefix = f"{iteration_dir(text) or text}/"
        kept = [n for n in names if n == MEGATRON_LATEST or n.startswith(prefix)]
        if len(kept) == 1 and len(names) > 1:
            raise CheckpointFormatError(f"names iteration {text} but {prefix} does not exist",
                                        culprit=url(MEGATRON_LATEST),
                                        hint="point at an existing iteration folder instead")
        return kept

    writes_pipeline_stages = True
    holds_experts = True
    ckpt_format = "torch"

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0,
                    ep: int = 1) -> str:
        return megatron_file_name(source.iteration or "release", tp_rank, pp_rank, pp, ep_rank, ep)

    def extra_files(self, source: SourceCheckpoint) -> dict[str, str]:
        return {MEGATRON_LATEST: iteration_text(source.iteration or "release")}

    def carried(self, source: SourceCheckpoint) -> dict[str, Path]:
        return tokenizer_files(Path(source.files[0]).parent.parent)  # iter_X/mp_rank_TT/model_optim_rng.pt

    def carried_name(self, source: SourceCheckpoint, name: str) -> str | None:
        return tokenizer_name(source, name)

    def axes(self, args: Any, source: SourceCheckpoint) -> SourceCheckpoint:
        """``mp_rank_TT_NNN`` is pipeline stage NNN, or expert-parallel rank NNN when the saved args
        say EP > 1 and PP 1 (Megatron-LM names the folder the same way for both). Ranks missing from
        the grid are the pairs no process held when the experts' TP differs from the TP
        (:func:`~reshard.core.experts.rank_files`); else a rank folder is missing."""
        if source.ep == 1 and source.pp > 1 and int_arg(args, "pipeline_model_parallel_size") == 1 and \
                int_arg(args, "expert_model_parallel_size") == source.pp:
            source = replace(source, pp=1, ep=source.pp)
        etp = int_arg(args, "expert_tensor_parallel_size") if int_arg(args, "num_experts") else None
        if etp is None or etp == source.tp:
            _refuse_holes(source)
            return source
        check_expert_tp(etp, source.tp, source.origin, "convert it from the torch_dist checkpoint of the same run "
                                                       "(--ckpt-format torch_dist)")
        return _expert_grid(replace(source, etp=etp))

    def chunked(self, first: dict[str, Any], source: SourceCheckpoint) -> SourceCheckpoint:
        """Files of the interleaved pipeline hold ``model0 .. model{V-1}`` (and no ``model``): a grid
        of V times the pipeline ranks' rows, virtual stage first (megatron-core's chunk order). The
        saved args must say V virtual stages (a ``model{i}`` they do not explain is refused)."""
        keys = chunk_keys(first)
        args = first.get("args")
        saved = _saved_virtual_stages(args, source)
        if not keys or "model" in first:
            if saved > 1:
                raise CheckpointFormatError(f"args say {saved} virtual pipeline stages but the rank file holds one "
                                            f"model, not model0..model{saved - 1}", culprit=str(source.files[0]),
                                            hint="the saved args do not describe these files")
            return source
        _check_chunk_keys(keys, len(keys), str(source.files[0]))
        if args is not None and saved != len(keys):
            raise CheckpointFormatError(f"holds {len(keys)} model chunks ({keys[0]}..{keys[-1]}) but its args say "
                                        f"{saved} virtual pipeline stage{'s' if saved > 1 else ''}",
                                        culprit=str(source.files[0]), hint="the saved args do not describe these files")
        v = len(keys)
        return replace(source, files=source.files * v, pp=source.pp * v, chunks=v)

    def open(self, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
        """A rank file; of the interleaved pipeline, the view of one model chunk: its top-level
        entries with that chunk's ``model{v}`` as ``model``, where the chunks stood."""
        sd = super().open(source, options, index)
        if source.chunks == 1:
            return sd
        where = str(source.files[index])
        keys = chunk_keys(sd)
        _check_chunk_keys(keys, source.chunks, where)
        chunk = f"model{source.chunk_of(index)}"
        view: dict[str, Any] = {}
        for k, v in sd.items():
            if k not in keys:
                view[k] = v
            elif k == keys[0]:
                view["model"] = sd[chunk]
        return view

    def check_saved_degrees(self, args: Any, source: SourceCheckpoint) -> None:
        for name, found, what in (("tensor_model_parallel_size", source.tp, "tensor-parallel ranks"),
                                  ("pipeline_model_parallel_size", source.pipeline_ranks, "pipeline stages"),
                                  ("expert_model_parallel_size", source.ep, "expert-parallel ranks")):
            saved = int_arg(args, name)
            if saved is not None and saved != found:
                raise CheckpointFormatError(f"args.{name} is {saved} but {found} {what} were found",
                                            culprit=source.origin, hint="supply all rank folders of the checkpoint")

    def locate(self, path: Path) -> SourceCheckpoint:
        if (path / MEGATRON_LATEST).is_file():
            return _locate_run(path)
        return _locate_iteration(path, str(path))


def _saved_virtual_stages(args: Any, source: SourceCheckpoint) -> int:
    """The virtual stages per pipeline rank the saved args describe (1: none, or no args)."""
    num_layers = int_arg(args, "num_layers")
    if args is None or num_layers is None or not any(getattr(args, n, None) for n in STAGE_ARG_NAMES):
        return 1
    ranks = int_arg(args, "pipeline_model_parallel_size") or source.pp  # as saved: a partial copy is refused later
    return StageLayout.from_args(args, num_layers, ranks, f"{source.origin} (saved args)").vpp


def _check_chunk_keys(keys: list[str], chunks: int, where: str) -> None:
    """A rank file of the interleaved pipeline holds exactly ``model0 .. model{chunks-1}``."""
    want = [f"model{i}" for i in range(chunks)]
    if keys != want:
        missing = sorted(set(want) - set(keys), key=lambda k: int(k[5:]))
        what = f"lacks {', '.join(missing)}" if missing else f"holds {', '.join(k for k in keys if k not in want)}"
        raise CheckpointFormatError(f"{what}: a rank file of this interleaved pipeline holds model0..model{chunks - 1}",
                                    culprit=where, hint="copy the complete rank file (every model chunk)")


def _where(source: SourceCheckpoint, row: int) -> str:
    return f"stage {row // source.ep}" + (f", expert-parallel rank {row % source.ep}" if source.ep > 1 else "")


def _refuse_holes(source: SourceCheckpoint) -> None:
    """A grid position without a file is a missing rank folder."""
    if source.holes:
        row = source.holes[0] // source.tp
        missing = [i % source.tp for i in source.holes if i // source.tp == row]
        raise CheckpointFormatError(f"{_where(source, row)} lacks tensor-parallel ranks {missing}",
                                    culprit=source.origin, hint="copy the missing rank folders")


def _expert_grid(source: SourceCheckpoint) -> SourceCheckpoint:
    """The grid of a checkpoint saved with the experts' TP (``etp``) below the TP, its holes filled
    with the files holding what the planner reads there: position ``t`` of a stage's EP rank 0
    row gives the dense TP rank ``t`` (and for ``t < etp`` EP rank 0's expert slice ``t``); position
    ``t < etp`` of EP rank ``e``'s row gives EP rank ``e``'s expert slice ``t``, which every file
    ``(t', e)`` with ``t' % etp == t`` holds; its other positions repeat those (never read for experts)."""
    tp, etp, ep = source.tp, source.expert_tp, source.ep
    expected = set(rank_files(tp, etp, ep))
    holes = set(source.holes)
    files = list(source.files)
    for stage in range(source.pp):
        at = {(t, e): source.index(stage * ep + e, t) for e in range(ep) for t in range(tp)}
        stray = sorted(pair for pair in at if pair not in expected and at[pair] not in holes)
        if stray:  # e.g. args that say ETP 1 of files split over the TP
            t, e = stray[0]
            raise CheckpointFormatError(f"{_where(source, stage * ep + e)} has a rank folder for tensor-parallel rank "
                                        f"{t}, which no process saves when the experts' TP is {etp} (args."
                                        f"expert_tensor_parallel_size)", culprit=source.origin,
                                        hint="the saved args do not describe these files: fix "
                                             "expert_tensor_parallel_size, or remove stray folders")
        missing = sorted(pair for pair in expected if at[pair] in holes)
        if missing:
            t, e = missing[0]
            raise CheckpointFormatError(f"{_where(source, stage * ep + e)} lacks tensor-parallel rank {t} (the "
                                        f"experts' TP is {etp}: {len(expected)} rank folders per stage)",
                                        culprit=source.origin, hint="copy the missing rank folders")
        for (t, e), i in at.items():
            if i not in holes:
                continue
            if e == 0:  # the dense TP rank t, from the first EP rank holding it
                files[i] = source.files[next(at[(t, x)] for x in range(ep) if (t, x) in expected)]
            else:  # EP rank e's expert slice t % etp
                files[i] = source.files[next(at[(u, e)] for u in range(tp)
                                             if (u, e) in expected and u % etp == t % etp)]
    return replace(source, files=tuple(files), holes=())


def _locate_run(run: Path) -> SourceCheckpoint:
    """A Megatron-LM run folder: ``latest_checkpointed_iteration.txt`` names the iteration."""
    return _locate_iteration(iteration_folder(run), str(run))


def iteration_folder(run: Path) -> Path:
    """The iteration folder a Megatron-LM run folder's ``latest_checkpointed_iteration.txt`` names
    (shared by every Megatron-LM layout: per-rank files and torch_dist)."""
    latest = run / MEGATRON_LATEST
    text = latest.read_text().strip()
    name = iteration_dir(text)
    if name is None:
        raise CheckpointFormatError(f"holds {text[:40]!r}, not an iteration number or 'release'",
                                    culprit=str(latest), hint="point at the iteration folder instead")
    folder = run / name
    if not folder.is_dir():
        raise CheckpointFormatError(f"names iteration {text} but {name}/ does not exist", culprit=str(latest),
                                    hint="point at an existing iteration folder instead")
    return folder


def _locate_iteration(folder: Path, origin: str) -> SourceCheckpoint:
    """An iteration folder of ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` files, as a grid of
    (stage, expert-parallel rank) rows of TP files. A two-number folder ``mp_rank_TT_NNN`` is
    taken as stage NNN here; the saved args may make it an expert-parallel rank
    (:meth:`MegatronFormat.axes`), which changes no file's place in the grid."""
    grid: dict[tuple[int, int, int], Path] = {}
    numbers: set[int] = set()
    for child in sorted(folder.iterdir()):
        m = MEGATRON_RANK_DIR_RE.match(child.name)
        if not (m and child.is_dir()):
            continue
        f = child / MEGATRON_FILE
        if not f.is_file():
            raise CheckpointFormatError(f"{child.name}/ holds no {MEGATRON_FILE}", culprit=str(folder),
                                        hint="copy the missing rank file (distributed-optimizer files alone "
                                             "hold no weights)")
        tp, pp, ep = (int(g) if g is not None else 0 for g in m.groups())
        numbers.add(sum(g is not None for g in m.groups()))
        if (pp, ep, tp) in grid:
            raise CheckpointFormatError(f"{child.name} appears twice", culprit=str(folder),
                                        hint="keep exactly one folder per rank")
        grid[(pp, ep, tp)] = f
    if len(numbers) > 1:
        raise CheckpointFormatError("mixes mp_rank_TT, mp_rank_TT_NNN and mp_rank_TT_PPP_EEE folders",
                                    culprit=str(folder), hint="remove stray folders from another parallel layout")
    n_pp, n_ep, n_tp = (1 + max(key[i] for key in grid) for i in range(3))
    files: list[Path] = []
    holes: list[int] = []
    for stage in range(n_pp):
        for expert_rank in range(n_ep):
            ranks = sorted(tp for pp, ep, tp in grid if (pp, ep) == (stage, expert_rank))
            if not ranks:
                where = f"stage {stage}" + (f", expert-parallel rank {expert_rank}" if n_ep > 1 else "")
                raise CheckpointFormatError(f"{where} has no rank folders", culprit=str(folder),
                                            hint="copy the missing mp_rank_* folders")
            for t in range(n_tp):  # a missing rank is a hole until the saved args explain it (axes)
                if (stage, expert_rank, t) not in grid:
                    holes.append(len(files))
                files.append(grid.get((stage, expert_rank, t), grid[(stage, expert_rank, ranks[0])]))
    return SourceCheckpoint(tuple(files), origin=origin, format=MEGATRON, pp=n_pp, ep=n_ep, iteration=folder.name,
                            holes=tuple(holes))
