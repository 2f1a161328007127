"""Write small, realistic tensor-parallel GPT checkpoints (demo, tests, benchmarks).

Two kinds: legacy-GPT DeepSpeed checkpoints (``write_sample_checkpoint``, ``mp_rank_XX_model_states.pt``)
and megatron-core GPTs in Megatron-LM run folders (``write_core_sample_checkpoint``: GQA, SwiGLU,
RMSNorm, rotary, tied or untied output, vocabulary padding, pipeline stages).

The layout code here is deliberately written independently of ``reshard.core``: it builds
the full logical weights first and lays each rank out with reshape/permute per version, so
tests that reshard these files check the engine against a second implementation. The names the
weights are written under are the families' (by role: :data:`reshard.models.megatron_gpt.LEGACY_ROLES`,
:data:`~reshard.models.megatron_gpt.CORE_ROLES`, :data:`reshard.models.mixtral_sample.MIXTRAL_ROLES`). Vocabulary
padding rows are zeros, so a sample written at TP=M equals a correct reshard of the sample
written at TP=N, bit for bit.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reshard.models.megatron_gpt import CORE_ROLES, LEGACY_ROLES
from reshard.models.mixtral_sample import MIXTRAL_ROLES
from reshard.models.mixtral_sample import mixtral_config_json as _config_json


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
    w = {"embedding": r(cfg.vocab, h, scale=0.5), "position_embeddings": r(cfg.seq, h, scale=0.5),
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
    """The module state dict of every rank, legacy Megatron names (``prefix``: how the stack's
    names start; ``attention``: the attention module's name)."""
    names = LEGACY_ROLES

    def name(role: str, entry: str = "", **layer: object) -> str:
        return (names["layer"].format(layers=prefix, **layer) if layer else "") + \
            names[role].format(layers=prefix, attention=attention) + entry

    out = []
    for rank in range(tp):
        def col(x: torch.Tensor, rank: int = rank) -> torch.Tensor:
            return x.chunk(tp, dim=0)[rank]

        def row(x: torch.Tensor, rank: int = rank) -> torch.Tensor:
            return x.chunk(tp, dim=1)[rank]

        sd: dict[str, torch.Tensor] = {name("embedding"): col(w["embedding"]),
                                       name("position"): w["position_embeddings"]}
        for i in range(cfg.layers):
            sd |= {
                name("ln1", "weight", i=i): w[f"{i}.ln1.weight"], name("ln1", "bias", i=i): w[f"{i}.ln1.bias"],
                name("qkv", "weight", i=i):
                    _qkv_rank(w[f"{i}.q.weight"], w[f"{i}.k.weight"], w[f"{i}.v.weight"], cfg.heads, tp, rank, version),
                name("qkv", "bias", i=i):
                    _qkv_rank(w[f"{i}.q.bias"], w[f"{i}.k.bias"], w[f"{i}.v.bias"], cfg.heads, tp, rank, version),
                name("dense", "weight", i=i): row(w[f"{i}.dense.weight"]),
                name("dense", "bias", i=i): w[f"{i}.dense.bias"],
                name("ln2", "weight", i=i): w[f"{i}.ln2.weight"],
                name("ln2", "bias", i=i): w[f"{i}.ln2.bias"],
                name("h4h", "weight", i=i): col(w[f"{i}.h4h.weight"]),
                name("h4h", "bias", i=i): col(w[f"{i}.h4h.bias"]),
                name("4hh", "weight", i=i): row(w[f"{i}.4hh.weight"]),
                name("4hh", "bias", i=i): w[f"{i}.4hh.bias"],
            }
        sd |= {name("final_ln", "weight"): w["final_ln.weight"], name("final_ln", "bias"): w["final_ln.bias"]}
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


# --- megatron-core GPT (GQA, SwiGLU, RMSNorm, vocabulary padding, pipeline stages) ----------------


@dataclass(frozen=True)
class CoreGPTConfig:
    """Shape of a small megatron-core GPT. ``groups`` None is multi-head attention."""

    layers: int = 2
    hidden: int = 64
    heads: int = 8
    groups: int | None = None
    ffn: int = 96
    swiglu: bool = False
    rmsnorm: bool = False
    bias: bool = True
    rope: bool = False
    tied: bool = True
    vocab: int = 100
    divisible_by: int = 16
    seq: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def query_groups(self) -> int:
        return self.groups or self.heads

    def padded_vocab(self, tp: int) -> int:
        """Megatron-LM's padding: up to a multiple of ``divisible_by * tp``."""
        unit = self.divisible_by * tp
        return -(-self.vocab // unit) * unit


def core_full_weights(cfg: CoreGPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unsharded logical weights (fp32) by role: q/k/v per head, gate (w) and up (v) halves."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, f, hn = cfg.hidden, cfg.ffn, cfg.head_dim
    kv = cfg.query_groups * hn
    w = {"embedding": r(cfg.vocab, h, scale=0.5), "final_ln.weight": 1 + r(h), "final_ln.bias": r(h)}
    if not cfg.rope:
        w["position_embeddings"] = r(cfg.seq, h, scale=0.5)
    if not cfg.tied:
        w["output"] = r(cfg.vocab, h, scale=0.5)
    for i in range(cfg.layers):
        w |= {f"{i}.ln1.weight": 1 + r(h), f"{i}.ln1.bias": r(h), f"{i}.ln2.weight": 1 + r(h), f"{i}.ln2.bias": r(h),
              f"{i}.q.weight": r(cfg.heads * hn, h), f"{i}.k.weight": r(kv, h), f"{i}.v.weight": r(kv, h),
              f"{i}.q.bias": r(cfg.heads * hn), f"{i}.k.bias": r(kv), f"{i}.v.bias": r(kv),
              f"{i}.proj.weight": r(h, cfg.heads * hn), f"{i}.proj.bias": r(h),
              f"{i}.gate.weight": r(f, h), f"{i}.gate.bias": r(f), f"{i}.up.weight": r(f, h), f"{i}.up.bias": r(f),
              f"{i}.fc2.weight": r(h, f), f"{i}.fc2.bias": r(h)}
    return w


def _grouped_qkv_rank(cfg: CoreGPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int,
                      rank: int) -> torch.Tensor:
    """One rank's fused QKV rows: for each of its query groups, that group's q heads, its k, its v.

    ``q`` is ``[heads*hn, *tail]``, ``k``/``v`` ``[groups*hn, *tail]``; the full tensor is
    ``[groups, heads/groups + 2, hn, *tail]`` and a rank holds ``groups/tp`` whole groups."""
    groups, hn, tail = cfg.query_groups, cfg.head_dim, q.shape[1:]
    qg = q.reshape(groups, cfg.heads // groups, hn, *tail)
    full = torch.cat([qg, k.reshape(groups, 1, hn, *tail), v.reshape(groups, 1, hn, *tail)], dim=1)
    per = groups // tp
    return full[rank * per:(rank + 1) * per].reshape(-1, *tail)


def _vocab_rows(cfg: CoreGPTConfig, x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a vocabulary-parallel weight, padded with zero rows at the end."""
    padded = torch.cat([x, x.new_zeros(cfg.padded_vocab(tp) - cfg.vocab, x.shape[1])])
    return padded.chunk(tp, dim=0)[rank]


def core_rank_state_dict(cfg: CoreGPTConfig, w: dict[str, torch.Tensor], tp: int, rank: int, pp: int = 1,
                         stage: int = 0, dtype: torch.dtype = torch.float32,
                         extra_state: object = None) -> dict[str, object]:
    """The module state dict of (TP rank, PP stage), megatron-core names, local-spec layout
    (``_extra_state`` entries as megatron-core's local linear layers save them: None)."""

    def col(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(tp, dim=0)[rank]

    def row(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(tp, dim=1)[rank]

    def norm(name: str, key: str) -> dict[str, torch.Tensor]:
        out = {f"{name}weight": w[f"{key}.weight"]}
        if not cfg.rmsnorm:
            out[f"{name}bias"] = w[f"{key}.bias"]
        return out

    names = CORE_ROLES
    sd: dict[str, object] = {}
    first, last = stage == 0, stage == pp - 1
    if first:
        sd[names["embedding"] + "weight"] = _vocab_rows(cfg, w["embedding"], tp, rank)
        if not cfg.rope:
            sd[names["position"] + "weight"] = w["position_embeddings"]
    per = cfg.layers // pp
    for local in range(per):
        i = stage * per + local
        p = names["layer"].format(i=local)
        proj, qkv, fc1, fc2 = (p + names[role] for role in ("proj", "qkv", "fc1", "fc2"))
        sd |= norm(p + names["ln1"], f"{i}.ln1")
        sd[proj + "weight"] = row(w[f"{i}.proj.weight"])
        if cfg.bias:
            sd[proj + "bias"] = w[f"{i}.proj.bias"]
        sd[proj + "_extra_state"] = extra_state
        sd[qkv + "weight"] = _grouped_qkv_rank(cfg, w[f"{i}.q.weight"], w[f"{i}.k.weight"], w[f"{i}.v.weight"], tp,
                                               rank)
        if cfg.bias:
            sd[qkv + "bias"] = _grouped_qkv_rank(cfg, w[f"{i}.q.bias"], w[f"{i}.k.bias"], w[f"{i}.v.bias"], tp, rank)
        sd[qkv + "_extra_state"] = extra_state
        sd |= norm(p + names["ln2"], f"{i}.ln2")
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            gate, up = col(w[f"{i}.gate.{kind}"]), col(w[f"{i}.up.{kind}"])
            sd[fc1 + kind] = torch.cat([gate, up]) if cfg.swiglu else gate
        sd[fc1 + "_extra_state"] = extra_state
        sd[fc2 + "weight"] = row(w[f"{i}.fc2.weight"])
        if cfg.bias:
            sd[fc2 + "bias"] = w[f"{i}.fc2.bias"]
        sd[fc2 + "_extra_state"] = extra_state
    if last:
        sd |= norm(names["final_ln"], "final_ln")
        if not cfg.tied:
            sd[names["output"] + "weight"] = _vocab_rows(cfg, w["output"], tp, rank)
        elif pp > 1:
            sd[names["output"] + "weight"] = _vocab_rows(cfg, w["embedding"], tp, rank)
        sd[names["output"] + "_extra_state"] = extra_state
    return {k: (v.to(dtype).clone() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state") else v)
            for k, v in sd.items()}


def core_args(cfg: CoreGPTConfig, tp: int, pp: int, save_vocab_size: bool = True) -> argparse.Namespace:
    """The Megatron-LM ``args`` attributes that describe the model and its parallel layout."""
    return argparse.Namespace(
        num_layers=cfg.layers, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn, num_attention_heads=cfg.heads,
        kv_channels=cfg.head_dim, group_query_attention=cfg.groups is not None, num_query_groups=cfg.groups or 1,
        swiglu=cfg.swiglu, normalization="RMSNorm" if cfg.rmsnorm else "LayerNorm", add_bias_linear=cfg.bias,
        position_embedding_type="rope" if cfg.rope else "learned_absolute",
        untie_embeddings_and_output_weights=not cfg.tied, vocab_size=cfg.vocab if save_vocab_size else None,
        padded_vocab_size=cfg.padded_vocab(tp), make_vocab_size_divisible_by=cfg.divisible_by,
        max_position_embeddings=cfg.seq, seq_length=cfg.seq, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp)


def write_core_sample_checkpoint(folder: str | os.PathLike[str], *, tp: int = 2, pp: int = 1,
                                 cfg: CoreGPTConfig | None = None, seed: int = 0, iteration: int = 100,
                                 dtype: torch.dtype = torch.float32, save_args: bool = True,
                                 save_vocab_size: bool = True, extra_state: object = None) -> list[Path]:
    """Write a Megatron-LM run folder: ``latest_checkpointed_iteration.txt`` and
    ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` per (TP rank, PP stage); returns the files."""
    cfg = cfg or CoreGPTConfig()
    folder = Path(folder)
    w = core_full_weights(cfg, seed)
    paths = []
    for stage in range(pp):
        for rank in range(tp):
            sub = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
            p = folder / f"iter_{iteration:07d}" / sub / "model_optim_rng.pt"
            p.parent.mkdir(parents=True, exist_ok=True)
            sd: dict[str, object] = {
                "checkpoint_version": 3.0, "iteration": iteration,
                "model": core_rank_state_dict(cfg, w, tp, rank, pp, stage, dtype, extra_state),
                "optimizer": {"state": {}}, "opt_param_scheduler": {"num_steps": iteration},
                "rng_state": [{"torch_rng_state": torch.zeros(8, dtype=torch.uint8)}],
                "num_floating_point_operations_so_far": 0,
            }
            if save_args:
                sd["args"] = core_args(cfg, tp, pp, save_vocab_size)
            torch.save(sd, p)
            paths.append(p)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return paths


# --- a Hugging Face mixture-of-experts folder (Mixtral's names and config.json) -----------------------

@dataclass(frozen=True)
class MixtralConfig:
    """Shape of a small ``MixtralForCausalLM``: grouped-query attention, RMSNorm, rotary, and every
    MLP a softmax-routed mixture of SwiGLU experts."""

    layers: int = 2
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 128
    experts: int = 4
    topk: int = 2
    vocab: int = 256
    seq: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def mixtral_config_json(cfg: MixtralConfig) -> dict[str, object]:
    """The ``config.json`` transformers writes for such a model (bf16, untied, no sliding window)."""
    return _config_json(vocab=cfg.vocab, hidden=cfg.hidden, ffn=cfg.ffn, layers=cfg.layers, heads=cfg.heads,
                        kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, seq=cfg.seq, experts=cfg.experts, topk=cfg.topk)


def write_mixtral_sample(folder: str | os.PathLike[str], cfg: MixtralConfig | None = None, seed: int = 0) -> Path:
    """A Hugging Face folder as ``save_pretrained`` leaves it (``config.json``, bf16
    ``model.safetensors``) of a small random Mixtral model; returns the folder."""
    import json

    from safetensors.torch import save_file

    cfg = cfg or MixtralConfig()
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + torch.randn(cfg.hidden, generator=g) * 0.1).to(torch.bfloat16)

    h, hn, n = cfg.hidden, cfg.head_dim, MIXTRAL_ROLES
    w = {n["embedding"]: r(cfg.vocab, h, scale=0.5), n["norm"]: norm(), n["head"]: r(cfg.vocab, h, scale=0.5)}
    for i in range(cfg.layers):
        p = n["layer"].format(i=i)
        w |= {p + n["ln1"]: norm(), p + n["ln2"]: norm(), p + n["q"]: r(cfg.heads * hn, h),
              p + n["k"]: r(cfg.kv_heads * hn, h), p + n["v"]: r(cfg.kv_heads * hn, h),
              p + n["o"]: r(h, cfg.heads * hn), p + n["router"]: r(cfg.experts, h)}
        for e in range(cfg.experts):
            x = p + n["expert"].format(e=e)
            w |= {x + n["gate"]: r(cfg.ffn, h), x + n["down"]: r(h, cfg.ffn), x + n["up"]: r(cfg.ffn, h)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(mixtral_config_json(cfg), indent=2) + "\n")
    return folder
