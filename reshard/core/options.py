"""The conversion options: one model, read by the CLI (its flags are made from these fields),
the Prefect flow parameters (``ReshardParams`` extends it) and the core (the planner).

Only these fields change the output bytes (besides the source). ``target_pp`` None keeps the
source's pipeline stages (one stage for an output format without stages); ``target_tp`` None is
only valid for an output format without a per-rank layout (``--to torch_dist``); the model-fact
fields (heads, query groups, SwiGLU, vocabulary) are only needed when the checkpoint's saved
``args`` lack them.

Values are checked here, once, into the error type every front end reports as one line
(:class:`~reshard.core.errors.LayoutError`, naming the flag); what depends on the checkpoint
(divisibility, contradictions with saved ``args``) is the planner's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reshard.core.errors import LayoutError
from reshard.core.source import AUTO


def _opt(default: Any = None, description: str = "", *, metavar: str | None = None, minimum: int | None = None,
         negative: tuple[str, str] | None = None, flag: str | None = None, alone: str | None = None) -> Any:
    """A field with what the CLI needs to make its flag (``metavar``; ``negative``: the flag that
    sets a bool False, and its help; ``alone``: the value of the flag given without one) and the
    JSON-schema bounds a deployment's form shows."""
    extra: dict[str, Any] = {}
    if alone:
        extra["alone"] = alone
    if metavar:
        extra["metavar"] = metavar
    if negative:
        extra["negative_flag"], extra["negative_help"] = negative
    if minimum is not None:
        extra["minimum"] = minimum
    if flag:
        extra["flag"] = flag  # the CLI's name, where the field's own would read otherwise
    return Field(default=default, description=description, json_schema_extra=extra or None)


#: ``--weights``: the module's own tensors, or one of the optimizer's per-parameter states (the fp32
#: master weights, Adam's first and second moments), each read from the ZeRO optimizer files.
WEIGHTS = ("module", "master", "exp_avg", "exp_avg_sq")

#: ``--quantize`` values: DeepSpeed's group-wise int8 (per-rank outputs; ``--quantize`` alone, as
#: before it took a value), DeepSeek's FP8 block scaling, GPT-OSS's MXFP4 and compressed-tensors'
#: INT4 by group, FP8 by channel and weight-only NVFP4 (Hugging Face outputs), and a release's own
#: scheme (``like-source``, with ``--quantize-like``: :mod:`reshard.core.like_source`).
QUANTIZATIONS = ("int8", "fp8", "mxfp4", "w4a16", "fp8-channel", "nvfp4", "like-source")

#: ``--normalization`` and ``--position-embedding-type``: Megatron-LM's choices.
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")

#: Fields that must be positive integers when given.
_POSITIVE = ("target_tp", "target_pp", "target_vpp", "target_first_stage_layers", "target_last_stage_layers",
             "target_ep", "target_etp", "num_heads", "num_query_groups", "vocab_size",
             "make_vocab_size_divisible_by", "groups", "group_size")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: Any, flag: str) -> int:
    """Bytes from ``5GB`` (decimal, as Hugging Face reads it), ``1GiB`` (binary) or a plain number."""
    m = _SIZE_RE.match(str(value)) if not isinstance(value, bool) else None
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if size < 1:
        raise LayoutError(f"{value!r} is not a size", culprit=flag, hint="write e.g. 5GB, 500MB, 2GiB or bytes")
    return size


def flag_of(field: str) -> str:
    """The CLI flag of an option field (``target_tp`` -> ``--target-tp``; a field may name its own)."""
    info = ReshardOptions.model_fields.get(field)  # called once the class exists, never while it is built
    extra = info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}
    return str(extra.get("flag") or "--" + field.replace("_", "-"))


