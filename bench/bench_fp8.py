"""FP8 block-scaled benchmark on DeepSeek-V3's real tensor sizes, in a ``DeepseekV3ForCausalLM``
folder: hidden 7168, multi-latent attention of 128 heads (query latent 1536, key-value latent 512,
head dims 128 + 64 rope, value 128), routed experts of 2048 and one shared expert, layers, experts
and vocabulary cut to fit the disk (every layer MoE):

* bf16 HF -> FP8 HF (``--to hf --quantize fp8``, blocks 128 x 128);
* FP8 HF -> bf16 HF (``--to hf``: DeepSeek's ``fp8_cast_bf16``);
* FP8 HF -> megatron-core per-rank TP 8 x EP 8;

each against the byte-copy floor of the bytes it reads and writes (read the source once, write as
many bytes as the output holds) and, for the first two, the naive script a user would write (load
every tensor, encode or decode each weight whole, ``save_file``), which must give the same tensors.
``--deep`` repeats reshard with twice the layers and twice the experts: peak RSS must stay flat.

    python bench/bench_fp8.py             # full run
    python bench/bench_fp8.py --quick     # smoke test of the benchmark itself (tiny model)

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_hf import agree, report, timed  # noqa: E402
from bench_torch_dist import SETTLE, reshard, size  # noqa: E402

#: The floor: read every source byte once, write as many bytes as the output holds (``argv[3]``).
FLOOR = [sys.executable, "-c", """
import sys, torch  # the floor pays the same interpreter + torch start-up
from pathlib import Path
src, dst, left = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dst.mkdir(parents=True, exist_ok=True)
buf = bytearray(1 << 20); mv = memoryview(buf)
with open(dst / 'out.bin', 'wb', buffering=0) as fo:
    for f in sorted(p for p in src.rglob('*') if p.is_file()):
        with open(f, 'rb', buffering=0) as fi:
            while n := fi.readinto(buf):
                if left > 0:
                    v = mv[:min(n, left)]; left -= len(v)
                    while v:
                        v = v[fo.write(v):]
    while left > 0:
        v = mv[:min(len(buf), left)]; left -= len(v)
        while v:
            v = v[fo.write(v):]
"""]

#: The naive peers: every tensor in memory, each weight encoded (or decoded) whole, one save_file.
NAIVE_QUANT = [sys.executable, "-c", """
import json, re, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2]); dst.mkdir(parents=True)
sd = {}
for f in sorted(src.glob('*.safetensors')):
    sd.update(load_file(f))
linear = re.compile(r'\\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\\.weight$')
out = {}
for k, w in sd.items():
    if not linear.search(k):
        out[k] = w; continue
    m, n = w.shape
    r, c = -(-m // 128), -(-n // 128)  # partial edge blocks (kv_a_proj_with_mqa's 576 rows): zero padding
    x = torch.zeros(r * 128, c * 128)
    x[:m, :n] = w.float()
    x = x.reshape(r, 128, c, 128)
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    out[k] = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(r * 128, c * 128)[:m, :n].contiguous()
    out[k + '_scale_inv'] = s.reshape(r, c)
save_file(out, dst / 'model.safetensors', metadata={'format': 'pt'})
cfg = json.loads((src / 'config.json').read_text())
cfg['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                              'weight_block_size': [128, 128]}
(dst / 'config.json').write_text(json.dumps(cfg))
"""]
NAIVE_DEQUANT = [sys.executable, "-c", """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2]); dst.mkdir(parents=True)
sd = {}
for f in sorted(src.glob('*.safetensors')):
    sd.update(load_file(f))
out = {}
for k, w in sd.items():
    if k.endswith('_scale_inv'):
        continue
    if w.dtype == torch.float8_e4m3fn:
        s = sd[k + '_scale_inv']
        m, n = w.shape
        r, c = s.shape
        x = torch.zeros(r * 128, c * 128)
        x[:m, :n] = w.float()
        x = x.reshape(r, 128, c, 128) * s.reshape(r, 1, c, 1)
        w = x.reshape(r * 128, c * 128)[:m, :n].to(torch.bfloat16)
    out[k] = w
