"""Write the real-tool fixtures under ``tests/fixtures/realtools/`` (run in the side env: ``make
realtools-fixtures``). Every checkpoint is saved by the tool's own code on this CPU:

* ``megatron-core-<v>/<model>-<layout>-<format>/``: Megatron-LM's ``save_checkpoint`` (from the
  ``megatron.training`` package in megatron-core's wheel) after ``parse_args`` on a command line and
  ``validate_args``, as ``pretrain_gpt.py`` would at its first save. ``checkpoint/`` is the ``--save``
  folder (``latest_checkpointed_iteration.txt``, ``iter_0000020/``).
* ``megatron-bridge-<v>/<model>/``: ``hf/`` a tiny Hugging Face model made here with transformers (a
  config, random weights, ``save_pretrained``, and a word-level tokenizer built offline), and
  ``checkpoint/`` what Megatron-Bridge's ``AutoBridge.import_ckpt(hf, checkpoint)`` writes;
  ``llama-lora/``: a PEFT (LoRA) checkpoint Megatron-Bridge's ``save_checkpoint`` writes for that
  Llama (adapters only), and ``hf_adapter/`` its ``export_adapter_ckpt``; ``qwen3-moe-lora/`` the same
  on a Qwen3-MoE (LoRA on every expert's ``linear_fc1``/``linear_fc2``), and ``qwen3-moe-lora-ep2/``
  that LoRA saved by two expert-parallel ranks.

Beside each: ``fixture.json`` (versions, how it was made, tokens, vocabulary) and ``logits.pt``
(``tokens`` and the source model's ``logits`` on them, float32, computed by the tool's own forward:
megatron-core's for Megatron-LM fixtures, transformers' for the Hugging Face source of Megatron-Bridge
ones; Bridge fixtures also carry megatron-core's forward of the imported model as ``megatron_logits``).
The README there is generated from the ``fixture.json`` files.

Norm weights (ones at initialization) and MoE expert biases (zeros) are drawn at random before the
save, as training would leave them, so a dropped or swapped norm or bias changes the logits.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "realtools"
sys.path.insert(0, str(HERE))

import megatron_lm  # noqa: E402 (found on the path set above)

#: The tokens every fixture's logits are computed on (below every fixture's vocabulary).
TOKENS = [1, 7, 42, 3, 99, 15, 64, 2]
ITERATION = 20
HF_VOCAB = 128

# --- Megatron-LM ----------------------------------------------------------------------------------

#: What a user adds to run Megatron-LM on a CPU without Transformer Engine or Apex: the local layer
#: implementation, the fused kernels off, weights initialized on the CPU (the same values at every TP).
CPU_FLAGS = ("--transformer-impl local --no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion "
             "--use-cpu-initialization").split()

#: A training run's own flags (the batch, schedule and saving), as small as validate_args allows.
RUN_FLAGS = ("--micro-batch-size 1 --seq-length 16 --max-position-embeddings 16 --train-iters 20 --lr 1e-4 "
             f"--save-interval {ITERATION} --tokenizer-type NullTokenizer --vocab-size 100").split()

#: Llama-like: GQA, SwiGLU, RMSNorm, rope, untied embeddings, no biases.
LLAMA = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear").split()

#: Mixtral-like experts on the Llama body: 4 experts, top-2, expert parallel 2.
MOE = LLAMA + ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --expert-model-parallel-size 2").split()

#: DeepSeek-V3-like: MLA (q and kv low-rank, q/kv norms, yarn rope and norm epsilon 1e-6 as DeepSeek-V3's
#: scripts set them: transformers' DeepseekV3 fixes its latent norms at 1e-6, so only then is there an exact export),
#: a dense first layer then MoE with a shared expert, sigmoid router with expert bias and group-limited
#: routing, expert parallel 2. kv_channels and the yarn betas stay Megatron-LM's defaults (kv_channels,
#: hidden / heads = 8, is then neither head width, as in DeepSeek-V3: 7168 / 128 = 56 against 128).
DEEPSEEK = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --swiglu "
            "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --disable-bias-linear --multi-latent-attention "
            "--q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
            "--qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 "
            "--mscale-all-dim 1.0 --num-experts 4 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 "
            "--moe-router-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
            "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 --moe-router-group-topk 1 "
            "--moe-router-pre-softmax --moe-router-dtype fp32 --moe-layer-freq ([0]*1+[1]*1) "
            "--expert-model-parallel-size 2").split()

#: name -> (model flags, tensor parallel, world size: TP x EP here, data parallel filling EP's grid)
MLM_MODELS: dict[str, tuple[list[str], int, int]] = {
    "llama-tp2": (LLAMA, 2, 2),
    "moe-tp2-ep2": (MOE, 2, 4),
    "deepseek-mla-tp2-ep2": (DEEPSEEK, 2, 4),
}
FORMATS = ("torch", "torch_dist")


def perturb(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Draw the norm weights (around 1) and expert biases (around 0) from a generator keyed by the
    tensor's name, so replicated copies on every rank get the same values; the names it drew."""
    drawn = []
    with torch.no_grad():
        for name, t in named:
            leaf = name.rsplit(".", 1)[-1]
            is_norm = ("norm" in name and leaf == "weight") or leaf == "layer_norm_weight"
            is_bias = leaf in ("expert_bias", "e_score_correction_bias")
            if not (is_norm or is_bias):
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = torch.rand(t.shape, generator=g, dtype=torch.float32)
            t.copy_((1.0 + noise) if is_norm else (noise - 0.5))
            drawn.append(name)
    return drawn


