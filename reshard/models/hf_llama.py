"""``LlamaForCausalLM`` both ways, and what its kin (Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE) build on: Llama's name table, the reading of a Llama-like ``config.json`` and the shape
of a Llama-like megatron-core model an export decides by.

Llama: RMSNorm, SwiGLU, rotary (whole head, not interleaved, no scaling), no linear biases — or
biases on every linear layer (``attention_bias``, ``mlp_bias``). megatron-core's rotary embedding
rotates the two halves of each head (``rotate_half``), as transformers' Llama does, so no row
permutation is needed.

``config.json`` comes in two layouts, both read (a key missing from both: the class default):

======================  ===========================================  =================================
fact                    transformers 4.x                             transformers 5.x
======================  ===========================================  =================================
rotary base             ``rope_theta``                               ``rope_parameters.rope_theta``
rotary scaling          ``rope_scaling`` (None: none)                ``rope_parameters.rope_type``
weights' dtype          ``torch_dtype``                              ``dtype``
======================  ===========================================  =================================

Only what megatron-core computes exactly is read; anything else (rotary scaling, sliding-window
attention, another activation, biases on some linear layers only) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    HF_DTYPES,
    LINEAR,
    GatedSplit,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    QKVSplit,
    Same,
    VocabRows,
    name_table,
)
from reshard.models.hf_common import (
    CORE_LAYER,
    EXTRA_STATE,
    HF_LAYER,
    NORM_EPS_DEFAULT,
    ROPE_BASE_DEFAULT,
    Refuse,
    asked_in_turn,
    config_int,
    decided_norm,
    has_key,
    import_refusal,
    megatron_model,
    not_exact,
    rope_of,
)

_L, _H = CORE_LAYER, HF_LAYER
#: megatron-core names (local spec first, then Transformer Engine's) <-> Hugging Face names
#: (Llama's, and the layers its kin share with it).
LLAMA_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", VocabRows(), ("model.embed_tokens.weight",)),
    ((_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"), Same(),
     (_H + "input_layernorm.weight",)),
    (_L + "self_attention.linear_qkv.{p}", QKVSplit(),
     (_H + "self_attn.q_proj.{p}", _H + "self_attn.k_proj.{p}", _H + "self_attn.v_proj.{p}"), LINEAR),
    (_L + "self_attention.linear_proj.{p}", Same(), (_H + "self_attn.o_proj.{p}",), LINEAR),
    ((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"), Same(),
     (_H + "post_attention_layernorm.weight",)),
    (_L + "mlp.linear_fc1.{p}", GatedSplit(), (_H + "mlp.gate_proj.{p}", _H + "mlp.up_proj.{p}"), LINEAR),
    (_L + "mlp.linear_fc2.{p}", Same(), (_H + "mlp.down_proj.{p}",), LINEAR),
    ("decoder.final_layernorm.weight", Same(), ("model.norm.weight",)),
    ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
    (EXTRA_STATE, None, ()),
)

#: Reads a Llama-like ``config.json``'s biases as (QKV bias, other linear biases), or refuses.
Biases = Callable[[Mapping[str, Any], Refuse], tuple[bool, bool]]
#: Megatron-LM's MoE ``args`` of a mixture-of-experts ``config.json`` (``c``, ``layers``, ``need``,
#: ``refuse``, ``where``).
MoEArgs = Callable[[Mapping[str, Any], int, Callable[..., int], Refuse, str], dict[str, Any]]


def llama_biases(c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
    """Llama's: biases on every linear layer or none."""
    if c["attention_bias"] != c["mlp_bias"]:
        raise refuse("biases on the attention or the MLP layers only (Megatron has them on all or none, "
                     "or on QKV alone)")
    return bool(c["attention_bias"]), bool(c["attention_bias"])