class ReshardOptions(BaseModel):
    """What the user asked for (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_tp: int | None = _opt(None, "tensor-parallel degree of the output (needed unless the output format has "
                                       "no per-rank layout, e.g. --to torch_dist)", metavar="M", minimum=1)
    version: float | None = _opt(None, "override the checkpoint version that decides the QKV layout "
                                       "(0, 1.0, 2.0, 3.0)", metavar="V")
    module_key: str = _opt(AUTO, "state-dict entry holding the module ('auto': exactly one of module/model)",
                           metavar="KEY")
    num_heads: int | None = _opt(None, "attention heads, when the checkpoint has no saved args (needed to split "
                                       "safely)", metavar="H", minimum=1)
    quantize: Literal["int8", "fp8", "mxfp4", "w4a16", "fp8-channel", "nvfp4", "like-source"] | None = _opt(
        None, "int8: DeepSpeed's group-wise int8 of the qkv, dense, h_to_4h, 4h_to_h weights (per-rank outputs; "
              "the flag alone); fp8: e4m3 block-scaled linear weights (--to hf; DeepSeek's format, which vLLM "
              "and transformers load); mxfp4: the stacked experts' weights in MXFP4, the rest as they are "
              "(--to hf; GPT-OSS's release format); w4a16: linear weights int4, symmetric, a scale per "
              "--group-size inputs (--to hf; compressed-tensors' pack-quantized, as Kimi-K2 ships); "
              "fp8-channel: linear weights e4m3, a scale per output row (--to hf; compressed-tensors' "
              "float-quantized); nvfp4: linear weights e2m1, an e4m3 scale per 16 inputs and a global one "
              "shared by q/k/v and by gate/up, weights only (--to hf; compressed-tensors' "
              "nvfp4-pack-quantized); like-source: exactly as the release folder --quantize-like names (--to hf; "
              "unchanged weights keep the release's codes and scales)",
        metavar="{int8,fp8,mxfp4,w4a16,fp8-channel,nvfp4,like-source}", alone="int8")
    quantize_like: str | None = _opt(None, "with --quantize like-source: the quantized release folder (a Hugging "
                                           "Face folder whose config.json, or hf_quant_config.json, declares its "
                                           "quantization) whose scheme, groups, ignore list and config the output "
                                           "takes", metavar="DIR")
    fp8_block: tuple[int, int] | None = _opt(None, "with --quantize fp8: the scale blocks, rows x columns "
                                                   "(default 128x128)", metavar="ROWSxCOLS")
    group_size: int | None = _opt(None, "with --quantize w4a16: inputs per scale (default 32)", metavar="N",
                                  minimum=1)
    bits: int = _opt(8, "quantization bits (1..8, default 8)", minimum=1)
    groups: int = _opt(64, "quantization groups per weight piece (default 64)", minimum=1)
    mlp_extra_grouping: bool = _opt(True, "double the quantization groups for MLP weights (DeepSpeed's default)",
                                    negative=("--no-mlp-extra-grouping", "do not double the groups for MLP weights"))
    target_pp: int | None = _opt(None, "pipeline-parallel stages of the output (default: as the source)",
                                 metavar="P", minimum=1)
    target_vpp: int | None = _opt(None, "virtual pipeline stages per pipeline rank of the output (Megatron-LM's "
                                        "interleaved schedule; default: the source's when the target keeps its PP, "
                                        "else 1)", metavar="V", minimum=1)
    target_first_stage_layers: int | None = _opt(
        None, "layers of the output's first pipeline rank (Megatron-LM's --decoder-first-pipeline-num-layers; the "
              "other ranks split the rest evenly)", metavar="N", minimum=1)
    target_last_stage_layers: int | None = _opt(
        None, "layers of the output's last pipeline rank (Megatron-LM's --decoder-last-pipeline-num-layers)",
        metavar="N", minimum=1)
    target_pipeline_layout: str | None = _opt(
        None, "the output's stages as Megatron-LM's --pipeline-model-parallel-layout string (E embedding, t layer, "
              "L loss, | between stages, virtual stage first), e.g. 'Ett|tt|tt|ttL'", metavar="LAYOUT")
    target_ep: int | None = _opt(None, "expert-parallel ranks of the output, for a mixture-of-experts model "
                                       "(default: as the source)", metavar="E", minimum=1)
    target_etp: int | None = _opt(None, "tensor-parallel degree of the routed experts in the output, dividing the "
                                        "target TP (default: the target TP, or the source's when it splits its "
                                        "experts apart)", metavar="T", minimum=1)
    num_query_groups: int | None = _opt(None, "query groups (GQA), when the saved args lack them (needed to split "
                                              "safely)", metavar="G", minimum=1)
    swiglu: bool | None = _opt(None, "the MLP is gated (SwiGLU), when neither args nor shapes tell",
                               negative=("--no-swiglu", "the MLP is not gated"))
    vocab_size: int | None = _opt(None, "true (unpadded) vocabulary size, for Megatron's exact padding when the "
                                        "saved args lack it", metavar="V", minimum=1)
    make_vocab_size_divisible_by: int | None = _opt(None, "Megatron's vocabulary padding divisor, when the saved "
                                                          "args lack it", metavar="D", minimum=1)
    hf_model_config: dict[str, Any] | None = _opt(
        None, "the model's Hugging Face config.json (any architecture reshard imports; a path, read at once): the "
              "model facts the checkpoint does not save, e.g. a torch_dist written by mbridge or Megatron-Bridge "
              "(a Megatron-Bridge run_config.yaml beside the checkpoint is read without it)", metavar="FILE",
        flag="--model-config")
    normalization: str | None = _opt(None, "LayerNorm or RMSNorm, when the saved args lack it", metavar="NORM")
    position_embedding_type: str | None = _opt(None, "learned_absolute, rope or none, when the saved args lack it",
                                               metavar="TYPE")
    rotary_base: float | None = _opt(None, "the rotary base (rope theta), when the saved args lack it", metavar="BASE")
    norm_epsilon: float | None = _opt(None, "the layer norms' epsilon, when the saved args lack it", metavar="EPS")
    to: str | None = _opt(None, "output format (default: the source's own; torch_dist and Hugging Face sources "
                                "are written as Megatron-LM per-rank files)", metavar="FORMAT")
    merge_adapter: str | None = _opt(None, "a LoRA adapter checkpoint (Megatron-Bridge's PEFT save) to merge "
                                           "into the base's weights, W + alpha/r * B A in float32, cast once",
                                     metavar="LORA_CKPT")
    hf_architecture: str | None = _opt(None, "with --to hf: the transformers class to write (default: the one "
                                             "reshard finds computes the model), e.g. MistralForCausalLM, or a "
                                             "registered plug-in's", metavar="CLASS")

    weights: str = _opt("module", "which weights to convert: 'module' (the copy the model ran with), 'master' "
                                  "(the optimizer's fp32 master weights, from DeepSpeed ZeRO optimizer files), or "
                                  "Adam's moments 'exp_avg' / 'exp_avg_sq' (from the same files)",
                        metavar="WHICH")

    max_shard_size: str | int | None = _opt(None, "largest file of an output written in shards, e.g. 2GB, 500MB, "
                                                  "1GiB or bytes (hf, torch_dist; default 5GB, as Hugging Face)",
                                            metavar="SIZE")

    @field_validator("quantize", mode="before")
    @classmethod
    def _read_quantize(cls, value: Any) -> Any:
        """``True`` (the flag and the API before it took a value, a deployment's ``quantize=true``)
        is int8; ``False`` none."""
        if isinstance(value, bool):
            return "int8" if value else None
        if value is not None and value not in QUANTIZATIONS:
            raise LayoutError(f"{value!r} is not one of {', '.join(QUANTIZATIONS)}", culprit="--quantize")
        return value

    @field_validator("fp8_block", mode="before")
    @classmethod
    def _read_block(cls, value: Any) -> Any:
        """``128x128``, ``128,128``, ``[128, 128]`` or one number for a square block."""
        if value is None:
            return None
        parts: Any = value
        if isinstance(value, str):
            parts = [p for p in re.split(r"[x,\s]+", value.strip().lower()) if p]
        elif isinstance(value, int) and not isinstance(value, bool):
            parts = [value, value]
        try:
            block = tuple(int(p) for p in parts)
        except (TypeError, ValueError):
            block = ()
        if len(block) == 1:
            block = block * 2
        if len(block) != 2 or min(block) < 1:
            raise LayoutError(f"{value!r} is not a block size", culprit="--fp8-block", hint="write e.g. 128x128")
        return block

    @property
    def int8(self) -> bool:
        """DeepSpeed's int8 quantization (the per-rank formats' record of scales) is asked for."""
        return self.quantize == "int8"

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value, flag_of("max_shard_size"))

    @field_validator("hf_model_config", mode="before")
    @classmethod
    def _read_model_config(cls, value: Any) -> Any:
        """A path is read here, once: the options (and so the conversion's identity and the flow's
        parameters) hold the config itself."""
        if value is None or isinstance(value, dict):
            return value
        import json
        import os

        if not isinstance(value, (str, os.PathLike)):
            raise LayoutError(f"{value!r} is neither a config.json path nor its contents",
                              culprit=flag_of("hf_model_config"))
        try:
            data = json.loads(open(value, encoding="utf-8").read())
        except OSError as exc:
            raise LayoutError(f"cannot read: {exc.strerror}", culprit=str(value), hint="check --model-config") from None
        except (ValueError, UnicodeDecodeError):
            raise LayoutError("is not valid JSON", culprit=str(value),
                              hint="--model-config takes a Hugging Face config.json") from None
        if not isinstance(data, dict):
            raise LayoutError("is not a JSON object", culprit=str(value),
                              hint="--model-config takes a Hugging Face config.json")
        return data

    @field_validator("normalization")
    @classmethod
    def _check_normalization(cls, value: str | None) -> str | None:
        if value is not None and value not in NORMALIZATIONS:
            raise LayoutError(f"{value!r} is not one of {', '.join(NORMALIZATIONS)}", culprit="--normalization")
        return value

    @field_validator("position_embedding_type")
    @classmethod
    def _check_positions(cls, value: str | None) -> str | None:
        if value is not None and value not in POSITION_EMBEDDINGS:
            raise LayoutError(f"{value!r} is not one of {', '.join(POSITION_EMBEDDINGS)}",
                              culprit="--position-embedding-type")
        return value

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: str) -> str:
        if value not in WEIGHTS:
            raise LayoutError(f"{value!r} is not one of {', '.join(WEIGHTS)}", culprit=flag_of("weights"))
        return value

    @model_validator(mode="after")
    def _check_values(self) -> ReshardOptions:
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise LayoutError(f"{value!r} must be a positive integer", culprit=flag_of(name),
                                  hint=f"give {flag_of(name)} 1 or more, or leave it out")
        if not 1 <= self.bits <= 8:
            raise LayoutError(f"{self.bits} does not fit int8", culprit="--bits", hint="use 1..8")
        if self.fp8_block is not None and self.quantize != "fp8":
            raise LayoutError("applies only with --quantize fp8", culprit="--fp8-block",
                              hint="add --quantize fp8, or drop it")
        if self.quantize == "fp8":  # the int8 settings would be ignored
            for name in ("bits", "groups", "mlp_extra_grouping"):
                if getattr(self, name) != ReshardOptions.model_fields[name].default:
                    raise LayoutError("sets int8 quantization, not FP8's (whose blocks are --fp8-block)",
                                      culprit=flag_of(name), hint="drop it, or --quantize int8")
        if self.quantize == "mxfp4":  # the int8 settings would be ignored: MXFP4 has one fixed group
            for name in ("bits", "groups", "mlp_extra_grouping"):
                if getattr(self, name) != ReshardOptions.model_fields[name].default:
                    raise LayoutError("sets int8 quantization, not MXFP4's (32 values per scale, fixed)",
                                      culprit=flag_of(name), hint="drop it, or --quantize int8")
        if self.quantize in ("w4a16", "fp8-channel", "nvfp4"):  # the int8 settings would be ignored
            for name in ("bits", "groups", "mlp_extra_grouping"):
                if getattr(self, name) != ReshardOptions.model_fields[name].default:
                    raise LayoutError(f"sets int8 quantization, not {self.quantize}'s", culprit=flag_of(name),
                                      hint="drop it (w4a16's group is --group-size), or --quantize int8")
        if (self.quantize == "like-source") != (self.quantize_like is not None):
            raise LayoutError("--quantize like-source and --quantize-like DIR go together", culprit=(
                "--quantize-like" if self.quantize_like is not None else "--quantize"),
                hint="give both (the release folder whose quantization the output takes), or neither")
        if self.quantize == "like-source":  # the release says every setting
            for name in ("bits", "groups", "mlp_extra_grouping"):
                if getattr(self, name) != ReshardOptions.model_fields[name].default:
                    raise LayoutError("sets int8 quantization, not the release's", culprit=flag_of(name),
                                      hint="drop it: --quantize like-source takes every setting from the release")
        if self.group_size is not None and self.quantize != "w4a16":  # NVFP4's group is 16, fixed
            raise LayoutError("applies only with --quantize w4a16", culprit="--group-size",
                              hint="add --quantize w4a16, or drop it (nvfp4's group is 16, fixed)")
        if self.hf_architecture is not None and self.to != "hf":  # the hf format's own choice of class
            raise LayoutError("names the class of a Hugging Face export", culprit=flag_of("hf_architecture"),
                              hint="add --to hf, or drop it")
        return self

    def to_record(self) -> dict[str, Any]:
        """The options as plain data (manifest, conversion identity, task parameters)."""
        return {name: getattr(self, name) for name in ReshardOptions.model_fields}

    @classmethod
    def checked(cls, **fields: Any) -> ReshardOptions:
        """The options from keyword arguments, every problem the one-line
        :class:`~reshard.core.errors.LayoutError` the CLI prints for its flag (:func:`in_keywords`
        words it for a Python caller)."""
        from pydantic import ValidationError

        try:
            return cls(**fields)
        except ValidationError as exc:
            raise option_error(exc) from None

    @classmethod
    def from_fields(cls, values: Any) -> ReshardOptions:
        """The options among ``values`` (a mapping or an object with attributes), by field name;
        absent ones take their defaults."""
        get = values.get if isinstance(values, dict) else (lambda k, d=None: getattr(values, k, d))
        return cls(**{k: get(k) for k in cls.model_fields if get(k, _MISSING) is not _MISSING})


_MISSING = object()


def option_error(exc: Any) -> LayoutError:
    """A pydantic ``ValidationError`` over option fields as the one-line error naming the flag."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first.get("loc") else "options"
    if first.get("type") == "extra_forbidden":
        return LayoutError("is not an option of reshard", culprit=field,
                           hint=f"use one of {', '.join(ReshardOptions.model_fields)}")
    shown = "" if field == "storage_options" else f" (got {first.get('input')!r})"
    return LayoutError(f"{first['msg']}{shown}", culprit=flag_of(field), hint=_expected(field))


