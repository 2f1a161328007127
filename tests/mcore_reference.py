"""An independent megatron-core-style GPT forward pass that runs directly on TP shards.

Covers what megatron-core's local spec computes: grouped QKV (GQA; MHA is groups = heads),
gated SwiGLU fc1 ``[W_r; V_r]`` per rank, LayerNorm or RMSNorm, learned or rotary positions,
biases or none, tied or untied output, query/key RMSNorm per head (``qk_norm``), a head dim of
its own (``head_dim``) and a sliding window on every layer (``window``). Each rank works on its
own query groups / FFN slice; the row-parallel outputs are summed and the vocab-parallel logits
concatenated, as under TP. It is checked against megatron-core's own logits in
``test_megatron_core.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Arch:
    """What the forward pass needs besides the tensors."""

    layers: int
    heads: int
    groups: int
    swiglu: bool = False
    rmsnorm: bool = False
    rope: bool = False
    eps: float = 1e-5
    rope_base: float = 10000.0
    qk_norm: bool = False
    head_dim: int | None = None
    #: megatron-core's sliding window's left side on every layer: query i sees keys i - window .. i
    window: int | None = None


def _norm(x: torch.Tensor, sd: dict[str, torch.Tensor], prefix: str, arch: Arch) -> torch.Tensor:
    w = sd[prefix + ".weight"]
    if arch.rmsnorm:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + arch.eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, sd[prefix + ".bias"], arch.eps)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding as megatron-core applies it (non-interleaved halves); x [n, s, d]."""
    d, s = x.shape[-1], x.shape[1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def core_logits(shards: list[dict[str, torch.Tensor]], arch: Arch, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[seq, padded vocab]`` of the model whose TP shards (megatron-core names) are ``shards``."""
    tp = len(shards)
    sds = [{k: v.float() for k, v in sd.items() if isinstance(v, torch.Tensor)} for sd in shards]
    emb = [sd["embedding.word_embeddings.weight"] for sd in sds]
    h = emb[0].shape[1]
    hn = arch.head_dim or h // arch.heads
    q_per = arch.heads // arch.groups
    g_rank = arch.groups // tp
    seq = tokens.shape[0]

    x = torch.zeros(seq, h)
    start = 0
    for e in emb:  # vocab-parallel lookup, summed
        local = tokens - start
        mask = (local >= 0) & (local < e.shape[0])
        x = x + e[local.clamp(0, e.shape[0] - 1)] * mask.unsqueeze(1)
        start += e.shape[0]
    if not arch.rope:
        x = x + sds[0]["embedding.position_embeddings.weight"][:seq]

    causal = torch.full((seq, seq), float("-inf")).triu(1)
    if arch.window is not None:
        causal = causal + torch.full((seq, seq), float("-inf")).tril(-arch.window - 1)
    for i in range(arch.layers):
        p = f"decoder.layers.{i}."
        ln1 = _norm(x, sds[0], p + "input_layernorm", arch)
        attn = torch.zeros(seq, h)
        for sd in sds:
            qkv = ln1 @ sd[p + "self_attention.linear_qkv.weight"].T
            if p + "self_attention.linear_qkv.bias" in sd:
                qkv = qkv + sd[p + "self_attention.linear_qkv.bias"]
            qkv = qkv.reshape(seq, g_rank, q_per + 2, hn)
            q = qkv[:, :, :q_per].reshape(seq, g_rank * q_per, hn).transpose(0, 1)
            k = qkv[:, :, q_per].transpose(0, 1)
            v = qkv[:, :, q_per + 1].transpose(0, 1)
            if arch.qk_norm:  # RMSNorm over each head's dims, before the rotary embedding
                q = _norm(q, sd, p + "self_attention.q_layernorm", arch)
                k = _norm(k, sd, p + "self_attention.k_layernorm", arch)
            if arch.rope:
                q, k = _rope(q, arch.rope_base), _rope(k, arch.rope_base)
            k = k.repeat_interleave(q_per, dim=0)
            v = v.repeat_interleave(q_per, dim=0)
            scores = q @ k.transpose(1, 2) / math.sqrt(hn) + causal
            ctx = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, -1)
            attn = attn + ctx @ sd[p + "self_attention.linear_proj.weight"].T
        x = x + attn + sds[0].get(p + "self_attention.linear_proj.bias", torch.zeros(h))
        ln2 = _norm(x, sds[0], p + "pre_mlp_layernorm", arch)
        mlp = torch.zeros(seq, h)
        for sd in sds:
            a = ln2 @ sd[p + "mlp.linear_fc1.weight"].T
            if p + "mlp.linear_fc1.bias" in sd:
                a = a + sd[p + "mlp.linear_fc1.bias"]
            if arch.swiglu:
                gate, up = a.chunk(2, dim=-1)
                a = F.silu(gate) * up
            else:
                a = F.gelu(a)
            mlp = mlp + a @ sd[p + "mlp.linear_fc2.weight"].T
        x = x + mlp + sds[0].get(p + "mlp.linear_fc2.bias", torch.zeros(h))
    x = _norm(x, sds[0], "decoder.final_layernorm", arch)
    heads = [sd.get("output_layer.weight", e) for sd, e in zip(sds, emb)]
    return torch.cat([x @ w.T for w in heads], dim=1)
