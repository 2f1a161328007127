"""Write small, realistic legacy-GPT tensor-parallel checkpoints (demo, tests, benchmarks).

The layout code here is deliberately written independently of ``reshard.core``: it builds
the full logical weights first and lays each rank out with reshape/permute per version, so
tests that reshard these files check the engine against a second implementation.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a small legacy Megatron GPT."""

    layers: int = 2
    hidden: int = 64
    heads: int = 8
    vocab: int = 128
    seq: int = 32
    ffn_mult: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def full_weights(cfg: GPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unsharded logical weights (fp32), named by role, not by checkpoint key."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, f = cfg.hidden, cfg.ffn_mult * cfg.hidden
    w = {"word_embeddings": r(cfg.vocab, h, scale=0.5), "position_embeddings": r(cfg.seq, h, scale=0.5),
         "final_ln.weight": 1 + r(h), "final_ln.bias": r(h)}
    for i in range(cfg.layers):
        w |= {f"{i}.ln1.weight": 1 + r(h), f"{i}.ln1.bias": r(h),
              f"{i}.q.weight": r(h, h), f"{i}.k.weight": r(h, h), f"{i}.v.weight": r(h, h),
              f"{i}.q.bias": r(h), f"{i}.k.bias": r(h), f"{i}.v.bias": r(h),
              f"{i}.dense.weight": r(h, h), f"{i}.dense.bias": r(h),
              f"{i}.ln2.weight": 1 + r(h), f"{i}.ln2.bias": r(h),
              f"{i}.h4h.weight": r(f, h), f"{i}.h4h.bias": r(f),
              f"{i}.4hh.weight": r(h, f), f"{i}.4hh.bias": r(h)}
    return w


def _qkv_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, tp: int, rank: int,
              version: float) -> torch.Tensor:
    """One rank's fused QKV rows (weight ``[h_out, h]`` or bias ``[h_out]``) for a version."""
    npr = heads // tp
    tail = q.shape[1:]

    def mine(x: torch.Tensor) -> torch.Tensor:  # [np, hn, *tail] for this rank's heads
        return x.reshape(heads, -1, *tail)[rank * npr:(rank + 1) * npr]

    qs, ks, vs = mine(q), mine(k), mine(v)
    if version == 0:
        return torch.cat([qs.reshape(-1, *tail), ks.reshape(-1, *tail), vs.reshape(-1, *tail)])
    if version == 1.0:  # [np, hn, 3]
        return torch.stack([qs, ks, vs], dim=2).reshape(-1, *tail)
    return torch.stack([qs, ks, vs], dim=1).reshape(-1, *tail)  # [np, 3, hn]


def shard_state_dicts(cfg: GPTConfig, w: dict[str, torch.Tensor], tp: int, version: float,
                      prefix: str = "transformer.", attention: str = "attention",
                      dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """The module state dict of every rank, legacy Megatron names."""
    out = []
    for rank in range(tp):
        def col(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(tp, dim=0)[rank]

        def row(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(tp, dim=1)[rank]

        sd: dict[str, torch.Tensor] = {"word_embeddings.weight": col(w["word_embeddings"]),
                                       "position_embeddings.weight": w["position_embeddings"]}
        for i in range(cfg.layers):
            p = f"{prefix}layers.{i}."
            sd |= {
                p + "input_layernorm.weight": w[f"{i}.ln1.weight"], p + "input_layernorm.bias": w[f"{i}.ln1.bias"],
                p + f"{attention}.query_key_value.weight":
                    _qkv_rank(w[f"{i}.q.weight"], w[f"{i}.k.weight"], w[f"{i}.v.weight"], cfg.heads, tp, rank, version),
                p + f"{attention}.query_key_value.bias":
                    _qkv_rank(w[f"{i}.q.bias"], w[f"{i}.k.bias"], w[f"{i}.v.bias"], cfg.heads, tp, rank, version),
                p + f"{attention}.dense.weight": row(w[f"{i}.dense.weight"]),
                p + f"{attention}.dense.bias": w[f"{i}.dense.bias"],
                p + "post_attention_layernorm.weight": w[f"{i}.ln2.weight"],
                p + "post_attention_layernorm.bias": w[f"{i}.ln2.bias"],
                p + "mlp.dense_h_to_4h.weight": col(w[f"{i}.h4h.weight"]),
                p + "mlp.dense_h_to_4h.bias": col(w[f"{i}.h4h.bias"]),
                p + "mlp.dense_4h_to_h.weight": row(w[f"{i}.4hh.weight"]),
                p + "mlp.dense_4h_to_h.bias": w[f"{i}.4hh.bias"],
            }
        sd |= {f"{prefix}final_layernorm.weight": w["final_ln.weight"],
               f"{prefix}final_layernorm.bias": w["final_ln.bias"]}
        out.append({k: v.to(dtype).clone() for k, v in sd.items()})
    return out


def write_sample_checkpoint(folder: str | os.PathLike[str], *, tp: int = 8, cfg: GPTConfig | None = None,
                            version: float = 2.0, dtype: torch.dtype = torch.float32, seed: int = 0,
                            save_args: bool = True, save_version: bool = True, module_key: str = "module",
                            zero_stage: int = 1) -> list[Path]:
    """Write ``mp_rank_XX_model_states.pt`` files as DeepSpeed saves them; returns the paths."""
    cfg = cfg or GPTConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = full_weights(cfg, seed)
    modules = shard_state_dicts(cfg, w, tp, version, dtype=dtype)
    paths = []
    for rank, module in enumerate(modules):
        sd: dict[str, object] = {
            module_key: module, "mp_world_size": tp, "dp_world_size": 1, "iteration": 1000,
            "global_steps": 1000, "ds_version": "0.19.8", "buffer_names": [],
            "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": zero_stage}},
            "lr_scheduler": {"last_epoch": 1000}, "optimizer": None,
            "random_rng_state": torch.zeros(8, dtype=torch.uint8),
        }
        if save_version:
            sd["checkpoint_version"] = version
        if save_args:
            sd["args"] = argparse.Namespace(num_layers=cfg.layers, hidden_size=cfg.hidden,
                                            num_attention_heads=cfg.heads, max_position_embeddings=cfg.seq,
                                            padded_vocab_size=cfg.vocab, tensor_model_parallel_size=tp)
        p = folder / f"mp_rank_{rank:02d}_model_states.pt"
        torch.save(sd, p)
        paths.append(p)
    return paths
