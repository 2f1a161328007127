"""Hugging Face benchmark, both directions, on the ~3 GB fp16 Llama-shaped checkpoint of
``bench_torch_dist.py`` (generated the same way):

* export: megatron-core per-rank TP 8 -> ``--to hf`` (safetensors), against the byte-copy floor of
  the source and the naive script a user would write (load every rank file, merge each parameter,
  split it into Hugging Face names, ``safetensors.torch.save_file``);
* import: that Hugging Face folder -> megatron-core per-rank TP 2, against its byte-copy floor and
  the naive script (``load_file`` every shard, fuse Q/K/V and gate/up, pad the vocabulary, split
  for TP 2, ``torch.save`` each rank).

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

from bench_torch_dist import FLOOR, SETTLE, log, measure, parse_bench_args, reshard, settle, size, source_for, warm  # noqa: E402
from contention import busy, load_note  # noqa: E402

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


#: The naive importer: every shard in memory, fused and split for TP 2 with this Llama shape's rules.
NAIVE_IMPORT = [sys.executable, "-c", """
import argparse, json, math, sys, torch
from pathlib import Path
from safetensors.torch import load_file
src, dst, tp = Path(sys.argv[1]), Path(sys.argv[2]), 2
cfg = json.loads((src / 'config.json').read_text())
sd = {}
for f in sorted(src.glob('*.safetensors')):
    sd.update(load_file(str(f)))
heads, groups, hidden = cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['hidden_size']
hd, q = cfg.get('head_dim') or hidden // heads, heads // groups
vocab = cfg['vocab_size']
padded = math.ceil(vocab / (128 * tp)) * 128 * tp
def pad(t):
    return torch.cat([t, t.new_zeros(padded - vocab, t.shape[1])])
core = {'embedding.word_embeddings.weight': pad(sd['model.embed_tokens.weight'])}
for i in range(cfg['num_hidden_layers']):
    p, c = f'model.layers.{i}.', f'decoder.layers.{i}.'
    qw, kw, vw = (sd[p + f'self_attn.{x}_proj.weight'].view(groups, -1, hidden) for x in 'qkv')
    core[c + 'input_layernorm.weight'] = sd[p + 'input_layernorm.weight']
    core[c + 'self_attention.linear_qkv.weight'] = torch.cat([qw, kw, vw], dim=1).reshape(-1, hidden)
    core[c + 'self_attention.linear_proj.weight'] = sd[p + 'self_attn.o_proj.weight']
    core[c + 'pre_mlp_layernorm.weight'] = sd[p + 'post_attention_layernorm.weight']
    core[c + 'mlp.linear_fc1.weight'] = torch.cat([sd[p + 'mlp.gate_proj.weight'], sd[p + 'mlp.up_proj.weight']])
    core[c + 'mlp.linear_fc2.weight'] = sd[p + 'mlp.down_proj.weight']
core['decoder.final_layernorm.weight'] = sd['model.norm.weight']
core['output_layer.weight'] = pad(sd['lm_head.weight'])
for r in range(tp):
    mod = {}
    for k, t in core.items():
        if 'layernorm' in k:
            mod[k] = t
        elif 'linear_proj' in k or 'linear_fc2' in k:
            mod[k] = t.chunk(tp, dim=1)[r].clone()
        elif 'linear_fc1' in k:
            gate, up = t.chunk(2)
            mod[k] = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        else:
            mod[k] = t.chunk(tp)[r].clone()
    out = dst / 'release' / f'mp_rank_{r:02d}' / 'model_optim_rng.pt'
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'args': argparse.Namespace(**cfg), 'checkpoint_version': 3.0, 'iteration': 0, 'model': mod}, out)
"""]


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return False
        return all(fa.get_tensor(k).equal(fb.get_tensor(k)) for k in fa.keys())


def same_rank_tensors(a: Path, b: Path) -> bool:
    """Both imports' rank files hold equal tensors under every name the naive script writes."""
    import torch

    files = sorted(p.relative_to(a) for p in a.rglob("model_optim_rng.pt"))
    if not files or files != sorted(p.relative_to(b) for p in b.rglob("model_optim_rng.pt")):
        return False
    for f in files:
        ma = torch.load(a / f, weights_only=False, mmap=True)["model"]
        mb = torch.load(b / f, weights_only=False, mmap=True)["model"]
        if not all(k in ma and ma[k].equal(v) for k, v in mb.items()):
            return False
    return True


def timed(methods: dict[str, list[str]], src: Path, work: Path, runs: int, label: str,
          pause: float = SETTLE, load: int = 0) -> dict[str, dict[str, float]]:
    """Median wall seconds and peak RSS of each command, methods interleaved, the source warm,
    ``pause`` seconds before each (:func:`bench_torch_dist.settle`), ``load`` busy processes beside
    each (``--busy``, :mod:`contention`)."""
    got: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    out = work / "run_out"
    for i in range(runs):
        for name, cmd in methods.items():
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            warm(src)
            settle(pause)
            log(f"{label} run {i + 1}/{runs}: {name}")
            with busy(load):  # the same load beside every method (none by default)
                got[name].append(measure([c.replace("{out}", str(out)) for c in cmd]))
            log(f"  {got[name][-1]['seconds']:.2f} s, {got[name][-1]['rss_mib']:.0f} MiB")  # each run, for the spread
    shutil.rmtree(out, ignore_errors=True)
    return {m: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                "peak_rss_mib": round(statistics.median(r["rss_mib"] for r in rs))} for m, rs in got.items()}


