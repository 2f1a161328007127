"""Folders quantized by compressed-tensors (``quantization_config.quant_method
"compressed-tensors"``, as llm-compressor writes them): which weights are quantized how, read as the
model's.

``quantization_config`` holds ``config_groups`` (each a ``weights`` scheme, a ``format`` and the
``targets`` it applies to: module names, ``re:`` patterns matched from the name's start, or class
names such as ``Linear``), a top-level ``format`` and an ``ignore`` list (kept in the model's
dtype). A module's group is the one whose targets name it (exactly or by pattern), else the one
whose targets are class names (a folder holds no classes; two such groups are refused). What is
stored says which modules are quantized; the config says how:

========================  ===================================================  ===============================
format                    stored beside ``X``'s other tensors                  arithmetic
========================  ===================================================  ===============================
``pack-quantized``        ``weight_packed`` int32, ``weight_scale``,           :mod:`reshard.core.int_packed`
                          ``weight_shape`` (``weight_zero_point``,
                          ``weight_g_idx``)
``float-quantized``       ``weight`` float8_e4m3fn, ``weight_scale``           :mod:`reshard.core.fp8_scaled`
``nvfp4-pack-quantized``  ``weight_packed`` uint8, ``weight_scale`` e4m3,      :mod:`reshard.core.nvfp4`
                          ``weight_global_scale``
========================  ===================================================  ===============================

Weight-only FP8 is ``naive-quantized`` there (the same layout and decompressor). Activation and
KV-cache scales (``input_scale``, ``input_global_scale``, ``k_scale``, ...) are a
serving kernel's; the dequantized model computes without them, so they are not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core import fp8_scaled, int_packed, nvfp4
from reshard.core.errors import CheckpointFormatError
from reshard.core.lazy import LazyTensor, RowsDecoded, materialized, read_rows

METHOD = "compressed-tensors"
PACK, FLOAT, NVFP4 = "pack-quantized", "float-quantized", "nvfp4-pack-quantized"
FORMATS = (PACK, FLOAT, NVFP4)
#: What compressed-tensors names the float-quantized layout of weights whose activations are not
#: quantized (its compressor for both is one: ``q.to(sd) * scale``).
NAIVE = "naive-quantized"
#: A quantized module's tensors besides its codes, which the dequantized weight replaces.
WEIGHT_PARAMS = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale")
#: Calibration scales of activations and of the KV cache: a serving kernel's, not the model's.
ACTIVATION_PARAMS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                     "k_scale", "v_scale", "k_zero_point", "v_zero_point")
_HINT = "compressed-tensors writes config_groups of weights schemes, as llm-compressor saves them"


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization."""

    name: str
    format: str
    targets: tuple[str, ...]
    num_bits: int
    type: str
    strategy: str
    symmetric: bool
    group_size: int | None
    block: tuple[int, int] | None


@dataclass(frozen=True)
class Settings:
    """A folder's ``quantization_config``, as read."""

    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]

    def scheme_of(self, module: str, where: str) -> Scheme:
        """The scheme quantizing ``module`` (see the module docstring), or a refusal naming it."""
        named = [s for s in self.schemes if any(not class_name(t) and matches(module, t) for t in s.targets)]
        classes = [s for s in self.schemes if any(class_name(t) for t in s.targets)]
        found = named[:1] or classes
        if len(found) != 1:
            why = "no config group targets it" if not found else \
                f"config groups {', '.join(s.name for s in found)} could each target it"
            raise CheckpointFormatError(f"{module} is stored quantized but {why}", culprit=where,
                                        hint="the config.json does not belong to these weights; re-copy the folder")
        return found[0]


