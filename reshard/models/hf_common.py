"""What several Hugging Face architecture modules share: the name templates of a decoder layer and
of a routed expert, megatron-core's defaults for what ``args`` may not record, the flags no exported
architecture computes, the checks every built-in export starts with, the sliding window and the
rotary embedding both ways (YaRN included), and the making of Megatron-LM's ``args`` and model facts
from a ``config.json``'s numbers.

Pure: no files. Each architecture's own facts (its name table, its ``config.json`` reading and its
export decision) are in its module (:mod:`reshard.models.hf_llama`, :mod:`~reshard.models.hf_mistral`,
:mod:`~reshard.models.hf_qwen`, :mod:`~reshard.models.hf_qwen_moe`, :mod:`~reshard.models.hf_mixtral`,
:mod:`~reshard.models.hf_gpt2`, :mod:`~reshard.models.hf_deepseek`); the transforms and the base
class are the toolkit's (:mod:`reshard.models.hf_architectures`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import HFModel, NameTable

#: megatron-core's defaults for what Megatron-LM's ``args`` may not record.
ROPE_BASE_DEFAULT = 10000.0
NORM_EPS_DEFAULT = 1e-5

#: A decoder layer's name prefix in megatron-core and in a Llama-like Hugging Face folder.
CORE_LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."
#: Transformer Engine's extra state of any module: held in the checkpoint, never exported.
EXTRA_STATE = "{prefix}_extra_state"
#: A routed expert's megatron-core names: SequentialMLP's, then grouped GEMM's.
EXPERT_FC1 = (CORE_LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
              CORE_LAYER + "mlp.experts.linear_fc1.weight{expert}")
EXPERT_FC2 = (CORE_LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
              CORE_LAYER + "mlp.experts.linear_fc2.weight{expert}")

#: Megatron-LM ``args`` flags no exported architecture computes (each refused by name, with what it does).
NOT_EXPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("squared_relu", "squared ReLU"),
    ("apply_residual_connection_post_layernorm", "residual taken after the layer norm"),
    ("qk_l2_norm", "L2-normalized queries and keys"), ("rotary_interleaved", "interleaved rotary"),
    ("use_rope_scaling", "rotary scaling"),
    ("apply_layernorm_1p", "norm weights stored as w - 1 (layernorm 1p)"))

Refuse = Callable[[str], LayoutError]
Has = Callable[[str], bool]
_F = TypeVar("_F", bound=Callable[..., Any])


def asked_in_turn(fn: _F) -> _F:
    """``fn`` answered once for equal arguments asked in a row: the classes that claim a model by its
    shape each ask the same question of one model in turn
    (:func:`~reshard.models.hf_registry.decide_export`), and on a model of many experts each answer
    scans every name. A copy of the last arguments (equal, not merely the same objects: an ``args``
    edited in place is another question) and the answer, or the refusal, are held until the next
    call; each caller gets its own copy of the answer."""
    last: list[Any] = [None]
    lock = threading.Lock()

    @functools.wraps(fn)
    def asked(*args: Any) -> Any:
        with lock:
            held = last[0]
        if held is not None and held[0] == args:
            answered, value = held[1]
        else:
            asked_with = tuple(frozenset(a) if isinstance(a, (set, frozenset)) else copy.deepcopy(a) for a in args)
            try:
                answered, value = True, fn(*args)
            except LayoutError as refusal:
                answered, value = False, refusal
            with lock:
                last[0] = (asked_with, (answered, value))
        if not answered:
            raise value
        return copy.deepcopy(value)

    return asked  # type: ignore[return-value]


def not_exact(what: str) -> LayoutError:
    """The built-in export's refusal: no Hugging Face architecture computes the model exactly."""
    return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                       hint="keep it in a Megatron layout (Llama, Qwen2 and GPT-2 shapes are exported)")


def has_key(keys: set[str]) -> Has:
    """Whether any megatron-core name of ``keys`` matches a pattern (searched)."""
    return lambda pattern: any(re.search(pattern, k) for k in keys)


