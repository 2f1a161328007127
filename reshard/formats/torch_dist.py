"""megatron-core's ``torch_dist`` format (Megatron-LM ``--ckpt-format torch_dist``), read and written
without a cluster.

A torch_dist checkpoint is an iteration folder (``iter_XXXXXXX``, ``release``), alone or in a
Megatron-LM run folder (``latest_checkpointed_iteration.txt``), holding a
``torch.distributed.checkpoint`` folder: ``.metadata`` (the index, see
:mod:`reshard.core.dcp_metadata`), ``__R_K.distcp`` (the chunks every rank wrote), the common
state (``args``, ``iteration``, ...) and ``metadata.json`` (the backend). megatron-core before 0.19
writes the common state as ``common.pt`` (a torch file); from 0.19 on as one byte item of the
index, the ShardedObject ``common_state`` (:data:`COMMON_STATE`, ``torch.save`` of the one-element
list ``[common]``), and loads ``common.pt`` first where there is one: so does reshard
(:func:`common_state`). It is the checkpoint's metadata, never a parameter.

Keys are *global*: one entry per parameter whatever the TP, chunks of it from every rank; the
per-layer parameters of the stack's layers are stacked along a leading layer axis (or stored
per layer). Global tensors are exactly the TP 1 tensors of megatron-core's per-rank layout
(fused QKV grouped per query group, SwiGLU fc1 ``[all gate; all up]``, padded vocabulary rows),
so the checkpoint is laid out as a TP 1, PP 1 grid of one "file" (its ``.metadata``) whose module
holds :class:`~reshard.core.lazy.LazyTensor` s: a target reads only its rows of each chunk.

Names, torch_dist -> megatron-core per-rank: the layer axis, the expert axis and the renames of
the family's table (the family module says them, see "megatron-core's names in torch_dist" in
:mod:`reshard.models.megatron_gpt`). The renames apply when the saved ``args.transformer_impl`` is
``local``, or, where no ``args`` were saved (Megatron-Bridge), its ``run_config.yaml`` records
megatron-core's local layer spec (Transformer Engine's fused layer norms keep the torch_dist names):
a per-rank output's names are those of the spec its ``args`` name. Routed experts are SequentialMLP's
per rank, or grouped GEMM's where the saved ``args.moe_grouped_gemm`` says Transformer Engine's
``TEGroupedMLP`` holds them (its sharded state dict keys them as SequentialMLP's, see
:func:`~reshard.models.megatron_gpt.as_grouped_experts`). Optimizer state (``optimizer.*``)
and RNG state are skipped, reported as dropped, and never read (not even fetched: :meth:`needed_ranges`).
Outputs are written in Megatron-LM's per-rank layout (``writes_as``) unless ``--to torch_dist``
asks for this format: the same table backwards (:func:`global_items`; a legacy Megatron module
is first renamed by its family's table, :func:`reshard.models.megatron_gpt.as_megatron_core`),
one chunk per layer of each stacked key (per-layer keys when the layers differ: dense and MoE
layers mixed; one chunk per expert along the expert axis), the blobs streamed back to back into
``.distcp`` files — one, or files of at most ``--max-shard-size`` (default 5 GB) cut between
entries, each a target of its own so workers write them in parallel — at offsets that, like the
whole index, follow from the shapes alone (:func:`index_bytes`, :func:`write_distcp`).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import mmap
import os
import pickle
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reshard.core import foreign, remote, torch_writer
from reshard.core.dcp_metadata import (
    ChunkRef,
    DcpBytes,
    DcpMetadata,
    DcpTensor,
    check_storage,
    metadata_bytes,
    read_metadata,
)
from reshard.core.errors import CheckpointFormatError, CorruptCheckpointError, LayoutError, UnsafeCheckpointError
from reshard.core.lazy import LazyTensor, RowConcat
from reshard.core.pages import PageDropper
from reshard.core.remote import RemoteStorage, RemoteTensor
from reshard.core.safe_load import load_shard, refusal_reason, safe_torch_load, tensor_record
from reshard.core.source import MEGATRON, MEGATRON_LATEST, SourceCheckpoint, iteration_text
from reshard.core.torch_writer import PendingTensor
from reshard.formats.base import CheckpointFormat, size_groups
from reshard.formats.megatron import TOKENIZER_DIR, TOKENIZER_FILE, iteration_folder, tokenizer_files
from reshard.models import claiming_family
from reshard.models.bridge_config import RUN_CONFIG, run_config
from reshard.models.given_facts import run_config_facts
from reshard.models.megatron_gpt import (
    EXPERTS,
    LAYERS,
    LOCAL_EXPERT,
    MIN_CORE_COMPATIBLE_VERSION,
    PER_RANK_ONLY,
    as_grouped_experts,
    as_megatron_core,
    as_sequential_experts,
    beside_stack_entry,
    core_module,
    dist_renames,
    expert_dist_name,
    grouped_extra_states,
    is_megatron_core,
    per_rank_renames,
)

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan

TORCH_DIST = "torch_dist"
INDEX = ".metadata"
COMMON = "common.pt"
#: The byte item megatron-core >= 0.19 keeps the common state in: ``ShardedObject("common_state",
#: data, global_shape=(1,), global_offset=(0,))``'s unique key (its ``dist_checkpointing.save``).
COMMON_STATE = "common_state/shard_0_1"
CONFIG = "metadata.json"
#: Global keys that are not the model: skipped (never read), reported under these top-level names.
SKIPPED_ROOTS: dict[str, str] = {"optimizer.": "optimizer", "rng_state": "rng_state",
                                 "rerun_state_machine_state": "rerun_state_machine"}
_SHARD_RE = re.compile(r"^(?P<base>.+)/shard_(?P<offsets>[\d.]+)_(?P<shape>[\d.]+)$")


class TorchDistFormat(CheckpointFormat):
    """megatron-core's torch_dist (Megatron-LM --ckpt-format torch_dist): a .metadata index over
    .distcp files of global tensors."""

    name = TORCH_DIST
    title = "torch_dist"
    priority = 5  # before Megatron-LM's per-rank layout: both use latest_checkpointed_iteration.txt
    patterns = (re.compile(r"(^|/)__\d+_\d+\.distcp$"), re.compile(r"(^|/)common\.pt$"))
    #: ``run_config.yaml``: Megatron-Bridge's description of the model (:mod:`reshard.models.given_facts`)
    markers = (re.compile(r"(^|/)\.metadata$"), re.compile(r"(^|/)metadata\.json$"),
               re.compile(r"(^|/)run_config\.yaml$"))
    carries = (TOKENIZER_FILE,)
    writes_as = MEGATRON

    def near_miss(self, folder: Path) -> str | None:
        """``.distcp`` files without the ``.metadata`` index megatron-core writes last."""
        if any(c.suffix == ".distcp" or c.name == "metadata.json" for c in folder.iterdir()):
            return (f"a torch_dist checkpoint needs its {INDEX} index, which megatron-core writes when the save "
                    "finishes: copy it too, or point at a checkpoint whose save completed")
        return None

    def detect(self, folder: Path) -> bool:
        if (folder / INDEX).is_file():
            return True
        if (folder / MEGATRON_LATEST).is_file():
            try:
                return (iteration_folder(folder) / INDEX).is_file()
            except CheckpointFormatError:
                return False  # the per-rank layout reports the broken marker
        return False

    def needed_ranges(self, name: str, markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
        """A ``.distcp`` file's blobs of the model — never the optimizer's, which megatron-core
        writes into the same files — from the index beside it, touching runs merged."""
        folder, _, base = name.rpartition("/")
        index = markers.get(f"{folder}/{INDEX}" if folder else INDEX)
        if not base.endswith(".distcp") or index is None:
            return None
        meta = _metadata(Path(index))
        keys = set(model_keys(meta))
        keys.add(COMMON_STATE)  # the common state (megatron-core >= 0.19) is read beside the model
        spans = sorted({(c.offset, c.length) for t in meta.tensors.values() if t.key in keys for c in t.chunks
                        if c.file == base} | {(b.offset, b.length) for b in meta.byte_items.values()
                                               if b.key in keys and b.file == base})
        merged: list[list[int]] = []
        for off, length in spans:
            if merged and off <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], off + length - merged[-1][0])
            else:
                merged.append([off, length])
        return [(o, n) for o, n in merged]

    def skeleton(self, name: str, size: int, pread: Callable[[int, int], bytes],
                 markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
        """A ``.distcp`` file streams (nothing of it on disk: each blob's structure is read into
        memory through its source when it is first mapped, see :class:`MappedFile`); ``common.pt``
        is fetched whole."""
        return [] if name.endswith(".distcp") else None

    def shard_role(self, name: str, listing: Any) -> str | None:
        return None  # the index is read whole by locate; its blobs are checked against it there

    def locate(self, path: Path) -> SourceCheckpoint:
        folder = path if (path / INDEX).is_file() else iteration_folder(path)
        _check_backend(folder)
        meta = _metadata(folder / INDEX)
        model = model_keys(meta)
        if not model:
            raise CheckpointFormatError("the torch_dist index holds no model parameters (only "
                                        f"{', '.join(sorted(_skipped(meta))) or 'nothing'})", culprit=str(folder),
                                        hint="point at a checkpoint saved with the model's state")
        sizes = {f.name: f.stat().st_size for f in folder.iterdir() if f.suffix == ".distcp" and f.is_file()}
        read = set(model) | ({COMMON_STATE} & set(meta.byte_items))
        check_storage(meta, sizes, read, str(folder))
        aux = ([folder / COMMON] if (folder / COMMON).is_file() else []) + \
            [folder / f for f in sorted(meta.files(read))]
        return SourceCheckpoint((folder / INDEX,), origin=str(path), format=TORCH_DIST, pp=1,
                                iteration=folder.name, aux=tuple(aux))

    def load(self, path: Any) -> dict[str, Any]:
        p = Path(path)
        meta = _metadata(p)
        folder = p.parent
        common = common_state(meta, folder)
        args, impl = common.get("args"), _transformer_impl(common.get("args"), p)
        grouped = bool(getattr(args, "moe_grouped_gemm", False)) and any(EXPERTS in k for k in meta.keys)
        if grouped and (impl == "local" or getattr(args, "moe_use_legacy_grouped_gemm", False)):
            raise LayoutError("the experts were trained with the legacy grouped GEMM (args.moe_grouped_gemm with "
                              f"{'the local spec' if impl == 'local' else 'args.moe_use_legacy_grouped_gemm'}: "
                              "GroupedMLP), whose per-rank weights are not megatron-core's per-expert ones",
                              culprit=str(folder / COMMON if (folder / COMMON).is_file() else p),
                              hint="convert a per-rank checkpoint of this run instead")
        module = per_rank_module(meta, folder, impl, grouped=grouped)
        out: dict[str, Any] = {}
        for k, v in common.items():  # the module where Megatron-LM's per-rank files have it: after iteration
            if k != "model":
                out[k] = v
            if k == "iteration":
                out["model"] = module
        out.setdefault("model", module)
        for root in sorted(_skipped(meta)):
            out.setdefault(root, None)  # reported as dropped by the planner, never read
        return out

    def padding_tp(self, args: Any, source: SourceCheckpoint) -> int:
        saved = getattr(args, "tensor_model_parallel_size", None)
        return saved if isinstance(saved, int) and saved > 0 else 1

    # -- writing: global tensors (the TP 1 plan), one storage file, the index as a side file ------
    per_rank = False
    holds_experts = True  # on a global expert axis
    ckpt_format = TORCH_DIST

    def check_plan(self, plan: Plan) -> None:
        if plan.facts.naming != "megatron-core" and plan.version < MIN_CORE_COMPATIBLE_VERSION:
            raise LayoutError(f"checkpoint_version {plan.version:g} orders the fused QKV rows differently from "
                              "megatron-core, which torch_dist holds", culprit=plan.source.origin,
                              hint="convert it to its own per-rank layout instead (drop --to torch_dist)")
        if plan.options.quantize:
            raise LayoutError("torch_dist has no place for quantized weights (int8 scales, FP8 block scales)",
                              culprit="--quantize", hint="quantize int8 into a per-rank layout or fp8 into a "
                                                          "Hugging Face folder (drop --to torch_dist)")
        plan_layout(plan)  # entries stored split into parts need the args that size them: refused here

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        return f"{output_iteration(source)}/{DISTCP_NAME}"

    def extra_files(self, source: SourceCheckpoint) -> dict[str, str]:
        iteration = output_iteration(source)
        return {MEGATRON_LATEST: iteration_text(iteration),
                f"{iteration}/{CONFIG}": json.dumps({"sharded_backend": TORCH_DIST, "sharded_backend_version": 1,
                                                     "common_backend": "torch", "common_backend_version": 1})}

    def carried(self, source: SourceCheckpoint) -> dict[str, Path]:
        return tokenizer_files(Path(source.files[0]).parent)  # the index is in the iteration folder

    def carried_name(self, source: SourceCheckpoint, name: str) -> str | None:
        return f"{output_iteration(source)}/{TOKENIZER_DIR}/{name}"

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str | bytes]:
        """The index (from the shapes: blob sizes do not depend on the bytes), ``common.pt`` (the
        top-level entries, ``args`` describing the output, which holds no optimizer or RNG state:
        the engine's ``retarget_args``) and, where there are ``args``, Megatron-Bridge's
        ``run_config.yaml`` of the model (without which Megatron-Bridge loads no Megatron-LM
        checkpoint: :mod:`reshard.models.bridge_config`)."""
        sd = plan.target_state(0)
        folder = names[0].rsplit("/", 1)[0]
        layout = plan_layout(plan)
        files = [(name.rsplit("/", 1)[1], global_items((sd if tgt == 0 else plan.target_state(tgt))[plan.module_key],
                                                       layout)) for tgt, name in enumerate(names)]
        top = {k: v for k, v in sd.items() if k != plan.module_key}
        out: dict[str, str | bytes] = {f"{folder}/{INDEX}": index_bytes(files)}
        if top.get("args") is not None:
            if plan.facts.naming != "megatron-core":
                top["args"] = _core_args(top["args"])
            out[f"{folder}/{RUN_CONFIG}"] = run_config(top["args"])
        buf = io.BytesIO()
        torch.save(top, buf, pickle_module=foreign.ForeignPickleModule if foreign.contains_foreign(top) else pickle)
        out[f"{folder}/{COMMON}"] = buf.getvalue()
        return out

    def file_groups(self, sizes: Sequence[int], options: ReshardOptions) -> list[int]:
        """Files of at most ``--max-shard-size`` bytes (see :func:`~reshard.formats.base.size_groups`):
        each a target of its own, so a large model's files are written in parallel, by as many
        workers as there are files."""
        return size_groups(sizes, options.max_shard_size)

    def part_name(self, name: str, part: int, parts: int) -> str:
        return f"{name.rsplit('/', 1)[0]}/__{part}_0.distcp"

    def prepare(self, plan: Plan, tgt: int, sd: dict[str, Any]) -> Any:
        return DistcpFile(global_items(sd[plan.module_key], plan_layout(plan)))

    def write(self, obj: Any, path: str | os.PathLike[str], *, pickle_module: Any = None, sha256: bool = False,
              on_bytes: Callable[[int], None] | None = None, stream: Any = None) -> torch_writer.SaveStats:
        if not isinstance(obj, DistcpFile):
            raise torch_writer.WriterError("the torch_dist format writes what its prepare() returns")
        return write_distcp(obj.items, os.fspath(path), sha256=sha256, on_bytes=on_bytes, stream=stream)

    def writes_streams(self) -> bool:
        return True


#: The iteration folder of a torch_dist output whose source has no numbered one (a Hugging Face folder,
#: a Megatron-LM ``release``): Megatron-Bridge loads ``iter_*`` folders only (``load_megatron_model``
#: skips ``release/``), as its own ``import_ckpt`` writes them, and Megatron-LM loads it as the weights
#: alone since its ``args`` say no optimizer or RNG state was saved (its torch_dist loader honours
#: ``no_save_optim`` / ``no_save_rng``). Per-rank outputs keep ``release``: Megatron-LM loads their
#: weights alone only there (no flags needed), and Megatron-Bridge reads torch_dist only.
UNNUMBERED = "iter_0000000"


def output_iteration(source: SourceCheckpoint) -> str:
    """The iteration folder a torch_dist output of ``source`` is written in: the source's own, or
    :data:`UNNUMBERED` for none or ``release``."""
    iteration = source.iteration or "release"
    return UNNUMBERED if iteration == "release" else iteration


def _transformer_impl(args: Any, path: Path) -> Any:
    """The layer implementation the checkpoint was saved with: its saved ``args``, else (none saved)
    Megatron-Bridge's ``run_config.yaml`` beside it; None when neither says (Megatron-LM's default,
    Transformer Engine, whose names torch_dist keeps)."""
    if args is not None:
        return getattr(args, "transformer_impl", None)
    facts = run_config_facts(path)
    return getattr(facts, "transformer_impl", None)


def _core_args(args: Any) -> Any:
    """A legacy model's ``args`` as megatron-core's: written under megatron-core names, its layers are
    the local spec's (separate layer norms), which is how :func:`per_rank_module` reads them back."""
    new = copy.copy(args)
    new.transformer_impl = "local"
    if hasattr(new, "use_legacy_models"):
        new.use_legacy_models = False
    return new


