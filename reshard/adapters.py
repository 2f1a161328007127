"""LoRA adapter checkpoints: Megatron-Bridge's PEFT save (torch_dist, adapters only) -> a Hugging
Face PEFT adapter folder (``reshard run LORA_CKPT DST --to hf-peft``).

Why a path of its own: an adapter checkpoint holds no model (no embeddings, no norms), so the
planner's model checks do not apply; each adapter weight is small and goes, whole, to the Hugging
Face modules its base weight goes to (:mod:`reshard.models.lora`). The facts (heads, query groups,
rank, alpha) come from the ``run_config.yaml`` Megatron-Bridge saves beside it; the architecture is
the one reshard exports such a megatron-core model as (:func:`reshard.models.hf_registry.decide_export`),
from the keys a model of those args holds (:func:`reshard.models.lora.base_model_keys`, a MoE model's
experts included); an adapter of a weight such a model does not hold is refused.
The adapters keep their dtype (Megatron-Bridge 0.6.2's own export writes them as bf16)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import DestinationError, LayoutError
from reshard.formats.hf_peft import adapter_config, write_adapter
from reshard.formats.megatron_peft import read_adapter_checkpoint
from reshard.models.hf_architectures import ffn_widths
from reshard.models.hf_registry import decide_export
from reshard.models.lora import adapter_parts, base_model_keys, peft_export, target_modules


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
    stage = dst.parent / f".{dst.name}.reshard-{uuid.uuid4().hex[:8]}"
    try:
        size = write_adapter(stage, out.items(), config)
        if dst.exists():
            shutil.rmtree(dst)
        stage.rename(dst)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    return {"destination": str(dst), "architecture": arch.name, "tensors": len(out), "bytes": size,
            "dtypes": sorted(str(d) for d in dtypes), "r": ckpt.lora.r, "lora_alpha": ckpt.lora.alpha}