def class_name(target: str) -> bool:
    """A target naming a module class (``Linear``), not a module (dotted) or a pattern (``re:``)."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def matches(name: str, target: str) -> bool:
    """compressed-tensors' name match: ``re:`` a pattern matched from the start, else equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_config(config: Mapping[str, Any], where: str) -> Settings:
    """The schemes of a compressed-tensors ``config.json`` (``config``); what reshard does not read
    (another format, activation-ordered groups it cannot place, a width that straddles words) is
    refused by name."""
    qc = config["quantization_config"]
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointFormatError(f"quantization_config.config_groups is {groups!r}", culprit=where, hint=_HINT)
    top = qc.get("format")
    schemes = []
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, Mapping) else None
        at = f"quantization_config.config_groups.{name}"
        if not isinstance(w, Mapping):
            raise CheckpointFormatError(f"{at}.weights is {w!r}", culprit=where,
                                        hint="reshard reads weight quantization (activation-only groups "
                                             "leave the weights in the model's dtype; drop the group)")
        fmt = g.get("format") or top
        if fmt == NAIVE and w.get("type") == "float":  # weight-only FP8: the float-quantized layout
            fmt = FLOAT
        if fmt not in FORMATS:
            raise CheckpointFormatError(f"{at} has format {fmt!r}, which reshard does not read", culprit=where,
                                        hint=f"reshard reads compressed-tensors {', '.join(FORMATS)}; "
                                             "dequantize others with compressed-tensors first")
        targets = g.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise CheckpointFormatError(f"{at}.targets is {targets!r}", culprit=where, hint=_HINT)
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy") or "tensor"
        group, block = w.get("group_size"), w.get("block_structure")
        want = {PACK: ("int", ("group", "channel", "tensor")),
                FLOAT: ("float", ("tensor", "channel", "group", "block")), NVFP4: ("float", ("tensor_group",))}[fmt]
        if kind != want[0] or strategy not in want[1] or not _int(bits):
            raise CheckpointFormatError(f"{at}.weights is {kind!r} {bits!r}-bit by {strategy!r} in {fmt}",
                                        culprit=where, hint=f"{fmt} holds {want[0]} weights by "
                                                            f"{' / '.join(want[1])}")
        if (fmt == PACK and (bits not in (1, 2, 4, 8))) or (fmt == FLOAT and bits != 8) or (fmt == NVFP4 and bits != 4):
            raise CheckpointFormatError(f"{at}.weights.num_bits is {bits}", culprit=where,
                                        hint="reshard reads pack-quantized widths that divide 32, FP8 and NVFP4")
        if strategy in ("group", "tensor_group") and not (_int(group) and group > 0):
            raise CheckpointFormatError(f"{at}.weights.group_size is {group!r}", culprit=where, hint=_HINT)
        if fmt == NVFP4 and group != nvfp4.GROUP:
            raise CheckpointFormatError(f"{at}.weights.group_size is {group}, not {nvfp4.GROUP}", culprit=where,
                                        hint="NVFP4 scales 16 values a row each")
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2 and all(_int(b) and b > 0
                                                                                        for b in block)):
            raise CheckpointFormatError(f"{at}.weights.block_structure is {block!r}", culprit=where, hint=_HINT)
        symmetric = w.get("symmetric", True) is not False
        if fmt != PACK and not symmetric:
            raise CheckpointFormatError(f"{at}.weights is asymmetric {fmt}", culprit=where,
                                        hint="compressed-tensors writes float weights symmetric only")
        schemes.append(Scheme(str(name), fmt, tuple(targets), bits, kind, strategy, symmetric,
                              group if strategy in ("group", "tensor_group") else None,
                              tuple(block) if strategy == "block" else None))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise CheckpointFormatError(f"quantization_config.ignore is {ignore!r}", culprit=where, hint=_HINT)
    return Settings(tuple(schemes), tuple(ignore))


def summary(settings: Settings) -> dict[str, Any]:
    """How the weights are stored, for ``inspect`` and a run's record."""
    return {"method": METHOD, "groups": [
        {"format": s.format, "weights": f"{s.type}{s.num_bits}", "strategy": s.strategy,
         **({"group": s.group_size} if s.group_size else {}), **({"block": list(s.block)} if s.block else {}),
         **({} if s.symmetric else {"zero_point": True}), "targets": list(s.targets)} for s in settings.schemes],
        "ignore": list(settings.ignore)}


def encoded(key: str, dtype: torch.dtype) -> bool:
    """Is ``key`` a weight's codes?"""
    return key.endswith(".weight_packed") or (key.endswith(".weight") and dtype == fp8_scaled.E4M3)


def refuse_unannounced(tensors: Mapping[str, Any], where: str) -> None:
    """Refuse packed codes in a folder whose ``config.json`` declares no quantization (read as
    they are, they would be another model)."""
    key = next((k for k in tensors if k.endswith(".weight_packed")), None)
    if key is not None:
        raise refusal(f"{key} holds packed codes but config.json declares no quantization_config", where,
                      hint="a compressed-tensors release names its scheme in config.json's quantization_config "
                           "(quant_method 'compressed-tensors'); re-copy config.json")


def _named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refusal(what: str, where: str, hint: str = "the tensors do not belong to this quantization_config; re-copy "
                                               "the folder") -> CheckpointFormatError:
    """The one-line refusal of a quantized folder's tensor ``what`` names (``where``: the folder)."""
    return CheckpointFormatError(what, culprit=where, hint=hint)