def _check_backend(folder: Path) -> None:
    cfg = folder / CONFIG
    if not cfg.is_file():
        return  # plain torch.distributed.checkpoint folders have none
    try:
        backend = json.loads(cfg.read_text()).get("sharded_backend")
    except (ValueError, AttributeError, UnicodeDecodeError):
        raise CorruptCheckpointError("is not a JSON object", culprit=str(cfg), hint="re-copy the checkpoint") from None
    if backend != TORCH_DIST:
        raise CheckpointFormatError(f"sharded backend is {backend!r}; reshard reads torch_dist", culprit=str(cfg),
                                    hint="re-save with Megatron-LM's --ckpt-format torch_dist (or torch)")


@functools.lru_cache(maxsize=8)
def _metadata_cached(path: str, _mtime: int, _size: int) -> DcpMetadata:
    return read_metadata(path)


def _metadata(path: Path) -> DcpMetadata:
    st = path.stat()
    return _metadata_cached(str(path), st.st_mtime_ns, st.st_size)


def _skipped(meta: DcpMetadata) -> set[str]:
    return {root for k in meta.keys for prefix, root in SKIPPED_ROOTS.items() if k.startswith(prefix)}


def model_keys(meta: DcpMetadata) -> list[str]:
    """The global keys that belong to the model (everything but optimizer and RNG state, and the
    common state: :func:`common_state`)."""
    return [k for k in meta.keys if k != COMMON_STATE and not any(k.startswith(p) for p in SKIPPED_ROOTS)]


