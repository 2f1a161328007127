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
``GPT2LMHeadModel``    LayerNorm, GELU (exact; ``gelu_new`` with ``--openai-gelu``), learned absolute
                       positions, biases on every linear layer, multi-head attention (legacy
                       Megatron GPT, megatron-core's GPT with those settings)
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
:class:`Conv1D`     ``[out, in]``                          ``[in, out]`` (GPT-2's ``Conv1D``; whole)
:class:`GPT2QKV`    ``[heads * 3 * d, h]`` per head q,k,v  ``c_attn [h, 3 * heads * d]``: all q, all
                                                           k, all v, transposed (whole)
==================  =====================================  ========================================

"whole": a transpose is no byte run, so that one tensor is read into memory, then written.

(``g`` query groups, ``q`` query heads per group, ``d`` head dim, ``f`` FFN width.) megatron-core's
rotary embedding rotates the two halves of each head (``rotate_half``), as transformers' Llama
does, so no row permutation is needed.
"""

from __future__ import annotations

import abc
import functools
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


class Transform(abc.ABC):
    """How one megatron-core tensor becomes Hugging Face tensors (``names``: theirs, filled in)."""

    @abc.abstractmethod
    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        """The Hugging Face tensors (names and shapes) made from a megatron-core tensor of ``shape``."""


class ByteTransform(Transform):
    """A transform that only moves bytes: streamed, nothing held in memory."""

    @abc.abstractmethod
    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        """Where each byte range of the megatron-core tensor goes (bytes no run covers are dropped)."""


class WholeTensorTransform(Transform):
    """A transform that needs the whole tensor (a transpose): it is read into memory, one at a time."""

    @abc.abstractmethod
    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        """The outputs, in :meth:`outputs` order."""


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


class Same(ByteTransform):
    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], shape)]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, shape[0] * _row_bytes(shape, itemsize), 0, 0)] if shape else [Run(0, itemsize, 0, 0)]


class VocabRows(ByteTransform):
    """The true vocabulary's rows: Megatron's padding rows are dropped."""

    @staticmethod
    def rows(shape: tuple[int, ...], facts: ModelFacts) -> int:
        return min(facts.vocab_size, shape[0]) if facts.vocab_size else shape[0]

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (self.rows(shape, facts), *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        return [Run(0, self.rows(shape, facts) * _row_bytes(shape, itemsize), 0, 0)]


class QKVSplit(ByteTransform):
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


class GatedSplit(ByteTransform):
    """SwiGLU's fused first MLP layer ``[gate; up]`` as its two projections."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        f = shape[0] // 2
        return [OutTensor(names[0], (f, *shape[1:])), OutTensor(names[1], (f, *shape[1:]))]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        half = shape[0] // 2 * _row_bytes(shape, itemsize)
        return [Run(0, half, 0, 0), Run(half, half, 1, 0)]


class Conv1D(WholeTensorTransform):
    """GPT-2's ``Conv1D`` weights are stored ``[in, out]``: the transpose of a linear layer's.
    Whole-tensor (a transpose is no byte run): the tensor is read once, in memory, then written."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (shape[1], shape[0]))]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        return [t.t().contiguous()]


class GPT2QKV(WholeTensorTransform):
    """megatron-core's fused QKV of multi-head attention (``[heads, 3, d]`` rows) as GPT-2's
    ``c_attn``: ``[3, heads, d]`` rows (all queries, all keys, all values), a weight transposed."""

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], (shape[1], shape[0]) if len(shape) == 2 else shape)]

    def convert(self, t: torch.Tensor, facts: ModelFacts) -> list[torch.Tensor]:
        heads = facts.heads or 0
        if not heads or t.shape[0] % (3 * heads):
            raise LayoutError(f"fused QKV of {t.shape[0]} rows is not 3 x {heads} heads", culprit="linear_qkv",
                              hint="check --num-heads")
        rows = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return [rows.t().contiguous() if t.dim() == 2 else rows.contiguous()]


#: (pattern, transform, Hugging Face name templates) per megatron-core name; transform None: not exported.
NameTable = tuple[tuple[re.Pattern[str], ByteTransform | WholeTensorTransform | None, tuple[str, ...]], ...]


def _table(*rows: tuple[str, ByteTransform | WholeTensorTransform | None, tuple[str, ...]]) -> NameTable:
    return tuple((re.compile(pattern), transform, names) for pattern, transform, names in rows)


_L = r"^decoder\.layers\.(?P<layer>\d+)\."
_H = "model.layers.{layer}."
#: megatron-core name (local or Transformer Engine spec) -> Hugging Face names (Llama / Qwen2).
#: ``None``: the entry holds no weights (``_extra_state``) and is not exported.
LLAMA_NAMES: NameTable = _table(
    (r"^embedding\.word_embeddings\.weight$", VocabRows(), ("model.embed_tokens.weight",)),
    (_L + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$", Same(),
     (_H + "input_layernorm.weight",)),
    (_L + r"self_attention\.linear_qkv\.(?P<p>weight|bias)$", QKVSplit(),
     (_H + "self_attn.q_proj.{p}", _H + "self_attn.k_proj.{p}", _H + "self_attn.v_proj.{p}")),
    (_L + r"self_attention\.linear_proj\.(?P<p>weight|bias)$", Same(), (_H + "self_attn.o_proj.{p}",)),
    (_L + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)$", Same(),
     (_H + "post_attention_layernorm.weight",)),
    (_L + r"mlp\.linear_fc1\.(?P<p>weight|bias)$", GatedSplit(), (_H + "mlp.gate_proj.{p}", _H + "mlp.up_proj.{p}")),
    (_L + r"mlp\.linear_fc2\.(?P<p>weight|bias)$", Same(), (_H + "mlp.down_proj.{p}",)),
    (r"^decoder\.final_layernorm\.weight$", Same(), ("model.norm.weight",)),
    (r"^output_layer\.weight$", VocabRows(), ("lm_head.weight",)),
    (r"^(?:.+\.)?_extra_state$", None, ()),
)


_G = "transformer.h.{layer}."
#: megatron-core name -> GPT-2 names (``GPT2LMHeadModel``; its linear layers are ``Conv1D``).
GPT2_NAMES: NameTable = _table(
    (r"^embedding\.word_embeddings\.weight$", VocabRows(), ("transformer.wte.weight",)),
    (r"^embedding\.position_embeddings\.weight$", Same(), ("transformer.wpe.weight",)),
    (_L + r"(?:input_layernorm\.|self_attention\.linear_qkv\.layer_norm_)(?P<p>weight|bias)$", Same(),
     (_G + "ln_1.{p}",)),
    (_L + r"self_attention\.linear_qkv\.weight$", GPT2QKV(), (_G + "attn.c_attn.weight",)),
    (_L + r"self_attention\.linear_qkv\.bias$", GPT2QKV(), (_G + "attn.c_attn.bias",)),
    (_L + r"self_attention\.linear_proj\.weight$", Conv1D(), (_G + "attn.c_proj.weight",)),
    (_L + r"self_attention\.linear_proj\.bias$", Same(), (_G + "attn.c_proj.bias",)),
    (_L + r"(?:pre_mlp_layernorm\.|mlp\.linear_fc1\.layer_norm_)(?P<p>weight|bias)$", Same(),
     (_G + "ln_2.{p}",)),
    (_L + r"mlp\.linear_fc1\.weight$", Conv1D(), (_G + "mlp.c_fc.weight",)),
    (_L + r"mlp\.linear_fc1\.bias$", Same(), (_G + "mlp.c_fc.bias",)),
    (_L + r"mlp\.linear_fc2\.weight$", Conv1D(), (_G + "mlp.c_proj.weight",)),
    (_L + r"mlp\.linear_fc2\.bias$", Same(), (_G + "mlp.c_proj.bias",)),
    (r"^decoder\.final_layernorm\.(?P<p>weight|bias)$", Same(), ("transformer.ln_f.{p}",)),
    (r"^output_layer\.weight$", VocabRows(), ("lm_head.weight",)),
    (r"^(?:.+\.)?_extra_state$", None, ()),
)
#: Each architecture's name table.
NAME_TABLES = {"LlamaForCausalLM": LLAMA_NAMES, "Qwen2ForCausalLM": LLAMA_NAMES, "GPT2LMHeadModel": GPT2_NAMES}


@dataclass(frozen=True)
class Export:
    """One megatron-core tensor's Hugging Face outputs and byte runs (empty: not exported)."""

    key: str
    outputs: tuple[OutTensor, ...] = ()
    runs: tuple[Run, ...] = ()
    #: whole-tensor transforms (a transpose): the outputs from the tensor itself, else None
    convert: Any = None


def export_of(key: str, shape: tuple[int, ...], itemsize: int, facts: ModelFacts, architecture: str) -> Export:
    """Where megatron-core tensor ``key`` goes in ``architecture`` (:data:`NAME_TABLES`); an unknown
    key is an error."""
    for pattern, transform, names in NAME_TABLES[architecture]:
        m = pattern.match(key)
        if m is None:
            continue
        if transform is None:
            return Export(key)
        fields = m.groupdict()
        filled = tuple(n.format(layer=fields.get("layer"), p=fields.get("p")) for n in names)
        outputs = tuple(transform.outputs(filled, shape, facts))
        if isinstance(transform, WholeTensorTransform):
            return Export(key, outputs, (), functools.partial(transform.convert, facts=facts))
        return Export(key, outputs, tuple(transform.runs(shape, itemsize, facts)))
    raise LayoutError(f"{key} has no counterpart in Hugging Face's {architecture}", culprit=key,
                      hint="export a model whose every tensor that architecture holds")


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
                           hint="keep it in a Megatron layout (Llama, Qwen2 and GPT-2 shapes are exported)")

    def has(pattern: str) -> bool:
        return any(re.search(pattern, k) for k in keys)

    for flag, what in (("squared_relu", "squared ReLU"), ("apply_residual_connection_post_layernorm",
                                                          "residual taken after the layer norm"),
                       ("qk_layernorm", "query/key layer norms"), ("rotary_interleaved", "interleaved rotary"),
                       ("use_rope_scaling", "rotary scaling"), ("multi_latent_attention", "multi-latent attention"),
                       ("moe_num_experts", "mixture of experts"), ("num_experts", "mixture of experts")):
        if _arg(args, flag, default=False):
            raise refuse(f"{what} ({flag})")
    if has(r"(q_layernorm|k_layernorm)\."):
        raise refuse("query/key layer norms")
    if facts.heads is None or facts.query_groups is None or facts.head_dim is None or facts.hidden is None:
        raise refuse("heads, query groups or head dim unknown (give --num-heads / --num-query-groups)")
    norm = _arg(args, "normalization", default="LayerNorm")  # Megatron-LM's default
    if norm == "LayerNorm":
        return _gpt2(args, facts, has, dtype, ffn, refuse)
    if norm != "RMSNorm":
        raise refuse(f"normalization is {norm}")
    if not facts.swiglu:
        raise refuse("the MLP is not SwiGLU")
    if _arg(args, "position_embedding_type") != "rope" or has(r"position_embeddings\."):
        raise refuse(f"position embedding {_arg(args, 'position_embedding_type') or 'unknown'} (rotary needed)")
    percent = float(_arg(args, "rotary_percent", default=1.0))
    if percent != 1.0:
        raise refuse(f"rotary_percent {percent} (the whole head must rotate)")
    qkv_bias, proj_bias = has(r"linear_qkv\.bias$"), has(r"linear_proj\.bias$")
    mlp_bias = has(r"linear_fc1\.bias$") or has(r"linear_fc2\.bias$")
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


def _gpt2(args: Any, facts: ModelFacts, has: Any, dtype: torch.dtype, ffn: int | None,
          refuse: Any) -> HFArchitecture:
    """LayerNorm, GELU (exact, or tanh with ``--openai-gelu``), learned absolute positions, biases
    on every linear layer, multi-head attention: ``GPT2LMHeadModel``."""
    if facts.swiglu:
        raise refuse("LayerNorm with a SwiGLU MLP (GPT-2 has a plain GELU MLP)")
    if _arg(args, "position_embedding_type", default="learned_absolute") != "learned_absolute" or \
            not has(r"^embedding\.position_embeddings\."):
        raise refuse("LayerNorm without learned absolute positions (GPT-2 learns them)")
    if facts.query_groups != facts.heads:
        raise refuse(f"{facts.query_groups} query groups for {facts.heads} heads (GPT-2 has multi-head attention)")
    if facts.head_dim * facts.heads != facts.hidden:
        raise refuse("head dim x heads differs from the hidden size, which GPT-2 assumes")
    missing = [n for n, pat in (("QKV", r"linear_qkv\.bias$"), ("attention output", r"linear_proj\.bias$"),
                                ("MLP", r"linear_fc1\.bias$")) if not has(pat)]
    if missing:
        raise refuse(f"no biases on the {' and '.join(missing)} layers (GPT-2 has them on every linear layer)")
    rows = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
    eps = float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=NORM_EPS_DEFAULT))
    gelu = "gelu_new" if _arg(args, "openai_gelu", default=False) else "gelu"
    config: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": rows, "n_embd": facts.hidden,
        "n_layer": facts.num_layers, "n_head": facts.heads, "n_inner": ffn, "activation_function": gelu,
        "layer_norm_epsilon": eps, "tie_word_embeddings": bool(facts.tied_embeddings),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "dtype": _HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None, "use_cache": True,
    }
    max_pos = _arg(args, "max_position_embeddings", "seq_length")
    if isinstance(max_pos, int):
        config["n_positions"] = max_pos
    notes = (f"activation {gelu} ({'--openai-gelu' if gelu == 'gelu_new' else 'exact GELU, Megatron default'})",
             f"layer_norm_epsilon {eps:g}" + (" (megatron-core's default)" if _arg(
                 args, "norm_epsilon", "layernorm_epsilon") is None else ""))
    return HFArchitecture(name="GPT2LMHeadModel", config=config, notes=notes,
                          reason="LayerNorm, GELU, learned positions, biases on every linear layer, multi-head")
