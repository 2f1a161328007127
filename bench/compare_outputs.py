"""Byte-identical outputs across a refactor: run a fixed set of conversions and record, or check,
the SHA-256 of every file they write.

The set covers every built-in format and family: legacy Megatron GPT per-rank files (DeepSpeed,
int8 quantized, Megatron-LM run folders at PP 2), megatron-core per-rank (dense at TP and PP
changes, MoE at an EP change), torch_dist in and out (dense and MoE), Hugging Face export and
import (Llama and Qwen3, made by transformers), ZeRO-2 and ZeRO-3 master weights and universal
checkpoints (saved by DeepSpeed's engine). Sources are written once by the real tools (megatron-core
and DeepSpeed on CPU through the test harnesses, transformers) under ``--sources``, seeded, and
reused; the manifest (``reshard_manifest.json``: times and the code version) is left out of the
comparison.

    python bench/compare_outputs.py --sources /tmp/cmp_src --record before.json   # old code
    python bench/compare_outputs.py --sources /tmp/cmp_src --check before.json    # new code

``--check`` exits 1 naming every conversion whose files differ (or that now fails or succeeds
where it did not), 0 when every byte is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
MANIFEST = "reshard_manifest.json"


def _sources(root: Path) -> dict[str, Path]:
    """Every source checkpoint, written once under ``root`` (a folder is done when ``.complete`` is)."""
    sys.path.insert(0, str(TESTS))
    import torch

    from reshard.sample import GPTConfig, write_sample_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    out = {"ds_legacy_tp4": root / "ds_legacy_tp4", "llama_tp2": root / "llama_tp2_pp1",
           "gqa_tp2_pp2": root / "gqa_tp2_pp2", "gqa_swiglu_dist_tp2": root / "gqa_swiglu_tp2_dist",
           "moe_tp1_ep2": root / "moe_tp1_ep2", "moe_dist_tp2_ep2": root / "moe_tp2_ep2_dist",
           "hf_llama": root / "hf_llama", "hf_qwen3": root / "hf_qwen3",
           "zero2": root / "zero2", "zero3": root / "zero3"}
    if (root / ".complete").exists():
        return _with_tags(out)
    shutil.rmtree(root)
    root.mkdir(parents=True)
    write_sample_checkpoint(out["ds_legacy_tp4"], tp=4, cfg=GPTConfig(), version=3.0, dtype=torch.float16)

    from mcore_fixtures import TOKENS, model_options, moe_options, run_harness

    jobs = [{"kind": "write", "out": str(out["llama_tp2"]), "tp": 2, "pp": 1, "model": model_options("llama"),
             "tokens": TOKENS},
            {"kind": "write", "out": str(out["gqa_tp2_pp2"]), "tp": 2, "pp": 2, "model": model_options("gqa"),
             "tokens": TOKENS},
            {"kind": "write_dist", "out": str(out["gqa_swiglu_dist_tp2"]), "tp": 2, "pp": 1, "adam": True,
             "model": model_options("gqa_swiglu"), "tokens": TOKENS},
            {"kind": "write", "out": str(out["moe_tp1_ep2"]), "tp": 1, "ep": 2, "pp": 1, "model": moe_options("moe"),
             "tokens": TOKENS},
            {"kind": "write_dist", "out": str(out["moe_dist_tp2_ep2"]), "tp": 2, "ep": 2, "model": moe_options("moe"),
             "tokens": TOKENS}]
    run_harness(jobs, root / "harness")

    from test_hf_import import make_hf_model

    make_hf_model("llama", out["hf_llama"])
    make_hf_model("qwen3", out["hf_qwen3"])

    from conftest import run_zero_engine

    run_zero_engine(out["zero2"], 2, "fp32", 2)
    run_zero_engine(out["zero3"], 3, "fp32", 2)
    (root / ".complete").write_text("sources written\n")
    return _with_tags(out)


def _with_tags(out: dict[str, Path]) -> dict[str, Path]:
    from conftest import ZERO_TAG

    return {k: (v / ZERO_TAG if k.startswith("zero") else v) for k, v in out.items()}


#: name -> (source, options of reshard.api.convert)
CONVERSIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "ds_legacy tp4->2": ("ds_legacy_tp4", {"target_tp": 2}),
    "ds_legacy tp4->1 int8": ("ds_legacy_tp4", {"target_tp": 1, "quantize": True}),
    "ds_legacy -> torch_dist": ("ds_legacy_tp4", {"to": "torch_dist"}),
    "llama tp2->1": ("llama_tp2", {"target_tp": 1}),
    "llama tp2 pp1 -> tp1 pp2": ("llama_tp2", {"target_tp": 1, "target_pp": 2}),
    "llama -> hf": ("llama_tp2", {"to": "hf"}),
    "llama -> torch_dist": ("llama_tp2", {"to": "torch_dist"}),
    "gqa tp2 pp2 -> tp1 pp1": ("gqa_tp2_pp2", {"target_tp": 1, "target_pp": 1}),
    "torch_dist gqa_swiglu -> megatron tp4": ("gqa_swiglu_dist_tp2", {"to": "megatron", "target_tp": 4}),
    "torch_dist gqa_swiglu -> hf (refused: LayerNorm)": ("gqa_swiglu_dist_tp2", {"to": "hf"}),
    "moe ep2 -> tp2 ep1": ("moe_tp1_ep2", {"target_tp": 2, "target_ep": 1}),
    "moe -> torch_dist": ("moe_tp1_ep2", {"to": "torch_dist"}),
    "moe torch_dist -> megatron tp1 ep4": ("moe_dist_tp2_ep2", {"to": "megatron", "target_tp": 1, "target_ep": 4}),
    "hf llama -> megatron tp2": ("hf_llama", {"to": "megatron", "target_tp": 2}),
    "hf qwen3 -> torch_dist": ("hf_qwen3", {"to": "torch_dist"}),
    "zero2 master -> tp1": ("zero2", {"target_tp": 1, "weights": "master"}),
    "zero2 -> universal": ("zero2", {"to": "universal"}),
    "zero3 master -> tp1": ("zero3", {"target_tp": 1, "weights": "master"}),
    "zero3 -> universal": ("zero3", {"to": "universal"}),
}


def _digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def run_all(sources: dict[str, Path], work: Path) -> dict[str, Any]:
    from reshard import api
    from reshard.core.errors import ReshardError

    results: dict[str, Any] = {}
    for i, (name, (src, options)) in enumerate(CONVERSIONS.items()):
        dst = work / f"c{i}"
        try:
            api.convert(str(sources[src]), str(dst), **options)
        except ReshardError as exc:
            results[name] = {"error": str(exc)}
        else:
            results[name] = _digests(dst)
        shutil.rmtree(dst, ignore_errors=True)
        print(f"{name}: {'refused' if 'error' in results[name] else f'{len(results[name])} files'}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=Path, required=True, help="folder of the source checkpoints (written once)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, help="write the digests to this JSON file")
    mode.add_argument("--check", type=Path, help="compare with the digests in this JSON file")
    ns = ap.parse_args(argv)
    sources = _sources(ns.sources)
    with tempfile.TemporaryDirectory() as work:
        got = run_all(sources, Path(work))
    if ns.record:
        ns.record.write_text(json.dumps(got, indent=1, sort_keys=True))
        print(f"recorded {len(got)} conversions, {sum(len(v) for v in got.values())} files: {ns.record}")
        return 0
    want = json.loads(ns.check.read_text())
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    for k in bad:
        w, g = want.get(k, {}), got.get(k, {})
        files = sorted(f for f in set(w) | set(g) if w.get(f) != g.get(f))
        print(f"DIFFERENT: {k}: {', '.join(files[:6])}{' ...' if len(files) > 6 else ''}")
    print(f"{len(got) - len(bad)} of {len(got)} conversions byte-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
