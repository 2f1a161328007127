"""Re-quantizing a converted model the way the release it came from is quantized (``--quantize
like-source --quantize-like DIR``): a model imported from a release, fine-tuned and exported comes
back in the format it was downloaded in.

The release folder ``DIR`` is read lazily (its safetensors headers; a tensor's bytes only when
compared or copied) and never whole. Each Hugging Face weight of the output is decided on its own,
before it is written:

=====================================  =============================================================
the output's tensor ``X``              written as
=====================================  =============================================================
the release stores ``X`` (same shape)  the release's scheme; its values equal the release's dequantized
quantized                              ``X`` bit for bit (in the output's dtype): the release's codes
                                       and scales copied; else quantized afresh by the scheme's rule
the release stores ``X`` (same shape)  as it is (the release's ignore / ``modules_to_not_convert`` /
unquantized                            unquantized linears stay so)
no counterpart (absent, or another     the scheme's rule if the release's config targets it
shape)                                 (:meth:`LikeScheme.targets`), else as it is
=====================================  =============================================================

Copying, not recomputing: scales recomputed from dequantized values do not give the release's back
(an int4 group's largest value dequantizes to ``7 s`` or ``-8 s``, whose range gives another
``s``; a release whose quantizer rounds its scales up re-quantizes to other codes).

A scheme is one :class:`LikeScheme` registered for its release method
(:func:`register_like_scheme`, next to the method's reading codec in
:mod:`reshard.core.release_codecs`): which tensors its rule quantizes, which stored tensors hold a
weight's codes and scales (copied, in the order the writer lays them out), and the encoding a
fresh quantization uses (the writer's: an FP8 block ``(rows, cols)``, :data:`mxfp4.METHOD`, or a
compressed-tensors :class:`~reshard.core.compressed_tensors_out.Encoding`, ModelOpt's NVFP4 among
them). A method without one is refused in one line naming it and ``DIR``.

W4A4 NVFP4 releases (ModelOpt's ``quant_algo: NVFP4``; compressed-tensors' ``NVFP4`` preset) carry
a calibrated activation scale per quantized layer (``X.input_scale``, ``X.input_global_scale``),
found on data a conversion does not have. Decision (issue #58): every one is copied from the
release as it is, never recomputed:

==========================================  ==================================================
the layer                                   written as
==========================================  ==================================================
unchanged (as the table above decides)      the release's tensors, its activation scale among
                                            them: bit for bit
its weights changed                         re-encoded by the scheme's weight rule, keeping the
                                            release's activation scale; one warning line for
                                            the run counts these layers (recalibrate with
                                            ModelOpt / llm-compressor if their activations
                                            moved)
quantized, absent from the release          refused in one line naming it: no scale to keep
==========================================  ==================================================

A scheme whose weights share a global scale (compressed-tensors' NVFP4: q/k/v, gate/up, as
llm-compressor fuses them for vLLM; ModelOpt's ``weight_scale_2``, the max of the parts' amax as its
export's ``preprocess_linear_fusion`` unifies them; :meth:`LikeScheme.global_scale_name`) is decided per *export*,
the weights the writer makes from one megatron-core tensor, which hold the fused group whole:

=============================================  =====================================================
the export's weights                           written as
=============================================  =====================================================
every one unchanged, and the release's global  the release's codes and scales of every one, copied
scales of them all bit for bit one             (:meth:`LikeSource.global_scales_agree`)
any one changed, or the release's scales of    every one quantized afresh under one global scale
them differ                                    of their joint maximum (llm-compressor's rule, as
                                               ``--quantize nvfp4`` writes it; ModelOpt's
                                               ``NVFP4QTensor`` rule,
                                               :func:`~reshard.core.nvfp4.quantize_modelopt`)
=============================================  =====================================================

Copying the unchanged parts alone would leave them under the release's global scale and the
changed ones under a fresh one: two scales in one fused matmul.
"""

from __future__ import annotations

import abc
import fnmatch
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.core import compressed_tensors, fp8_block, fp8_scaled, modelopt, mxfp4
from reshard.core.compressed_tensors_out import MODELOPT_NVFP4, Encoding
from reshard.core.errors import LayoutError
from reshard.core.lazy import LazyTensor, box_of, read_rows
from reshard.core.release_codecs import (
    SIDECAR,
    ReleaseQuantization,
    read_release_quantization,
    release_config,
    release_dequantized,
)
from reshard.core.safetensors_read import MappedSafetensors

