"""The fp32 master weights of a DeepSpeed ZeRO checkpoint (and, laid out alike, Adam's moments), as
lazy module tensors.

Under ZeRO 1/2 a rank file's module holds the 16-bit copy the forward pass used; the weights the
optimizer updates are fp32, flattened per parameter group and cut into one equal partition per
data-parallel rank, in ``zero_pp_rank_D_mp_rank_TT_optim_states.pt`` (``bf16_``-prefixed under
bf16). Their order is the model states file's ``param_shapes`` (one ordered name -> shape map per
group); DeepSpeed pads the flat group, and newer releases each parameter
(``param_alignment_paddings``), so the group's elements are found by walking the shapes:

=====================================  ==========================================================
group ``g`` of DP ranks ``0..D-1``     parameter ``k`` of the group
=====================================  ==========================================================
flat = partition[0] ++ ... ++ [D-1]    ``flat[o_k : o_k + numel_k].view(shape_k)``, where
(each ``single_partition_of_fp32_      ``o_0 = 0`` and ``o_{k+1} = o_k + numel_k + pad_k``
groups[g]``; the last may be shorter)  (``pad_k``: ``param_alignment_paddings[g][k]``, else 0)
end of the walk                        equals ``len(flat)`` up to DeepSpeed's alignment to
                                       ``2 * D`` elements; anything else is refused
=====================================  ==========================================================

Adam's moments (``exp_avg``, ``exp_avg_sq``: the base optimizer's per-group state, one flat tensor
per group as long as the group's fp32 partition) are cut exactly like the master weights
(:data:`STATES` names where each lives); a frozen parameter has none and is left out of them.

A parameter may straddle two partitions: :class:`FlatSlice` reads it from both, lazily (the
partitions are memory-mapped; nothing is read until a target asks for a box). Module entries no
group holds are frozen parameters (or buffers): kept from the module copy, floating ones upcast to
fp32 (:class:`Upcast`); ``shared_params`` (one tensor under two names) alias the owner's master.

ZeRO stage 3 partitions each parameter instead (:func:`master_module_zero3`): every rank holds
``ceil(numel / D)`` elements of it, one parameter after another through its groups' flat
``fp32_flat_groups``, the last rank's share zero-padded; the module files hold empty placeholders,
and a frozen parameter is each rank's ``frozen_param_fragments`` entry:

=====================================  ==========================================================
parameter ``k`` (all groups in order)  ``cat(rank_0[o_k : o_k + c_k], ..., rank_{D-1}[...])``
                                       cut to ``numel_k``, where ``c_k = ceil(numel_k / D)``,
                                       ``o_0 = 0``, ``o_{k+1} = o_k + c_k`` (rank ``r``'s groups
                                       concatenated)
frozen parameter ``f``                 ``cat(fragment_f of every rank)`` cut to ``numel_f``
=====================================  ==========================================================
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, InconsistentShardsError
from reshard.core.foreign import Foreign
from reshard.core.lazy import LazyTensor, overlaps
from reshard.core.pages import PageDropper
from reshard.core.safe_load import load_shard

OPTIM_STATE = "optimizer_state_dict"
FP32_PARTITIONS = "single_partition_of_fp32_groups"
#: Where each ZeRO stage keeps its flat fp32 partitions in an optimizer file (0: DeepSpeed's
#: BF16_Optimizer, which bf16 ZeRO-1 with fp32 gradient accumulation runs: ZeRO-1's layout, and files
#: that name no stage).
PARTITIONS_KEY = {0: FP32_PARTITIONS, 1: FP32_PARTITIONS, 2: FP32_PARTITIONS, 3: "fp32_flat_groups"}
#: The per-parameter optimizer states that are read as module tensors (``--weights``), as they are
#: named in a universal checkpoint: the fp32 master weights and Adam's two moments.
STATES = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
OPTIM_FILE_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: The same files as names in a listing (relative to the checkpoint's root).
OPTIM_FILE_PATTERN = re.compile(r"(^|/)(?:bf16_|fp16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


class FlatSlice(LazyTensor):
    """One parameter inside a flat fp32 group cut into partitions: ``pieces`` of ``(partition,
    first element, elements)`` in order, viewed as ``shape``. A box that is a run of the flat
    elements (whole trailing dims) is copied from the pieces it spans (a view when it lies in one);
    any other box is cut from its rows of dim 0, read as one run. The partitions are mapped
    files: ``pages`` gives back what was read once it is copied or written (memory stays a few
    tensors however large the optimizer files are)."""

    def __init__(self, pieces: list[tuple[torch.Tensor, int, int]], shape: tuple[int, ...],
                 pages: PageDropper | None = None) -> None:
        self.pieces, self.shape, self.dtype = pieces, tuple(shape), pieces[0][0].dtype
        self.pages = pages

    def _run(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
        """The box as flat elements ``[lo, hi)``, if it is one run: single indices on the dims
        before some dim ``k``, any range on ``k``, whole dims after it."""
        if not self.shape:
            return 0, 1
        k = 0
        while k < len(sizes) - 1 and sizes[k] == 1:
            k += 1
        if any(o != 0 or s != d for o, s, d in zip(offsets[k + 1:], sizes[k + 1:], self.shape[k + 1:])):
            return None
        lo, stride = 0, 1
        for o, d in zip(reversed(offsets), reversed(self.shape)):
            lo += o * stride
            stride *= d
        return lo, lo + math.prod(sizes)

    def _segments(self, lo: int, hi: int) -> list[tuple[torch.Tensor, int, int, int]]:
        return overlaps(self.pieces, lo, hi)

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        run = self._run(offsets, sizes)
        if run is None:
            return None
        segs = self._segments(*run)
        if len(segs) != 1:
            return None
        t, start, n, _ = segs[0]
        return t.narrow(0, start, n).view(sizes)

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        run = self._run(offsets, sizes)
        if run is None:  # read its rows of dim 0 (one run), keep the box's columns
            rows = self.read_box((offsets[0], *(0 for _ in self.shape[1:])), (sizes[0], *self.shape[1:]))
            box = rows[(slice(None), *(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:])))]
            if out is None:
                return box.contiguous()
            return out.copy_(box)
        out, done = self._destination(offsets, sizes, out)
        if done:
            return out
        flat = out.view(-1) if out.is_contiguous() else None
        buf = flat if flat is not None else torch.empty(run[1] - run[0], dtype=self.dtype)
        for t, start, n, at in self._segments(*run):
            src = t.narrow(0, start, n)
            buf.narrow(0, at, n).copy_(src)
            self.release(src)
        if flat is None:
            out.copy_(buf.view(sizes))
        return out

    def release(self, t: torch.Tensor) -> None:
        if self.pages is not None:
            self.pages.drop(t.data_ptr(), t.numel() * t.element_size())

    def __repr__(self) -> str:
        return f"FlatSlice({[(s, n) for _, s, n in self.pieces]}, shape={self.shape})"


class Upcast(LazyTensor):
    """A tensor read as ``dtype`` (a frozen parameter's 16-bit copy, as fp32), box by box."""

    def __init__(self, tensor: torch.Tensor | LazyTensor, dtype: torch.dtype) -> None:
        self.tensor, self.shape, self.dtype = tensor, tuple(tensor.shape), dtype

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.tensor, LazyTensor):
            box = self.tensor.read_box(offsets, sizes)
        else:
            box = self.tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        if out is None:
            return box.to(self.dtype).contiguous()
        return out.copy_(box)


