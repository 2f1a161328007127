"""Hugging Face architectures a megatron-core GPT model maps onto *exactly*, and the name table of
each: which ``transformers`` class computes the same function from the same tensors, its
``config.json``, and where every megatron-core tensor's bytes go in the Hugging Face tensors.

Pure: no files, no torch I/O. The ``hf`` format (:mod:`reshard.formats.hf`) streams the bytes.

Architectures (decided by :func:`decide_architecture` from the saved ``args`` and the tensors
present; anything else is refused with what differs — never an approximate export):

=====================  ===========================================================================
architecture           megatron-core model
=====================  ===========================================================================
``LlamaForCausalLM``   RMSNorm, SwiGLU, rotary (whole head, not interleaved, no scaling), no linear
                       biases — or biases on every linear layer (``attention_bias``, ``mlp_bias``)
``Qwen2ForCausalLM``   the same with biases on the fused QKV only (``--add-qkv-bias``)
=====================  ===========================================================================

Tensor transforms (one class each, owning its byte mapping; rows are the leading dim):

==================  =====================================  ========================================
kind                megatron-core tensor                   Hugging Face tensors
==================  =====================================  ========================================
:class:`Same`       any ``[r, ...]``                       one tensor, same bytes
:class:`VocabRows`  ``[padded_vocab, h]``                  ``[vocab, h]``: the first ``vocab`` rows
:class:`QKVSplit`   ``[g * (q + 2) * d, ...]`` per group:  ``q_proj [g*q*d, ...]``, ``k_proj
                    ``q*d`` query rows, ``d`` key rows,    [g*d, ...]``, ``v_proj [g*d, ...]``
                    ``d`` value rows
:class:`GatedSplit` ``[2 * f, h]`` = ``[gate; up]``        ``gate_proj [f, h]``, ``up_proj [f, h]``
==================  =====================================  ========================================

(``g`` query groups, ``q`` query heads per group, ``d`` head dim, ``f`` FFN width.) megatron-core's
rotary embedding rotates the two halves of each head (``rotate_half``), as transformers' Llama
does, so no row permutation is needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.errors import LayoutError
from reshard.core.plan_types import ModelFacts

#: megatron-core's defaults for what Megatron-LM's ``args`` may not record.
ROPE_BASE_DEFAULT = 10000.0
NORM_EPS_DEFAULT = 1e-5


@dataclass(frozen=True)
class Run:
    """Bytes ``[src, src + length)`` of the megatron-core tensor go to output ``out`` at byte ``dst``."""

    src: int
    length: int
    out: int
    dst: int


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]


class Transform:
    """How one megatron-core tensor becomes Hugging Face tensors (names from a template: ``{}``
    takes each output's suffix)."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        raise NotImplementedError

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        raise NotImplementedError


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


class Same(Transform):
    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], shape)]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, shape[0] * _row_bytes(shape, itemsize), 0, 0)] if shape else [Run(0, itemsize, 0, 0)]


class VocabRows(Transform):
    """The true vocabulary's rows: Megatron's padding rows are dropped."""

    @staticmethod
    def rows(shape: tuple[int, ...], facts: ModelFacts) -> int:
        return min(facts.vocab_size, shape[0]) if facts.vocab_size else shape[0]

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (self.rows(shape, facts), *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, self.rows(shape, facts) * _row_bytes(shape, itemsize), 0, 0)]


