"""Hugging Face safetensors folders, written for serving (``--to hf``): ``config.json``, the weights
as ``model.safetensors`` or as shards of at most ``--max-shard-size`` (``model-00001-of-0000N.safetensors``)
with ``model.safetensors.index.json`` — and read, to import a Hugging Face model into Megatron
layouts: the folder is a TP 1 megatron-core source whose tensors are lazy views of the mapped
safetensors files (:mod:`reshard.models.hf_import`, :mod:`reshard.core.safetensors_read`).

The architecture and the name table are the model family's (:mod:`reshard.models.hf_architectures`);
this module only lays bytes out. A safetensors file is an 8-byte header length, a JSON header
(name -> dtype, shape, byte range) and the tensors' bytes back to back, so the whole header
follows from the shapes: it is written first, then every megatron-core tensor is produced once,
in order, and its bytes are routed straight to the Hugging Face tensors they belong to (a fused
QKV into Q, K and V; Megatron's padding rows of the vocabulary dropped). Nothing is assembled
whole; each tensor's region is hashed once it is complete, beside the writing. A stacked tensor
(one Hugging Face tensor made of many megatron-core ones, :mod:`reshard.models.stacked`) is
written slab by slab, its megatron-core tensors one after another, one slab held at a time, and
never cut between files (:meth:`HFFormat.together`).

The planner writes global tensors (TP 1, one pipeline stage); a target too large for one file is
cut, between megatron-core tensors, into several (:meth:`HFFormat.file_groups`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import struct
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reshard.core import band_threads, mxfp4
from reshard.core.band_threads import band_workers
from reshard.core.compressed_tensors_out import SCHEMES as CT_SCHEMES
from reshard.core.compressed_tensors_out import Encoding, fused_with, shape_tensor
from reshard.core.errors import CheckpointFormatError, CorruptCheckpointError, LayoutError, UnsafeCheckpointError
from reshard.core.fp8_block import (
    DEFAULT_BLOCK,
    E4M3,
    NonFiniteWeightError,
    quantization_config,
    quantize_chunks,
    scale_name,
    scale_shape,
)
from reshard.core.like_source import LIKE_SOURCE, LikeSource, open_like
from reshard.core.release_codecs import SIDECAR, read_release_quantization, release_config, release_dequantized
from reshard.core.row_bands import RowBandSink, in_order
from reshard.core.safetensors_read import ST_DTYPES, MappedSafetensors
from reshard.core.source import MEGATRON, MODULE_KEYS, SourceCheckpoint
from reshard.core.torch_writer import (
    PUNCH_BYTES,
    QUEUE_DEPTH,
    PendingTensor,
    RecordSink,
    SaveStats,
    WriterError,
    WriteStage,
    as_bytes,
    file_digest,
    punch_hole,
    tensor_bytes,
    writer_pipeline,
)
from reshard.formats.base import CheckpointFormat, size_groups
from reshard.models.given_facts import with_flags
from reshard.models.hf_architectures import (
    HF_DTYPES,
    Export,
    HFArchitecture,
    Transform,
    export_of,
    ffn_widths,
    linear_weight,
    transposed_slab,
    with_token_ids,
)
from reshard.models.hf_import import megatron_state
from reshard.models.hf_registry import decide_export, export_as, hf_architecture, hf_architectures, read_config
from reshard.models.megatron_gpt import (
    CORE_ROLES,
    FLOAT32_BUFFER,
    MIN_CORE_COMPATIBLE_VERSION,
    as_megatron_core,
    core_name,
)
from reshard.models.stacked import stacked_name

if TYPE_CHECKING:
    from reshard.core.options import ReshardOptions
    from reshard.core.plan_types import Plan, SourceRead

HF = "hf"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
#: Pickle weights transformers used to write: recognized, to be refused.
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: Megatron-LM's default ``--make-vocab-size-divisible-by``: an import pads the vocabulary as it would.
MEGATRON_VOCAB_DIVISOR = 128
#: What transformers saves beside the weights that no weight depends on and a conversion carries
#: unchanged: the tokenizer (the files of every kind of tokenizer, its chat templates, the module
#: of a remote-code tokenizer that ``tokenizer_config.json``'s ``auto_map`` names) and the
#: generation config. Relative to the folder.
CARRIED = re.compile(r"^(?:tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
                     r"|tokenizer\.model|tiktoken\.model|[^/]+\.tiktoken|vocab\.json|vocab\.txt|merges\.txt"
                     r"|chat_template\.(?:jinja|json)|additional_chat_templates/[^/]+\.jinja"
                     r"|tokenization_[^/]+\.py|generation_config\.json)$")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpointError("is not valid JSON", culprit=str(path), hint="re-copy the file") from None


def _config(folder: Path) -> Any:
    """``config.json`` of ``folder``, with the quantization ``hf_quant_config.json`` beside it
    declares (ModelOpt's export) when it declares none itself."""
    config = _json(folder / CONFIG)
    sidecar = folder / SIDECAR
    return release_config(config, _json(sidecar) if sidecar.is_file() else None)


def _model_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The dtype quantized weights (FP8, MXFP4) are read as: the model's own (``torch_dtype``,
    transformers 5's ``dtype``) — the quantization is the weights' encoding, not the model's
    dtype — else bfloat16."""
    named = config.get("dtype") or config.get("torch_dtype")
    return next((dtype for dtype, name in HF_DTYPES.items() if name == named), torch.bfloat16)


def _weight_map(folder: Path) -> dict[str, str]:
    """The index's tensor name -> file name."""
    wm = _json(folder / INDEX)
    wm = wm.get("weight_map") if isinstance(wm, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) and "/" not in v
                                           for k, v in wm.items()):
        raise CorruptCheckpointError("has no weight_map of tensor names to file names", culprit=str(folder / INDEX),
                                     hint="re-copy the index, or re-save the model")
    return wm


