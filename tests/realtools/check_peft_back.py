"""Does Megatron-Bridge load the PEFT checkpoints reshard writes (``--to megatron-peft``)? Side env
only, not part of ``make test``:

    SIDE/bin/python tests/realtools/check_peft_back.py --hf BASE_HF CKPT=EXPECTED [CKPT=EXPECTED ...]
    SIDE/bin/python tests/realtools/check_peft_back.py --reshard .venv/bin/reshard   # make check-peft-back

The second form makes the pairs from the LoRA fixtures with reshard's CLI first (in its own venv):
the TP 1 fixture's Hugging Face adapter (Bridge's export) written at TP 1 and TP 2, expecting that
adapter back; reshard's ``--to hf-peft`` of the TP 2 fixture (float32) written at TP 2 and TP 1,
expecting Bridge's export of the TP 2 fixture's own checkpoint.

For each pair, Megatron-Bridge 0.6.2's own ``AutoBridge.from_hf_pretrained(BASE_HF)
.export_adapter_ckpt(CKPT's iter_ folder, tmp)`` — which builds the LoRA model from the checkpoint's
``run_config.yaml`` ``peft`` section, loads the adapters with megatron-core's
``dist_checkpointing.load`` (sharding integrity validated) and writes a Hugging Face PEFT adapter —
and the adapter it writes is compared with ``EXPECTED`` (a Hugging Face PEFT folder: the one the
checkpoint was converted from, or Bridge's export of Bridge's own checkpoint), tensor for tensor, bit
for bit, with the same ``r``, ``lora_alpha`` and ``target_modules`` (``--bf16``: the expected tensors cast
to bf16, as Megatron-Bridge 0.6.2's export writes float32 adapters). Bridge builds its model at TP 1
whatever the checkpoint's TP, so a TP 2 checkpoint is resharded by megatron-core on load. Prints
``PASS`` or ``FAIL: ...`` per pair; exit status 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
BRIDGE = HERE.parent / "fixtures" / "realtools" / "megatron-bridge-0.6.2"


def fixture_pairs(reshard: str, root: Path) -> list[str]:
    """The pairs of the second form (see the module docstring), converted by ``reshard`` into ``root``."""
    import subprocess

    config = ["--model-config", str(BRIDGE / "llama" / "hf" / "config.json")]

    def run(*args: str) -> None:
        subprocess.run([reshard, "run", *args], check=True, stdout=subprocess.DEVNULL)

    adapter, tp2 = BRIDGE / "llama-lora" / "hf_adapter", BRIDGE / "llama-lora-tp2" / "checkpoint"
    run(str(tp2), str(root / "tp2-hf"), "--to", "hf-peft")
    pairs = []
    for name, src, want in (("tp1", adapter, adapter), ("tp2", root / "tp2-hf", tp2)):
        for tp in (1, 2):
            out = root / f"{name}-at-tp{tp}"
            run(str(src), str(out), "--to", "megatron-peft", "--target-tp", str(tp), *config)
            pairs.append(f"{out}={want}")
    return pairs


def iteration_dir(ckpt: Path) -> Path:
    """Bridge's export takes an ``iter_`` folder (not the run folder)."""
    found = sorted(ckpt.glob("iter_*"))
    return found[-1] if found else ckpt


def compare(got: Path, want: Path, bf16: bool = False) -> list[str]:
    """What differs between two Hugging Face PEFT adapter folders (nothing: an empty list);
    ``bf16``: ``want``'s tensors cast to bf16 first."""
    import torch
    from safetensors.torch import load_file

    problems = []
    a, b = (load_file(str(d / "adapter_model.safetensors")) for d in (got, want))
    if bf16:
        b = {k: v.to(torch.bfloat16) for k, v in b.items()}
    if sorted(a) != sorted(b):
        problems.append(f"keys differ: {sorted(set(a) ^ set(b))[:4]}")
    for k in sorted(set(a) & set(b)):
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            gap = (a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else "-"
            problems.append(f"{k}: {a[k].dtype} {tuple(a[k].shape)} vs {b[k].dtype} {tuple(b[k].shape)}, max gap {gap}")
    ca, cb = (json.loads((d / "adapter_config.json").read_text()) for d in (got, want))
    for field in ("peft_type", "r", "lora_alpha"):
        if ca.get(field) != cb.get(field):
            problems.append(f"{field}: {ca.get(field)!r} vs {cb.get(field)!r}")
    if sorted(ca.get("target_modules") or []) != sorted(cb.get("target_modules") or []):
        problems.append(f"target_modules: {ca.get('target_modules')} vs {cb.get('target_modules')}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", type=Path, default=BRIDGE / "llama" / "hf", help="the base's Hugging Face folder "
                        "(default: the LoRA fixtures' base)")
    parser.add_argument("pairs", nargs="*", help="CKPT=EXPECTED_ADAPTER")
    parser.add_argument("--reshard", help="reshard's CLI: check the LoRA fixtures' adapters written by it (no pairs)")
    parser.add_argument("--bf16", action="store_true",
                        help="compare with EXPECTED adapters cast to bf16 (Megatron-Bridge 0.6.2's export writes "
                             "float32 adapters as bf16)")
    ns = parser.parse_args(argv)
    if bool(ns.pairs) == bool(ns.reshard):
        parser.error("give CKPT=EXPECTED pairs, or --reshard")
    work = tempfile.TemporaryDirectory()
    pairs = ns.pairs or fixture_pairs(ns.reshard, Path(work.name))
    import cpu_shims

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cpu_shims.install_for_bridge()
    from megatron.bridge import AutoBridge

    failed = 0
    for pair in pairs:
        ckpt, _, want = pair.partition("=")
        try:
            bridge = AutoBridge.from_hf_pretrained(str(ns.hf))
            with tempfile.TemporaryDirectory() as tmp:
                bridge.export_adapter_ckpt(str(iteration_dir(Path(ckpt))), f"{tmp}/got", show_progress=False)
                if not (Path(want) / "adapter_config.json").is_file():  # a checkpoint: Bridge's export of it
                    bridge.export_adapter_ckpt(str(iteration_dir(Path(want))), f"{tmp}/want", show_progress=False)
                    want = f"{tmp}/want"
                problems = compare(Path(tmp) / "got", Path(want), bf16=ns.bf16 and "want" not in want)
            print(f"{ckpt}: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems[:4])), flush=True)
            failed += bool(problems)
        except Exception as exc:  # the tool's own error, reported as the check's result
            traceback.print_exc()
            print(f"{ckpt}: FAIL: {type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}", flush=True)
            failed += 1
    work.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