def read_llama_like(arch: str, names: NameTable, c: Mapping[str, Any], where: str, *,
                    biases: Biases = llama_biases, qk_norm: bool = False, moe: MoEArgs | None = None) -> HFModel:
    """The megatron-core model of a Llama-like ``config.json`` ``c`` whose class defaults are already
    filled in: a plug-in whose class computes Llama's arithmetic calls it with its own name table;
    Llama's kin give their ``biases``, query/key norms (``qk_norm``, megatron-core's
    ``--qk-layernorm``) and MoE layers (``moe``). :class:`LayoutError` naming the first thing
    megatron-core does not compute exactly."""
    refuse, need = import_refusal(arch, where), config_int(c, where)
    vocab = need("vocab_size")
    if c["hidden_act"] != "silu":
        raise refuse(f"activation {c['hidden_act']} (Megatron's SwiGLU is silu)")
    if c.get("use_sliding_window"):
        raise refuse("sliding-window attention")
    base, rope_type, partial = rope_of(c)
    if rope_type != "default":
        raise refuse(f"rotary scaling {rope_type}")
    if partial != 1.0:
        raise refuse(f"partial rotary factor {partial}")
    hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    groups = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    ffn = need("intermediate_size")
    qkv_bias, linear_bias = biases(c, refuse)
    arch_args = dict(
        normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True,
        position_embedding_type="rope", rotary_base=base, rotary_percent=1.0, rotary_interleaved=False,
        add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, max_position_embeddings=need("max_position_embeddings"),
        qk_layernorm=qk_norm)
    if moe is not None:
        arch_args.update(moe(c, layers, need, refuse, where))
    return megatron_model(arch, names, vocab=vocab, hidden=hidden, layers=layers, heads=heads, groups=groups,
                          head_dim=head_dim, ffn=ffn, tied=bool(c["tie_word_embeddings"]), arch_args=arch_args)


@dataclass(frozen=True)
class LlamaShape:
    """A megatron-core model with Llama's arithmetic (RMSNorm, SwiGLU, whole-head rotary), as an
    export sees it: the ``config.json`` entries Llama and its kin share, the notes, which linear
    layers have biases, and whether it has query/key norms and MoE layers (what tells the kin apart)."""

    config: dict[str, Any]
    notes: tuple[str, ...]
    qkv_bias: bool
    proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: bool

    @property
    def where_biased(self) -> str:
        """The layers with biases, for a refusal."""
        return " and ".join(n for n, b in (("QKV", self.qkv_bias), ("attention output", self.proj_bias),
                                           ("MLP", self.mlp_bias)) if b)


@asked_in_turn
def llama_shape(args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
                widths: Mapping[str, int]) -> LlamaShape | None:
    """The Llama-like shape of a megatron-core model (None: a LayerNorm model, GPT-2's), or the
    refusal of what no Llama-like architecture computes — the same whichever of them asks."""
    norm, qk_norm = decided_norm(args, facts, keys)
    if norm == "LayerNorm":
        return None
    has = has_key(keys)
    if norm != "RMSNorm":
        raise not_exact(f"normalization is {norm}")
    if not facts.swiglu:
        raise not_exact("the MLP is not SwiGLU")
    if saved_arg(args, "position_embedding_type") != "rope" or has(r"position_embeddings\."):
        raise not_exact(f"position embedding {saved_arg(args, 'position_embedding_type') or 'unknown'} (rotary "
                        "needed)")
    percent = float(saved_arg(args, "rotary_percent", default=1.0))
    if percent != 1.0:
        raise not_exact(f"rotary_percent {percent} (the whole head must rotate)")
    qkv_bias, proj_bias = has(r"linear_qkv\.bias$"), has(r"linear_proj\.bias$")
    mlp_bias = has(r"linear_fc1\.bias$") or has(r"linear_fc2\.bias$")
    vocab = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
    base = float(saved_arg(args, "rotary_base", default=ROPE_BASE_DEFAULT))
    eps = float(saved_arg(args, "norm_epsilon", default=NORM_EPS_DEFAULT))
    config: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": facts.hidden, "intermediate_size": widths.get("dense"),
        "num_hidden_layers": facts.num_layers, "num_attention_heads": facts.heads,
        "num_key_value_heads": facts.query_groups, "head_dim": facts.head_dim, "hidden_act": "silu",
        "rms_norm_eps": eps, "rope_theta": base, "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "tie_word_embeddings": bool(facts.tied_embeddings), "dtype": HF_DTYPES.get(dtype, str(dtype)),
        "bos_token_id": None, "eos_token_id": None, "use_cache": True,
    }
    max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
    if isinstance(max_pos, int):
        config["max_position_embeddings"] = max_pos
    notes = (f"rope_theta {base:g}" + (" (megatron-core's default: args do not record it)"
                                       if saved_arg(args, "rotary_base") is None else ""),
             f"rms_norm_eps {eps:g}"
             + (" (megatron-core's default)" if saved_arg(args, "norm_epsilon") is None else ""))
    shape = LlamaShape(config, notes, qkv_bias, proj_bias, mlp_bias, qk_norm, has(r"\.mlp\.router\.weight$"))
    if qk_norm and (qkv_bias != proj_bias or mlp_bias):
        raise not_exact(f"query/key layer norms with biases on the {shape.where_biased} layers (Qwen3 has them on "
                        "the attention layers alone, or none)")
    return shape