def optim_files(folder: Path, tp_rank: int, where: str) -> list[Path]:
    """The ZeRO optimizer files of tensor-parallel rank ``tp_rank`` in ``folder``, by data-parallel
    rank (which must be 0..D-1, one file each)."""
    by_dp: dict[int, list[Path]] = {}
    for child in sorted(folder.iterdir()):
        m = OPTIM_FILE_RE.match(child.name)
        if m and int(m.group(2)) == tp_rank and child.is_file():
            by_dp.setdefault(int(m.group(1)), []).append(child)
    if not by_dp:
        raise CheckpointFormatError(f"no ZeRO optimizer files (zero_pp_rank_D_mp_rank_{tp_rank:02d}_optim_states.pt) "
                                    f"beside it: the optimizer's states (--weights master, exp_avg, exp_avg_sq; "
                                    f"--to universal) are read from them", culprit=where,
                                    hint="copy the *_optim_states.pt files of every data-parallel rank, or convert "
                                         "the module's own weights (no --weights, no --to universal)")
    ranks = sorted(by_dp)
    if ranks != list(range(len(ranks))) or any(len(v) > 1 for v in by_dp.values()):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise CheckpointFormatError(f"ZeRO optimizer files of data-parallel ranks {ranks} for TP rank {tp_rank}"
                                    + (f": missing {missing}" if missing else ": a rank appears twice"),
                                    culprit=str(folder),
                                    hint="supply one *_optim_states.pt file per data-parallel rank")
    return [by_dp[r][0] for r in ranks]