def _mlm_save(args: Any, payload: dict[str, Any]) -> None:
    """One rank of a Megatron-LM fixture: build, draw norms and biases, logits, ``save_checkpoint``."""
    from megatron.training.checkpointing import save_checkpoint

    model = megatron_lm.build_model(args)
    inner = model[0]
    drawn = perturb([*inner.named_parameters(), *inner.named_buffers()])
    out = megatron_lm.logits(inner, TOKENS)
    save_checkpoint(ITERATION, model, None, None, 0)
    if args.rank == 0:
        torch.save({"tokens": torch.tensor(TOKENS), "logits": out}, payload["logits"])
        Path(payload["drawn"]).write_text(json.dumps(sorted(set(drawn))))


def write_mlm(name: str, fmt: str, root: Path) -> Path:
    flags, tp, world = MLM_MODELS[name]
    fixture = root / f"{name}-{fmt.replace('_', '-')}"
    ckpt = fixture / "checkpoint"
    fixture.mkdir(parents=True)
    argv = [*flags, *RUN_FLAGS, *CPU_FLAGS, "--tensor-model-parallel-size", str(tp), "--ckpt-format", fmt,
            "--save", str(ckpt)]
    drawn = fixture / "drawn.json"
    megatron_lm.launch(world, argv, _mlm_save, {"logits": str(fixture / "logits.pt"), "drawn": str(drawn)})
    meta = {"tool": "megatron-lm", "versions": versions(), "format": fmt, "world_size": world,
            "command_line": shlex.join(["pretrain_gpt.py", *argv]),
            "made_by": "megatron.training.arguments.parse_args + validate_args, set_global_variables; GPTModel from "
                       "core_transformer_config_from_args and the local layer spec; "
                       f"megatron.training.checkpointing.save_checkpoint(iteration={ITERATION}) on {world} gloo ranks",
            "iteration": ITERATION, "tokens": TOKENS, "vocab_size": 100,
            "logits": "megatron-core forward (eval, float32) of the saved model, gathered over TP; "
                      "columns = the padded vocabulary",
            "drawn_at_random": json.loads(drawn.read_text())}
    drawn.unlink()
    finish(fixture, meta)
    return fixture


# --- Megatron-Bridge ------------------------------------------------------------------------------

def hf_config(name: str) -> Any:
    """The tiny Hugging Face configs (bf16, as published checkpoints are; DeepSeek-V3 with 8 heads of
    hidden 64, as the Megatron-LM one)."""
    import transformers

    common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, dtype="bfloat16")
    if name == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common)
    if name == "qwen3-moe":
        # every layer MoE (decoder_sparse_step 1), no shared expert; head_dim 16 = 64 / 4
        return transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True,
                                           **common)
    if name == "deepseek-v3":
        common["num_attention_heads"] = 8
        return transformers.DeepseekV3Config(
            num_key_value_heads=8, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "rope_theta": 10000.0},
            **common)
    raise KeyError(name)


BRIDGE_MODELS = ("llama", "deepseek-v3", "qwen3-moe")

