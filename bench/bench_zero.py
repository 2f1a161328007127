"""Side-by-side benchmark on a ZeRO stage 2 checkpoint, in one run, at two depths (memory must stay
flat when the layers double): the fp32 master weights, ``reshard run --direct --weights master``
against DeepSpeed's own ``zero_to_fp32``; and the universal checkpoint, ``reshard run --direct --to
universal`` against DeepSpeed's ``ds_to_universal`` (both by their command lines).

    python bench/bench_zero.py                # hidden 4096, 2 and 4 layers, DP 2 (7.4 / 12.3 GB of optimizer state)
    python bench/bench_zero.py --quick        # smoke test of the script itself (tiny model)

The source is synthetic but has DeepSpeed's layout exactly (``zero_to_fp32`` reads it): a legacy-GPT
``mp_rank_00_model_states.pt`` (bf16 module, ``param_shapes``) and one
``zero_pp_rank_D_mp_rank_00_optim_states.pt`` per data-parallel rank holding its partition of the
flat fp32 group and the two Adam moments (and the ``param_slice_mappings`` and
``universal_checkpoint_info`` that ``ds_to_universal`` needs, as Megatron-DeepSpeed saves them).
Written under ``bench/data/`` (git-ignored) and deleted after its depth is measured (it is large).
Both pairs of outputs are checked to hold equal tensors.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf import report, timed  # noqa: E402
from bench_torch_dist import log  # noqa: E402

HERE = Path(__file__).resolve().parent
TAG = "global_step1"
DP = 2


def make_source(root: Path, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> Path:
    """A ZeRO-2 bf16 checkpoint of a legacy GPT, written parameter by parameter per DP rank."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from reshard.sample import GPTConfig, full_weights, shard_state_dicts

    step = root / TAG
    if (root / ".complete").exists():
        return step
    shutil.rmtree(root, ignore_errors=True)
    step.mkdir(parents=True)
    cfg = GPTConfig(layers=1, hidden=hidden, heads=heads, vocab=vocab, seq=seq)
    one = shard_state_dicts(cfg, full_weights(cfg, 0), 1, 2.0, dtype=torch.bfloat16)[0]
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    layer0 = [(k, v) for k, v in one.items() if ".layers.0." in k]
    for k, v in one.items():  # layer 0 repeated as layers 0..L-1, in Megatron's key order
        if ".layers.0." not in k:
            module[k] = v
        elif k == layer0[0][0]:
            for i in range(layers):
                for lk, lv in layer0:
                    module[lk.replace(".layers.0.", f".layers.{i}.")] = lv.clone()
    shapes = OrderedDict((k, v.shape) for k, v in module.items())
    total = sum(v.numel() for v in module.values())
    align = 2 * DP
    padded = math.ceil(total / align) * align
    part = padded // DP
    flat = torch.empty(padded, dtype=torch.float32)
    at = 0
    for v in module.values():  # master = the bf16 copy plus a little (so they differ)
        flat[at:at + v.numel()] = v.reshape(-1).float() + 1e-3
        at += v.numel()
    flat[at:] = 0
    uc_info = {"universal_checkpoint_version": 0.2, "original_vocab_size": vocab,
               "tp_replicated_parameter_patterns": [r".*layernorm\.(weight|bias)", r".*attention\.dense\.bias",
                                                    r".*mlp\.dense_4h_to_h\.bias", r".*position_embeddings\.weight"],
               "parameter_with_row_parallelism_patterns": [r".*attention\.dense\.weight",
                                                           r".*mlp\.dense_4h_to_h\.weight"],
               "vocabulary_parameter_patterns": [r".*word_embeddings\.weight"]}
    torch.save({"module": module, "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
                "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": OrderedDict(),
                "lr_scheduler": None, "global_steps": 1, "dp_world_size": DP, "mp_world_size": 1,
                "universal_checkpoint_info": uc_info, "checkpoint_version": 3.0, "ds_version": "0.19.8",
                "ds_config": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}},
               step / "mp_rank_00_model_states.pt")
    numels = [(k, v.numel()) for k, v in module.items()]
    del module
    for d in range(DP):
        mine = flat[d * part:(d + 1) * part].clone()
        state = {"step": torch.tensor(1.0), "exp_avg": mine * 0.5, "exp_avg_sq": mine * mine}
        lo, hi, at, slices = d * part, (d + 1) * part, 0, OrderedDict()
        for k, n in numels:  # where each parameter's elements are in this rank's partition
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                slices[k] = fragment_address(numel=b - a, start=a - lo)
            at += n
        torch.save({"optimizer_state_dict": {
            "zero_stage": 2, "partition_count": [DP], "single_partition_of_fp32_groups": [mine],
            "base_optimizer_state": {"state": {0: state}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
            "group_paddings": [padded - total if d == DP - 1 else 0], "ds_version": "0.19.8",
            "param_slice_mappings": [slices], "loss_scaler": None, "dynamic_loss_scale": False,
            "overflow": False, "clip_grad": 0.0},
            "ds_config": {}, "ds_version": "0.19.8"}, step / f"bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
        del mine, state
    (root / "latest").write_text(TAG)
    (root / ".complete").touch()
    return step


def _root(layers: int, shape: dict[str, int]) -> Path:
    return HERE / "data" / f"zero2_h{shape['hidden']}_l{layers}_dp{DP}_bf16"


def size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


COMPARE_UNIVERSAL = """
import sys, torch
from pathlib import Path
a, b = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(f.relative_to(b) for f in b.rglob("zero/**/*.pt"))
ok = bool(files) and sorted(f.relative_to(a) for f in a.rglob("zero/**/*.pt")) == files
for f in files if ok else []:
    x, y = torch.load(a / f, weights_only=False, mmap=True), torch.load(b / f, weights_only=False, mmap=True)
    if isinstance(y, dict) and "param" in y:
        ok = ok and list(x) == list(y) and torch.equal(x["param"], y["param"])
        ok = ok and all(x[k] == y[k] for k in y if k != "param")
    elif isinstance(y, torch.Tensor):
        ok = ok and torch.equal(x, y)
sys.exit(0 if ok else 1)
"""

COMPARE = """
import sys, torch
a = torch.load(sys.argv[1] + "/mp_rank_00_model_states.pt", mmap=True, weights_only=False)["module"]
b = torch.load(sys.argv[2] + "/pytorch_model.bin", mmap=True, weights_only=False)
sys.exit(0 if list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b) else 1)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--make", type=int, metavar="LAYERS", help=argparse.SUPPRESS)  # the child that writes a source
    ns = ap.parse_args(argv)
    shape = dict(hidden=256, heads=8, vocab=1024, seq=128) if ns.quick else \
        dict(hidden=4096, heads=32, vocab=50304, seq=2048)
    if ns.make:
        make_source(_root(ns.make, shape), ns.make, **shape)
        return 0
    depths = (1, 2) if ns.quick else (2, 4)
    work = HERE / "out" / "zero"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for layers in depths:
        root = _root(layers, shape)
        log(f"writing the source ({layers} layers)")
        # in a child: a parent that grew while writing it would hand its peak RSS to every command it forks
        subprocess.run([sys.executable, __file__, "--make", str(layers)] + (["--quick"] if ns.quick else []),
                       check=True)
        step = root / TAG
        optim = sum(f.stat().st_size for f in step.glob("*optim_states.pt"))
        methods = {
            "reshard --direct --weights master": [sys.executable, "-m", "reshard.cli", "run", "--direct", str(step),
                                                  "{out}", "--target-tp", "1", "--weights", "master"],
            "DeepSpeed zero_to_fp32": [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(root), "{out}",
                                       "-t", TAG],
        }
        universal = {
            "reshard --direct --to universal": [sys.executable, "-m", "reshard.cli", "run", "--direct", str(step),
                                                "{out}", "--to", "universal"],
            "DeepSpeed ds_to_universal": [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                          "--input_folder", str(step), "--output_folder", "{out}/" + TAG],
        }
        for group, floor, compare in ((methods, "DeepSpeed zero_to_fp32", COMPARE),
                                      (universal, "DeepSpeed ds_to_universal", COMPARE_UNIVERSAL)):
            rows = timed(group, step, work, ns.runs, f"{layers} layers")
            a, b = work / "check_reshard", work / "check_ds"
            for cmd, out in zip(group.values(), (a, b)):
                subprocess.run([c.replace("{out}", str(out)) for c in cmd], check=True, capture_output=True)
            same = subprocess.run([sys.executable, "-c", compare, str(a), str(b)]).returncode == 0
            shutil.rmtree(a)
            shutil.rmtree(b)
            report(f"\n{layers} layers: model states {size(step) - optim:,} B, optimizer files {optim:,} B; "
                   f"outputs hold equal tensors: {same}", rows, floor, ratio=f"x {floor.split()[-1]}")
        if not ns.quick:
            shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
