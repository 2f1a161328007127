"""Build real megatron-core GPT models on the CPU and save them as Megatron-LM does (test-only).

Run as a script: ``python mcore_harness.py jobs.json``, or ``python mcore_harness.py --serve`` (the
tests' launcher, :func:`mcore_fixtures.run_harness`: one per test process, fed one jobs file per line,
see :func:`serve`). The launcher imports megatron-core once and then, per job, *forks* one process
per rank (gloo process groups, world size ``tp * pp``) — it never computes anything itself, so
forking is safe. Jobs:

* ``write``: build ``GPTModel`` (``get_gpt_layer_local_spec``, ``use_cpu_initialization=True``)
  from ``model`` at (tp, pp) with a fixed seed and save ``<out>/iter_XXXXXXX/mp_rank_TT[_PPP]/
  model_optim_rng.pt`` plus ``latest_checkpointed_iteration.txt`` the way Megatron-LM's
  ``save_checkpoint`` (``--ckpt-format torch``) lays them out: ``args`` (a Namespace with real
  megatron enums), ``checkpoint_version`` 3.0, ``iteration``, ``model``, optimizer and
  scheduler state, ``rng_state`` (with numpy state). With pp == 1 it also saves the logits of
  ``tokens`` (gathered over TP) to ``<out>/logits.pt``.
* ``forward``: build the model at tp (pp 1), ``load_state_dict(strict=True)`` the rank files of
  the Megatron checkpoint ``ckpt`` (a run or iteration folder) and save its logits to ``out``.
  With ``from_args`` the model is built from the checkpoint's own saved ``args`` (as Megatron-LM's
  ``--use-checkpoint-args`` would), not from ``model``: what an import wrote there is tested too
  (``forward_dist`` likewise, from the folder's ``common.pt``).

MoE models (``experts`` in the model options) are built with SequentialMLP experts and the
``allgather`` token dispatcher at expert-parallel size ``ep`` (world ``tp * pp * ep``, expert TP =
TP), saved in ``mp_rank_TT[_PPP]_EEE`` folders; each router's routing decisions of the forward
are saved beside the logits (``routing.pt``; ``<out>.routing`` for a ``forward`` job). megatron-core
names ``te_general_gemm`` in its router only when Transformer Engine is installed: it is set to None.
GPT-OSS's layers take Megatron-LM's own arg names as options (``softmax_type``, ``quick_geglu``,
``glu_linear_offset``, ``activation_func_clamp_value``; ``pos`` ``"yarn"`` with ``yarn``: the YaRN args,
set as the config attributes ``GPTModel`` reads, :data:`YARN_CONFIG`); MoE layers with biases need
``etp`` 1 (megatron-core asserts it).

Four CPU shims, for code paths that assume CUDA even when ``use_cpu_initialization`` is set:
``torch.cuda.current_device`` returns "cpu" (a scratch buffer's device), ``Tensor.cuda`` is the
identity (the tied-embedding sync across pipeline stages moves the weight to CUDA before its
all-reduce), ``torch.cuda.synchronize`` is a no-op (``dist_checkpointing``'s save waits for
device copies) and the CUDA RNG tracker's ``fork`` is a no-op (dropout is 0 in eval anyway). A
causal mask is passed explicitly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

SERVE = sys.argv[1:] == ["--serve"]
if SERVE:  # stdout is the replies' channel alone: whatever else is printed (imports, ranks) goes to stderr
    CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from rendezvous import free_port  # noqa: E402

ITERATION = 7


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``."""
    unit = divisible_by * tp
    return math.ceil(vocab / unit) * unit