@asked_in_turn
def decided_norm(args: Any, facts: ModelFacts, keys: set[str]) -> tuple[str, bool]:
    """The checks every built-in export (GPT-2's and the Llama-like ones) starts with, in one order so
    that whichever architecture asks first refuses the same way: the flags none computes, query/key
    norms the args contradict, the head shape, the normalization. Returns the normalization and
    whether the layers hold query/key norms."""
    has = has_key(keys)
    for flag, what in (*NOT_EXPORTED_FLAGS, ("multi_latent_attention", "multi-latent attention")):
        if saved_arg(args, flag, default=False):
            raise not_exact(f"{what} ({flag})")
    qk_norm = has(r"\.(q_layernorm|k_layernorm)\.weight$")
    if qk_norm != bool(saved_arg(args, "qk_layernorm", default=qk_norm)):
        raise not_exact("args.qk_layernorm contradicts the query/key layer norms the tensors hold")
    if facts.heads is None or facts.query_groups is None or facts.head_dim is None or facts.hidden is None:
        raise not_exact("heads, query groups or head dim unknown (give --num-heads / --num-query-groups)")
    norm = saved_arg(args, "normalization")
    if norm is None:  # Megatron-LM's default is LayerNorm, which no SwiGLU, MoE or Qwen3 export has: ask
        if facts.swiglu or qk_norm or has(r"\.mlp\.router\.weight$"):
            raise LayoutError("the normalization is unknown: the checkpoint's args do not record it",
                              culprit="--to hf", hint="give --normalization RMSNorm (or LayerNorm), or the model's "
                                                      "config.json with --model-config")
        norm = "LayerNorm"
    if norm == "LayerNorm" and has(r"\.mlp\.router\.weight$"):
        raise not_exact("a mixture-of-experts model with LayerNorm (Mixtral and Qwen2-MoE use RMSNorm)")
    if norm == "LayerNorm" and qk_norm:
        raise not_exact("query/key layer norms with LayerNorm (Qwen3 uses RMSNorm)")
    return norm, qk_norm


def window_args(sliding_window: int) -> dict[str, Any]:
    """Megatron-LM's ``args`` for transformers' ``sliding_window`` ``W`` on every layer.

    transformers masks key ``j`` from query ``i`` unless ``i - W < j <= i`` (``sliding_window_overlay``
    and the causal mask): the ``W`` latest tokens, the query's own included. megatron-core's
    ``window_size`` ``(left, right)`` lets query ``i`` see keys ``i - left`` to ``i + right``, both
    included (its local attention's ``get_sliding_window_causal_mask``; Transformer Engine's and
    flash-attention's windows read the same): ``(W - 1, 0)``. ``window_attn_skip_freq`` None: every
    layer windowed. Megatron-LM's ``--window-size`` saves the pair as a tuple of ints. (megatron-core
    0.16.1's local attention leaves the window out of its fused fp16/bf16 softmax kernel, a GPU path:
    a run trained that way did not compute the window its args state.)"""
    return {"window_size": (sliding_window - 1, 0), "window_attn_skip_freq": None}


def _window_refusal(what: str) -> LayoutError:
    return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                       hint="keep it in a Megatron layout (a window on every layer, looking back only, is exported "
                            "as MistralForCausalLM's sliding_window; GptOssForCausalLM's layer_types window some "
                            "layers)")


