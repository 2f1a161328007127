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
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from reshard.core.checks import check_same_keys
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError
from reshard.core.plan_types import SourceRead, SourceStage
from reshard.core.safe_load import load_shard
from reshard.core.shard_check import RANK, check_shard_file
from reshard.core.source import SourceCheckpoint, choose_module_key
from reshard.models.megatron_gpt import expert_rows

if TYPE_CHECKING:
    import torch

    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan
    from reshard.core.torch_writer import SaveStats


class Locating(ABC):
    """Role 1 of a format — locating and discovery: which files (local or listed remotely) are this
    format's, which a conversion needs, what each is and which byte ranges of it are read, and the
    grid they form. Every format implements :meth:`detect` and :meth:`locate` (and
    :meth:`detect_file` if it is a single file, like a descriptor)."""

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
    #: Names of small files kept beside the weights that no weight depends on but the model's
    #: users do — a Hugging Face folder's tokenizer and generation config, Megatron-LM's
    #: ``tokenizer/`` folder: a conversion copies them into its output unchanged (see
    #: :meth:`carried`, :meth:`Writing.carried_name`); discovery lists and fetches them whole,
    #: with the markers.
    carries: ClassVar[tuple[re.Pattern[str], ...]] = ()
    #: How errors name the layout (default: ``name``).
    title: ClassVar[str] = ""
    #: Is this layout read (a source reshard converts from)? Listed by ``reshard formats``.
    reads: ClassVar[bool] = True

    def optional_patterns(self, weights: frozenset[str]) -> tuple[re.Pattern[str], ...]:
        """Names of files read only when a conversion reads some ``weights`` (the sets
        :func:`reshard.formats.output.weights_read` gives: the ZeRO optimizer files, for anything
        beyond ``module``): discovery fetches them then, and never otherwise. Given the sets, not
        the options, so a source format need not ask the registry what its output reads."""
        return ()

    def companions(self, source: SourceCheckpoint, weights: frozenset[str]) -> tuple[Path, ...]:
        """Files :meth:`open` reads besides ``source.files`` when a conversion reads ``weights``
        (see :meth:`optional_patterns`; the ZeRO optimizer files, for ``--weights master``): a
        pipeline that fetches shard by shard links them in before any file is opened. Default: none."""
        return ()

    def detect(self, folder: Path) -> bool:
        """Does this local folder hold a checkpoint of this format? (Names only.)"""
        return False

    def detect_file(self, path: Path) -> bool:
        """Is this local file a checkpoint of this format (e.g. a descriptor)? (Names only.)"""
        return False

    def near_miss(self, folder: Path) -> str | None:
        """For a folder that no format detects: if it looks like an incomplete checkpoint of this
        format, what is missing and what to do, in a few words (the fix of the one-line error);
        else None. Names only."""
        return None

    @abstractmethod
    def locate(self, path: Path) -> SourceCheckpoint:
        """The checkpoint at ``path`` as a validated grid of files; raises
        :class:`~reshard.core.errors.CheckpointFormatError` naming the file and the fix."""

    def carried(self, source: SourceCheckpoint) -> dict[str, Path]:
        """The files of ``source`` a conversion copies unchanged (see :attr:`carries`), under the
        names a Hugging Face folder gives them (``tokenizer.json``, ``generation_config.json``)
        -> their local paths. Default: none."""
        return {}

    # -- discovery (remote listings: names only, markers read whole) ----------------------------
    def select_objects(self, names: Sequence[str], read: Callable[[str], bytes],
                       url: Callable[[str], str]) -> list[str] | None:
        """Of a folder's listing (``names`` relative to its root, every object some format reads),
        the ones a conversion needs, when this format's markers decide it (e.g. only the iteration
        a Megatron-LM run's ``latest`` marker names); ``read(name)`` gives a marker's bytes and
        ``url(name)`` its URL for errors. None: this format does not narrow the listing."""
        return None

    def descriptor_entries(self, raw: bytes, where: str) -> list[str] | None:
        """The objects a single-file checkpoint (a descriptor) read from object storage lists, as
        paths relative to its folder; None: this format is no descriptor. (A local descriptor is
        read by :meth:`locate`, which may allow absolute paths.)"""
        return None

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

    def skeleton(self, name: str, size: int, pread: Callable[[int, int], bytes],
                 markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
        """Whether this format's weight file ``name`` (``size`` bytes, read by ``pread(n, offset)``)
        can be read while converting instead of fetched whole first (see :mod:`reshard.core.remote`):
        the ``(offset, length)`` ranges of it to keep on local disk as its stand-in — often none:
        :meth:`load` and :meth:`open` read the file's structure into memory through the source
        attached to the stand-in and hand out :class:`~reshard.core.remote.RemoteTensor` s — or None:
        fetch it whole. Default: a ``torch.save`` archive read by the default :meth:`load`
        streams (nothing on disk); a format with a loader of its own is fetched whole."""
        return [] if type(self).load is Reading.load else None



class Reading:
    """Role 2 of a format — reading: a file into a state dict (weights-only, lazily), the files as
    the conversion sees them under its options, and the planner's rows of the grid (checked for
    what one format can tell). Defaults read ``torch.save`` archives; a format overrides what its
    files hold differently."""

    #: Megatron's vocabulary padding divisor when neither ``--make-vocab-size-divisible-by`` nor the
    #: saved ``args`` give one (None: keep the source's rows). A format of unpadded vocabularies
    #: (Hugging Face) sets Megatron-LM's default, so its import pads as Megatron-LM would.
    vocab_divisor: ClassVar[int | None] = None

    #: Do the files hold Megatron's (or DeepSpeed's) state dicts, with a ``checkpoint_version`` and
    #: the module under a key? A Hugging Face folder's do not: its import is made as one (version
    #: 3, the module under ``model``), which is no fact of the folder's.
    state_dicts: ClassVar[bool] = True

    def quantization(self, source: SourceCheckpoint) -> dict[str, Any] | None:
        """How the stored weights are quantized, which the conversion reads dequantized (a
        Hugging Face folder's FP8 blocks: ``method``, ``format``, ``block``, ``scales``); None:
        they are not. From the small files alone (no tensor header). Default: None."""
        return None

    def inspected_as(self, source: SourceCheckpoint) -> str | None:
        """The output format ``inspect`` plans the checkpoint with (it describes the model as a
        conversion reads it, and a conversion has an output); None: the default output. A source
        that only one output can be made of names that one. Default: None."""
        return None

    def stored(self, source: SourceCheckpoint) -> dict[str, Any]:
        """What ``inspect`` shows of the files as stored, beyond the planner's view of the weights
        as a conversion reads them: the ``architecture`` they name, their stored ``dtypes``, and the
        :meth:`quantization` with the ``tensors`` it covers (count and ``names``, layer and expert
        numbers as ``*``). Default: nothing more."""
        return {}

    def check_file(self, path: str, role: str, module_key: str, where: str) -> dict[str, Any]:
        """The per-shard check of one fetched file (see :mod:`reshard.core.shard_check`)."""
        return check_shard_file(path, role, module_key, where, load=self.load)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """One file's state dict (tensors may be lazy: memory-mapped), the module under ``module``
        or ``model``. Default: a torch zip file through the weights-only loader and allowlist."""
        return load_shard(path)

    def open(self, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
        """File ``index`` of ``source`` as the conversion sees it under ``options``: what :meth:`load`
        reads, unless the options ask for other weights than the module's own (``--weights
        master``), which only a format that carries them provides. The planner and the engine
        read source files through this."""
        if options.weights != "module":
            raise LayoutError(f"--weights {options.weights} is not available for the {self.title or self.name} "
                              f"layout", culprit="--weights",
                              hint="optimizer states are read from DeepSpeed ZeRO checkpoints; drop the flag")
        return self.load(source.files[index])

    def opened(self, source: SourceCheckpoint, options: ReshardOptions, index: int) -> dict[str, Any]:
        """:meth:`open`, with the saved ``args`` supplemented by the model facts given another way
        (flags, ``--model-config``, Megatron-Bridge's ``run_config.yaml``: see
        :mod:`reshard.models.given_facts`). The planner and the engine read source files through
        this; formats override :meth:`open`, not this."""
        from reshard.models.given_facts import given_args

        return given_args(self.open(source, options, index), options, Path(source.files[index]))

    def read(self, source: SourceCheckpoint, options: ReshardOptions, *, headers_only: bool = False) -> SourceRead:
        """The planner's view of ``source``: its files' top-level entries and module dicts as rows
        of the (stage, TP rank) grid, each checked for what one format can tell (module key, same
        keys across a stage's ranks, saved degrees); the canonical names of the module keys. No
        tensor bytes are read (tensors are lazy). Default: every file holds top-level entries
        with the module under one key, and its keys are canonical names.

        ``headers_only``: read the first file of each stage alone and stand it in for every rank
        of its stage (see :func:`reshard.execution.plan.build_grid_plan`)."""
        first = self.opened(source, options, 0)
        source = self.axes(first.get("args"), source)  # the grid as the saved args explain it
        chunked = self.chunked(first, source)
        if chunked != source:  # the files hold model chunks: each grid position reads one
            source, first = chunked, self.opened(chunked, options, 0)
        n = source.tp
        opened = {(source.files[0], 0): first}

        def at(i: int) -> dict[str, Any]:
            at_i = (source.files[i], source.chunk_of(i))
            if at_i not in opened:  # a grid may repeat a file (expert TP, model chunks): read once per chunk
                opened[at_i] = self.opened(source, options, i)
            return opened[at_i]

        shards = [at(i // n * n if headers_only else i) for i in range(len(source.files))]
        names = [str(f) for f in source.files]
        module_key, modules = module_dicts(shards, names, options.module_key, n)
        self.check_saved_degrees(shards[0].get("args"), source)
        stages = [SourceStage(index=r, names=names[r * n:(r + 1) * n], modules=modules[r * n:(r + 1) * n],
                              pp_stage=r // source.ep, expert_rank=r % source.ep) for r in range(source.rows)]
        for st in stages:
            check_same_keys(st.modules, st.names)
        if source.ep > 1:
            stages = expert_rows(stages)
        return SourceRead(shards=shards, names=names, module_key=module_key, stages=stages, source=source)

    def axes(self, args: Any, source: SourceCheckpoint) -> SourceCheckpoint:
        """``source`` with its grid's rows read as the saved ``args`` say (pipeline stages or
        expert-parallel ranks), when its file names alone cannot tell. Default: as located."""
        return source

    def chunked(self, first: dict[str, Any], source: SourceCheckpoint) -> SourceCheckpoint:
        """``source`` as a grid of model chunks when its files hold several (Megatron-LM's
        interleaved pipeline: ``model0 ..`` per file; see :attr:`SourceCheckpoint.chunks`), from
        the first file (``first``, as opened) and its saved args. Default: as located."""
        return source

    def check_saved_degrees(self, args: Any, source: SourceCheckpoint) -> None:
        """Refuse a partial copy when the saved ``args`` name more ranks than were found."""

    def padding_tp(self, args: Any, source: SourceCheckpoint) -> int:
        """The TP degree the vocabulary rows were padded for (Megatron pads to a multiple of
        ``make_vocab_size_divisible_by * TP``): the grid's TP, unless the format stores global
        tensors saved at another TP."""
        return source.tp



class Writing:
    """Role 3 of a format — writing: its traits as data (class attributes: does it write, per rank
    or global tensors, pipeline stages, experts, what it keeps), the refusals of what it cannot
    write (:meth:`check_target`, :meth:`check_source`, :meth:`check_plan`), the output's names and
    files, and the writer. Outputs are written in the format they were read in, or in
    :attr:`writes_as`."""

    #: Is this layout written (a ``--to`` choice, or what a source of its own kind becomes)?
    writes: ClassVar[bool] = True
    #: The format outputs are written in when this one is read (None: this one).
    writes_as: ClassVar[str | None] = None
    #: Does this layout hold one file per tensor-parallel rank (else global tensors, TP-free)?
    per_rank: ClassVar[bool] = True
    #: Can this layout hold several pipeline stages of per-rank files?
    writes_pipeline_stages: ClassVar[bool] = False
    #: Megatron-LM's ``args.ckpt_format`` for this layout (written into the output's ``args``).
    ckpt_format: ClassVar[str | None] = None
    #: Can this layout hold MoE experts? A per-rank one then also has an expert-parallel axis
    #: (``target_name``'s ``ep_rank``/``ep``).
    holds_experts: ClassVar[bool] = False
    #: Can this layout hold FP8 block-scaled weights (``--quantize fp8``)?
    holds_fp8: ClassVar[bool] = False
    #: Can this layout hold MXFP4 weights (``--quantize mxfp4``)?
    holds_mxfp4: ClassVar[bool] = False
    #: Can this layout hold compressed-tensors' formats (``--quantize w4a16``, ``fp8-channel``, ``nvfp4``)?
    holds_compressed_tensors: ClassVar[bool] = False
    #: Can this layout hold a quantized release's own format (``--quantize like-source``)?
    holds_like_source: ClassVar[bool] = False
    #: Top-level entries of the source that this output keeps although a reshard drops them
    #: elsewhere (:data:`~reshard.core.plan_types.DROPPED_ENTRIES`): a universal checkpoint resumes
    #: training, so it keeps the LR scheduler.
    keeps: ClassVar[frozenset[str]] = frozenset()

    def kept_entries(self, source: SourceCheckpoint) -> frozenset[str]:
        """The top-level entries of ``source`` this output keeps (:attr:`keeps`; an output that
        carries a source's files whole keeps everything of them)."""
        return self.keeps

    def check_target(self, target_pp: int) -> None:
        """Refuse a target layout this format cannot write."""
        if target_pp != 1 and not self.writes_pipeline_stages:
            raise LayoutError(f"cannot write {target_pp} pipeline stages in the {self.title or self.name} layout",
                              culprit="--target-pp", hint="pipeline stages can be changed for Megatron-LM "
                                                          "(iter_*/mp_rank_XX_YYY) checkpoints; use --target-pp 1")

    def check_plan(self, plan: Plan) -> None:
        """Refuse a validated plan this format cannot write (e.g. a naming it has no place for)."""

    def plan_warnings(self, plan: Plan) -> list[str]:
        """What the user should know about writing ``plan`` that only the weights' values tell
        (one line each; the hf format's ``--quantize like-source`` re-encoding), run after
        :meth:`check_plan` on a plan whose source is fully at hand."""
        return []

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        """Path, relative to the destination, of the output file of (tp_rank, pp_rank). A layout that
        :attr:`holds_experts` also takes ``ep_rank=`` and ``ep=``, passed when EP > 1."""
        raise LayoutError(f"the {self.name} format is read-only here: reshard cannot write it", culprit=source.origin,
                          hint="convert to a format reshard writes (DeepSpeed or Megatron-LM layout)")

    def check_source(self, source: SourceCheckpoint, options: ReshardOptions) -> None:
        """Refuse, before anything is read, a source this output cannot be written from (a layout
        that needs what only some sources hold: a universal checkpoint, the ZeRO optimizer files)."""

    def read_weights(self, source: SourceCheckpoint, options: ReshardOptions) -> str:
        """The weights (a ``--weights`` value) the source is read as for this output: those its
        parameters and its targets without weights of their own come from. Default: ``--weights``
        (a DeepSpeed universal checkpoint of a ZeRO-3 run reads Adam's first moment: its files hold
        the trained parameters only, and its module files are placeholders)."""
        return options.weights

    def object_targets(self, source: SourceCheckpoint, options: ReshardOptions) -> dict[str, int]:
        """Output files that hold no parameter of the plan but a whole object of the source (a
        ZeRO-3 run's model-states files, its optimizer's settings), each a target of its own so it
        is streamed and cached like any other, with the bytes it is expected to take; :meth:`prepare`
        builds each. Default: none."""
        return {}

    def weight_sets(self, options: ReshardOptions) -> tuple[str, ...]:
        """The weights (``--weights`` values) this output's files are written from, when it holds
        more than ``options.weights`` (a DeepSpeed universal checkpoint: the module, the fp32 master
        weights and both Adam moments, each in files of its own; see :meth:`split`). Default: none."""
        return ()

    def split(self, name: str, keys: Sequence[str], sizes: Sequence[int], options: ReshardOptions,
              weights: str) -> list[tuple[str, int, int]]:
        """The files a layout of global tensors writes its one target ``name`` as, for the parameters
        named ``keys`` (in order; ``sizes``: their bytes) read as ``weights``: ``(file name, first,
        stop)`` per file, a run of the parameters each. Default: cut where :meth:`file_groups` says
        (given the bytes of each run that :meth:`together` keeps in one file), named by
        :meth:`part_name`."""
        units = cut_points(self.together(keys, options))  # tensors of one group stay in one file
        starts = [units[u] for u in self.file_groups(
            [sum(sizes[a:b]) for a, b in zip(units, [*units[1:], len(keys)])], options)]
        if starts == [0]:
            return [(name, 0, len(keys))]
        bounds = [*starts, len(keys)]
        return [(self.part_name(name, i, len(starts)), a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    def together(self, keys: Sequence[str], options: ReshardOptions) -> list[str | None]:
        """A group name per parameter (``keys``, in order; None: none) for parameters that must lie
        in one file whatever the cut (one output tensor made of many parameters, stacked): no file
        boundary falls between the first and the last parameter of a group (:func:`cut_points`).
        Default: none."""
        return [None] * len(keys)

    def file_groups(self, sizes: Sequence[int], options: ReshardOptions) -> list[int]:
        """A layout of global tensors written as several files: where its one target is cut, as the
        index of each file's first parameter (``sizes``: the parameters' bytes, in order). Default:
        one file."""
        return [0]

    def cuts_files(self) -> bool:
        """Whether a target may be cut into several files (``--max-shard-size`` means something for
        this output): exactly when the format brings its own :meth:`file_groups`."""
        return type(self).file_groups is not Writing.file_groups

    def stored_bytes(self, key: str, size: int, dtype: torch.dtype | None, options: ReshardOptions,
                     keys: Collection[str] = ()) -> int:
        """The bytes parameter ``key`` (planned as ``size`` bytes of ``dtype``) takes in this
        format's files, where the format encodes it otherwise (FP8) or writes it more than once
        (``keys``: every parameter name of the model): what cuts files and estimates the output.
        Default: ``size``."""
        return size

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

    def carried_name(self, source: SourceCheckpoint, name: str) -> str | None:
        """Where this layout's output holds the source's carried file ``name`` (see
        :meth:`Locating.carried`), relative to the output's root; None: it has no place for it (the
        conversion drops it and says so). Default: None."""
        return None

    def extra_files(self, source: SourceCheckpoint) -> dict[str, str]:
        """Small text files the output needs whatever its targets (e.g. a ``latest`` marker)."""
        return {}

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str | bytes]:
        """Small files written beside the outputs once their names are known (a descriptor, an index)."""
        return {}

    def write(self, obj: Any, path: str | os.PathLike[str], *, pickle_module: Any = None, sha256: bool = False,
              on_bytes: Callable[[int], None] | None = None, stream: Any = None) -> SaveStats:
        """Write one output file from ``obj`` (a state dict whose tensors may be pending, see
        :mod:`reshard.core.torch_writer`). Default: exactly the bytes ``torch.save`` writes, streamed.
        ``stream`` (only given where :meth:`writes_streams`): also feed the file's final bytes,
        in order, to ``stream.update`` — an upload taking the output while it is written; ``path``
        then need not hold more than what the writer reads back."""
        from reshard.core import torch_writer

        return torch_writer.save(obj, path, pickle_module=pickle_module, sha256=sha256, on_bytes=on_bytes,
                                 stream=stream)

    def writes_streams(self) -> bool:
        """Does :meth:`write` take a ``stream``? Default: when it is the default writer (a format
        that brings its own ``write`` says so itself)."""
        return type(self).write is Writing.write

    def encodes_on_device(self) -> bool:
        """Does :meth:`write` take a ``device`` (``--device``) to encode tensors on (FP8 block
        quantization), falling back to nothing but the CPU when it is the CPU? Default: no (the
        engine's own int8 quantization runs on the device before the writer)."""
        return False


class CheckpointFormat(Locating, Reading, Writing):
    """One on-disk layout: its three roles (:class:`Locating`, :class:`Reading`, :class:`Writing`),
    each with defaults, so a format author overrides only what the layout's files do differently
    and finds each hook with the role it serves. A read-only format sets ``writes = False`` and
    needs nothing of :class:`Writing`."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def module_dicts(shards: list[dict[str, Any]], names: list[str], module_key: str | None, n: int
                 ) -> tuple[str, list[dict[str, Any]]]:
    """The module key and every file's module dict (one key for all; DeepSpeed's ``mp_world_size``
    checked against the ``n`` TP ranks found)."""
    key = choose_module_key(shards[0], module_key, names[0])
    modules = []
    for sd, name in zip(shards, names):
        if choose_module_key(sd, module_key, name) != key:
            raise InconsistentShardsError(f"module is not under {key!r} as on rank 0", culprit=name)
        mod = sd[key]
        if not isinstance(mod, dict):
            raise CheckpointFormatError(f"{key!r} is a {type(mod).__name__}, not a state dict", culprit=name)
        mws = sd.get("mp_world_size")
        if mws is not None and mws != n:
            raise CheckpointFormatError(f"saved mp_world_size is {mws} but {n} rank files were found",
                                        culprit=name, hint="supply all rank files of the checkpoint (and no extra)")
        modules.append(mod)
    return key, modules


def check_contiguous(ranks: list[int], where: str) -> None:
    """Ranks must be exactly 0..N-1 (a gap is a missing file, an extra one a stray)."""
    expected = list(range(len(ranks)))
    if ranks != expected:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(
            f"rank files are not 0..N-1: found ranks {ranks}" + (f", missing {missing}" if missing else ""),
            culprit=where, hint="copy the missing rank files, or remove stray extra ones")


#: The largest file of an output cut into shards unless ``--max-shard-size`` says otherwise
#: (Hugging Face's ``max_shard_size="5GB"``, decimal: small enough for any object store's single
#: upload limits and to spread a model's files over workers, large enough to keep file counts low).
DEFAULT_MAX_SHARD = 5 * 10**9


def cut_points(groups: Sequence[str | None]) -> list[int]:
    """Where a run of parameters may be cut into files, given each one's group (None: none): before
    every parameter except inside a group's span (its first to its last member, whatever lies
    between, so groups that interleave are kept together as one).

    ==============================  ===============
    groups                          cut points
    ==============================  ===============
    [None, None, None]              [0, 1, 2]
    [None, a, b, a, b, None]        [0, 1, 5]
    [a, None, a, b]                 [0, 3]
    ==============================  ===============
    """
    last = {g: i for i, g in enumerate(groups) if g is not None}
    points, reach = [], -1
    for i, g in enumerate(groups):
        if i > reach:
            points.append(i)
        if g is not None:
            reach = max(reach, last[g])
    return points or [0]


def size_groups(sizes: Sequence[int], limit: int | None) -> list[int]:
    """Cut a run of tensors (``sizes``: their bytes, in order) into files of at most ``limit``
    bytes (default :data:`DEFAULT_MAX_SHARD`), between tensors: the index of each file's first
    tensor. A tensor larger than the limit is a file of its own, as Hugging Face does; an entry of
    no bytes (an ``_extra_state``) stays with the one before it, never starting a file.

    ============================  ===========  =========
    sizes                         limit        groups
    ============================  ===========  =========
    [4, 4, 4]                     8            [0, 2]
    [4, 9, 1]                     8            [0, 1, 2]
    [9, 0, 4]                     8            [0, 2]
    [4, 4]                        None (5 GB)  [0]
    ============================  ===========  =========
    """
    limit = limit or DEFAULT_MAX_SHARD
    starts, used = [0], 0
    for i, size in enumerate(sizes):
        if size and used and used + size > limit:
            starts.append(i)
            used = 0
        used += size
    return starts