def master_module(module: Mapping[str, Any], model_states: Mapping[str, Any], files: Sequence[Path],
                  which: str = "master") -> dict[str, Any]:
    """``module`` (a rank file's module, in its order) with every parameter replaced by its fp32
    master weight (``which``: or an Adam moment, see :data:`STATES`) from the ZeRO optimizer ``files``
    (data-parallel ranks in order); see the module docstring. Validates everything it reads: stage,
    partition count, step, group sizes, shapes."""
    where = str(files[0])
    states = [optimizer_state(f) for f in files]
    stage = _stage(states[0], where)
    if stage == 3:
        raise CheckpointFormatError("is a ZeRO stage 3 optimizer file beside model states that are not ZeRO-3's "
                                    "(zero_pp_rank_D_mp_rank_TT_model_states.pt)", culprit=where,
                                    hint="the files come from different checkpoints")
    dp = len(files)
    for st, f in zip(states, files):
        counts = st.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != dp for c in counts):
            raise CheckpointFormatError(f"partition_count {st.get('partition_count')} but {dp} data-parallel files "
                                        f"were found", culprit=str(f), hint="supply every data-parallel rank's "
                                                                            "*_optim_states.pt file, and no others")
        if _stage(st, str(f)) != stage:
            raise InconsistentShardsError("ZeRO stage differs from data-parallel rank 0's", culprit=str(f),
                                          hint="all files must come from one checkpoint")
    _check_same_step(states, files)
    param_shapes = model_states.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, Mapping) for g in param_shapes):
        raise CheckpointFormatError("has no param_shapes (one name -> shape map per parameter group)",
                                    culprit=where, hint="the model states file does not come from a ZeRO engine")
    groups = [_flat_groups(st, stage, which, len(param_shapes), str(f)) for st, f in zip(states, files)]
    paddings = states[0].get("param_alignment_paddings")
    pages = PageDropper(files)  # the optimizer files are mapped now
    masters: dict[str, LazyTensor] = {}
    for gi, shapes in enumerate(param_shapes):
        parts = [g[gi] for g in groups]
        pads = paddings[gi] if isinstance(paddings, list) and gi < len(paddings) else None
        masters.update(_walk_group(gi, shapes, parts, pads, dp, files, pages))

    out: dict[str, Any] = {}
    shared = model_states.get("shared_params") or {}
    for key, value in module.items():
        master = masters.get(key)
        if master is None and key in shared and which == "master":  # (an alias has no moments of its own)
            master = masters.get(shared[key])
        if master is not None:
            if isinstance(value, torch.Tensor) and tuple(value.shape) != master.shape:
                raise InconsistentShardsError(f"{key}: param_shapes says {master.shape} but the module holds "
                                              f"{tuple(value.shape)}", culprit=where,
                                              hint="the optimizer files do not belong to this model states file")
            out[key] = master
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and \
                key not in (model_states.get("buffer_names") or ()):
            if which == "master":  # frozen: the optimizer holds no copy (and no moments)
                out[key] = Upcast(value, torch.float32)
        elif which == "master":  # buffers, integer tensors, non-tensor entries: kept as they are
            out[key] = value
    unused = sorted(set(masters) - set(module))
    if unused:
        raise InconsistentShardsError(f"param_shapes names {unused[:3]} that the module does not hold", culprit=where,
                                      hint="the model states file and the optimizer files do not belong together")
    return out


def optimizer_summary(files: Sequence[Path]) -> dict[str, Any] | None:
    """What ``reshard inspect`` says of the ZeRO optimizer files beside a checkpoint: stage (0:
    DeepSpeed's BF16_Optimizer, see :data:`PARTITIONS_KEY`),
    data-parallel size, parameter groups, the master weights' dtype and elements, the step (from
    tensor-parallel rank 0's files; None when there are none)."""
    mine = [f for f in files if (m := OPTIM_FILE_RE.match(f.name)) and int(m.group(2)) == 0]
    if not mine:
        return None
    states = [optimizer_state(f) for f in sorted(mine, key=lambda f: int(OPTIM_FILE_RE.match(f.name).group(1)))]
    stage = _stage(states[0], str(mine[0]))
    key = PARTITIONS_KEY[stage]
    parts = [t for st in states for t in st.get(key) or [] if isinstance(t, torch.Tensor)]
    step = _step(states[0])
    return {"zero_stage": stage, "dp": len(states), "groups": len(states[0].get(key) or []),
            "master_dtype": str(parts[0].dtype).replace("torch.", "") if parts else None,
            "master_elements": sum(int(t.numel()) for t in parts), "step": int(step) if step is not None else None}


