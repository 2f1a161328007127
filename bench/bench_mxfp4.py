"""MXFP4 benchmark (issue 55) on GPT-OSS-120B's tensor sizes, in a ``GptOssForCausalLM`` folder: hidden
2880, 128 experts of intermediate 2880 with biases, 64 query heads and 8 key-value heads of head_dim
64 (with biases and sinks), the router with its bias; layers and vocabulary cut to fit the disk (one
layer, 16384 tokens: a whole ``gate_up_proj`` is still 4.2 GB in bf16, 1.1 GB in MXFP4):

* MXFP4 HF -> bf16 HF (``--to hf``);
* MXFP4 HF -> megatron-core per-rank TP 8 x EP 8 (expert TP 1, the default for biased experts);
* bf16 HF -> MXFP4 HF (``--to hf --quantize mxfp4``);

each against the byte-copy floor of the bytes it reads and writes (read the source once, write as
many bytes as the output holds) and, for the first and last, the naive script a user would write
(load every tensor, convert each stacked weight whole with transformers' own
``convert_moe_packed_tensors`` — or quantize it by the OCP rule written out, an expert at a time,
a float32 copy of a whole 4.2 GB tensor being 8.5 GB —, ``save_file``), which must give the same
tensors. ``--deep`` repeats reshard with twice the experts: peak RSS must stay flat.

The MXFP4 folder is the release's layout (``*_blocks``/``*_scales``, ``quantization_config``
``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``), made by reshard's own ``--to hf
--quantize mxfp4`` from a random bf16 folder this script writes tensor by tensor (an expert slab
at a time, never a whole tensor in memory); that random folder is the quantize runs' source. The
dequantize check compares the naive script's output with reshard's ``--to hf`` of the release,
made in the same run; quantizing that again must give the release's codes and scales back.

    python bench/bench_mxfp4.py             # full run (~16 GB of disk at the peak with --deep)
    python bench/bench_mxfp4.py --quick     # smoke test of the benchmark itself (tiny model)

Not part of the tests. Each command is its own process (wall time around it, peak RSS its
``ru_maxrss``); methods interleaved, medians of ``--runs`` (``--deep-runs`` for the deep model);
the source warm before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fp8 import FLOOR, child_mode, ranks_size  # noqa: E402
from bench_hf import agree, report, timed  # noqa: E402
from bench_torch_dist import SETTLE, log, reshard, size  # noqa: E402

#: The naive dequantizer: every tensor in memory, each ``*_blocks``/``*_scales`` pair converted whole
#: by transformers' own function (its output is ``[E, in, out]``, the bf16 release's layout), one save_file.
NAIVE_DEQUANT = [sys.executable, "-c", """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
src, dst = Path(sys.argv[1]), Path(sys.argv[2]); dst.mkdir(parents=True)
sd = {}
for f in sorted(src.glob('*.safetensors')):
    sd.update(load_file(f))
out = {}
for k in sorted(sd):
    if k.endswith('_scales'):
        continue
    if k.endswith('_blocks'):
        base = k[:-len('_blocks')]
        out[base] = convert_moe_packed_tensors(sd.pop(k), sd.pop(base + '_scales'), dtype=torch.bfloat16)
    else:
        out[k] = sd[k]
save_file(out, dst / 'model.safetensors', metadata={'format': 'pt'})
cfg = json.loads((src / 'config.json').read_text()); cfg.pop('quantization_config')
(dst / 'config.json').write_text(json.dumps(cfg))
"""]

#: The naive quantizer: every tensor in memory; each stacked expert weight ``X`` ``[E, in, out]``
#: quantized by the OCP Microscaling rule written out, over ``W = X[e]^T`` ``[out, in]``, one expert
#: at a time: scale ``2**(floor(log2(amax)) - 2)`` per 32 inputs (clamped to e8m0's 2**-127..2**127,
#: so an all-zero group gets the smallest), each value rounded to the nearest e2m1 magnitude with
#: ties to the even code (a tie goes up at 0.75, 1.75 and 3.5, down at 0.25, 1.25, 2.5 and 5),
#: saturated at 6, the sign bit 8; two codes a byte, the even column in the low nibble.
NAIVE_QUANT = [sys.executable, "-c", """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2]); dst.mkdir(parents=True)
sd = {}
for f in sorted(src.glob('*.safetensors')):
    sd.update(load_file(f))