def layer_windows(args: Any, num_layers: int) -> list[int | None]:
    """transformers' window of each layer (its ``sliding_window`` ``W``; None: the layer attends
    fully) for the windows Megatron-LM's ``args`` give (the inverse of :func:`window_args` per layer);
    :class:`LayoutError` for a window no ``sliding_window`` computes: a look-ahead, a negative side
    (Transformer Engine's "unbounded", which megatron-core's local attention does not read so), one in
    a legacy model's args (its attention is not megatron-core's), or a ``window_attn_skip_freq`` that
    is neither an int nor a flag per layer (read as megatron-core's ``is_layer_window_attention``
    does: layer numbers from 1, an int ``k`` leaves every ``k``-th layer unwindowed)."""
    size = saved_arg(args, "window_size")
    if size is None:
        return [None] * num_layers
    if not (isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                       for v in size)):
        raise _window_refusal(f"window_size {size!r} (megatron-core's window is a pair of ints, (left, right))")
    left, right = size
    if right != 0:
        raise _window_refusal(f"window_size ({left}, {right}) looks {right} tokens ahead (transformers' windows look "
                              "back only)")
    if left < 0:
        raise _window_refusal(f"window_size ({left}, 0) (Transformer Engine reads a negative side as unbounded, "
                              "megatron-core's local attention does not)")
    if saved_arg(args, "use_legacy_models", default=False):
        raise _window_refusal(f"window_size ({left}, 0) in a legacy Megatron model's args (its attention is not "
                              "megatron-core's)")
    freq = saved_arg(args, "window_attn_skip_freq")
    layers = range(1, num_layers + 1)  # megatron-core numbers layers from 1
    if freq is None:
        windowed = [True] * num_layers
    elif isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        windowed = [n % freq != 0 for n in layers]
    elif isinstance(freq, (list, tuple)) and len(freq) == num_layers:
        windowed = [bool(v) for v in freq]
    else:
        raise _window_refusal(f"window_attn_skip_freq {freq!r} (an int or one flag per layer of {num_layers})")
    return [left + 1 if w else None for w in windowed]


def sliding_window(args: Any, num_layers: int) -> int | None:
    """transformers' ``sliding_window`` for the window Megatron-LM's ``args`` give every layer (the
    inverse of :func:`window_args`), None without one; :class:`LayoutError` for a window no
    ``sliding_window`` computes (:func:`layer_windows`) or windows on some layers only."""
    windows = layer_windows(args, num_layers)
    if not any(windows):
        return None
    if not all(windows):
        full = [i for i, w in enumerate(windows) if w is None]
        raise _window_refusal(f"sliding-window attention on some layers only (layers {full} attend fully: "
                              f"window_attn_skip_freq {saved_arg(args, 'window_attn_skip_freq')!r})")
    return windows[0]


def rope_of(c: Mapping[str, Any]) -> tuple[float, str, float]:
    """(rotary base, rotary scaling type, partial rotary factor) from either ``config.json`` layout
    (transformers 5's ``rope_parameters``, 4's ``rope_theta`` + ``rope_scaling``)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5.x
        base = params.get("rope_theta", c.get("rope_theta", ROPE_BASE_DEFAULT))
        rope_type = params.get("rope_type") or params.get("type") or "default"
        partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    else:  # transformers 4.x
        scaling = c.get("rope_scaling")
        base = c.get("rope_theta", ROPE_BASE_DEFAULT)
        rope_type = (scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) \
            else "default"
        partial = c.get("partial_rotary_factor", 1.0)
    return float(base), str(rope_type), float(partial)


def rope_from_hf(c: Mapping[str, Any], refuse: Any) -> dict[str, Any]:
    """Megatron-LM's rope ``args`` for a ``config.json`` with plain rope or YaRN (either layout:
    transformers 5's ``rope_parameters``, 4's ``rope_theta`` + ``rope_scaling``). YaRN's cos/sin
    factor and softmax scale must come out the same: transformers uses ``mscale / mscale_all_dim``
    when both are set, else ``mscale`` 1 (and no softmax scaling without ``mscale_all_dim``);
    megatron-core always uses the ratio, so ``mscale_all_dim`` 0 reads as mscale 1."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else c.get("rope_scaling")
    params = dict(params or {})
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=base, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise refuse(f"rotary scaling {rope_type} (megatron-core's MLA has YaRN or none)")
    for key in ("attention_factor", "partial_rotary_factor"):
        if params.get(key) is not None:
            raise refuse(f"rope {key} {params[key]}")
    if params.get("truncate") is False:
        raise refuse("YaRN without truncation (truncate false)")
    original = params.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = float(params.get("factor") or c["max_position_embeddings"] / original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not all_dim:
        mscale, all_dim = 1.0, 0.0
    elif not mscale:
        raise refuse("YaRN mscale_all_dim without mscale (megatron-core scales cos/sin by their ratio)")
    return dict(rope_type="yarn", rotary_base=base, rotary_scaling_factor=factor,
                original_max_position_embeddings=int(original), beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale), mscale_all_dim=float(all_dim))