def common_state(meta: DcpMetadata, folder: Path) -> dict[str, Any]:
    """The checkpoint's common state (``args``, ``checkpoint_version``, ``iteration``, ...) as
    megatron-core's ``load_common_state_dict`` finds it: ``common.pt`` where the folder has one,
    else the :data:`COMMON_STATE` byte item (the list of one dict that megatron-core >= 0.19
    saves), else nothing (a plain ``torch.distributed.checkpoint`` folder). Weights-only with the
    allowlist, like any torch file reshard reads."""
    if (folder / COMMON).is_file():
        return load_shard(folder / COMMON)
    item = meta.byte_items.get(COMMON_STATE)
    if item is None:
        return {}
    path = folder / item.file
    value = _load_blob(path, item.offset, item.length, f"{path} ({COMMON_STATE})", allowlist=True)
    if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)):
        raise CorruptCheckpointError(f"the common state holds a {type(value).__name__}, not the list of one dict "
                                     "megatron-core saves", culprit=f"{path} ({COMMON_STATE})",
                                     hint="the checkpoint is corrupt or was not written by megatron-core; re-copy it")
    return value[0]


def per_rank_module(meta: DcpMetadata, folder: Path, transformer_impl: Any, *, grouped: bool = False
                    ) -> dict[str, Any]:
    """The module of megatron-core's per-rank layout at TP 1, tensors lazy (see the name table above);
    ``grouped``: the experts under grouped GEMM's per-rank names
    (:func:`~reshard.models.megatron_gpt.as_grouped_experts`)."""
    keys = set(model_keys(meta))
    stacked = [meta.tensors[k] for k in keys if k in meta.tensors and _is_stacked(k)]
    depths = {t.shape[0] if t.shape else None for t in stacked}
    if len(depths) > 1 or None in depths:
        raise CorruptCheckpointError("stacked layer parameters disagree on the number of layers: "
                                     f"{sorted(map(str, depths))}",
                                     culprit=str(folder / INDEX), hint="the checkpoint is inconsistent")
    # module order: megatron-core's (the index lists keys in module order, each layer's as one run)
    position: dict[str, int] = {}
    for k in model_keys(meta):
        m = _SHARD_RE.match(k)
        position.setdefault(m.group("base") if m else k, len(position))
    block: dict[str, int] = {}  # each experts' key group's first position: experts ordered by number in it
    for k, pos in position.items():
        if EXPERTS in k:
            block.setdefault(k.split(EXPERTS)[0], pos)
    entries: list[tuple[tuple[int, ...], str, Any]] = []  # (sort key, name, value)
    files: dict[str, MappedFile] = {}  # mapped on first read, shared by this module's tensors
    by_file: dict[str, list[ChunkRef]] = {}
    for t in (meta.tensors[k] for k in keys if k in meta.tensors):
        for c in t.chunks:
            by_file.setdefault(c.file, []).append(c)

    def chunks_of(name: str) -> Sequence[ChunkRef]:
        return by_file.get(name, [])

    for t in (meta.tensors[k] for k in keys if k in meta.tensors):
        stacked = _is_stacked(t.key)
        layers: Sequence[int | None] = range(t.shape[0]) if stacked else [None]
        experts: Sequence[int | None] = range(t.shape[int(stacked)]) if EXPERTS in t.key else [None]
        for i in layers:
            for g in experts:
                lead = tuple(x for x in (i, g) if x is not None)
                entries.append((_order(t.key, position, block, i, g), _entry_name(t.key, i, g),
                                DistTensor(t, folder, lead, files, chunks_of)))
    for item in (meta.byte_items[k] for k in keys if k in meta.byte_items):
        m = _SHARD_RE.match(item.key)
        base, offsets = (m.group("base"), [int(x) for x in m.group("offsets").split(".")]) if m else (item.key, [])
        i = offsets[0] if _is_stacked(base) and offsets else None
        g = offsets[int(i is not None)] if EXPERTS in base and len(offsets) > int(i is not None) else None
        if any(offsets[(i is not None) + (g is not None):]):
            continue  # a per-TP-rank copy: rank 0's is the one carried
        entries.append((_order(base, position, block, i, g), _entry_name(base, i, g), _ByteItem(item, folder)))
    names = per_rank_renames(transformer_impl)
    module: dict[str, Any] = {}
    for _, name, value in sorted(entries, key=lambda e: e[0]):
        for dist, per_rank in names.items():
            name = name.replace(dist, per_rank)
        module[name] = value.load() if isinstance(value, _ByteItem) else value
    for name, value in PER_RANK_ONLY.items():
        module.setdefault(name, value)
    return fused_parts(as_grouped_experts(module, str(folder / INDEX)) if grouped else module)