def agree(reshard_cmd: list[str], naive_cmd: list[str], work: Path, compare: str, script: str = __file__) -> bool:
    """Do reshard and the naive script write the same tensors? (The comparison runs in a child,
    ``script compare A B``: it maps both outputs, and children forked from a big parent report its
    peak RSS as theirs.)"""
    a, b = work / "check_reshard", work / "check_naive"
    subprocess.run([c.replace("{out}", str(a)) for c in reshard_cmd], check=True, capture_output=True)
    subprocess.run([c.replace("{out}", str(b)) for c in naive_cmd], check=True)
    same = subprocess.run([sys.executable, script, compare, str(a), str(b)]).returncode == 0
    shutil.rmtree(a)
    shutil.rmtree(b)
    return same


def report(title: str, rows: dict[str, dict[str, float]], floor_name: str, ratio: str = "x floor") -> None:
    """Each method's median seconds, its ratio to ``floor_name``'s (column ``ratio``) and peak RSS."""
    floor = rows[floor_name]["seconds"]
    w = max(8, len(ratio))
    print(f"{title}\n{'method':40} {'seconds':>8} {ratio:>{w}} {'peak RSS':>10}")
    for name, rec in rows.items():
        print(f"{name:40} {rec['seconds']:8.2f} {rec['seconds'] / floor:{w}.2f} {rec['peak_rss_mib']:7d} MiB")


EXPORT, IMPORT = "reshard --direct TP 8 -> hf", "reshard --direct hf -> TP 2"
EXPORT_FLOOR, IMPORT_FLOOR = "floor (per-rank TP 8 bytes)", "floor (hf folder bytes)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare"]:
        return 0 if same_tensors(Path(argv[1]), Path(argv[2])) else 1
    if argv[:1] == ["--compare-ranks"]:
        return 0 if same_rank_tensors(Path(argv[1]), Path(argv[2])) else 1
    ns, shape = parse_bench_args(argv, __doc__.splitlines()[0])
    work = ns.work_dir / "hf"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for layers in [ns.layers] + ([ns.deep_layers] if ns.deep_layers else []):
        src = source_for(ns, layers, shape)
        hf = ns.data_dir / f"hf_{src.name}"  # the import's source: reshard's own export, made once
        if not (hf / "config.json").is_file():
            subprocess.run([c.replace("{out}", str(hf)) for c in reshard(str(src), "{out}", "--to", "hf")],
                           check=True, capture_output=True)
        export = {EXPORT_FLOOR: FLOOR + [str(src), "{out}"], EXPORT: reshard(str(src), "{out}", "--to", "hf"),
                  "naive: load all, merge, save_file": NAIVE + [str(src), "{out}"]}
        imp = {IMPORT_FLOOR: FLOOR + [str(hf), "{out}"], IMPORT: reshard(str(hf), "{out}", "--target-tp", "2"),
               "naive: load_file all, fuse, split, save": NAIVE_IMPORT + [str(hf), "{out}"]}
        deep = layers != ns.layers
        if deep:  # memory scaling: reshard only
            export, imp = {EXPORT: export[EXPORT]}, {IMPORT: imp[IMPORT]}
        results[f"layers={layers}"] = {
            "source GB": round(size(src) / 1e9, 2), "hf GB": round(size(hf) / 1e9, 2),
            "export": timed(export, src, work, ns.runs, f"L{layers} export", ns.settle, ns.busy),
            "import": timed(imp, hf, work, ns.runs, f"L{layers} import", ns.settle, ns.busy)}
        if not deep:  # independent checks: the naive scripts write the same tensors
            results["export: same tensors as the naive script"] = agree(export[EXPORT], export[
                "naive: load all, merge, save_file"], work, "--compare")
            results["import: same tensors as the naive script"] = agree(imp[IMPORT], imp[
                "naive: load_file all, fuse, split, save"], work, "--compare-ranks")
    base = results[f"layers={ns.layers}"]
    print(load_note(ns.busy))
    report("export", base["export"], EXPORT_FLOOR)
    report("import", base["import"], IMPORT_FLOOR)
    if ns.deep_layers:
        deep_rec = results[f"layers={ns.deep_layers}"]
        for what, name in (("export", EXPORT), ("import", IMPORT)):
            print(f"peak RSS {name}: {base[what][name]['peak_rss_mib']} MiB at {ns.layers} layers, "
                  f"{deep_rec[what][name]['peak_rss_mib']} MiB at {ns.deep_layers} layers")
    for k in ("export: same tensors as the naive script", "import: same tensors as the naive script"):
        print(f"{k}: {results[k]}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
