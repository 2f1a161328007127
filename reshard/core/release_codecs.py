"""Quantized releases: ``config.json``'s ``quantization_config.quant_method`` -> the codec that reads
the folder's weights back as the model's.

A release quantized by a method reshard reads is imported dequantized, each stored weight a lazy
tensor of the model's dtype in the layout a full-precision release would hold (the architecture's
name table never sees the codes); a method no codec reads is refused by name before anything is
fetched. Each codec is one :class:`ReleaseCodec` (its arithmetic in a codec module of its own);
the next method is a class registered with :func:`register_release_codec`, not a branch in the
``hf`` format.

======================  ==========================================  ====================================================
method                  codec module                                stored tensors of a weight ``X``
======================  ==========================================  ====================================================
``fp8``                 :mod:`reshard.core.fp8_block`               ``X`` float8_e4m3fn ``[M, N]``,
                                                                    ``X_scale_inv`` float32 per block
``mxfp4``               :mod:`reshard.core.mxfp4`                   ``X_blocks`` uint8 ``[*, out, in/32, 16]``,
                                                                    ``X_scales`` uint8 ``[*, out, in/32]``; ``X`` is
                                                                    read as ``[*, in, out]``
``compressed-tensors``  :mod:`reshard.core.compressed_tensors`      by each config group's ``format`` (``X`` is
                        (config groups, ``ignore``, ``targets``);   ``*.weight``): ``pack-quantized``: ``X_packed``
                        arithmetic: :mod:`reshard.core.int_packed`  int32 ``[out, in*b/32]``, ``X_scale``, ``X_shape``
                        (INT), :mod:`reshard.core.fp8_scaled`       (``X_zero_point``); ``float-quantized``: ``X``
                        (FP8), :mod:`reshard.core.nvfp4`            e4m3, ``X_scale`` per tensor/channel/group/block;
                                                                    ``nvfp4-pack-quantized``: ``X_packed`` uint8
                                                                    ``[out, in/2]``, ``X_scale`` e4m3 ``[out, in/16]``,
                                                                    ``X_global_scale`` float32
``modelopt``            :mod:`reshard.core.modelopt`; arithmetic:   NVFP4: ``X`` uint8 ``[out, in/2]``, ``X_scale`` e4m3
                        :mod:`reshard.core.nvfp4`                   ``[out, in/16]``, ``X_scale_2`` float32 (declared
                                                                    in ``config.json`` or ``hf_quant_config.json``)
======================  ==========================================  ====================================================
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from reshard.core import compressed_tensors, fp8_block, modelopt, mxfp4
from reshard.core.errors import CheckpointFormatError


class ReleaseCodec(abc.ABC):
    """One quantization method of released folders, as read."""

    #: ``quantization_config.quant_method``.
    method: ClassVar[str]
    #: What it is, for the refusal of other methods.
    title: ClassVar[str]

    @abc.abstractmethod
    def settings(self, config: Mapping[str, Any], where: str) -> Any:
        """The method's settings from ``config.json`` (``config``), or a
        :class:`CheckpointFormatError` naming what it cannot read."""

    @abc.abstractmethod
    def dequantized(self, tensors: Mapping[str, Any], settings: Any, dtype: torch.dtype,
                    where: str) -> dict[str, Any]:
        """The folder's ``tensors`` with each quantized weight a lazy ``dtype`` tensor under the
        weight's own name (its stored tensors gone), every pair checked first."""

    @abc.abstractmethod
    def summary(self, settings: Any) -> dict[str, Any]:
        """How the weights are stored, for ``inspect`` and a run's record (``method`` first)."""

    @abc.abstractmethod
    def encoded(self, key: str, dtype: torch.dtype) -> bool:
        """Is stored tensor ``key`` of ``dtype`` a weight's codes (what ``inspect`` counts)?"""

    def unannounced(self, tensors: Mapping[str, Any], where: str) -> None:
        """Refuse, in a folder whose ``config.json`` declares no quantization, tensors only this
        method stores (a bare cast of its codes would be another model). Default: nothing."""


@dataclass(frozen=True)
class ReleaseQuantization:
    """A folder's quantization: the codec reading it and its settings."""

    codec: ReleaseCodec
    settings: Any

    def summary(self) -> dict[str, Any]:
        return self.codec.summary(self.settings)