#: ``--quantize`` asking for the release's own scheme, and the flag naming the release.
LIKE_SOURCE, FLAG = "like-source", "--quantize-like"
CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
#: Values compared at a time (a band of rows of the output and of the release's dequantized weight).
BAND_ELEMENTS = 1 << 20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class LikeScheme(abc.ABC):
    """One release method re-applied: the rule, the stored names, the encoding (module docstring)."""

    @abc.abstractmethod
    def quantized(self, name: str, stored: Mapping[str, Any]) -> bool:
        """Does the release store weight ``name`` quantized (else as it is)?"""

    @abc.abstractmethod
    def targets(self, name: str, *, linear: bool, stacked: bool) -> bool:
        """Does the release's rule quantize ``name``, a weight it does not hold (``linear``: an
        ``[out, in]`` weight of a linear layer; ``stacked``: a stacked ``[E, in, out]`` one)?"""

    @abc.abstractmethod
    def encoding(self, name: str) -> Any:
        """The writer's encoding of weight ``name``."""

    @abc.abstractmethod
    def stored_names(self, name: str) -> tuple[str, ...]:
        """The release's tensors holding weight ``name``'s codes and scales, in the writer's order."""

    def global_scale_name(self, name: str) -> str | None:
        """The release's tensor holding weight ``name``'s global scale where the scheme shares one
        among fused weights (the module docstring), else None."""
        return None

    def rows(self, dequantized: LazyTensor, slab: int | None) -> Callable[[int, int], torch.Tensor] | None:
        """``(first, n) -> rows`` of the release's dequantized weight in the layout the writer
        encodes (``[out, in]``); ``slab``: the expert of a stacked weight. None: no such rows."""
        if slab is not None or len(dequantized.shape) != 2:
            return None
        return lambda first, n: read_rows(dequantized, first, n)


def _excluded(module: str, patterns: tuple[str, ...]) -> bool:
    """transformers' match of ``modules_to_not_convert``: a pattern matched from the start of the
    module's name (``*`` for a layer number), or its suffix."""
    return any(re.match(p, module) or module == p or module.endswith("." + p) for p in patterns)


def _not_converted(kept: Any, where: str) -> tuple[str, ...]:
    """A release's ``modules_to_not_convert`` as patterns :func:`_excluded` matches: a list of
    strings, each a regular expression (transformers matches them as such); else refused."""
    if not isinstance(kept, (list, tuple)) or not all(isinstance(k, str) for k in kept):
        raise LayoutError(f"quantization_config.modules_to_not_convert is {kept!r}", culprit=where,
                          hint="a list of module names or patterns, as transformers writes it")
    for k in kept:
        try:
            re.compile(k)
        except re.error as exc:
            raise LayoutError(f"quantization_config.modules_to_not_convert holds {k!r}, no regular expression "
                              f"({exc})", culprit=where, hint="fix the pattern in the release's config.json") from None
    return tuple(kept)


class Fp8BlockLike(LikeScheme):
    """DeepSeek's FP8 blocks: ``X`` e4m3 and ``X_scale_inv`` float32 a block; the rule: linear
    weights outside ``modules_to_not_convert``."""

    def __init__(self, block: tuple[int, int], kept: tuple[str, ...]) -> None:
        self.block, self.kept = block, kept

    def quantized(self, name: str, stored: Mapping[str, Any]) -> bool:
        return name in stored and stored[name].dtype == fp8_block.E4M3

    def targets(self, name: str, *, linear: bool, stacked: bool) -> bool:
        return linear and not stacked and not _excluded(name.removesuffix(".weight"), self.kept)

    def encoding(self, name: str) -> Any:
        return self.block

    def stored_names(self, name: str) -> tuple[str, ...]:
        return name, fp8_block.scale_name(name)