#: Megatron-LM command lines of the same models as the Hugging Face configs above (for checking, with
#: check_loads.py, that Megatron-LM loads a Megatron checkpoint of them): checked by loading reshard's
#: torch_dist and TP 2 outputs of each hf/ folder with them, to the hf/ logits within 3e-7. Qwen3-MoE
#: (the LoRA fixtures' MoE base) has none yet: no command line of it has been checked so.
HF_AS_MEGATRON_LM = {
    "llama": "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
             "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 "
             "--position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights "
             "--disable-bias-linear --max-position-embeddings 64",
    "deepseek-v3": "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --swiglu "
                   "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
                   "--untie-embeddings-and-output-weights --disable-bias-linear --multi-latent-attention "
                   "--q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 "
                   "--qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --rotary-base 10000 "
                   "--num-experts 4 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 "
                   "--moe-router-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                   "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 --moe-router-group-topk 1 "
                   "--moe-router-pre-softmax --moe-router-dtype fp32 --moe-layer-freq ([0]*1+[1]*1) "
                   "--max-position-embeddings 64",
}
#: what a run of either adds: the batch, and the checkpoints' dtype and vocabulary
HF_RUN_FLAGS = ("--seq-length 16 --micro-batch-size 1 --train-iters 1 --lr 1e-4 --tokenizer-type NullTokenizer "
                f"--vocab-size {HF_VOCAB} --bf16")


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of ``vocab`` entries built offline (``<unk>``, ``<s>``, ``</s>``, ``t3``...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_hf(name: str, out: Path) -> torch.Tensor:
    """The tiny Hugging Face model ``name`` saved to ``out``; its logits on TOKENS (float32 forward)."""
    import transformers

    config = hf_config(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb(list(model.state_dict(keep_vars=True).items()))
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer(HF_VOCAB).save_pretrained(out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return reloaded(torch.tensor([TOKENS])).logits[0].float()


def _bridge_rank(name: str, fixture: str, errors: Any) -> None:
    """Megatron-Bridge's import of one tiny model, in a process of its own (world 1, gloo)."""
    try:
        import cpu_shims

        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cpu_shims.install_for_bridge()
        import torch.distributed as dist
        from megatron.bridge import AutoBridge

        root = Path(fixture)
        hf, ckpt = root / "hf", root / "checkpoint"
        hf_logits = make_hf(name, hf)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{megatron_lm.free_port()}", world_size=1,
                                rank=0)
        AutoBridge.import_ckpt(str(hf), str(ckpt))
        # megatron-core's forward of the model Megatron-Bridge builds from the same weights
        bridge = AutoBridge.from_hf_pretrained(str(hf), dtype=torch.float32)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.params_dtype = torch.float32
        provider.bf16 = False
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        mcore_logits = megatron_lm.logits(model[0], TOKENS)
        torch.save({"tokens": torch.tensor(TOKENS), "logits": hf_logits, "megatron_logits": mcore_logits},
                   root / "logits.pt")
        dist.destroy_process_group()
    except BaseException:
        import traceback

        errors.put(traceback.format_exc())
        raise


#: The PEFT fixture: LoRA on the Llama fixture's model (Megatron-Bridge's default targets: linear_qkv,
#: linear_proj, linear_fc1, linear_fc2), rank 4, alpha 8; the step its save records.
LORA = {"dim": 4, "alpha": 8}
LORA_STEP = 10


def _lora_rank(rank: int, base: str, fixture: str, errors: Any, tp: int = 1, port: int = 0,
               float32: bool = False, ep: int = 1) -> None:
    """Megatron-Bridge's PEFT checkpoint of LoRA on the ``base`` fixture's model: the model as a
    fine-tuning run builds it (the provider's pre-wrap hook applies LoRA), its adapters drawn at
    random (LoRA starts with B = 0: a no-op), saved by Megatron-Bridge's own ``save_checkpoint`` with
    ``peft`` set, which keeps the adapter weights only; then Bridge's ``export_adapter_ckpt`` of the
    iteration folder to a Hugging Face PEFT adapter, and the logits of transformers + peft with it.
    At ``tp`` x ``ep`` > 1 one process per rank (gloo), no export (Megatron-Bridge's export builds the
    model at TP 1: the TP 1 fixture has it); ``ep``: expert parallel (each rank holds its experts'
    adapters under their local index, ``local_experts.0..``); ``float32``: the model built in float32 (its adapters then
    are: Megatron-Bridge casts them to a bf16 model's dtype whatever ``LoRA.lora_dtype`` says)."""
    try:
        import cpu_shims

        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cpu_shims.install_for_bridge()
        import peft as hf_peft
        import torch.distributed as dist
        import transformers
        from megatron.bridge import AutoBridge
        from megatron.bridge.peft.lora import LoRA
        from megatron.bridge.training.checkpointing import save_checkpoint
        from megatron.bridge.training.config import (
            CheckpointConfig,
            ConfigContainer,
            LoggerConfig,
        )
        from megatron.bridge.training.state import GlobalState
        from megatron.bridge.training.tokenizers.config import TokenizerConfig
        from megatron.core.optimizer import OptimizerConfig

        root, hf = Path(fixture), Path(base) / "hf"
        ckpt = root / "checkpoint"
        world = tp * ep
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or megatron_lm.free_port()}",
                                world_size=world, rank=rank)
        bridge = AutoBridge.from_hf_pretrained(str(hf))
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = tp
        provider.expert_model_parallel_size = ep
        if float32:
            provider.params_dtype, provider.bf16 = torch.float32, False
        provider.finalize()
        lora = LoRA(**LORA)
        provider.register_pre_wrap_hook(lambda chunks: lora(chunks, training=True))
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        from megatron.core import parallel_state as mpu

        with torch.no_grad():
            for name, p in model[0].named_parameters():
                if ".adapter." in name:
                    # at TP > 1 each rank's shard its own draw: a wrong split of any of them shows; under EP
                    # each rank's experts (named by their local index alike) their own, the replicated
                    # non-expert adapters one draw on every EP rank, as training keeps them
                    key = name if tp == 1 else f"{name}@{mpu.get_tensor_model_parallel_rank()}"
                    if ep > 1 and ".experts." in name:
                        key += f"@ep{mpu.get_expert_model_parallel_rank()}"
                    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        state = GlobalState()
        state.cfg = ConfigContainer(
            model=provider, train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False), ddp=None,
            scheduler=None, dataset=None, logger=LoggerConfig(),
            tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf)),
            checkpoint=CheckpointConfig(save=str(ckpt), save_optim=False, save_rng=False, ckpt_format="torch_dist",
                                        pretrained_checkpoint=str(Path(base) / "checkpoint")),
            dist=None, peft=lora)
        state.train_state.step = LORA_STEP
        save_checkpoint(state=state, model=model, optimizer=None, opt_param_scheduler=None,
                        num_floating_point_operations_so_far=0)
        # the saved model's forward in float32 (its bf16 weights upcast), as the references are
        mcore_logits = megatron_lm.logits(getattr(model[0], "module", model[0]).float(), TOKENS)
        if world > 1:
            if rank == 0:
                torch.save({"tokens": torch.tensor(TOKENS), "megatron_logits": mcore_logits}, root / "logits.pt")
            dist.destroy_process_group()
            return
        adapter = root / "hf_adapter"
        bridge.export_adapter_ckpt(str(ckpt / f"iter_{LORA_STEP:07d}"), str(adapter), show_progress=False)
        base_model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
        with torch.no_grad():
            peft_model = hf_peft.PeftModel.from_pretrained(base_model, str(adapter)).eval()
            hf_logits = peft_model(torch.tensor([TOKENS])).logits[0].float()
        torch.save({"tokens": torch.tensor(TOKENS), "logits": hf_logits, "megatron_logits": mcore_logits},
                   root / "logits.pt")
        dist.destroy_process_group()
    except BaseException:
        import traceback

        errors.put(traceback.format_exc())
        raise


