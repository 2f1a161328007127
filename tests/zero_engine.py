"""Save a legacy-GPT checkpoint with DeepSpeed's own engine under ZeRO stage 1, 2 or 3 (CPU, gloo),
one process per (data-parallel, tensor-parallel) rank:
``python tests/zero_engine.py OUT PORT RANK WORLD STAGE DTYPE [TP [RESUME]]`` (global rank ``dp * TP + tp``,
as Megatron-LM numbers them; with TP > 1 a model-parallel unit tells DeepSpeed the groups, as
Megatron-DeepSpeed's ``mpu`` does), or ``python tests/zero_engine.py --serve`` (the tests' launcher,
:func:`conftest.run_zero_engine`: one per test process, DeepSpeed and torch imported once; each line on
stdin is ``JOB<TAB>LOG``, a JSON list ``[OUT, STAGE, DTYPE, DP, TP, RESUME]``; it forks one process per
rank, which runs as the script runs, with their output in LOG, and answers ``ok`` or ``failed`` on
stdout. It computes nothing itself, so forking is safe.)

The model is :mod:`reshard.sample`'s small legacy GPT, its parameters registered under their
Megatron names (so reshard's rule table reads the checkpoint), trained two steps with Adam so the
fp32 master weights differ from the 16-bit module copy. Two parameter groups (no weight decay on
biases and norms, as Megatron-LM does), and the position embeddings frozen. The module carries the
``universal_checkpoint_info`` Megatron-DeepSpeed gives its models (which parameters are replicated
or row-parallel, the vocabulary), so DeepSpeed's ``ds_to_universal`` can convert the checkpoint.

With ``RESUME`` (a universal checkpoint's folder) the engine is started with
``checkpoint.load_universal`` instead, loads it, and data-parallel rank 0 saves what it resumed with
(every trained parameter's whole fp32 weight and Adam moments, the step, the groups' settings) to
``OUT`` (a ``torch.save`` file)."""

from __future__ import annotations

import json
import os
import sys

import deepspeed  # noqa: E402

# gloo's all-reduce, not DeepSpeed's shared-memory one: that op is compiled on first use into
# ~/.cache/torch_extensions (a minute per fresh HOME), and a build killed half-way leaves a lock that
# hangs every later engine start. The tests' DeepSpeed scripts all say this line.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from rendezvous import free_port  # noqa: E402
from reshard.sample import GPTConfig, full_weights, shard_state_dicts  # noqa: E402

FROZEN = "position_embeddings.weight"
#: DTYPE may name a variant, ``bf16-gather``: the config it adds.
VARIANTS = {
    "": {},
    # ZeRO-3 gathering 16-bit weights for save_16bit_model (the checkpoint's module files stay placeholders)
    "gather": {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": True}},
    # ZeRO-1 so configured runs DeepSpeed's BF16_Optimizer (its files name no ZeRO stage)
    "fp32acc": {"data_types": {"grad_accum_dtype": "fp32"}},
    # ZeRO-2 reordering each group's parameters round-robin over the ranks (param_shapes follows)
    "roundrobin": {"zero_optimization": {"round_robin_gradients": True}},
    # one Parameter under two names: the output layer tied to the word embeddings
    "tied": {},
}


class Leaf(nn.Module):
    """A module of the tree: its forward is its own parameters' share of the loss (a fixed random
    weighting of their entries), so ZeRO-3 gathers exactly its parameters when it is called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros((), dtype=torch.float32)
        for name, p in self._parameters.items():
            total = total + ((p.float() - 0.5) ** 2 * self.coef[name]).sum()
        return total * x.float().mean()


def populate(root: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Register ``sd``'s tensors as parameters of ``root`` under ``sd``'s dotted names."""
    gen = torch.Generator().manual_seed(1)
    for name, t in sd.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, Leaf())
                m._modules[part].coef = {}
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(t.detach().clone().float(), requires_grad=name != FROZEN))
        m.coef[leaf] = torch.randn(t.shape, generator=gen)