class Mxfp4Like(LikeScheme):
    """GPT-OSS's MXFP4: a stacked ``X`` ``[E, in, out]`` as ``X_blocks`` and ``X_scales``; the
    rule: stacked weights outside ``modules_to_not_convert``. Decided per expert (slab), the unit
    the writer quantizes: a group's scale depends on its 32 values alone."""

    def __init__(self, kept: tuple[str, ...]) -> None:
        self.kept = kept

    def quantized(self, name: str, stored: Mapping[str, Any]) -> bool:
        return name + mxfp4.BLOCKS_SUFFIX in stored

    def targets(self, name: str, *, linear: bool, stacked: bool) -> bool:
        return stacked and not _excluded(name.rsplit(".", 1)[0], self.kept)

    def encoding(self, name: str) -> Any:
        return mxfp4.METHOD

    def stored_names(self, name: str) -> tuple[str, ...]:
        return name + mxfp4.BLOCKS_SUFFIX, name + mxfp4.SCALES_SUFFIX

    def rows(self, dequantized: LazyTensor, slab: int | None) -> Callable[[int, int], torch.Tensor] | None:
        codes = dequantized.transposed() if isinstance(dequantized, mxfp4.Mxfp4Dequantized) else None
        if slab is None or codes is None or not 0 <= slab < codes.shape[0]:
            return None
        cols = codes.shape[-1]
        return lambda first, n: codes.read_box((slab, first, 0), (1, n, cols)).view(n, cols)


class CompressedTensorsLike(LikeScheme):
    """compressed-tensors' pack-quantized INT (symmetric, by group or channel) and float-quantized
    FP8 (by channel or tensor); the rule: ``Linear`` weights a config group targets, outside
    ``ignore``. Each config group's encoding is made by its format's entry of :data:`CT_FORMATS`."""

    def __init__(self, settings: compressed_tensors.Settings, stored: Mapping[str, Any],
                 qc: Mapping[str, Any], where: str) -> None:
        self.settings = settings
        for name, group in (qc.get("config_groups") or {}).items():
            for kind in ("input_activations", "output_activations"):
                act = group.get(kind) if isinstance(group, Mapping) else None
                if isinstance(act, Mapping) and not act.get("dynamic"):
                    raise _refused(f"config group {name} quantizes {kind} with calibrated (static) scales", where)
        if qc.get("kv_cache_scheme"):
            raise _refused("quantization_config.kv_cache_scheme (calibrated KV cache scales)", where)
        # W4A4 NVFP4 (the NVFP4 preset): each layer's calibrated activation scale, kept from the release
        self.activation = any(k.endswith(".input_global_scale") for k in stored)
        g_idx = next((k for k in stored if k.endswith(".weight_g_idx")), None)
        if g_idx is not None:
            raise _refused(f"{g_idx} (a g_idx: activation-order groups, which reshard does not write)", where)
        scale_dtypes = {t.dtype for k, t in stored.items() if k.endswith(".weight_scale")}
        shape_dtypes = {t.dtype for k, t in stored.items() if k.endswith(".weight_shape")}
        if len(scale_dtypes) > 1 or len(shape_dtypes) > 1:
            raise _refused(f"scales of several dtypes ({sorted(map(str, scale_dtypes | shape_dtypes))})", where)
        self.scale_dtype = next(iter(scale_dtypes), None)
        self.shape_dtype = next(iter(shape_dtypes), None)
        self.encodings: dict[str, Encoding] = {}
        for s in settings.schemes:
            classes = [t for t in s.targets if compressed_tensors.class_name(t) and t != "Linear"]
            if classes:
                raise _refused(f"config group {s.name} targeting {classes[0]} (reshard places Linear layers)", where)
            make = CT_FORMATS.get(s.format)
            if make is None:
                raise _refused(f"compressed-tensors {s.format} (config group {s.name})", where)
            self.encodings[s.name] = make(s, self, where)

    def _module(self, name: str) -> str:
        return name.removesuffix(".weight")

    def quantized(self, name: str, stored: Mapping[str, Any]) -> bool:
        module = self._module(name)
        return f"{module}.weight_packed" in stored or (name in stored and stored[name].dtype == fp8_scaled.E4M3)

    def targets(self, name: str, *, linear: bool, stacked: bool) -> bool:
        module = self._module(name)
        if not linear or stacked or not name.endswith(".weight"):
            return False
        if any(compressed_tensors.matches(module, t) for t in self.settings.ignore):
            return False
        return any(compressed_tensors.class_name(t) or compressed_tensors.matches(module, t)
                   for s in self.settings.schemes for t in s.targets)

    def encoding(self, name: str) -> Any:
        scheme = self.settings.scheme_of(self._module(name), FLAG)
        return self.encodings[scheme.name]

    def stored_names(self, name: str) -> tuple[str, ...]:
        enc = self.encoding(name)
        return tuple(n for n, _dtype, _shape in enc.tensors(name, (1, 1), torch.float32))

    def global_scale_name(self, name: str) -> str | None:
        return f"{self._module(name)}.weight_global_scale" if self.encoding(name).global_scaled else None