save_file(out, dst / 'model.safetensors', metadata={'format': 'pt'})
cfg = json.loads((src / 'config.json').read_text()); cfg.pop('quantization_config')
(dst / 'config.json').write_text(json.dumps(cfg))
"""]


#: llm-compressor's model-free FP8 block quantization (compressed-tensors output: ``weight_scale`` in the
#: model's dtype, so about 3% of the e4m3 values round otherwise); run by ``--llmcompressor-python``,
#: an interpreter with llmcompressor installed (it pins transformers <= 5.17: its own environment).
LLMCOMPRESSOR = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(model_stub=sys.argv[1], save_directory=sys.argv[2], scheme='FP8_BLOCK',
               ignore=['re:.*gate$', 'lm_head', 'model.embed_tokens'], max_workers=2, device='cpu')
"""


def make_source(folder: Path, layers: int, experts: int, shape: dict[str, int]) -> None:
    """A bf16 DeepseekV3 folder, one shard per layer (memory: one layer), random weights; the
    router's expert bias in float32, as DeepSeek publishes it."""
    import torch
    from safetensors.torch import save_file

    h, heads, ffn, vocab = (shape[k] for k in ("hidden", "heads", "moe_ffn", "vocab"))
    q_lora, kv_lora, nope, rope, v = (shape[k] for k in ("q_lora", "kv_lora", "nope", "rope", "v"))
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def w(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": w(vocab, h)}]
    for i in range(layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
              a + "q_a_proj.weight": w(q_lora, h), a + "q_a_layernorm.weight": ones(q_lora),
              a + "q_b_proj.weight": w(heads * (nope + rope), q_lora),
              a + "kv_a_proj_with_mqa.weight": w(kv_lora + rope, h), a + "kv_a_layernorm.weight": ones(kv_lora),
              a + "kv_b_proj.weight": w(heads * (nope + v), kv_lora), a + "o_proj.weight": w(h, heads * v),
              p + "mlp.gate.weight": w(experts, h), p + "mlp.gate.e_score_correction_bias": torch.zeros(experts)}
        for q in [f"{p}mlp.experts.{e}." for e in range(experts)] + [f"{p}mlp.shared_experts."]:
            sd |= {q + "gate_proj.weight": w(ffn, h), q + "up_proj.weight": w(ffn, h),
                   q + "down_proj.weight": w(h, ffn)}
        shards.append(sd)
    shards.append({"model.norm.weight": ones(h), "lm_head.weight": w(vocab, h)})
    weight_map, total = {}, 0
    for j, sd in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(folder / name), metadata={"format": "pt"})
        for k, t in sd.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": h,
              "intermediate_size": 18432, "moe_intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora,
              "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
              "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 4,
              "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 0,
              "scoring_func": "sigmoid", "topk_method": "noaux_tc", "vocab_size": vocab, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                      "mscale": 1.0, "mscale_all_dim": 1.0,
                                                      "original_max_position_embeddings": 4096},
              "max_position_embeddings": 163840, "hidden_act": "silu", "tie_word_embeddings": False,
              "dtype": "bfloat16", "num_nextn_predict_layers": 0}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def same_tensors(a: Path, b: Path) -> bool:
    """The same names and bytes (an FP8 tensor compared as its bits)."""
    import torch
    from safetensors import safe_open

    def load(folder: Path) -> dict[str, Any]:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out |= {k: st.get_tensor(k) for k in st.keys()}
        return out

    x, y = load(a), load(b)
    if sorted(x) != sorted(y):
        print("names differ:", sorted(set(x) ^ set(y))[:5])
        return False
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1).view(dtype=torch.uint8)

    bad = [k for k in x if x[k].dtype != y[k].dtype or not (bits(x[k]) == bits(y[k])).all()]
    print("differ:", bad[:5]) if bad else None
    return not bad