class Fp8BlockCodec(ReleaseCodec):
    """FP8 block scaling (DeepSeek-V3's): :mod:`reshard.core.fp8_block`."""

    method = "fp8"
    title = "FP8 block-scaled (quant_method 'fp8' with weight_block_size)"

    def settings(self, config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
        return fp8_block.read_quantization_config(config, where)

    def dequantized(self, tensors: Mapping[str, Any], settings: Any, dtype: torch.dtype,
                    where: str) -> dict[str, Any]:
        return fp8_block.dequantized_tensors(tensors, settings, dtype, where)

    def summary(self, settings: Any) -> dict[str, Any]:
        return {"method": "fp8", "format": "e4m3", "block": list(settings),
                "scales": f"float32 {fp8_block.scale_name('weight')}"}

    def encoded(self, key: str, dtype: torch.dtype) -> bool:
        return dtype == fp8_block.E4M3

    def unannounced(self, tensors: Mapping[str, Any], where: str) -> None:
        fp8_block.dequantized_tensors(tensors, None, torch.bfloat16, where)  # refuses an FP8 tensor


class Mxfp4Codec(ReleaseCodec):
    """MXFP4 (GPT-OSS's): :mod:`reshard.core.mxfp4`."""

    method = "mxfp4"
    title = "MXFP4 (quant_method 'mxfp4': X_blocks and X_scales)"

    def settings(self, config: Mapping[str, Any], where: str) -> tuple[str, ...]:
        """The release's ``modules_to_not_convert`` (informational: the pairs stored say what is
        quantized)."""
        kept = config["quantization_config"].get("modules_to_not_convert") or []
        if not isinstance(kept, list) or not all(isinstance(k, str) for k in kept):
            raise CheckpointFormatError(f"quantization_config.modules_to_not_convert is {kept!r}", culprit=where,
                                        hint="a list of module names or patterns, as transformers writes it")
        return tuple(kept)

    def dequantized(self, tensors: Mapping[str, Any], settings: Any, dtype: torch.dtype,
                    where: str) -> dict[str, Any]:
        """Each ``X_blocks``/``X_scales`` pair as ``X`` (:class:`~reshard.core.mxfp4.Mxfp4Dequantized`),
        after every pair is checked: both present, uint8, the blocks 16 bytes wide, the scales one
        per block row, no ``X`` stored beside them."""
        out: dict[str, Any] = {}
        pairs = {}
        for key, t in tensors.items():
            if key.endswith(mxfp4.SCALES_SUFFIX):
                base = key.removesuffix(mxfp4.SCALES_SUFFIX)
                if base + mxfp4.BLOCKS_SUFFIX not in tensors:
                    raise CheckpointFormatError(f"{key} scales no weight ({base}{mxfp4.BLOCKS_SUFFIX} is absent)",
                                                culprit=where, hint="the files do not belong together; re-copy "
                                                "the folder")
                continue
            if not key.endswith(mxfp4.BLOCKS_SUFFIX):
                out[key] = t
                continue
            base = key.removesuffix(mxfp4.BLOCKS_SUFFIX)
            scales = tensors.get(base + mxfp4.SCALES_SUFFIX)
            _check_pair(key, t, base + mxfp4.SCALES_SUFFIX, scales, where)
            if base in tensors:
                raise CheckpointFormatError(f"{base} is stored both as itself and as {key}", culprit=where,
                                            hint="the files do not belong together; re-copy the folder")
            pairs[base] = (t, scales)
        for base, (blocks, scales) in pairs.items():
            out[base] = mxfp4.Mxfp4Dequantized(blocks, scales, dtype)
        return out

    def summary(self, settings: Any) -> dict[str, Any]:
        return {"method": "mxfp4", "format": "e2m1", "group": mxfp4.GROUP,
                "scales": f"e8m0 uint8 weight{mxfp4.SCALES_SUFFIX}"}

    def encoded(self, key: str, dtype: torch.dtype) -> bool:
        return key.endswith(mxfp4.BLOCKS_SUFFIX) and dtype == torch.uint8


class CompressedTensorsCodec(ReleaseCodec):
    """compressed-tensors' pack-quantized INT, float-quantized FP8 and NVFP4 (llm-compressor's
    releases): :mod:`reshard.core.compressed_tensors`."""

    method = compressed_tensors.METHOD
    title = ("compressed-tensors pack-quantized, float-quantized and nvfp4-pack-quantized "
             "(quant_method 'compressed-tensors')")

    def settings(self, config: Mapping[str, Any], where: str) -> compressed_tensors.Settings:
        return compressed_tensors.read_config(config, where)

    def dequantized(self, tensors: Mapping[str, Any], settings: Any, dtype: torch.dtype,
                    where: str) -> dict[str, Any]:
        return compressed_tensors.dequantized_tensors(tensors, settings, dtype, where)

    def summary(self, settings: Any) -> dict[str, Any]:
        return compressed_tensors.summary(settings)

    def encoded(self, key: str, dtype: torch.dtype) -> bool:
        return compressed_tensors.encoded(key, dtype)

    def unannounced(self, tensors: Mapping[str, Any], where: str) -> None:
        compressed_tensors.refuse_unannounced(tensors, where)


class ModelOptCodec(ReleaseCodec):
    """NVIDIA ModelOpt's NVFP4: :mod:`reshard.core.modelopt`."""

    method = modelopt.METHOD
    title = "ModelOpt NVFP4 (quant_method 'modelopt' or hf_quant_config.json)"

    def settings(self, config: Mapping[str, Any], where: str) -> modelopt.Settings:
        return modelopt.read_config(config, where)

    def dequantized(self, tensors: Mapping[str, Any], settings: Any, dtype: torch.dtype,
                    where: str) -> dict[str, Any]:
        return modelopt.dequantized_tensors(tensors, settings, dtype, where)

    def summary(self, settings: Any) -> dict[str, Any]:
        return modelopt.summary(settings)

    def encoded(self, key: str, dtype: torch.dtype) -> bool:
        return modelopt.encoded(key, dtype)

    def unannounced(self, tensors: Mapping[str, Any], where: str) -> None:
        modelopt.refuse_unannounced(tensors, where)


def _check_pair(key: str, blocks: Any, scales_key: str, scales: Any, where: str) -> None:
    """An MXFP4 pair that does not fit is refused by the tensor's name, before anything is read."""
    if scales is None:
        raise CheckpointFormatError(f"{key} has no {scales_key}", culprit=where,
                                    hint="supply the scale tensors written with the blocks")
    want = f"uint8 [*, out, in/{mxfp4.GROUP}, {mxfp4.GROUP_BYTES}]"
    if blocks.dtype != torch.uint8 or len(blocks.shape) < 3 or blocks.shape[-1] != mxfp4.GROUP_BYTES:
        raise CheckpointFormatError(f"{key} is {str(blocks.dtype).removeprefix('torch.')} {list(blocks.shape)}, "
                                    f"not {want}", culprit=where,
                                    hint=f"MXFP4 blocks hold {mxfp4.GROUP} e2m1 codes in {mxfp4.GROUP_BYTES} bytes")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointFormatError(f"{scales_key} is {str(scales.dtype).removeprefix('torch.')} "
                                    f"{list(scales.shape)}, not uint8 {list(blocks.shape[:-1])} (one scale per "
                                    f"block of {key})", culprit=where,
                                    hint="the scales do not belong to these blocks; re-copy the folder")


_CODECS: dict[str, ReleaseCodec] = {}


def _builtins() -> dict[str, ReleaseCodec]:
    if not _CODECS:
        # NVFP4's and compressed-tensors' checks of an undeclared folder first: their codes come
        # with e4m3 scales, which the FP8 codec's check would name as FP8 block scales
        for codec in (ModelOptCodec(), CompressedTensorsCodec(), Fp8BlockCodec(), Mxfp4Codec()):
            _CODECS.setdefault(codec.method, codec)
    return _CODECS


def register_release_codec(codec: ReleaseCodec) -> None:
    """Read folders of ``codec.method`` with ``codec`` (replacing a codec of that method)."""
    _builtins()[codec.method] = codec


def unregister_release_codec(method: str) -> None:
    """Stop reading folders of ``method`` (a built-in comes back when registered again)."""
    _builtins().pop(method, None)


def release_codecs() -> dict[str, ReleaseCodec]:
    """The codecs by method."""
    return dict(_builtins())


def release_config(config: Mapping[str, Any], sidecar: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``config.json`` (``config``) with the quantization a file beside it declares when it declares
    none itself: ModelOpt's ``hf_quant_config.json`` (``sidecar``, :data:`SIDECAR`)."""
    return modelopt.with_sidecar(config, sidecar)


#: The file beside ``config.json`` that may declare a folder's quantization (ModelOpt's export).
SIDECAR = modelopt.SIDECAR


def read_release_quantization(config: Mapping[str, Any], where: str) -> ReleaseQuantization | None:
    """The quantization ``config.json`` (``config``, read with :func:`release_config`) declares,
    None for none; a method no codec reads is refused, named (its weights are not the model's until
    its own kernels unpack them)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    codec = _builtins().get(method) if isinstance(method, str) else None
    if codec is None:
        named = f"quant_method {method!r}" if method else "a quantization_config without quant_method"
        read = ", ".join(c.title for c in _builtins().values())
        raise CheckpointFormatError(f"holds {named}, which reshard does not read", culprit=where,
                                    hint=f"reshard reads {read}; dequantize others with their own tools first")
    return ReleaseQuantization(codec, codec.settings(config, where))


def release_dequantized(tensors: Mapping[str, Any], quantization: ReleaseQuantization | None, dtype: torch.dtype,
                        where: str) -> dict[str, Any]:
    """A folder's tensors as the model's: dequantized by its codec, or, when it declares none,
    as stored once no codec finds its codes among them."""
    if quantization is not None:
        return quantization.codec.dequantized(tensors, quantization.settings, dtype, where)
    for codec in _builtins().values():
        codec.unannounced(tensors, where)
    return dict(tensors)