def _bridge_export(base: str, fixture: str, errors: Any) -> None:
    """Megatron-Bridge's ``export_adapter_ckpt`` of a LoRA fixture saved on several ranks, in a
    process of its own (world 1, gloo): the export builds its model at TP 1 / EP 1 and loads the
    torch_dist checkpoint, whose tensors are global, at that layout."""
    try:
        import cpu_shims

        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cpu_shims.install_for_bridge()
        import torch.distributed as dist
        from megatron.bridge import AutoBridge

        root = Path(fixture)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{megatron_lm.free_port()}", world_size=1,
                                rank=0)
        bridge = AutoBridge.from_hf_pretrained(str(Path(base) / "hf"))
        bridge.export_adapter_ckpt(str(root / "checkpoint" / f"iter_{LORA_STEP:07d}"), str(root / "hf_adapter"),
                                   show_progress=False)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        errors.put(traceback.format_exc())
        raise


def write_lora(base: Path, root: Path, tp: int = 1, ep: int = 1) -> Path:
    """The LoRA fixture on the committed ``base`` fixture (its hf/ and checkpoint/), at TP ``tp`` and
    EP ``ep``."""
    import torch.multiprocessing as mp

    world = tp * ep
    fixture = root / (f"{base.name}-lora" + (f"-tp{tp}" if tp > 1 else "") + (f"-ep{ep}" if ep > 1 else ""))
    fixture.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    # on several ranks the model (and so its adapters) in float32: what keeping the adapters' dtype is checked on
    port = megatron_lm.free_port()
    procs = [ctx.Process(target=_lora_rank, args=(r, str(base), str(fixture), errors, tp, port, world > 1, ep))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"LoRA of {base.name} failed:\n" + (errors.get() if not errors.empty() else ""))
    if ep > 1:  # the expert-parallel save exported by Megatron-Bridge too (its float32 adapters written as bf16)
        proc = ctx.Process(target=_bridge_export, args=(str(base), str(fixture), errors))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"export of {fixture.name} failed:\n" + (errors.get() if not errors.empty() else ""))
    if world > 1:
        layout = f"tensor_model_parallel_size={tp}" + (f", expert_model_parallel_size={ep}" if ep > 1 else "")
        meta = {"tool": "megatron-bridge", "versions": versions(), "format": "torch_dist (adapters only)",
                "world_size": world, "tensor_parallel": tp, "base_fixture": f"../{base.name}",
                "lora": LORA, "step": LORA_STEP,
                "made_by": f"LoRA({LORA}) applied by the provider's pre-wrap hook to the model AutoBridge builds "
                           f"from ../{base.name}/hf in float32 at {layout} on {world} gloo ranks, "
                           "adapter weights drawn N(0, 0.1); megatron.bridge.training.checkpointing"
                           ".save_checkpoint with cfg.peft set -> checkpoint/",
                "tokens": TOKENS, "vocab_size": HF_VOCAB,
                "logits": "megatron_logits: megatron-core forward (float32, gathered over TP) of the LoRA model "
                          "that was saved"}
        if ep > 1:
            meta["expert_parallel"] = ep
            meta["made_by"] += (f"; AutoBridge.export_adapter_ckpt(checkpoint/iter_{LORA_STEP:07d}) in one process -> "
                                "hf_adapter/ (Hugging Face PEFT)")
        finish(fixture, meta)
        return fixture
    ref = torch.load(fixture / "logits.pt", weights_only=True)
    gap = (ref["megatron_logits"][:, :HF_VOCAB] - ref["logits"]).abs().max().item()
    meta = {"tool": "megatron-bridge", "versions": versions(), "format": "torch_dist (adapters only)",
            "world_size": 1, "base_fixture": f"../{base.name}", "lora": LORA, "step": LORA_STEP,
            "made_by": f"LoRA({LORA}) applied by the provider's pre-wrap hook to the model AutoBridge builds from "
                       f"../{base.name}/hf, adapter weights drawn N(0, 0.1); megatron.bridge.training.checkpointing"
                       f".save_checkpoint with cfg.peft set (pretrained_checkpoint = ../{base.name}/checkpoint) "
                       f"-> checkpoint/; AutoBridge.export_adapter_ckpt(checkpoint/iter_{LORA_STEP:07d}) -> "
                       "hf_adapter/ (Hugging Face PEFT)",
            "tokens": TOKENS, "vocab_size": HF_VOCAB,
            "logits": "transformers + peft forward (float32) of the base hf/ with hf_adapter/; megatron_logits: "
                      "megatron-core forward (float32, bf16 weights upcast) of the LoRA model that was saved",
            "max_abs_logit_gap_megatron_vs_hf": gap}
    finish(fixture, meta)
    return fixture


