"""Quantized Hugging Face folders written by the reference libraries themselves, on a CPU, and
those libraries' own dequantization of them (the oracles of ``tests/test_quantized_releases.py``
and of the import harness run in ``tests/test_hf_import.py``).

- compressed-tensors: its quantization lifecycle over a transformers model
  (``apply_quantization_config``, the scales from ``calculate_qparams`` / ``generate_gparam`` of
  each weight's own min and max, as a min-max observer gives them), then ``ModelCompressor``'s
  ``compress_model``, ``save_pretrained`` and ``update_config``: llm-compressor's save path. An
  NVFP4 (``tensor_group``) weight's global scale is its fused group's (q/k/v, gate/up:
  :func:`fused_global_scales`), as llm-compressor's fused observers compute it; llm-compressor
  itself pins an older compressed-tensors than the 0.20 these tests run, so that one step is
  reproduced here from its source (``observers/helpers.py``: ``FUSED_LAYER_NAMES``,
  ``fuse_weight_observers``; ``observers/base.py``: ``Observer.get_global_scale``).
  Dequantized by transformers loading the folder with ``CompressedTensorsConfig(dequantize=True)``
  (compressed-tensors' decompressors).
- ModelOpt NVFP4: each linear weight quantized by ModelOpt's own ``NVFP4QTensor.quantize``, the
  folder laid out as ModelOpt's ``export_hf_checkpoint`` writes it (``X.weight`` uint8,
  ``X.weight_scale``, ``X.weight_scale_2``, ``X.input_scale``; ``hf_quant_config.json`` and, by
  ModelOpt's own ``convert_hf_quant_config_format``, ``config.json``'s ``quantization_config``),
  written here because the exporter needs a calibrated ModelOpt model. Dequantized by
  ``NVFP4QTensor.dequantize``.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch

#: The schemes, as compressed-tensors ``QuantizationArgs`` keyword arguments of the weights (and
#: the preset whose activations they carry, for the formats that need them).
SCHEMES = {
    # Kimi-K2-Thinking / K2.5's: INT4 symmetric, group 32
    "w4a16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "w4a16_g16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
    "w4a16_asym": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    "w4a16_channel": dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
    "w4a16_tensor": dict(num_bits=4, type="int", symmetric=True, strategy="tensor"),
    "w8a16": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8_tensor": "FP8",
    "fp8_channel": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
    "fp8_group": dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32),
    "fp8_block": dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 48]),
    "nvfp4": "NVFP4",
    "nvfp4a16": "NVFP4A16",
}


def ct_scheme(name: str | dict):
    """A scheme of :data:`SCHEMES` by name, or one of ``QuantizationArgs`` keyword arguments."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    spec = SCHEMES[name] if isinstance(name, str) else name
    if isinstance(spec, str):
        return preset_name_to_scheme(spec, ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**spec))


#: llm-compressor's ``FUSED_LAYER_NAMES``: the layers of one module whose NVFP4 global scale is one.
FUSED_LAYER_NAMES = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                     ("w1", "w3"))


def fused_global_scales(weights: dict[str, torch.Tensor], group_size: int = 16) -> dict[str, torch.Tensor]:
    """Each module's (``weights``: module name -> its weight) NVFP4 global scale as llm-compressor's
    fused min-max observers give it: the modules of a fused group (a parent holding every name of
    one of :data:`FUSED_LAYER_NAMES`) take ``generate_gparam`` of the absolute maximum over all
    their per-group minima and maxima (in the weights' dtype); any other module its own."""
    from compressed_tensors.quantization.utils import generate_gparam

    stats = {}
    for name, w in weights.items():
        grouped = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
        stats[name] = (grouped.amin(-1), grouped.amax(-1))
    out = {}
    for name in weights:
        parent, _, leaf = name.rpartition(".")
        members = [name]
        for group in FUSED_LAYER_NAMES:
            if leaf in group and all(f"{parent}.{g}" in weights for g in group):
                members = [f"{parent}.{g}" for g in group]
        absmax = stats[members[0]][1].max()
        for m in members:
            absmax = torch.max(absmax, -stats[m][0].min())
            absmax = torch.max(absmax, stats[m][1].max())
        out[name] = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    return out


def fused_groups(modules: Collection[str]) -> list[list[str]]:
    """``modules`` in their fused groups (a parent holding every name of one of
    :data:`FUSED_LAYER_NAMES`, in that order), any other module alone; sorted by first member."""
    out, seen = [], set()
    for name in sorted(modules):
        if name in seen:
            continue
        parent, _, leaf = name.rpartition(".")
        members = [name]
        for group in FUSED_LAYER_NAMES:
            if leaf in group and all(f"{parent}.{g}" in modules for g in group):
                members = [f"{parent}.{g}" for g in group]
        seen.update(members)
        out.append(members)
    return out


