"""Folders quantized to NVFP4 by NVIDIA's ModelOpt (``quantization_config.quant_method "modelopt"``
in ``config.json``, and/or ``hf_quant_config.json`` beside it): which weights are quantized, read as
the model's.

ModelOpt's export writes ``hf_quant_config.json`` (``{"producer": ..., "quantization":
{"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}}``) and, in newer releases,
the same as ``config.json``'s ``quantization_config`` (``quant_method "modelopt"``, ``quant_algo``,
``ignore``). A quantized linear layer ``X`` stores ``X.weight`` uint8 ``[out, in/2]``,
``X.weight_scale`` e4m3 ``[out, in/16]``, ``X.weight_scale_2`` float32 and ``X.input_scale``
(an activation scale: not read; ``--quantize like-source`` copies it): :mod:`reshard.core.nvfp4`
has the arithmetic. Excluded modules (``exclude_modules``, fnmatch patterns as vLLM matches them)
keep the model's dtype.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core import nvfp4
from reshard.core.compressed_tensors import nvfp4_weight, refusal
from reshard.core.errors import CheckpointFormatError
from reshard.core.lazy import LazyTensor

METHOD = "modelopt"
#: The file ModelOpt's export writes beside ``config.json``.
SIDECAR = "hf_quant_config.json"
#: A quantized module's tensors besides its codes (``input_scale``: the activations').
PARAMS = ("weight_scale", "weight_scale_2", "input_scale")


@dataclass(frozen=True)
class Settings:
    """The release's ``quant_algo`` (NVFP4), group size and excluded modules."""

    group_size: int
    exclude: tuple[str, ...]


def with_sidecar(config: Mapping[str, Any], sidecar: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``config`` declaring ModelOpt's quantization from ``hf_quant_config.json`` (``sidecar``)
    when it declares none itself (older exports write only the sidecar)."""
    if sidecar is None or config.get("quantization_config") is not None:
        return config
    details = sidecar.get("quantization") if isinstance(sidecar, Mapping) else None
    return {**config, "quantization_config": {"quant_method": METHOD,
                                              **(details if isinstance(details, Mapping) else {})}}


def read_config(config: Mapping[str, Any], where: str) -> Settings:
    """NVFP4's settings, or a refusal naming the ``quant_algo`` reshard does not read."""
    qc = config["quantization_config"]
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointFormatError(f"holds ModelOpt quant_algo {algo!r}, which reshard does not read", culprit=where,
                                    hint="reshard reads ModelOpt NVFP4; dequantize others with ModelOpt first")
    if qc.get("kv_cache_quant_algo") not in (None, "FP8") or qc.get("pre_quant_scale"):
        raise CheckpointFormatError("holds ModelOpt NVFP4 with scales reshard does not read", culprit=where,
                                    hint="reshard reads plain NVFP4 weights (no AWQ pre_quant_scale)")
    group = qc.get("group_size", nvfp4.GROUP)
    if group != nvfp4.GROUP:
        raise CheckpointFormatError(f"ModelOpt NVFP4 group_size is {group!r}, not {nvfp4.GROUP}", culprit=where,
                                    hint="NVFP4 scales 16 values a row each")
    exclude = qc.get("exclude_modules", qc.get("ignore")) or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise CheckpointFormatError(f"ModelOpt exclude_modules is {exclude!r}", culprit=where,
                                    hint="a list of module names or fnmatch patterns, as ModelOpt writes it")
    return Settings(group, tuple(exclude))


def summary(settings: Settings) -> dict[str, Any]:
    return {"method": METHOD, "format": "nvfp4 e2m1", "group": settings.group_size,
            "scales": "e4m3 weight_scale, float32 weight_scale_2", "exclude": list(settings.exclude)}


def encoded(key: str, dtype: torch.dtype) -> bool:
    return key.endswith(".weight") and dtype == torch.uint8


def refuse_unannounced(tensors: Mapping[str, Any], where: str) -> None:
    """Refuse NVFP4 codes (a uint8 weight with its ``weight_scale_2``) in a folder that declares no
    quantization, neither in ``config.json`` nor by ``hf_quant_config.json``."""
    key = next((k for k, t in tensors.items() if encoded(k, t.dtype)
                and f"{k.rpartition('.')[0]}.weight_scale_2" in tensors), None)
    if key is not None:
        raise refusal(f"{key} holds NVFP4 codes but the folder declares no quantization", where,
                      hint=f"ModelOpt's export declares it in {SIDECAR} and config.json; re-copy them")


def dequantized_tensors(tensors: Mapping[str, Any], settings: Settings, dtype: torch.dtype,
                        where: str) -> dict[str, Any]:
    """The folder's ``tensors`` with each NVFP4 weight (a uint8 ``X.weight``) a lazy ``dtype``
    tensor and its scales gone, every one checked before any is read."""
    modules = {key.rpartition(".")[0] for key, t in tensors.items() if encoded(key, t.dtype)}
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        module, _, param = key.rpartition(".")
        if module in modules and param in (*PARAMS, "weight"):
            continue
        if param in ("weight_scale_2", "input_scale", "k_scale", "v_scale"):
            continue
        if param == "weight_scale":
            raise refusal(f"{key} scales no NVFP4 weight ({module}.weight is not uint8)", where)
        out[key] = t
    for module in modules:
        if any(fnmatch.fnmatchcase(module, p) for p in settings.exclude):
            raise refusal(f"{module}.weight is stored as NVFP4 but exclude_modules lists {module}", where)
        out[f"{module}.weight"] = _weight(module, tensors, dtype, where)
    return out


def _weight(module: str, tensors: Mapping[str, Any], dtype: torch.dtype, where: str) -> LazyTensor:
    codes = tensors[f"{module}.weight"]
    if len(codes.shape) != 2:
        raise refusal(f"{module}.weight is uint8 {list(codes.shape)}, not NVFP4's [out, in/2]", where)
    return nvfp4_weight(f"{module}.weight", codes, f"{module}.weight_scale", tensors.get(f"{module}.weight_scale"),
                        f"{module}.weight_scale_2", tensors.get(f"{module}.weight_scale_2"),
                        nvfp4.dequantize_modelopt, dtype, where)