def fused_parts(module: dict[str, Any]) -> dict[str, Any]:
    """``module`` with the entries megatron-core's sharded state dict stores split into parts
    (``<name>.<part>``, as the claiming family's ``dist_parts`` says) fused back into one lazy tensor
    in its parts' order, at the place of its first part."""
    names = list(module)
    family = claiming_family(names)
    parts_of: dict[str, tuple[str, ...]] = {}
    for name in names:
        base, _, part = name.rpartition(".")
        parts = family.dist_parts(base) if base else None
        if parts and part in (p for p, _ in parts):
            parts_of[base] = tuple(p for p, _ in parts)
    if not parts_of:
        return module
    out: dict[str, Any] = {}
    for name, value in module.items():
        base = name.rpartition(".")[0]
        if base not in parts_of:
            out[name] = value
            continue
        if base in out:
            continue
        keys = [f"{base}.{p}" for p in parts_of[base]]
        missing = [k for k in keys if not isinstance(module.get(k), LazyTensor)]
        if missing:
            raise CorruptCheckpointError(f"{missing[0]} is missing beside {name} (megatron-core stores {base} as "
                                         f"{', '.join(parts_of[base])})", culprit=missing[0],
                                         hint="the checkpoint is incomplete; re-copy it")
        out[base] = RowConcat([(module[k], 0, module[k].shape[0]) for k in keys])
    return out