def write_bridge(name: str, root: Path) -> Path:
    import torch.multiprocessing as mp

    fixture = root / name
    fixture.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    proc = ctx.Process(target=_bridge_rank, args=(name, str(fixture), errors))
    proc.start()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"bridge import of {name} failed:\n" + (errors.get() if not errors.empty() else ""))
    ref = torch.load(fixture / "logits.pt", weights_only=True)
    gap = (ref["megatron_logits"][:, :HF_VOCAB] - ref["logits"]).abs().max().item()
    meta = {"tool": "megatron-bridge", "versions": versions(), "format": "torch_dist", "world_size": 1,
            "made_by": "transformers AutoModelForCausalLM.from_config (seed 0, norms/biases drawn), "
                       "save_pretrained in bf16 with a word-level tokenizer -> hf/; "
                       "megatron.bridge.AutoBridge.import_ckpt(hf, checkpoint) on one gloo rank",
            "hf_config": json.loads((fixture / "hf" / "config.json").read_text()),
            "tokens": TOKENS, "vocab_size": HF_VOCAB,
            "logits": "transformers forward (float32) of hf/; megatron_logits: megatron-core forward (float32) "
                      "of the model Megatron-Bridge builds from hf/ (columns = padded vocabulary)",
            "max_abs_logit_gap_megatron_vs_hf": gap}
    if name in HF_AS_MEGATRON_LM:
        meta["megatron_lm_flags"] = shlex.join(["pretrain_gpt.py", *shlex.split(HF_AS_MEGATRON_LM[name]),
                                                *shlex.split(HF_RUN_FLAGS)])
    finish(fixture, meta)
    return fixture