def stage_config(st: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig's pipeline-stage fields from a job's ``stages`` (``vpp``, ``first``, ``last``,
    ``account_embedding``, ``account_loss``, ``layout``)."""
    return dict(virtual_pipeline_model_parallel_size=st.get("vpp"),
                num_layers_in_first_pipeline_stage=st.get("first"), num_layers_in_last_pipeline_stage=st.get("last"),
                account_for_embedding_in_pipeline_split=bool(st.get("account_embedding")),
                account_for_loss_in_pipeline_split=bool(st.get("account_loss")),
                pipeline_model_parallel_layout=st.get("layout"))


def build_model(m: dict[str, Any], tp: int, pp: int, seed: int | None, ep: int = 1, etp: int | None = None,
                vp_stage: int | None = None) -> GPTModel:
    """One model (with ``vp_stage``: model chunk ``vp_stage`` of this pipeline rank, as Megatron-LM's
    ``get_model`` builds it for the interleaved schedule; ``seed`` None: go on drawing from the
    generator, so the chunks of a rank differ)."""
    if m.get("gdn"):  # gated DeltaNet layers (Qwen3-Next, Qwen3.5): megatron-core's hybrid spec, with stand-ins
        import mcore_gdn

        return mcore_gdn.build_model({**m, "vocab": padded_vocab(m["vocab"], m["divisible_by"], tp)}, tp, pp, seed,
                                     ep, etp, vp_stage)
    if seed is not None:
        torch.manual_seed(seed)
    norm = m.get("norm", "LayerNorm")
    kw: dict[str, Any] = stage_config(m.get("stages", {}))
    spec_kw: dict[str, Any] = {}
    if m.get("experts"):  # MoE: SequentialMLP experts, the allgather dispatcher (runs without GPUs)
        kw.update(num_moe_experts=m["experts"], moe_router_topk=m.get("topk", 2), moe_ffn_hidden_size=m["moe_ffn"],
                  moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
                  expert_tensor_parallel_size=etp or tp, moe_layer_freq=m.get("moe_layer_freq", 1),
                  moe_shared_expert_intermediate_size=m.get("shared_ffn"),
                  moe_router_enable_expert_bias=m.get("expert_bias", False),
                  moe_router_score_function="sigmoid" if m.get("expert_bias") else "softmax",
                  moe_router_pre_softmax=m.get("pre_softmax", False),
                  moe_shared_expert_gate=m.get("shared_gate", False))
        kw.update({k: v for k, v in m.get("router", {}).items() if v is not None})  # DeepSeek's group routing
        spec_kw.update(num_experts=m["experts"])
    config_class: Any = TransformerConfig
    if m.get("mla"):  # multi-latent attention (DeepSeek): its config class, on the CPU through _mla_shims
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        _mla_shims()
        config_class = MLATransformerConfig
        kw.update(m["mla"], apply_rope_fusion=False, bias_activation_fusion=False)
        spec_kw.update(multi_latent_attention=True)
    if m.get("mtp"):  # multi-token prediction layers (DeepSeek-V3, GLM-4.5)
        kw.update(mtp_num_layers=m["mtp"])
    if m.get("window_size") is not None:  # sliding-window attention (JSON gives the pair as a list)
        _cpu_window_mask()
        kw.update(window_size=tuple(m["window_size"]), window_attn_skip_freq=m.get("window_attn_skip_freq"))
    if m.get("softmax_type"):  # learned attention sinks (GPT-OSS): one softmax offset per head
        kw.update(softmax_type=m["softmax_type"])
    if m.get("swiglu"):
        kw.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    elif m.get("quick_geglu"):  # GPT-OSS's clamped gated activation, megatron-core's unfused path
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        eager = getattr(quick_gelu, "__wrapped__", quick_gelu)  # torch.compile's original, where it compiled one
        kw.update(gated_linear_unit=True, activation_func=eager, bias_activation_fusion=False,
                  glu_linear_offset=m.get("glu_linear_offset", 0.0),
                  activation_func_clamp_value=m.get("activation_func_clamp_value"))
    elif m.get("openai_gelu"):
        from megatron.core.transformer.utils import openai_gelu

        kw.update(activation_func=openai_gelu)
    cfg = config_class(
        num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
        num_query_groups=m.get("groups"), ffn_hidden_size=m["ffn"], normalization=norm,
        add_bias_linear=m.get("bias", True), add_qkv_bias=m.get("qkv_bias", False),
        layernorm_epsilon=m.get("eps", 1e-5), use_cpu_initialization=True, hidden_dropout=0.0,
        qk_layernorm=m.get("qk_norm", False), kv_channels=m.get("kv_channels"),
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32 if pp > 1 else None, **kw)
    for arg, attr in YARN_CONFIG.items():  # YaRN: GPTModel reads these config attributes (none are fields in 0.16.1)
        if m.get("yarn"):
            setattr(cfg, attr, m["yarn"][arg])
    if spec_kw.get("num_experts"):  # dense and MoE layers as moe_layer_freq says: the decoder block spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=norm,
                                          pp_rank=ps.get_pipeline_model_parallel_rank(), vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=m.get("qk_norm", False),
                                        multi_latent_attention=bool(m.get("mla")))
    mtp_spec = None
    if m.get("mtp"):  # multi-token prediction layers, after the decoder (megatron-core's spec of its last layer)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        # None off its stage
        mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False, vp_stage=vp_stage)
    model = GPTModel(cfg, spec, mtp_block_spec=mtp_spec,
                    vocab_size=padded_vocab(m["vocab"], m["divisible_by"], tp), max_sequence_length=m["seq"],
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=m.get("tied", True), vp_stage=vp_stage,
                    position_embedding_type=m.get("pos", "learned_absolute"), rotary_base=m.get("rope_base", 10000),
                    rotary_percent=m.get("rotary_percent", 1.0))
    if m.get("norm_noise"):  # norms distinct from ones (a swapped norm must show), alike at every layout
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    p.add_(torch.rand(p.shape, generator=g))
    return model


def _mla_shims() -> None:
    """megatron-core 0.16.1's MLA on a CPU without Transformer Engine: its local core attention takes
    no ``k_channels``/``v_channels`` and sizes its output by ``kv_channels``; here it takes them and
    sizes its output by ``v_channels`` (MLA's ``v_head_dim``), as Transformer Engine's attention does,
    so ``kv_channels`` plays no part — as in Megatron-LM, which ignores it under MLA and saves its
    default ``hidden / heads`` there. ``multi_latent_attention.HAVE_TE`` is True even without TE
    (TE is a mock whose ``isinstance`` raises): set False."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models import backends
    from megatron.core.transformer import dot_product_attention as dpa

    class LocalMLAAttention(dpa.DotProductAttention):
        def __init__(self, *a: Any, k_channels: Any = None, v_channels: Any = None, **k: Any) -> None:
            super().__init__(*a, **k)  # MLA gives the softmax scale: the key width is not needed
            if v_channels is not None:  # (the base Attention builds one without, which MLA replaces)
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    backends.LocalSpecProvider.core_attention = lambda self: LocalMLAAttention
    mla.HAVE_TE = False


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """Factory calls asking for ``device="cuda"`` made on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _cpu_window_mask() -> None:
    """megatron-core 0.16.1's local attention builds its sliding-window mask with ``device="cuda"``
    (``get_sliding_window_causal_mask``, called by ``FusedScaleMaskSoftmax`` in place of the mask it
    is given): its own function, run with those tensors made on the CPU."""
    from megatron.core.fusions import fused_softmax

    make = fused_softmax.get_sliding_window_causal_mask
    if getattr(make, "on_cpu", False):
        return

    def on_cpu(*a: Any) -> torch.Tensor:
        with _CudaAsCpu():
            return make(*a)

    on_cpu.on_cpu = True  # type: ignore[attr-defined]
    fused_softmax.get_sliding_window_causal_mask = on_cpu


#: Megatron-LM's YaRN args of a GPT model (``--position-embedding-type yarn``; the harness's ``yarn``
#: option holds them under these names) -> the config attributes megatron-core 0.16.1's ``GPTModel``
#: reads for its ``YarnRotaryEmbedding`` and its attention's concentration factor.
YARN_CONFIG = {"rotary_scaling_factor": "yarn_rotary_scaling_factor",
               "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
               "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
               "mscale_all_dim": "yarn_mscale_all_dim",
               "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int"}
#: Megatron-LM's args of GPT-OSS's attention and activation (the harness's options of the same names).
GPT_OSS_ARGS = ("softmax_type", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value")

#: Megatron-LM's MLA and DeepSeek-router args <-> the harness's model options (same names).
MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
            "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim")
ROUTER_ARGS = ("moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor", "moe_router_dtype")


def megatron_args(m: dict[str, Any], tp: int, pp: int, ep: int = 1, etp: int | None = None) -> Any:
    """A Megatron-LM-like ``args`` Namespace (the attributes reshard and Megatron's loader read)."""
    import argparse

    moe = {}
    if m.get("experts"):
        moe = dict(num_experts=m["experts"], moe_router_topk=m.get("topk", 2), moe_ffn_hidden_size=m["moe_ffn"],
                   moe_shared_expert_intermediate_size=m.get("shared_ffn"), moe_layer_freq=m.get("moe_layer_freq", 1),
                   expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
                   moe_router_enable_expert_bias=m.get("expert_bias", False),
                   moe_router_score_function="sigmoid" if m.get("expert_bias") else "softmax",
                   moe_router_pre_softmax=m.get("pre_softmax", False),
                   moe_shared_expert_gate=m.get("shared_gate", False))

    if m.get("mla"):  # Megatron-LM's MLA and DeepSeek-router args (its CLI names are the config's)
        moe |= dict(multi_latent_attention=True, **m["mla"], apply_rope_fusion=False)
    if m.get("mla") or m.get("router"):  # the DeepSeek and GLM routers' args (the CLI names are the config's)
        moe |= {k: v for k, v in m.get("router", {}).items() if v is not None}
    if m.get("mtp"):
        moe |= dict(mtp_num_layers=m["mtp"])
    groups = m.get("groups")
    # what Megatron-LM records for these (only where a model sets them: older fixtures' args stay as they were)
    recorded = {arg: m[key] for key, arg in (("qkv_bias", "add_qkv_bias"), ("eps", "norm_epsilon"),
                                             ("rope_base", "rotary_base"), ("qk_norm", "qk_layernorm"),
                                             ("rotary_percent", "rotary_percent")) if key in m}
    if m.get("window_size") is not None:  # Megatron-LM's --window-size (a tuple) and --window-attn-skip-freq
        recorded.update(window_size=tuple(m["window_size"]), window_attn_skip_freq=m.get("window_attn_skip_freq"))
    recorded.update({k: m[k] for k in GPT_OSS_ARGS if k in m})
    recorded.update(m.get("yarn") or {})
    made = argparse.Namespace(**recorded, **moe,
        num_layers=m["layers"], hidden_size=m["hidden"], ffn_hidden_size=m["ffn"],
        num_attention_heads=m["heads"], kv_channels=m.get("kv_channels") or m["hidden"] // m["heads"],
        group_query_attention=groups is not None, num_query_groups=groups or 1, swiglu=bool(m.get("swiglu")),
        normalization=m.get("norm", "LayerNorm"), position_embedding_type=m.get("pos", "learned_absolute"),
        add_bias_linear=m.get("bias", True), untie_embeddings_and_output_weights=not m.get("tied", True),
        vocab_size=m.get("saved_vocab_size"), padded_vocab_size=padded_vocab(m["vocab"], m["divisible_by"], tp),
        make_vocab_size_divisible_by=m["divisible_by"], max_position_embeddings=m["seq"], seq_length=m["seq"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world_size(tp, pp, ep, etp),
        **stage_args(m, pp), attention_backend=AttnBackend.auto,
        params_dtype=torch.float32, ckpt_format="torch", tokenizer_type="NullTokenizer", save="/ckpt",
        transformer_impl="local")
    if m.get("gdn"):
        import mcore_gdn

        return mcore_gdn.megatron_args(m, made)
    return made


def stage_args(m: dict[str, Any], pp: int) -> dict[str, Any]:
    """The pipeline-stage fields of Megatron-LM's saved ``args`` after its ``validate_args``, as a user
    asks for the stages: ``--num-layers-per-virtual-pipeline-stage`` for an even interleaved split,
    ``--num-virtual-stages-per-pipeline-rank`` beside uneven stages, a layout string on its own
    (its virtual stages derived); ``virtual_pipeline_model_parallel_size`` derived in each case."""
    st = m.get("stages", {})
    vpp, layout = virtual_stages(st, pp), st.get("layout")
    uneven = st.get("first") is not None or st.get("last") is not None
    n = m["layers"] + bool(st.get("account_embedding")) + bool(st.get("account_loss"))
    return dict(virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                num_layers_per_virtual_pipeline_stage=n // pp // vpp if vpp and not uneven and not layout else None,
                num_virtual_stages_per_pipeline_rank=vpp if vpp and uneven else None,
                decoder_first_pipeline_num_layers=st.get("first"), decoder_last_pipeline_num_layers=st.get("last"),
                account_for_embedding_in_pipeline_split=bool(st.get("account_embedding")),
                account_for_loss_in_pipeline_split=bool(st.get("account_loss")),
                pipeline_model_parallel_layout=layout, transformer_pipeline_model_parallel_size=pp)


def virtual_stages(st: dict[str, Any], pp: int) -> int | None:
    """The virtual stages per pipeline rank a job's ``stages`` ask for (a layout string: its stages
    over ``pp``; the harness's layout strings spell every stage out); None or 1 without."""
    return len(st["layout"].split("|")) // pp if st.get("layout") else st.get("vpp")


def world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The smallest world holding both grids: dense (TP x DP per stage) and expert (ETP x EP x EDP)."""
    return pp * math.lcm(tp, (etp or tp) * ep)


def options_from_args(a: Any) -> dict[str, Any]:
    """The model options (as :func:`build_model` takes them) that Megatron-LM's saved ``args`` describe."""
    if getattr(a, "experimental_attention_variant", None):
        import mcore_gdn

        return mcore_gdn.options_from_args(a, _options_from_args(a))
    return _options_from_args(a)


def _options_from_args(a: Any) -> dict[str, Any]:
    return {"layers": a.num_layers, "hidden": a.hidden_size, "heads": a.num_attention_heads,
            "groups": a.num_query_groups if a.group_query_attention else None, "ffn": a.ffn_hidden_size,
            "swiglu": a.swiglu, "openai_gelu": getattr(a, "openai_gelu", False), "norm": a.normalization,
            "bias": a.add_bias_linear, "qkv_bias": getattr(a, "add_qkv_bias", False),
            "eps": getattr(a, "norm_epsilon", getattr(a, "layernorm_epsilon", None)),  # megatron-core 0.19's name
            "rope_base": getattr(a, "rotary_base", 10000), "pos": a.position_embedding_type,
            "rotary_percent": getattr(a, "rotary_percent", 1.0),
            "qk_norm": getattr(a, "qk_layernorm", False), "kv_channels": a.kv_channels,
            "window_size": getattr(a, "window_size", None), "window_attn_skip_freq": getattr(a, "window_attn_skip_freq",
                                                                                               None),
            "tied": not a.untie_embeddings_and_output_weights, "vocab": a.padded_vocab_size, "divisible_by": 1,
            "seq": a.max_position_embeddings,
            **({"experts": a.num_experts, "topk": a.moe_router_topk, "moe_ffn": a.moe_ffn_hidden_size,
                "shared_ffn": a.moe_shared_expert_intermediate_size, "moe_layer_freq": a.moe_layer_freq,
                "expert_bias": a.moe_router_enable_expert_bias, "pre_softmax": a.moe_router_pre_softmax,
                "shared_gate": a.moe_shared_expert_gate,
                "router": {k: getattr(a, k, None) for k in ROUTER_ARGS}} if getattr(a, "num_experts", None) else {}),
            "stages": {"vpp": getattr(a, "virtual_pipeline_model_parallel_size", None),
                       "first": getattr(a, "decoder_first_pipeline_num_layers", None),
                       "last": getattr(a, "decoder_last_pipeline_num_layers", None),
                       "account_embedding": getattr(a, "account_for_embedding_in_pipeline_split", False),
                       "account_loss": getattr(a, "account_for_loss_in_pipeline_split", False),
                       "layout": getattr(a, "pipeline_model_parallel_layout", None)},
            **({"mtp": a.mtp_num_layers} if getattr(a, "mtp_num_layers", None) else {}),
            **{k: getattr(a, k) for k in GPT_OSS_ARGS if getattr(a, k, None) is not None},
            **({"yarn": {k: getattr(a, k) for k in YARN_CONFIG}} if a.position_embedding_type == "yarn" else {}),
            **({"mla": {k: getattr(a, k) for k in MLA_ARGS if getattr(a, k, None) is not None or k == "q_lora_rank"}}
               if getattr(a, "multi_latent_attention", False) else {})}


def _iteration(ckpt: Path) -> Path:
    """The iteration folder (``iter_`` and the 7-digit step, or ``release``) that a run folder's
    ``latest_checkpointed_iteration.txt`` names; ``ckpt`` itself when it is no run folder."""
    marker = ckpt / "latest_checkpointed_iteration.txt"
    if not marker.exists():
        return ckpt
    text = marker.read_text().strip()
    return ckpt / (f"iter_{int(text):07d}" if text.isdigit() else text)


#: The routing decisions of the last forward (MoE): router name -> which experts each token went to.
ROUTING: dict[str, torch.Tensor] = {}


def _record_routing(model: GPTModel) -> None:
    """Keep each MoE router's ``routing_map`` (tokens x experts, bool): top-k is discontinuous, so
    equal logits after a conversion should come with equal routing, checked on its own."""
    from megatron.core.transformer.moe.router import TopKRouter

    for name, mod in model.named_modules():
        if isinstance(mod, TopKRouter):
            mod.register_forward_hook(lambda _m, _i, out, name=name: ROUTING.__setitem__(name, out[1].clone()))


#: The multi-token prediction layers' logits of the last forward (a model with MTP layers), in order.
MTP_LOGITS: list[torch.Tensor] = []


def _logits(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    s = len(tokens)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool().view(1, 1, s, s)
    model.eval()
    _record_routing(model)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        if model.config.mtp_num_layers:
            out = _with_mtp_logits(model, lambda: model(ids, torch.arange(s).unsqueeze(0), attention_mask=mask,
                                                        labels=ids))
        else:
            out = model(ids, torch.arange(s).unsqueeze(0), attention_mask=mask)
    return _gather_vocab(out)


def _with_mtp_logits(model: GPTModel, forward: Any) -> torch.Tensor:
    """The model's logits ``[1, s, vocab/TP]`` from a model (chunk) with MTP layers, whose ``forward``
    (given the tokens as labels: megatron-core then returns losses) calls the output layer for each
    MTP layer, then for the model; the MTP layers' logits go to :data:`MTP_LOGITS` (copied: the
    loss computation works on them in place)."""
    calls: list[torch.Tensor] = []
    hook = model.output_layer.register_forward_hook(lambda _m, _i, o: calls.append(o[0].transpose(0, 1).clone()))
    try:
        forward()
    finally:
        hook.remove()
    MTP_LOGITS[:] = [_gather_vocab(c) for c in calls[:-1]]
    return calls[-1]


def _gather_vocab(out: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[0]


def _rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT``, ``_PPP`` with PP > 1, ``_EEE`` with EP > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def _stage_table(job: dict[str, Any]) -> None:
    """megatron-core's own layer placement for each config of ``job["configs"]`` (``layers``, ``pp``,
    and the ``stages`` fields): ``[offset, count]`` of every chunk, virtual stage first, as its
    ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` give them (parallel_state set as a
    chunk's rank sees it); or the error its ``TransformerConfig`` raises."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    table: list[Any] = []
    for c in job["configs"]:
        try:
            cfg = TransformerConfig(num_layers=c["layers"], hidden_size=8, num_attention_heads=1,
                                    pipeline_model_parallel_size=c["pp"], pipeline_dtype=torch.float32,
                                    **stage_config(c.get("stages", {})))
            vpp = cfg.virtual_pipeline_model_parallel_size
            ps.set_pipeline_model_parallel_world_size(c["pp"])
            ps.set_virtual_pipeline_model_parallel_world_size(vpp)
            rows = []
            for v in range(vpp or 1):
                for p in range(c["pp"]):
                    ps.set_pipeline_model_parallel_rank(p)
                    stage = v if vpp else None
                    rows.append([get_transformer_layer_offset(cfg, stage, p), get_num_layers_to_build(cfg, stage, p)])
            starts = [sum(count for _, count in rows[:i]) for i in range(len(rows))]
            if sum(count for _, count in rows) != c["layers"] or [o for o, _ in rows] != starts:
                raise ValueError(f"the chunks build {rows}, not the {c['layers']} layers one after the other")
            table.append(rows)
        except Exception as e:  # noqa: BLE001 - megatron-core refuses the config: recorded
            table.append(f"error: {type(e).__name__}: {e}")
    Path(job["out"]).write_text(json.dumps(table))


def _serve_019_enums() -> None:
    """The two enums megatron-core 0.19 saves in ``args`` (:mod:`mcore019`), under megatron-core's
    module where the installed 0.16.1 lacks them, and on torch's safe globals as 0.19 lists them
    (``megatron.core.safe_globals``), so a checkpoint that carries 0.19's ``args`` unpickles here as
    it would there (``dist_checkpointing``'s common state is loaded weights-only)."""
    from megatron.core.transformer import enums

    import mcore019

    for cls in (mcore019.InferenceCudaGraphScope, mcore019.CudaGraphModule):
        if not hasattr(enums, cls.__name__):
            cls.__module__ = enums.__name__
            setattr(enums, cls.__name__, cls)
            torch.serialization.add_safe_globals([cls])


def _worker(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    _serve_019_enums()
    if job["kind"] == "stage_table":
        return _stage_table(job)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]  # dist_checkpointing's preload
    import megatron.core.transformer.moe.moe_utils as moe_utils  # names te_general_gemm only when TE is installed

    moe_utils.te_general_gemm = None
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp, pp, ep, etp = job["tp"], job.get("pp", 1), job.get("ep", 1), job.get("etp") or job["tp"]
    try:
        vpp = virtual_stages(job.get("model", {}).get("stages", {}), pp)
        if job.get("from_args"):
            saved_args = torch.load(_iteration(Path(job["ckpt"])) / (_rank_dir(0, 0, pp, 0, ep) + "/model_optim_rng.pt"
                                    if job["kind"] == "forward" else "common.pt"), weights_only=False)["args"]
            vpp = getattr(saved_args, "virtual_pipeline_model_parallel_size", None)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        state = None
        if job["kind"] == "forward":
            state = torch.load(_iteration(Path(job["ckpt"])) / _rank_dir(tp_rank, pp_rank, pp, ep_rank, ep) /
                               "model_optim_rng.pt", weights_only=False)
        if job.get("from_args"):  # a torch_dist folder keeps its args in common.pt
            saved = state if state is not None else torch.load(_iteration(Path(job["ckpt"])) / "common.pt",
                                                               weights_only=False)
            job = {**job, "model": options_from_args(saved["args"])}
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        if vpp:  # the interleaved pipeline: this rank's model chunks, built in order (the tied head's sync pairs them)
            torch.manual_seed(job.get("seed", 1234) + pp_rank)
            chunks = [build_model(job["model"], tp, pp, None, ep, etp, vp_stage=v) for v in range(vpp)]
        else:
            chunks = [build_model(job["model"], tp, pp, job.get("seed", 1234), ep, etp,
                                  vp_stage=0 if pp > 1 else None)]
        model = chunks[0]
        if job["kind"] == "write":
            out = Path(job["out"])
            name = _rank_dir(tp_rank, pp_rank, pp, ep_rank, ep)
            f = out / f"iter_{ITERATION:07d}" / name / "model_optim_rng.pt"
            sd = {
                "args": megatron_args(job["model"], tp, pp, ep, etp), "checkpoint_version": 3.0, "iteration": ITERATION,
                **_module_entries(chunks),
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]},
                "opt_param_scheduler": {"num_steps": ITERATION},
                "rerun_state_machine": None,
                "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
                "num_floating_point_operations_so_far": 0,
            }
            if _writes_file(name):
                f.parent.mkdir(parents=True, exist_ok=True)
                torch.save(sd, f)
            if rank == 0:
                (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
            if pp == 1:
                logits = _logits(model, job["tokens"])
                if rank == 0:
                    torch.save(logits, out / "logits.pt")
                    torch.save(ROUTING, out / "routing.pt")
                    if MTP_LOGITS:
                        torch.save(MTP_LOGITS, out / "mtp_logits.pt")
            else:  # the pipeline's forward, chunk by chunk in megatron-core's order
                logits = _pipeline_logits(chunks, job["tokens"], job["model"]["hidden"])
                if logits is not None:
                    torch.save(logits, out / "logits.pt")
                    if MTP_LOGITS:
                        torch.save(MTP_LOGITS, out / "mtp_logits.pt")
        elif job["kind"] == "write_dist":
            _write_dist(job, model, tp, pp)
        elif job["kind"] == "forward_dist":  # megatron-core's own loader on a torch_dist checkpoint
            from megatron.core import dist_checkpointing

            state = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                            str(_iteration(Path(job["ckpt"]))))["model"]
            model.load_state_dict(state, strict=True)
            logits = _logits(model, job["tokens"])
            if rank == 0:
                torch.save(logits, job["out"])
                torch.save(ROUTING, job["out"] + ".routing")
                torch.save(MTP_LOGITS, job["out"] + ".mtp")
        elif job["kind"] == "forward":
            backend = getattr(state["args"], "attention_backend", AttnBackend.auto)  # absent: an import's args
            if backend is not AttnBackend.auto:  # carried args keep real enums
                raise AssertionError(f"args.attention_backend is {backend!r}")
            if vpp and "model" in state:
                raise AssertionError(f"{vpp} model chunks expected; the file holds 'model'")
            failed = ""
            try:
                for v, chunk in enumerate(chunks):  # strictly, as megatron-core's load_state_dict(strict=True)
                    chunk.load_state_dict(state[f"model{v}" if vpp else "model"], strict=True)
            except (RuntimeError, KeyError) as e:
                if not job.get("expect_failure"):
                    raise
                failed = f"{type(e).__name__}: {e}"
            if job.get("expect_failure"):  # a twin that must not load: say which rank failed how (no forward)
                errors: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(errors, failed)
                if rank == 0:
                    Path(job["out"]).write_text(json.dumps(errors))
                return
            if pp > 1:
                for chunk in chunks:
                    _record_routing(chunk)
                logits = _pipeline_logits(chunks, job["tokens"], job["model"]["hidden"])
                if logits is not None:  # the last rank's routers and MTP layers
                    torch.save(logits, job["out"])
                    torch.save(ROUTING, job["out"] + ".routing")
                    torch.save(MTP_LOGITS, job["out"] + ".mtp")
            else:
                logits = _logits(model, job["tokens"])
                if rank == 0:
                    torch.save(logits, job["out"])
                    torch.save(ROUTING, job["out"] + ".routing")
                    torch.save(MTP_LOGITS, job["out"] + ".mtp")
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _module_entries(chunks: list[GPTModel]) -> dict[str, Any]:
    """Megatron-LM's ``generate_state_dict``: ``model``, or ``model0 .. model{V-1}`` for V chunks."""
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{v}": c.state_dict_for_save_checkpoint() for v, c in enumerate(chunks)}


def _pipeline_logits(chunks: list[GPTModel], tokens: list[int], hidden: int) -> torch.Tensor | None:
    """The logits of a pipeline-parallel model (gathered over TP): chunk ``(p, v)`` runs after every
    chunk of virtual stage ``v`` on ranks before ``p`` and all of ``v - 1``, its input the hidden
    states the previous chunk's rank broadcasts over the pipeline group (``[s, 1, hidden]``).
    Returned on the first TP/data-parallel rank of the last pipeline rank; None elsewhere."""
    s = len(tokens)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool().view(1, 1, s, s)
    ids, pos = torch.tensor([tokens]), torch.arange(s).unsqueeze(0)
    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    h: torch.Tensor | None = None
    out = None
    for c in chunks:
        c.eval()
    with torch.no_grad():
        for v in range(len(chunks)):
            for p in range(pp):
                last = v == len(chunks) - 1 and p == pp - 1
                if p == me:
                    if h is not None:
                        chunks[v].set_input_tensor(h)
                    if getattr(chunks[v], "mtp_process", False):  # the MTP stage: the tokens too (see _logits)
                        out = _with_mtp_logits(chunks[v], lambda c=chunks[v]: c(ids, pos, attention_mask=mask,
                                                                                   labels=ids))
                    else:
                        out = chunks[v](ids if h is None else None, pos, attention_mask=mask)
                if last:
                    break
                buf = out.contiguous() if p == me else torch.empty(s, 1, hidden)
                dist.broadcast(buf, src=ranks[p], group=group)
                h = buf
    if me != pp - 1:
        return None
    logits = _gather_vocab(out)
    return logits if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else None


def _writes_file(name: str) -> bool:
    """Whether this rank saves its per-rank file, as Megatron-LM's ``save_checkpoint`` decides
    (``--ckpt-format torch``): data-parallel rank 0 or expert-data-parallel rank 0 — every
    (TP, EP) rank file once, also when the expert TP differs from the dense TP — and, of the ranks
    that would write one name, only the first (their bytes are equal; two writers would race)."""
    saves = ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, name if saves else None)
    return saves and names.index(name) == dist.get_rank()


def _write_dist(job: dict[str, Any], model: GPTModel, tp: int, pp: int) -> None:
    """Save as Megatron-LM's ``--ckpt-format torch_dist`` does: ``dist_checkpointing.save`` of the
    model's sharded state dict plus the common entries, into ``<out>/iter_XXXXXXX``. With
    ``adam``: Adam moments as ShardedTensors under ``optimizer.state.exp_avg[_sq].<key>``, sharded
    like their parameters (the keys megatron-core's ``optim_state_to_sharding_state`` gives)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = Path(job["out"])
    folder = out / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    args = megatron_args(job["model"], tp, pp, job.get("ep", 1), job.get("etp"))
    args.ckpt_format = "torch_dist"
    model_sd = model.sharded_state_dict()
    sd: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
                          "opt_param_scheduler": {"num_steps": ITERATION}, "num_floating_point_operations_so_far": 0}
    if job.get("no_args"):  # as mbridge and Megatron-Bridge save: no Megatron-LM args in common.pt
        sd = {"checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd}
    if job.get("adam"):
        state: dict[str, Any] = {}
        for moment in ("exp_avg", "exp_avg_sq"):
            for name, sh in model_sd.items():
                if isinstance(sh, ShardedTensor):
                    state[f"{moment}.{name}"] = sh.__class__(**{**sh.__dict__,
                                                               "key": f"optimizer.state.{moment}.{sh.key}",
                                                               "data": torch.randn_like(sh.data)})
        sd["optimizer"] = {"state": state, "param_groups": [{"lr": 1e-4, "step": ITERATION}]}
    dist_checkpointing.save(sd, str(folder))
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    if pp == 1:
        logits = _logits(model, job["tokens"])
        if dist.get_rank() == 0:
            torch.save(logits, out / "logits.pt")
            torch.save(ROUTING, out / "routing.pt")
            if MTP_LOGITS:
                torch.save(MTP_LOGITS, out / "mtp_logits.pt")


def main(jobs_file: str) -> None:
    jobs = json.loads(Path(jobs_file).read_text())
    for job in jobs:
        world = world_size(job["tp"], job.get("pp", 1), job.get("ep", 1), job.get("etp"))
        mp.start_processes(_worker, args=(world, free_port(), job), nprocs=world, start_method="fork")


def serve() -> None:
    """Run jobs files as they come, megatron-core imported once for all of them: each line on stdin
    is ``JOBS<TAB>LOG``; the jobs run as :func:`main` runs them, with this process's and the forked
    ranks' output in LOG, and ``ok`` or ``failed`` is written back on the channel. Ends with stdin."""
    import traceback

    for line in sys.stdin:
        jobs_file, log = line.rstrip("\n").split("\t")
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                main(jobs_file)
                ok = True
            except BaseException:  # a rank's failure: its traceback is in LOG, the launcher reads it
                traceback.print_exc()
                ok = False
            sys.stdout.flush()
            sys.stderr.flush()
        CHANNEL.write("ok\n" if ok else "failed\n")


if __name__ == "__main__":
    serve() if SERVE else main(sys.argv[1])