def universal_globals(model_states: Mapping[str, Any], optim_file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a universal checkpoint keeps of a ZeRO stage 1/2 optimizer besides the per-parameter
    states: its settings (the file's entries less the partitions and the per-parameter state, the
    base optimizer's ``param_groups`` added: learning rates, betas, weight decay) and each trained
    parameter's ``step`` (its group's), from one optimizer file and its model states."""
    where = str(optim_file)
    state = optimizer_state(optim_file)  # (its stage was checked when the plan read the master weights)
    base = state.get("base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, dict) else None
    per_group = base.get("state") if isinstance(base, dict) else None
    param_shapes = model_states.get("param_shapes")
    if not isinstance(groups, list) or not isinstance(per_group, dict) or not isinstance(param_shapes, list) or \
            len(groups) != len(param_shapes):
        raise CheckpointFormatError("has no base optimizer param_groups and state matching param_shapes",
                                    culprit=where, hint="pass a DeepSpeed ZeRO stage 1/2 checkpoint's own files")
    settings = {k: v for k, v in state.items() if k not in ("base_optimizer_state", "param_slice_mappings",
                                                            FP32_PARTITIONS)}
    settings["param_groups"] = groups
    steps = {}
    for g, shapes in enumerate(param_shapes):
        step = per_group.get(g, {}).get("step") if isinstance(per_group.get(g), dict) else None
        if step is not None:
            steps.update({name: step for name in shapes})
    return settings, steps


def master_module_zero3(module: Mapping[str, Any], model_states: Sequence[Mapping[str, Any]],
                        files: Sequence[Path], which: str = "master") -> dict[str, Any]:
    """``module`` (placeholders, in the module's order) with every parameter its fp32 master weight
    (``which``: or an Adam moment, see :data:`STATES`) from ZeRO stage 3 optimizer ``files`` and
    each data-parallel rank's ``model_states`` (frozen fragments); see the module docstring."""
    where = str(files[0])
    states = [optimizer_state(f) for f in files]
    dp = len(files)
    for st, f in zip(states, files):
        if _stage(st, str(f)) != 3:
            raise InconsistentShardsError("is not a ZeRO stage 3 optimizer file as its model states are",
                                          culprit=str(f), hint="all files must come from one checkpoint")
        if st.get("partition_count") != dp:
            raise CheckpointFormatError(f"partition_count {st.get('partition_count')} but {dp} data-parallel files "
                                        f"were found", culprit=str(f), hint="supply every data-parallel rank's "
                                                                            "*_optim_states.pt file, and no others")
    _check_same_step(states, files)
    param_shapes = model_states[0].get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, Mapping) for g in param_shapes):
        raise CheckpointFormatError("has no param_shapes (one name -> shape map per parameter group)",
                                    culprit=where, hint="the model states file does not come from a ZeRO engine")
    shapes = {name: tuple(int(d) for d in shape) for group in param_shapes for name, shape in group.items()}
    flats: list[list[tuple[torch.Tensor, int, int]]] = []
    for st, f in zip(states, files):
        count = len(st.get("fp32_flat_groups") or ())
        groups = _flat_groups(st, 3, which, count, str(f))
        if not all(t.dtype == torch.float32 for t in groups):
            raise CheckpointFormatError(f"{STATES[which]} partitions are not flat fp32 tensors", culprit=str(f),
                                        hint="pass a DeepSpeed ZeRO stage 3 checkpoint's own *_optim_states.pt files")
        flats.append([(t, 0, int(t.numel())) for t in groups])
    pages = PageDropper(files)  # the optimizer files are mapped now
    masters: dict[str, LazyTensor] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        share = math.ceil(numel / dp)
        if any(offset + share > sum(n for _, _, n in spans) for spans in flats):
            raise CheckpointFormatError(f"the fp32 partitions end before parameter {name}: param_shapes needs more "
                                        f"elements than the {dp} ranks hold", culprit=where,
                                        hint="param_shapes and the optimizer files do not belong together")
        pieces = [p for spans in flats for p in _pieces(spans, offset, share)]
        masters[name] = FlatSlice(_cut(pieces, numel), shape, pages)
        offset += share
    for spans, f in zip(flats, files):
        held = sum(n for _, _, n in spans)
        if offset != held:
            raise CheckpointFormatError(f"the parameters take {offset} fp32 elements per rank but it holds {held}",
                                        culprit=str(f), hint="param_shapes and the optimizer files do not belong "
                                                             "together")
    frozen = model_states[0].get("frozen_param_shapes") if which == "master" else None  # no moments
    for name, shape in (frozen or {}).items():
        frags = [ms.get("frozen_param_fragments", {}).get(name) for ms in model_states]
        if not all(isinstance(t, torch.Tensor) for t in frags):
            raise CheckpointFormatError(f"frozen parameter {name} lacks a fragment on some data-parallel rank",
                                        culprit=where, hint="supply every data-parallel rank's model states file")
        shape = tuple(int(d) for d in shape)
        pieces = [(t.reshape(-1), 0, int(t.numel())) for t in frags]
        masters[name] = Upcast(FlatSlice(_cut(pieces, math.prod(shape)), shape), torch.float32)
    shared = model_states[0].get("shared_params") or {}
    out: dict[str, Any] = {}
    for key, value in module.items():
        master = masters.get(key) or masters.get(shared.get(key, ""))
        if which != "master" and key in shared:
            continue  # moments: the owner's only (as ds_to_universal writes them)
        if master is not None or which == "master":
            out[key] = master if master is not None else value
    unused = sorted(set(masters) - set(module))
    if unused:
        raise InconsistentShardsError(f"param_shapes names {unused[:3]} that the module does not hold", culprit=where,
                                      hint="the model states file and the optimizer files do not belong together")
    return out