class HFFormat(CheckpointFormat):
    """Hugging Face: config.json and safetensors (sharded, with an index), as transformers and vLLM load them."""

    name = HF
    title = "Hugging Face safetensors"
    priority = 90  # after the Megatron and DeepSpeed layouts: a config.json alone says little
    #: weight files (pickle ones listed too: to be refused by name, never read)
    patterns = (re.compile(r"(^|/)[^/]+\.safetensors$"), re.compile(r"(^|/)pytorch_model[^/]*\.bin$"))
    markers = (re.compile(r"(^|/)config\.json$"),
               re.compile(r"(^|/)(model\.safetensors|pytorch_model\.bin)\.index\.json$"),
               re.compile(r"(^|/)" + re.escape(SIDECAR) + "$"))  # ModelOpt's declaration of its quantization
    carries = (CARRIED,)
    writes_as = MEGATRON  # an import: megatron-core's per-rank layout unless --to says otherwise
    vocab_divisor = MEGATRON_VOCAB_DIVISOR
    state_dicts = False  # config.json and tensors: its import is made a Megatron-LM state dict

    # -- reading ------------------------------------------------------------------------------
    def detect(self, folder: Path) -> bool:
        return (folder / CONFIG).is_file() and any(
            (folder / n).is_file() for n in (WEIGHTS, INDEX, *PICKLE_WEIGHTS))

    def near_miss(self, folder: Path) -> str | None:
        """``config.json`` without weights, or safetensors files without ``config.json``."""
        if (folder / CONFIG).is_file():
            return (f"a Hugging Face folder needs its weights beside {CONFIG}: {WEIGHTS}, or {INDEX} and the "
                    "shards it lists")
        if any(c.suffix == ".safetensors" for c in folder.iterdir()):
            return f"a Hugging Face folder needs its {CONFIG} beside the safetensors files"
        return None

    def shard_role(self, name: str, listing: Any) -> str | None:
        return None  # weight files are checked against config.json and the index when loaded

    def locate(self, path: Path) -> SourceCheckpoint:
        """The folder as a TP 1 grid of one "file", its ``config.json`` (what every target reads
        first); the weight files are ``aux``. Only names are read here (in a pipeline the weights
        may not be fetched yet): their headers are checked by :meth:`load`."""
        config = _config(path)  # refuse an architecture or a quantization before anything is fetched
        read_config(config, str(path / CONFIG))
        read_release_quantization(config, str(path / CONFIG))
        indexed = (path / INDEX).is_file()
        files = sorted(set(_weight_map(path).values())) if indexed else [WEIGHTS] if (path / WEIGHTS).is_file() else []
        if not files:
            pickled = next(n for n in PICKLE_WEIGHTS if (path / n).is_file())
            raise UnsafeCheckpointError(f"holds {pickled}: PyTorch pickle weights, which reshard does not "
                                        "unpickle", culprit=str(path),
                                        hint="re-save the model with save_pretrained(..., safe_serialization=True)")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointFormatError(f"{INDEX} lists {missing[0]}, which is missing"
                                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                        culprit=str(path), hint="copy every shard the index lists")
        aux = ([path / INDEX] if indexed else []) + [path / f for f in files] + \
            ([path / SIDECAR] if (path / SIDECAR).is_file() else [])
        return SourceCheckpoint((path / CONFIG,), origin=str(path), format=HF, pp=1, iteration="release",
                                aux=tuple(aux))

    def carried(self, source: SourceCheckpoint) -> dict[str, Path]:
        root = Path(source.files[0]).parent  # config.json's folder
        found = sorted((*root.glob("*"), *root.glob("*/*")))
        return {p.relative_to(root).as_posix(): p for p in found
                if p.is_file() and CARRIED.match(p.relative_to(root).as_posix())}

    def quantization(self, source: SourceCheckpoint) -> dict[str, Any] | None:
        config = _config(Path(source.files[0]).parent)
        quantization = read_release_quantization(config, str(source.files[0]))
        return None if quantization is None else quantization.summary()

    def stored(self, source: SourceCheckpoint) -> dict[str, Any]:
        """The class ``config.json`` names, the dtypes of the safetensors files' tensors (their
        headers), and which tensors the quantization encodes."""
        folder = Path(source.files[0]).parent
        config = _config(folder)
        dtypes: dict[str, torch.dtype] = {}
        for name in sorted(set(_weight_map(folder).values())) if (folder / INDEX).is_file() else [WEIGHTS]:
            dtypes.update({key: e.dtype for key, e in MappedSafetensors(folder / name).entries.items()})
        out: dict[str, Any] = {"architecture": read_config(config, str(folder / CONFIG)).architecture,
                               "dtypes": sorted({str(d).removeprefix("torch.") for d in dtypes.values()})}
        quantization = read_release_quantization(config, str(folder / CONFIG))
        if quantization is not None:
            encoded = [key for key, dtype in dtypes.items() if quantization.codec.encoded(key, dtype)]
            out["quantization"] = {**quantization.summary(), "tensors": len(encoded),
                                   "names": sorted({re.sub(r"\.\d+\.", ".*.", k) for k in encoded})}
        return out

    def inspected_as(self, source: SourceCheckpoint) -> str | None:
        """A folder of an architecture megatron-core does not compute (``hf_only``) is described as
        what it can only be converted into: a Hugging Face folder."""
        config = _json(Path(source.files[0]))
        arch = hf_architecture(read_config(config, str(source.files[0])).architecture)
        return self.name if arch.hf_only is not None else None

    def read(self, source: SourceCheckpoint, options: ReshardOptions, *, headers_only: bool = False) -> SourceRead:
        """The default read, and what ``config.json`` declares that the folder does not hold (its
        architecture's :meth:`~reshard.models.hf_architectures.HFArchitectureFamily.import_warnings`);
        an architecture megatron-core does not compute (``hf_only``) refused unless ``--to hf``."""
        config = _json(Path(source.files[0]))
        arch = hf_architecture(read_config(config, str(source.files[0])).architecture)
        if arch.hf_only is not None and options.to != self.name:  # refused before anything is written
            raise LayoutError(f"megatron-core does not compute {arch.name}: {arch.hf_only}",
                              culprit=str(source.files[0]), hint="convert it to a Hugging Face folder (--to hf, "
                                                                 "--quantize fp8 for FP8 blocks)")
        read = super().read(source, options, headers_only=headers_only)
        return dataclasses.replace(read, warnings=(*read.warnings, *arch.import_warnings(config, read.args)))

    def load(self, path: Any) -> dict[str, Any]:
        """Megatron-LM's TP 1 per-rank state of the folder (:func:`~reshard.models.hf_import.megatron_state`),
        every tensor a lazy view of the mapped safetensors files, after every file's header (validated by
        the ``safetensors`` library) has been checked against the index."""
        folder = Path(path).parent
        config = _config(folder)
        model = read_config(config, str(folder / CONFIG))
        quantization = read_release_quantization(config, str(folder / CONFIG))
        indexed = _weight_map(folder) if (folder / INDEX).is_file() else None
        tensors: dict[str, Any] = {}
        for name in sorted(set(indexed.values())) if indexed is not None else [WEIGHTS]:
            file = MappedSafetensors(folder / name)
            for key in file.entries:
                if indexed is not None and indexed.get(key) != name:
                    where = f"in {indexed[key]}" if key in indexed else "absent"
                    raise CheckpointFormatError(f"{name} holds {key}, which the index says is {where}",
                                                culprit=str(folder / INDEX), hint="the index does not belong to "
                                                "these files; re-copy the folder")
                tensors[key] = file.tensor(key)
        absent = sorted(set(indexed or ()) - set(tensors))
        if indexed is not None and absent:
            raise CheckpointFormatError(f"the index lists {absent[0]} in {indexed[absent[0]]}, which does not hold "
                                        "it", culprit=str(folder / INDEX),
                                        hint="the index does not belong to these files; re-copy the folder")
        return megatron_state(release_dequantized(tensors, quantization, _model_dtype(config), str(folder)), model)

    # -- writing ------------------------------------------------------------------------------
    per_rank = False
    holds_experts = True  # Mixtral and Qwen2-MoE (global expert numbers)

    holds_fp8 = True
    holds_mxfp4 = True
    holds_compressed_tensors = True
    holds_like_source = True

    def check_plan(self, plan: Plan) -> None:
        if plan.options.int8:
            raise LayoutError("Hugging Face safetensors has no place for reshard's int8 quantization record",
                              culprit="--quantize", hint="quantize into a per-rank layout (drop --to hf), or "
                                                         "--quantize fp8 for FP8 block-scaled weights")
        if plan.facts.naming != "megatron-core" and plan.version < MIN_CORE_COMPATIBLE_VERSION:
            raise LayoutError(f"checkpoint_version {plan.version:g} orders the fused QKV rows differently from "
                              "megatron-core", culprit=plan.source.origin,
                              hint="convert it to its own per-rank layout instead (drop --to hf)")
        like = _like(plan)  # the release folder first: it exists and reshard writes its quantization
        arch = architecture(plan)  # refuses what no architecture computes exactly, before any byte is written
        if like is not None:
            _check_like(plan, arch, like)
        if plan.options.quantize == "fp8":
            _check_fp8(plan, arch)
        if plan.options.quantize == "mxfp4":
            _check_mxfp4(plan, arch)
        encoding = _ct_encoding(plan)
        if encoding is not None:
            _check_ct(plan, arch, encoding)

    def plan_warnings(self, plan: Plan) -> list[str]:
        return _like_warnings(plan)

    def target_name(self, source: SourceCheckpoint, *, tp_rank: int, pp_rank: int, pp: int) -> str:
        return WEIGHTS

    def carried_name(self, source: SourceCheckpoint, name: str) -> str | None:
        """At the folder's root, as transformers saves it: a file transformers saves there
        (:data:`CARRIED`), never one of the weights' or the config's names."""
        return name if CARRIED.match(name) else None

    def file_groups(self, sizes: Sequence[int], options: ReshardOptions) -> list[int]:
        """Shards of at most ``--max-shard-size`` bytes (see :func:`~reshard.formats.base.size_groups`)."""
        return size_groups(sizes, options.max_shard_size)

    def together(self, keys: Sequence[str], options: ReshardOptions) -> list[str | None]:
        """The tensors one stacked Hugging Face tensor is made of (a layer's experts) share its file:
        grouped by that tensor's name, in the class written (``--hf-architecture``'s, else any
        registered one)."""
        archs = [hf_architecture(options.hf_architecture)] if options.hf_architecture else hf_architectures()
        tables = [a.names for a in archs]
        return [stacked_name(key, tables) for key in keys]

    def part_name(self, name: str, part: int, parts: int) -> str:
        return name if parts == 1 else f"model-{part + 1:05d}-of-{parts:05d}.safetensors"

    def stored_bytes(self, key: str, size: int, dtype: torch.dtype | None, options: ReshardOptions,
                     keys: Collection[str] = ()) -> int:
        """A linear weight under ``--quantize fp8``: a byte per element and a float32 scale per block;
        a tensor the export writes more than once (an architecture's copies of the embeddings in its
        layers beside the stack), each copy (``--max-shard-size`` cuts by the bytes written, as Hugging
        Face's own saving does; ``keys``: the model's megatron-core names)."""
        # the class written: --hf-architecture's, else any registered one (their linear rows agree)
        archs = [hf_architecture(options.hf_architecture)] if options.hf_architecture else hf_architectures()
        tables = [a.names for a in archs]
        size *= max((transform.copies(keys) for patterns, transform in _copying_rows(tuple(a.name for a in archs))
                     if any(p.match(key) for p in patterns)), default=1)
        if options.quantize == "mxfp4" and dtype is not None and transposed_slab(key, tables):
            elements = size // dtype.itemsize  # half a byte a value, a byte a group of 32
            return elements // 2 + elements // mxfp4.GROUP
        if options.quantize in CT_SCHEMES and dtype is not None and linear_weight(key, tables):
            return Encoding(options.quantize, options.group_size).stored_bytes(size // dtype.itemsize, dtype.itemsize)
        if options.quantize != "fp8" or dtype is None:
            return size
        if not linear_weight(key, tables):
            return size
        b0, b1 = options.fp8_block or DEFAULT_BLOCK
        elements = size // dtype.itemsize
        return elements + 4 * -(-elements // (b0 * b1))

    def side_files(self, plan: Plan, names: list[str]) -> dict[str, str | bytes]:
        arch = architecture(plan)
        config = dict(arch.config)
        block = _fp8_block(plan)
        if block is not None:  # the linear layers that stay in the model's dtype, named for transformers and vLLM
            kept = sorted(e.name.removesuffix(".weight") for tgt in range(len(names)) for e in _file_entries(plan, tgt)
                          if e.dtype != E4M3 and len(e.shape) == 2 and e.name.endswith(".weight"))
            config["quantization_config"] = {**quantization_config(block), "modules_to_not_convert": kept}
        if plan.options.quantize == "mxfp4":
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted(
                [e for tgt in range(len(names)) for e in _file_entries(plan, tgt)])}
        encoding = _ct_encoding(plan)
        if encoding is not None:
            config["quantization_config"] = encoding.quantization_config(_ct_ignored(plan, len(names)))
        like = _like(plan)
        if like is not None and like.quantization_config is not None:  # the release's, as it is
            config["quantization_config"] = like.quantization_config
        out: dict[str, str | bytes] = {CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"}
        if like is not None and like.sidecar is not None:  # ModelOpt's declaration, as the release has it
            out[SIDECAR] = like.sidecar
        if len(names) > 1:
            weight_map, total = {}, 0
            for tgt, name in enumerate(names):
                for entry in _file_entries(plan, tgt):
                    weight_map[entry.name] = name
                    total += entry.nbytes
            out[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                                    indent=2) + "\n"
        return out

    def describe(self, plan: Plan) -> list[str]:
        arch = architecture(plan)
        block = _fp8_block(plan)
        fp8 = [] if block is None else [f"linear weights FP8 e4m3, scales float32 per {block[0]} x {block[1]} block"]
        if plan.options.quantize == "mxfp4":
            fp8 = [f"stacked [in, out] weights MXFP4 (e2m1, an e8m0 scale per {mxfp4.GROUP} inputs), the rest "
                   "as they are"]
        encoding = _ct_encoding(plan)
        if encoding is not None:
            fp8 = [f"linear weights in compressed-tensors' {encoding.quantization_config(())['format']} "
                   f"({encoding.scheme}), the rest as they are"]
        like = _like(plan)
        if like is not None:
            fp8 = [f"quantized as {like.folder} ({like.quantization.codec.method}): weights equal to its "
                   "dequantized ones keep its codes and scales, the rest quantized afresh by its scheme"]
        return [f"architecture {arch.name}: {arch.reason}", *arch.notes, *fp8]

    def prepare(self, plan: Plan, tgt: int, sd: dict[str, Any]) -> Any:
        return SafetensorsFile(_exports(plan, tgt, _module(sd, plan)), _like(plan))

    def write(self, obj: Any, path: str | os.PathLike[str], *, pickle_module: Any = None, sha256: bool = False,
              on_bytes: Callable[[int], None] | None = None, stream: Any = None,
              device: torch.device | None = None) -> SaveStats:
        if not isinstance(obj, SafetensorsFile):
            raise WriterError("the hf format writes what its prepare() returns")
        return obj.write(os.fspath(path), sha256=sha256, on_bytes=on_bytes, stream=stream, device=device)

    def writes_streams(self) -> bool:
        return True

    def encodes_on_device(self) -> bool:
        return True

    def skeleton(self, name: str, size: int, pread: Callable[[int, int], bytes],
                 markers: Mapping[str, Path]) -> list[tuple[int, int]] | None:
        """A safetensors file's header (its length, then the JSON): the tensors are read while converting."""
        if not name.endswith(".safetensors") or size < 8:
            return None
        (n,) = struct.unpack("<Q", pread(8, 0))
        return [(0, 8 + n)] if 8 + n <= size else None


# --- what one file holds ------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """One Hugging Face tensor of a file, at its byte range of the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _module(sd: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The target's module under megatron-core names (a legacy model's renamed by its family's table)."""
    module = next((sd[k] for k in MODULE_KEYS if isinstance(sd.get(k), dict)), None)
    if module is None:
        raise WriterError("the target state has no module")
    return module if plan.facts.naming == "megatron-core" else as_megatron_core(module)


def architecture(plan: Plan) -> HFArchitecture:
    """The architecture of the whole model, from the plan's parameters and the saved ``args``."""
    return _PER_PLAN.get(plan, "architecture", lambda: _architecture(plan))


def _architecture(plan: Plan) -> HFArchitecture:
    legacy = plan.facts.naming != "megatron-core"
    written = {core_name(tp.out_key) if legacy else tp.out_key: tp.param for t in plan.targets for tp in t.params}
    keys = set(written)
    dtypes = {p.dtype for key, p in written.items() if p.dtype is not None and not FLOAT32_BUFFER.search(key)}
    split_rows = {}  # the whole model's size of every split tensor along its split dim
    for key, p in written.items():
        if p.spec is not None:
            split = plan.degrees.of(p.rule)[0]  # the source TP (expert TP) it is split over
            split_rows[key] = p.shape[p.spec.dim] * split if p.spec.total is None else p.spec.total * p.spec.parts
    widths = ffn_widths(split_rows, bool(plan.facts.swiglu))
    if len(dtypes) > 1:
        raise LayoutError(f"the weights mix dtypes {sorted(map(str, dtypes))}", culprit="--to hf",
                          hint="Hugging Face's config.json records one dtype")
    args = with_flags(plan.target_state(0).get("args"), plan.options, "--to hf")
    decided = decide_export(args, plan.facts, keys, dtypes.pop() if dtypes else torch.float32, widths)
    return with_token_ids(export_as(decided, plan.options.hf_architecture), args)


class _PerPlan:
    """What this format derives from a plan, computed once: checking it, its side files, its
    description and each target's preparation all see the same plan object in one process."""

    def __init__(self) -> None:
        self.plan: Any = None
        self.values: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def get(self, plan: Plan, key: Any, compute: Callable[[], Any]) -> Any:
        with self.lock:
            if self.plan is not plan:
                self.plan, self.values = plan, {}
            if key in self.values:
                return self.values[key]
        value = compute()
        with self.lock:
            if self.plan is plan:
                self.values[key] = value
        return value


_PER_PLAN = _PerPlan()


def _fp8_block(plan: Plan) -> tuple[int, int] | None:
    """The FP8 scale blocks of the output (``--quantize fp8``), else None."""
    if plan.options.quantize != "fp8":
        return None
    return plan.options.fp8_block or DEFAULT_BLOCK


def _like(plan: Plan) -> LikeSource | None:
    """The release folder of ``--quantize like-source`` (``--quantize-like``), opened once per plan."""
    if plan.options.quantize != LIKE_SOURCE:
        return None
    return _PER_PLAN.get(plan, "like", lambda: open_like(str(plan.options.quantize_like)))


def _like_encoding(like: LikeSource, exp: Export) -> Any:
    """The encoding ``--quantize like-source`` gives export ``exp`` (one for all its outputs: they
    are written from one megatron-core tensor), refused where its outputs' differ."""
    found = [like.encoding(o.name, tuple(o.shape), slab=exp.part is not None, linear=exp.linear,
                           transposed=exp.transposed_slab) for o in exp.outputs]
    if any(f != found[0] for f in found[1:]):
        raise LayoutError(f"{like.folder} quantizes {', '.join(o.name for o, f in zip(exp.outputs, found) if f)} but "
                          f"not {', '.join(o.name for o, f in zip(exp.outputs, found) if not f)}, which reshard "
                          f"writes from one tensor ({exp.key})", culprit="--quantize-like",
                          hint="export without --quantize and quantize with the release's own tools")
    return found[0] if found else None


def _check_like(plan: Plan, arch: HFArchitecture, like: LikeSource) -> None:
    """``--quantize like-source``: the release is this architecture; each quantized output is one the
    release's scheme can write (a stacked weight for MXFP4, a whole ``[out, in]`` weight else, of a
    float dtype; compressed-tensors' group widths; an NVFP4 fused group made from one tensor); and
    where a weight would be copied, the release's stored tensors are what the scheme lays out
    (same scheme, same shapes)."""
    where = str(like.folder)
    fused: dict[str, str] = {}  # each module under a global scale -> the megatron-core tensor it is made from
    if like.architectures and arch.name not in like.architectures:
        raise LayoutError(f"is a {', '.join(like.architectures)}, not the {arch.name} written", culprit=where,
                          hint="--quantize-like takes the release this model was imported from")
    for tgt in range(len(plan.targets)):
        file = SafetensorsFile(_exports(plan, tgt, _module(plan.target_state(tgt), plan)))
        for (exp, _value, dtype, enc), (first, stop) in zip(file.exports, file.spans):
            if enc is None:
                continue
            name = exp.outputs[0].name
            if (enc == MXFP4) != exp.transposed_slab or (enc != MXFP4 and exp.part is not None):
                how = "as a stacked slab" if exp.part is not None else "whole"
                raise LayoutError(f"{where} quantizes {name}, which reshard writes {how}", culprit="--quantize-like",
                                  hint="export without --quantize and quantize with the release's own tools")
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise LayoutError(f"{exp.key} is {dtype}: {like.quantization.codec.method} encodes float16, bfloat16 "
                                  "or float32 weights", culprit="--quantize like-source", hint="drop --quantize")
            if isinstance(enc, Encoding):
                if enc.scale_dtype is not None and enc.scale_dtype != dtype:
                    raise LayoutError(f"{where} stores compressed-tensors scales as {enc.scale_dtype}, the weights "
                                      f"written are {dtype}", culprit="--quantize like-source",
                                      hint="export the model in the release's dtype")
                for o in exp.outputs:
                    refused = enc.refusal(o.shape, dtype)
                    if refused is not None:
                        raise LayoutError(f"{o.name} {refused[0]}", culprit="--quantize like-source",
                                          hint="export without --quantize")
                    if enc.global_scaled:
                        fused[o.name.removesuffix(".weight")] = exp.key
            if enc == MXFP4 and exp.outputs[0].shape[0] % mxfp4.GROUP:
                raise LayoutError(f"{name} has input width {exp.outputs[0].shape[0]}, not a multiple of "
                                  f"{mxfp4.GROUP}", culprit="--quantize like-source", hint="drop --quantize")
            entries = file.entries[first:stop]
            per = len(entries) // len(exp.outputs)
            for i, o in enumerate(exp.outputs):
                act = enc.activation_scale_name(o.name) if isinstance(enc, Encoding) else None
                if act is not None:  # kept from the release: a layer it lacks has none to keep
                    e = next(e for e in entries[per * i:per * i + per] if e.name == act)
                    t = like.stored.get(act)
                    if t is None:
                        raise LayoutError(f"{o.name} is quantized with calibrated activation scales, but {where} "
                                          f"holds no {act} to keep", culprit="--quantize-like",
                                          hint="export without --quantize and quantize with the release's own "
                                               "tools (ModelOpt, llm-compressor), which calibrate it")
                    if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                        raise LayoutError(f"{act} is {t.dtype} {list(t.shape)} in {where}, where its scheme lays "
                                          f"out {e.dtype} {list(e.shape)}", culprit="--quantize-like",
                                          hint="the release's tensors do not follow its config.json; re-copy it")
                if not like.copies(o.name, tuple(o.shape), slab=exp.part is not None):
                    continue
                for e, key in zip(entries[per * i:per * i + per], like.scheme.stored_names(o.name), strict=True):
                    t = like.stored.get(key)
                    if t is None or e.name != key or t.dtype != e.dtype or tuple(t.shape) != e.shape:
                        got = "absent" if t is None else f"{t.dtype} {list(t.shape)}"
                        raise LayoutError(f"{key} is {got} in {where}, where its scheme lays out {e.dtype} "
                                          f"{list(e.shape)}", culprit="--quantize-like",
                                          hint="the release's tensors do not follow its config.json; re-copy it")
    _refuse_split_fused(arch, fused, "--quantize like-source",
                        "export without --quantize and quantize with the release's own tools")


def _ct_encoding(plan: Plan) -> Encoding | None:
    """The compressed-tensors encoding of the output's linear weights (``--quantize w4a16``,
    ``fp8-channel`` or ``nvfp4``), else None."""
    if plan.options.quantize not in CT_SCHEMES:
        return None
    return Encoding(plan.options.quantize, plan.options.group_size)


def _check_ct(plan: Plan, arch: HFArchitecture, encoding: Encoding) -> None:
    """``--quantize w4a16`` / ``fp8-channel`` / ``nvfp4`` (``encoding``) encode the linear weights,
    each of a float dtype and of an input width the group size divides (w4a16, nvfp4), in an
    architecture that has them; under ``nvfp4`` the layers that share a global scale
    (:func:`~reshard.core.compressed_tensors_out.fused_with`: q/k/v, gate/up) are each made from
    one megatron-core tensor (a fused QKV, a fused fc1, an expert's fc1), whose export finds their
    scale before it writes any of them."""
    flag = f"--quantize {encoding.scheme}"
    if not any(row.linear for row in arch.names):
        raise LayoutError(f"{arch.name} has no linear layer compressed-tensors quantizes (its weights are not "
                          "[out, in])", culprit=flag, hint="drop --quantize")
    source: dict[str, str] = {}  # each quantized module -> the megatron-core tensor it is made from
    for tgt in range(len(plan.targets)):
        for exp, _value, dtype, enc in _exports(plan, tgt, _module(plan.target_state(tgt), plan)):
            if not isinstance(enc, Encoding):
                continue
            for o in exp.outputs:
                refused = encoding.refusal(o.shape, dtype)
                if refused is not None:
                    raise LayoutError(f"{o.name} {refused[0]}", culprit=flag, hint=refused[1])
                source[o.name.removesuffix(".weight")] = exp.key
    if encoding.global_scaled:
        _refuse_split_fused(arch, source, flag, "drop --quantize, or --quantize w4a16 / fp8-channel")


def _refuse_split_fused(arch: HFArchitecture, source: Mapping[str, str], flag: str, hint: str) -> None:
    """Refuse a fused group (:func:`~reshard.core.compressed_tensors_out.fused_with`) whose layers
    (``source``: each NVFP4 module -> the megatron-core tensor it is made from) come from two
    tensors: their one global scale is found over one export's outputs."""
    for module, key in source.items():
        split = [m for m in fused_with(module, source, arch.fused_layers) if source[m] != key]
        if split:
            raise LayoutError(f"{module} and {split[0]} share one NVFP4 global scale (vLLM fuses them) but are "
                              f"made from two tensors, {key} and {source[split[0]]}", culprit=flag, hint=hint)


def _ct_ignored(plan: Plan, files: int) -> list[str]:
    """compressed-tensors' ``ignore`` of the output: the modules of the ``[out, in]`` weights left
    in the model's dtype (the head, a router), as llm-compressor's recipes list them; an embedding
    (megatron-core's ``embedding`` module), which compressed-tensors' ``Linear`` target never
    takes, is not named."""
    embeddings = (CORE_ROLES["embedding"], CORE_ROLES["position"])
    kept = set()
    for tgt in range(files):
        for exp, _value, _dtype, enc in _exports(plan, tgt, _module(plan.target_state(tgt), plan)):
            if enc is None and not exp.key.startswith(embeddings):
                kept.update(o.name.removesuffix(".weight") for o in exp.outputs
                            if len(o.shape) == 2 and o.name.endswith(".weight"))
    return sorted(kept)


def _check_fp8(plan: Plan, arch: HFArchitecture) -> None:
    """``--quantize fp8`` encodes floating-point linear weights in an architecture that has them."""
    if not any(row.linear for row in arch.names):
        raise LayoutError(f"{arch.name} has no linear layer vLLM or transformers reads FP8 block scales for "
                          "(its weights are not [out, in])", culprit="--quantize fp8",
                          hint="drop --quantize, or export a Llama, Mistral, Qwen2/3, Qwen-MoE or Mixtral model")
    dtypes = {tp.param.dtype for t in plan.targets for tp in t.params if tp.param.dtype is not None}
    if not dtypes <= {torch.float16, torch.bfloat16, torch.float32}:
        raise LayoutError(f"the weights are {', '.join(sorted(map(str, dtypes)))}: FP8 encodes float16, bfloat16 "
                          "or float32 weights", culprit="--quantize fp8", hint="drop --quantize")


#: The encoding of an export's 4th element under ``--quantize mxfp4`` (an FP8 export holds its block).
MXFP4 = mxfp4.METHOD


def _check_mxfp4(plan: Plan, arch: HFArchitecture) -> None:
    """``--quantize mxfp4`` encodes the stacked ``[in, out]`` weights (the experts of an architecture
    that stacks them), each input width a multiple of 32, in a model that has them."""
    quantized = [item for tgt in range(len(plan.targets))
                 for item in _exports(plan, tgt, _module(plan.target_state(tgt), plan)) if item[3] == MXFP4]
    if not quantized:
        raise LayoutError(f"{arch.name} stores no stacked [in, out] weights, which are what MXFP4 encodes",
                          culprit="--quantize mxfp4", hint="drop --quantize, or export a model whose experts "
                          "its architecture stacks (GPT-OSS's layout)")
    for exp, _value, dtype, _enc in quantized:
        width = exp.outputs[0].shape[0]
        if width % mxfp4.GROUP:
            raise LayoutError(f"{exp.outputs[0].name} has input width {width}, not a multiple of {mxfp4.GROUP}",
                              culprit="--quantize mxfp4", hint="MXFP4 scales groups of 32 inputs; drop --quantize")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise LayoutError(f"{exp.key} is {dtype}: MXFP4 encodes float16, bfloat16 or float32 weights",
                              culprit="--quantize mxfp4", hint="drop --quantize")


def not_converted(entries: Sequence[FileEntry]) -> list[str]:
    """``modules_to_not_convert`` of an MXFP4 export of ``entries``: the modules of the linear
    weights left as they are, layer numbers as ``*`` and each widened to its largest enclosing
    module that holds no quantized weight (GPT-OSS's release lists its attention and router
    modules, the embeddings and the head so). transformers matches each as a regular expression
    from the start of a module's name, or as its suffix."""
    def module(name: str) -> str:
        return re.sub(r"\.\d+(?=\.|$)", ".*", name.rsplit(".", 1)[0] if "." in name else name)

    quantized = {module(e.name.removesuffix(mxfp4.BLOCKS_SUFFIX)) for e in entries
                 if e.name.endswith(mxfp4.BLOCKS_SUFFIX) and e.dtype == torch.uint8}
    kept = set()
    for e in entries:
        if e.dtype == torch.uint8 or len(e.shape) != 2 or not e.name.endswith(".weight"):
            continue
        name = module(e.name)
        while "." in name:
            parent = name.rsplit(".", 1)[0]
            if any(q == parent or q.startswith(parent + ".") for q in quantized):
                break
            name = parent
        kept.add(name)
    return sorted(kept)


@functools.lru_cache(maxsize=16)
def _copying_rows(names: tuple[str, ...]) -> tuple[tuple[tuple[re.Pattern[str], ...], Transform], ...]:
    """The rows of the architectures called ``names`` whose transform writes its tensor more than once
    (:meth:`~reshard.models.hf_architectures.Transform.copies`): found once, not per parameter."""
    return tuple((row.core_patterns, row.transform) for name in names for row in hf_architecture(name).names
                 if row.transform is not None and type(row.transform).copies is not Transform.copies)


def _exports(plan: Plan, tgt: int, module: dict[str, Any]) -> list[tuple[Export, Any, torch.dtype, Any]]:
    """Each exported megatron-core tensor, its value, its dtype and its encoding: its FP8 block,
    :data:`MXFP4`, a compressed-tensors :class:`~reshard.core.compressed_tensors_out.Encoding`, or
    None (written as it is)."""
    block = _fp8_block(plan) or _ct_encoding(plan)
    mx = plan.options.quantize == MXFP4
    like = _like(plan)
    out = []
    for key, value in module.items():
        if not isinstance(value, (PendingTensor, torch.Tensor)):
            if value is not None and not key.endswith("_extra_state"):
                raise LayoutError(f"{key} holds a {type(value).__name__}, not a tensor", culprit=key)
            continue
        exp = export_of(key, tuple(value.shape), value.dtype.itemsize, plan.facts, architecture(plan))
        if exp.outputs and like is not None:
            out.append((exp, value, value.dtype, _like_encoding(like, exp)))
        elif exp.outputs:
            out.append((exp, value, value.dtype, MXFP4 if mx and exp.transposed_slab else
                        block if exp.linear else None))
    return out


def _stacked_order(exports: list[tuple[Export, Any, torch.dtype, Any]]) -> list[tuple[Export, Any, torch.dtype, Any]]:
    """``exports`` in file order: the slabs of one stacked Hugging Face tensor
    (:attr:`~reshard.models.hf_architectures.Export.part`) one after another, slab 0 first, where
    the first of them was (megatron-core's order alternates a layer's experts between two stacked
    tensors), so each is written front to back; :class:`LayoutError` for a stack whose slabs are
    not numbered ``0 .. n-1`` once each, or a stacking transform with several outputs."""
    stacks: dict[str, list[tuple[Export, Any, torch.dtype, Any]]] = {}
    for item in exports:
        exp = item[0]
        if exp.part is not None:
            if len(exp.outputs) != 1:
                raise LayoutError(f"{exp.key} is a slab of {len(exp.outputs)} tensors, not one", culprit=exp.key)
            stacks.setdefault(exp.outputs[0].name, []).append(item)
    out = []
    for item in exports:
        exp = item[0]
        if exp.part is None:
            out.append(item)
            continue
        stack = stacks.pop(exp.outputs[0].name, None)
        if stack is None:
            continue  # written with the stack's first slab
        stack.sort(key=lambda it: it[0].part)
        numbers = [it[0].part for it in stack]
        if numbers != list(range(len(stack))):
            name = exp.outputs[0].name
            raise LayoutError(f"is stacked here from slabs {numbers}, not 0 to {len(stack) - 1} once each",
                              culprit=name, hint="export every tensor of the stack into one file")
        out += stack
    return out


def _file_entries(plan: Plan, tgt: int) -> list[FileEntry]:
    return _PER_PLAN.get(plan, ("entries", tgt), lambda: SafetensorsFile(
        _exports(plan, tgt, _module(plan.target_state(tgt), plan))).entries)


class SafetensorsFile:
    """The layout of one safetensors file (header from the shapes) and its streamed writing. An
    FP8-encoded output is two entries, the e4m3 weight and its float32 scales right after it."""

    def __init__(self, exports: list[tuple[Export, Any, torch.dtype, Any]], like: LikeSource | None = None) -> None:
        self.like = like  # --quantize like-source: each quantized weight copied from it where unchanged
        self.exports = exports = _stacked_order(exports)
        self.entries: list[FileEntry] = []
        self.spans: list[tuple[int, int]] = []  # each export's entries: [first, stop)
        self.stacks: dict[str, FileEntry] = {}  # each stacked tensor as its slabs make it (before encoding)
        start = 0
        slabs = collections.Counter(exp.outputs[0].name for exp, *_ in exports if exp.part is not None)
        for exp, _value, dtype, block in exports:
            if dtype not in ST_DTYPES:
                raise LayoutError(f"{exp.key} is {dtype}, which safetensors cannot hold", culprit=exp.key)
            if exp.part is not None and exp.part > 0:  # in the stacked tensor its slab 0 laid out
                stacked = self.stacks[exp.outputs[0].name]
                if dtype != stacked.dtype or tuple(exp.outputs[0].shape) != stacked.shape[1:]:
                    raise LayoutError(f"{exp.key} is {exp.outputs[0].shape} {dtype}, unlike the other slabs of "
                                      f"{stacked.name} {stacked.shape[1:]} {stacked.dtype}", culprit=exp.key,
                                      hint="stacked tensors need one shape and dtype")
                self.spans.append(self.spans[-1])
                continue
            if exp.part == 0:
                o = exp.outputs[0]
                whole = FileEntry(o.name, dtype, (slabs[o.name], *o.shape), start)
                self.stacks[o.name] = whole
                first = len(self.entries)
                self.entries += [whole] if block != MXFP4 else _mxfp4_entries(whole)
                start = self.entries[-1].start + self.entries[-1].nbytes
                self.spans.append((first, len(self.entries)))
                continue
            first = len(self.entries)
            for o in exp.outputs:
                if isinstance(block, Encoding):
                    for name, dt, shape in block.tensors(o.name, o.shape, dtype):
                        self.entries.append(FileEntry(name, dt, shape, start))
                        start += self.entries[-1].nbytes
                    continue
                made = ([FileEntry(o.name, dtype, o.shape, start)] if block is None else
                        [FileEntry(o.name, E4M3, o.shape, start)])
                if block is not None:
                    made.append(FileEntry(scale_name(o.name), torch.float32, scale_shape(o.shape, block),
                                          start + made[0].nbytes))
                self.entries += made
                start = made[-1].start + made[-1].nbytes
            self.spans.append((first, len(self.entries)))
        self.data_size = start
        self.header = header_bytes(self.entries)

    def write(self, path: str, *, sha256: bool = False, on_bytes: Callable[[int], None] | None = None,
              stream: Any = None, device: torch.device | None = None) -> SaveStats:
        """Header first, then each megatron-core tensor streamed into its Hugging Face tensors:
        ``pwrite`` on the writer thread (as :func:`reshard.core.torch_writer.save` does) and
        hashed, in file order, on a hashing thread (:class:`_InOrderHasher`). With a ``stream``
        (an upload fed in file order with the hash) one thread takes each piece: one that continues
        the hashed prefix goes to the hash and the stream from memory, never to the disk; only one
        written ahead of it (a fused QKV's K and V rows arrive while Q is being filled) waits on
        disk, and is given back once read."""
        digest = file_digest(sha256, stream)
        base = len(self.header)
        # an upload bounds a streamed output: a second quantizing thread gains it next to nothing and
        # holds more of it in memory at once (measured in docs/performance.md, session 26)
        workers = 1 if stream is not None else band_workers(device)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, base + self.data_size)
            if stream is not None:
                writer = WriteStage("reshard-writer", _InOrderHasher(fd, digest, write_ahead=True), QUEUE_DEPTH)
            else:
                hasher = None if digest is None else _InOrderHasher(fd, digest)
                writer = writer_pipeline(fd, QUEUE_DEPTH, hash_work=hasher)
            try:
                writer.put((memoryview(self.header), 0, None, None))
                for (exp, value, _dtype, block), (first, stop) in zip(self.exports, self.spans):
                    entries = self.entries[first:stop]
                    if exp.part is not None and block == MXFP4:
                        hi = _write_mxfp4_slab(writer, exp, value, entries, base, self.like)
                    elif exp.part is not None:
                        hi = _write_slab(writer, exp, value, entries[0], base)
                    elif block is None:
                        _write_export(writer, exp, value, entries, base)
                    elif isinstance(block, Encoding):
                        _write_ct_export(writer, exp, value, entries, base, block, self.like, workers)
                    else:
                        _write_fp8_export(writer, exp, value, entries, base, block, device, workers, self.like)
                    if exp.part is None:
                        hi = base + entries[-1].start + entries[-1].nbytes
                    writer.put((memoryview(b""), hi, None, None))  # the file is complete up to hi
                    if on_bytes is not None:
                        on_bytes(hi)
            finally:
                writer.close()
        finally:
            os.close(fd)
        return SaveStats(size=base + self.data_size, records=len(self.entries),
                         largest_record=max((e.nbytes for e in self.entries), default=0),
                         record_order=[e.name for e in self.entries],
                         sha256=digest.hexdigest() if digest is not None else None)


def _write_export(writer: Any, exp: Export, value: Any, entries: list[FileEntry], base: int) -> None:
    """Queue one megatron-core tensor's bytes for its Hugging Face tensors (``entries``)."""
    if exp.convert is not None:  # a transpose: this one tensor in memory, then its outputs
        whole = value.materialize() if isinstance(value, PendingTensor) else value.detach()
        for entry, out in zip(entries, exp.convert(whole)):
            if tuple(out.shape) != entry.shape:
                raise WriterError(f"{exp.key}: made {tuple(out.shape)} for {entry.name} {entry.shape}")
            writer.put((tensor_bytes(out), base + entry.start, None, out))
        return
    runs = sorted((r.src, r.length, base + entries[r.out].start + r.dst) for r in exp.runs)
    if sum(r[1] for r in runs) != sum(e.nbytes for e in entries):
        raise WriterError(f"{exp.key}: its byte runs do not cover its Hugging Face tensors")
    _stream_into(value, ScatterSink(writer, runs, exp.key))


def _stream_into(value: Any, sink: ScatterSink | RowBandSink) -> None:
    """All of ``value``'s bytes into ``sink`` in order (a pending tensor's as its producer makes
    them), then the sink's check that they were all of them."""
    if isinstance(value, PendingTensor):
        value.produce(sink)
        sink.finish(value.nbytes)
    else:
        t = value.detach().contiguous()
        sink.write(t)
        sink.finish(t.numel() * t.element_size())


def _write_slab(writer: Any, exp: Export, value: Any, entry: FileEntry, base: int) -> int:
    """Write one megatron-core tensor as slab ``exp.part`` of its stacked Hugging Face tensor
    (``entry``) and wait until it is written, so one slab is held at a time (a mapped source's rows
    read where they lie, :meth:`PendingTensor.borrowed`, and the slab they make): the stack is
    never whole in memory. Returns the end of the slab: the file is complete up to there (the
    slabs of a stack come in order, :func:`_stacked_order`)."""
    slab = entry.nbytes // entry.shape[0]
    at = base + entry.start + exp.part * slab
    with value.borrowed() if isinstance(value, PendingTensor) else contextlib.nullcontext(value.detach()) as whole:
        if exp.convert is not None:
            (out,) = exp.convert(whole)
            if tuple(out.shape) != entry.shape[1:]:
                raise WriterError(f"{exp.key}: made {tuple(out.shape)} for a slab of {entry.name} {entry.shape}")
        else:
            (out,) = _by_runs(whole, exp)
        out = out.contiguous()
        written = threading.Event()
        writer.put((tensor_bytes(out), at, written.set, out))
        del out
        while not written.wait(0.5):
            error = writer.failed()
            if error is not None:
                raise error
    return at + slab


def _mxfp4_entries(whole: FileEntry) -> list[FileEntry]:
    """A stacked ``[E, in, out]`` tensor ``X`` as MXFP4 stores it: ``X_blocks`` ``[E, out, in/32,
    16]`` and ``X_scales`` ``[E, out, in/32]``, uint8, back to back from ``whole.start``."""
    codes = (*whole.shape[:-2], whole.shape[-1], whole.shape[-2])  # [E, out, in]
    blocks = FileEntry(whole.name + mxfp4.BLOCKS_SUFFIX, torch.uint8, mxfp4.blocks_shape(codes), whole.start)
    scales = FileEntry(whole.name + mxfp4.SCALES_SUFFIX, torch.uint8, mxfp4.scales_shape(codes),
                       blocks.start + blocks.nbytes)
    return [blocks, scales]


def _write_mxfp4_slab(writer: Any, exp: Export, value: Any, entries: list[FileEntry], base: int,
                      like: LikeSource | None = None) -> int:
    """Write one megatron-core tensor as slab ``exp.part`` of its stacked tensor's MXFP4 pair
    (``entries``: blocks, scales), quantized from the slab's transpose ``[out, in]``
    (:func:`~reshard.core.mxfp4.quantize`; made from the tensor without transposing it twice,
    :attr:`Export.convert_transposed`), and wait until both are written: one slab is held at a
    time, as :func:`_write_slab` holds it. Returns where the file is complete up to: the slab's
    blocks (its scales, after all the blocks, are complete with the last slab). ``like``
    (``--quantize like-source``): a slab equal to the release's dequantized one takes its codes
    and scales."""
    blocks, scales = entries
    b_slab, s_slab = blocks.nbytes // blocks.shape[0], scales.nbytes // scales.shape[0]
    with value.borrowed() if isinstance(value, PendingTensor) else contextlib.nullcontext(value.detach()) as whole:
        (w,) = exp.convert_transposed(whole)
        if tuple(w.shape) != (blocks.shape[1], blocks.shape[2] * mxfp4.GROUP):
            raise WriterError(f"{exp.key}: made {tuple(w.shape)} for a slab of {blocks.name} {blocks.shape}")
        weight = blocks.name.removesuffix(mxfp4.BLOCKS_SUFFIX)
        if like is not None and like.unchanged(weight, w, slab=exp.part):
            (_, codes), (_, scale) = _copied(like, weight, [blocks, scales], exp.part)
        else:
            try:
                codes, scale = mxfp4.quantize(w)
            except NonFiniteWeightError as exc:
                raise LayoutError(f"{blocks.name}: {exc}", culprit="--quantize mxfp4", hint="the checkpoint's "
                                  "weights are not finite; convert it without --quantize") from None
        del w
        done = [threading.Event(), threading.Event()]
        writer.put((tensor_bytes(codes), base + blocks.start + exp.part * b_slab, done[0].set, codes))
        writer.put((tensor_bytes(scale), base + scales.start + exp.part * s_slab, done[1].set, scale))
        del codes, scale
        for event in done:
            while not event.wait(0.5):
                error = writer.failed()
                if error is not None:
                    raise error
    last = exp.part == blocks.shape[0] - 1
    return base + (scales.start + scales.nbytes if last else blocks.start + (exp.part + 1) * b_slab)


def _copied(like: LikeSource, weight: str, entries: list[FileEntry], slab: int | None = None
            ) -> list[tuple[str, torch.Tensor]]:
    """The release's stored codes and scales of ``weight`` (``slab``: one expert's), each checked
    against the entry it fills (:func:`_check_like` refused a release whose tensors differ)."""
    got = like.stored_tensors(weight, slab)
    for (key, t), e in zip(got, entries, strict=True):
        shape = e.shape if slab is None else e.shape[1:]
        if key != e.name or t.dtype != e.dtype or tuple(t.shape) != shape:
            raise WriterError(f"{key} {t.dtype} {list(t.shape)} of {like.folder} does not fill {e.name} {list(shape)}")
    return got


def _bands(exp: Export, value: Any, band_rows: Sequence[int], on_band: Callable[[int, int, torch.Tensor], None]
           ) -> None:
    """Hand ``on_band(i, first row, rows)`` each band of ``band_rows[i]`` rows of the export's
    outputs, in the order the tensor's bytes come: streamed through a
    :class:`~reshard.core.row_bands.RowBandSink` where its byte runs fill each output in order (a
    fused QKV or fc1: neither the tensor nor an output is ever whole in memory); a transform of
    the whole tensor (a transpose) takes it whole, as :func:`_write_export` does, and hands on
    bands of its outputs. ``rows`` may be a reused buffer: ``on_band`` must not keep it."""
    dtype = value.dtype
    runs = [(r.src, r.length, r.out, r.dst) for r in exp.runs]
    if exp.convert is None and in_order(runs, [_nbytes(o.shape, dtype) for o in exp.outputs]):
        _stream_into(value, RowBandSink(runs, [o.shape for o in exp.outputs], dtype, band_rows, on_band, exp.key))
        return
    with value.borrowed() if isinstance(value, PendingTensor) else contextlib.nullcontext(value.detach()) as whole:
        outs = exp.convert(whole) if exp.convert is not None else _by_runs(whole, exp)
        for i, (out, o) in enumerate(zip(outs, exp.outputs, strict=True)):
            if tuple(out.shape) != tuple(o.shape):
                raise WriterError(f"{exp.key}: made {tuple(out.shape)} for {o.name} {o.shape}")
            for r in range(0, out.shape[0], band_rows[i]):
                on_band(i, r, out[r:r + band_rows[i]])


def _finite(band: torch.Tensor, name: str, flag: str) -> None:
    """Refuse a weight holding a value no quantizer can scale (NaN, an infinity), naming it."""
    if not bool(torch.isfinite(band).all()):
        raise LayoutError(f"{name}: holds a value that is not finite", culprit=flag,
                          hint="the checkpoint's weights are not finite; convert it without --quantize")


def _surveyed(exp: Export, value: Any, names: Sequence[str], band_rows: Sequence[int], like: LikeSource | None,
              stat: Callable[[torch.Tensor], torch.Tensor] | None, flag: str
              ) -> tuple[list[bool], list[torch.Tensor | None]]:
    """One pass over an export's outputs ``names`` before any is encoded, band by band
    (:func:`_bands`), each band checked finite: which outputs are the release's dequantized
    weights unchanged (``like``; all False without it), and per output ``stat`` of its bands
    combined by :func:`torch.maximum` (:meth:`Encoding.band_stat`; None without ``stat``). Skipped
    (nothing to learn) without either."""
    n = len(names)
    same: list[bool] = [False] * n
    stats: list[torch.Tensor | None] = [None] * n
    if like is None and stat is None:
        return same, stats
    matchers = [None] * n if like is None else [like.matcher(name, tuple(o.shape), value.dtype)
                                                 for name, o in zip(names, exp.outputs, strict=True)]
    same = [m is not None for m in matchers]

    def on_band(i: int, r: int, band: torch.Tensor) -> None:
        _finite(band, names[i], flag)
        if same[i]:
            same[i] = matchers[i](r, band)
        if stat is not None:
            got = stat(band)
            stats[i] = got if stats[i] is None else torch.maximum(stats[i], got)

    if stat is not None or any(same):
        _bands(exp, value, band_rows, on_band)
    return same, stats


def _put_copied(writer: Any, like: LikeSource, names: Sequence[str], copied: Sequence[bool],
                entries: list[FileEntry], base: int) -> None:
    """Queue the release's stored tensors of each output ``names[i]`` that is ``copied``, into its
    entries (``entries``: every output's, the same number each)."""
    per = len(entries) // len(names)
    for i, name in enumerate(names):
        if copied[i]:
            part = entries[per * i:per * i + per]
            for (_key, t), e in zip(_copied(like, name, part), part):
                writer.put((tensor_bytes(t), base + e.start, None, t))


def _write_fp8_export(writer: Any, exp: Export, value: Any, entries: list[FileEntry], base: int,
                      block: tuple[int, int], device: torch.device | None = None, workers: int = 1,
                      like: LikeSource | None = None) -> None:
    """Queue one megatron-core linear weight's Hugging Face weights, each FP8-encoded
    (:func:`~reshard.core.fp8_block.quantize_chunks`, on ``device`` when one is given), a band
    of whole block rows (about :data:`FP8_CHUNK_BYTES` of codes) at a time as the tensor streams
    (:func:`_bands`): each band's codes are queued as they are made, the scales after the last.
    ``workers``: threads the quantizer shares each band's blocks among. ``like`` (``--quantize
    like-source``): an output equal to the release's dequantized weight (a first pass,
    :func:`_surveyed`) takes the release's codes and scales instead."""
    flag = f"--quantize {'fp8' if like is None else LIKE_SOURCE}"
    names = [e.name for e in entries[0::2]]
    for o, codes in zip(exp.outputs, entries[0::2], strict=True):
        if tuple(o.shape) != codes.shape:
            raise WriterError(f"{exp.key}: makes {tuple(o.shape)} for {codes.name} {codes.shape}")
    rows = [fp8_chunk_rows(o.shape[1], block[0]) for o in exp.outputs]
    copied, _ = _surveyed(exp, value, names, rows, like, None, flag)
    if like is not None:
        _put_copied(writer, like, names, copied, entries, base)
    if all(copied):
        return
    dev = device if device is not None else torch.device("cpu")
    scales = [torch.empty(entries[2 * i + 1].shape, dtype=torch.float32, device=dev) for i in range(len(names))]

    def on_band(i: int, r: int, band: torch.Tensor) -> None:
        if copied[i]:
            return
        codes = entries[2 * i]
        w = band if device is None else band.to(device)
        s = scales[i][r // block[0]:math.ceil((r + band.shape[0]) / block[0])]
        try:
            for rr, q in quantize_chunks(w, s, block, chunk_rows=rows[i], workers=workers):
                q = q.cpu()
                writer.put((tensor_bytes(q), base + codes.start + (r + rr) * q.shape[1] * q.element_size(), None, q))
        except NonFiniteWeightError as exc:
            raise LayoutError(f"{codes.name}: {exc.moved(r)}", culprit=flag, hint="the checkpoint's "
                              "weights are not finite; convert it without --quantize") from None

    _bands(exp, value, rows, on_band)
    for i, s in enumerate(scales):
        if not copied[i]:
            s = s.cpu()
            writer.put((tensor_bytes(s), base + entries[2 * i + 1].start, None, s))


def _write_ct_export(writer: Any, exp: Export, value: Any, entries: list[FileEntry], base: int,
                     encoding: Encoding, like: LikeSource | None = None, workers: int = 1) -> None:
    """Queue one megatron-core linear weight's Hugging Face weights in compressed-tensors' format
    (``encoding``), a band of rows (about :data:`FP8_CHUNK_BYTES` of the weight) at a time as the
    tensor streams (:func:`_bands`): each band's codes are queued as they are made, then each
    output's scales (then ``weight_shape``, or ``weight_global_scale``). An encoding that needs
    every band first (:attr:`Encoding.surveyed`: NVFP4's global scale, shared by a fused QKV's q, k
    and v and a fused fc1's gate and up, :func:`_check_ct`; the ``tensor`` strategy's one scale)
    has it from a first pass over the same bands (:func:`_surveyed`), nothing written before.
    ``workers``: threads each band's rows are shared among (:mod:`reshard.core.band_threads`).
    ``like`` (``--quantize like-source``): an output equal to the release's dequantized weight,
    found in that first pass, takes the release's tensors instead; under a global scale only all
    the outputs together, where every one is unchanged and the release's global scales of them are
    one (:meth:`~reshard.core.like_source.LikeSource.global_scales_agree`), else all are encoded
    afresh under a new one."""
    per = len(entries) // len(exp.outputs)
    flag = f"--quantize {encoding.scheme if like is None else LIKE_SOURCE}"
    names = [o.name for o in exp.outputs]
    for o, codes in zip(exp.outputs, entries[0::per], strict=True):
        if (o.shape[0], *codes.shape[1:]) != codes.shape or encoding.refusal(o.shape, value.dtype):
            raise WriterError(f"{exp.key}: makes {tuple(o.shape)} {value.dtype} for {codes.name} {codes.shape}")
    rows = _ct_band_rows(exp, value.dtype)
    same, stats = _surveyed(exp, value, names, rows, like, encoding.band_stat if encoding.surveyed else None, flag)
    copied = [False] * len(names) if like is None else _like_decided(like, encoding, names, same)
    fused = None
    if encoding.global_scaled and not all(copied):
        amax = functools.reduce(torch.maximum, [t for t in stats if t is not None])
        fused = encoding.global_scale(amax)
    if like is not None:
        _put_copied(writer, like, names, copied, entries, base)
    if all(copied):
        return
    whole = [encoding.tensor_scale(t) for t in stats]  # the tensor strategy's one scale of each weight
    scales = [torch.empty(entries[per * i + 1].shape, dtype=entries[per * i + 1].dtype) for i in range(len(names))]

    def on_band(i: int, r: int, band: torch.Tensor) -> None:
        if copied[i]:
            return
        if stats[i] is None:  # surveyed bands were checked in the first pass
            _finite(band, names[i], flag)
        codes = entries[per * i]

        def encode(first: int, stop: int) -> None:  # rows first .. stop of the band
            q, sb = encoding.encode_rows(band[first:stop], fused if fused is not None else whole[i])
            if whole[i] is None:
                scales[i][r + first:r + stop] = sb
            else:
                scales[i].copy_(sb)
            writer.put((tensor_bytes(q), base + codes.start + (r + first) * q.shape[1] * q.element_size(), None, q))

        band_threads.split_rows(band.shape[0], encode, workers)

    _bands(exp, value, rows, on_band)
    for i, name in enumerate(names):
        if copied[i]:
            continue
        codes, scale_entry, *rest = entries[per * i:per * i + per]
        writer.put((tensor_bytes(scales[i]), base + scale_entry.start, None, scales[i]))
        act = encoding.activation_scale_name(name)
        for entry in rest:  # weight_shape, or weight_global_scale (weight_scale_2), then an activation scale
            if entry.name == act and like is not None:  # the release's calibration, as it is
                t = _copied_activation(like, entry)
            else:
                t = fused if fused is not None else shape_tensor(exp.outputs[i].shape).to(entry.dtype)
            writer.put((tensor_bytes(t), base + entry.start, None, t))


def _ct_band_rows(exp: Export, dtype: torch.dtype) -> list[int]:
    """Rows of each output's band for compressed-tensors' encodings: about :data:`FP8_CHUNK_BYTES`
    of the weight, at least one row."""
    return [max(1, FP8_CHUNK_BYTES // max(1, o.shape[1] * dtype.itemsize)) for o in exp.outputs]


def _like_decided(like: LikeSource, encoding: Encoding, names: Sequence[str], same: Sequence[bool]) -> list[bool]:
    """Which outputs ``names`` take the release's tensors, given which are its weights unchanged
    (``same``): under a global scale all or none (every one unchanged and the release's scales of
    them one), else each unchanged one."""
    if encoding.global_scaled:
        return [all(same) and like.global_scales_agree(names)] * len(names)
    return list(same)


def _like_copied(like: LikeSource, encoding: Encoding, exp: Export, value: Any) -> list[bool]:
    """Which of one export's outputs take the release's tensors (:func:`_like_decided`, after a
    pass over its bands, :func:`_surveyed`)."""
    names = [o.name for o in exp.outputs]
    same, _ = _surveyed(exp, value, names, _ct_band_rows(exp, value.dtype), like, None, f"--quantize {LIKE_SOURCE}")
    return _like_decided(like, encoding, names, same)


def _copied_activation(like: LikeSource, entry: FileEntry) -> torch.Tensor:
    """The release's calibrated activation scale ``entry`` (checked by :func:`_check_like`)."""
    t = like.stored_tensor(entry.name)
    if t.dtype != entry.dtype or tuple(t.shape) != entry.shape:
        raise WriterError(f"{entry.name} {t.dtype} {list(t.shape)} of {like.folder} does not fill {entry.name} "
                          f"{list(entry.shape)}")
    return t


def _like_warnings(plan: Plan) -> list[str]:
    """``--quantize like-source`` from a release with calibrated activation scales (W4A4 NVFP4):
    one line counting the layers whose weights changed, re-encoded by the scheme's weight rule
    while keeping the release's activation scales (:mod:`reshard.core.like_source`). Each such
    weight is compared with the release's here, as the writer compares it, the first difference
    ending each comparison."""
    like = _like(plan)
    if like is None:
        return []
    re_encoded = 0
    for tgt in range(len(plan.targets)):
        for exp, value, _dtype, enc in _exports(plan, tgt, _module(plan.target_state(tgt), plan)):
            if not isinstance(enc, Encoding) or not enc.activation or exp.part is not None or not exp.outputs:
                continue
            re_encoded += _like_copied(like, enc, exp, value).count(False)
    if not re_encoded:
        return []
    return [f"{re_encoded} quantized layer(s) changed from {like.folder} were re-encoded and keep its calibrated "
            "activation scales (input_scale / input_global_scale); if their activations moved, recalibrate with "
            "ModelOpt or llm-compressor"]


#: Bytes of FP8 codes an export quantizes and queues for the writer at a time: a weight's codes are
#: streamed out in chunks of whole block rows, never held whole (``o_proj``'s are 117 MB in
#: DeepSeek-V3), so at most the writer queue's few chunks wait in memory.
FP8_CHUNK_BYTES = 16 << 20


def fp8_chunk_rows(columns: int, block_rows: int) -> int:
    """Rows per quantized chunk: whole block rows, about :data:`FP8_CHUNK_BYTES` of codes, at
    least one block row."""
    return max(1, FP8_CHUNK_BYTES // max(1, columns) // block_rows) * block_rows


def _by_runs(whole: torch.Tensor, exp: Export) -> list[torch.Tensor]:
    """A whole megatron-core tensor's Hugging Face tensors, made in memory from its byte runs: views
    of it where each output is one run (a routed expert's down projection, an attention output
    projection, the halves of a fused gated MLP input projection), copies where runs interleave (a
    fused QKV's heads)."""
    data = whole.contiguous().view(-1).view(torch.uint8)
    if (len(exp.runs) == len(exp.outputs) and sorted(r.out for r in exp.runs) == list(range(len(exp.outputs)))
            and all(r.dst == 0 and r.length == _nbytes(exp.outputs[r.out].shape, whole.dtype) for r in exp.runs)):
        views = {r.out: data[r.src:r.src + r.length].view(whole.dtype).view(exp.outputs[r.out].shape)
                 for r in exp.runs}
        return [views[i] for i in range(len(exp.outputs))]
    outs = [torch.empty(o.shape, dtype=whole.dtype) for o in exp.outputs]
    flat = [o.view(-1).view(torch.uint8) for o in outs]
    if sum(r.length for r in exp.runs) != sum(f.numel() for f in flat):
        raise WriterError(f"{exp.key}: its byte runs do not cover its Hugging Face tensors")
    for r in exp.runs:
        flat[r.out][r.dst:r.dst + r.length] = data[r.src:r.src + r.length]
    return outs


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class _InOrderHasher:
    """The SHA-256 of the file in file order, fed each piece after it is written: a piece that
    starts where the hashed prefix ends is hashed from memory; one written ahead of it (a fused
    QKV's K and V rows arrive while Q is still being filled) is skipped, and read back from the
    page cache when an empty piece at offset X says the file is complete up to X. Only such
    out-of-order bytes are read twice."""

    def __init__(self, fd: int, digest: Any, *, write_ahead: bool = False) -> None:
        self.fd, self.digest, self.done = fd, digest, 0
        # the only writer: a piece ahead of the prefix goes to disk, the prefix's disk blocks go back
        self.write_ahead = write_ahead
        self.punched = 0

    def __call__(self, mv: memoryview, offset: int | None) -> None:
        if offset is None:
            return
        if not len(mv):
            if offset > self.done:
                _hash_region(self.fd, self.done, offset, self.digest)
                self.done = offset
        elif offset == self.done:
            self.digest.update(mv)
            self.done += len(mv)
        elif self.write_ahead:
            done = 0
            while done < len(mv):
                done += os.pwrite(self.fd, mv[done:], offset + done)
        if self.write_ahead and self.done - self.punched >= PUNCH_BYTES:
            self.punched = punch_hole(self.fd, self.punched, self.done)


def header_bytes(entries: Sequence[FileEntry]) -> bytes:
    """safetensors' header for ``entries``: little-endian u64 length, then the JSON (padded with
    spaces to a multiple of 8 bytes, as the library pads it)."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for e in entries:
        meta[e.name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [e.start, e.start + e.nbytes]}
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ScatterSink(RecordSink):
    """A megatron-core tensor's bytes, in order, queued for the writer thread to where its runs
    say (``(src, length, file offset)``, sorted); bytes no run covers (vocabulary padding) are
    dropped, bytes several runs cover (an architecture's copies of the embeddings) go to each. A chunk's
    ``release`` runs once its last piece is written."""

    def __init__(self, writer: Any, runs: list[tuple[int, int, int]], key: str) -> None:
        self.writer, self.runs, self.key = writer, runs, key
        self.pos = 0
        self.next = 0

    def write(self, data: Any, release: Callable[[], None] | None = None, keep: Any = None) -> None:
        mv, hold = as_bytes(data)
        lo, hi = self.pos, self.pos + len(mv)
        pieces = []
        done = True  # the runs before i all end in this chunk: later chunks start after them
        for i in range(self.next, len(self.runs)):
            src, length, dst = self.runs[i]
            if src >= hi:
                break
            a, b = max(lo, src), min(hi, src + length)
            if a < b:
                pieces.append((mv[a - lo:b - lo], dst + a - src))
            done = done and src + length <= hi
            if done:
                self.next = i + 1
        self.pos = hi
        if not pieces:
            if release is not None:
                release()
            return
        for j, (piece, offset) in enumerate(pieces):
            last = j == len(pieces) - 1
            self.writer.put((piece, offset, release if last else None, (keep, hold, data)))

    def finish(self, expected: int) -> None:
        if self.pos != expected:
            raise WriterError(f"producer of {self.key} wrote {self.pos} of {expected} bytes")


def _hash_region(fd: int, lo: int, hi: int, digest: Any) -> None:
    buf = bytearray(min(hi - lo, 16 << 20))
    view = memoryview(buf)
    while lo < hi:
        n = os.preadv(fd, [view[:min(hi - lo, len(buf))]], lo)
        if n <= 0:
            raise WriterError(f"the output ended at byte {lo} while hashing it")
        digest.update(view[:n])
        lo += n