def sources(ns: argparse.Namespace, layers: int, experts: int, shape: dict[str, int]) -> tuple[Path, Path]:
    """The bf16 folder and its FP8 form (made by reshard, checked against the naive script), once."""
    tag = "quick" if ns.quick else "dsv3"
    bf16 = ns.data_dir / f"deepseek_{tag}_l{layers}_e{experts}_bf16"
    fp8 = ns.data_dir / f"deepseek_{tag}_l{layers}_e{experts}_fp8"
    if not (bf16 / "config.json").is_file():
        shutil.rmtree(bf16, ignore_errors=True)
        subprocess.run([sys.executable, __file__, "--make-source", str(bf16), str(layers), str(experts),
                        json.dumps(shape)], check=True)
    if not (fp8 / "config.json").is_file():
        shutil.rmtree(fp8, ignore_errors=True)
        subprocess.run([c.replace("{out}", str(fp8)) for c in reshard(str(bf16), "{out}", "--to", "hf",
                                                                      "--quantize", "fp8")],
                       check=True, capture_output=True)
    return bf16, fp8


#: DeepSeek-V3's tensor sizes (the vocabulary cut), and a tiny model for ``--quick``.
DSV3_SHAPE = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, moe_ffn=2048, vocab=16384)
QUICK_SHAPE = dict(hidden=256, heads=8, q_lora=192, kv_lora=64, nope=32, rope=16, v=32, moe_ffn=128, vocab=1024)


def ranks_size(fp8: Path, work: Path) -> int:
    """The bytes of the TP 8 x EP 8 per-rank output, from reshard's own run (what the floor must write)."""
    out = work / "ranks_size"
    subprocess.run([c.replace("{out}", str(out)) for c in reshard(str(fp8), "{out}", "--target-tp", "8",
                                                                 "--target-ep", "8")],
                   check=True, capture_output=True)
    n = size(out)
    shutil.rmtree(out)
    return n


def baseline(cmd: list[str], tree: Path) -> list[str]:
    """``cmd`` (a :func:`bench_torch_dist.reshard` command) importing reshard from ``tree``."""
    code = cmd[2]
    assert cmd[1] == "-c" and code.startswith("import sys;"), cmd
    return [cmd[0], "-c", f"import sys; sys.path.insert(0, {str(tree.resolve())!r});" + code[len("import sys;"):],
            *cmd[3:]]


QUANT, DEQUANT, TO_RANKS = "reshard bf16 -> FP8 hf", "reshard FP8 -> bf16 hf", "reshard FP8 -> TP 8 x EP 8"
#: Each conversion's report: (group, title, reshard's method, its floor, the naive script that must
#: give the same tensors, or None).
REPORTS = (("quantize", "bf16 -> FP8", QUANT, "floor (read bf16, write FP8 bytes)",
            "naive: load all, quantize, save_file"),
           ("dequantize", "FP8 -> bf16", DEQUANT, "floor (read FP8, write bf16 bytes)",
            "naive: load all, dequantize, save_file"),
           ("to-ranks", "FP8 -> TP 8 x EP 8", TO_RANKS, "floor (read FP8, write the rank files' bytes)", None))
#: The conversions timed, as ``--only`` names them.
GROUPS = tuple(r[0] for r in REPORTS)