def nvfp4_weight(stored: str, codes: Any, scale_key: str, scale: Any, second_key: str, second: Any,
                 dequantize: Callable[..., torch.Tensor], dtype: torch.dtype, where: str) -> RowsDecoded:
    """The weight whose NVFP4 codes ``stored`` holds (``[out, in/2]``, two per byte), with its e4m3
    scales per 16 values and one float32 second-level scale (compressed-tensors' global scale,
    ModelOpt's ``weight_scale_2``), all checked first; decoded a band of rows at a time by
    ``dequantize(codes, scales, second, dtype)``, the variant's own arithmetic (:mod:`nvfp4`)."""
    out, half = codes.shape
    if (2 * half) % nvfp4.GROUP:
        raise refusal(f"{stored} holds rows of {2 * half} values, not a multiple of {nvfp4.GROUP}", where)
    check_tensor(scale_key, scale, fp8_scaled.E4M3, (out, 2 * half // nvfp4.GROUP), where)
    if second is None or second.dtype != torch.float32 or int(torch.tensor(second.shape).prod()) != 1:
        raise refusal(f"{second_key} is " + ("missing" if second is None else
                      f"{_named(second.dtype)} {list(second.shape)}, not one float32"), where)
    g = materialized(second)

    def decode(first: int, n: int) -> torch.Tensor:
        return dequantize(read_rows(codes, first, n), read_rows(scale, first, n), g, dtype)

    return RowsDecoded((out, 2 * half), dtype, decode, stored)


def check_tensor(key: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], where: str) -> None:
    """Refuse ``key`` unless it is present, ``dtype`` and ``shape`` (a scale of the wrong shape is
    another weight's, or another layout's)."""
    if t is None:
        raise refusal(f"{key} is missing", where)
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise refusal(f"{key} is {_named(t.dtype)} {list(t.shape)}, not {_named(dtype)} {list(shape)}", where)


def dequantized_tensors(tensors: Mapping[str, Any], settings: Settings, dtype: torch.dtype,
                        where: str) -> dict[str, Any]:
    """The folder's ``tensors`` with each quantized module's ``weight`` a lazy ``dtype`` tensor and
    its quantization tensors gone, every module checked (shapes, dtypes, its scheme) before any
    weight is read."""
    modules = {}
    for key, t in tensors.items():
        module, _, param = key.rpartition(".")
        if param == "weight_packed" or (param == "weight" and t.dtype == fp8_scaled.E4M3):
            if module in modules or (param == "weight_packed" and f"{module}.weight" in tensors):
                raise refusal(f"{module} is stored both as {module}.weight and as {module}.weight_packed", where)
            modules[module] = t
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        module, _, param = key.rpartition(".")
        if module in modules and param in (*WEIGHT_PARAMS, "weight_packed", "weight"):
            continue
        if param in ACTIVATION_PARAMS:
            continue
        if param in WEIGHT_PARAMS:
            raise refusal(f"{key} belongs to no quantized weight ({module}.weight_packed or an FP8 "
                          f"{module}.weight is absent)", where)
        out[key] = t
    for module, codes in modules.items():
        if any(matches(module, t) for t in settings.ignore):
            raise refusal(f"{module} is stored quantized but quantization_config.ignore lists it", where)
        scheme = settings.scheme_of(module, where)
        out[f"{module}.weight"] = _weight(module, codes, scheme, tensors, dtype, where)
    return out


def _weight(module: str, codes: Any, scheme: Scheme, tensors: Mapping[str, Any], dtype: torch.dtype,
            where: str) -> LazyTensor:
    """One module's weight as a lazy tensor, its stored tensors checked first."""
    packed = f"{module}.weight_packed" in tensors
    expected = {PACK: (True, torch.int32), NVFP4: (True, torch.uint8), FLOAT: (False, fp8_scaled.E4M3)}[scheme.format]
    stored = f"{module}.weight_packed" if packed else f"{module}.weight"
    if (packed, codes.dtype) != expected or len(codes.shape) != 2:
        kind = f"{_named(expected[1])} 2-D {'weight_packed' if expected[0] else 'weight'}"
        raise refusal(f"{stored} is {_named(codes.dtype)} {list(codes.shape)} but config group {scheme.name} "
                      f"stores {scheme.format} ({kind})", where)
    get = tensors.get
    scale = get(f"{module}.weight_scale")
    if scheme.format == PACK:
        return _packed(module, codes, scheme, scale, get, dtype, where)
    if scheme.format == NVFP4:
        return nvfp4_weight(stored, codes, f"{module}.weight_scale", scale, f"{module}.weight_global_scale",
                            get(f"{module}.weight_global_scale"), nvfp4.dequantize_ct, dtype, where)
    out, inp = codes.shape
    if scale is None:
        raise refusal(f"{module}.weight_scale is missing", where)
    if scheme.strategy == "group" and inp % int(scheme.group_size or 1):
        raise refusal(f"{module} has {inp} columns, not a multiple of group_size {scheme.group_size}", where)
    want = fp8_scaled.scale_shape(scheme.strategy, (out, inp), scheme.group_size, scheme.block)
    if tuple(scale.shape) != want and not (scheme.strategy == "tensor" and int(torch.tensor(scale.shape).prod()) == 1):
        raise refusal(f"{module}.weight_scale is {list(scale.shape)}, not {list(want)} ({scheme.strategy} scales of "
                    f"{list(codes.shape)})", where)
    if not scale.dtype.is_floating_point or scale.dtype == fp8_scaled.E4M3:
        raise refusal(f"{module}.weight_scale is {_named(scale.dtype)}", where, hint="FP8 scales are float tensors")
    whole = scheme.strategy in ("tensor", "block")
    s_all = materialized(scale) if whole else None

    def decode_fp8(first: int, n: int) -> torch.Tensor:
        s = s_all if whole else read_rows(scale, first, n)
        band = fp8_scaled.band_scales(s, scheme.strategy, first if whole else 0, n, inp, scheme.block)
        return fp8_scaled.dequantize_rows(read_rows(codes, first, n), band, dtype)

    return RowsDecoded((out, inp), dtype, decode_fp8, stored)


def _packed(module: str, codes: Any, scheme: Scheme, scale: Any, get: Callable[[str], Any], dtype: torch.dtype,
            where: str) -> LazyTensor:
    """A pack-quantized weight (:mod:`reshard.core.int_packed`), checked."""
    shape_t = get(f"{module}.weight_shape")
    if shape_t is None or tuple(shape_t.shape) != (2,) or shape_t.dtype.is_floating_point:
        raise refusal(f"{module}.weight_shape is " + ("missing" if shape_t is None else
                    f"{_named(shape_t.dtype)} {list(shape_t.shape)}, not the 2 integers [out, in]"), where)
    out, inp = (int(v) for v in materialized(shape_t).tolist())
    bits = scheme.num_bits
    want = (out, int_packed.packed_width(inp, bits))
    if tuple(codes.shape) != want:
        raise refusal(f"{module}.weight_packed is {list(codes.shape)}, not {list(want)} ({bits}-bit codes of "
                    f"weight_shape {[out, inp]}, {int_packed.WORD_BITS // bits} a word)", where)
    if scheme.strategy == "group" and inp % int(scheme.group_size or 1):
        raise refusal(f"{module} has {inp} columns, not a multiple of group_size {scheme.group_size}", where)
    if scale is None:
        raise refusal(f"{module}.weight_scale is missing", where)
    s_shape = int_packed.scale_shape(scheme.strategy, (out, inp), scheme.group_size)
    if tuple(scale.shape) != s_shape or not scale.dtype.is_floating_point or scale.dtype == fp8_scaled.E4M3:
        raise refusal(f"{module}.weight_scale is {_named(scale.dtype)} {list(scale.shape)}, not a float "
                    f"{list(s_shape)} ({scheme.strategy} scales of {[out, inp]})", where)
    zp = get(f"{module}.weight_zero_point")
    if scheme.symmetric and zp is not None:
        raise refusal(f"{module}.weight_zero_point is stored but config group {scheme.name} is symmetric", where)
    groups = s_shape[-1] if len(s_shape) == 2 else 1
    if not scheme.symmetric:
        if scheme.strategy == "tensor":
            raise refusal(f"{module} is asymmetric by tensor", where,
                          hint="reshard reads asymmetric INT weights by group or channel, as compressed-tensors "
                               "packs them")
        zp_shape = (int_packed.packed_width(out, bits), groups)
        check_tensor(f"{module}.weight_zero_point", zp, torch.int32, zp_shape, where)
    g_idx = get(f"{module}.weight_g_idx")
    if g_idx is not None:
        if (tuple(g_idx.shape) != (inp,) or g_idx.dtype.is_floating_point or scheme.strategy != "group"
                or not int_packed.identity_groups(materialized(g_idx), int(scheme.group_size or 1))):
            raise refusal(f"{module}.weight_g_idx places columns in groups out of order (activation order)", where,
                        hint="reshard reads g_idx only as the plain order k // group_size; dequantize "
                             "activation-ordered weights with compressed-tensors first")
    s_tensor = materialized(scale) if scheme.strategy == "tensor" else None

    def decode(first: int, n: int) -> torch.Tensor:
        q = int_packed.unpack_rows(read_rows(codes, first, n), bits, inp)
        s = s_tensor.reshape(1, 1).expand(n, 1) if s_tensor is not None else read_rows(scale, first, n)
        z = None
        if zp is not None:
            lo, k = int_packed.zero_point_words(first, n, bits)
            z = int_packed.unpack_columns(read_rows(zp, lo, k), bits, out, first, n)
        return int_packed.dequantize_rows(q, s, z, dtype)

    return RowsDecoded((out, inp), dtype, decode, f"{module}.weight_packed")