def _is_stacked(key: str) -> bool:
    return key.startswith(LAYERS) and not key[len(LAYERS):].split(".", 1)[0].isdigit()


def _layer_name(key: str, i: int) -> str:
    return f"{LAYERS}{i}.{key[len(LAYERS):]}"




def _entry_name(key: str, layer: int | None, expert: int | None) -> str:
    """The per-rank module name of layer ``layer`` (stacked keys) and expert ``expert`` of ``key``."""
    name = key if layer is None else _layer_name(key, layer)
    return name if expert is None else name.replace(EXPERTS, LOCAL_EXPERT.format(expert))


def _order(key: str, position: dict[str, int], block: dict[str, int], layer: int | None = None,
           expert: int | None = None) -> tuple[int, ...]:
    """Module order: embeddings, layers (by layer), then the rest (final norm, output layer), each
    as indexed; a layer's experts by number where its experts' keys are."""
    group = 0 if key.startswith("embedding.") else 1 if key.startswith(LAYERS) else 2
    if expert is None:
        return (group, layer or 0, position[key], -1, 0)
    return (group, layer or 0, block[key.split(EXPERTS)[0]], expert, position[key])


#: Bytes of each end of a streamed ``.distcp`` blob read as its structure (a one-tensor
#: ``torch.save`` archive keeps its pickle at the start, its directory at the end; a larger one
#: than guessed reads the rest exactly as it is asked for).
BLOB_EDGE = 4 << 10


class MappedFile:
    """One ``.distcp`` file mapped private copy-on-write: each chunk is a view of its ``torch.save``
    blob's data record (located from the blob's zip directory and its ``data.pkl``, read by an
    unpickler that knows only tensor rebuilding), read on first touch; pages are given back once
    used (:class:`~reshard.core.pages.PageDropper`). A blob that cannot be mapped is loaded instead."""

    def __init__(self, path: Path, chunks: Sequence[ChunkRef] = ()) -> None:
        self.path = path
        self.source = remote.source_for(path)  # a streamed stand-in: everything is read from there
        self.views: dict[int, torch.Tensor | RemoteTensor | None] = {}
        if self.source is not None:  # the blobs' structure: both edges of each, read into memory at once
            edges: list[tuple[int, int]] = []
            for c in chunks:
                edge = min(c.length, BLOB_EDGE)
                edges += [(c.offset, edge), (c.offset + c.length - edge, edge)]
            self.structure = remote.structure(self.source, lambda _pread: torch_writer.merge_ranges(edges, gap=0))
            self.mm = None
            self.pages = PageDropper(())  # nothing mapped
            return
        self.file = open(path, "rb")  # noqa: SIM115  (lives as long as the mapping's views)
        size = os.fstat(self.file.fileno()).st_size
        self.mm = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.pages = PageDropper([path])  # after mapping: it gives back pages of the mappings it finds now

    def view(self, c: ChunkRef, dtype: torch.dtype) -> torch.Tensor | RemoteTensor | None:
        """The chunk's tensor as a view of the mapping (of its source, for a streamed file), or
        None when its blob is not a plain stored tensor archive of the chunk's shape and dtype
        (then it is loaded and checked)."""
        if c.offset not in self.views:
            self.views[c.offset] = self._map(c, dtype)
        return self.views[c.offset]

    def _map(self, c: ChunkRef, dtype: torch.dtype) -> torch.Tensor | RemoteTensor | None:
        if self.mm is None and self.source is None:
            return None
        if self.source is not None:
            pread = self.structure.pread
        else:
            fd = self.file.fileno()
            pread = lambda n, off: os.pread(fd, n, off)  # noqa: E731
        try:
            entries = {e.name: e for e in torch_writer.zip_entries(pread, c.offset, c.offset + c.length)}
            pkl = entries["data.pkl"]
            rec = tensor_record(pread(pkl.size, pkl.data_offset))
            data = entries[f"data/{rec.key}"]
            if rec.dtype != dtype or rec.size != c.sizes or data.data_offset + data.size > c.offset + c.length:
                return None
            count = data.size // dtype.itemsize
            if count == 0:
                return None
            if self.source is not None:
                if data.data_offset + data.size > self.source.size:
                    return None
                return RemoteTensor(RemoteStorage(self.source, data.data_offset, data.size), rec.storage_offset,
                                    rec.size, rec.stride, dtype)
            base = torch.frombuffer(self.mm, dtype=dtype, offset=data.data_offset, count=count)
            return base.as_strided(rec.size, rec.stride, rec.storage_offset)
        except (torch_writer.WriterError, pickle.UnpicklingError, KeyError, ValueError, RuntimeError, OSError,
                struct.error, UnicodeDecodeError):
            return None

    def release(self, t: torch.Tensor) -> None:
        self.pages.drop(t.data_ptr(), t.numel() * t.element_size())


