"""Quantized-release codecs benchmark (issue 58): reshard reading compressed-tensors' and ModelOpt's
formats to bf16 (``--to hf``) and writing compressed-tensors' (``--quantize``), on two layer shapes:

* a Kimi-K2-shaped layer (``DeepseekV3ForCausalLM``, Kimi-K2's sizes: hidden 7168, 64 multi-latent
  heads, query latent 1536, key-value latent 512, routed experts of 2048 and one shared expert),
  one layer, the experts cut to ``--experts`` (16) and the vocabulary to 4096 to fit the disk;
* a Llama-70B-shaped dense layer (``LlamaForCausalLM``: hidden 8192, intermediate 28672, 64 heads,
  8 key-value heads of 128), one layer, a vocabulary of 4096.

Reading (every linear weight but the head and the routers quantized, as reshard's writer does):
compressed-tensors ``pack-quantized`` INT4 group 32 symmetric (Kimi-K2-Thinking's) and asymmetric,
``float-quantized`` FP8 per channel, ``nvfp4-pack-quantized`` (weight-only, q/k/v and gate/up
sharing one global scale as llm-compressor writes it), and ModelOpt NVFP4. Writing: ``--quantize
w4a16``, ``fp8-channel`` and ``nvfp4`` (:data:`WRITES`); ``nvfp4`` on the Llama shape only
(:data:`NOT_WRITTEN`: it refuses DeepSeek-V3's fused ``q_a_proj`` / ``kv_a_proj_with_mqa``, so the
Kimi-shaped layer cannot carry it).

Each run against the byte-copy floor of the bytes it reads and writes (:data:`bench_fp8.FLOOR`)
and against the reference library's own path in the same run, loading the safetensors as a user's
script would (every tensor in memory): compressed-tensors' per-module compressor
(``calculate_qparams`` of each group's min and max, ``compress`` / ``decompress``, its model-free
path, the one its tests' ``compress_folder_ct`` takes), ModelOpt's ``NVFP4QTensor.dequantize`` for
its format; with ``--llmcompressor-python`` also llm-compressor's own W4A16 in its own environment.
The peer's output must be reshard's, tensor for tensor and bit for bit (checked, not only timed).

The release folders are made by the same compressed-tensors (and ModelOpt) code from a random bf16
folder this script writes a band of rows at a time (``--make-source``), the releases a tensor at a
time (``--peer compress ... --stream``): no whole model in memory. ``--deep`` repeats reshard alone
at twice the experts (Kimi) or layers (Llama): peak RSS must stay flat.

    python bench/bench_ct.py              # full run (8 GB of disk at the 16-expert stage; deleted at the end)
    python bench/bench_ct.py --quick      # smoke test of the benchmark itself (tiny shapes, < 1 min)

Not part of the tests. Each command is its own process (wall time around it; peak RSS and CPU
seconds from its ``wait4`` usage); methods interleaved, medians of ``--runs``; the source warm
before each run. Throughput per core is the bf16 bytes converted per CPU second of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fp8 import FLOOR, child_mode  # noqa: E402
from bench_mxfp4 import remove, same_tensors, write_safetensors  # noqa: E402
from bench_torch_dist import SETTLE, log, measure, reshard, settle, size, warm  # noqa: E402

#: The layer shapes (vocabulary cut), and tiny ones for ``--quick``.
KIMI_K2 = dict(family="kimi", hidden=7168, heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128,
               moe_ffn=2048, vocab=4096)
LLAMA_70B = dict(family="llama", hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, vocab=4096)
QUICK = {"kimi": dict(KIMI_K2, hidden=256, heads=4, q_lora=128, kv_lora=64, nope=32, rope=16, v=32, moe_ffn=128,
                      vocab=512),
         "llama": dict(LLAMA_70B, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=512)}
SHAPES = {"kimi": KIMI_K2, "llama": LLAMA_70B}

#: Each codec: the compressed-tensors weight scheme (``QuantizationArgs`` keywords, or a preset's
#: name) and format, or ModelOpt's layout. The names are the rows of the report.
CODECS: dict[str, dict[str, Any]] = {
    "w4a16": dict(fmt="pack-quantized",
                  args=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)),
    "w4a16-asym": dict(fmt="pack-quantized",
                       args=dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
    "fp8-channel": dict(fmt="float-quantized", args=dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
    "nvfp4": dict(fmt="nvfp4-pack-quantized", args="NVFP4A16"),
    "modelopt-nvfp4": dict(fmt="modelopt"),
}
#: The codecs read (``--to hf``).
READS = tuple(CODECS)
#: The codecs reshard writes (``--quantize NAME``), each against the peer's ``compress`` of the
#: same name (``"nvfp4"``'s: one global scale for q/k/v and for gate/up, as llm-compressor's).
WRITES = ("w4a16", "fp8-channel", "nvfp4")
#: shape family -> the written codecs it cannot carry (``--quantize nvfp4`` refuses DeepSeek-V3's
#: fused ``q_a_proj`` / ``kv_a_proj_with_mqa``, one tensor in vLLM, two in megatron-core).
NOT_WRITTEN = {"kimi": ("nvfp4",)}

#: The linear weights quantized: every ``*_proj`` (``kv_a_proj_with_mqa`` too), not the head or the
#: routers (``mlp.gate``), as reshard's ``--quantize`` chooses.
QUANTIZED = re.compile(r".*_proj(_with_mqa)?")
#: Modules that share one NVFP4 global scale (llm-compressor's fused q/k/v and gate/up; vLLM fuses them).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: Rows of a band the source writer makes at a time.
BAND_ROWS = 4096
#: Bytes of compressed tensors the streamed compressor holds before it writes a shard.
SHARD_BYTES = 1 << 30
#: Peak RSS reshard must stay within (issue 58).
RSS_LIMIT_MIB = 1024


# --- the random bf16 source, written a band at a time ----------------------------------------------

Entry = tuple[str, tuple[int, ...], Callable[[], Iterator[Any]]]


def make_source(folder: Path, layers: int, experts: int, shape: dict[str, Any]) -> None:
    """A random bf16 folder of ``shape``'s family: per layer one safetensors file, every tensor
    written in bands of :data:`BAND_ROWS` rows (the DeepSeek router's bias in float32 in a small
    file of its own, as DeepSeek publishes it), the embeddings and the head in one more."""
    import torch
    from safetensors.torch import save_file

    h, vocab = shape["hidden"], shape["vocab"]
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def rnd(rows: int, cols: int) -> Callable[[], Iterator[Any]]:
        return lambda: ((torch.randn(min(BAND_ROWS, rows - r), cols, generator=gen) * 0.02).to(torch.bfloat16)
                        for r in range(0, rows, BAND_ROWS))

    def ones(n: int) -> Callable[[], Iterator[Any]]:
        return lambda: iter([torch.ones(n, dtype=torch.bfloat16)])

    def lin(name: str, rows: int, cols: int) -> Entry:
        return name, (rows, cols), rnd(rows, cols)

    files: dict[str, list[Entry]] = {"embed_head.safetensors": [
        lin("model.embed_tokens.weight", vocab, h), ("model.norm.weight", (h,), ones(h)),
        lin("lm_head.weight", vocab, h)]}
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        entries = [(p + "input_layernorm.weight", (h,), ones(h)),
                   (p + "post_attention_layernorm.weight", (h,), ones(h))]
        if shape["family"] == "kimi":
            q_lora, kv_lora, nope, rope, v, heads = (shape[k] for k in
                                                     ("q_lora", "kv_lora", "nope", "rope", "v", "heads"))
            entries += [lin(a + "q_a_proj.weight", q_lora, h), (a + "q_a_layernorm.weight", (q_lora,), ones(q_lora)),
                        lin(a + "q_b_proj.weight", heads * (nope + rope), q_lora),
                        lin(a + "kv_a_proj_with_mqa.weight", kv_lora + rope, h),
                        (a + "kv_a_layernorm.weight", (kv_lora,), ones(kv_lora)),
                        lin(a + "kv_b_proj.weight", heads * (nope + v), kv_lora),
                        lin(a + "o_proj.weight", h, heads * v),
                        lin(p + "mlp.gate.weight", experts, h)]
            ffn = shape["moe_ffn"]
            for q in [f"{p}mlp.experts.{e}." for e in range(experts)] + [f"{p}mlp.shared_experts."]:
                entries += [lin(q + "gate_proj.weight", ffn, h), lin(q + "up_proj.weight", ffn, h),
                            lin(q + "down_proj.weight", h, ffn)]
            bias = f"router_{i:03d}.safetensors"
            save_file({p + "mlp.gate.e_score_correction_bias": torch.zeros(experts)}, str(folder / bias),
                      metadata={"format": "pt"})
            weight_map[p + "mlp.gate.e_score_correction_bias"] = bias
            total += experts * 4
        else:
            heads, kv, hd, ffn = (shape[k] for k in ("heads", "kv_heads", "head_dim", "ffn"))
            entries += [lin(a + "q_proj.weight", heads * hd, h), lin(a + "k_proj.weight", kv * hd, h),
                        lin(a + "v_proj.weight", kv * hd, h), lin(a + "o_proj.weight", h, heads * hd),
                        lin(p + "mlp.gate_proj.weight", ffn, h), lin(p + "mlp.up_proj.weight", ffn, h),
                        lin(p + "mlp.down_proj.weight", h, ffn)]
        files[f"layer_{i:03d}.safetensors"] = entries
    for name, entries in files.items():
        total += write_safetensors(folder / name, entries)
        weight_map |= {e[0]: name for e in entries}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config_of(layers, experts, shape), indent=2))


def config_of(layers: int, experts: int, shape: dict[str, Any]) -> dict[str, Any]:
    h, vocab = shape["hidden"], shape["vocab"]
    common = {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": shape["heads"], "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16"}
    if shape["family"] == "llama":  # meta-llama/Llama-3.1-70B's, the layers and vocabulary cut
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "intermediate_size": shape["ffn"], "num_key_value_heads": shape["kv_heads"],
                "head_dim": shape["head_dim"], "max_position_embeddings": 131072, "rope_theta": 500000.0,
                "attention_bias": False, "mlp_bias": False}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,  # Kimi-K2's
            "intermediate_size": 18432, "moe_intermediate_size": shape["moe_ffn"],
            "num_key_value_heads": shape["heads"],
            "q_lora_rank": shape["q_lora"], "kv_lora_rank": shape["kv_lora"], "qk_nope_head_dim": shape["nope"],
            "qk_rope_head_dim": shape["rope"], "v_head_dim": shape["v"], "n_routed_experts": experts,
            "n_shared_experts": 1, "num_experts_per_tok": min(8, experts), "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.827, "norm_topk_prob": True, "first_k_dense_replace": 0,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
            "max_position_embeddings": 131072, "num_nextn_predict_layers": 0}


# --- the reference libraries' own paths (the peers, and the release builder) -----------------------

def _scheme(codec: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    args = CODECS[codec]["args"]
    if isinstance(args, str):
        return preset_name_to_scheme(args, ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))


def _fused_amax(keys: list[str], get: Callable[[str], Any]) -> dict[str, tuple[Any, Any]]:
    """Each quantized weight's (min, max) for its NVFP4 global scale: over the weights it shares
    one with (:data:`FUSED`), else its own."""
    import torch

    own = {k: (get(k).amin(), get(k).amax()) for k in keys}  # in the weight's dtype, as its observers
    out = {}
    for k in keys:
        module = k.removesuffix(".weight")
        parent, leaf = module.rsplit(".", 1)
        mates = next((g for g in FUSED if leaf in g), (leaf,))
        peers = [f"{parent}.{m}.weight" for m in mates if f"{parent}.{m}.weight" in own]
        out[k] = (torch.stack([own[p][0] for p in peers]).amin(), torch.stack([own[p][1] for p in peers]).amax())
    return out


def compress_one(codec: str, w: Any, lo_hi: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """``w`` (``[out, in]``, bf16) as the reference library stores it: compressed-tensors' min-max
    ``calculate_qparams`` (a global scale by ``generate_gparam`` for NVFP4) and its compressor, in
    the weight's dtype as it computes; ModelOpt's ``NVFP4QTensor.quantize`` for its layout. Keys
    are the stored names less the module's (``weight_packed``, ``weight_scale``, ...)."""
    import torch

    if codec == "modelopt-nvfp4":
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        q, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
        return {"weight": q._quantized_data, "weight_scale": scale, "weight_scale_2": scale_2,
                "input_scale": torch.tensor(0.25)}
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = _scheme(codec)
    args = scheme.weights
    state: dict[str, Any] = {"weight": w}
    gscale = None
    if args.strategy == "tensor_group":
        lo, hi = lo_hi if lo_hi is not None else (w.amin(), w.amax())
        gscale = state["weight_global_scale"] = generate_gparam(lo, hi)
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=gscale)
    state["weight_scale"] = scale.to(w.dtype)  # the module's scale parameter is in the weight's dtype
    if not args.symmetric:
        state["weight_zero_point"] = zero.to(args.zp_dtype or zero.dtype)
    return BaseCompressor.get_value_from_registry(CODECS[codec]["fmt"]).compress(state, scheme)


