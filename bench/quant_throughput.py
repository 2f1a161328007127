"""int8 group quantization throughput: reshard's quantizers (the cache-blocked one the engine
uses, and the one-expression vectorized reference) vs DeepSpeed's
``WeightQuantization.quantize_data``, on the same tensors (layer 0's four quantized weights of
one source rank), checking the results are bit-identical. Prints one JSON line.

    python bench/quant_throughput.py SRC_DIR [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from deepspeed.runtime.weight_quantizer import WeightQuantization

from reshard.core.quantize import quantize_groups
from reshard.core.quantize_blocked import quantize_groups_blocked
from reshard.core.safe_load import load_shard

WEIGHTS = ("attention.query_key_value.weight", "attention.dense.weight", "mlp.dense_h_to_4h.weight",
           "mlp.dense_4h_to_h.weight")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--seconds", type=float, default=3.0, help="time per quantizer (over 5 interleaved rounds)")
    ap.add_argument("--groups", type=int, default=64)
    ns = ap.parse_args(argv)
    module = load_shard(sorted(ns.src.glob("mp_rank_*_model_states.pt"))[0])["module"]
    tensors = []
    for k, v in module.items():
        if ".layers.0." in k and k.endswith(WEIGHTS):
            g = ns.groups * (2 if ".mlp." in k else 1)
            tensors.append((k, v.clone(), g))
    nbytes = sum(t.numel() * t.element_size() for _, t, _ in tensors)
    ds = WeightQuantization(mlp_extra_grouping=True)
    for k, t, g in tensors:  # identical results first
        q1, s1 = quantize_groups_blocked(t, 8, g, k)
        q2, s2 = ds.quantize_data(t, 8, g, k)
        q3, s3 = quantize_groups(t, 8, g, k)
        assert torch.equal(q1, q2) and torch.equal(s1.reshape(-1), s2.reshape(-1).to(s1.dtype)), k
        assert torch.equal(q1, q3) and torch.equal(s1, s3), k

    fns = {"ours": lambda t, g, k: quantize_groups_blocked(t, 8, g, k),
           "vectorized": lambda t, g, k: quantize_groups(t, 8, g, k),
           "theirs": lambda t, g, k: ds.quantize_data(t, 8, g, k)}
    rates: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 5
    for _ in range(rounds):  # interleaved rounds: the three see the same machine state
        for name, fn in fns.items():
            reps, t0 = 0, time.perf_counter()
            while True:
                for k, t, g in tensors:
                    fn(t, g, k)
                reps += 1
                dt = time.perf_counter() - t0
                if dt >= ns.seconds / rounds:
                    break
            rates[name].append(reps * nbytes / dt / 1e9)
    ours, vectorized, theirs = (statistics.median(rates[n]) for n in ("ours", "vectorized", "theirs"))
    print(json.dumps({"tensors": [k for k, _, _ in tensors], "bytes": nbytes, "reshard_gbps": ours,
                      "reshard_vectorized_gbps": vectorized, "deepspeed_gbps": theirs, "speedup": ours / theirs,
                      "vectorized_speedup": vectorized / theirs, "threads": torch.get_num_threads(),
                      "rounds": rates,
                      "bit_identical": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
