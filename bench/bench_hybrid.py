"""Hybrid-family benchmark (issue 56): a Qwen3-Next MoE folder (gated DeltaNet and gated attention,
routed experts with a shared expert) and a Nemotron-H MoE folder (Mamba-2, attention and MoE layers),
each converted

* Hugging Face -> megatron-core per-rank TP 2 x EP 2 (expert TP 1), and
* that TP 2 x EP 2 checkpoint -> Hugging Face (``--to hf``),

against the byte-copy floor of the bytes each reads and writes (read the source once, write as many
bytes as the output holds: ``bench_fp8.FLOOR``), at ``--layers`` and twice as many layers: reshard's
peak RSS must stay within 1 GiB and flat as the layers double. The round trip HF -> TP 2 x EP 2 -> HF
must give the source's tensors bit for bit (checked at the first depth).

The folders are transformers' own: the model built on the meta device from its config, its
parameters filled with random bf16 values (norms ones, so the zero-centred gated norm's ``w - 1`` is
exact; the router's float32 where transformers keeps it so) and written by ``save_pretrained``, in a
child process of its own (its peak RSS is not measured).

    python bench/bench_hybrid.py             # full run (~3.5 GB of disk at the peak)
    python bench/bench_hybrid.py --quick     # smoke test of the benchmark itself (tiny models)

Not part of the tests. Each command is its own process (wall time around it, peak RSS its
``ru_maxrss``); methods interleaved, medians of ``--runs``; the source warm before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fp8 import FLOOR  # noqa: E402
from bench_hf import report, timed  # noqa: E402
from bench_mxfp4 import remove, same_tensors  # noqa: E402
from bench_torch_dist import SETTLE, log, reshard, size  # noqa: E402

#: Qwen3-Next's layer kinds repeat every ``full_attention_interval`` (4) layers; Nemotron-H's by this
#: unit (Nemotron-H's own mixture: Mamba, MoE, Mamba, attention), so doubling the layers doubles each kind.
NEMOTRON_UNIT = ("mamba", "moe", "mamba", "attention")

#: Each family's config at bench size (hidden 1024, 64 routed experts; about 0.5 GB of bf16 at the
#: default depth) and a tiny one for ``--quick``; ``num_hidden_layers`` / ``layers_block_type`` are set
#: by depth.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        "class": "Qwen3NextForCausalLM", "config": "Qwen3NextConfig",
        "full": dict(vocab_size=32768, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                     linear_num_value_heads=8, intermediate_size=2048, num_experts=64, num_experts_per_tok=8,
                     moe_intermediate_size=256, shared_expert_intermediate_size=512, full_attention_interval=4),
        "quick": dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, full_attention_interval=4)},
    "nemotron_h": {
        "class": "NemotronHForCausalLM", "config": "NemotronHConfig",
        "full": dict(vocab_size=32768, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                     intermediate_size=2048, ssm_state_size=128, mamba_num_heads=32, mamba_head_dim=64, n_groups=8,
                     chunk_size=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=512,
                     moe_shared_expert_intermediate_size=1024, tie_word_embeddings=False),
        "quick": dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                      chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      moe_shared_expert_intermediate_size=48, tie_word_embeddings=False)},
}


def make_source(folder: Path, family: str, layers: int, config: dict[str, Any]) -> None:
    """transformers' folder of ``family`` with ``layers`` layers and random weights (module docstring)."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = FAMILIES[family]
    cfg = dict(config)
    if family == "nemotron_h":
        cfg["layers_block_type"] = [NEMOTRON_UNIT[i % len(NEMOTRON_UNIT)] for i in range(layers)]
    else:
        cfg["num_hidden_layers"] = layers
    conf = getattr(transformers, spec["config"])(**cfg)
    with torch.device("meta"):
        model = getattr(transformers, spec["class"])(conf).to(torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dtype.is_floating_point:
                if "norm" in name.rsplit(".", 2)[-2] or name.endswith(".D"):
                    t.fill_(1.0)
                else:
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    for name, m in model.named_modules():  # Nemotron-H's router in float32, as transformers keeps it
        if name.endswith("mixer.gate"):
            m.float()
    model.config.dtype = "bfloat16"
    model.save_pretrained(folder)


def sources(ns: argparse.Namespace, family: str, layers: int) -> Path:
    folder = ns.data_dir / f"hybrid_{family}_{'quick' if ns.quick else 'h1024'}_l{layers}"
    if not (folder / "config.json").is_file():
        remove(folder)
        log(f"writing {folder.name}")
        # its own process: a child forked from a big parent would report the parent's peak RSS
        subprocess.run([sys.executable, __file__, "--make-source", str(folder), family, str(layers),
                        json.dumps(FAMILIES[family]["quick" if ns.quick else "full"])], check=True)
    return folder


def run_reshard(src: Path, dst: Path, *args: str) -> None:
    remove(dst)
    subprocess.run([c.replace("{out}", str(dst)) for c in reshard(str(src), "{out}", *args)], check=True,
                   capture_output=True)


LAYOUT = ("--target-tp", "2", "--target-ep", "2", "--target-etp", "1")
TO_RANKS, TO_HF = "reshard hf -> TP 2 x EP 2", "reshard TP 2 x EP 2 -> hf"
RANKS_FLOOR, HF_FLOOR = "floor (read hf, write the rank files' bytes)", "floor (read rank files, write hf bytes)"
#: Peak RSS reshard must stay within (issue 56).
RSS_LIMIT_MIB = 1024


def depth(ns: argparse.Namespace, family: str, layers: int, first: bool, work: Path) -> dict[str, Any]:
    """One family at one depth: the TP 2 x EP 2 form and the round trip made once (their sizes are
    the floors' output bytes; the round trip is checked bit for bit), then the timed runs."""
    hf = sources(ns, family, layers)
    ranks, back = work / f"{family}_l{layers}_ranks", work / f"{family}_l{layers}_back"
    run_reshard(hf, ranks, *LAYOUT)
    run_reshard(ranks, back, "--to", "hf")
    rec: dict[str, Any] = {"hf GB": round(size(hf) / 1e9, 3), "ranks GB": round(size(ranks) / 1e9, 3)}
    if first:
        rec["round trip bit for bit"] = subprocess.run([sys.executable, __file__, "--compare", str(hf),
                                                        str(back)]).returncode == 0
        log(f"{family} L{layers} round trip bit for bit: {rec['round trip bit for bit']}")
    to_ranks = {RANKS_FLOOR: FLOOR + [str(hf), "{out}", str(size(ranks))], TO_RANKS: reshard(str(hf), "{out}", *LAYOUT)}
    to_hf = {HF_FLOOR: FLOOR + [str(ranks), "{out}", str(size(back))],
             TO_HF: reshard(str(ranks), "{out}", "--to", "hf")}
    remove(back)
    if not first:  # memory scaling: reshard only
        to_ranks, to_hf = {TO_RANKS: to_ranks[TO_RANKS]}, {TO_HF: to_hf[TO_HF]}
    label = f"{family} L{layers}"
    rec["to-ranks"] = timed(to_ranks, hf, work, ns.runs, f"{label} to-ranks", ns.settle)
    rec["to-hf"] = timed(to_hf, ranks, work, ns.runs, f"{label} to-hf", ns.settle)
    log(f"{label}: {json.dumps(rec)}")
    remove(ranks)
    if not ns.keep:
        remove(hf)
    return rec


def summary(ns: argparse.Namespace, results: dict[str, Any]) -> None:
    for family in ns.family:
        base, deep = results[f"{family} layers={ns.layers}"], results[f"{family} layers={2 * ns.layers}"]
        print(f"\n{family}: hf {base['hf GB']} GB, TP 2 x EP 2 rank files {base['ranks GB']} GB at {ns.layers} "
              f"layers; {deep['hf GB']} / {deep['ranks GB']} GB at {2 * ns.layers}; round trip bit for bit: "
              f"{base['round trip bit for bit']}")
        for group, name, floor in (("to-ranks", TO_RANKS, RANKS_FLOOR), ("to-hf", TO_HF, HF_FLOOR)):
            report(f"{family} {group}", base[group], floor)
            a, b = base[group][name]["peak_rss_mib"], deep[group][name]["peak_rss_mib"]
            print(f"  peak RSS {a} MiB at {ns.layers} layers, {b} MiB at {2 * ns.layers} ({b / a - 1:+.1%}); "
                  f"deep wall {deep[group][name]['seconds']:.2f} s; within {RSS_LIMIT_MIB} MiB: "
                  f"{max(a, b) <= RSS_LIMIT_MIB}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-source"]:
        make_source(Path(argv[1]), argv[2], int(argv[3]), json.loads(argv[4]))
        return 0
    if argv[:1] == ["--compare"]:
        return 0 if same_tensors(Path(argv[1]), Path(argv[2])) else 1
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="the first depth (a multiple of 4); then twice as many")
    ap.add_argument("--family", action="append", choices=tuple(FAMILIES), default=None,
                    help="benchmark only these families (repeatable; default: both)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the generated Hugging Face folders")
    ap.add_argument("--settle", type=float, default=SETTLE)
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    ns.family = ns.family or list(FAMILIES)
    if ns.quick:
        ns.runs, ns.settle = 1, 0.5
    # reshard as installed (pip compiles its bytecode at install), as bench_fp8.py
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "reshard")], check=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    work = ns.work_dir / "hybrid"
    remove(work)
    results: dict[str, Any] = {}
    for family in ns.family:
        for layers in (ns.layers, 2 * ns.layers):
            results[f"{family} layers={layers}"] = depth(ns, family, layers, layers == ns.layers, work)
    summary(ns, results)
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    shutil.rmtree(work / "run_out", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