class Toy(nn.Module):
    """Every parameter gets a gradient: the loss is the sum of every module's share."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        populate(self, sd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(m(x) for m in self.modules() if isinstance(m, Leaf))


class ModelParallelUnit:
    """The groups DeepSpeed asks a model-parallel unit for: TP ranks adjacent, DP ranks strided."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, me = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_rank, self.dp_rank = me % tp, me // tp
        for d in range(self.dp):  # every process creates every group, in one order
            g = dist.new_group([d * tp + t for t in range(tp)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tp):
            g = dist.new_group([d * tp + t for d in range(self.dp)])
            if t == self.tp_rank:
                self.dp_group = g

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group


def run_rank(out: str, rank: int, stage: int, dtype: str, tp: int, resume: str | None) -> None:
    """One rank's job (its process's distributed environment already set): train two steps and
    save, or with ``resume`` load that universal checkpoint and save what was resumed. Ends the
    process (gloo's threads may abort an orderly interpreter exit once the files are saved)."""
    base, _, variant = dtype.partition("-")
    mpu = None
    if tp > 1:
        deepspeed.init_distributed(dist_backend="gloo")
        mpu = ModelParallelUnit(tp)
    cfg = GPTConfig(layers=2, hidden=64, heads=8, vocab=128, seq=32)
    module = shard_state_dicts(cfg, full_weights(cfg, 0), tp, 2.0, dtype=torch.float32)[rank % tp]
    model = Toy(module)
    if variant == "tied":  # the output layer is the word embeddings' Parameter under a second name (shared_params)
        model.add_module("output_layer", Leaf())
        model.output_layer.coef = {"weight": model.word_embeddings.coef["weight"]}
        model.output_layer.register_parameter("weight", model.word_embeddings.weight)
    model.universal_checkpoint_info = {  # as Megatron-DeepSpeed declares its GPT's layout
        "universal_checkpoint_version": 0.2,
        "tp_replicated_parameter_patterns": [r".*layernorm\.(weight|bias)", r".*attention\.dense\.bias",
                                             r".*mlp\.dense_4h_to_h\.bias"],  # (the frozen embeddings: none)
        "parameter_with_row_parallelism_patterns": [r".*attention\.dense\.weight", r".*mlp\.dense_4h_to_h\.weight"],
        "vocabulary_parameter_patterns": [r".*word_embeddings\.weight"],
        "original_vocab_size": cfg.vocab,
    }
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(".weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not any(p is q for q in decay)]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    if base in ("bf16", "fp16"):
        config[base] = {"enabled": True}
    for section, extra in VARIANTS[variant].items():
        config.setdefault(section, {}).update(extra)
    if resume:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=True, mpu=mpu,
                                      model_parameters=[{"params": decay, "weight_decay": 0.1 if not resume else 0.5},
                                                        {"params": no_decay, "weight_decay": 0.0}])
    if resume:  # the groups' settings (weight decay 0.5 above) must come from the checkpoint
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        engine.load_checkpoint(resume)
        state = {name: {"fp32": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                        "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
                 for name, p in model.named_parameters() if p.requires_grad}
        inner = engine.optimizer.optimizer
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        if stage == 3:  # keyed by the flat fp32 partitions (its universal loader empties the groups' params)
            steps = [inner.state[t].get("step") for t in engine.optimizer.fp32_partitioned_groups_flat]
        else:
            steps = [inner.state[g["params"][0]].get("step") for g in inner.param_groups]
        if rank == 0:
            torch.save({"params": state, "groups": groups, "steps": steps}, out)
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)
    x_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(base, torch.float32)
    for _ in range(2):
        x = torch.ones(2, 4, dtype=x_dtype)
        engine.backward(engine(x).float())
        engine.step()
    engine.save_checkpoint(out, tag="global_step2", client_state={"checkpoint_version": 3.0})
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def _set_rank_env(port: int | str, rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))


def _fork_job(job: list, log: str) -> bool:
    """Fork the job's ranks (each one process, as the script's), their output in ``log``; True when
    every rank exited 0."""
    out, stage, dtype, dp, tp, resume = job
    world, port = dp * tp, free_port()
    pids = []
    with open(log, "a") as f:
        for rank in range(world):
            pid = os.fork()
            if pid == 0:  # the rank: never returns
                try:
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.dup2(f.fileno(), 1)
                    os.dup2(f.fileno(), 2)
                    _set_rank_env(port, rank, world)
                    run_rank(out, rank, stage, dtype, tp, resume)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    os._exit(1)
            pids.append(pid)
    return all(os.waitpid(pid, 0)[1] == 0 for pid in pids)


def serve() -> None:
    """Run jobs as they come on stdin (``JOB<TAB>LOG``), answering ``ok`` or ``failed``; ends with stdin."""
    for line in sys.stdin:
        job, log = line.rstrip("\n").split("\t")
        ok = _fork_job(json.loads(job), log)
        sys.stdout.write("ok\n" if ok else "failed\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        _out, _port, _rank, _world, _stage, _dtype = sys.argv[1:7]
        _set_rank_env(_port, int(_rank), int(_world))
        run_rank(_out, int(_rank), int(_stage), _dtype, int(sys.argv[7]) if len(sys.argv) > 7 else 1,
                 sys.argv[8] if len(sys.argv) > 8 else None)