class DistTensor(LazyTensor):
    """One parameter (one layer of a stacked one) of a torch_dist checkpoint: a box that lies in
    one chunk and is contiguous there is returned as a view of the mapped file (no copy); any
    other box is gathered from the chunks that overlap it."""

    def __init__(self, t: DcpTensor, folder: Path, lead: tuple[int, ...], files: dict[str, MappedFile],
                 chunks_of: Callable[[str], Sequence[ChunkRef]]) -> None:
        self.t, self.folder, self.lead, self.files = t, folder, lead, files  # lead: layer and/or expert index
        self.chunks_of = chunks_of  # a file's chunks of the module (a streamed file reads their structure at once)
        self.shape = t.shape[len(lead):]
        self.dtype = t.dtype

    def _file(self, name: str) -> MappedFile:
        if name not in self.files:
            self.files[name] = MappedFile(self.folder / name, self.chunks_of(name))
        return self.files[name]

    def _hits(self, g_off: tuple[int, ...], g_size: tuple[int, ...]) -> list[tuple[ChunkRef, list[int], list[int]]]:
        hits = []
        for c in self.t.chunks:
            lo = [max(o, co) for o, co in zip(g_off, c.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(g_off, g_size, c.offsets, c.sizes)]
            if all(a < b for a, b in zip(lo, hi)):
                hits.append((c, lo, hi))
        return hits

    def _global(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (*self.lead, *offsets), (*(1 for _ in self.lead), *sizes)

    def view_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        if 0 in sizes:
            return None
        g_off, g_size = self._global(offsets, sizes)
        hits = self._hits(g_off, g_size)
        if len(hits) != 1 or hits[0][1] != list(g_off) or hits[0][2] != [o + s for o, s in zip(g_off, g_size)]:
            return None
        c = hits[0][0]
        view = self._file(c.file).view(c, self.dtype)
        if not isinstance(view, torch.Tensor):  # not mapped: read (below), not viewed
            return None
        sub = view[tuple(slice(a - co, b - co) for a, b, co in zip(hits[0][1], hits[0][2], c.offsets))]
        sub = sub[tuple(0 for _ in self.lead)]
        return sub if sub.is_contiguous() else None

    def read_box(self, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor | None = None) -> torch.Tensor:
        out, done = self._destination(offsets, sizes, out)
        if done or 0 in sizes:
            return out
        g_off, g_size = self._global(offsets, sizes)
        for c, lo, hi in self._hits(g_off, g_size):
            mapped = self._file(c.file).view(c, self.dtype)
            if isinstance(mapped, RemoteTensor):  # a streamed file: just the box, from its source
                src = mapped.read_box(tuple(a - co for a, co in zip(lo, c.offsets)),
                                      tuple(b - a for a, b in zip(lo, hi)))
            else:
                chunk = mapped if mapped is not None else self._chunk(c)
                src = chunk[tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c.offsets))]
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, g_off))
            src, dst = src[tuple(0 for _ in self.lead)], dst[len(self.lead):]
            out[dst] = src
            if isinstance(mapped, torch.Tensor):
                self._file(c.file).release(mapped)
        return out

    def release(self, t: torch.Tensor) -> None:
        for name in {c.file for c in self.t.chunks}:
            if name in self.files:
                self.files[name].release(t)

    def _chunk(self, c: ChunkRef) -> torch.Tensor:
        where = f"{self.folder / c.file} ({self.t.key} at {c.offsets})"
        t = _load_blob(self.folder / c.file, c.offset, c.length, where)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.sizes or t.dtype != self.dtype:
            what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CorruptCheckpointError(f"chunk holds {what}, the index says {c.sizes} {self.dtype}",
                                         culprit=where, hint="the checkpoint is inconsistent; re-copy it")
        return t

    def __repr__(self) -> str:
        return f"DistTensor({self.t.key!r}, lead={self.lead}, shape={self.shape}, dtype={self.dtype})"


class _ByteItem:
    def __init__(self, item: Any, folder: Path) -> None:
        self.item, self.folder = item, folder

    def load(self) -> Any:
        path = self.folder / self.item.file
        value = _load_blob(path, self.item.offset, self.item.length, f"{path} ({self.item.key})", allowlist=True)
        # megatron-core saves a sharded object as the list of its rank's objects under that key
        return value[0] if isinstance(value, list) and len(value) == 1 else value


def _load_blob(path: Path, offset: int, length: int, where: str, *, allowlist: bool = False) -> Any:
    """The object of the ``torch.save`` blob at ``[offset, offset + length)`` of ``path``, weights-only
    (read from the file's source when ``path`` is a streamed skeleton)."""
    source = remote.source_for(path)
    if source is not None and offset + length <= source.size:
        buf = bytearray(length)
        source.read_into(offset, memoryview(buf))
        blob = bytes(buf)
    else:
        with open(path, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
    if len(blob) != length:
        raise CorruptCheckpointError(f"{path.name} is truncated", culprit=where, hint="re-copy the file")
    try:
        return safe_torch_load(io.BytesIO(blob), allowlist=allowlist)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"refused to unpickle: {refusal_reason(exc)}; nothing from it was executed",
                                    culprit=where, hint="only load checkpoints from sources you trust") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CorruptCheckpointError(f"cannot read the blob: {str(exc).splitlines()[0][:200]}", culprit=where,
                                     hint="the .distcp file is truncated or corrupt; re-copy it") from None


# --- writing ----------------------------------------------------------------------------------------

#: The storage file reshard writes (rank 0, writer 0 in megatron-core's naming); an output cut
#: into several (``--max-shard-size``) names file ``i`` ``__i_0.distcp`` (see ``part_name``).
DISTCP_NAME = "__0_0.distcp"
_LAYER_KEY_RE = re.compile("^" + re.escape(LAYERS) + r"(\d+)\.(.+)$")


@dataclass(frozen=True)
class ModelLayout:
    """What the whole model's entry names decide about every entry's global key: one file of an
    output cut into several holds only some entries and must key them as the whole model does
    (the layer axis is the model's depth, not the file's; a file of embeddings alone is still a
    megatron-core model's)."""

    core: bool  #: names are megatron-core's (else renamed by the family's table first)
    layers: int  #: the stacked keys' leading axis
    stacked: bool  #: every layer holds the same entries (else keys stay per layer)
    experts: Mapping[int, int]  #: layer -> its experts (the next axis of an expert's key)
    #: ``_extra_state`` entries megatron-core's model asks for that no file of the source holds
    #: (a legacy model's, or a megatron-core-named one saved without them): made up as None
    made_up: frozenset[str] = frozenset()
    #: per-rank name part -> its torch_dist name part, as the family's table renames the model's
    #: entries (:func:`reshard.models.megatron_gpt.dist_renames`)
    renames: Mapping[str, str] = field(default_factory=dict)
    #: a layer beside the stack (never stacked, :func:`reshard.models.megatron_gpt.beside_stack_entry`)
    #: -> its experts (the leading axis of its experts' keys)
    beside_experts: Mapping[str, int] = field(default_factory=dict)
    #: entries megatron-core stores split into parts (the family's ``dist_parts``): name -> (part, rows)
    parts: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    #: per-rank entries torch_dist does not store (the family's ``dist_per_rank_only``)
    per_rank_only: frozenset[str] = frozenset(PER_RANK_ONLY)