# --- common ---------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist_name in ("megatron-core", "megatron-bridge", "torch", "transformers"):
        out[dist_name] = md.version(dist_name)
    return out


def finish(fixture: Path, meta: dict[str, Any]) -> None:
    files = sorted(p for p in fixture.rglob("*") if p.is_file())
    meta["files"] = {str(p.relative_to(fixture)): p.stat().st_size for p in files}
    meta["bytes"] = sum(meta["files"].values())
    (fixture / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def write_readme(root: Path) -> None:
    lines = ["# Checkpoints written by the real tools", "",
             "Generated by `tests/realtools/write_fixtures.py` (`make realtools-fixtures`, in the side environment",
             "that `make side-env` builds); do not edit by hand. Each fixture's `fixture.json` holds the versions,",
             "how it was made and its file sizes; `logits.pt` the source model's logits on `tokens`.", "",
             "| fixture | tool | format | world | bytes | made by |", "|---|---|---|---|---|---|"]
    total = 0
    for meta_file in sorted(root.glob("*/*/fixture.json")):
        meta = json.loads(meta_file.read_text())
        total += meta["bytes"]
        how = meta.get("command_line", meta["made_by"])
        lines.append(f"| `{meta_file.parent.relative_to(root)}` | {meta['tool']} | {meta['format']} | "
                     f"{meta['world_size']} | {meta['bytes']} | `{how}` |")
    lines += ["", f"Total: {total} bytes.", ""]
    (root / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="fixture names to (re)write (default: all)")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    a = parser.parse_args()
    v = versions()
    mlm_root = a.out / f"megatron-core-{v['megatron-core']}"
    bridge_root = a.out / f"megatron-bridge-{v['megatron-bridge']}"
    jobs = [(f"{m}-{f.replace('_', '-')}", mlm_root, lambda root, m=m, f=f: write_mlm(m, f, root))
            for m in MLM_MODELS for f in FORMATS]
    jobs += [(b, bridge_root, lambda root, b=b: write_bridge(b, root)) for b in BRIDGE_MODELS]
    jobs.append(("llama-lora", bridge_root, lambda root: write_lora(bridge_root / "llama", root)))
    jobs.append(("llama-lora-tp2", bridge_root, lambda root: write_lora(bridge_root / "llama", root, tp=2)))
    jobs.append(("qwen3-moe-lora", bridge_root, lambda root: write_lora(bridge_root / "qwen3-moe", root)))
    jobs.append(("qwen3-moe-lora-ep2", bridge_root, lambda root: write_lora(bridge_root / "qwen3-moe", root, ep=2)))
    jobs.append(("qwen3-moe-lora-tp2-ep2", bridge_root,
                 lambda root: write_lora(bridge_root / "qwen3-moe", root, tp=2, ep=2)))
    for fixture_name, root, job in jobs:
        if a.only and fixture_name not in a.only:
            continue
        # a fixed staging folder: the tools record the save path (Megatron-LM's args.save, Bridge's
        # run_config.yaml), so a fixed one keeps a rewrite byte-stable apart from the tools' own stamps
        staging = Path(tempfile.gettempdir()) / "realtools-staging" / root.name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        print(f"== {fixture_name}", flush=True)
        written = job(staging)
        target = root / fixture_name
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(written, target)
        shutil.rmtree(staging)
    write_readme(a.out)


if __name__ == "__main__":
    main()
