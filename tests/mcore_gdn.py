"""megatron-core 0.16.1's GPT model with gated DeltaNet layers (Qwen3-Next's, Qwen3.5's) built on the
CPU, for the harness (:mod:`mcore_harness`: a model whose options hold ``gdn``). Test-only.

megatron-core builds these layers from its Transformer Engine spec alone
(``experimental_attention_variant_module_specs``: ``_get_backend_spec_provider`` asserts
``transformer_impl == "transformer_engine"``), and its mixer imports flash-linear-attention. Neither
runs here; this module puts the smallest stand-ins in their place and uses megatron-core's own
modules for everything else (``GPTModel``, ``TransformerBlock``, ``TransformerLayer``,
``GatedDeltaNet``, ``SelfAttention`` with its output gate, ``DotProductAttention``, ``MoELayer`` with
``SequentialMLP`` and the gated ``SharedExpertMLP``, megatron-core's block spec function itself):

=======================================  ===========================================================
stand-in                                 for (its definition)
=======================================  ===========================================================
:class:`ZeroCentredRMSNorm`              Transformer Engine's ``RMSNorm`` with ``zero_centered_gamma``
                                         (``--apply-layernorm-1p``): ``x / rms(x) * (1 + w)`` in fp32
:class:`NormedColumnParallelLinear`      Transformer Engine's ``LayerNormColumnParallelLinear``: that
                                         norm (``layer_norm_weight``), then megatron-core's
                                         ``ColumnParallelLinear``
:func:`l2norm`                           flash-linear-attention's ``l2norm``: ``x / sqrt(sum x^2 + 1e-6)``
``chunk_gated_delta_rule``               megatron-core's own torch fallback,
                                         ``gated_delta_net.torch_chunk_gated_delta_rule``
``_get_backend_spec_provider``           megatron-core's ``LocalSpecProvider`` with the two above
                                         (fused input norms, as Transformer Engine's)
``_get_self_attention_module_spec``      the Transformer Engine spec's ``SelfAttention`` with the
                                         stand-ins (``linear_qkv`` fused with the input norm, query/key
                                         norms) and megatron-core's local core attention
=======================================  ===========================================================

(``causal_conv1d`` is absent, so megatron-core runs its ``nn.Conv1d`` path itself.)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

#: The Megatron-LM args of the mixer (``TransformerConfig`` fields of the same names).
GDN_ARGS = ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads")


class ZeroCentredRMSNorm(torch.nn.Module):
    """Transformer Engine's zero-centred RMSNorm (see the module table)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class NormedColumnParallelLinear(ColumnParallelLinear):
    """Transformer Engine's ``LayerNormColumnParallelLinear`` (see the module table)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kw)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, *a: Any, **k: Any) -> Any:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return super().forward((y * (1.0 + self.layer_norm_weight.float())).to(x.dtype), *a, **k)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's ``l2norm`` (see the module table)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


class CpuBackend(LocalSpecProvider):
    """megatron-core's local modules, with Transformer Engine's fused input norms (the stand-ins)."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return NormedColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return ZeroCentredRMSNorm


def _attention_spec(config: Any, backend: Any = None) -> Any:
    """The Transformer Engine spec's gated attention, with the stand-ins."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(
                          linear_qkv=NormedColumnParallelLinear, core_attention=DotProductAttention,
                          linear_proj=RowParallelLinear, q_layernorm=ZeroCentredRMSNorm,
                          k_layernorm=ZeroCentredRMSNorm),
                      metainfo={"fuse_input_layernorm": True})


def install_stand_ins() -> None:
    """Put the stand-ins in place (in a harness rank, before the model is built)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.ssm import gated_delta_net as gdn

    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    specs._get_backend_spec_provider = lambda config: CpuBackend()
    specs._get_self_attention_module_spec = _attention_spec


def build_model(m: dict[str, Any], tp: int, pp: int, seed: int | None, ep: int = 1, etp: int | None = None,
                vp_stage: int | None = None) -> Any:
    """megatron-core's ``GPTModel`` of options ``m`` (the harness's, plus ``gdn``: :data:`GDN_ARGS`),
    its layers from megatron-core's own hybrid block spec."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    install_stand_ins()
    if seed is not None:
        torch.manual_seed(seed)
    moe: dict[str, Any] = {}
    if m.get("experts"):
        moe = dict(num_moe_experts=m["experts"], moe_router_topk=m["topk"], moe_ffn_hidden_size=m["moe_ffn"],
                   moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=etp or tp, moe_layer_freq=m.get("moe_layer_freq", 1),
                   moe_shared_expert_intermediate_size=m.get("shared_ffn"), moe_shared_expert_gate=True,
                   moe_router_pre_softmax=m.get("pre_softmax", False))
    cfg = TransformerConfig(
        num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
        num_query_groups=m.get("groups"), kv_channels=m["kv_channels"], ffn_hidden_size=m["ffn"],
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, layernorm_epsilon=m["eps"],
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
        **{k: m["gdn"][k] for k in GDN_ARGS}, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32 if pp > 1 else None, bias_activation_fusion=False, **moe)
    spec = get_transformer_block_with_experimental_attention_variant_spec(
        cfg, vp_stage=vp_stage, pp_rank=ps.get_pipeline_model_parallel_rank())
    model = GPTModel(cfg, spec, vocab_size=m["vocab"], max_sequence_length=m["seq"],
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     share_embeddings_and_output_weights=m.get("tied", False), vp_stage=vp_stage,
                     position_embedding_type="rope", rotary_percent=m["rotary_percent"],
                     rotary_base=m.get("rope_base", 10000))
    if m.get("norm_noise"):  # weights away from their initial values (a misplaced one must show)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("layer_norm_weight", "layernorm.weight", "out_norm.weight", "A_log", "dt_bias")):
                    p.add_(torch.rand(p.shape, generator=g) * 0.5)
    return model


def megatron_args(m: dict[str, Any], base: argparse.Namespace) -> argparse.Namespace:
    """The harness's ``args`` of a model with gated DeltaNet layers: Megatron-LM's flags for them."""
    extra = dict(experimental_attention_variant="gated_delta_net", attention_output_gate=True, apply_layernorm_1p=True,
                 rotary_percent=m["rotary_percent"], transformer_impl="transformer_engine",
                 norm_epsilon=m["eps"], qk_layernorm=True, **m["gdn"])
    if m.get("experts"):
        extra.update(moe_shared_expert_gate=True, moe_router_pre_softmax=m.get("pre_softmax", False))
    return argparse.Namespace(**{**vars(base), **extra})


def options_from_args(a: Any, base: dict[str, Any]) -> dict[str, Any]:
    """The harness's model options of saved ``args`` with gated DeltaNet layers."""
    return {**base, "gdn": {k: getattr(a, k) for k in GDN_ARGS}, "rotary_percent": a.rotary_percent,
            "eps": getattr(a, "norm_epsilon", None) or a.layernorm_epsilon}