def model_layout(names: Sequence[str], args: Any = None) -> ModelLayout:
    """The :class:`ModelLayout` of a module with entries ``names`` (a whole model's; ``args``: its
    saved ``args``, which size the parts of an entry stored split)."""
    family = claiming_family(list(names))
    parts = {n: p for n in names if (p := family.dist_parts(n, args)) is not None}
    if any(rows is None for p in parts.values() for _, rows in p):
        raise LayoutError("the args that size the parts torch_dist stores split are unknown", culprit="--to torch_dist",
                          hint="give the model's args (--model-config), or write a per-rank layout")
    core = is_megatron_core(names)
    given = set(names)
    names = list(core_module(dict.fromkeys(names)) if core else as_megatron_core(dict.fromkeys(names)))
    made_up = frozenset(n for n in [*names, *grouped_extra_states(names)]
                        if n not in given and n.endswith("._extra_state"))
    per_layer: dict[int, set[str]] = {}
    experts: dict[int, set[int]] = {}
    beside_experts: dict[str, set[int]] = {}
    for name in names:
        m = _LAYER_KEY_RE.match(name)
        if m:
            rest, g = _dist_name(m.group(2))
            per_layer.setdefault(int(m.group(1)), set()).add(rest)
            if g is not None:
                experts.setdefault(int(m.group(1)), set()).add(g)
        beside = beside_stack_entry(name)
        if beside and _dist_name(beside[1])[1] is not None:
            beside_experts.setdefault(beside[0], set()).add(_dist_name(beside[1])[1])
    stacked = family.dist_stacks_layers and len({frozenset(v) for v in per_layer.values()}) <= 1
    return ModelLayout(core, 1 + max(per_layer, default=-1), stacked,
                       {i: len(e) for i, e in experts.items()}, made_up,
                       renames=dist_renames(names) if family.dist_keys_map else {},
                       beside_experts={k: len(e) for k, e in beside_experts.items()},
                       parts={n: tuple((p, int(r)) for p, r in ps) for n, ps in parts.items()},
                       per_rank_only=frozenset(PER_RANK_ONLY) if family.dist_per_rank_only is None
                       else family.dist_per_rank_only)


def plan_layout(plan: Plan) -> ModelLayout:
    """The :class:`ModelLayout` of the model a plan writes, over all its files (with the output's
    ``args`` where the family stores some entry split into parts, which they size)."""
    names = [tp.out_key for t in plan.targets for tp in t.params]
    family = claiming_family(names)
    split = any(family.dist_parts(n) is not None for n in names)
    return model_layout(names, plan.target_state(0).get("args") if split else None)


@dataclass(frozen=True)
class DistcpFile:
    """What one ``.distcp`` file of the output holds: its entries, keyed for the whole model."""

    items: list[GlobalItem]


