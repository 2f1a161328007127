"""Do the real tools load a checkpoint? The other direction of the fixtures (side env only):
``make check-realtools OUT=FOLDER [FLAGS='...'] [HF=FOLDER] [FIXTURE=FOLDER]``.

1. **megatron-core 0.19** (Megatron-LM's own loader): the ranks start as ``pretrain_gpt.py`` would
   with the model's command line (``--flags``, or a fixture's from its ``fixture.json``: a Megatron-LM
   fixture's own, a Megatron-Bridge fixture's ``megatron_lm_flags`` for its model) plus ``--load OUT
   --no-load-optim --no-load-rng``, build the model, and call
   ``megatron.training.checkpointing.load_checkpoint`` at its default strictness (``strict=True``;
   torch_dist at ``--dist-ckpt-strictness``'s default), which also checks the saved ``args`` against the
   command line. Then a forward on the fixtures' tokens; the logits are printed (and compared with
   ``--reference``, a fixture's ``logits.pt``). Megatron-LM's strict per-rank load falls back to
   ``strict=False`` on a key mismatch and only prints it: the check loads each rank's file strictly
   again and fails on missing or unexpected keys (``_extra_state`` aside, which Megatron-LM and
   Transformer Engine add and drop between versions). Per-rank folders load at their own layout
   (the ranks come from the ``mp_rank_*`` folder names); torch_dist at ``--tp`` (default 1). Logits are compared
   over the model's vocabulary (a fixture's ``vocab_size``, or ``--vocab``): padding rows are free.
2. **Megatron-Bridge 0.6** ``AutoBridge.export_ckpt(OUT, tmp)`` with a bridge made from ``--hf`` (a
   Hugging Face folder of the same model, with its tokenizer), then transformers' forward of the
   export (float32) against ``--reference``. A run folder that fails is tried again at its iteration
   folder (Megatron-Bridge finds ``iter_*`` folders only; ``release/`` it does not). Per-rank folders
   are skipped: ``export_ckpt`` reads torch_dist only.

Each step prints ``PASS`` or ``FAIL: <the tool's error, last line>``; the exit status is 1 when a step
failed. Nothing is written into OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import megatron_lm  # noqa: E402 (found on the path set above)
from write_fixtures import CPU_FLAGS, TOKENS  # noqa: E402

#: Command-line options a checkpoint's own layout and format decide (dropped from --flags/fixtures).
LAYOUT_OPTIONS = ("--save", "--load", "--ckpt-format", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                  "--expert-model-parallel-size", "--expert-tensor-parallel-size")


def iteration_dir(ckpt: Path) -> Path:
    """The iteration folder a run folder's tracker names (the folder itself without a tracker)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        return ckpt
    text = tracker.read_text().strip()
    return ckpt / ("release" if text == "release" else f"iter_{int(text):07d}")


def layout(ckpt: Path, ep_hint: int = 1) -> tuple[str, int, int, int]:
    """(format, TP, PP, EP) from the iteration folder's files (Megatron-LM's own names; a lone
    ``_NNN`` suffix is Megatron-LM's PP rank, or its EP rank where ``ep_hint`` > 1)."""
    it = iteration_dir(ckpt)
    if (it / ".metadata").exists():
        return "torch_dist", 1, 1, 1
    ranks = [re.fullmatch(r"mp_rank_(\d+)(?:_(\d{3}))?(?:_(\d{3}))?", p.name) for p in it.iterdir() if p.is_dir()]
    ranks = [m for m in ranks if m]
    if not ranks:
        raise SystemExit(f"check_loads: error: {it}: neither torch_dist (.metadata) nor mp_rank_* folders")
    tp = len({m.group(1) for m in ranks})
    suffixes = [tuple(g for g in m.groups()[1:] if g is not None) for m in ranks]
    if all(len(s) == 2 for s in suffixes):
        return "torch", tp, len({s[0] for s in suffixes}), len({s[1] for s in suffixes})
    if all(len(s) == 1 for s in suffixes):
        n = len({s[0] for s in suffixes})
        return ("torch", tp, 1, n) if ep_hint > 1 else ("torch", tp, n, 1)
    return "torch", tp, 1, 1