def rope_to_hf(args: Any, refuse: Any) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for megatron-core's rope ``args`` with YaRN's fields
    (Megatron-LM's CLI defaults where the args are silent: YaRN with factor 1, which is plain rope)."""
    base = float(saved_arg(args, "rotary_base", default=10000.0))
    rope_type = saved_arg(args, "rope_type", default="yarn")
    factor = float(saved_arg(args, "rotary_scaling_factor", default=1.0))
    mscale = float(saved_arg(args, "mscale", default=1.0))
    all_dim = float(saved_arg(args, "mscale_all_dim", default=0.0))
    if factor <= 1.0:  # YaRN at factor 1 is plain rope, and no mscale applies
        return {"rope_type": "default", "rope_theta": base}
    if rope_type != "yarn":
        if all_dim:
            raise refuse(f"plain rope with rotary_scaling_factor {factor:g} and mscale_all_dim {all_dim:g} "
                         "(megatron-core scales the softmax; transformers does not)")
        return {"rope_type": "default", "rope_theta": base}
    if not all_dim and mscale != 1.0:
        raise refuse(f"YaRN mscale {mscale:g} without mscale_all_dim (transformers then uses mscale 1)")
    if all_dim and not mscale:
        raise refuse("YaRN mscale 0 with mscale_all_dim set (transformers then uses mscale 1)")
    return {"rope_type": "yarn", "rope_theta": base, "factor": factor,
            "original_max_position_embeddings": int(saved_arg(args, "original_max_position_embeddings", default=4096)),
            "beta_fast": float(saved_arg(args, "beta_fast", default=32)),
            "beta_slow": float(saved_arg(args, "beta_slow", default=1)),
            "mscale": mscale, "mscale_all_dim": all_dim}


def config_int(c: Mapping[str, Any], where: str) -> Callable[..., int]:
    """``need(*keys)``: the first of ``keys`` that ``config.json`` ``c`` holds as an int, else
    :class:`CheckpointFormatError` naming the first key."""

    def need(*keys: str) -> int:
        for k in keys:
            if isinstance(c.get(k), int):
                return int(c[k])
        raise CheckpointFormatError(f"has no integer {keys[0]}", culprit=where, hint="check config.json")

    return need


def import_refusal(arch: str, where: str) -> Refuse:
    """The import's refusal of a ``config.json`` of ``arch`` naming what megatron-core does not compute."""
    return lambda what: LayoutError(f"megatron-core does not compute this {arch} exactly: {what}", culprit=where,
                                    hint="only models Megatron-LM reproduces exactly are imported")


def megatron_model(arch: str, names: NameTable, *, vocab: int, hidden: int, layers: int, heads: int, groups: int,
                   head_dim: int, ffn: int, tied: bool, arch_args: Mapping[str, Any],
                   base_prefix: str | None = None) -> HFModel:
    """The megatron-core model (TP 1, local spec, as Megatron-LM's ``args`` and model facts) of a
    ``config.json``'s numbers and ``arch_args`` (the architecture's own ``args``: normalization,
    activation, positions, biases, MoE; ``max_position_embeddings`` is the sequence length too)."""
    args = argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        kv_channels=head_dim, group_query_attention=groups != heads,
        **({"num_query_groups": groups} if groups != heads else {}),  # Megatron-LM's 1 (a default) without GQA
        untie_embeddings_and_output_weights=not tied, vocab_size=vocab, padded_vocab_size=vocab,
        seq_length=arch_args["max_position_embeddings"], tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, transformer_impl="local", use_legacy_models=False, ckpt_format="torch",
        **arch_args)
    facts = ModelFacts(naming="megatron-core", num_layers=layers, hidden=hidden, heads=heads, query_groups=groups,
                       head_dim=head_dim, swiglu=arch_args["swiglu"], tied_embeddings=tied, vocab_size=vocab,
                       padded_vocab_source=vocab, padded_vocab_target=None, make_vocab_size_divisible_by=None,
                       source_pp_layers=(layers,), target_pp_layers=(layers,))
    return HFModel(arch, args, facts, names, base_prefix)
