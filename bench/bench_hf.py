"""Hugging Face export benchmark: megatron-core per-rank TP 8 -> ``--to hf`` (safetensors), against
the byte-copy floor of the source and the naive script a user would write (load every rank file,
merge each parameter, split it into Hugging Face names, ``safetensors.torch.save_file``), on the
~3 GB fp16 Llama-shaped checkpoint of ``bench_torch_dist.py`` (generated the same way).

    python bench/bench_hf.py               # full run
    python bench/bench_hf.py --quick       # smoke test of the benchmark itself (tiny model)

Not part of the tests. Each command is its own process (wall time around it, peak RSS its
``ru_maxrss``); methods interleaved, medians of ``--runs``; the source is read once before each
run (warm cache); outputs deleted and synced between runs. ``--deep-layers`` repeats reshard on a
model with twice the layers: peak RSS must stay flat.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_torch_dist import FLOOR, log, measure, parse_bench_args, reshard, size, source_for, warm  # noqa: E402

#: The naive peer: the whole model in memory, merged with the TP rules of this Llama shape.
NAIVE = [sys.executable, "-c", """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(src.glob('iter_*/mp_rank_*/model_optim_rng.pt'))
ranks = [torch.load(f, map_location='cpu', weights_only=False) for f in files]
args = ranks[0]['args']
mods = [r['model'] for r in ranks]
heads, groups, hd = args.num_attention_heads, args.num_query_groups, args.kv_channels
q = heads // groups
out = {}
for k in mods[0]:
    if k.endswith('_extra_state'):
        continue
    parts = [m[k] for m in mods]
    if 'linear_fc1.weight' in k:   # [gate_r; up_r] per rank -> [all gate; all up]
        halves = [p.chunk(2) for p in parts]
        t = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    elif 'linear_proj.weight' in k or 'linear_fc2.weight' in k:
        t = torch.cat(parts, dim=1)
    elif 'layernorm' in k or 'layer_norm' in k:
        t = parts[0].clone()
    else:
        t = torch.cat(parts)
    name = k
    if k.startswith('decoder.layers.'):
        i, rest = k.split('.')[2], k.split('.', 3)[3]
        pre = f'model.layers.{i}.'
        if rest.startswith('self_attention.linear_qkv.weight'):
            g = t.view(groups, (q + 2) * hd, -1)
            out[pre + 'self_attn.q_proj.weight'] = g[:, :q * hd].reshape(-1, t.shape[1]).clone()
            out[pre + 'self_attn.k_proj.weight'] = g[:, q * hd:(q + 1) * hd].reshape(-1, t.shape[1]).clone()
            out[pre + 'self_attn.v_proj.weight'] = g[:, (q + 1) * hd:].reshape(-1, t.shape[1]).clone()
            continue
        if rest.startswith('mlp.linear_fc1.weight'):
            gate, up = t.chunk(2)
            out[pre + 'mlp.gate_proj.weight'], out[pre + 'mlp.up_proj.weight'] = gate.clone(), up.clone()
            continue
        name = pre + {'input_layernorm.weight': 'input_layernorm.weight',
                      'self_attention.linear_proj.weight': 'self_attn.o_proj.weight',
                      'pre_mlp_layernorm.weight': 'post_attention_layernorm.weight',
                      'mlp.linear_fc2.weight': 'mlp.down_proj.weight'}[rest]
    else:
        name = {'embedding.word_embeddings.weight': 'model.embed_tokens.weight',
                'decoder.final_layernorm.weight': 'model.norm.weight', 'output_layer.weight': 'lm_head.weight'}[k]
    out[name] = t
dst.mkdir(parents=True, exist_ok=True)
save_file(out, str(dst / 'model.safetensors'), metadata={'format': 'pt'})
"""]


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return False
        return all(fa.get_tensor(k).equal(fb.get_tensor(k)) for k in fa.keys())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare"]:
        return 0 if same_tensors(Path(argv[1]), Path(argv[2])) else 1
    ns, shape = parse_bench_args(argv, __doc__.splitlines()[0])
    work = ns.work_dir / "hf"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for layers in [ns.layers] + ([ns.deep_layers] if ns.deep_layers else []):
        src = source_for(ns, layers, shape)
        methods = {
            "floor (per-rank TP 8 bytes)": FLOOR + [str(src)],
            "reshard --direct TP 8 -> hf": reshard(str(src), "{out}", "--to", "hf"),
            "naive: load all, merge, save_file": NAIVE + [str(src)],
        }
        if layers != ns.layers:
            methods = {k: v for k, v in methods.items() if k.startswith("reshard")}
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
        for i in range(ns.runs):
            for name, cmd in methods.items():
                out = work / "run_out"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                warm(src)
                log(f"L{layers} run {i + 1}/{ns.runs}: {name}")
                cmd = [c.replace("{out}", str(out)) for c in cmd] + ([] if name.startswith("reshard") else [str(out)])
                runs[name].append(measure(cmd))
                if name.startswith("reshard") and i == 0:
                    results.setdefault("output GB", round(size(out) / 1e9, 2))
        shutil.rmtree(work / "run_out", ignore_errors=True)
        if layers == ns.layers:  # the two exports hold the same tensors (the naive script is an independent check)
            a, b = work / "check_reshard", work / "check_naive"
            subprocess.run([c.replace("{out}", str(a)) for c in methods["reshard --direct TP 8 -> hf"]], check=True,
                           capture_output=True)
            subprocess.run(NAIVE + [str(src), str(b)], check=True)
            # in a child process: the comparison maps both outputs, and children forked from a big
            # parent would report its peak RSS as theirs
            results["same tensors as the naive script"] = subprocess.run(
                [sys.executable, __file__, "--compare", str(a), str(b)]).returncode == 0
            shutil.rmtree(a)
            shutil.rmtree(b)
        results[f"layers={layers}"] = {
            "source GB": round(size(src) / 1e9, 2),
            **{m: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                   "peak_rss_mib": round(statistics.median(r["rss_mib"] for r in rs))} for m, rs in runs.items()}}
    base = results[f"layers={ns.layers}"]
    floor = base["floor (per-rank TP 8 bytes)"]["seconds"]
    print(f"{'method':36} {'seconds':>8} {'x floor':>8} {'peak RSS':>10}")
    for name, rec in base.items():
        if isinstance(rec, dict):
            print(f"{name:36} {rec['seconds']:8.2f} {rec['seconds'] / floor:8.2f} {rec['peak_rss_mib']:7d} MiB")
    if ns.deep_layers:
        deep = results[f"layers={ns.deep_layers}"]["reshard --direct TP 8 -> hf"]["peak_rss_mib"]
        print(f"peak RSS reshard: {base['reshard --direct TP 8 -> hf']['peak_rss_mib']} MiB at {ns.layers} layers, "
              f"{deep} MiB at {ns.deep_layers} layers")
    print(f"same tensors as the naive script: {results['same tensors as the naive script']}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
