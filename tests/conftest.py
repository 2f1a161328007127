"""Shared fixtures: sample checkpoints written once per session, DeepSpeed on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from reshard.sample import GPTConfig, write_sample_checkpoint  # noqa: E402

CFG = GPTConfig(layers=2, hidden=64, heads=8, vocab=128, seq=16)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="session")
def sample_factory(tmp_path_factory):
    """``make(tp, version=2.0, dtype='fp32', **kw) -> folder``; each distinct checkpoint written once."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("samples")

    def make(tp: int, version: float = 2.0, dtype: str = "fp32", **kw) -> Path:
        key = (tp, version, dtype, tuple(sorted(kw.items())))
        if key not in cache:
            folder = root / f"tp{tp}_v{version}_{dtype}_{len(cache)}"
            write_sample_checkpoint(folder, tp=tp, cfg=kw.pop("cfg", CFG), version=version,
                                    dtype=DTYPES[dtype], save_version=version != 0, **kw)
            cache[key] = folder
        return cache[key]

    return make


def rank_files(folder: Path) -> list[str]:
    return [str(p) for p in sorted(Path(folder).glob("mp_rank_*_model_states.pt"))]


def load_modules(folder: Path, key: str = "module") -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=False)[key] for f in rank_files(folder)]
