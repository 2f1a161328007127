"""An independent Megatron-style GPT forward pass that runs directly on TP shards.

Each rank's tensors are interpreted with the QKV layout of the checkpoint version; the
row-parallel outputs are summed across ranks and vocab-parallel logits concatenated — the way
the model actually runs under tensor parallelism. If a reshard puts one row in the wrong
place, the logits change.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _find(sd: dict[str, torch.Tensor], suffix: str) -> torch.Tensor:
    hits = [k for k in sd if k.endswith(suffix)]
    if len(hits) != 1:
        raise KeyError(f"{suffix}: {hits}")
    return sd[hits[0]]


def _split_qkv(t: torch.Tensor, npr: int, hn: int, version: float) -> tuple[torch.Tensor, ...]:
    """Per-rank fused QKV rows -> q, k, v each ``[np, hn, *tail]``."""
    tail = t.shape[1:]
    if version == 0:
        q, k, v = t.reshape(3, npr, hn, *tail).unbind(0)
    elif version == 1.0:
        q, k, v = t.reshape(npr, hn, 3, *tail).unbind(2)
    else:
        q, k, v = t.reshape(npr, 3, hn, *tail).unbind(1)
    return q, k, v


def logits_from_shards(shards: list[dict[str, torch.Tensor]], version: float, heads: int, layers: int,
                       tokens: torch.Tensor, prefix: str = "transformer.", attention: str = "attention"
                       ) -> torch.Tensor:
    """Logits ``[seq, vocab]`` of the model whose TP shards are ``shards`` (module state dicts)."""
    tp = len(shards)
    sds = [{k: v.float() for k, v in sd.items()} for sd in shards]
    npr = heads // tp
    emb = [sd["word_embeddings.weight"] for sd in sds]
    h = emb[0].shape[1]
    hn = h // heads
    seq = tokens.shape[0]

    # vocab-parallel embedding: each rank looks up its rows, the results are summed
    x = torch.zeros(seq, h)
    start = 0
    for e in emb:
        local = tokens - start
        mask = (local >= 0) & (local < e.shape[0])
        x = x + e[local.clamp(0, e.shape[0] - 1)] * mask.unsqueeze(1)
        start += e.shape[0]
    x = x + sds[0]["position_embeddings.weight"][:seq]

    causal = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        ln1 = F.layer_norm(x, (h,), sds[0][p + "input_layernorm.weight"], sds[0][p + "input_layernorm.bias"])
        attn_out = torch.zeros(seq, h)
        for sd in sds:
            qw, kw, vw = _split_qkv(sd[p + f"{attention}.query_key_value.weight"], npr, hn, version)
            qb, kb, vb = _split_qkv(sd[p + f"{attention}.query_key_value.bias"], npr, hn, version)
            q = torch.einsum("sh,ndh->nsd", ln1, qw) + qb.unsqueeze(1)
            k = torch.einsum("sh,ndh->nsd", ln1, kw) + kb.unsqueeze(1)
            v = torch.einsum("sh,ndh->nsd", ln1, vw) + vb.unsqueeze(1)
            scores = q @ k.transpose(1, 2) / math.sqrt(hn) + causal
            ctx = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, npr * hn)
            attn_out = attn_out + ctx @ sd[p + f"{attention}.dense.weight"].T
        x = x + attn_out + sds[0][p + f"{attention}.dense.bias"]
        ln2 = F.layer_norm(x, (h,), sds[0][p + "post_attention_layernorm.weight"],
                           sds[0][p + "post_attention_layernorm.bias"])
        mlp_out = torch.zeros(seq, h)
        for sd in sds:
            a = F.gelu(ln2 @ sd[p + "mlp.dense_h_to_4h.weight"].T + sd[p + "mlp.dense_h_to_4h.bias"])
            mlp_out = mlp_out + a @ sd[p + "mlp.dense_4h_to_h.weight"].T
        x = x + mlp_out + sds[0][p + "mlp.dense_4h_to_h.bias"]
    x = F.layer_norm(x, (h,), _find(sds[0], "final_layernorm.weight"), _find(sds[0], "final_layernorm.bias"))
    return torch.cat([x @ e.T for e in emb], dim=1)
