"""TP N -> M with DeepSpeed's own MegatronSDLoader, as a user runs it: load each target rank
with ``SDLoaderFactory.get_sd_loader(...).load(M, r)`` and ``torch.save`` it.

    python bench/ds_reshard.py SRC_DIR DST_DIR --target-tp 2
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from deepspeed.runtime.state_dict_factory import SDLoaderFactory
from deepspeed.utils import logger

logger.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--target-tp", type=int, required=True)
    ns = ap.parse_args(argv)
    files = [str(p) for p in sorted(ns.src.glob("mp_rank_*_model_states.pt"))]
    ns.dst.mkdir(parents=True, exist_ok=True)
    loader = SDLoaderFactory.get_sd_loader(files, None, "Megatron", None)
    for r in range(ns.target_tp):
        _path, sd, _scales = loader.load(ns.target_tp, r)
        torch.save(sd, ns.dst / f"mp_rank_{r:02d}_model_states.pt")
        del sd
    return 0


if __name__ == "__main__":
    sys.exit(main())