def _pack_encoding(s: compressed_tensors.Scheme, like: CompressedTensorsLike, where: str) -> Encoding:
    """pack-quantized INT4 / INT8, symmetric, by group or channel (:mod:`reshard.core.int_packed`)."""
    if not s.symmetric:
        raise _refused(f"asymmetric pack-quantized int{s.num_bits} (config group {s.name})", where)
    if s.num_bits not in (4, 8) or s.strategy not in ("group", "channel"):
        raise _refused(f"pack-quantized int{s.num_bits} by {s.strategy} (config group {s.name})", where)
    return Encoding(compressed_tensors.PACK, s.group_size, s.num_bits, s.strategy, like.scale_dtype,
                    like.shape_dtype)


def _float_encoding(s: compressed_tensors.Scheme, like: CompressedTensorsLike, where: str) -> Encoding:
    """float-quantized FP8 by channel or tensor (:mod:`reshard.core.fp8_scaled`)."""
    if s.strategy not in ("channel", "tensor"):
        raise _refused(f"float-quantized FP8 by {s.strategy} (config group {s.name})", where)
    return Encoding(compressed_tensors.FLOAT, None, 8, s.strategy, like.scale_dtype)


def _nvfp4_encoding(s: compressed_tensors.Scheme, like: CompressedTensorsLike, where: str) -> Encoding:
    """nvfp4-pack-quantized weights (:func:`reshard.core.nvfp4.quantize_ct`), a global scale per
    fused group (:func:`~reshard.core.compressed_tensors_out.fused_with`); ``read_config`` has
    checked its 4 bits and group of 16."""
    return Encoding(compressed_tensors.NVFP4, activation=like.activation)


#: compressed-tensors format -> the encoding of a config group of it (one entry per format written;
#: a format not here is refused).
CT_FORMATS: dict[str, Callable[[compressed_tensors.Scheme, CompressedTensorsLike, str], Any]] = {
    compressed_tensors.PACK: _pack_encoding, compressed_tensors.FLOAT: _float_encoding,
    compressed_tensors.NVFP4: _nvfp4_encoding}


def _fp8_scheme(q: ReleaseQuantization, config: Mapping[str, Any], stored: Mapping[str, Any],
                where: str) -> LikeScheme:
    return Fp8BlockLike(q.settings, _not_converted(config["quantization_config"].get("modules_to_not_convert") or [],
                                                   where))


def _mxfp4_scheme(q: ReleaseQuantization, config: Mapping[str, Any], stored: Mapping[str, Any],
                  where: str) -> LikeScheme:
    return Mxfp4Like(_not_converted(tuple(q.settings), where))


def _ct_scheme(q: ReleaseQuantization, config: Mapping[str, Any], stored: Mapping[str, Any],
               where: str) -> LikeScheme:
    return CompressedTensorsLike(q.settings, stored, config["quantization_config"], where)


class ModelOptLike(LikeScheme):
    """ModelOpt's NVFP4 (W4A4): ``X.weight`` uint8, ``X.weight_scale`` e4m3, ``X.weight_scale_2``
    (shared by q/k/v and by gate/up, as its export's ``preprocess_linear_fusion`` unifies their
    amax) and ``X.input_scale`` (calibrated, copied from the release: the module docstring); the
    rule: linear weights outside ``exclude_modules`` (fnmatch patterns, as vLLM matches them)."""

    def __init__(self, settings: modelopt.Settings) -> None:
        self.exclude = settings.exclude
        self.enc = Encoding(MODELOPT_NVFP4, activation=True)

    def quantized(self, name: str, stored: Mapping[str, Any]) -> bool:
        module = name.removesuffix(".weight")
        return (name.endswith(".weight") and name in stored and modelopt.encoded(name, stored[name].dtype)
                and f"{module}.weight_scale_2" in stored)

    def targets(self, name: str, *, linear: bool, stacked: bool) -> bool:
        module = name.removesuffix(".weight")
        return (linear and not stacked and name.endswith(".weight")
                and not any(fnmatch.fnmatchcase(module, p) for p in self.exclude))

    def encoding(self, name: str) -> Any:
        return self.enc

    def stored_names(self, name: str) -> tuple[str, ...]:
        return tuple(n for n, _dtype, _shape in self.enc.tensors(name, (1, 1), torch.float32))

    def global_scale_name(self, name: str) -> str | None:
        return f"{name.removesuffix('.weight')}.weight_scale_2"