def modelopt_fused(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt 0.47's own NVFP4 quantization of one fused group's ``weights`` (module name ->
    ``[out, in]``) as its HF export requantizes them: ``weight_scale_2`` from the max of the
    parts' amax (``preprocess_linear_fusion`` unifies the weight quantizers' amax;
    ``get_weights_scaling_factor_2`` of each part is that amax over 2688, so the max of theirs),
    each part then ``NVFP4QTensor.quantize``d under it; the stored tensors by their full names."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    scale_2 = torch.stack([NVFP4QTensor.get_weights_scaling_factor_2(w) for w in weights.values()]).max()
    out = {}
    for module, w in weights.items():
        q, scale, _ = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=scale_2)
        out |= {module + ".weight": q._quantized_data, module + ".weight_scale": scale,
                module + ".weight_scale_2": scale_2.clone()}
    return out


def _observe(module: torch.nn.Module, gscale: torch.Tensor | None = None) -> None:
    """A min-max observer's qparams of ``module``'s weight, set on it (compressed-tensors' helpers);
    ``gscale``: a ``tensor_group`` weight's global scale (its fused group's), else its own."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights
    w = module.weight.data
    if args.strategy in ("group", "tensor_group"):
        grouped = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        b0, b1 = args.block_structure
        rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
        padded = torch.nn.functional.pad(w, (0, cols * b1 - w.shape[1], 0, rows * b0 - w.shape[0]))
        blocks = padded.view(rows, b0, cols, b1)
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        lo, hi = w.amin(), w.amax()
    if hasattr(module, "weight_global_scale"):
        gscale = generate_gparam(w.amin(), w.amax()) if gscale is None else gscale
        module.weight_global_scale.data.copy_(gscale)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=gscale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(0.5)  # a calibrated activation scale: a serving kernel's, not read
    if hasattr(module, "input_global_scale"):  # W4A4 NVFP4's calibrated one (made up: no data here)
        module.input_global_scale.data.fill_(672.0)


def make_ct_folder(src: Path, dst: Path, scheme: str | dict, dtype: torch.dtype = torch.bfloat16,
                   ignore: tuple[str, ...] = ("lm_head",), max_shard_size: str | None = None,
                   fused: bool = True) -> None:
    """``src`` (a transformers folder) quantized by compressed-tensors under ``scheme`` into ``dst``
    (one file, or files of ``max_shard_size`` and their index); ``fused=False``: each NVFP4
    weight's global scale its own (compressed-tensors without llm-compressor's fused observers)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": ct_scheme(scheme)},
                                                        ignore=list(ignore)))
    with torch.no_grad():
        quantized = {name: module for name, module in model.named_modules()
                     if getattr(module, "quantization_scheme", None) is not None}
        gscales = fused_global_scales({name: m.weight.data for name, m in quantized.items()
                                       if hasattr(m, "weight_global_scale")}) if fused else {}
        for name, module in quantized.items():
            _observe(module, gscales.get(name))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    compressor.update_config(str(dst))


