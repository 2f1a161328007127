"""Pipeline stages as megatron-core builds them: which transformer layers each *model chunk* holds.

A pipeline of ``pp`` ranks with ``vpp`` virtual stages per rank (the interleaved schedule) cuts
the decoder into ``pp * vpp`` chunks. Chunk ``(p, v)`` (pipeline rank ``p``, virtual stage ``v``)
is *stage* ``v * pp + p`` of the run: chunks are ordered virtual stage first, then rank, and
each holds a contiguous run of layers numbered locally from 0 in its own state dict (Megatron-LM
saves rank ``p``'s chunks as ``model0 .. model{vpp-1}`` of its files). The embedding is in stage
0, the final norm and the output layer in the last one.

How many layers each chunk holds is megatron-core 0.16.1's rule
(``get_num_layers_to_build`` / ``get_transformer_layer_offset``), from one of three settings:

=========================================  ======================================================
setting (Megatron-LM flag)                 layers of chunk ``(p, v)``
=========================================  ======================================================
even (default)                             ``n / pp / vpp`` with ``n = L (+1 embedding) (+1 loss)``
                                           under ``--account-for-{embedding,loss}-in-pipeline-
                                           split``; the first chunk one fewer for the embedding,
                                           the last one fewer for the loss
``--decoder-first/last-pipeline-num-layers``  the first / last rank holds that many (its chunks
                                           ``first / vpp`` each), the other ranks the rest evenly
``--pipeline-model-parallel-layout``       the ``t`` s of stage ``v * pp + p`` of the layout string
                                           (``E``: embedding, ``t``: layer, ``L``: loss, ``|``
                                           between stages, ``(..)*n`` and ``x*n`` repeat)
=========================================  ======================================================

Examples (``L`` layers, 0-based, chunk order ``(0,0) (1,0) .. (0,1) ..``)::

    L=8  pp=2 vpp=2                      (0,0) 0-1  (1,0) 2-3  (0,1) 4-5  (1,1) 6-7
    L=12 pp=3 vpp=2 first=2 last=2       (0,0) 0  (1,0) 1-4  (2,0) 5  (0,1) 6  (1,1) 7-10  (2,1) 11
    L=6  pp=2 vpp=2 embedding+loss       (0,0) 0  (1,0) 1-2  (0,1) 3-4  (1,1) 5
    L=6  pp=2 first=4                    (0) 0-3  (1) 4-5

Pure arithmetic on the settings; :class:`StageLayout` also reads and writes them as Megatron-LM's
saved ``args`` name them (one place for those names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from reshard.core.errors import CheckpointFormatError, LayoutError

#: Megatron-LM's ``args`` that describe the pipeline's stages (besides ``pipeline_model_parallel_size``).
VPP_ARG = "virtual_pipeline_model_parallel_size"
LAYERS_PER_VIRTUAL_STAGE_ARG = "num_layers_per_virtual_pipeline_stage"
VIRTUAL_STAGES_ARG = "num_virtual_stages_per_pipeline_rank"
FIRST_ARG = "decoder_first_pipeline_num_layers"
LAST_ARG = "decoder_last_pipeline_num_layers"
ACCOUNT_EMBEDDING_ARG = "account_for_embedding_in_pipeline_split"
ACCOUNT_LOSS_ARG = "account_for_loss_in_pipeline_split"
LAYOUT_ARG = "pipeline_model_parallel_layout"
STAGE_ARG_NAMES: tuple[str, ...] = (VPP_ARG, LAYERS_PER_VIRTUAL_STAGE_ARG, VIRTUAL_STAGES_ARG, FIRST_ARG, LAST_ARG,
                                    ACCOUNT_EMBEDDING_ARG, ACCOUNT_LOSS_ARG, LAYOUT_ARG)

_CHUNK_KEY_RE = re.compile(r"^model(\d+)$")


def chunk_keys(sd: dict[str, Any]) -> list[str]:
    """The ``model{i}`` entries of a Megatron-LM rank file (one per virtual stage), in order."""
    return sorted((k for k in sd if isinstance(k, str) and _CHUNK_KEY_RE.match(k)), key=lambda k: int(k[5:]))


def chunk_counts(num_layers: int, pp: int, vpp: int = 1, *, first: int | None = None, last: int | None = None,
                 account_embedding: bool = False, account_loss: bool = False, where: str = "pipeline stages"
                 ) -> tuple[int, ...]:
    """Layers of every chunk, stage by stage (``v * pp + p``), as megatron-core 0.16.1 builds them;
    a setting megatron-core refuses is refused here too (``where`` names it in the error)."""
    if vpp > 1 and pp == 1:
        raise LayoutError(f"{vpp} virtual stages need more than one pipeline rank", culprit=where,
                          hint="virtual pipeline stages interleave over PP > 1")
    uneven = first is not None or last is not None
    if pp == 1:  # megatron-core builds every layer; accounting for the embedding/loss changes nothing here
        if uneven and ((first is None) == (last is None) or (first or last) != num_layers):
            raise LayoutError("uneven first/last stages need more than one pipeline rank", culprit=where,
                              hint="one pipeline stage holds every layer")
        return (num_layers,)
    for name, value in (("first", first), ("last", last)):
        if value is not None and value <= 0:
            raise LayoutError(f"a {name} pipeline stage of {value} layers", culprit=where,
                              hint="give it at least one layer (megatron-core refuses empty first/last stages)")
    if uneven and (account_embedding or account_loss):
        raise LayoutError("uneven first/last stages cannot be combined with accounting for the embedding or loss",
                          culprit=where, hint="choose one of the two ways to balance the stages")
    if uneven:
        edges = (first is not None) + (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        middle_ranks = pp - edges
        if middle_layers < 0 or (middle_ranks == 0 and middle_layers) or \
                (middle_ranks and (middle_layers % middle_ranks or not middle_layers)):
            raise LayoutError(f"{num_layers} layers leave {middle_layers} for {middle_ranks} middle pipeline ranks "
                              f"after first={first} last={last}: they do not split evenly", culprit=where,
                              hint="choose first/last stage sizes that leave a positive multiple of the middle ranks")
        if middle_ranks == 0 and vpp > 1:  # megatron-core 0.16.1 divides by the middle ranks there
            raise LayoutError(f"first and last stages of {pp} pipeline ranks leave no middle rank, which megatron-core "
                              f"cannot place over {vpp} virtual stages", culprit=where,
                              hint="set one of first/last only, or use more pipeline ranks")
        per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        n = num_layers + account_embedding + account_loss
        if n % pp:
            raise LayoutError(f"{n} layers{' (with the embedding/loss counted)' if n != num_layers else ''} cannot "
                              f"be split evenly over {pp} pipeline stages", culprit=where,
                              hint=f"choose a PP that divides {n}, or uneven first/last stages")
        per_rank = [n // pp] * pp
    for p, count in enumerate(per_rank):
        if count % vpp:
            raise LayoutError(f"pipeline rank {p} holds {count} layers, which {vpp} virtual stages do not divide",
                              culprit=where, hint="choose a VPP dividing the layers of every pipeline rank")
    counts = [per_rank[p] // vpp for _v in range(vpp) for p in range(pp)]
    if account_embedding:
        counts[0] -= 1
    if account_loss:
        counts[-1] -= 1
    if min(counts) < 0:
        raise LayoutError("a stage would hold fewer than no layers", culprit=where, hint="use fewer pipeline ranks")
    return tuple(counts)


def parse_layout(text: str, where: str = "--target-pipeline-layout") -> list[str]:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` string as its stages, each a string of
    ``E`` (embedding), ``t`` (transformer layer), ``m`` (a layer beside the stack), ``L`` (loss): commas dropped,
    ``(..)*n`` and ``x*n`` unrolled, split at ``|``.

    =====================  ================================
    text                   stages
    =====================  ================================
    ``Ett|tt|tt|ttL``      ``Ett``, ``tt``, ``tt``, ``ttL``
    ``E(t|)*2,tL``         ``Et``, ``t``, ``tL``
    ``Et*3|t*3L``          ``Ettt``, ``tttL``
    =====================  ================================
    """
    if any(c.isspace() for c in text):
        raise LayoutError(f"pipeline layout {text!r} holds whitespace", culprit=where,
                          hint="Megatron-LM's layout strings have none; write e.g. 'Ett|tt|tt|ttL'")
    s = text.replace(",", "")
    s = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = sorted(set(s) - set("EtmL|"))
    if bad:
        raise LayoutError(f"pipeline layout {text!r} holds {''.join(bad)!r}", culprit=where,
                          hint="write stages of E, t, m, L separated by |, e.g. 'Ett|tt|tt|ttL'")
    return s.split("|")


