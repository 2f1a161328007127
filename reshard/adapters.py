"""LoRA adapter checkpoints: Megatron-Bridge's PEFT save (torch_dist, adapters only) -> a Hugging
Face PEFT adapter folder (``reshard run LORA_CKPT DST --to hf-peft``), and back (``reshard run
HF_ADAPTER DST --to megatron-peft [--target-tp N]``, :func:`export_megatron_peft`: the fusion reversed
by the base architecture's name table, :func:`reshard.models.lora.peft_import`).

Why a path of its own: an adapter checkpoint holds no model (no embeddings, no norms), so the
planner's model checks do not apply; each adapter weight is small and goes, whole, to the Hugging
Face modules its base weight goes to (:mod:`reshard.models.lora`). The facts (heads, query groups,
rank, alpha) come from the ``run_config.yaml`` Megatron-Bridge saves beside it; the architecture is
the one reshard exports such a megatron-core model as (:func:`reshard.models.hf_registry.decide_export`),
from the keys a model of those args holds (:func:`reshard.models.lora.base_model_keys`, a MoE model's
experts included); an adapter of a weight such a model does not hold is refused.
The adapters keep their dtype (Megatron-Bridge 0.6.2's own export writes them as bf16)."""

from __future__ import annotations

import argparse
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import DestinationError, LayoutError
from reshard.formats.hf_peft import ADAPTER_CONFIG, adapter_config, read_adapter, write_adapter
from reshard.formats.megatron_peft import read_adapter_checkpoint
from reshard.formats.megatron_peft_writer import rank_items, run_config, write_checkpoint
from reshard.models.hf_architectures import ffn_widths
from reshard.models.hf_registry import decide_export, read_config
from reshard.models.lora import (
    BRIDGE_TARGETS,
    adapter_parts,
    base_model_keys,
    check_tp,
    peft_export,
    peft_import,
    peft_section,
    peft_settings,
    target_modules,
    wrapped_layer,
)


def _staged(dst: Path, write: Callable[[Path], int]) -> int:
    """``write`` the output into a folder beside ``dst``, then rename it into place: a failed or
    killed run leaves no half-written ``dst``. Returns what ``write`` returns (the bytes written)."""
    stage = dst.parent / f".{dst.name}.reshard-{uuid.uuid4().hex[:8]}"
    try:
        size = write(stage)
        if dst.exists():
            shutil.rmtree(dst)
        stage.rename(dst)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    return size


