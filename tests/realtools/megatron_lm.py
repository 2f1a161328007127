"""Megatron-LM's own training code (``megatron.training``, shipped in megatron-core's wheel) on a CPU:
build the arguments from a command line, a GPT model as ``pretrain_gpt.py`` builds it, and save or
load checkpoints with ``save_checkpoint`` / ``load_checkpoint`` (side environment only).

One process per rank (gloo, world size TP x PP x DP as the job's command line asks), started with
``spawn`` from :func:`launch`. Each rank does what ``pretrain_gpt.py`` does before training:
``parse_args`` on the command line, ``validate_args``, ``set_global_variables`` (which builds the
tokenizer and pads the vocabulary), ``torch.distributed`` and ``mpu.initialize_model_parallel`` with
the arguments' sizes (``initialize_megatron`` does these only when CUDA devices exist), the random
seeds, then the model of Megatron-LM's GPT builder: ``core_transformer_config_from_args`` and the
local layer spec (``--transformer-impl local``; the decoder block spec for MoE).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, argv: list[str], work: Callable[..., Any], payload: Any,
               errors: Any) -> None:
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port),
                          CUDA_DEVICE_MAX_CONNECTIONS="1")
        warnings.filterwarnings("ignore")
        sys.path.insert(0, str(HERE))
        import cpu_shims

        cpu_shims.install_for_megatron_core()
        args = initialize(argv)
        work(args, payload)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def launch(world: int, argv: list[str], work: Callable[..., Any], payload: Any = None) -> None:
    """Run ``work(args, payload)`` on ``world`` ranks whose Megatron-LM command line is ``argv``."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, argv, work, payload, errors))
             for port in [free_port()] for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError("a rank failed:\n" + (errors.get() if not errors.empty() else "(no traceback)"))


def initialize(argv: list[str]) -> Any:
    """``pretrain_gpt.py``'s start on a CPU: parsed and validated args, process groups, seeds."""
    import random

    import numpy as np
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args)
    torch.distributed.init_process_group("gloo", world_size=args.world_size, rank=args.rank)
    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-dp-pp", create_gloo_process_groups=args.use_gloo_process_groups)
    seed = args.seed + 100 * mpu.get_pipeline_model_parallel_rank()  # Megatron-LM's _set_random_seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return args


def model_provider(args: Any, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
    """Megatron-LM's GPT builder for ``--transformer-impl local`` (``gpt_builders.py``'s choices)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        args.multi_latent_attention, normalization=args.normalization)
    mtp_spec = None
    if args.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp_spec,
        vp_stage=vp_stage)


def build_model(args: Any) -> list[Any]:
    """The model chunks of this rank, in the checkpoint dtype (``Float16Module`` as ``get_model`` wraps
    them with --bf16/--fp16; its state dict names are the inner model's)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.module import Float16Module

    model = model_provider(args, pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    if args.fp16 or args.bf16:
        model = Float16Module(model.config, model)
    return [model]


def logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """The model's logits on ``tokens`` (one sequence, causal mask given explicitly as the local
    attention needs it), gathered over tensor parallelism: ``[seq, padded_vocab]`` float32."""
    from megatron.core import parallel_state as mpu

    s = len(tokens)
    ids = torch.tensor([tokens])
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool().view(1, 1, s, s)
    model.eval()
    with torch.no_grad():
        out = model(ids, torch.arange(s).unsqueeze(0), attention_mask=mask)
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[0].float()
