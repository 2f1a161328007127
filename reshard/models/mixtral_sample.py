"""Hugging Face ``MixtralForCausalLM``'s names and ``config.json``, by role, for a writer that lays a
model out from its roles (the sample folder of :func:`reshard.sample.write_mixtral_sample`): the
architecture's names live with the model families, not in the writer. How reshard maps these
names to megatron-core's is the architecture's name table
(:data:`reshard.models.hf_architectures.MIXTRAL_NAMES`)."""

from __future__ import annotations

#: Names by role: the model's own, and a layer's (``layer + role``; ``{i}``: the layer) and a routed
#: expert's (``layer + expert + role``; ``{e}``: the expert).
MIXTRAL_ROLES: dict[str, str] = {
    "embedding": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight",
    "layer": "model.layers.{i}.", "ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "router": "block_sparse_moe.gate.weight",
    "expert": "block_sparse_moe.experts.{e}.", "gate": "w1.weight", "down": "w2.weight", "up": "w3.weight",
}


def mixtral_config_json(*, vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                        head_dim: int, seq: int, experts: int, topk: int) -> dict[str, object]:
    """The ``config.json`` transformers writes for such a model (bf16, untied, no sliding window)."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_act": "silu", "max_position_embeddings": seq, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
            "tie_word_embeddings": False, "num_local_experts": experts, "num_experts_per_tok": topk,
            "sliding_window": None, "router_aux_loss_coef": 0.02, "output_router_logits": False,
            "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
            "use_cache": True, "dtype": "bfloat16"}
