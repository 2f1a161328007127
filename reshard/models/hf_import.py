"""A Hugging Face model folder read as the megatron-core model it computes: ``config.json`` as
Megatron-LM's ``args`` and model facts, its tensors as megatron-core's per-rank module at TP 1
(lazy: each megatron-core tensor a view of the Hugging Face ones, by the architecture's name
table and transforms in :mod:`reshard.models.hf_architectures`).

Pure: no files. The ``hf`` format (:mod:`reshard.formats.hf`) reads the folder.

``config.json`` comes in two layouts, both read (a key missing from both: the class default):

======================  ===========================================  =================================
fact                    transformers 4.x                             transformers 5.x
======================  ===========================================  =================================
rotary base             ``rope_theta``                               ``rope_parameters.rope_theta``
rotary scaling          ``rope_scaling`` (None: none)                ``rope_parameters.rope_type``
weights' dtype          ``torch_dtype``                              ``dtype``
======================  ===========================================  =================================

Only what megatron-core computes exactly is read; anything else (rotary scaling, Qwen's and
Mixtral's sliding-window attention, another activation, biases on some linear layers only) is
refused in one line. Mistral is Llama's arithmetic with a sliding window on every layer (none with
``"sliding_window": null``), which becomes Megatron-LM's ``window_size`` (:func:`window_args`).
Mixtral, Qwen2-MoE and Qwen3-MoE become megatron-core MoE layers (SequentialMLP experts, EP 1:
reshard's ``--target-ep`` deals them out); Qwen3's query/key norms become ``--qk-layernorm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lazy import LazyTensor
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import (
    MTP_HF,
    MTP_SHARED_COPIES,
    NAME_TABLES,
    ROPE_BASE_DEFAULT,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    decide_architecture,
    hf_to_mtp,
    mtp_to_hf,
    sliding_window,
    window_args,
)
from reshard.models.megatron_args import MadeArgs
from reshard.models.megatron_gpt import core_module

#: Tensors some saved folders hold that are buffers, not weights (recomputed by the model).
BUFFERS = (re.compile(r"\.rotary_emb\.inv_freq$"), re.compile(r"^(?:transformer\.)?h\.\d+\.attn\.(?:masked_)?bias$"))
#: The base model's prefix of each class: some folders (the original GPT-2 ones on the hub) hold
#: the base model's names without it, which transformers loads all the same.
BASE_PREFIX = {"GPT2LMHeadModel": "transformer."}
#: Each class's defaults for what a ``config.json`` may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                         "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048},
    # Mistral: Llama's arithmetic (no biases) with a sliding window, which transformers' MistralConfig
    # sets by default (4096): a folder without the key has that window; "sliding_window": null, none.
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                           "max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                         "use_sliding_window": False, "max_position_embeddings": 32768},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
                           "max_position_embeddings": 131072, "sliding_window": None, "num_local_experts": 8,
                           "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                            "use_sliding_window": False, "max_position_embeddings": 32768, "decoder_sparse_step": 1,
                            "mlp_only_layers": [], "norm_topk_prob": False, "qkv_bias": True, "num_experts": 60,
                            "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632, "intermediate_size": 5632},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                         "attention_bias": False, "use_sliding_window": False, "max_position_embeddings": 32768,
                         "head_dim": 128},
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                            "attention_bias": False, "use_sliding_window": False, "max_position_embeddings": 32768,
                            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                            "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "intermediate_size": 6144},
    "GPT2LMHeadModel": {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "activation_function": "gelu_new",
                        "n_positions": 1024, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
}
_ACTIVATIONS = {"gelu": False, "gelu_new": True}  # GPT-2 activation -> Megatron's --openai-gelu


class BuiltinArchitecture(HFArchitectureFamily):
    """A built-in architecture: its name table from :data:`~reshard.models.hf_architectures.NAME_TABLES`,
    its ``config.json`` read by :func:`read_llama_like` (or GPT-2's branch of it) with its class defaults,
    exported as :func:`~reshard.models.hf_architectures.decide_architecture` decides."""

    priority = 0

    def __init__(self, name: str, model_type: str) -> None:
        self.name, self.model_types, self.names = name, (model_type,), NAME_TABLES[name]

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        return read_llama_like(self.name, self.names, {**_DEFAULTS[self.name], **config}, where)


class MistralArchitecture(BuiltinArchitecture):
    """Mistral: Llama's arithmetic without biases, and a sliding window on every layer, which
    megatron-core computes from Megatron-LM's ``window_size`` (:func:`window_args`, both ways).
    Exported as the model reshard decides is Llama without biases when the args give every layer a
    window (:meth:`decide`), or without one under ``--hf-architecture MistralForCausalLM``."""

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS[self.name], **config}
        window = c["sliding_window"]
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise CheckpointFormatError(f"sliding_window {window!r} is not a positive number of tokens", culprit=where,
                                        hint="check config.json (null: no window)")
        # its linear layers have no biases, whatever the config says
        model = read_llama_like(self.name, self.names, {**c, "attention_bias": False, "mlp_bias": False}, where)
        if window is not None:
            vars(model.args).update(window_args(window))
        return model

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model whose args give every layer a window, if the rest is Llama without biases (the
        built-in decision); None otherwise, left to the others and to the registry's check that no
        export drops a window (:func:`~reshard.models.hf_registry.decide_export`)."""
        window = sliding_window(args, facts.num_layers)
        if window is None:
            return None
        try:
            decided = decide_architecture(args, facts, keys, dtype, widths.get("dense"), widths.get("expert"),
                                          widths.get("shared"))
        except LayoutError:
            return None  # not Llama's arithmetic: whichever claims it, the window check refuses it
        if decided.name != LLAMA.name or decided.config.get("attention_bias") or decided.config.get("mlp_bias"):
            return None
        mistral = self.as_llama_without_biases(decided, "mistral", sliding_window=window)
        return dataclasses.replace(mistral, reason=f"{decided.reason}, a sliding window of {window} tokens")

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        return self.as_llama_without_biases(decided, "mistral", sliding_window=None)


LLAMA = BuiltinArchitecture("LlamaForCausalLM", "llama")
MISTRAL = MistralArchitecture("MistralForCausalLM", "mistral")
QWEN2 = BuiltinArchitecture("Qwen2ForCausalLM", "qwen2")
QWEN3 = BuiltinArchitecture("Qwen3ForCausalLM", "qwen3")
MIXTRAL = BuiltinArchitecture("MixtralForCausalLM", "mixtral")
QWEN2_MOE = BuiltinArchitecture("Qwen2MoeForCausalLM", "qwen2_moe")
QWEN3_MOE = BuiltinArchitecture("Qwen3MoeForCausalLM", "qwen3_moe")
GPT2 = BuiltinArchitecture("GPT2LMHeadModel", "gpt2")


def read_llama_like(arch: str, names: NameTable, c: Mapping[str, Any], where: str) -> HFModel:
    """The megatron-core model of a Llama-like (or GPT-2) ``config.json`` ``c`` whose class defaults are
    already filled in (see the module table): a plug-in whose class computes Llama's arithmetic calls
    it with its own name table. :class:`LayoutError` naming the first thing megatron-core does not
    compute exactly."""

    def refuse(what: str) -> LayoutError:
        return LayoutError(f"megatron-core does not compute this {arch} exactly: {what}", culprit=where,
                           hint="only models Megatron-LM reproduces exactly are imported")

    def need(*keys: str) -> int:
        for k in keys:
            if isinstance(c.get(k), int):
                return int(c[k])
        raise CheckpointFormatError(f"has no integer {keys[0]}", culprit=where, hint="check config.json")

    vocab = need("vocab_size")
    if arch == "GPT2LMHeadModel":
        hidden, layers, heads = need("n_embd", "hidden_size"), need("n_layer"), need("n_head")
        act = c["activation_function"]
        if act not in _ACTIVATIONS:
            raise refuse(f"activation {act} (Megatron has gelu and gelu_new)")
        if not c["scale_attn_weights"] or c["scale_attn_by_inverse_layer_idx"]:
            raise refuse("attention scores not scaled by 1/sqrt(head dim)")
        ffn = c.get("n_inner") or 4 * hidden
        groups, head_dim = heads, hidden // heads
        arch_args: dict[str, Any] = dict(
            normalization="LayerNorm", norm_epsilon=float(c["layer_norm_epsilon"]), swiglu=False,
            openai_gelu=_ACTIVATIONS[act], position_embedding_type="learned_absolute", add_bias_linear=True,
            add_qkv_bias=True, max_position_embeddings=need("n_positions"))
    else:
        if c["hidden_act"] != "silu":
            raise refuse(f"activation {c['hidden_act']} (Megatron's SwiGLU is silu)")
        if c.get("use_sliding_window"):
            raise refuse("sliding-window attention")
        base, rope_type, partial = _rope(c)
        if rope_type != "default":
            raise refuse(f"rotary scaling {rope_type}")
        if partial != 1.0:
            raise refuse(f"partial rotary factor {partial}")
        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        groups = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        ffn = need("intermediate_size")
        if arch == "Qwen2ForCausalLM":
            qkv_bias, linear_bias = True, False
        elif arch in _QWEN3:
            if c["attention_bias"]:
                raise refuse("biases on the attention layers but not the MLP (Megatron has them on all linear "
                             "layers or on QKV alone)")
            qkv_bias = linear_bias = False
        elif arch in _MOE:
            qkv_bias, linear_bias = arch == "Qwen2MoeForCausalLM" and bool(c["qkv_bias"]), False
        else:
            if c["attention_bias"] != c["mlp_bias"]:
                raise refuse("biases on the attention or the MLP layers only (Megatron has them on all or none, "
                             "or on QKV alone)")
            qkv_bias = linear_bias = bool(c["attention_bias"])
        arch_args = dict(
            normalization="RMSNorm", norm_epsilon=float(c["rms_norm_eps"]), swiglu=True,
            position_embedding_type="rope", rotary_base=base, rotary_percent=1.0, rotary_interleaved=False,
            add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, max_position_embeddings=need("max_position_embeddings"),
            qk_layernorm=arch in _QWEN3)
        if arch in _MOE:
            arch_args.update(_moe_args(arch, c, layers, need, refuse, where))
    tied = bool(c["tie_word_embeddings"])
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
    return HFModel(arch, args, facts, names, BASE_PREFIX.get(arch))


#: The mixture-of-experts architectures (:func:`_moe_args`).
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
#: The architectures with query/key layer norms (megatron-core's ``--qk-layernorm``).
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _moe_args(arch: str, c: Mapping[str, Any], layers: int, need: Callable[..., int],
              refuse: Callable[[str], LayoutError], where: str) -> dict[str, Any]:
    """Megatron-LM's MoE args for a Mixtral, Qwen2-MoE or Qwen3-MoE config: megatron-core's
    SequentialMLP experts at TP 1, EP 1; the router's top-k of the softmax, renormalized unless
    ``--moe-router-pre-softmax`` (Qwen's ``norm_topk_prob`` false; Mixtral always renormalizes);
    Qwen2-MoE's shared expert gated by a sigmoid (Qwen3-MoE has none); Qwen's dense layers
    (``mlp_only_layers``, ``decoder_sparse_step``) as ``moe_layer_freq``."""
    if arch == "MixtralForCausalLM":
        if c.get("sliding_window") is not None:
            raise refuse("sliding-window attention")
        experts, moe_ffn, shared, pre_softmax, freq = need("num_local_experts"), need("intermediate_size"), None, \
            False, [1] * layers
    else:
        step, dense = need("decoder_sparse_step"), set(c.get("mlp_only_layers") or ())
        if step < 1:
            raise CheckpointFormatError(f"decoder_sparse_step is {step}", culprit=where, hint="check config.json")
        experts, moe_ffn = need("num_experts", "num_local_experts"), need("moe_intermediate_size")  # 5.x: local
        shared = need("shared_expert_intermediate_size") if arch == "Qwen2MoeForCausalLM" else None
        pre_softmax = not c["norm_topk_prob"]
        freq = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if experts < 1 or not any(freq):
        raise refuse("no MoE layer")
    return dict(num_experts=experts, moe_router_topk=need("num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None,
                moe_router_pre_softmax=pre_softmax, moe_router_score_function="softmax",
                moe_router_enable_expert_bias=False, moe_layer_freq=1 if all(freq) else freq,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1, moe_grouped_gemm=False)


def _rope(c: Mapping[str, Any]) -> tuple[float, str, float]:
    """(rotary base, rotary scaling type, partial rotary factor) from either config layout."""
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


def core_tensors(tensors: Mapping[str, LazyTensor], model: HFModel) -> dict[str, Any]:
    """megatron-core's per-rank module at TP 1 from the Hugging Face ``tensors`` (name -> lazy
    tensor): each row of the architecture's name table gathers its Hugging Face tensors into the
    megatron-core tensor (local-spec names), then megatron-core's order and extra states. A tensor
    no row names, or one a row misses, is an error; a tied model's ``lm_head`` copy is dropped
    (transformers ties it to the embedding on load, as megatron-core does); names saved without
    the base model's prefix (:data:`BASE_PREFIX`) are read with it."""
    table = model.names
    prefix = model.base_prefix
    if prefix and not any(k.startswith(prefix) for k in tensors):
        tensors = {(k if k.startswith("lm_head.") else prefix + k): v for k, v in tensors.items()}
    if any(row.hf and row.hf[0].startswith(MTP_HF) for row in table):  # multi-token prediction layers
        tensors = {hf_to_mtp(k, model.facts.num_layers): v for k, v in tensors.items()}
    found: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
    for name in tensors:
        if any(p.search(name) for p in BUFFERS) or MTP_SHARED_COPIES.match(name):
            continue
        hit = next(((i, j, m) for i, row in enumerate(table) if row.transform is not None
                    for j, m in enumerate(p.match(name) for p in row.hf_patterns) if m), None)
        if hit is None:
            name = mtp_to_hf(name, model.facts.num_layers)
            raise CheckpointFormatError(f"{name} has no counterpart in megatron-core's {model.architecture}",
                                        culprit=name, hint="import a model of the architecture config.json names")
        i, j, m = hit
        found.setdefault((i, tuple(sorted(m.groupdict().items()))), {})[j] = name
    module: dict[str, Any] = {}
    stacks: dict[tuple[Any, ...], dict[str, int]] = {}  # slabs of the stacked tensors of one layer
    for (i, fields), parts in found.items():
        row = table[i]
        names = tuple(t.format(**dict(fields)) for t in row.hf)
        missing = [n for j, n in enumerate(names) if j not in parts]
        if missing:
            missing = [mtp_to_hf(n, model.facts.num_layers) for n in missing]
            raise CheckpointFormatError(f"{missing[0]} is missing (beside {parts[min(parts)]})", culprit=missing[0],
                                        hint="the weights are incomplete; re-copy the folder")
        transform: Any = row.transform  # never None: such rows match no name above
        if transform.stacks is not None:  # one Hugging Face tensor, many megatron-core ones
            fanned = transform.fan_out(names, [tensors[n] for n in names], model.facts)
            counts = stacks.setdefault((transform.stacks, fields), {})
            counts[names[0]] = len(fanned)
            if len(set(counts.values())) > 1:
                held = ", ".join(f"{n} {c}" for n, c in counts.items())
                raise CheckpointFormatError(f"stacked tensors of one layer hold different numbers of "
                                            f"{transform.stacks}s: {held}", culprit=names[0],
                                            hint="the weights are incomplete; re-copy the folder")
            for j, t in enumerate(fanned):
                module[row.core[0].format(**dict(fields), **{transform.stacks: j})] = t
            continue
        key = row.core[0].format(**dict(fields))
        if key == "output_layer.weight" and model.facts.tied_embeddings:
            continue
        module[key] = transform.gather(names, [tensors[n] for n in names], model.facts)
    _check_layers(module, model)
    return core_module(module)


def _check_layers(module: Mapping[str, Any], model: HFModel) -> None:
    layers = {int(k.split(".")[2]) for k in module if k.startswith("decoder.layers.")}
    if layers != set(range(model.facts.num_layers)):
        raise CheckpointFormatError(f"holds layers {sorted(layers)[:8]}{'...' if len(layers) > 8 else ''}, "
                                    f"config.json says {model.facts.num_layers}", culprit="config.json",
                                    hint="the weights and config.json do not belong together")
    emb = module.get("embedding.word_embeddings.weight")
    if not isinstance(emb, LazyTensor) or emb.shape != (model.facts.vocab_size, model.facts.hidden):
        shape = tuple(emb.shape) if isinstance(emb, LazyTensor) else None
        raise CheckpointFormatError(f"the input embedding is {shape}, config.json implies "
                                    f"{(model.facts.vocab_size, model.facts.hidden)}", culprit="config.json",
                                    hint="the weights and config.json do not belong together")


def megatron_state(tensors: Mapping[str, LazyTensor], model: HFModel) -> dict[str, Any]:
    """What Megatron-LM's per-rank file of a TP 1 ``release`` checkpoint holds for this model:
    ``args`` (with the weights' dtype; completed as Megatron-LM's own when written:
    :class:`~reshard.models.megatron_args.MadeArgs`),
    the checkpoint version, the module (:func:`core_tensors`)."""
    module = core_tensors(tensors, model)
    dtype = module["embedding.word_embeddings.weight"].dtype
    args = MadeArgs(**vars(model.args), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                    fp16=dtype == torch.float16)
    mtp = {int(k.split(".")[2]) for k in module if k.startswith("mtp.layers.")}
    for i in sorted(mtp):  # a layer beyond num_hidden_layers is one only with its own modules
        if f"mtp.layers.{i}.eh_proj.weight" not in module or i >= len(mtp):
            where = f"model.layers.{model.facts.num_layers + i}"
            raise CheckpointFormatError(f"{where} is beyond num_hidden_layers {model.facts.num_layers} but no "
                                        "multi-token prediction layer (no eh_proj, or one missing before it)",
                                        culprit=where, hint="check num_hidden_layers in config.json")
    if mtp:  # the multi-token prediction layers the folder holds (its config's count may be a default)
        args.mtp_num_layers = len(mtp)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": module}