def layout_counts(text: str, pp: int, num_layers: int, where: str = "--target-pipeline-layout"
                  ) -> tuple[int, tuple[int, ...]]:
    """(virtual stages, layers per stage) of a layout string for ``pp`` ranks and ``num_layers``
    layers, checked as megatron-core checks it (embedding first, loss last, every layer placed) and
    stricter: the embedding in the first stage and the loss in the last (where megatron-core builds
    them whatever the string says). Layers beside the stack (``m``) are not counted here (their
    family places them)."""
    stages = parse_layout(text, where)
    flat = "".join(stages)
    if pp == 1 and len(stages) > 1:
        raise LayoutError(f"pipeline layout {text!r} has {len(stages)} stages for one pipeline rank", culprit=where,
                          hint="virtual pipeline stages interleave over PP > 1")
    if len(stages) % pp:
        raise LayoutError(f"pipeline layout {text!r} has {len(stages)} stages, not a multiple of PP {pp}",
                          culprit=where, hint="write PP x VPP stages separated by |")
    if flat.count("E") != 1 or flat.count("L") != 1 or not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise LayoutError(f"pipeline layout {text!r} must start its first stage with E (the embedding) and end its "
                          f"last stage with L (the loss), once each", culprit=where,
                          hint="e.g. 'Ett|tt|tt|ttL'")
    if flat.count("t") != num_layers:
        raise LayoutError(f"pipeline layout {text!r} places {flat.count('t')} layers; the model has {num_layers}",
                          culprit=where, hint="write one t per transformer layer")
    return len(stages) // pp, tuple(stage.count("t") for stage in stages)