def ct_dequantized(folder: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model transformers loads from a compressed-tensors ``folder`` dequantized
    (compressed-tensors' decompressors), as a state dict."""
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


def make_modelopt_folder(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16,
                         exclude: tuple[str, ...] = ("lm_head",)) -> dict[str, torch.Tensor]:
    """``src`` with every ``*_proj`` weight quantized to NVFP4 by ModelOpt's ``NVFP4QTensor`` (the
    rest in ``dtype``), laid out as ModelOpt's HF export writes it; returns ModelOpt's own
    dequantization of each weight (``NVFP4QTensor.dequantize``) and the rest as stored.

    As ModelOpt's export fuses them (``preprocess_linear_fusion``: the max of the parts' weight
    amax and of their input amax), q/k/v and gate/up share one ``weight_scale_2`` (each part
    quantized under it: :func:`modelopt_fused`) and one ``input_scale``; each fused group's
    ``input_scale`` is its own made-up value (a calibration's, which nothing here recomputes)."""
    import fnmatch

    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    stored, model = {}, {}
    chosen = {key.removesuffix(".weight"): w.to(dtype) for key, w in tensors.items() if key.endswith("_proj.weight")
              and not any(fnmatch.fnmatchcase(key.removesuffix(".weight"), p) for p in exclude)}
    for key, w in sorted(tensors.items()):
        if key.removesuffix(".weight") not in chosen:
            stored[key] = model[key] = w.to(dtype)
    for n, modules in enumerate(fused_groups(chosen)):
        stored.update(modelopt_fused({m: chosen[m] for m in modules}))
        for m in modules:
            stored[m + ".input_scale"] = torch.tensor(0.25 + n / 64)
            q = NVFP4QTensor(chosen[m].shape, dtype, stored[m + ".weight"])
            model[m + ".weight"] = q.dequantize(dtype=dtype, scale=stored[m + ".weight_scale"],
                                                double_scale=stored[m + ".weight_scale_2"], block_sizes={-1: 16})
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": list(exclude)}}
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    config = json.loads((src / "config.json").read_text())
    config.update(dtype=str(dtype).removeprefix("torch."), quantization_config=convert_hf_quant_config_format(hf_quant))
    (dst / "config.json").write_text(json.dumps(config, indent=4))
    return model


def compress_folder_ct(src: Path, dst: Path, scheme: str, quantized: str, ignore: list[str],
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``src``'s weights whose module name fully matches the pattern ``quantized`` compressed by
    compressed-tensors' own compressor of ``scheme``'s format (a scheme of scales by group), per
    module as its model-free path does (a model whose experts transformers fuses has no ``Linear``
    per expert to quantize; an NVFP4 scheme's global scales fused as llm-compressor's model-free path
    fuses them, :func:`fused_global_scales`), the
    rest in ``dtype``, the config as compressed-tensors writes it with ``ignore``; returns
    compressed-tensors' own decompression of every weight (the model the folder encodes)."""
    import re

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    q_scheme = ct_scheme(scheme)
    args = q_scheme.weights
    fmt = (CompressionFormat.pack_quantized if args.type == "int" else CompressionFormat.nvfp4_pack_quantized
           if args.strategy == "tensor_group" else CompressionFormat.float_quantized)
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    chosen = {key.removesuffix(".weight"): w.to(dtype) for key, w in tensors.items()
              if key.endswith(".weight") and re.fullmatch(quantized, key.removesuffix(".weight"))}
    gscales = fused_global_scales(chosen, args.group_size) if args.strategy == "tensor_group" else {}
    stored, model = {}, {}
    for key, w in sorted(tensors.items()):
        module = key.removesuffix(".weight")
        if module not in chosen or not key.endswith(".weight"):
            stored[key] = model[key] = w.to(dtype)
            continue
        w = chosen[module]
        grouped = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        gscale = gscales.get(module)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=gscale)
        state = {"weight": w, "weight_scale": scale.to(dtype), "weight_zero_point": zero}
        if gscale is not None:
            state["weight_global_scale"] = gscale
        local = compressor.compress(state, q_scheme)
        stored.update({f"{module}.{name}": t for name, t in local.items()})
        model[key] = compressor.decompress(local, q_scheme)["weight"]
    dst.mkdir(parents=True)
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    q_config = QuantizationConfig(config_groups={"group_0": q_scheme}, ignore=ignore, format=fmt.value,
                                  quantization_status=QuantizationStatus.COMPRESSED)
    config = json.loads((src / "config.json").read_text())
    config.update(dtype=str(dtype).removeprefix("torch."),
                  quantization_config={"quant_method": "compressed-tensors", **q_config.model_dump()})
    (dst / "config.json").write_text(json.dumps(config, default=str))
    return model


def ct_compress_weight(spec: str | dict, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compression of one weight ``w`` ``[out, in]`` under ``spec`` (a name
    of :data:`SCHEMES` or ``QuantizationArgs`` keyword arguments): a min-max observer's qparams
    (``calculate_qparams`` of the weight's own range by its strategy), then its format's
    compressor, as llm-compressor's save path runs them; the stored tensors by parameter name."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization.utils import calculate_qparams

    q_scheme = ct_scheme(spec)
    args = q_scheme.weights
    fmt = CompressionFormat.pack_quantized if args.type == "int" else CompressionFormat.float_quantized
    if args.strategy == "group":
        grouped = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    return compressor.compress({"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}, q_scheme)


def ct_compress_fused(spec: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compression of the NVFP4 weights ``weights`` (module name ->
    ``[out, in]``) under ``spec`` (a name of :data:`SCHEMES`), each fused group under the global
    scale llm-compressor's fused observers give it (:func:`fused_global_scales`), as
    :func:`compress_folder_ct` compresses them; the stored tensors by their full names."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization.utils import calculate_qparams

    q_scheme = ct_scheme(spec)
    args = q_scheme.weights
    compressor = BaseCompressor.get_value_from_registry(CompressionFormat.nvfp4_pack_quantized.value)
    gscales = fused_global_scales(weights, args.group_size)
    out = {}
    for module, w in weights.items():
        grouped = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=gscales[module])
        state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero,
                 "weight_global_scale": gscales[module]}
        out.update({f"{module}.{name}": t for name, t in compressor.compress(state, q_scheme).items()})
    return out


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files."""
    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ in dtype, shape or any bit (``-0.0`` is not ``0.0``); the key
    sets must agree."""
    assert sorted(got) == sorted(want)
    return sorted(k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
                  or not torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)))