def _cut(pieces: list[tuple[torch.Tensor, int, int]], numel: int) -> list[tuple[torch.Tensor, int, int]]:
    """The first ``numel`` elements of ``pieces`` (the padding after them dropped)."""
    out, left = [], numel
    for t, start, n in pieces:
        if left <= 0:
            break
        out.append((t, start, min(n, left)))
        left -= n
    return out or [(pieces[0][0], 0, 0)]


def optimizer_state(path: Path) -> dict[str, Any]:
    """The ``optimizer_state_dict`` of one ZeRO optimizer file, memory-mapped (never written to;
    kept for every caller, who must not change it).

    Kept for the process (up to :data:`OPEN_FILES` files, keyed by path, size and modification time):
    every target of a conversion reads its sources' optimizer files, and a universal checkpoint is one
    target per parameter and state — parsing each file's pickle again for each would cost
    ``targets x TP x DP`` loads, where ``ds_to_universal`` reads each file once."""
    stat = os.stat(path)
    return _optimizer_state_of(str(path), stat.st_size, stat.st_mtime_ns)


#: Optimizer files kept loaded (mapped; their pages are given back as they are read).
OPEN_FILES = 1024


def forget_optimizer_files() -> None:
    """Drop the optimizer files kept loaded (a conversion calls this when it ends: a mapped file
    keeps its disk space after the shard cache evicts it)."""
    _optimizer_state_of.cache_clear()


def kept_optimizer_files() -> int:
    """How many optimizer files are kept loaded now (see :func:`optimizer_state`): none once a
    conversion has ended."""
    return _optimizer_state_of.cache_info().currsize


@functools.lru_cache(maxsize=OPEN_FILES)
def _optimizer_state_of(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    sd = load_shard(path)
    st = sd.get(OPTIM_STATE)
    if not isinstance(st, dict):
        raise CheckpointFormatError(f"has no {OPTIM_STATE!r} dict", culprit=str(path),
                                    hint="pass a DeepSpeed ZeRO checkpoint's *_optim_states.pt files")
    return st


def _flat_groups(state: Mapping[str, Any], stage: int, which: str, count: int, where: str) -> list[torch.Tensor]:
    """The ``count`` flat per-group tensors of state ``which`` in one optimizer file: the fp32
    partitions, or the base optimizer's per-group Adam moments (same lengths, same cut)."""
    if which == "master":
        groups: Any = state.get(PARTITIONS_KEY[stage])
        what = PARTITIONS_KEY[stage]
    else:
        base = state.get("base_optimizer_state" if stage < 3 else OPTIM_STATE)
        per_group = base.get("state") if isinstance(base, dict) else None
        groups = [per_group.get(g, {}).get(which) if isinstance(per_group, dict) and
                  isinstance(per_group.get(g), dict) else None for g in range(count)]
        what = f"the optimizer's {which} state"
    if not isinstance(groups, list) or len(groups) != count or \
            not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in groups):
        raise CheckpointFormatError(f"{what} does not hold {count} flat groups as param_shapes has", culprit=where,
                                    hint="the files do not belong together, or the optimizer is not Adam "
                                         "(only Adam's moments are read)" if which != "master" else
                                         "the files do not belong together")
    return groups