def export_hf_peft(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """``reshard run LORA_CKPT DST --to hf-peft``: write the adapter as a Hugging Face PEFT folder,
    staged beside ``dst`` and renamed into place (nothing is left half-written). Returns a summary."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise DestinationError("is not empty", culprit=str(dst), hint="choose an empty folder, or --overwrite")
    ckpt = read_adapter_checkpoint(src)
    keys, rows = base_model_keys(ckpt.args)
    foreign = sorted(k for k in ckpt.tensors if adapter_parts(k)[0] not in keys)  # type: ignore[index]
    if foreign:
        raise LayoutError(f"the adapter wraps a weight a model of its run_config.yaml does not hold ({len(foreign)} "
                          f"adapter weight(s))", culprit=foreign[0],
                          hint="copy the run_config.yaml of the run that trained these adapters beside them")
    dtypes = {t.dtype for t in ckpt.tensors.values()}
    arch = decide_export(ckpt.args, ckpt.facts, keys, getattr(ckpt.args, "params_dtype", torch.float32),
                         ffn_widths(rows, bool(ckpt.facts.swiglu)))
    out: dict[str, torch.Tensor] = {}
    for key in sorted(ckpt.tensors):
        t = ckpt.tensors[key]
        shape, dtype = tuple(t.shape), t.dtype
        exp = peft_export(key, shape, dtype.itemsize, ckpt.facts, arch)
        whole = t.read_box((0,) * len(shape), shape).contiguous()
        if exp.copies:
            for o in exp.outputs:
                out[o.name] = whole
            continue
        raw = whole.view(torch.uint8).reshape(-1)
        bufs = [torch.empty(o.shape, dtype=dtype) for o in exp.outputs]
        views = [b.view(torch.uint8).reshape(-1) for b in bufs]
        for run in exp.runs:
            views[run.out][run.dst:run.dst + run.length] = raw[run.src:run.src + run.length]
        out.update({o.name: b for o, b in zip(exp.outputs, bufs, strict=True)})
    config = adapter_config(r=ckpt.lora.r, alpha=ckpt.lora.alpha, dropout=ckpt.lora.dropout,
                            targets=target_modules(list(out)), base=ckpt.base)
    size = _staged(dst, lambda stage: write_adapter(stage, out.items(), config))
    return {"destination": str(dst), "architecture": arch.name, "tensors": len(out), "bytes": size,
            "dtypes": sorted(str(d) for d in dtypes), "r": ckpt.lora.r, "lora_alpha": ckpt.lora.alpha}


def export_megatron_peft(src: str | Path, dst: str | Path, *, target_tp: int | None = None,
                         model_config: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """``reshard run HF_ADAPTER DST --to megatron-peft``: write a Hugging Face PEFT adapter as
    Megatron-Bridge's PEFT checkpoint at TP ``target_tp`` (default 1: a torch_dist checkpoint loads
    at any TP; the TP decides only its files and chunks), staged beside ``dst`` and renamed into
    place. The base's ``config.json`` is ``model_config`` (``--model-config``), else the one in the
    folder the adapter's ``base_model_name_or_path`` names: it gives what the adapter alone lacks
    (heads, query groups, head size) and the ``model`` section Megatron-Bridge builds from."""
    src, dst = Path(src), Path(dst)
    tp = target_tp or 1
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise DestinationError("is not empty", culprit=str(dst), hint="choose an empty folder, or --overwrite")
    config, tensors = read_adapter(src)
    lora = peft_settings(config, str(src / ADAPTER_CONFIG))
    base = config.get("base_model_name_or_path")
    base = base if isinstance(base, str) and base else None
    model = read_config(*_base_config(model_config, base, src))
    if getattr(model.args, "num_experts", None):
        raise LayoutError(f"the base is a mixture of {model.args.num_experts} experts: experts' adapters are not "
                          "converted yet", culprit="--to megatron-peft", hint="convert the adapter of a dense model")
    pairs = peft_import(tensors, model, lora.r, model.args.ffn_hidden_size)
    check_tp(pairs, tp, model.facts)
    dtype = next(iter(pairs.values()))[0].dtype
    args = argparse.Namespace(**{**vars(model.args), "params_dtype": dtype, "bf16": dtype == torch.bfloat16,
                                 "fp16": dtype == torch.float16})
    targets = sorted({wrapped_layer(k) for k in pairs})
    text = run_config(args, peft_section(lora, targets), tp, base)
    ranks = rank_items(pairs, tp, model.facts.num_layers or 0, bool(model.facts.swiglu))
    size = _staged(dst, lambda stage: write_checkpoint(stage, ranks, text))
    return {"destination": str(dst), "architecture": model.architecture, "tensors": 2 * len(pairs), "bytes": size,
            "dtypes": [str(dtype)], "r": lora.r, "lora_alpha": lora.alpha, "tp": tp,
            "target_modules": [t for t in BRIDGE_TARGETS if t in targets]}


def _base_config(given: dict[str, Any] | None, base: str | None, src: Path) -> tuple[dict[str, Any], str]:
    """The base's ``config.json`` and where it came from (see :func:`export_megatron_peft`)."""
    if given is not None:
        return given, "--model-config"
    path = Path(base) / "config.json" if base else None
    if path is None or not path.is_file():
        raise LayoutError(f"the base model ({base or 'not named'}) is no local folder with a config.json: its heads, "
                          "query groups and head size are unknown", culprit=str(src / ADAPTER_CONFIG),
                          hint="give the base's config.json with --model-config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise LayoutError("is not valid JSON", culprit=str(path), hint="give the base's config.json with "
                                                                       "--model-config") from None
    if not isinstance(data, dict):
        raise LayoutError("is not a JSON object", culprit=str(path), hint="give the base's config.json with "
                                                                          "--model-config")
    return data, str(path)