class QKVSplit(Transform):
    """megatron-core's fused QKV (grouped per query group) as separate Q, K and V projections."""

    @staticmethod
    def _dims(shape: tuple[int, ...], facts: ModelFacts) -> tuple[int, int, int]:
        g, heads, d = facts.query_groups, facts.heads, facts.head_dim
        if not (g and heads and d) or heads % g or shape[0] != (heads + 2 * g) * d:
            raise LayoutError(f"fused QKV of {shape[0]} rows does not match {heads} heads in {g} groups of "
                              f"dim {d}", culprit="linear_qkv", hint="check --num-heads / --num-query-groups")
        return g, heads // g, d

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        g, q, d = self._dims(shape, facts)
        rest = shape[1:]
        return [OutTensor(names[0], (g * q * d, *rest)), OutTensor(names[1], (g * d, *rest)),
                OutTensor(names[2], (g * d, *rest))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        g, q, d = self._dims(shape, facts)
        row = _row_bytes(shape, itemsize)
        out = []
        for i in range(g):
            base = i * (q + 2) * d * row
            out += [Run(base, q * d * row, 0, i * q * d * row),
                    Run(base + q * d * row, d * row, 1, i * d * row),
                    Run(base + (q + 1) * d * row, d * row, 2, i * d * row)]
        return out


class GatedSplit(Transform):
    """SwiGLU's fused first MLP layer ``[gate; up]`` as its two projections."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        f = shape[0] // 2
        return [OutTensor(names[0], (f, *shape[1:])), OutTensor(names[1], (f, *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        half = shape[0] // 2 * _row_bytes(shape, itemsize)
        return [Run(0, half, 0, 0), Run(half, half, 1, 0)]


_L = r"^decoder\.layers\.(\d+)\."
_H = "model.layers.{layer}."
#: megatron-core name (local or Transformer Engine spec) -> Hugging Face names (Llama / Qwen2).
#: ``None``: the entry holds no weights (``_extra_state``) and is not exported.
LLAMA_NAMES: tuple[tuple[re.Pattern[str], Transform | None, tuple[str, ...]], ...] = tuple(
    (re.compile(p), t, n) for p, t, n in (
        (r"^embedding\.word_embeddings\.weight$", VocabRows(), ("model.embed_tokens.weight",)),
        (_L + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$", Same(),
         (_H + "input_layernorm.weight",)),
        (_L + r"self_attention\.linear_qkv\.(weight|bias)$", QKVSplit(),
         (_H + "self_attn.q_proj.{p}", _H + "self_attn.k_proj.{p}", _H + "self_attn.v_proj.{p}")),
        (_L + r"self_attention\.linear_proj\.(weight|bias)$", Same(), (_H + "self_attn.o_proj.{p}",)),
        (_L + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)$", Same(),
         (_H + "post_attention_layernorm.weight",)),
        (_L + r"mlp\.linear_fc1\.(weight|bias)$", GatedSplit(), (_H + "mlp.gate_proj.{p}", _H + "mlp.up_proj.{p}")),
        (_L + r"mlp\.linear_fc2\.(weight|bias)$", Same(), (_H + "mlp.down_proj.{p}",)),
        (r"^decoder\.final_layernorm\.weight$", Same(), ("model.norm.weight",)),
        (r"^output_layer\.weight$", VocabRows(), ("lm_head.weight",)),
        (r"^(?:.+\.)?_extra_state$", None, ()),
    ))


@dataclass(frozen=True)
class Export:
    """One megatron-core tensor's Hugging Face outputs and byte runs (empty: not exported)."""

    key: str
    outputs: tuple[OutTensor, ...] = ()
    runs: tuple[Run, ...] = ()


def export_of(key: str, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> Export:
    """Where megatron-core tensor ``key`` goes (:data:`LLAMA_NAMES`); an unknown key is an error."""
    for pattern, transform, names in LLAMA_NAMES:
        m = pattern.match(key)
        if m is None:
            continue
        if transform is None:
            return Export(key)
        groups = m.groups()
        layer = groups[0] if groups and key.startswith("decoder.layers.") else None
        part = groups[-1] if len(groups) > 1 else None
        filled = tuple(n.format(layer=layer, p=part) for n in names)
        return Export(key, tuple(transform.outputs(filled, shape, facts)),
                      tuple(transform.runs(shape, itemsize, facts)))
    raise LayoutError(f"{key} has no Hugging Face counterpart in the Llama/Qwen2 architectures", culprit=key,
                      hint="export a model whose every tensor those architectures hold")


@dataclass(frozen=True, kw_only=True)
class HFArchitecture:
    """The chosen class, its ``config.json`` and why (for the report)."""

    name: str
    config: dict[str, Any]
    reason: str
    notes: tuple[str, ...] = field(default_factory=tuple)


_HF_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _arg(args: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(args, n, None) if args is not None else None
        if v is not None:
            return v
    return default


def decide_architecture(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                        ffn: int | None) -> HFArchitecture:
    """The Hugging Face architecture that computes this megatron-core model exactly (see the module
    table), from the saved ``args`` and the tensor names present; :class:`LayoutError` naming the
    first difference otherwise."""

    def refuse(what: str) -> LayoutError:
        return LayoutError(f"no Hugging Face architecture computes this model exactly: {what}", culprit="--to hf",
                           hint="keep it in a Megatron layout (Llama and Qwen2 shapes are exported)")

    def has(pattern: str) -> bool:
        return any(re.search(pattern, k) for k in keys)

    norm = _arg(args, "normalization")
    if norm != "RMSNorm":
        raise refuse(f"normalization is {norm or 'not recorded in args'} (Llama/Qwen2 use RMSNorm; GPT-2-style "
                     "LayerNorm models are not exported yet)")
    if not facts.swiglu:
        raise refuse("the MLP is not SwiGLU")
    for flag, what in (("squared_relu", "squared ReLU"), ("apply_residual_connection_post_layernorm",
                                                          "residual taken after the layer norm"),
                       ("qk_layernorm", "query/key layer norms"), ("rotary_interleaved", "interleaved rotary"),
                       ("use_rope_scaling", "rotary scaling"), ("multi_latent_attention", "multi-latent attention")):
        if _arg(args, flag, default=False):
            raise refuse(f"{what} ({flag})")
    if has(r"(q_layernorm|k_layernorm)\."):
        raise refuse("query/key layer norms")
    if _arg(args, "position_embedding_type") != "rope" or has(r"position_embeddings\."):
        raise refuse(f"position embedding {_arg(args, 'position_embedding_type') or 'unknown'} (rotary needed)")
    percent = float(_arg(args, "rotary_percent", default=1.0))
    if percent != 1.0:
        raise refuse(f"rotary_percent {percent} (the whole head must rotate)")
    if _arg(args, "moe_num_experts", "num_experts", default=None):
        raise refuse("mixture of experts")
    qkv_bias, proj_bias = has(r"linear_qkv\.bias$"), has(r"linear_proj\.bias$")
    mlp_bias = has(r"linear_fc1\.bias$") or has(r"linear_fc2\.bias$")
    if facts.heads is None or facts.query_groups is None or facts.head_dim is None or facts.hidden is None:
        raise refuse("heads, query groups or head dim unknown (pass --num-heads / --num-query-groups)")
    vocab = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
    base = float(_arg(args, "rotary_base", default=ROPE_BASE_DEFAULT))
    eps = float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=NORM_EPS_DEFAULT))
    config: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": facts.hidden, "intermediate_size": ffn,
        "num_hidden_layers": facts.num_layers, "num_attention_heads": facts.heads,
        "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim, "hidden_act": "silu",
        "rms_norm_eps": eps, "rope_theta": base, "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "tie_word_embeddings": bool(facts.tied_embeddings), "dtype": _HF_DTYPES.get(dtype, str(dtype)),
        "bos_token_id": None, "eos_token_id": None, "use_cache": True,
    }
    max_pos = _arg(args, "max_position_embeddings", "seq_length")
    if isinstance(max_pos, int):
        config["max_position_embeddings"] = max_pos
    notes = (f"rope_theta {base:g}" + (" (megatron-core's default: args do not record it)"
                                       if _arg(args, "rotary_base") is None else ""),
             f"rms_norm_eps {eps:g}" + (" (megatron-core's default)" if _arg(args, "norm_epsilon",
                                                                              "layernorm_epsilon") is None else ""))
    if qkv_bias and not proj_bias and not mlp_bias:
        if facts.head_dim * facts.heads != facts.hidden:
            raise refuse("head dim x heads differs from the hidden size, which Qwen2 assumes")
        config.pop("head_dim")
        return HFArchitecture(name="Qwen2ForCausalLM", config={"architectures": ["Qwen2ForCausalLM"],
                                                               "model_type": "qwen2", **config},
                              reason="RMSNorm, SwiGLU, rotary, biases on the fused QKV only", notes=notes)
    if qkv_bias != proj_bias or (mlp_bias and not qkv_bias):
        where = [n for n, b in (("QKV", qkv_bias), ("attention output", proj_bias), ("MLP", mlp_bias)) if b]
        raise refuse(f"biases on the {' and '.join(where)} layers only (Llama has them on all or none, Qwen2 on "
                     "QKV alone)")
    config.update(attention_bias=qkv_bias, mlp_bias=mlp_bias)
    return HFArchitecture(name="LlamaForCausalLM", config={"architectures": ["LlamaForCausalLM"],
                                                           "model_type": "llama", **config},
                          reason="RMSNorm, SwiGLU, rotary" + (", biases on every linear layer" if qkv_bias
                                                              else ", no linear biases"), notes=notes)