TIES_DOWN, TIES_UP = (0.25, 1.25, 2.5, 5.0), (0.75, 1.75, 3.5)
def quantize(w):  # w [out, in] -> blocks [out, in/32, 16], scales [out, in/32]
    out, inp = w.shape
    g = w.float().reshape(out, inp // 32, 32)
    e = (torch.floor(torch.log2(g.abs().amax(-1))) - 2).clamp(-127, 127)
    x = g * torch.exp2(-e).unsqueeze(-1)
    a = x.abs()
    index = sum((a > t).to(torch.uint8) for t in TIES_DOWN) + sum((a >= t).to(torch.uint8) for t in TIES_UP)
    codes = index + 8 * torch.signbit(x).to(torch.uint8)
    pairs = codes.reshape(out, inp // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (e + 127).to(torch.uint8)
out = {}
for k, t in sd.items():
    if not k.endswith(('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')):
        out[k] = t; continue
    pairs = [quantize(t[e].t()) for e in range(t.shape[0])]
    out[k + '_blocks'] = torch.stack([p[0] for p in pairs]); out[k + '_scales'] = torch.stack([p[1] for p in pairs])
    del pairs
save_file(out, dst / 'model.safetensors', metadata={'format': 'pt'})
cfg = json.loads((src / 'config.json').read_text())
cfg['quantization_config'] = {'quant_method': 'mxfp4', 'modules_to_not_convert': [
    'lm_head', 'model.embed_tokens', 'model.layers.*.mlp.router', 'model.layers.*.self_attn']}
(dst / 'config.json').write_text(json.dumps(cfg))
"""]

#: GPT-OSS-120B's tensor sizes (the vocabulary cut), and a tiny model for ``--quick``.
GPT_OSS_120B_SHAPE = dict(hidden=2880, ffn=2880, heads=64, kv_heads=8, head_dim=64, vocab=16384)
QUICK_SHAPE = dict(hidden=128, ffn=64, heads=8, kv_heads=8, head_dim=16, vocab=1024)
#: The release's rotary (openai/gpt-oss-120b's config.json).
ROPE_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

#: safetensors' names of torch's dtypes this script writes.
_ST_DTYPES = {"torch.bfloat16": "BF16"}


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], Callable[[], Iterator[Any]]]]) -> int:
    """A safetensors file of bf16 tensors, each written from its ``chunks()`` (contiguous tensors in
    row-major order: a whole small tensor, or a stacked weight an expert at a time), so memory is
    one chunk. The format: an 8-byte little-endian header length, the JSON header (padded with
    spaces to 8 bytes), the tensors' bytes in header order. Returns the bytes of tensor data."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape, _ in entries:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, _, chunks in entries:
            written = 0
            for t in chunks():
                if str(t.dtype) not in _ST_DTYPES or not t.is_contiguous():
                    raise ValueError(f"{name}: a chunk is {t.dtype}, contiguous {t.is_contiguous()}")
                f.write(t.view(-1).view(dtype=torch.uint8).numpy())
                written += t.numel() * 2
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if written != want:
                raise ValueError(f"{name}: wrote {written} bytes, the header says {want}")
    return at


def make_source(folder: Path, layers: int, experts: int, shape: dict[str, int]) -> None:
    """A random bf16 ``GptOssForCausalLM`` folder in the bf16 release's layout: one file for the
    embeddings, per layer one for attention, norms and router, one for ``gate_up_proj`` and one for
    ``down_proj`` (each written an expert at a time), one for the head."""
    import torch

    h, f, heads, kv, hd, vocab = (shape[k] for k in ("hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab"))
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def rnd(*s: int, std: float = 0.02) -> Callable[[], Iterator[Any]]:
        return lambda: iter([(torch.randn(*s, generator=gen) * std).to(torch.bfloat16)])

    def ones(n: int) -> Callable[[], Iterator[Any]]:
        return lambda: iter([torch.ones(n, dtype=torch.bfloat16)])

    def stacked(*s: int) -> Callable[[], Iterator[Any]]:
        return lambda: ((torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(experts))

    files: list[list[tuple[str, tuple[int, ...], Callable[[], Iterator[Any]]]]] = [
        [("model.embed_tokens.weight", (vocab, h), rnd(vocab, h))]]
    for i in range(layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        dense = [(a + "q_proj.weight", heads * hd, h), (a + "q_proj.bias", heads * hd),
                 (a + "k_proj.weight", kv * hd, h), (a + "k_proj.bias", kv * hd),
                 (a + "v_proj.weight", kv * hd, h), (a + "v_proj.bias", kv * hd),
                 (a + "o_proj.weight", h, heads * hd), (a + "o_proj.bias", h),
                 (m + "router.weight", experts, h), (m + "router.bias", experts),
                 (m + "experts.gate_up_proj_bias", experts, 2 * f), (m + "experts.down_proj_bias", experts, h)]
        files.append([(p + "input_layernorm.weight", (h,), ones(h)),
                      (p + "post_attention_layernorm.weight", (h,), ones(h)),
                      (a + "sinks", (heads,), rnd(heads, std=1.0)),
                      *((name, tuple(s), rnd(*s)) for name, *s in dense)])
        files.append([(m + "experts.gate_up_proj", (experts, h, 2 * f), stacked(h, 2 * f))])
        files.append([(m + "experts.down_proj", (experts, f, h), stacked(f, h))])
    files.append([("model.norm.weight", (h,), ones(h)), ("lm_head.weight", (vocab, h), rnd(vocab, h))])
    weight_map, total = {}, 0
    for j, entries in enumerate(files):
        name = f"model-{j + 1:05d}-of-{len(files):05d}.safetensors"
        total += write_safetensors(folder / name, entries)
        weight_map |= {e[0]: name for e in entries}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
              "attention_dropout": 0.0, "head_dim": hd, "hidden_act": "silu", "hidden_size": h,
              "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": f,
              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
              "max_position_embeddings": 131072, "num_attention_heads": heads, "num_experts_per_tok": 4,
              "experts_per_token": 4, "num_hidden_layers": layers, "num_key_value_heads": kv,
              "num_local_experts": experts, "output_router_logits": False, "rms_norm_eps": 1e-5,
              "rope_scaling": ROPE_SCALING, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
              "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
              "vocab_size": vocab, "dtype": "bfloat16", "eos_token_id": 2, "pad_token_id": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _tensor_files(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            where |= {k: f for k in st.keys()}
    return where


def same_tensors(a: Path, b: Path) -> bool:
    """The same names, dtypes, shapes and bits, a stacked tensor compared an expert at a time (two
    whole 4.2 GB tensors would not fit beside each other here)."""
    import torch
    from safetensors import safe_open

    x, y = _tensor_files(a), _tensor_files(b)
    if sorted(x) != sorted(y):
        print("names differ:", sorted(set(x) ^ set(y))[:5])
        return False
    bad = []
    for k in sorted(x):
        with safe_open(str(x[k]), framework="pt") as fa, safe_open(str(y[k]), framework="pt") as fb:
            sa, sb = fa.get_slice(k), fb.get_slice(k)
            if sa.get_dtype() != sb.get_dtype() or sa.get_shape() != sb.get_shape():
                bad.append(k)
                continue
            parts = range(sa.get_shape()[0]) if len(sa.get_shape()) >= 3 else [None]
            for e in parts:
                ta, tb = (s[e:e + 1] if e is not None else s[:] for s in (sa, sb))
                if not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)):
                    bad.append(k)
                    break
    if bad:
        print("differ:", bad[:5])
    return not bad


def remove(*folders: Path) -> None:
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)


def run_reshard(src: Path, dst: Path, *args: str) -> None:
    remove(dst)
    subprocess.run([c.replace("{out}", str(dst)) for c in reshard(str(src), "{out}", *args)], check=True,
                   capture_output=True)


def folders(ns: argparse.Namespace, layers: int, experts: int) -> dict[str, Path]:
    tag = f"gptoss_{'quick' if ns.quick else '120b'}_l{layers}_e{experts}"
    return {k: ns.data_dir / f"{tag}_{k}" for k in ("random", "mxfp4", "bf16")}


def make_random(ns: argparse.Namespace, folder: Path, layers: int, experts: int, shape: dict[str, int]) -> None:
    if not (folder / "config.json").is_file():
        remove(folder)
        log(f"writing {folder.name}")
        # its own process: a child forked from a big parent would report the parent's peak RSS
        subprocess.run([sys.executable, __file__, "--make-source", str(folder), str(layers), str(experts),
                        json.dumps(shape)], check=True)


def release(ns: argparse.Namespace, layers: int, experts: int, shape: dict[str, int]) -> Path:
    """The MXFP4 release folder: reshard's ``--quantize mxfp4`` of the random bf16 folder (which is
    written first when absent, and kept), made once."""
    f = folders(ns, layers, experts)
    if not (f["mxfp4"] / "config.json").is_file():
        make_random(ns, f["random"], layers, experts, shape)
        log(f"quantizing {f['random'].name}")
        run_reshard(f["random"], f["mxfp4"], "--to", "hf", "--quantize", "mxfp4")
    return f["mxfp4"]


QUANT, DEQUANT, TO_RANKS = "reshard bf16 -> MXFP4 hf", "reshard MXFP4 -> bf16 hf", "reshard MXFP4 -> TP 8 x EP 8"
QUANT_FLOOR, DEQUANT_FLOOR = "floor (read bf16, write MXFP4 bytes)", "floor (read MXFP4, write bf16 bytes)"
RANKS_FLOOR = "floor (read MXFP4, write the rank files' bytes)"
NAIVE_Q, NAIVE_D = "naive: load all, OCP rule, save_file", "naive: transformers' dequant, save_file"
#: Each conversion's report: (group, title, reshard's method, its floor, its naive peer or None).
REPORTS = (("dequantize", "MXFP4 -> bf16", DEQUANT, DEQUANT_FLOOR, NAIVE_D),
           ("to-ranks", "MXFP4 -> TP 8 x EP 8", TO_RANKS, RANKS_FLOOR, None),
           ("quantize", "bf16 -> MXFP4", QUANT, QUANT_FLOOR, NAIVE_Q))
GROUPS = tuple(r[0] for r in REPORTS)
#: The checks that reshard's outputs are the naive scripts' tensors.
SAME_Q, SAME_D = "quantize: same tensors as the naive script", "dequantize: same tensors as the naive script"
#: The check that quantizing the dequantized release gives its codes and scales back.
ROUND_TRIP = "quantize: the release's codes and scales back"
#: Peak RSS reshard must stay within (issue 55).
RSS_LIMIT_MIB = 1024


def base_run(ns: argparse.Namespace, only: set[str], work: Path, shape: dict[str, int]) -> dict[str, Any]:
    """The timed runs and checks at ``--layers`` x ``--experts``: reshard, floors and naive peers.
    Quantizing reads the random bf16 folder (values off the MXFP4 grid: the rounding is exercised);
    then, that folder deleted (disk), the release is dequantized by reshard into the bf16 folder the
    naive dequantizer's output must equal, and which must quantize back to the release's codes."""
    f = folders(ns, ns.layers, ns.experts)
    rnd, bf16 = f["random"], f["bf16"]
    make_random(ns, rnd, ns.layers, ns.experts, shape)
    mx = release(ns, ns.layers, ns.experts, shape)
    key = f"layers={ns.layers} experts={ns.experts}"
    rec: dict[str, Any] = {"bf16 GB": round(size(rnd) / 1e9, 2), "mxfp4 GB": round(size(mx) / 1e9, 2)}
    if "quantize" in only:
        q = {QUANT_FLOOR: FLOOR + [str(rnd), "{out}", str(size(mx))],
             QUANT: reshard(str(rnd), "{out}", "--to", "hf", "--quantize", "mxfp4"),
             NAIVE_Q: NAIVE_QUANT + [str(rnd), "{out}"]}
        rec["quantize"] = timed(q, rnd, work, ns.runs, f"{key} quantize", ns.settle)
        log(f"{key} quantize: {json.dumps(rec['quantize'])}")
        rec[SAME_Q] = agree(q[QUANT], q[NAIVE_Q], work, "--compare", __file__)
        log(f"{SAME_Q}: {rec[SAME_Q]}")
    remove(rnd)
    log(f"dequantizing {mx.name} (the dequantize check's reference)")
    run_reshard(mx, bf16, "--to", "hf")
    if "quantize" in only:
        back = work / "check_back"
        run_reshard(bf16, back, "--to", "hf", "--quantize", "mxfp4")
        rec[ROUND_TRIP] = compare(mx, back)
        log(f"{ROUND_TRIP}: {rec[ROUND_TRIP]}")
        remove(back)
    if "dequantize" in only:
        d = {DEQUANT_FLOOR: FLOOR + [str(mx), "{out}", str(size(bf16))],
             DEQUANT: reshard(str(mx), "{out}", "--to", "hf"), NAIVE_D: NAIVE_DEQUANT + [str(mx), "{out}"]}
        rec["dequantize"] = timed(d, mx, work, ns.runs, f"{key} dequantize", ns.settle)
        log(f"{key} dequantize: {json.dumps(rec['dequantize'])}")
        naive = work / "check_naive"  # its output against reshard's --to hf of the same release
        remove(naive)
        subprocess.run([c.replace("{out}", str(naive)) for c in d[NAIVE_D]], check=True)
        rec[SAME_D] = compare(bf16, naive)
        log(f"{SAME_D}: {rec[SAME_D]}")
        remove(naive)
    remove(bf16)
    rec["ranks GB"] = 0.0
    if "to-ranks" in only:
        ranks_bytes = ranks_size(mx, work)
        rec["ranks GB"] = round(ranks_bytes / 1e9, 2)
        r = {RANKS_FLOOR: FLOOR + [str(mx), "{out}", str(ranks_bytes)],
             TO_RANKS: reshard(str(mx), "{out}", "--target-tp", "8", "--target-ep", "8")}
        rec["to-ranks"] = timed(r, mx, work, ns.runs, f"{key} to-ranks", ns.settle)
        log(f"{key} to-ranks: {json.dumps(rec['to-ranks'])}")
    return rec


def compare(a: Path, b: Path) -> bool:
    """:func:`same_tensors` in a child (it maps both outputs: children forked from a big parent
    report its peak RSS as theirs)."""
    return subprocess.run([sys.executable, __file__, "--compare", str(a), str(b)]).returncode == 0


def deep_run(ns: argparse.Namespace, only: set[str], work: Path, shape: dict[str, int]) -> dict[str, Any]:
    """reshard alone at twice the experts, for its peak RSS. The disk holds one model at a time: the
    base folders are removed, the random bf16 folder is the quantize source, then gives way to its
    MXFP4 form."""
    layers, experts = ns.layers, 2 * ns.experts
    f = folders(ns, layers, experts)
    remove(*folders(ns, ns.layers, ns.experts).values())
    rec: dict[str, Any] = {}
    key = f"layers={layers} experts={experts}"
    if not (f["mxfp4"] / "config.json").is_file() or "quantize" in only:
        make_random(ns, f["random"], layers, experts, shape)
        rec["bf16 GB"] = round(size(f["random"]) / 1e9, 2)
        if "quantize" in only:
            rec["quantize"] = timed({QUANT: reshard(str(f["random"]), "{out}", "--to", "hf", "--quantize", "mxfp4")},
                                    f["random"], work, ns.deep_runs, f"{key} quantize", ns.settle)
    mx = release(ns, layers, experts, shape)
    remove(f["random"])
    rec["mxfp4 GB"] = round(size(mx) / 1e9, 2)
    if "dequantize" in only:
        rec["dequantize"] = timed({DEQUANT: reshard(str(mx), "{out}", "--to", "hf")}, mx, work, ns.deep_runs,
                                  f"{key} dequantize", ns.settle)
    if "to-ranks" in only:
        rec["to-ranks"] = timed({TO_RANKS: reshard(str(mx), "{out}", "--target-tp", "8", "--target-ep", "8")}, mx,
                                work, ns.deep_runs, f"{key} to-ranks", ns.settle)
    log(f"{key}: {json.dumps(rec)}")
    if not ns.keep_deep:
        remove(*f.values())
    return rec


#: ``--s3``: the conversions run S3 -> S3 (``--direct``) from the release uploaded to a loopback SeaweedFS.
S3_CONVERSIONS = (("dequantize", "MXFP4 -> bf16 hf", ("--to", "hf")),
                  ("to-ranks", "MXFP4 -> TP 8 x EP 8", ("--target-tp", "8", "--target-ep", "8")))


def s3_run(ns: argparse.Namespace, only: set[str], shape: dict[str, int]) -> list[dict[str, Any]]:
    """The release read from S3 and the output written to S3, on the tests' SeaweedFS (``weed mini``
    on 127.0.0.1, :class:`bench_scale.Bench`): wall, peak RSS and the peak of everything reshard
    writes on local disk (its cache folder, sampled every 20 ms), one run each."""
    from bench_scale import Bench

    mx = release(ns, ns.layers, ns.experts, shape)
    remove(folders(ns, ns.layers, ns.experts)["random"])
    b = Bench(argparse.Namespace(work_dir=ns.work_dir / "mxfp4_s3"))
    rows = []
    try:
        url = b.upload(mx)
        for group, label, target in S3_CONVERSIONS:
            if group in only:
                r = b.convert(f"S3 -> S3 {label}", url, ["--direct"], target=target)
                rows.append({"conversion": label, **{k: round(r[k], 2) for k in ("wall", "rss_mib", "disk_mib")}})
                log(f"S3: {json.dumps(rows[-1])}")
        b.drop_bucket(url[5:].split("/")[0])
    finally:
        b.close()
    return rows


def summary(ns: argparse.Namespace, only: set[str], results: dict[str, Any]) -> None:
    base = results[f"layers={ns.layers} experts={ns.experts}"]
    deep = results.get(f"layers={ns.layers} experts={2 * ns.experts}")
    print(f"sizes: MXFP4 {base['mxfp4 GB']} GB, bf16 {base['bf16 GB']} GB, TP 8 x EP 8 rank files "
          f"{base['ranks GB']} GB")
    for group, title, name, floor, naive in REPORTS:
        if group not in only:
            continue
        rows = base[group]
        report(title, rows, floor)
        mine = rows[name]
        line = f"  reshard / floor {mine['seconds'] / rows[floor]['seconds']:.2f}x"
        if naive:
            line += (f", naive / reshard {rows[naive]['seconds'] / mine['seconds']:.2f}x time, "
                     f"{rows[naive]['peak_rss_mib'] / mine['peak_rss_mib']:.1f}x RSS; same tensors: "
                     f"{base[f'{group}: same tensors as the naive script']}")
        print(line)
        if deep and group in deep:
            big = deep[group][name]["peak_rss_mib"]
            print(f"  peak RSS {mine['peak_rss_mib']} MiB at {ns.experts} experts, {big} MiB at {2 * ns.experts} "
                  f"({big / mine['peak_rss_mib'] - 1:+.1%}); deep wall {deep[group][name]['seconds']:.2f} s")
        worst = max([mine["peak_rss_mib"]] + ([deep[group][name]["peak_rss_mib"]] if deep and group in deep else []))
        print(f"  reshard peak RSS within {RSS_LIMIT_MIB} MiB: {worst <= RSS_LIMIT_MIB}")
    if "quantize" in only:
        print(f"{ROUND_TRIP}: {base[ROUND_TRIP]}")
    for row in results.get("s3", []):
        print(f"S3 -> S3 {row['conversion']}: {row['wall']:.2f} s, peak RSS {row['rss_mib']:.0f} MiB, "
              f"peak local disk {row['disk_mib']:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    child = child_mode(argv, make_source, same_tensors)
    if child is not None:
        return child
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--deep", action="store_true", help="also reshard alone at twice the experts")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deep-runs", type=int, default=1)
    ap.add_argument("--s3", action="store_true", help="also MXFP4 -> bf16 and -> TP 8 x EP 8 S3 -> S3 (SeaweedFS)")
    ap.add_argument("--keep-deep", action="store_true", help="keep the deep model's MXFP4 folder")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--settle", type=float, default=SETTLE)
    ap.add_argument("--only", action="append", choices=GROUPS, default=None,
                    help="time only these conversions (repeatable; default: all three)")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    only = set(ns.only or GROUPS)
    shape = QUICK_SHAPE if ns.quick else GPT_OSS_120B_SHAPE
    if ns.quick:
        ns.runs, ns.deep_runs, ns.settle, ns.experts = 1, 1, 0.5, 8
    # reshard as installed (pip compiles its bytecode at install), as bench_fp8.py
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "reshard")], check=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    work = ns.work_dir / "mxfp4"
    remove(work)
    results: dict[str, Any] = {f"layers={ns.layers} experts={ns.experts}": base_run(ns, only, work, shape)}
    if ns.s3:
        results["s3"] = s3_run(ns, only, shape)
    if ns.deep:
        results[f"layers={ns.layers} experts={2 * ns.experts}"] = deep_run(ns, only, work, shape)
    summary(ns, only, results)
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
