"""megatron-core's hybrid ``MambaModel`` on a CPU, run by ``python tests/mcore_mamba.py JOBS.json``
(one process per TP rank, gloo): what the Nemotron-H tests judge reshard's checkpoints by.

The model is megatron-core 0.16.1's own (``MambaModel``, ``MambaStack``, ``MambaLayer``,
``MambaMixer``, ``TransformerLayer`` + ``SelfAttention``, ``MLPLayer`` + ``MLP``), built from the
checkpoint's saved ``args`` as Megatron-LM's ``--use-checkpoint-args`` would, and loaded with
``load_state_dict(strict=True)``. What does not import or run on a CPU is replaced by the smallest
stand-in, each written here from its definition:

* ``mamba_ssm`` (Triton kernels): a package of three modules put in ``sys.modules`` before
  megatron-core's mixer is imported — ``ops.triton.layernorm_gated.RMSNorm`` (the gated RMSNorm,
  ``norm_before_gate=False``: ``RMSNorm_per_group(y * silu(z)) * weight``),
  ``ops.triton.ssd_combined.mamba_chunk_scan_combined`` (the Mamba-2 SSD recurrence, step by step:
  ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t`` with
  ``dt_t = softplus(dt_t + dt_bias)``, B and C shared by the heads of a group) and the fused
  training kernel (never called: ``use_mamba_mem_eff_path`` is False, so the mixer takes its
  prefill path, whose causal conv is megatron-core's own ``nn.Conv1d``: ``causal_conv1d`` is
  absent);
* Transformer Engine (the stack spec's ``TELayerNormColumnParallelLinear``,
  ``TERowParallelLinear``, ``TEDotProductAttention``, ``TENorm``): megatron-core's local
  ``ColumnParallelLinear`` with the layer's RMSNorm in front (its ``layer_norm_weight``, as
  Transformer Engine's fused layer names it), ``RowParallelLinear``, ``DotProductAttention`` and
  ``WrappedTorchNorm`` (``mamba_block.TENorm``, the stack's final norm);
* Triton: megatron-core's ``inference/contexts/attention_context/triton/tensor_ops`` (dynamic
  batching's cache updates, imported by the mixer, never called here) is a module of three
  functions that raise;
* CUDA: ``torch.cuda.current_device`` is the CPU, ``torch.cuda.synchronize`` (``dist_checkpointing``'s
  save) and the CUDA RNG tracker's ``fork`` are no-ops.

Jobs (``tp``, ``ep``, ``etp``, ``pp``: TP, EP, expert TP and pipeline stages, a ``forward``'s stages
passing their hidden states on by ``send``/``recv``; the world the smallest holding both grids):
``write`` builds the model from ``model`` options at TP ``tp`` (seeded; norms and mixer
vectors drawn away from their initial values), saves Megatron-LM's per-rank files with the
``args`` Megatron-LM would and the logits of ``tokens``; ``forward`` loads the checkpoint ``ckpt``
at TP ``tp`` from its own args and saves the logits to ``out``; ``write_dist`` and ``forward_dist`` do
the same in torch_dist (``dist_checkpointing.save`` / ``load`` of the model's sharded state dict). A
job's ``expect_failure`` records each rank's load error instead (a checkpoint that must not load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import types
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ITERATION = 3


# --- the stand-ins -------------------------------------------------------------------------------
class GatedRMSNorm(torch.nn.Module):
    """mamba_ssm's ``RMSNorm`` (``layernorm_gated``) with ``norm_before_gate=False``: the input times
    ``silu(z)``, normalised per group of ``group_size`` channels, times the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        assert not norm_before_gate
        self.eps, self.group_size = eps, group_size or hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        y = x.float() * (F.silu(z.float()) if z is not None else 1.0)
        g = y.reshape(*y.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.reshape(y.shape) * self.weight.float()).to(x.dtype)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
             dt_bias: torch.Tensor | None = None, dt_softplus: bool = False, return_final_states: bool = False,
             **unused: Any) -> Any:
    """mamba_ssm's ``mamba_chunk_scan_combined`` by its definition, one step at a time (the chunking
    is an evaluation order): ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]``, ``B``/``C``
    ``[b, l, g, n]``, ``D`` ``[h]``; no clamp of ``dt`` (the kernel's default ``dt_limit``)."""
    assert z is None and not unused.get("initial_states") and unused.get("seq_idx") is None
    b, length, h, p = x.shape
    rep = h // B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    Bh, Ch = B.float().repeat_interleave(rep, dim=2), C.float().repeat_interleave(rep, dim=2)
    state = torch.zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.float())  # [b, h]
        state = state * decay[..., None, None] + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        y = (state * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + (D.float()[:, None] if D.dim() == 1 else D.float()) * x[:, t].float()
        ys.append(y)
    out = torch.stack(ys, dim=1).to(x.dtype)
    return (out, state) if return_final_states else out


def _fused_kernel(*a: Any, **k: Any) -> Any:
    raise AssertionError("a kernel that is not stood in (the fused training scan, dynamic inference's ops)")


#: megatron-core's Triton tensor ops of dynamic inference, which the mixer imports (``import triton``).
TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def install_mamba_stand_ins() -> None:
    """Put the ``mamba_ssm`` stand-in package in ``sys.modules`` (before megatron-core's mixer is imported)."""
    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.layernorm_gated",
             "mamba_ssm.ops.triton.ssd_combined")
    mods = {n: types.ModuleType(n) for n in names}
    mods["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm = GatedRMSNorm  # type: ignore[attr-defined]
    mods["mamba_ssm.ops.triton.ssd_combined"].mamba_chunk_scan_combined = ssd_scan  # type: ignore[attr-defined]
    mods["mamba_ssm.ops.triton.ssd_combined"].mamba_split_conv1d_scan_combined = _fused_kernel  # type: ignore
    for n, m in mods.items():
        m.__path__ = []  # type: ignore[attr-defined]
        sys.modules.setdefault(n, m)
    ops = types.ModuleType(TRITON_TENSOR_OPS)  # Triton kernels of dynamic batching's cache, unused here
    for fn in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(ops, fn, _fused_kernel)
    sys.modules.setdefault(TRITON_TENSOR_OPS, ops)


def _stack_spec() -> Any:
    """megatron-core's ``mamba_stack_spec`` with Transformer Engine's layers stood in by local ones."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm import mamba_block
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    class NormedColumnParallelLinear(ColumnParallelLinear):
        """Transformer Engine's ``TELayerNormColumnParallelLinear`` stood in: the layer's RMSNorm
        (``layer_norm_weight``) in front of megatron-core's ``ColumnParallelLinear``."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.norm_eps = config.layernorm_epsilon

        def forward(self, x: torch.Tensor, *a: Any, **k: Any) -> Any:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            x = x32.to(x.dtype) * self.layer_norm_weight
            return super().forward(x)

    class GroupedLinear(MegatronModule):
        """Transformer Engine's ``TEColumnParallelGroupedLinear`` (``split`` 0: output rows over the expert
        TP) and ``TERowParallelGroupedLinear`` (``split`` 1: inputs) stood in: one ``weight{i}`` per local
        expert, each expert's tokens times its own; the token dispatcher reduces a row-parallel output
        over the expert TP (megatron-core's explicit expert communication), so there is none here. Its
        state is Transformer Engine's: one ``_extra_state`` per rank (None: no FP8 metadata), and the
        sharded state dict of megatron-core's ``TEGroupedLinear._sharded_state_dict_grouped`` (each
        ``weight{i}`` the global expert ``e``'s slice, on an expert axis after the given ones, and the extra
        state as ``_extra_state``, ``_extra_state1`` ... one object per expert, merged back on loading as
        its ``merge_extra_states`` does)."""

        split = 0

        def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Any,
                     bias: bool, pg_collection: Any, **kw: Any) -> None:
            super().__init__(config)
            assert not bias
            self.num_gemms, self.pg = num_gemms, pg_collection
            etp = pg_collection.expt_tp.size()
            shape = (output_size // etp, input_size) if self.split == 0 else (output_size, input_size // etp)
            for i in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype))
                init_method(w)
                self.register_parameter(f"weight{i}", w)
            self._register_load_state_dict_pre_hook(self._merge_extra_states, with_module=False)

        def forward(self, x: torch.Tensor, m_splits: list[int]) -> Any:
            parts = torch.split(x, m_splits)
            return torch.cat([p @ getattr(self, f"weight{i}").t() for i, p in enumerate(parts)]), None

        def get_extra_state(self) -> Any:
            return None

        def set_extra_state(self, state: Any) -> None:
            assert state is None

        def _merge_extra_states(self, state_dict: dict, prefix: str, *_: Any) -> None:
            for i in range(1, self.num_gemms):
                assert state_dict.pop(f"{prefix}_extra_state{i}", None) is None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
            from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            ep, first = self.pg.ep.size() * self.num_gemms, self.pg.ep.rank() * self.num_gemms
            out = {}
            for i in range(self.num_gemms):
                sub = make_sharded_tensors_for_checkpoint(
                    {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": self.get_extra_state()}, "",
                    {f"{i}.weight": self.split}, (*sharded_offsets, (len(sharded_offsets), first + i, ep)),
                    tp_group=self.pg.expt_tp, dp_cp_group=metadata["dp_cp_group"])
                replace_prefix_for_sharding(sub, f"{i}.", prefix)
                out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
                out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            for sh in out.values():  # replicated over the expert data-parallel ranks
                sh.replica_id = (*sh.replica_id[:2], self.pg.expt_dp.rank())
            return out

    class GroupedRowLinear(GroupedLinear):
        split = 1

    mamba_block.TENorm = WrappedTorchNorm  # the stack's final norm
    moe = ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=GroupedLinear,
                                                                         linear_fc2=GroupedRowLinear)),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=NormedColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                      submodules=SelfAttentionSubmodules(
                                          linear_qkv=NormedColumnParallelLinear, core_attention=DotProductAttention,
                                          linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=NormedColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm, mlp=moe, mlp_bda=get_bias_dropout_add))))