def release_config(codec: str, src_config: dict[str, Any], ignore: list[str]) -> tuple[dict[str, Any], dict | None]:
    """The release's ``config.json`` (and ModelOpt's ``hf_quant_config.json``)."""
    if codec == "modelopt-nvfp4":
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

        hf_quant = {"producer": {"name": "modelopt", "version": "0.47.0"},
                    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                     "exclude_modules": ignore}}
        return {**src_config, "quantization_config": convert_hf_quant_config_format(hf_quant)}, hf_quant
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    q = QuantizationConfig(config_groups={"group_0": _scheme(codec)}, ignore=ignore, format=CODECS[codec]["fmt"],
                           quantization_status=QuantizationStatus.COMPRESSED)
    return {**src_config, "quantization_config": {"quant_method": "compressed-tensors", **q.model_dump()}}, None


def peer_compress(src: Path, dst: Path, codec: str, stream: bool) -> None:
    """The reference library compressing ``src``: every quantized weight by :func:`compress_one`,
    the rest as stored. ``stream``: a tensor at a time, shards of :data:`SHARD_BYTES` (the release
    builder); else as a user's script does it: ``load_file`` of every file, one ``save_file``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    if stream:
        handles = {f: safe_open(str(src / f), framework="pt") for f in sorted(set(index.values()))}

        def get(k: str) -> Any:
            return handles[index[k]].get_tensor(k)
    else:
        sd: dict[str, Any] = {}
        for f in sorted(src.glob("*.safetensors")):
            sd.update(load_file(f))
        get = sd.__getitem__
    keys = sorted(index)
    quantized = [k for k in keys if k.endswith(".weight") and QUANTIZED.fullmatch(k.removesuffix(".weight"))
                 and not k.startswith("lm_head")]
    nvfp4 = codec != "modelopt-nvfp4" and CODECS[codec]["args"] == "NVFP4A16"
    amax = _fused_amax(quantized, get) if nvfp4 else {}
    dst.mkdir(parents=True)
    out: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    held = 0

    def flush() -> None:
        nonlocal out, held
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
        out, held = {}, 0

    qset = set(quantized)
    for k in keys:
        w = get(k)
        if k in qset:
            module = k.removesuffix(".weight")
            got = {f"{module}.{n}": t for n, t in compress_one(codec, w, amax.get(k)).items()}
        else:
            got = {k: w}
        out |= got
        held += sum(t.numel() * t.element_size() for t in got.values())
        if stream and held >= SHARD_BYTES:
            flush()
    flush()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    ignore = ["lm_head"] + sorted(k.removesuffix(".weight") for k in keys if k.endswith("mlp.gate.weight"))
    config, hf_quant = release_config(codec, config, ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if hf_quant:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))


def peer_decompress(src: Path, dst: Path) -> None:
    """The reference library's dequantization of a release, as a user's script does it: every
    tensor in memory; each quantized module by compressed-tensors' ``decompress`` (the scheme read
    from ``config.json`` by compressed-tensors' own ``QuantizationConfig``) or ModelOpt's
    ``NVFP4QTensor.dequantize``, in bf16; one ``save_file``."""
    import torch
    from safetensors.torch import load_file, save_file

    sd: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(f))
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    out: dict[str, Any] = {}
    if qc.get("quant_method") == "modelopt":
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        for k, t in sd.items():
            module = k.removesuffix(".weight")
            if k.endswith(".weight") and module + ".weight_scale_2" in sd:
                q = NVFP4QTensor(torch.Size([t.shape[0], t.shape[1] * 2]), torch.bfloat16, t)
                out[k] = q.dequantize(dtype=torch.bfloat16, scale=sd[module + ".weight_scale"],
                                      double_scale=sd[module + ".weight_scale_2"], block_sizes={-1: 16})
            elif not k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
                out[k] = t
    else:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        q = QuantizationConfig.model_validate(qc)
        (scheme,) = q.config_groups.values()
        compressor = BaseCompressor.get_value_from_registry(q.format)
        params = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale")
        modules = {k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight_scale")}
        for module in sorted(modules):
            local = {p: sd.pop(f"{module}.{p}") for p in params + ("weight",) if f"{module}.{p}" in sd}
            out[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].to(torch.bfloat16)
        out |= sd
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))


# --- llm-compressor, in its own environment ------------------------------------------------------

#: llm-compressor's model-free path (``model_free_ptq``: safetensors in, a tensor at a time, min-max
#: scales, compressed-tensors' compressors), the scheme of ``argv[3]`` (JSON ``QuantizationArgs``, or
#: a preset's name), the same modules left out as reshard; run by ``--llmcompressor-python``, an
#: interpreter with llmcompressor installed (it pins an older compressed-tensors: its own environment).
LLMCOMPRESSOR = """
import json, sys
from llmcompressor import model_free_ptq
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
args = json.loads(sys.argv[3])
scheme = args if isinstance(args, str) else QuantizationScheme(targets=['Linear'], weights=QuantizationArgs(**args))
model_free_ptq(model_stub=sys.argv[1], save_directory=sys.argv[2], scheme=scheme,
               ignore=['lm_head', 'model.embed_tokens', 're:.*mlp.gate$'], max_workers=2, device='cpu')