def _modelopt_scheme(q: ReleaseQuantization, config: Mapping[str, Any], stored: Mapping[str, Any],
                     where: str) -> LikeScheme:
    return ModelOptLike(q.settings)


#: release method (``quant_method``) -> its scheme, made from the release (its quantization, its
#: config.json, its stored tensors, the folder for refusals). One entry per method.
LikeFactory = Callable[[ReleaseQuantization, Mapping[str, Any], Mapping[str, Any], str], LikeScheme]
_SCHEMES: dict[str, LikeFactory] = {"fp8": _fp8_scheme, "mxfp4": _mxfp4_scheme,
                                    compressed_tensors.METHOD: _ct_scheme, modelopt.METHOD: _modelopt_scheme}


def register_like_scheme(method: str, factory: LikeFactory) -> None:
    """Re-quantize releases of ``method`` with the scheme ``factory`` makes (replacing any)."""
    _SCHEMES[method] = factory


def _refused(what: str, where: str) -> LayoutError:
    return LayoutError(f"{where} is quantized with {what}, which --quantize like-source cannot write", culprit=FLAG,
                       hint="export without --quantize (or with a --quantize scheme reshard writes), then "
                            "quantize with the release's own tools")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise LayoutError("is not readable JSON", culprit=str(path), hint=f"{FLAG} takes a release folder") from None


