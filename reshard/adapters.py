"""LoRA adapter checkpoints: Megatron-Bridge's PEFT save (torch_dist, adapters only) -> a Hugging
Face PEFT adapter folder (``reshard run LORA_CKPT DST --to hf-peft``).

Why a path of its own: an adapter checkpoint holds no model (no embeddings, no norms), so the
planner's model checks do not apply; each adapter weight is small and goes, whole, to the Hugging
Face modules its base weight goes to (:mod:`reshard.models.lora`). The facts (heads, query groups,
rank, alpha) come from the ``run_config.yaml`` Megatron-Bridge saves beside it; the architecture is
the one reshard exports such a megatron-core model as (:func:`reshard.models.hf_registry.decide_export`).
The adapters keep their dtype (Megatron-Bridge 0.6.2's own export writes them as bf16)."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, DestinationError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.formats import get_format, locate
from reshard.formats.hf_peft import adapter_config, write_adapter
from reshard.models.given_facts import from_run_config, run_config_beside
from reshard.models.hf_architectures import ffn_widths
from reshard.models.hf_registry import decide_export
from reshard.models.lora import (
    LoraSettings,
    adapter_parts,
    base_model_keys,
    lora_settings,
    peft_export,
    target_modules,
)


@dataclass(frozen=True)
class AdapterCheckpoint:
    """A located adapter checkpoint: its lazy tensors (megatron-core names), the model's ``args``
    and facts (from ``run_config.yaml``), the LoRA settings and the base it was trained on."""

    where: str
    tensors: dict[str, Any]
    args: Any
    facts: ModelFacts
    lora: LoraSettings
    base: str | None


def read_adapter_checkpoint(src: Path) -> AdapterCheckpoint:
    """Locate ``src`` (a Megatron-Bridge PEFT save, its run folder or ``iter_`` folder) and read what
    it says of itself; refuses a checkpoint that holds a model's weights or no LoRA."""
    import yaml

    source = locate(src)
    fmt = get_format(source.format)
    if source.format != "torch_dist":
        raise CheckpointFormatError(f"is a {fmt.title or fmt.name} checkpoint; a LoRA adapter checkpoint is "
                                    "Megatron-Bridge's torch_dist save", culprit=str(src),
                                    hint="point at the PEFT run's checkpoint folder")
    state = fmt.load(source.files[0])
    tensors = {k: v for k, v in state["model"].items() if v is not None and hasattr(v, "shape")}
    others = sorted(k for k in tensors if adapter_parts(k) is None)
    if not tensors or others:
        raise LayoutError(f"holds {len(others)} weight(s) that are no LoRA adapter's ({', '.join(others[:3])}"
                          f"{', ...' if len(others) > 3 else ''})" if others else "holds no adapter weights",
                          culprit=str(src), hint="convert a model with --to hf; --to hf-peft takes an adapter "
                                                 "checkpoint (cfg.peft set)")
    rc_path = run_config_beside(Path(source.files[0]))
    if rc_path is None:
        raise CheckpointFormatError("has no run_config.yaml: the adapter's rank, alpha and model are unknown",
                                    culprit=str(src), hint="copy the training run's run_config.yaml beside it")
    run_config = yaml.safe_load(rc_path.read_text(encoding="utf-8"))
    lora = lora_settings(run_config, str(rc_path))
    args = from_run_config(rc_path)
    if args is None:
        raise CheckpointFormatError("run_config.yaml has no model section", culprit=str(rc_path),
                                    hint="copy the training run's run_config.yaml beside it")
    for key, t in tensors.items():
        _base, side = adapter_parts(key)  # type: ignore[misc]
        r = t.shape[0] if side == "A" else t.shape[-1]
        if r != lora.r:
            raise LayoutError(f"has rank {r}, run_config.yaml's peft.dim is {lora.r}", culprit=key,
                              hint="re-copy run_config.yaml from the run that saved these adapters")
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // heads
    facts = ModelFacts(naming="core", num_layers=args.num_layers, hidden=args.hidden_size, heads=heads,
                       query_groups=groups, head_dim=head_dim, swiglu=bool(getattr(args, "swiglu", False)),
                       tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                       vocab_size=getattr(args, "vocab_size", None), padded_vocab_source=None,
                       padded_vocab_target=None, make_vocab_size_divisible_by=None,
                       source_pp_layers=(args.num_layers,), target_pp_layers=(args.num_layers,),
                       origin={"heads": "args", "query_groups": "args", "head_dim": "args"})
    model = run_config.get("model") if isinstance(run_config, dict) else None
    base = model.get("hf_model_id") if isinstance(model, dict) else None
    return AdapterCheckpoint(str(src), tensors, args, facts, lora, base if isinstance(base, str) else None)


def export_hf_peft(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """``reshard run LORA_CKPT DST --to hf-peft``: write the adapter as a Hugging Face PEFT folder,
    staged beside ``dst`` and renamed into place (nothing is left half-written). Returns a summary."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise DestinationError("is not empty", culprit=str(dst), hint="choose an empty folder, or --overwrite")
    ckpt = read_adapter_checkpoint(src)
    keys, rows = base_model_keys(ckpt.args)
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