@dataclass(frozen=True)
class StageLayout:
    """The chunks of a pipeline and the setting they come from (see the module docstring):
    ``counts[v * pp + p]`` layers in chunk ``(p, v)``."""

    pp: int
    vpp: int
    counts: tuple[int, ...]
    first: int | None = None
    last: int | None = None
    account_embedding: bool = False
    account_loss: bool = False
    layout: str | None = None
    #: Where the layout came from (a flag, the saved args, the files), for errors.
    where: str = field(default="pipeline stages", compare=False)
    #: Read from a checkpoint's saved args (whose own stage fields then describe it as they are).
    saved: bool = field(default=False, compare=False)

    @classmethod
    def build(cls, num_layers: int, pp: int, vpp: int = 1, *, first: int | None = None, last: int | None = None,
              account_embedding: bool = False, account_loss: bool = False, layout: str | None = None,
              where: str = "pipeline stages") -> StageLayout:
        """The layout megatron-core builds from these settings (refused where it refuses them)."""
        if layout:
            if first is not None or last is not None or account_embedding or account_loss:
                raise LayoutError("a pipeline layout string cannot be combined with first/last stage sizes or "
                                  "accounting for the embedding/loss", culprit=where, hint="give one of them")
            v, counts = layout_counts(layout, pp, num_layers, where)
            if vpp not in (1, v):
                raise LayoutError(f"pipeline layout {layout!r} has {v} virtual stages, not {vpp}", culprit=where,
                                  hint="drop the virtual stage count, or write PP x VPP stages")
            return cls(pp, v, counts, layout=layout, where=where)
        counts = chunk_counts(num_layers, pp, vpp, first=first, last=last, account_embedding=account_embedding,
                              account_loss=account_loss, where=where)
        return cls(pp, vpp, counts, first=first if pp > 1 else None, last=last if pp > 1 else None,
                   account_embedding=account_embedding and pp > 1, account_loss=account_loss and pp > 1, where=where)

    @classmethod
    def from_args(cls, args: Any, num_layers: int, pp: int, where: str) -> StageLayout:
        """The layout Megatron-LM's saved ``args`` describe (its ``validate_args``: the virtual
        stages from the layout string, ``num_virtual_stages_per_pipeline_rank``,
        ``num_layers_per_virtual_pipeline_stage`` or the saved ``virtual_pipeline_model_parallel_size``)."""
        def get(name: str) -> Any:
            return getattr(args, name, None)

        if pp == 1:  # one stage holds every layer, whatever the stage fields say
            return cls(1, 1, (num_layers,), where=where, saved=True)
        layout, first, last = get(LAYOUT_ARG), get(FIRST_ARG), get(LAST_ARG)
        emb, loss = bool(get(ACCOUNT_EMBEDDING_ARG)), bool(get(ACCOUNT_LOSS_ARG))
        hint = "the saved args describe no pipeline megatron-core builds for these files"
        if layout is not None and not isinstance(layout, str):  # a parsed layout object: its stage lists
            raise CheckpointFormatError(f"args.{LAYOUT_ARG} is a {type(layout).__name__}, not the layout string "
                                        f"Megatron-LM saves", culprit=where, hint=hint)
        vpp = get(VPP_ARG) or get(VIRTUAL_STAGES_ARG)
        per_chunk = get(LAYERS_PER_VIRTUAL_STAGE_ARG)
        for name, value in ((FIRST_ARG, first), (LAST_ARG, last), (VPP_ARG, vpp), (LAYERS_PER_VIRTUAL_STAGE_ARG,
                                                                                   per_chunk)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise CheckpointFormatError(f"args.{name} is {value!r}, not a number of layers or stages",
                                            culprit=where, hint=hint)
        if not vpp and per_chunk and not layout and pp > 1:
            n = num_layers + emb + loss
            vpp = n // pp // per_chunk if n % pp == 0 and (n // pp) % per_chunk == 0 else 0
            if not vpp:
                raise CheckpointFormatError(f"args.{LAYERS_PER_VIRTUAL_STAGE_ARG} is {per_chunk}, which does not "
                                            f"divide the {n // pp} layers of each of the {pp} pipeline ranks",
                                            culprit=where, hint=hint)
        try:
            built = cls.build(num_layers, pp, int(vpp or 1), first=first, last=last, account_embedding=emb,
                              account_loss=loss, layout=layout, where=where)
        except LayoutError as err:  # not the user's flags: the checkpoint's own args
            raise CheckpointFormatError(err.message, culprit=where, hint=hint) from None
        return replace(built, saved=True)

    @property
    def stages(self) -> int:
        """Chunks in all (``pp * vpp``)."""
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def uneven(self) -> bool:
        """Are the stages set apart from an even split (first/last sizes, accounting, a layout)?"""
        return self.first is not None or self.last is not None or self.account_embedding or self.account_loss or \
            bool(self.layout)

    def chunk(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, virtual stage) of stage ``stage``."""
        return stage % self.pp, stage // self.pp

    def offsets(self) -> tuple[int, ...]:
        """The global number of each stage's first layer."""
        return tuple(accumulate(self.counts, initial=0))[:-1]

    def stage_of(self, layer: int) -> tuple[int, int]:
        """(stage, local index) of global layer ``layer``."""
        for stage, (offset, count) in enumerate(zip(self.offsets(), self.counts)):
            if offset <= layer < offset + count:
                return stage, layer - offset
        raise ValueError(f"layer {layer} is beyond the {self.num_layers} layers of {self}")

    def describe(self) -> str:
        """One line: the ranks, virtual stages and layers per chunk."""
        head = f"PP {self.pp}" + (f" x VPP {self.vpp}" if self.vpp > 1 else "")
        if self.stages == 1:
            return head
        chunks = " ".join(f"({p},{v}):{c}" if self.vpp > 1 else f"{p}:{c}"
                          for (p, v), c in ((self.chunk(s), c) for s, c in enumerate(self.counts)))
        return f"{head}, layers per {'chunk (rank,virtual)' if self.vpp > 1 else 'stage'} {chunks}"

    def args(self) -> dict[str, Any]:
        """The saved ``args`` that make Megatron-LM build this layout (every stage field: unset ones
        None / False). Virtual stages are given by ``num_layers_per_virtual_pipeline_stage`` when the
        split is even (what ``--use-checkpoint-args`` carries over) and by
        ``num_virtual_stages_per_pipeline_rank`` otherwise (Megatron-LM accepts only that one beside
        uneven stages); a layout string says it all itself."""
        vpp = self.vpp if self.vpp > 1 else None
        per_chunk = (self.num_layers + self.account_embedding + self.account_loss) // self.stages \
            if vpp and not self.layout and self.first is None and self.last is None else None
        return {VPP_ARG: vpp, LAYERS_PER_VIRTUAL_STAGE_ARG: per_chunk,
                VIRTUAL_STAGES_ARG: vpp if vpp and per_chunk is None and not self.layout else None,
                FIRST_ARG: self.first, LAST_ARG: self.last, ACCOUNT_EMBEDDING_ARG: self.account_embedding,
                ACCOUNT_LOSS_ARG: self.account_loss, LAYOUT_ARG: self.layout}