@dataclass(frozen=True)
class GlobalItem:
    """One entry of the written index: a tensor chunk (``dtype`` set) or a byte item."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    value: Any


def global_items(module: dict[str, Any], layout: ModelLayout | None = None) -> list[GlobalItem]:
    """A TP 1 megatron-core module (or a legacy one, renamed by its family's table) as torch_dist
    entries (the name table above, backwards): layer ``i`` of ``L`` becomes chunk ``i`` of the
    stacked key — or, when the layers differ (dense and MoE layers mixed), keys stay per layer, as
    megatron-core keeps them then; expert ``e`` of ``E`` is chunk ``e`` along the expert axis that
    follows; the family's renames apply (:attr:`ModelLayout.renames`); ``_extra_state`` becomes the byte item
    ``<key>/shard_<chunk offsets>_<axis sizes>`` (``shard_0_1`` for an entry of no axis).
    ``layout``: the whole model's, when ``module`` is one file's part of it (default: its own)."""
    layout = layout or model_layout(list(module))
    given = module
    if not layout.core:
        module = as_megatron_core(module)  # a legacy model: check_plan let only core-compatible QKV through
    elif layout.made_up:  # extra states the source lacks, in megatron-core's order
        module = core_module(module)
    # an extra state is made up beside its module's weight, in that file alone; one another file of
    # the source holds is that file's
    module = as_sequential_experts({k: v for k, v in module.items()
                                    if not k.endswith("._extra_state") or k in given or k in layout.made_up},
                                   lambda layer: layout.experts[layer], layout.made_up)
    layers, stacked = layout.layers, layout.stacked
    items = []
    for name, value in module.items():
        if name in layout.per_rank_only:
            continue
        for dist, per_rank in layout.renames.items():
            name = name.replace(per_rank, dist)
        m = _LAYER_KEY_RE.match(name)
        lead: tuple[int, ...] = ()
        axes: tuple[int, ...] = ()
        key = name
        if m:
            i = int(m.group(1))
            rest, g = _dist_name(m.group(2))
            key = f"{LAYERS}{rest}" if stacked else f"{LAYERS}{i}.{rest}"
            lead, axes = ((i,), (layers,)) if stacked else ((), ())
            if g is not None:
                lead, axes = (*lead, g), (*axes, layout.experts[i])
        elif (beside := beside_stack_entry(name)) and _dist_name(beside[1])[1] is not None:
            rest, g = _dist_name(beside[1])
            key, lead, axes = f"{beside[0]}.{rest}", (g,), (layout.beside_experts[beside[0]],)
        if name.endswith("._extra_state"):
            shard = f"shard_{'.'.join(map(str, lead))}_{'.'.join(map(str, axes))}" if lead else "shard_0_1"
            items.append(GlobalItem(f"{key}/{shard}", (), (), (), None, value))
            continue
        for part_key, piece in _split(key, value, layout.parts.get(name)):
            shape = tuple(piece.shape)
            items.append(GlobalItem(part_key, (*lead, *[0] * len(shape)), (*(1 for _ in lead), *shape),
                                    (*axes, *shape), piece.dtype, piece))
    return items


def _split(key: str, value: Any, parts: tuple[tuple[str, int], ...] | None) -> list[tuple[str, Any]]:
    """``value`` under ``key``, or its parts along dim 0 under ``key.<part>`` (a pending tensor's as
    pending row ranges, each made from the whole tensor while its part is written)."""
    if parts is None:
        return [(key, value)]
    if sum(rows for _, rows in parts) != value.shape[0]:
        raise LayoutError(f"{key} has {value.shape[0]} rows, its parts {dict(parts)} add up to "
                          f"{sum(rows for _, rows in parts)}", culprit=key, hint="check the model's args")
    out, first = [], 0
    for part, rows in parts:
        shape = (rows, *value.shape[1:])
        if isinstance(value, PendingTensor):
            piece: Any = PendingTensor(shape, value.dtype, functools.partial(_rows_of, value, first, rows),
                                       value.requires_grad, f"{key}.{part}")
        else:
            piece = value[first:first + rows]
        out.append((f"{key}.{part}", piece))
        first += rows
    return out


def _rows_of(whole: PendingTensor, first: int, rows: int, sink: Any) -> None:
    """Write rows ``first .. first + rows`` of the pending tensor ``whole`` (made whole, then let go)."""
    with whole.borrowed() as t:
        sink.write(t[first:first + rows].contiguous())


def _dist_name(rest: str) -> tuple[str, int | None]:
    """A layer entry's name in torch_dist (an expert's under the experts' shared key) and its expert."""
    return expert_dist_name(rest)


def _blob_tensor(item: GlobalItem) -> Any:
    """What one chunk's ``torch.save`` blob holds: the tensor in the chunk's shape."""
    v = item.value
    if isinstance(v, PendingTensor):
        return PendingTensor(item.sizes, v.dtype, v.produce, v.requires_grad, item.key)
    return v.reshape(item.sizes)


def _byte_blob(value: Any) -> bytes:
    """A byte item as megatron-core saves one: the list of the rank's objects under the key."""
    buf = io.BytesIO()
    obj = [value]
    torch.save(obj, buf, pickle_module=foreign.ForeignPickleModule if foreign.contains_foreign(obj) else pickle)
    return buf.getvalue()


def _placed(items: list[GlobalItem]) -> list[tuple[GlobalItem, int, int, bytes | None]]:
    """Each item with its (offset, length) in the ``.distcp`` file holding them — blobs back to
    back, a tensor's size from its shape — and a byte item's blob itself (small: serialized once)."""
    out, offset = [], 0
    for it in items:
        blob = _byte_blob(it.value) if it.dtype is None else None
        length = len(blob) if blob is not None else torch_writer.saved_size(_blob_tensor(it))
        out.append((it, offset, length, blob))
        offset += length
    return out


def index_bytes(files: Sequence[tuple[str, list[GlobalItem]]]) -> bytes:
    """The ``.metadata`` torch.distributed.checkpoint reads for ``files`` (name in the folder,
    the items :func:`write_distcp` writes there): a tensor cut over files has its chunks in each."""
    tensors: dict[str, DcpTensor] = {}
    byte_items: dict[str, DcpBytes] = {}
    keys: dict[str, None] = {}
    for file, it, offset, length in ((f, *p[:3]) for f, items in files for p in _placed(items)):
        keys.setdefault(it.key)
        if it.dtype is None:
            byte_items[it.key] = DcpBytes(it.key, file, offset, length)
            continue
        chunk = ChunkRef(it.offsets, it.sizes, file, offset, length)
        prev = tensors.get(it.key)
        tensors[it.key] = DcpTensor(it.key, it.shape, it.dtype, (prev.chunks if prev else ()) + (chunk,))
    return metadata_bytes(DcpMetadata(tensors, byte_items, tuple(keys)))


def write_distcp(items: list[GlobalItem], path: str, *, sha256: bool = False,
                 on_bytes: Callable[[int], None] | None = None, stream: Any = None) -> torch_writer.SaveStats:
    """Write the blobs of ``items`` back to back, each streamed as it is produced, exactly where
    :func:`index_bytes` says they are (with a ``stream``: the tensors' bytes go there, in order,
    and ``path`` keeps only the blobs' structure, see :func:`reshard.core.torch_writer.save`)."""
    with torch_writer.structure_path(path, streamed=stream is not None) as where:
        return _write_blobs(items, where, sha256=sha256, on_bytes=on_bytes, stream=stream)


def _write_blobs(items: list[GlobalItem], path: str, *, sha256: bool, on_bytes: Callable[[int], None] | None,
                 stream: Any) -> torch_writer.SaveStats:
    Path(path).write_bytes(b"")  # the blobs are written into it at their offsets
    stats = torch_writer.SaveStats()
    digest = torch_writer.file_digest(sha256, stream)  # fed blob by blob, in file order
    fd = os.open(path, os.O_RDWR)
    try:  # one write pipeline for the whole file: kept busy from blob to blob, not drained after each
        wt = torch_writer.writer_pipeline(fd, torch_writer.QUEUE_DEPTH, digest)
        try:
            for it, offset, length, blob in _placed(items):
                if blob is not None:
                    wt.put((memoryview(blob), offset, None, None))
                    size = len(blob)
                else:
                    shifted = None if on_bytes is None else (lambda n, o=offset: on_bytes(o + n))
                    size = torch_writer.save(_blob_tensor(it), path, offset=offset, digest=digest,
                                             keep_data=stream is None, pipeline=wt, on_bytes=shifted).size
                if size != length:
                    raise torch_writer.WriterError(f"{it.key}: wrote {size} bytes where the index says {length}")
                stats.size, stats.records = offset + size, stats.records + 1
        finally:
            wt.close()
    finally:
        os.close(fd)
    if digest is not None:
        stats.sha256 = digest.hexdigest()
    return stats