class LlamaLike(HFArchitectureFamily):
    """A built-in class with Llama's arithmetic: its ``config.json`` read by :func:`read_llama_like`
    with its class defaults (:attr:`defaults`), its biases (:meth:`biases`), query/key norms
    (:attr:`qk_norm`) and MoE layers (:meth:`moe_args`). Its :meth:`decide` claims a model by its
    shape (:func:`llama_shape`), after the classes that claim a model only they compute."""

    priority = 0
    fallback = True
    #: The class's defaults for what a ``config.json`` may leave out.
    defaults: Mapping[str, Any] = {}
    #: Query/key RMSNorm per head (megatron-core's ``--qk-layernorm``).
    qk_norm = False

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        return read_llama_like(self.name, self.names, {**self.defaults, **config}, where, biases=self.biases,
                               qk_norm=self.qk_norm, moe=self.moe_args)

    def biases(self, c: Mapping[str, Any], refuse: Refuse) -> tuple[bool, bool]:
        """Import: (QKV bias, other linear biases) of the filled-in ``config.json`` ``c``. Default: Llama's."""
        return llama_biases(c, refuse)

    def moe_args(self, c: Mapping[str, Any], layers: int, need: Callable[..., int], refuse: Refuse,
                 where: str) -> dict[str, Any]:
        """Import: Megatron-LM's MoE ``args`` (default: none; a class with MoE layers overrides this)."""
        return {}


class Llama(LlamaLike):
    name = "LlamaForCausalLM"
    model_types = ("llama",)
    names = LLAMA_NAMES
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "max_position_embeddings": 2048}

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A dense model without query/key norms whose biases are on every linear layer or none (biases
        on QKV alone are Qwen2's)."""
        shape = llama_shape(args, facts, keys, dtype, widths)
        if shape is None or shape.moe or shape.qk_norm or (shape.qkv_bias and not shape.proj_bias
                                                           and not shape.mlp_bias):
            return None
        if shape.qkv_bias != shape.proj_bias or (shape.mlp_bias and not shape.qkv_bias):
            raise not_exact(f"biases on the {shape.where_biased} layers only (Llama has them on all or none, Qwen2 "
                            "on QKV alone)")
        config = {**shape.config, "attention_bias": shape.qkv_bias, "mlp_bias": shape.mlp_bias}
        return HFArchitecture(name=self.name, config={"architectures": [self.name], "model_type": "llama", **config},
                              reason="RMSNorm, SwiGLU, rotary" + (", biases on every linear layer" if shape.qkv_bias
                                                                  else ", no linear biases"),
                              notes=shape.notes, names=self.names)


LLAMA = Llama()
