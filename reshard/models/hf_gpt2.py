"""``GPT2LMHeadModel`` both ways: LayerNorm, GELU (exact; ``gelu_new`` with ``--openai-gelu``),
learned absolute positions, biases on every linear layer, multi-head attention (legacy Megatron
GPT, megatron-core's GPT with those settings). Its linear layers are ``Conv1D`` (weights stored
``[in, out]``: transposed, whole tensors) and its fused ``c_attn`` holds all queries, then all keys,
then all values. Some folders (the original GPT-2 ones on the hub) hold the base model's names
without its ``transformer.`` prefix, which transformers loads all the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.plan_types import ModelFacts
from reshard.models.facts import saved_arg
from reshard.models.hf_architectures import (
    GPT2QKV,
    HF_DTYPES,
    Conv1D,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameTable,
    Same,
    VocabRows,
    name_table,
)
from reshard.models.hf_common import (
    CORE_LAYER,
    EXTRA_STATE,
    NORM_EPS_DEFAULT,
    config_int,
    decided_norm,
    has_key,
    import_refusal,
    megatron_model,
    not_exact,
)

_L, _G = CORE_LAYER, "transformer.h.{layer}."
#: megatron-core names <-> GPT-2 names.
GPT2_NAMES: NameTable = name_table(
    ("embedding.word_embeddings.weight", VocabRows(), ("transformer.wte.weight",)),
    ("embedding.position_embeddings.weight", Same(), ("transformer.wpe.weight",)),
    ((_L + "input_layernorm.{p}", _L + "self_attention.linear_qkv.layer_norm_{p}"), Same(), (_G + "ln_1.{p}",)),
    (_L + "self_attention.linear_qkv.weight", GPT2QKV(), (_G + "attn.c_attn.weight",)),
    (_L + "self_attention.linear_qkv.bias", GPT2QKV(), (_G + "attn.c_attn.bias",)),
    (_L + "self_attention.linear_proj.weight", Conv1D(), (_G + "attn.c_proj.weight",)),
    (_L + "self_attention.linear_proj.bias", Same(), (_G + "attn.c_proj.bias",)),
    ((_L + "pre_mlp_layernorm.{p}", _L + "mlp.linear_fc1.layer_norm_{p}"), Same(), (_G + "ln_2.{p}",)),
    (_L + "mlp.linear_fc1.weight", Conv1D(), (_G + "mlp.c_fc.weight",)),
    (_L + "mlp.linear_fc1.bias", Same(), (_G + "mlp.c_fc.bias",)),
    (_L + "mlp.linear_fc2.weight", Conv1D(), (_G + "mlp.c_proj.weight",)),
    (_L + "mlp.linear_fc2.bias", Same(), (_G + "mlp.c_proj.bias",)),
    ("decoder.final_layernorm.{p}", Same(), ("transformer.ln_f.{p}",)),
    ("output_layer.weight", VocabRows(), ("lm_head.weight",)),
    (EXTRA_STATE, None, ()),
)
#: GPT-2's attention masks, which some saved folders hold: buffers, not weights (not imported).
MASK_BUFFER = re.compile(r"^(?:transformer\.)?h\.\d+\.attn\.(?:masked_)?bias$")
#: GPT-2's activations -> Megatron's ``--openai-gelu``.
ACTIVATIONS = {"gelu": False, "gelu_new": True}


class Gpt2(HFArchitectureFamily):
    name = "GPT2LMHeadModel"
    priority = 0
    fallback = True
    model_types = ("gpt2",)
    names = GPT2_NAMES
    #: GPT2Config's defaults for what a ``config.json`` may leave out.
    defaults: Mapping[str, Any] = {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                                   "activation_function": "gelu_new", "n_positions": 1024,
                                   "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}

    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        return None if MASK_BUFFER.match(name) else name

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**self.defaults, **config}
        refuse, need = import_refusal(self.name, where), config_int(c, where)
        vocab = need("vocab_size")
        hidden, layers, heads = need("n_embd", "hidden_size"), need("n_layer"), need("n_head")
        act = c["activation_function"]
        if act not in ACTIVATIONS:
            raise refuse(f"activation {act} (Megatron has gelu and gelu_new)")
        if not c["scale_attn_weights"] or c["scale_attn_by_inverse_layer_idx"]:
            raise refuse("attention scores not scaled by 1/sqrt(head dim)")
        arch_args: dict[str, Any] = dict(
            normalization="LayerNorm", norm_epsilon=float(c["layer_norm_epsilon"]), swiglu=False,
            openai_gelu=ACTIVATIONS[act], position_embedding_type="learned_absolute", add_bias_linear=True,
            add_qkv_bias=True, max_position_embeddings=need("n_positions"))
        return megatron_model(self.name, self.names, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                              groups=heads, head_dim=hidden // heads, ffn=c.get("n_inner") or 4 * hidden,
                              tied=bool(c["tie_word_embeddings"]), arch_args=arch_args, base_prefix="transformer.")

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A LayerNorm model: GELU, learned absolute positions, biases on every linear layer, multi-head."""
        norm, _ = decided_norm(args, facts, keys)
        if norm != "LayerNorm":
            return None
        has = has_key(keys)
        if facts.swiglu:
            raise not_exact("LayerNorm with a SwiGLU MLP (GPT-2 has a plain GELU MLP)")
        if saved_arg(args, "position_embedding_type", default="learned_absolute") != "learned_absolute" or \
                not has(r"^embedding\.position_embeddings\."):
            raise not_exact("LayerNorm without learned absolute positions (GPT-2 learns them)")
        if facts.query_groups != facts.heads:
            raise not_exact(f"{facts.query_groups} query groups for {facts.heads} heads (GPT-2 has multi-head "
                            "attention)")
        if facts.head_dim * facts.heads != facts.hidden:
            raise not_exact("head dim x heads differs from the hidden size, which GPT-2 assumes")
        missing = [n for n, pat in (("QKV", r"linear_qkv\.bias$"), ("attention output", r"linear_proj\.bias$"),
                                    ("MLP", r"linear_fc1\.bias$")) if not has(pat)]
        if missing:
            raise not_exact(f"no biases on the {' and '.join(missing)} layers (GPT-2 has them on every linear layer)")
        rows = facts.vocab_size or facts.padded_vocab_target or facts.padded_vocab_source
        eps = float(saved_arg(args, "norm_epsilon", default=NORM_EPS_DEFAULT))
        gelu = "gelu_new" if saved_arg(args, "openai_gelu", default=False) else "gelu"
        config: dict[str, Any] = {
            "architectures": [self.name], "model_type": "gpt2", "vocab_size": rows, "n_embd": facts.hidden,
            "n_layer": facts.num_layers, "n_head": facts.heads, "n_inner": widths.get("dense"),
            "activation_function": gelu, "layer_norm_epsilon": eps, "tie_word_embeddings": bool(facts.tied_embeddings),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "dtype": HF_DTYPES.get(dtype, str(dtype)), "bos_token_id": None, "eos_token_id": None, "use_cache": True,
        }
        max_pos = saved_arg(args, "max_position_embeddings", "seq_length")
        if isinstance(max_pos, int):
            config["n_positions"] = max_pos
        notes = (f"activation {gelu} ({'--openai-gelu' if gelu == 'gelu_new' else 'exact GELU, Megatron default'})",
                 f"layer_norm_epsilon {eps:g}" + (" (megatron-core's default)"
                                                  if saved_arg(args, "norm_epsilon") is None else ""))
        return HFArchitecture(name=self.name, config=config, notes=notes, names=self.names,
                              reason="LayerNorm, GELU, learned positions, biases on every linear layer, multi-head")


GPT2 = Gpt2()