# --- args <-> model -------------------------------------------------------------------------------
def megatron_args(m: dict[str, Any], tp: int, ep: int = 1, etp: int = 1) -> argparse.Namespace:
    """The ``args`` Megatron-LM's ``pretrain_mamba.py`` saves for model options ``m`` (the keys the
    model is rebuilt from)."""
    padded = -(-m["vocab"] // (128 * tp)) * 128 * tp
    return argparse.Namespace(
        num_layers=len(m["pattern"]), hidden_size=m["hidden"], ffn_hidden_size=m["ffn"],
        num_attention_heads=m["heads"], group_query_attention=m["groups"] != m["heads"], num_query_groups=m["groups"],
        kv_channels=m["head_dim"], normalization="RMSNorm", norm_epsilon=1e-5, swiglu=False, squared_relu=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, position_embedding_type="none",
        untie_embeddings_and_output_weights=True, vocab_size=m["vocab"], padded_vocab_size=padded,
        make_vocab_size_divisible_by=128, max_position_embeddings=m["seq"], seq_length=m["seq"],
        is_hybrid_model=True, hybrid_override_pattern=m["pattern"], hybrid_attention_ratio=0.0,
        hybrid_mlp_ratio=0.0, mamba_state_dim=m["state"], mamba_head_dim=m["mamba_head_dim"],
        mamba_num_groups=m["mamba_groups"], mamba_num_heads=m["mamba_heads"],
        spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, transformer_impl="transformer_engine",
        use_legacy_models=False, ckpt_format="torch", params_dtype=torch.float32, bf16=False, fp16=False,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        **({} if "experts" not in m else dict(
            num_experts=m["experts"], moe_router_topk=m["topk"], moe_ffn_hidden_size=m["moe_ffn"],
            moe_shared_expert_intermediate_size=m["shared_ffn"], moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
            moe_router_topk_scaling_factor=1.0, moe_router_dtype="fp32", moe_grouped_gemm=True)))


def build(a: Any, tp: int, ep: int = 1, etp: int = 1, pp: int = 1) -> Any:
    """``MambaModel`` as Megatron-LM builds it from ``args`` ``a`` (TP ``tp``, this rank's pipeline
    stage of ``pp``; the mixer on its prefill path)."""
    from megatron.core import parallel_state as ps
    from megatron.core.activations import squared_relu
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer import TransformerConfig

    groups = getattr(a, "num_query_groups", None) if getattr(a, "group_query_attention", False) else None
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=groups, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon,
        activation_func=squared_relu if a.squared_relu else F.gelu, gated_linear_unit=bool(a.swiglu),
        add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias, mamba_state_dim=a.mamba_state_dim,
        mamba_head_dim=a.mamba_head_dim, mamba_num_groups=a.mamba_num_groups, mamba_num_heads=a.mamba_num_heads,
        use_mamba_mem_eff_path=False, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=getattr(a, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(a, "decoder_last_pipeline_num_layers", None),
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        **({} if not getattr(a, "num_experts", None) else dict(
            num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk, moe_ffn_hidden_size=a.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
            moe_router_score_function=a.moe_router_score_function,
            moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
            moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor, moe_router_dtype=a.moe_router_dtype,
            moe_grouped_gemm=True, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0)))
    return MambaModel(cfg, _stack_spec(), vocab_size=a.padded_vocab_size,
                      max_sequence_length=a.max_position_embeddings, hybrid_override_pattern=a.hybrid_override_pattern,
                      position_embedding_type=a.position_embedding_type,
                      share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                      pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def logits(model: Any, tokens: list[int], vocab: int, hidden: int = 0) -> torch.Tensor | None:
    """The forward's logits ``[tokens, vocab]``, gathered over TP, the padding rows cut (None on a
    pipeline stage before the last: it sends its hidden states ``[tokens, 1, hidden]`` on)."""
    from megatron.core import parallel_state as ps

    ids = torch.tensor([tokens])
    mask = torch.ones(1, 1, len(tokens), len(tokens), dtype=torch.bool).triu(1)
    if not ps.is_pipeline_first_stage():
        received = torch.empty(len(tokens), 1, hidden)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    with torch.no_grad():
        out = model.eval()(ids, torch.arange(len(tokens))[None], mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    out = out[0]

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, -1)[:, :vocab]


def _draw(model: Any, seed: int) -> None:
    """Norms and mixer vectors away from their initial values (a misplaced one must show): the same
    draw on every TP rank for a replicated norm, each rank's own for its slice of the mixer's."""
    same, own = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm_weight") or "final_norm" in name or "pre_mlp_layernorm" in name:
                p.add_(torch.rand(p.shape, generator=same) * 0.5)
            elif name.endswith(("A_log", ".D", "conv1d.bias", "mixer.norm.weight")):
                p.add_(torch.rand(p.shape, generator=own) * 0.5)
            elif ".experts.linear_fc" in name:  # each expert-parallel rank's experts their own
                p.add_(torch.randn(p.shape, generator=own) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=same) * 0.1)


# --- the ranks ------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    install_mamba_stand_ins()
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]  # dist_checkpointing's save
    import megatron.core.transformer.moe.moe_utils as moe_utils  # names te_general_gemm only with TE installed

    moe_utils.te_general_gemm = None
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp, ep, etp, pp = job["tp"], job.get("ep", 1), job.get("etp") or job["tp"], job.get("pp", 1)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if pp > 1:
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        if ep > 1:
            name += f"_{ps.get_expert_model_parallel_rank():03d}"
        if job["kind"] == "write":
            args = megatron_args(job["model"], tp, ep, etp)
            torch.manual_seed(job.get("seed", 11))
            model = build(args, tp, ep, etp)
            _draw(model, job.get("seed", 11))
            out = Path(job["out"])
            f = out / f"iter_{ITERATION:07d}" / name / "model_optim_rng.pt"
            f.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                        "model": model.state_dict()}, f)
            if rank == 0:
                (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            got = logits(model, job["tokens"], args.vocab_size)
            if rank == 0:
                torch.save(got, out / "logits.pt")
            return
        if job["kind"] == "write_dist":  # Megatron-LM's --ckpt-format torch_dist: the sharded state dict
            from megatron.core import dist_checkpointing

            args = megatron_args(job["model"], tp, ep, etp)
            args.ckpt_format = "torch_dist"
            torch.manual_seed(job.get("seed", 11))
            model = build(args, tp, ep, etp)
            _draw(model, job.get("seed", 11))
            out = Path(job["out"])
            folder = out / f"iter_{ITERATION:07d}"
            folder.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                                     "model": model.sharded_state_dict()}, str(folder))
            if rank == 0:
                (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            got = logits(model, job["tokens"], args.vocab_size)
            if rank == 0:
                torch.save(got, out / "logits.pt")
            return
        ckpt = Path(job["ckpt"])
        if job["kind"] == "forward_dist":  # megatron-core's own loader on a torch_dist checkpoint
            from megatron.core import dist_checkpointing

            latest = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
            folder = ckpt / ("release" if latest == "release" else f"iter_{int(latest):07d}")
            args = torch.load(folder / "common.pt", weights_only=False)["args"]
            model = build(args, tp, ep, etp)
            state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))["model"]
            model.load_state_dict(state, strict=True)
            got = logits(model, job["tokens"], args.vocab_size)
            if rank == 0:
                torch.save(got, job["out"])
            return
        latest = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
        it = ckpt / ("release" if latest == "release" else f"iter_{int(latest):07d}")
        state = torch.load(it / name / "model_optim_rng.pt", weights_only=False)
        model = build(state["args"], tp, ep, etp, pp)
        failed = ""
        try:
            model.load_state_dict(state["model"], strict=True)
        except RuntimeError as e:
            if not job.get("expect_failure"):
                raise
            failed = str(e).splitlines()[0]
        if job.get("expect_failure"):
            errors: list[Any] = [None] * world
            dist.all_gather_object(errors, failed)
            if rank == 0:
                Path(job["out"]).write_text(json.dumps(errors))
            return
        got = logits(model, job["tokens"], state["args"].vocab_size, state["args"].hidden_size)
        if got is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0:
            torch.save(got, job["out"])
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(jobs_file: str) -> None:
    install_mamba_stand_ins()  # megatron-core imported once, before the ranks fork
    import megatron.core.models.mamba.mamba_model  # noqa: F401
    import megatron.core.ssm.mamba_mixer  # noqa: F401

    for job in json.loads(Path(jobs_file).read_text()):
        # the smallest world holding the dense grid (TP) and the expert grid (expert TP x EP)
        world = job.get("pp", 1) * math.lcm(job["tp"], (job.get("etp") or job["tp"]) * job.get("ep", 1))
        mp.start_processes(_worker, args=(world, _free_port(), job), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