def _expected(field: str) -> str:
    """What a field takes, in words (the fix of a value of the wrong type)."""
    import typing

    info = ReshardOptions.model_fields.get(field)
    kinds = [t for t in typing.get_args(info.annotation) if t is not type(None)] if info else []
    words = {int: "an integer", float: "a number", str: "text", bool: "true or false", dict: "a mapping"}
    said = [words[k] for k in kinds if k in words] or ["a value of the documented kind"]
    return f"give {flag_of(field)} {' or '.join(dict.fromkeys(said))}"


def flag_names() -> dict[str, str]:
    """Every CLI flag of the options -> the keyword a Python caller gives (``--no-swiglu`` is
    ``swiglu`` too)."""
    names = {flag_of(f): f for f in ReshardOptions.model_fields}
    for f, info in ReshardOptions.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "negative_flag" in extra:
            names[str(extra["negative_flag"])] = f
    return names


def in_keywords(err: LayoutError) -> LayoutError:
    """``err`` as a Python caller reads it: each CLI flag it names written as its keyword."""
    names = flag_names()
    pattern = re.compile("|".join(re.escape(f) for f in sorted(names, key=len, reverse=True)) + r"(?![\w-])")

    def keywords(text: str | None) -> str | None:
        return None if text is None else pattern.sub(lambda m: names[m.group(0)], text)

    return type(err)(keywords(err.message) or "", culprit=keywords(err.culprit), hint=keywords(err.fix))