@dataclass
class LikeSource:
    """An opened release folder and its scheme (:func:`open_like`)."""

    folder: Path
    config: dict[str, Any]
    sidecar: str | None
    quantization: ReleaseQuantization
    scheme: LikeScheme
    stored: dict[str, Any]
    _dequantized: dict[torch.dtype, dict[str, Any]] = field(default_factory=dict)

    @property
    def architectures(self) -> list[str]:
        """config.json's ``architectures`` (the class the release is)."""
        archs = self.config.get("architectures")
        return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """config.json's own ``quantization_config`` (None where only ``hf_quant_config.json`` declares it)."""
        return self.config.get("quantization_config")

    def dequantized(self, dtype: torch.dtype) -> dict[str, Any]:
        """The release's tensors as the model's, lazily, in ``dtype`` (every pair checked once)."""
        if dtype not in self._dequantized:
            self._dequantized[dtype] = release_dequantized(self.stored, self.quantization, dtype, str(self.folder))
        return self._dequantized[dtype]

    def counterpart(self, name: str, shape: tuple[int, ...], *, stacked: bool) -> bool:
        """Does the release hold ``name`` of ``shape`` (a slab's, of a stacked one: its last dims)?"""
        t = self.dequantized(torch.bfloat16).get(name)
        if t is None:
            return False
        return tuple(t.shape[1:] if stacked else t.shape) == tuple(shape)

    def encoding(self, name: str, shape: tuple[int, ...], *, slab: bool, linear: bool, transposed: bool) -> Any:
        """The encoding of the output's ``name`` (``shape``; ``slab``: a stacked tensor's slab shape;
        ``linear``: a linear layer's ``[out, in]`` weight; ``transposed``: a stacked ``[E, in, out]``
        one), None: written as it is."""
        if self.counterpart(name, shape, stacked=slab):
            return self.scheme.encoding(name) if self.scheme.quantized(name, self.stored) else None
        return self.scheme.encoding(name) if self.scheme.targets(name, linear=linear, stacked=transposed) else None

    def copies(self, name: str, shape: tuple[int, ...], *, slab: bool) -> bool:
        """Would an unchanged ``name`` be copied (the release holds it quantized, same shape)?"""
        return self.counterpart(name, shape, stacked=slab) and self.scheme.quantized(name, self.stored)

    def matcher(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slab: int | None = None
                ) -> Callable[[int, torch.Tensor], bool] | None:
        """For a weight ``name`` of ``shape`` and ``dtype`` (``[out, in]`` as the writer encodes it;
        ``slab``: its expert) seen a band at a time: ``(first row, rows) ->`` are those rows' bits the
        release's dequantized ones in ``dtype``? None where the release holds no such quantized
        weight (nothing to copy)."""
        deq = self.dequantized(dtype).get(name)
        if deq is None or len(shape) != 2 or not self.scheme.quantized(name, self.stored):
            return None
        rows = self.scheme.rows(deq, slab)
        if rows is None or tuple(deq.shape[1:] if slab is not None else deq.shape) != \
                tuple(reversed(shape) if slab is not None else shape):
            return None
        bits = _BITS[dtype.itemsize]

        def same(first: int, band: torch.Tensor) -> bool:
            got = rows(first, band.shape[0])
            return got.dtype == band.dtype and torch.equal(got.contiguous().view(bits), band.contiguous().view(bits))

        return same

    def unchanged(self, name: str, value: torch.Tensor, slab: int | None = None) -> bool:
        """Are ``value``'s bits (``[out, in]`` as the writer encodes it; ``slab``: its expert) the
        release's dequantized ``name`` in ``value``'s dtype? Compared a band of rows at a time
        (:meth:`matcher`), the first differing band ending it."""
        same = self.matcher(name, tuple(value.shape), value.dtype, slab) if value.dim() == 2 else None
        if same is None:
            return False
        band = max(1, BAND_ELEMENTS // max(1, value.shape[1]))
        return all(same(r, value[r:r + band]) for r in range(0, value.shape[0], band))

    def global_scales_agree(self, names: Sequence[str]) -> bool:
        """Do the weights ``names``, which share one global scale, have one in the release, bit
        for bit (the module docstring: else none of them is copied)?"""
        keys = [self.scheme.global_scale_name(n) for n in names]
        if any(k is None or k not in self.stored for k in keys):
            return False
        first = self.stored_tensor(keys[0])
        return all(_same_bits(first, self.stored_tensor(k)) for k in keys[1:])

    def stored_tensor(self, key: str) -> torch.Tensor:
        """The release's stored tensor ``key``, read whole (a scale: small)."""
        t = self.stored[key]
        return box_of(t, (0,) * len(t.shape), tuple(t.shape)).clone()

    def stored_tensors(self, name: str, slab: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """The release's codes and scales of ``name`` (``slab``: one expert's), as stored: copied out."""
        out = []
        for key in self.scheme.stored_names(name):
            t = self.stored[key]
            shape = tuple(t.shape)
            if slab is None:
                out.append((key, box_of(t, (0,) * len(shape), shape).clone()))
            else:
                out.append((key, box_of(t, (slab,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
                            .reshape(shape[1:]).clone()))
        return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # 0-dim: ModelOpt's scale_2


def open_like(folder: str | Path) -> LikeSource:
    """The release folder of ``--quantize-like`` with its scheme, every tensor's header read and
    every quantized pair checked; a folder that is none, declares no quantization, or one no
    :class:`LikeScheme` writes is refused in one line."""
    if "://" in str(folder):  # the release's tensors are mapped from local files, compared and copied
        raise LayoutError("is a URL: the release folder is read from a local disk", culprit=str(folder),
                          hint=f"download the release (its config.json and safetensors) and give {FLAG} that folder")
    path = Path(folder)
    if not (path / CONFIG).is_file():
        raise LayoutError(f"has no {CONFIG}", culprit=str(path),
                          hint=f"{FLAG} takes the Hugging Face folder of the quantized release")
    raw = _json(path / CONFIG)
    if not isinstance(raw, dict):
        raise LayoutError("is not a JSON object", culprit=str(path / CONFIG), hint=f"{FLAG} takes a release folder")
    sidecar = (path / SIDECAR).read_text() if (path / SIDECAR).is_file() else None
    config = release_config(raw, json.loads(sidecar) if sidecar is not None else None)
    quantization = read_release_quantization(config, str(path / CONFIG))  # a method reshard reads, else refused
    if quantization is None:
        raise LayoutError("declares no quantization (config.json has no quantization_config)", culprit=str(path),
                          hint=f"{FLAG} takes a quantized release; drop --quantize for a model in its dtype")
    if (path / INDEX).is_file():
        wm = _json(path / INDEX).get("weight_map")
        files = sorted(set(wm.values())) if isinstance(wm, dict) else []
    else:
        files = [WEIGHTS] if (path / WEIGHTS).is_file() else []
    if not files or not all((path / f).is_file() for f in files):
        raise LayoutError("has no safetensors weights (model.safetensors, or the files its index lists)",
                          culprit=str(path), hint=f"{FLAG} takes the release folder with its weights")
    stored: dict[str, Any] = {}
    for f in files:
        mapped = MappedSafetensors(path / f)
        stored.update({key: mapped.tensor(key) for key in mapped.entries})
    make = _SCHEMES.get(quantization.codec.method)
    if make is None:
        raise _refused(quantization.codec.title, str(path))
    scheme = make(quantization, config, stored, str(path))
    like = LikeSource(path, raw, sidecar, quantization, scheme, stored)
    like.dequantized(torch.bfloat16)  # every pair checked before anything is planned
    return like
