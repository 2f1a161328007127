"""Write the benchmark's source checkpoint: a fp16 legacy-GPT DeepSpeed checkpoint at TP 8.

``reshard.sample`` writes a 1-layer model with the benchmark's widths (hidden 4096, 32 heads,
vocabulary 50304, 2048 positions); every rank file is then deepened to ``--layers`` layers by
copying layer 0 (each copy its own storage), so generating a 3 GB checkpoint never holds more
than one rank file in memory. Written once under ``bench/data/`` (git-ignored) and reused: a
folder is complete when it holds ``.complete``.

    python bench/make_source.py --layers 6 --out bench/data/gpt_h4096_l6_tp8_fp16
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

from reshard.sample import GPTConfig, write_sample_checkpoint

TP = 8


def config(quick: bool) -> GPTConfig:
    if quick:  # smoke test of the benchmark itself
        return GPTConfig(layers=1, hidden=512, heads=8, vocab=2048, seq=256)
    return GPTConfig(layers=1, hidden=4096, heads=32, vocab=50304, seq=2048)


def deepen(module: OrderedDict[str, torch.Tensor], layers: int) -> OrderedDict[str, torch.Tensor]:
    """Layer 0's tensors repeated as layers 0..layers-1, in Megatron's key order."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    layer0 = [(k, v) for k, v in module.items() if ".layers.0." in k]
    done = False
    for k, v in module.items():
        if ".layers.0." in k:
            if not done:
                for i in range(layers):
                    for k0, v0 in layer0:
                        out[k0.replace(".layers.0.", f".layers.{i}.")] = v0.clone()
                done = True
            continue
        out[k] = v.clone()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny widths (benchmark smoke test)")
    ns = ap.parse_args(argv)
    if (ns.out / ".complete").exists():
        return 0
    t0 = time.perf_counter()
    shutil.rmtree(ns.out, ignore_errors=True)
    base = ns.out.with_name(ns.out.name + ".base")
    shutil.rmtree(base, ignore_errors=True)
    write_sample_checkpoint(base, tp=TP, cfg=config(ns.quick), version=2.0, dtype=torch.float16)
    ns.out.mkdir(parents=True)
    for r in range(TP):
        name = f"mp_rank_{r:02d}_model_states.pt"
        sd = torch.load(base / name, map_location="cpu", weights_only=False, mmap=True)
        sd["module"] = deepen(sd["module"], ns.layers)
        sd["args"].num_layers = ns.layers
        torch.save(sd, ns.out / name)
        del sd
    shutil.rmtree(base)
    (ns.out / ".complete").write_text(f"layers={ns.layers} tp={TP}\n")
    size = sum(f.stat().st_size for f in ns.out.glob("*.pt"))
    print(f"wrote {ns.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
