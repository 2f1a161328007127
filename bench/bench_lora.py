"""LoRA merge benchmark (issue 59): ``--merge-adapter`` against the plain conversion of the same
base, on the ~3 GB fp16 Llama-shaped Hugging Face folder of ``bench_hf.py`` (12 layers, hidden 3072,
ffn 8192; reshard's export of ``bench_torch_dist.py``'s source, made once under ``--data-dir``):

* floor: a byte copy of the base folder;
* plain: ``reshard run BASE OUT --to hf`` and ``--target-tp 2``;
* merged: the same with ``--merge-adapter LORA`` (rank 16 on q/k/v/o/gate/up/down, float32, made by
  this script as a Hugging Face PEFT adapter and converted with ``--to megatron-peft``);
* the peer: PEFT's ``merge_and_unload`` as a user runs it (transformers loads the whole base, PEFT
  wraps and merges it in the model's fp16, ``save_pretrained``).

The issue's target: merged within 1.3x of plain, in time and in peak RSS. ``--deep-layers`` repeats
reshard's runs on a base of twice the layers: peak RSS must stay flat. The adapter's A is shared by
q/k/v and by gate/up (a fused Megatron adapter has one A per fused layer); B is random, so every
adapted weight changes.

    python bench/bench_lora.py               # full run
    python bench/bench_lora.py --quick       # smoke test of the benchmark itself (tiny model)

Not part of the tests (tests/test_lora.py proves the merge bit-equal to PEFT's float32 merge). Each
command is its own process (wall time around it, peak RSS its ``ru_maxrss``); methods interleaved,
medians of ``--runs``; the source warm before each run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_hf import report, timed  # noqa: E402
from bench_torch_dist import FLOOR, log, parse_bench_args, reshard, size, source_for  # noqa: E402
from contention import load_note  # noqa: E402

#: The adapter's rank.
RANK = 16
#: PEFT's merge as a user writes it: the whole base in memory, merged in its own dtype.
PEFT_MERGE = [sys.executable, "-c", """
import sys, torch, transformers, peft
base = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16)
model = peft.PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload()
model.save_pretrained(sys.argv[3])
"""]


def make_adapter(base: Path, folder: Path) -> None:
    """A Hugging Face PEFT LoRA adapter for the Llama folder ``base``: float32, rank :data:`RANK`,
    one A per fused Megatron layer (q/k/v, gate/up), random B; ``base_model_name_or_path`` = ``base``."""
    import torch
    from safetensors.torch import save_file

    if (folder / "adapter_config.json").is_file():
        return
    config = json.loads((base / "config.json").read_text())
    hidden, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"base_model.model.model.layers.{i}."
        a_qkv, a_gu = rnd(RANK, hidden), rnd(RANK, hidden)
        for mod, a, out in (("self_attn.q_proj", a_qkv, q_out), ("self_attn.k_proj", a_qkv, kv_out),
                            ("self_attn.v_proj", a_qkv, kv_out), ("self_attn.o_proj", rnd(RANK, q_out), hidden),
                            ("mlp.gate_proj", a_gu, ffn), ("mlp.up_proj", a_gu, ffn),
                            ("mlp.down_proj", rnd(RANK, ffn), hidden)):
            tensors[p + mod + ".lora_A.weight"] = a.clone()
            tensors[p + mod + ".lora_B.weight"] = rnd(out, RANK)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": RANK,
        "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))


def inputs(ns: Any, layers: int, shape: dict[str, int]) -> tuple[Path, Path, Path]:
    """The Hugging Face base of ``layers`` layers, its PEFT adapter and that adapter as a Megatron
    PEFT checkpoint, each made once under ``--data-dir``."""
    src = source_for(ns, layers, shape)
    hf = ns.data_dir / f"hf_{src.name}"
    if not (hf / "config.json").is_file():
        subprocess.run([c.replace("{out}", str(hf)) for c in reshard(str(src), "{out}", "--to", "hf")],
                       check=True, capture_output=True)
    adapter = ns.data_dir / f"lora_r{RANK}_{hf.name}"
    subprocess.run([sys.executable, str(HERE / "bench_lora.py"), "--make-adapter", str(hf), str(adapter)], check=True)
    lora = ns.data_dir / f"megatron_{adapter.name}"
    if not (lora / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(lora, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "reshard.cli", "run", str(adapter), str(lora), "--to",
                        "megatron-peft"], check=True, capture_output=True)
    return hf, adapter, lora


PLAIN_HF, MERGED_HF = "reshard hf -> hf", "reshard hf -> hf, --merge-adapter"
PLAIN_TP2, MERGED_TP2 = "reshard hf -> TP 2", "reshard hf -> TP 2, --merge-adapter"
PEER = "PEFT merge_and_unload, save_pretrained"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make-adapter"]:
        make_adapter(Path(argv[1]), Path(argv[2]))
        return 0
    ns, shape = parse_bench_args(argv, __doc__.splitlines()[0])
    work = ns.work_dir / "lora"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for layers in [ns.layers] + ([ns.deep_layers] if ns.deep_layers else []):
        hf, adapter, lora = inputs(ns, layers, shape)
        methods = {"floor (hf folder bytes)": FLOOR + [str(hf), "{out}"],
                   PLAIN_HF: reshard(str(hf), "{out}", "--to", "hf"),
                   MERGED_HF: reshard(str(hf), "{out}", "--to", "hf", "--merge-adapter", str(lora)),
                   PLAIN_TP2: reshard(str(hf), "{out}", "--target-tp", "2"),
                   MERGED_TP2: reshard(str(hf), "{out}", "--target-tp", "2", "--merge-adapter", str(lora)),
                   PEER: PEFT_MERGE + [str(hf), str(adapter), "{out}"]}
        if layers != ns.layers:  # the deep base: memory scaling of reshard only
            methods = {k: v for k, v in methods.items() if k.startswith("reshard")}
        log(f"L{layers}: base {size(hf) / 1e9:.2f} GB, adapter {size(adapter) / 1e6:.1f} MB")
        results[f"layers={layers}"] = {"base GB": round(size(hf) / 1e9, 2),
                                       "rows": timed(methods, hf, work, ns.runs, f"L{layers}", ns.settle, ns.busy)}
    base = results[f"layers={ns.layers}"]
    print(load_note(ns.busy))
    report(f"base {base['base GB']} GB, LoRA rank {RANK} on every linear layer", base["rows"],
           "floor (hf folder bytes)")
    rows = base["rows"]
    for plain, merged in ((PLAIN_HF, MERGED_HF), (PLAIN_TP2, MERGED_TP2)):
        print(f"{merged}: {rows[merged]['seconds'] / rows[plain]['seconds']:.2f}x the time, "
              f"{rows[merged]['peak_rss_mib'] / rows[plain]['peak_rss_mib']:.2f}x the peak RSS of {plain}")
    if ns.deep_layers:
        deep = results[f"layers={ns.deep_layers}"]["rows"]
        for name in (MERGED_HF, MERGED_TP2):
            print(f"peak RSS {name}: {rows[name]['peak_rss_mib']} MiB at {ns.layers} layers, "
                  f"{deep[name]['peak_rss_mib']} MiB at {ns.deep_layers} layers")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