"""


# --- timing ---------------------------------------------------------------------------------------

def timed(methods: dict[str, list[str]], src: Path, work: Path, runs: int, label: str,
          pause: float, keep: tuple[str, ...] = (), peer_runs: int | None = None) -> dict[str, dict[str, float]]:
    """:func:`bench_hf.timed` with each run's CPU seconds too: medians of ``runs``, methods interleaved,
    the source warm, ``pause`` seconds before each; the peers (any method but the floor and reshard)
    in the first ``peer_runs`` rounds only (they are the slower half of a round). The output of
    each method in ``keep`` is left in ``work/kept_<method>`` from its last run (for :func:`agree`)."""
    got: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    out = work / "run_out"
    last = {m: runs - 1 if m in (FLOOR_M, RESHARD) or peer_runs is None else min(runs, peer_runs) - 1
            for m in methods}
    for i in range(runs):
        for name, cmd in methods.items():
            if i > last[name]:
                continue
            remove(out)
            os.sync()
            warm(src)
            settle(pause)
            log(f"{label} run {i + 1}/{runs}: {name}")
            got[name].append(measure([c.replace("{out}", str(out)) for c in cmd]))
            if i == last[name] and name in keep:
                remove(work / f"kept_{name}")
                out.rename(work / f"kept_{name}")
    remove(out)
    return {m: {"seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                "peak_rss_mib": round(statistics.median(r["rss_mib"] for r in rs)),
                "cpu_seconds": round(statistics.median(r["cpu"] for r in rs), 2),
                "spread": round((max(r["seconds"] for r in rs) - min(r["seconds"] for r in rs))
                                / statistics.median(r["seconds"] for r in rs), 2)} for m, rs in got.items()}


def agree(work: Path, a: str, b: str) -> bool:
    """Did methods ``a`` and ``b`` write the same tensors (names, dtypes, shapes, bits) in their last
    timed run (:func:`timed`'s ``keep``)? Compared in a child (:func:`bench_mxfp4.same_tensors`)."""
    return subprocess.run([sys.executable, __file__, "--compare", str(work / f"kept_{a}"),
                           str(work / f"kept_{b}")]).returncode == 0


FLOOR_M, RESHARD, PEER, LLMC = "floor", "reshard", "library", "llm-compressor"


def peer(*args: str) -> list[str]:
    return [sys.executable, __file__, "--peer", *args]


def folders(ns: argparse.Namespace, shape: dict[str, Any], layers: int, experts: int) -> dict[str, Path]:
    tag = f"ct_{'quick_' if ns.quick else ''}{shape['family']}_l{layers}_e{experts}"
    return {k: ns.data_dir / f"{tag}_{k}" for k in ("bf16",) + READS}


def build(ns: argparse.Namespace, shape: dict[str, Any], layers: int, experts: int,
          codecs: set[str]) -> dict[str, Path]:
    """The bf16 source and the releases read or written made from it (each in its own process), when absent."""
    f = folders(ns, shape, layers, experts)
    if not (f["bf16"] / "config.json").is_file():
        remove(f["bf16"])
        log(f"writing {f['bf16'].name}")
        subprocess.run([sys.executable, __file__, "--make-source", str(f["bf16"]), str(layers), str(experts),
                        json.dumps(shape)], check=True)
    for codec in sorted(codecs):
        if not (f[codec] / "config.json").is_file():
            remove(f[codec])
            log(f"compressing {f[codec].name}")
            subprocess.run(peer("compress", str(f["bf16"]), str(f[codec]), codec, "--stream"), check=True)
    return f


def shape_run(ns: argparse.Namespace, shape: dict[str, Any], work: Path) -> dict[str, Any]:
    """The timed runs and the agreement checks of one shape, then ``--deep``'s reshard-only runs."""
    layers, experts = ns.layers, ns.experts
    f = build(ns, shape, layers, experts, set(ns.reads) | set(ns.writes))
    bf16_bytes = size(f["bf16"])
    rec: dict[str, Any] = {"bf16 GB": round(bf16_bytes / 1e9, 3),
                           **{f"{c} GB": round(size(f[c]) / 1e9, 3) for c in sorted(set(ns.reads) | set(ns.writes))}}
    key = shape["family"]
    for codec in ns.reads:
        rel = f[codec]
        m = {FLOOR_M: FLOOR + [str(rel), "{out}", str(bf16_bytes)], RESHARD: reshard(str(rel), "{out}", "--to", "hf"),
             PEER: peer("decompress", str(rel), "{out}")}
        rec[f"read {codec}"] = timed(m, rel, work, ns.runs, f"{key} read {codec}", ns.settle, (RESHARD, PEER),
                                     ns.peer_runs)
        rec[f"read {codec} same"] = agree(work, RESHARD, PEER)
        log(f"{key} read {codec}: {json.dumps(rec[f'read {codec}'])} same: {rec[f'read {codec} same']}")
    for codec in (c for c in ns.writes if c not in NOT_WRITTEN.get(key, ())):
        m = {FLOOR_M: FLOOR + [str(f["bf16"]), "{out}", str(size(f[codec]))],
             RESHARD: reshard(str(f["bf16"]), "{out}", "--to", "hf", "--quantize", codec),
             PEER: peer("compress", str(f["bf16"]), "{out}", codec)}
        if ns.llmcompressor_python:
            m[LLMC] = [ns.llmcompressor_python, "-c", LLMCOMPRESSOR, str(f["bf16"]), "{out}",
                       json.dumps(CODECS[codec]["args"])]
        rec[f"write {codec}"] = timed(m, f["bf16"], work, ns.runs, f"{key} write {codec}", ns.settle,
                                      (RESHARD, PEER, LLMC), ns.peer_runs)
        rec[f"write {codec} same"] = agree(work, RESHARD, PEER)
        if LLMC in m:
            rec[f"write {codec} same {LLMC}"] = agree(work, RESHARD, LLMC)
        log(f"{key} write {codec}: {json.dumps(rec[f'write {codec}'])} same: {rec[f'write {codec} same']}")
    if ns.deep:
        deep_layers, deep_experts = (layers, 2 * experts) if key == "kimi" else (2 * layers, experts)
        remove(*(p for c, p in f.items() if c != "bf16"))  # the disk holds the deep folders instead
        remove(f["bf16"])
        d = build(ns, shape, deep_layers, deep_experts, (set(ns.reads) | set(ns.writes)) & set(ns.deep_codecs))
        deep: dict[str, Any] = {"layers": deep_layers, "experts": deep_experts,
                                "bf16 GB": round(size(d["bf16"]) / 1e9, 3)}
        for codec in (c for c in ns.reads if c in ns.deep_codecs):
            deep[f"read {codec}"] = timed({RESHARD: reshard(str(d[codec]), "{out}", "--to", "hf")}, d[codec], work,
                                          ns.deep_runs, f"{key} deep read {codec}", ns.settle)
        for codec in (c for c in ns.writes if c in ns.deep_codecs and c not in NOT_WRITTEN.get(key, ())):
            cmd = reshard(str(d["bf16"]), "{out}", "--to", "hf", "--quantize", codec)
            deep[f"write {codec}"] = timed({RESHARD: cmd}, d["bf16"], work, ns.deep_runs, f"{key} deep write {codec}",
                                           ns.settle)
        rec["deep"] = deep
        log(f"{key} deep: {json.dumps(deep)}")
        f = d
    if not ns.keep:
        remove(*f.values(), *work.glob("kept_*"))
    return rec


def summary(ns: argparse.Namespace, results: dict[str, Any]) -> None:
    """One table per shape: reshard's median wall, the floor's and the peer's, their ratios, peak
    RSS (and at the deep size), the CPU cores reshard kept busy, its throughput per core (bf16 GB
    per CPU second) and the peer's, and whether the peer's tensors are reshard's."""
    for family, rec in results.items():
        if family == "machine":
            continue
        deep = rec.get("deep")
        gb = rec["bf16 GB"]
        print(f"\n{family}: bf16 {gb} GB; " + ", ".join(f"{c.removesuffix(' GB')} {v} GB" for c, v in rec.items()
                                                   if c.endswith(" GB") and c != "bf16 GB")
              + (f"; deep: layers {deep['layers']}, experts {deep['experts']}, bf16 {deep['bf16 GB']} GB"
                 if deep else ""))
        cols = (f"{'conversion':22} {'reshard s':>9} {'floor s':>7} {'x floor':>7} {'peer s':>7} {'peer/rs':>7} "
                f"{'RSS MiB':>7} {'deep RSS':>8} {'peer RSS':>8} {'cores':>5} {'GB/s/core':>9} {'peer GB/s/c':>11} "
                f"{'spread':>6} same")
        print(cols)
        for what in [f"read {c}" for c in ns.reads] + [f"write {c}" for c in ns.writes if f"write {c}" in rec]:
            rows = rec[what]
            r, fl, p = rows[RESHARD], rows[FLOOR_M], rows[PEER]
            deep_rss = f"{deep[what][RESHARD]['peak_rss_mib']:8d}" if deep and what in deep else f"{'-':>8}"
            print(f"{what:22} {r['seconds']:9.2f} {fl['seconds']:7.2f} {r['seconds'] / fl['seconds']:7.2f} "
                  f"{p['seconds']:7.2f} {p['seconds'] / r['seconds']:7.2f} {r['peak_rss_mib']:7d} {deep_rss} "
                  f"{p['peak_rss_mib']:8d} {r['cpu_seconds'] / r['seconds']:5.2f} {gb / r['cpu_seconds']:9.3f} "
                  f"{gb / p['cpu_seconds']:11.3f} {max(x['spread'] for x in rows.values()):6.2f} {rec[f'{what} same']}")
            if LLMC in rows:
                lc = rows[LLMC]
                print(f"{'  llm-compressor':22} {lc['seconds']:9.2f} {'':7} {lc['seconds'] / fl['seconds']:7.2f} "
                      f"{'':7} {lc['seconds'] / r['seconds']:7.2f} {lc['peak_rss_mib']:7d} {'':8} {'':8} "
                      f"{lc['cpu_seconds'] / lc['seconds']:5.2f} {gb / lc['cpu_seconds']:9.3f} {'':11} {'':6} "
                      f"{rec.get(f'{what} same {LLMC}')}")
        worst = max([rec[w][RESHARD]["peak_rss_mib"] for w in rec if w.startswith(("read ", "write ")) and
                     not w.endswith(("same", LLMC))]
                    + ([deep[w][RESHARD]["peak_rss_mib"] for w in deep if w.startswith(("read ", "write "))]
                       if deep else []))
        print(f"reshard's peak RSS at most {worst} MiB: within {RSS_LIMIT_MIB} MiB: {worst <= RSS_LIMIT_MIB}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    child = child_mode(argv, make_source, same_tensors)
    if child is not None:
        return child
    if argv[:2] == ["--peer", "compress"]:
        peer_compress(Path(argv[2]), Path(argv[3]), argv[4], stream="--stream" in argv[5:])
        return 0
    if argv[:2] == ["--peer", "decompress"]:
        peer_decompress(Path(argv[2]), Path(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=tuple(SHAPES), default=None, help="default: both")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16, help="routed experts of the Kimi-K2-shaped layer")
    ap.add_argument("--read", dest="reads", action="append", choices=READS, default=None, help="default: all")
    ap.add_argument("--write", dest="writes", action="append", choices=WRITES, default=None, help="default: all")
    ap.add_argument("--deep", action="store_true", help="also reshard alone at twice the experts (Kimi) or layers")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deep-runs", type=int, default=1)
    ap.add_argument("--deep-codec", dest="deep_codecs", action="append", choices=READS, default=None,
                    help="the codecs --deep runs (default: all read or written)")
    ap.add_argument("--peer-runs", type=int, default=None, help="time the peers in this many rounds (default: all)")
    ap.add_argument("--settle", type=float, default=SETTLE)
    ap.add_argument("--llmcompressor-python", default=None,
                    help="an interpreter with llmcompressor installed: its W4A16 oneshot as a peer")
    ap.add_argument("--keep", action="store_true", help="keep the data folders")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data-dir", type=Path, default=HERE / "data")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ns = ap.parse_args(argv)
    if ns.quick:  # the smallest smoke test: one shape, INT4 read and written (the options widen it)
        ns.shape, ns.reads, ns.writes = ns.shape or ["kimi"], ns.reads or ["w4a16"], ns.writes or ["w4a16"]
        ns.runs, ns.deep_runs, ns.settle, ns.experts = 1, 1, 0.0, 4
    shapes = [QUICK[s] if ns.quick else SHAPES[s] for s in (ns.shape or SHAPES)]
    ns.reads, ns.writes = tuple(ns.reads or READS), tuple(ns.writes or WRITES)
    ns.deep_codecs = tuple(ns.deep_codecs or READS)
    # reshard as installed (pip compiles its bytecode at install), as bench_fp8.py
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "reshard")], check=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    work = ns.work_dir / "ct"
    remove(work)
    work.mkdir(parents=True)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()}}
    for shape in shapes:
        results[shape["family"]] = shape_run(ns, shape, work)
    results["machine"]["load_at_end"] = os.getloadavg()
    summary(ns, results)
    print(f"\nload average (1, 5, 15 min) at start {results['machine']['load_at_start']}, "
          f"at end {results['machine']['load_at_end']}, {results['machine']['cpus']} CPUs")
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