def child_mode(argv: list[str], make_source: Callable[..., Any], compare: Callable[[Path, Path], bool]) -> int | None:
    """The two child commands a bench runs itself (each in its own process, so the parent stays
    small): ``--make-source FOLDER LAYERS EXPERTS JSON`` writes a source with the bench's
    ``make_source``; ``--compare A B`` exits 0 where ``compare`` finds their tensors the same.
    None for any other command line (the bench's own)."""
    if argv[:1] == ["--make-source"]:
        make_source(Path(argv[1]), int(argv[2]), int(argv[3]), json.loads(argv[4]))
        return 0
    if argv[:1] == ["--compare"]:
        return 0 if compare(Path(argv[1]), Path(argv[2])) else 1
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    child = child_mode(argv, make_source, same_tensors)
    if child is not None:
        return child
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--deep", action="store_true", help="also twice the layers, then twice the experts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--settle", type=float, default=SETTLE)
    ap.add_argument("--llmcompressor-python", default=None, metavar="PYTHON",
                    help="a Python with llmcompressor installed: its model_free_ptq FP8_BLOCK joins the peers")
    ap.add_argument("--baseline", type=Path, default=None, metavar="TREE",
                    help="a checkout of another reshard commit (git worktree add TREE REV): it runs beside, same run")
    ap.add_argument("--only", action="append", choices=GROUPS, default=None,
                    help="time only these conversions (repeatable; default: all three)")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    only = set(ns.only or GROUPS)
    shape = QUICK_SHAPE if ns.quick else DSV3_SHAPE
    # reshard as installed (pip compiles its bytecode at install): a PYTHONDONTWRITEBYTECODE
    # environment would make every run compile reshard's modules again, which the floor never pays
    for tree in [HERE.parent] + ([ns.baseline] if ns.baseline else []):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(tree) / "reshard")], check=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if ns.quick:
        ns.runs, ns.settle = 1, 0.5
    work = ns.work_dir / "fp8"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    sizes = [(ns.layers, ns.experts)] + ([(2 * ns.layers, ns.experts), (ns.layers, 2 * ns.experts)] if ns.deep else [])
    for layers, experts in sizes:
        bf16, fp8 = sources(ns, layers, experts, shape)
        ranks_bytes = ranks_size(fp8, work) if "to-ranks" in only else 0
        quant = {"floor (read bf16, write FP8 bytes)": FLOOR + [str(bf16), "{out}", str(size(fp8))],
                 QUANT: reshard(str(bf16), "{out}", "--to", "hf", "--quantize", "fp8"),
                 "naive: load all, quantize, save_file": NAIVE_QUANT + [str(bf16), "{out}"]}
        if ns.llmcompressor_python:
            quant["llm-compressor model_free_ptq (2 workers)"] = [ns.llmcompressor_python, "-c", LLMCOMPRESSOR,
                                                                   str(bf16), "{out}"]
        dequant = {"floor (read FP8, write bf16 bytes)": FLOOR + [str(fp8), "{out}", str(size(bf16))],
                   DEQUANT: reshard(str(fp8), "{out}", "--to", "hf"),
                   "naive: load all, dequantize, save_file": NAIVE_DEQUANT + [str(fp8), "{out}"]}
        ranks = {"floor (read FP8, write the rank files' bytes)": FLOOR + [str(fp8), "{out}", str(ranks_bytes)],
                 TO_RANKS: reshard(str(fp8), "{out}", "--target-tp", "8", "--target-ep", "8")}
        if ns.baseline:  # the same commands, importing reshard from the other tree
            for group, name in ((quant, QUANT), (dequant, DEQUANT), (ranks, TO_RANKS)):
                group[f"{name} (baseline)"] = baseline(group[name], ns.baseline)
        first = (layers, experts) == sizes[0]
        if not first:  # memory scaling: reshard only
            quant, dequant, ranks = {QUANT: quant[QUANT]}, {DEQUANT: dequant[DEQUANT]}, {TO_RANKS: ranks[TO_RANKS]}
        key = f"layers={layers} experts={experts}"
        results[key] = {"bf16 GB": round(size(bf16) / 1e9, 2), "fp8 GB": round(size(fp8) / 1e9, 2),
                        "ranks GB": round(ranks_bytes / 1e9, 2)}
        for group, methods, source in (("quantize", quant, bf16), ("dequantize", dequant, fp8),
                                       ("to-ranks", ranks, fp8)):
            if group in only:
                results[key][group] = timed(methods, source, work, ns.runs, f"{key} {group}", ns.settle)
        if first:
            methods_of = {"quantize": quant, "dequantize": dequant}
            for group, _, name, _, naive in REPORTS:
                if naive and group in only:
                    results[f"{group}: same tensors as the naive script"] = agree(
                        methods_of[group][name], methods_of[group][naive], work, "--compare", __file__)
    base = results[f"layers={ns.layers} experts={ns.experts}"]
    print(f"sizes: bf16 {base['bf16 GB']} GB, FP8 {base['fp8 GB']} GB, TP 8 x EP 8 rank files {base['ranks GB']} GB")
    for group, title, name, floor, naive in REPORTS:
        if group not in only:
            continue
        report(title, base[group], floor)
        for layers, experts in sizes[1:]:
            rec = results[f"layers={layers} experts={experts}"]
            print(f"peak RSS {name}: {base[group][name]['peak_rss_mib']} MiB at {ns.layers} layers x {ns.experts} "
                  f"experts, {rec[group][name]['peak_rss_mib']} MiB at {layers} x {experts}")
        if naive:
            print(f"{group}: same tensors as the naive script: {results[f'{group}: same tensors as the naive script']}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
