"""Mixture-of-experts benchmark: a synthetic fp16 megatron-core MoE checkpoint (8 layers, every
layer MoE with SwiGLU experts, TP 1) converted EP 8 -> EP 2 and EP 8 -> Hugging Face (Mixtral),
against the byte-copy floor of the source and, for EP 8 -> EP 2, the naive script a user would
write (load every EP rank's file, renumber the experts, save each target rank); then the same with
twice the experts: reshard's peak RSS must stay flat.

    python bench/bench_moe.py               # full run (64 and 128 experts)
    python bench/bench_moe.py --quick       # smoke test of the benchmark itself

Not part of the tests. Each command is its own process (wall time around it, peak RSS its
``ru_maxrss``); methods interleaved, medians of ``--runs``; the source is read once before each
run (warm cache). Sources are generated under ``bench/data/`` (git-ignored), one EP rank at a time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_hf import agree, report, same_rank_tensors, timed  # noqa: E402
from bench_torch_dist import FLOOR, reshard, size  # noqa: E402

#: The naive peer: every EP rank's file in memory, experts renumbered for the target EP.
NAIVE = [sys.executable, "-c", """
import re, sys, torch
from pathlib import Path
src, dst, ep = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
files = sorted(src.glob('iter_*/mp_rank_*/model_optim_rng.pt'))
ranks = [torch.load(f, map_location='cpu', weights_only=False) for f in files]
rx = re.compile(r'(.*\\.local_experts\\.)(\\d+)(\\..*)')
local = 1 + max(int(m.group(2)) for k in ranks[0]['model'] if (m := rx.match(k)))
experts = {}
for e, r in enumerate(ranks):
    for k, v in r['model'].items():
        if m := rx.match(k):
            experts[(m.group(1), e * local + int(m.group(2)), m.group(3))] = v
per = local * len(ranks) // ep
for e in range(ep):
    model = {k: v for k, v in ranks[0]['model'].items() if not rx.match(k)}
    for (a, g, b), v in experts.items():
        if g // per == e:
            model[f'{a}{g % per}{b}'] = v
    args = ranks[0]['args']
    args.expert_model_parallel_size = ep
    out = dst / files[0].parent.parent.name / f'mp_rank_00_{e:03d}' / 'model_optim_rng.pt'
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**ranks[0], 'args': args, 'model': model}, out)
"""]


def make_source(folder: Path, layers: int, experts: int, hidden: int, moe_ffn: int, heads: int, vocab: int,
                ep: int) -> Path:
    """A megatron-core MoE run folder at TP 1, EP ``ep``, fp16, written one EP rank at a time."""
    import torch

    if (folder / "latest_checkpointed_iteration.txt").is_file():
        return folder
    args = argparse.Namespace(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                              num_attention_heads=heads, kv_channels=hidden // heads, group_query_attention=False,
                              num_query_groups=1, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                              add_bias_linear=False, untie_embeddings_and_output_weights=True, vocab_size=vocab,
                              padded_vocab_size=vocab, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=1, num_experts=experts, moe_ffn_hidden_size=moe_ffn,
                              moe_router_topk=2,
                              transformer_impl="local", ckpt_format="torch")
    dense = torch.Generator().manual_seed(0)

    def rnd(g: torch.Generator, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.float16)

    shared: dict[str, Any] = {"embedding.word_embeddings.weight": rnd(dense, vocab, hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shared[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        shared[p + "self_attention.linear_proj.weight"] = rnd(dense, hidden, hidden)
        shared[p + "self_attention.linear_qkv.weight"] = rnd(dense, 3 * hidden, hidden)
        shared[p + "pre_mlp_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        shared[p + "mlp.router.weight"] = rnd(dense, experts, hidden)
    shared["decoder.final_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
    shared["output_layer.weight"] = rnd(dense, vocab, hidden)
    local = experts // ep
    for e in range(ep):
        g = torch.Generator().manual_seed(1 + e)
        model: dict[str, Any] = {}
        for k, v in shared.items():  # megatron-core's order: a layer's experts after its router
            model[k] = v
            if k.endswith("mlp.router.weight"):
                pre = k[: -len("router.weight")] + "experts.local_experts."
                for i in range(local):
                    model[f"{pre}{i}.linear_fc1.weight"] = rnd(g, 2 * moe_ffn, hidden)
                    model[f"{pre}{i}.linear_fc2.weight"] = rnd(g, hidden, moe_ffn)
        f = folder / "iter_0000001" / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}, f)
        del model
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    return folder


RESHARD, FLOOR_NAME = "reshard --direct EP 8 -> EP 2", "floor (EP 8 bytes)"
TO_HF = "reshard --direct EP 8 -> hf (Mixtral)"
NAIVE_NAME = "naive: load all, renumber, save"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-source"]:
        make_source(Path(argv[1]), **json.loads(argv[2]))
        return 0
    if argv[:1] == ["--compare"]:
        return 0 if same_rank_tensors(Path(argv[1]), Path(argv[2])) else 1
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    shape = dict(layers=8, hidden=1024, moe_ffn=256, heads=16, vocab=8192, ep=8)
    if ns.quick:
        shape, ns.experts, ns.runs = dict(layers=2, hidden=128, moe_ffn=64, heads=4, vocab=512, ep=8), 8, 1
    work = ns.work_dir / "moe"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for experts in (ns.experts, 2 * ns.experts):
        src = ns.data_dir / f"moe_{'quick' if ns.quick else 'l8'}_e{experts}_ep8_fp16"
        # in its own process: a child forked from a big parent would report the parent's peak RSS
        subprocess.run([sys.executable, __file__, "--make-source", str(src), json.dumps({**shape, "experts": experts})],
                       check=True)
        methods = {FLOOR_NAME: FLOOR + [str(src), "{out}"],
                   RESHARD: reshard(str(src), "{out}", "--target-tp", "1", "--target-ep", "2"),
                   NAIVE_NAME: NAIVE + [str(src), "{out}", "2"],
                   TO_HF: reshard(str(src), "{out}", "--to", "hf")}
        if experts != ns.experts:  # memory scaling: reshard only
            methods = {RESHARD: methods[RESHARD], TO_HF: methods[TO_HF]}
        else:
            same = agree(methods[RESHARD], methods[NAIVE_NAME], work, "--compare", __file__)
            results["same tensors as the naive script"] = same
        results[f"experts={experts}"] = {"source GB": round(size(src) / 1e9, 2),
                                          **timed(methods, src, work, ns.runs, f"E{experts}")}
    base, deep = results[f"experts={ns.experts}"], results[f"experts={2 * ns.experts}"]
    report(f"EP 8 -> EP 2, {ns.experts} experts x {shape['layers']} layers ({base['source GB']} GB)",
           {k: v for k, v in base.items() if isinstance(v, dict)}, FLOOR_NAME)
    for name in (RESHARD, TO_HF):
        print(f"peak RSS {name}: {base[name]['peak_rss_mib']} MiB with {ns.experts} experts, "
              f"{deep[name]['peak_rss_mib']} MiB with {2 * ns.experts} ({deep['source GB']} GB)")
    print(f"same tensors as the naive script: {results['same tensors as the naive script']}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
