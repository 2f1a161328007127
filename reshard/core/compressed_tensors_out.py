"""Writing compressed-tensors' formats (``--quantize w4a16``, ``fp8-channel``, ``nvfp4``): which
tensors a quantized linear weight ``X.weight`` ``[out, in]`` becomes, its codes and scales made a
band of rows at a time, and the ``quantization_config`` that announces them, as compressed-tensors
(llm-compressor's save path) writes them. The arithmetic is the codecs'
(:func:`reshard.core.int_packed.quantize_symmetric`, :func:`reshard.core.fp8_scaled.quantize_channel`,
:func:`reshard.core.nvfp4.quantize_ct`); the names and the config are what
:mod:`reshard.core.compressed_tensors` reads back.

==================  ======================  ==============================================================
``--quantize``      format                  tensors of ``X`` (``d``: the weight's dtype)
==================  ======================  ==============================================================
``w4a16``           ``pack-quantized``      ``X.weight_packed`` int32 ``[out, in/8]``, ``X.weight_scale``
                    (int4, symmetric,       ``d`` ``[out, in/group]``, ``X.weight_shape`` int64 ``[2]``
                    by group)
``fp8-channel``     ``naive-quantized``     ``X.weight`` float8_e4m3fn ``[out, in]``, ``X.weight_scale``
                    (e4m3, by channel)      ``d`` ``[out, 1]``
``nvfp4``           ``nvfp4-pack-quantized``  ``X.weight_packed`` uint8 ``[out, in/2]``, ``X.weight_scale``
                    (e2m1, an e4m3 scale    float8_e4m3fn ``[out, in/16]``, ``X.weight_global_scale``
                    per 16 inputs and a     float32 ``[1]``
                    float32 one per tensor)
==================  ======================  ==============================================================

(compressed-tensors names weight-only FP8 ``naive-quantized``: ``float-quantized``'s layout.)

``nvfp4`` is weight-only (compressed-tensors' ``NVFP4A16`` preset): NVFP4 activations need an
``input_global_scale`` calibrated on data, which a conversion has none of, so no activation scale is
written. Its global scale is one per *group of fused layers* (:func:`fused_with`; the groups are the
architecture's, :attr:`reshard.models.hf_architectures.HFArchitecture.fused_layers`): llm-compressor's fused
observers give q/k/v, and gate/up, the scale of their joint absolute maximum, because vLLM runs each
group as one matmul with one scale. A writer finds it with :meth:`Encoding.global_scale` over every
tensor of the group before it encodes any band of them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core import fp8_scaled, int_packed, nvfp4
from reshard.core.compressed_tensors import METHOD, NAIVE, NVFP4, PACK

W4A16, FP8_CHANNEL, NVFP4_SCHEME = "w4a16", "fp8-channel", "nvfp4"
#: ``--quantize`` values written in compressed-tensors' formats.
SCHEMES = (W4A16, FP8_CHANNEL, NVFP4_SCHEME)
#: A ModelOpt NVFP4 release's weights re-applied by ``--quantize like-source`` (the codes and scales
#: laid out as ModelOpt's export writes them, :func:`reshard.core.nvfp4.quantize_modelopt`).
MODELOPT_NVFP4 = "modelopt-nvfp4"
#: ``--group-size`` when not given: Kimi-K2-Thinking's and llm-compressor's W4A16 preset's.
DEFAULT_GROUP = 32
#: Bits of a ``w4a16`` code.
INT_BITS = 4
#: The weight dtypes the quantizers take (compressed-tensors' scale dtypes).
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Encoding:
    """One compressed-tensors weight encoding: a ``--quantize`` of compressed-tensors' (``scheme``)
    and its group size, or, for ``--quantize like-source`` (:mod:`reshard.core.like_source`), a
    release's scheme: ``scheme`` then :data:`PACK`, :data:`FLOAT` or :data:`NVFP4` (the release's
    format), with its code width, strategy and the dtypes the release stores scales and shapes in.

    ===========  ============  ==========  ===========================================================
    ``scheme``   ``bits``      strategy    codes, scales
    ===========  ============  ==========  ===========================================================
    ``w4a16``    4             group       packed int32, ``[out, in/group]``
    ``PACK``     4 or 8        group,      packed int32, ``[out, in/group]`` or ``[out, 1]`` (channel:
                               channel     a group of the whole row)
    ``fp8-ch..`` 8             channel     e4m3, ``[out, 1]``
    ``FLOAT``    8             channel,    e4m3, ``[out, 1]`` or ``[1]`` (tensor: one scale of the
                               tensor      whole weight, :meth:`tensor_scale`)
    ``nvfp4``,   4 (e2m1)      tensor_     uint8 two codes a byte, e4m3 ``[out, in/16]`` and a float32
    ``NVFP4``                  group       global scale ``[1]`` of the fused group (:meth:`global_scale`)
    ``modelopt`` 4 (e2m1)      tensor_     ``X.weight`` uint8 two codes a byte, e4m3 ``[out, in/16]``,
    ``-nvfp4``                 group       ``weight_scale_2`` float32 ``[]`` of the fused group
    ===========  ============  ==========  ===========================================================

    ``activation``: the release stores each layer's calibrated activation scale after the weight's
    (compressed-tensors' ``input_global_scale`` ``[1]``, ModelOpt's ``input_scale`` ``[]``, both
    float32; :meth:`activation_scale_name`), which ``--quantize like-source`` copies from it.
    """

    scheme: str
    group: int | None = None
    bits: int | None = None
    strategy: str | None = None
    #: The dtype scales are stored in (None: the weight's, as compressed-tensors gives them).
    scale_dtype: torch.dtype | None = None
    #: The dtype of ``weight_shape`` (None: int64, as compressed-tensors 0.20 stores it).
    shape_dtype: torch.dtype | None = None
    #: Each layer carries the release's calibrated activation scale (W4A4 NVFP4).
    activation: bool = False

    @property
    def fp4(self) -> bool:
        """NVFP4 codes (``--quantize nvfp4``, or a release's ``nvfp4-pack-quantized``)."""
        return self.scheme in (NVFP4_SCHEME, NVFP4, MODELOPT_NVFP4)

    @property
    def packed(self) -> bool:
        """Integer codes packed into int32 words (else e4m3 codes)."""
        return self.scheme in (W4A16, PACK)

    @property
    def num_bits(self) -> int:
        return self.bits or (INT_BITS if self.packed else 8)

    @property
    def by(self) -> str:
        """The strategy: ``group`` for packed codes, ``channel`` for FP8, unless given."""
        return self.strategy or ("group" if self.packed else "channel")

    def tensors(self, name: str, shape: Sequence[int], dtype: torch.dtype
                ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of the tensors ``name`` (``X.weight``, ``[out, in]``) is stored
        as: the codes first, then the scales (then ``weight_shape``); see the module table."""
        out, inp = shape
        module = name.removesuffix(".weight")
        sd = self.scale_dtype or dtype
        act = self.activation_scale_name(name)
        acts = [] if act is None else [(act, torch.float32, () if self.scheme == MODELOPT_NVFP4 else (1,))]
        if self.scheme == MODELOPT_NVFP4:
            return [(name, torch.uint8, (out, inp // 2)),
                    (module + ".weight_scale", torch.float8_e4m3fn, (out, inp // nvfp4.GROUP)),
                    (module + ".weight_scale_2", torch.float32, ()), *acts]
        if self.fp4:
            return [(module + ".weight_packed", torch.uint8, (out, inp // 2)),
                    (module + ".weight_scale", torch.float8_e4m3fn, (out, inp // nvfp4.GROUP)),
                    (module + ".weight_global_scale", torch.float32, (1,)), *acts]
        if self.packed:
            groups = inp // self.group_size if self.by == "group" else 1
            return [(module + ".weight_packed", torch.int32, (out, int_packed.packed_width(inp, self.num_bits))),
                    (module + ".weight_scale", sd, (out, groups)),
                    (module + ".weight_shape", self.shape_dtype or torch.int64, (2,))]
        return [(name, fp8_scaled.E4M3, (out, inp)), (module + ".weight_scale", sd,
                                                      (1,) if self.by == "tensor" else (out, 1))]

    @property
    def group_size(self) -> int:
        return nvfp4.GROUP if self.fp4 else self.group or DEFAULT_GROUP

    @property
    def global_scaled(self) -> bool:
        """Does each weight carry a global scale, found from every tensor of its fused group
        (:meth:`global_scale`) before any band is encoded?"""
        return self.fp4

    def global_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """``X.weight_global_scale`` (ModelOpt's ``X.weight_scale_2``) of the weights of one fused
        group whose absolute maximum, in their dtype, is ``amax`` (the :func:`torch.maximum` of
        :func:`reshard.core.nvfp4.absmax` over their bands)."""
        if self.scheme == MODELOPT_NVFP4:
            return nvfp4.scale_2_modelopt(amax)
        return nvfp4.global_scale_ct(amax)

    def activation_scale_name(self, name: str) -> str | None:
        """The release's tensor holding weight ``name``'s calibrated activation scale (copied
        from the release, never computed), None where the encoding has none."""
        if not self.activation:
            return None
        module = name.removesuffix(".weight")
        return module + (".input_scale" if self.scheme == MODELOPT_NVFP4 else ".input_global_scale")

    def refusal(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[str, str] | None:
        """``(what, fix)``: what keeps a ``[out, in]`` weight of ``dtype`` from this encoding, and
        how to do without it; else None."""
        if dtype not in FLOATS:
            return (f"is {dtype}: compressed-tensors quantizes float16, bfloat16 or float32 weights",
                    "drop --quantize")
        if self.fp4 and shape[-1] % nvfp4.GROUP:
            return (f"has {shape[-1]} inputs, not a multiple of NVFP4's group of {nvfp4.GROUP}",
                    "drop --quantize, or --quantize w4a16 with a --group-size that divides it")
        if self.packed:
            inp = shape[-1]
            if self.by == "group" and inp % self.group_size:
                return (f"has {inp} inputs, not a multiple of the group size {self.group_size}",
                        "give --group-size a divisor of every linear layer's inputs, or drop --quantize")
            if inp * self.num_bits % int_packed.WORD_BITS:
                return (f"has {inp} inputs, which do not fill whole int32 words of int{self.num_bits} codes",
                        "drop --quantize")
        return None

    @property
    def surveyed(self) -> bool:
        """Is a weight's every band seen (:meth:`band_stat`) before any is encoded: for NVFP4's
        global scale of the fused group, or the ``tensor`` strategy's one scale of the weight?"""
        return self.global_scaled or self.tensor_scaled

    @property
    def tensor_scaled(self) -> bool:
        """FP8 under the ``tensor`` strategy: every band coded with the whole weight's one scale."""
        return not self.packed and self.by == "tensor"

    def band_stat(self, band: torch.Tensor) -> torch.Tensor:
        """What a :attr:`surveyed` encoding needs of ``band``, combined over bands (and over a fused
        group's weights) by :func:`torch.maximum`: NVFP4's absolute maximum (0-dim); the ``tensor``
        strategy's ``[-min, max]``, from which :meth:`tensor_scale` makes the weight's scale."""
        if self.global_scaled:
            return nvfp4.absmax(band)
        return torch.stack((band.amin().neg(), band.amax()))

    def tensor_scale(self, stat: torch.Tensor | None) -> torch.Tensor | None:
        """The one scale of a whole weight under the ``tensor`` strategy, from its bands'
        :meth:`band_stat` (the codes of every band are made with it, :meth:`encode_rows`), else
        None: the other strategies scale rows alone (NVFP4's global scale is its fused group's,
        :meth:`global_scale`)."""
        if not self.tensor_scaled or stat is None:
            return None
        return fp8_scaled.range_scale(stat[0].neg().reshape(1), stat[1].reshape(1))

    def encode_rows(self, w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)`` of rows ``w`` ``[n, in]`` as stored (see the module table); ``scale``:
        the whole weight's (:meth:`tensor_scale`) under the ``tensor`` strategy, the fused group's
        global scale (:meth:`global_scale`) for an encoding that has one."""
        if self.global_scaled:
            if scale is None:
                raise TypeError("nvfp4 encodes rows under their fused group's global scale; none was given")
            return nvfp4.quantize_modelopt(w, scale) if self.scheme == MODELOPT_NVFP4 else nvfp4.quantize_ct(w, scale)
        if self.packed:
            group = self.group_size if self.by == "group" else w.shape[1]
            codes, s = int_packed.quantize_symmetric(w, self.num_bits, group)
            return int_packed.pack_rows(codes, self.num_bits), s
        if scale is not None:
            return fp8_scaled.quantize_with(w, scale), scale
        return fp8_scaled.quantize_channel(w)

    def stored_bytes(self, elements: int, itemsize: int) -> int:
        """About the bytes a weight of ``elements`` values of ``itemsize`` bytes is stored in: exact
        for ``w4a16`` and ``nvfp4``; for ``fp8-channel`` the codes (its scales, a value a row, are
        left out: the rows are not known from the size)."""
        if self.scheme == W4A16:
            return elements * INT_BITS // 8 + elements // self.group_size * itemsize + 16
        if self.fp4:
            return elements // 2 + elements // nvfp4.GROUP + 4
        return elements

    def quantization_config(self, ignore: Sequence[str]) -> dict[str, Any]:
        """``config.json``'s ``quantization_config`` as compressed-tensors' ``update_config``
        writes it for a weight-only scheme targeting ``Linear`` layers (less its ``version``: the
        writer is not compressed-tensors), ``ignore``: the modules left in the model's dtype."""
        if self.scheme == W4A16:
            fmt, weights = PACK, {"num_bits": INT_BITS, "type": "int", "symmetric": True,
                                  "group_size": self.group_size, "strategy": "group", "dynamic": False}
        elif self.scheme == NVFP4_SCHEME:  # the NVFP4A16 preset's weights
            fmt, weights = NVFP4, {"num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.GROUP,
                                   "strategy": "tensor_group", "dynamic": False,
                                   "scale_dtype": str(torch.float8_e4m3fn)}
        else:
            fmt, weights = NAIVE, {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                   "strategy": "channel", "dynamic": False}
        return {"quant_method": METHOD, "format": fmt, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": fmt}},
                "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
                "moe_sparsity_config": None, "sparsity_config": {}, "transform_config": {}}


def fused_with(module: str, present: Collection[str], groups: Sequence[Sequence[str]]) -> list[str]:
    """The modules of ``present`` that share ``module``'s NVFP4 global scale, ``module`` among
    them: the group of ``groups`` (leaf names of the layers a serving stack runs as one matmul) its
    leaf name is in, where its parent holds the whole group (llm-compressor fuses only a complete
    one); else ``[module]``."""
    parent, _, leaf = module.rpartition(".")
    prefix = parent + "." if parent else ""
    for group in groups:
        if leaf in group and all(prefix + g in present for g in group):
            return [prefix + g for g in group]
    return [module]


def shape_tensor(shape: Sequence[int]) -> torch.Tensor:
    """``X.weight_shape``: ``[out, in]`` int64, as compressed-tensors stores ``torch.tensor(shape)``."""
    return torch.tensor(list(shape), dtype=torch.int64)