def model_flags(flags: list[str]) -> list[str]:
    """``flags`` less the options the checkpoint's layout and format decide."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in LAYOUT_OPTIONS:
            skip = True
            continue
        out.append(f)
    return out


def _mcore_load(args: Any, payload: dict[str, Any]) -> None:
    from megatron.training.checkpointing import load_checkpoint

    model = megatron_lm.build_model(args)
    iteration, _ = load_checkpoint(model, None, None)
    if args.ckpt_format == "torch":
        strict_per_rank(args, model[0])
    # the forward in float32 (a --bf16 model's weights upcast), to compare with float32 references
    inner = getattr(model[0], "module", model[0]).float()
    out = megatron_lm.logits(inner, TOKENS)
    if args.rank == 0:
        torch.save({"iteration": iteration, "logits": out}, payload["out"])


def strict_per_rank(args: Any, model: Any) -> None:
    """Megatron-LM 0.19's ``load_checkpoint(strict=True)`` of a per-rank file falls back to
    ``strict=False`` when the strict load raises (for Transformer Engine's changing extra states) and
    only prints the result, so a missing or misnamed tensor stays at its initial value. Load this
    rank's file strictly again, as ``strict=True`` means: any missing or unexpected key is an error."""
    from megatron.training.checkpointing import (
        get_checkpoint_name,
        get_checkpoint_tracker_filename,
        read_metadata,
    )

    iteration, release = read_metadata(get_checkpoint_tracker_filename(args.load))
    state = torch.load(get_checkpoint_name(args.load, iteration, release), map_location="cpu", weights_only=False)
    inner = getattr(model, "module", model)
    result = inner.load_state_dict(state["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"load_checkpoint fell back to strict=False: missing {missing}, unexpected {unexpected}")


def check_megatron_core(ckpt: Path, flags: list[str], reference: dict[str, Any] | None, ep_hint: int,
                        dist_tp: int) -> str:
    fmt, tp, pp, ep = layout(ckpt, ep_hint)
    if fmt == "torch_dist":  # any layout loads it: the one asked for
        tp = dist_tp
    world = tp * pp * ep
    argv = [*model_flags(flags), *[f for f in CPU_FLAGS if f not in flags], "--load", str(ckpt), "--no-load-optim",
            "--no-load-rng", "--ckpt-format", fmt, "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep)]
    print(f"megatron-core: {fmt}, TP {tp} PP {pp} EP {ep}, {world} rank(s): pretrain_gpt.py {shlex.join(argv)}")
    if pp > 1:
        return "FAIL: the check runs a forward at PP 1 only (load it at PP 1 first)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.pt"
        try:
            megatron_lm.launch(world, argv, _mcore_load, {"out": str(out)})
        except RuntimeError as err:
            return "FAIL: " + last_line(str(err))
        got = torch.load(out, weights_only=True)
    print(f"  loaded iteration {got['iteration']}; logits[0, :6] = {got['logits'][0, :6].tolist()}")
    return compare(got["logits"], reference)


def _bridge_export(ckpt: str, hf: str, out: str, errors: Any) -> None:
    try:
        import cpu_shims

        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cpu_shims.install_for_bridge()
        from megatron.bridge import AutoBridge

        AutoBridge.from_hf_pretrained(hf).export_ckpt(ckpt, out, show_progress=False)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


def check_bridge_export(ckpt: Path, hf: Path, reference: dict[str, Any] | None) -> str:
    """export_ckpt of ``ckpt``; of its iteration folder too when a run folder fails (Megatron-Bridge
    looks for ``iter_*`` folders only, so a user then hands it the iteration folder)."""
    verdict = export_once(ckpt, hf, reference)
    it = iteration_dir(ckpt)
    if verdict.startswith("FAIL") and it != ckpt:
        verdict = f"{verdict}; on {it.name}/: {export_once(it, hf, reference)}"
    return verdict


def export_once(ckpt: Path, hf: Path, reference: dict[str, Any] | None) -> str:
    import torch.multiprocessing as mp
    import transformers

    print(f"megatron-bridge: AutoBridge.from_hf_pretrained({hf}).export_ckpt({ckpt}, ...)")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        errors = ctx.SimpleQueue()
        proc = ctx.Process(target=_bridge_export, args=(str(ckpt), str(hf), tmp + "/hf", errors))
        proc.start()
        proc.join()
        if proc.exitcode:
            return "FAIL: " + last_line(errors.get() if not errors.empty() else f"exit code {proc.exitcode}")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp + "/hf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0]
    print(f"  exported; transformers logits[0, :6] = {logits[0, :6].tolist()}")
    return compare(logits, reference)


def compare(logits: torch.Tensor, reference: dict[str, Any] | None) -> str:
    if reference is None:
        return "PASS (loaded; no --reference to compare)"
    ref = reference["logits"]
    # the model's own vocabulary: the padding rows past it are free (a conversion may re-pad them)
    n = min(ref.shape[-1], logits.shape[-1], reference.get("vocab_size") or ref.shape[-1])
    gap = (logits[:, :n].float() - ref[:, :n].float()).abs().max().item()
    verdict = "PASS" if gap <= 1e-3 * max(1.0, ref.abs().max().item()) else "FAIL"
    return f"{verdict}: max |logits - reference| = {gap:.3g} over {n} vocabulary columns"


def last_line(text: str) -> str:
    """The tool's error from a traceback: its last ``SomeError: message`` line, with the next lines
    when the message goes on there (ends with a colon, or is empty), else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", lines[i]):
            if lines[i].endswith(":") or ":" not in lines[i]:
                return " ".join(lines[i:i + 3])
            return lines[i]
    return lines[-1] if lines else text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the checkpoint folder (a run folder or an iteration folder)")
    p.add_argument("--flags", default="", help="the model's Megatron-LM command line (model options)")
    p.add_argument("--fixture", type=Path, help="a fixture folder: its fixture.json's command line and logits.pt")
    p.add_argument("--hf", type=Path, help="a Hugging Face folder of the model (config and tokenizer) for export_ckpt")
    p.add_argument("--reference", type=Path, help="a logits.pt to compare with (default: the fixture's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to load a torch_dist folder at (default 1)")
    p.add_argument("--vocab", type=int, help="logit columns to compare: the model's vocabulary, padding past "
                   "it left out (default: a fixture's vocab_size, else all)")
    p.add_argument("--ep", type=int, help="expert-parallel ranks of a per-rank folder named mp_rank_TT_EEE "
                   "(default: the command line's --expert-model-parallel-size, else 1)")
    a = p.parse_args()
    flags = shlex.split(a.flags)
    reference_file = a.reference
    meta = json.loads((a.fixture / "fixture.json").read_text()) if a.fixture else {}
    if a.fixture:
        line = meta.get("command_line") or meta.get("megatron_lm_flags")  # its own, or its model's
        if line:
            flags = shlex.split(line)[1:] + flags
        reference_file = reference_file or a.fixture / "logits.pt"
        if a.hf is None and (a.fixture / "hf").is_dir():
            a.hf = a.fixture / "hf"
    reference = torch.load(reference_file, weights_only=True) if reference_file else None
    if reference is not None:
        reference["vocab_size"] = a.vocab or meta.get("vocab_size")
    if a.ep is None:
        given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--expert-model-parallel-size"]
        a.ep = int(given[-1]) if given else 1
    results = {}
    if flags:
        results["megatron-core load_checkpoint"] = check_megatron_core(a.out, flags, reference, a.ep, a.tp)
    else:
        results["megatron-core load_checkpoint"] = "SKIPPED: no --flags or Megatron-LM --fixture (model command line)"
    if layout(a.out, a.ep)[0] != "torch_dist":
        results["megatron-bridge export_ckpt"] = "SKIPPED: per-rank files (export_ckpt reads torch_dist)"
    elif a.hf:
        results["megatron-bridge export_ckpt"] = check_bridge_export(a.out, a.hf, reference)
    else:
        results["megatron-bridge export_ckpt"] = "SKIPPED: no --hf (a Hugging Face folder of the model)"
    print()
    for step, verdict in results.items():
        print(f"{step}: {verdict}")
    sys.exit(1 if any(v.startswith("FAIL") for v in results.values()) else 0)


if __name__ == "__main__":
    main()
