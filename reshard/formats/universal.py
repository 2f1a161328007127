"""DeepSpeed's universal checkpoint (``--to universal``): a training checkpoint that any data-parallel
size, and any TP a model-parallel unit asks for, resumes from (DeepSpeed's ``checkpoint.load_universal``).

Written from a DeepSpeed ZeRO stage 1/2 checkpoint (the model states and every data-parallel rank's
optimizer files), as DeepSpeed's ``ds_to_universal.py`` writes it, but streamed: each file is a
target of the plan, read from the optimizer partitions as it is written, with no temp folder of
per-slice files. The layout under the destination::

    latest_universal                      the tag (global_stepN), as DeepSpeed's loader looks it up
    TAG/mp_rank_00_model_states.pt        the model states at TP 1 (engine metadata, LR scheduler)
    TAG/zero/optimizer_state.pt           optimizer settings: param_groups, loss scaler, ...
    TAG/zero/NAME/fp32.pt                 per parameter: the fp32 master weight,
    TAG/zero/NAME/exp_avg.pt              Adam's first moment,
    TAG/zero/NAME/exp_avg_sq.pt           its second moment (each a dict, below),
    TAG/zero/NAME/step.pt                 and the optimizer step (trained parameters only)

Each state file is ``{"cat_dim": d, "param": whole tensor}``, the keys saying how DeepSpeed's loader
cuts the whole tensor for a TP rank; the rule table decides them (the source needs no
``universal_checkpoint_info`` patterns):

==========================  ==================================================================
rule of the parameter       entries besides ``param`` (in this order)
==========================  ==================================================================
replicated (norms, biases   none: every rank loads the whole tensor
of row-parallel layers)
column-parallel, QKV        ``cat_dim`` 0
row-parallel                ``cat_dim`` 1
gated MLP (SwiGLU) fc1      ``cat_dim`` 0, ``param_n_sub_params`` 2 ([gate; up], each cut alike)
vocabulary (embeddings,     ``cat_dim`` 0, ``vocab_tensor`` True; rows cut to the true vocabulary
output layer)               (``universal_checkpoint_info.original_vocab_size``, else the model
                            facts'), the loader pads them for its TP
==========================  ==================================================================

Frozen parameters have ``fp32.pt`` only (the module copy, upcast), as in DeepSpeed's own output.

From a ZeRO stage 3 checkpoint (TP 1) the output is what ``ds_to_universal`` writes for stage 3,
which DeepSpeed's ZeRO-3 loader reads: each state file is the whole tensor flattened to one
dimension (no dict: the loader re-partitions flat elements over its data-parallel ranks), for the
trained parameters only (``param_shapes``; frozen ones and a tied alias have none), with no
``step.pt`` (the loader takes the step from the optimizer's settings). ``zero/optimizer_state.pt``
is data-parallel rank 0's whole ``optimizer_state_dict`` with the base optimizer's
``param_groups`` beside it, and every ``zero_pp_rank_D_mp_rank_00_model_states.pt`` is carried as
saved (the engine's metadata and the frozen parameters' fragments); both are targets of their own,
streamed like the parameters (:meth:`UniversalFormat.object_targets`), since rank 0's optimizer
state is a data-parallel share of the whole model's.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reshard.core import foreign
from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import DROPPED_ENTRIES
from reshard.core.safe_load import load_shard
from reshard.core.source import DEEPSPEED, DEEPSPEED_ZERO3, SourceCheckpoint, rank_file_name
from reshard.core.torch_writer import first_rows, flat
from reshard.core.zero_master import OPTIM_STATE, STATES, optim_files, optimizer_state, universal_globals
from reshard.formats.base import CheckpointFormat
from reshard.formats.deepspeed import zero3_grid

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan

UNIVERSAL = "universal"
#: The marker DeepSpeed's loader reads (``load_universal``) instead of ``latest``.
LATEST_UNIVERSAL = "latest_universal"
#: Top-level entries of the model states kept (a resumed training needs its LR schedule).
KEPT = frozenset({"optimizer", "lr_scheduler"})


class UniversalFormat(CheckpointFormat):
    """DeepSpeed universal checkpoint (resumes at any DP size), written from ZeRO optimizer files."""

    name = UNIVERSAL
    reads = False
    title = "DeepSpeed universal checkpoint"
    priority = 95
    per_rank = False
    keeps = KEPT

    def locate(self, path: Path) -> SourceCheckpoint:
        raise CheckpointFormatError("reshard writes DeepSpeed universal checkpoints but does not read them",
                                    culprit=str(path), hint="convert the DeepSpeed ZeRO checkpoint it was made from")

    def check_source(self, source: SourceCheckpoint, options: ReshardOptions) -> None:
        if source.format not in (DEEPSPEED, DEEPSPEED_ZERO3):
            raise LayoutError(f"a universal checkpoint is written from a DeepSpeed ZeRO checkpoint (model states and "
                              f"optimizer files), not from a {source.format} checkpoint", culprit="--to universal",
                              hint="convert a DeepSpeed ZeRO checkpoint, or write another format")
        if source.format == DEEPSPEED_ZERO3 and source.tp > 1:
            raise LayoutError(f"a ZeRO stage 3 checkpoint at {source.tp} tensor-parallel ranks (DeepSpeed AutoTP): "
                              f"its universal form needs the TP merge patterns only AutoTP's model saves",
                              culprit="--to universal", hint="use DeepSpeed's ds_to_universal.py for an AutoTP run, "
                                                             "or convert the fp32 weights with --weights master")
        if options.weights != "module":
            raise LayoutError("a universal checkpoint holds the module, the master weights and Adam's moments "
                              "already", culprit="--weights", hint="drop --weights")
        if options.quantize:
            raise LayoutError("a universal checkpoint resumes training: its weights are not quantized",
                              culprit="--quantize", hint="drop --quantize")

    def kept_entries(self, source: SourceCheckpoint) -> frozenset[str]:
        if source.format == DEEPSPEED_ZERO3:  # its model-states files are carried whole
            return frozenset(DROPPED_ENTRIES)
        return self.keeps

    def read_weights(self, source: SourceCheckpoint, options: ReshardOptions) -> str:
        return "exp_avg" if source.format == DEEPSPEED_ZERO3 else options.weights

    def object_targets(self, source: SourceCheckpoint, options: ReshardOptions) -> dict[str, int]:
        if source.format != DEEPSPEED_ZERO3:
            return {}  # (stage 1/2: the optimizer's settings are a side file, the model states a target)
        tag, folder = _tag(source), source.files[0].parent
        (states,) = zero3_grid(folder).values()  # (TP 1: check_source)
        optim = optim_files(folder, 0, str(source.files[0]))[0]
        return {f"{tag}/zero/optimizer_state.pt": optim.stat().st_size,
                **{f"{tag}/{c.name}": c.stat().st_size for c in states}}

    def check_plan(self, plan: Plan) -> None:
        if plan.source.format == DEEPSPEED_ZERO3:
            return  # written whole and flat: no row is cut
        for p in plan.params:
            if p.spec is not None and p.spec.sections is not None:
                raise LayoutError("fused sections of unequal widths, which DeepSpeed's universal checkpoint cannot "
                                  "describe (its sub-parameters are equal)", culprit=p.key,
                                  hint="write the per-rank or torch_dist format instead")
            if p.spec is not None and p.spec.parts > 2:
                raise LayoutError(f"checkpoint_version {plan.version} stores QKV as [3, heads, head_dim] rows, which "
                                  f"DeepSpeed's universal loader would cut wrongly (it cuts whole rows)",
                                  culprit=p.key, hint="if the checkpoint stores QKV per head (Megatron-DeepSpeed: "
                                                      "checkpoint_version 3, often not saved), say so with --version 3")

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        return f"{_tag(source)}/{rank_file_name(0)}"

    def weight_sets(self, options: ReshardOptions) -> tuple[str, ...]:
        # read as "exp_avg" (a ZeRO-3 source, see read_weights): no module file, the trained parameters
        return tuple(STATES) if options.weights == "exp_avg" else ("module", *STATES)

    def split(self, name: str, keys: Sequence[str], sizes: Sequence[int], options: ReshardOptions,
              weights: str) -> list[tuple[str, int, int]]:
        if weights == "module":
            return [(name, 0, len(keys))]
        tag = name.split("/")[0]
        return [(f"{tag}/zero/{key}/{STATES[weights]}.pt", i, i + 1) for i, key in enumerate(keys)]

    def prepare(self, plan: Plan, tgt: int, sd: dict[str, Any]) -> Any:
        target = plan.targets[tgt]
        if not target.params:
            return _whole_object(plan, target.name)
        if target.weights is None and plan.options.weights == "module":
            return sd  # the model states file
        (entry,) = target.params
        value = sd[plan.module_key][entry.out_key]
        if plan.source.format == DEEPSPEED_ZERO3:
            return flat(value)
        p = entry.param
        rec: dict[str, Any] = {}
        if p.spec is not None:
            rec["cat_dim"] = p.spec.dim
            if p.spec.parts == 2:
                rec["param_n_sub_params"] = 2
        if p.rule.vocab:
            rec["vocab_tensor"] = True
            rows = _true_vocab(plan, sd)
            if rows is not None and rows < value.shape[0]:
                value = first_rows(value, rows)
        rec["param"] = value
        return rec

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str | bytes]:
        src = plan.source
        model_states = load_shard(src.files[0])
        tag = _tag_of(model_states, src)
        if src.format == DEEPSPEED_ZERO3:
            return {LATEST_UNIVERSAL: tag}  # (the optimizer's settings: a target, see object_targets)
        settings, steps = universal_globals(model_states, optim_files(src.files[0].parent, 0, str(src.files[0]))[0])
        out: dict[str, str | bytes] = {LATEST_UNIVERSAL: tag, f"{tag}/zero/optimizer_state.pt": _saved(settings)}
        trained = {t.params[0].out_key for t in plan.targets if t.weights == "exp_avg"}
        for key in sorted(trained):
            if key in steps:
                out[f"{tag}/zero/{key}/step.pt"] = _saved(steps[key])
        return out

    def describe(self, plan: Plan) -> list[str]:
        trained = sum(t.name.endswith("/exp_avg.pt") for t in plan.targets)
        frozen = sum(t.name.endswith("/fp32.pt") for t in plan.targets) - trained
        zero3 = plan.source.format == DEEPSPEED_ZERO3
        lines = [f"DeepSpeed universal checkpoint: {trained} trained parameters (fp32 master, exp_avg, exp_avg_sq"
                 + (")" if zero3 else ", step)") + (f", {frozen} frozen (fp32 only)" if frozen else "")
                 + (", as ZeRO stage 3 writes them (flat, the model states carried)" if zero3 else "")
                 + "; resume with DeepSpeed's checkpoint.load_universal=true at any data-parallel size"]
        if not zero3 and any(p.rule.vocab for p in plan.params) and \
                _true_vocab(plan, load_shard(plan.source.files[0])) is None:
            lines.append("vocabulary rows kept as saved, padding included: the true vocabulary size is unknown "
                         "(pass --vocab-size V to cut Megatron's padding; DeepSpeed's loader cannot load more "
                         "rows than its own padding)")
        return lines


def _whole_object(plan: Plan, name: str) -> Any:
    """What an object target of a ZeRO-3 source holds (see :meth:`UniversalFormat.object_targets`):
    data-parallel rank 0's optimizer state with the base optimizer's ``param_groups`` beside it
    (as ``ds_to_universal`` saves it), or a model-states file as saved. Memory-mapped: the writer
    streams its tensors."""
    folder = plan.source.files[0].parent
    base = name.rsplit("/", 1)[1]
    if name.endswith("/zero/optimizer_state.pt"):
        state = optimizer_state(optim_files(folder, 0, str(plan.source.files[0]))[0])
        inner = state.get(OPTIM_STATE)
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list):
            raise CheckpointFormatError("has no optimizer_state_dict.param_groups (the base optimizer's settings)",
                                        culprit=str(folder), hint="pass a DeepSpeed ZeRO stage 3 checkpoint's own "
                                                                  "*_optim_states.pt files")
        return {**state, "param_groups": groups}
    return load_shard(folder / base)


def _tag(source: SourceCheckpoint) -> str:
    """The output's tag: DeepSpeed's default for the saved step (``global_stepN``, from the model
    states' ``global_steps``), so the output does not depend on where the source was read from (a
    remote source is read through a local view of another name); the source folder's name when
    the step was not saved."""
    return _tag_of(load_shard(source.files[0]), source)


def _tag_of(model_states: dict[str, Any], source: SourceCheckpoint) -> str:
    steps = model_states.get("global_steps")
    return f"global_step{steps}" if isinstance(steps, int) else source.files[0].parent.name


def _true_vocab(plan: Plan, sd: dict[str, Any]) -> int | None:
    info = sd.get("universal_checkpoint_info")
    size = info.get("original_vocab_size") if isinstance(info, dict) else None
    return size if isinstance(size, int) else plan.facts.vocab_size


def _saved(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it (DeepSpeed's pickled classes under their own names)."""
    buf = io.BytesIO()
    foreign.save(obj.clone() if isinstance(obj, torch.Tensor) else obj, buf)
    return buf.getvalue()