def _stage(state: Mapping[str, Any], where: str) -> int:
    """The ZeRO stage an optimizer file was saved at (1, 2 or 3, with that stage's partitions)."""
    raw = state.get("zero_stage")
    value = raw.foreign_args[0] if isinstance(raw, Foreign) and raw.foreign_args else raw
    if raw is None and "base_optimizer_state" in state:
        value = 0  # BF16_Optimizer
    if value not in PARTITIONS_KEY or PARTITIONS_KEY[value] not in state:
        raise CheckpointFormatError(f"is not a ZeRO optimizer file (zero_stage {value!r}, or no fp32 partitions)",
                                    culprit=where, hint="pass a DeepSpeed ZeRO checkpoint's *_optim_states.pt files")
    return int(value)


def _check_same_step(states: list[dict[str, Any]], files: Sequence[Path]) -> None:
    """Every data-parallel file must be from the same optimizer step (a partial overwrite mixes them)."""
    steps = [_step(st) for st in states]
    for step, f in zip(steps[1:], files[1:]):
        if step != steps[0]:
            raise InconsistentShardsError(f"optimizer step {step} differs from data-parallel rank 0's {steps[0]}",
                                          culprit=str(f), hint="the files come from different checkpoints; re-copy "
                                                               "one step's files")


def _step(state: Mapping[str, Any]) -> float | None:
    base = state.get("base_optimizer_state")
    per_param = base.get("state") if isinstance(base, dict) else None
    if isinstance(per_param, dict):
        for value in per_param.values():
            step = value.get("step") if isinstance(value, dict) else None
            if isinstance(step, torch.Tensor):
                return float(step.reshape(-1)[0])
            if isinstance(step, (int, float)):
                return float(step)
    return None


def _walk_group(gi: int, shapes: Mapping[str, Any], parts: list[torch.Tensor], pads: Any, dp: int,
                files: Sequence[Path], pages: PageDropper) -> dict[str, FlatSlice]:
    """Every parameter of group ``gi`` as its run of the flat group (see the module docstring)."""
    for p, f in zip(parts, files):
        if p.dtype != torch.float32:
            raise CheckpointFormatError(f"the fp32 partition of parameter group {gi} is {p.dtype}", culprit=str(f),
                                        hint="pass a DeepSpeed ZeRO checkpoint's own *_optim_states.pt files")
    if pads is not None and (not isinstance(pads, list) or len(pads) != len(shapes)):
        raise CheckpointFormatError(f"param_alignment_paddings of group {gi} does not list its {len(shapes)} "
                                    f"parameters", culprit=str(files[0]), hint="the files do not belong together")
    spans = [(p, 0, int(p.numel())) for p in parts]
    total = sum(n for _, _, n in spans)
    offset, out = 0, {}
    for k, (name, shape) in enumerate(shapes.items()):
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        if offset + numel > total:
            raise CheckpointFormatError(f"parameter group {gi} holds {total} fp32 elements but its parameters need "
                                        f"more (at {name})", culprit=str(files[0]),
                                        hint="param_shapes and the optimizer files do not belong together")
        out[name] = FlatSlice(_pieces(spans, offset, numel), shape, pages)
        offset += numel + (int(pads[k]) if pads is not None else 0)
    align = 2 * dp
    if math.ceil(offset / align) != math.ceil(total / align):
        raise CheckpointFormatError(f"parameter group {gi}: its parameters take {offset} fp32 elements but the "
                                    f"{dp} partitions hold {total} (more than DeepSpeed's padding)",
                                    culprit=str(files[0]), hint="param_shapes and the optimizer files do not "
                                                                "belong together")
    return out


def _pieces(spans: list[tuple[torch.Tensor, int, int]], lo: int, numel: int) -> list[tuple[torch.Tensor, int, int]]:
    """The parts of ``spans`` (end to end) holding elements ``[lo, lo + numel)``."""
    out = [(t, start, n) for t, start, n, _ in overlaps(spans, lo, lo + numel)]
    if not out:  # an empty parameter: a zero-length view of the first partition
        out.append((spans[0][0], 0, 0))
    return out
