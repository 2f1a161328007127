"""Megatron-Bridge's PEFT checkpoints (LoRA adapters only, torch_dist with its ``run_config.yaml``):
read as lazy megatron-core tensors with the model's facts and the LoRA settings, for
``--to hf-peft`` (:mod:`reshard.adapters`) and ``--merge-adapter`` (:func:`merged`: every source file
the planner and the engine open gets the adapters merged into its base weights, box by box,
:class:`reshard.core.lora_merge.LoraMerged`; :mod:`reshard.execution.adapter_merge` applies it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.lora_merge import LoraMerged
from reshard.core.plan_types import ModelFacts
from reshard.core.source import SourceCheckpoint
from reshard.formats.registry import get_format
from reshard.formats.torch_dist import TORCH_DIST
from reshard.models.given_facts import from_run_config, run_config_beside
from reshard.models.lora import LoraSettings, adapter_parts, lora_settings


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

    from reshard.formats import locate

    source = locate(src)
    fmt = get_format(source.format)
    if source.format != TORCH_DIST:
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
    args = from_run_config(rc_path)  # first: it refuses a file that is no YAML in one line
    run_config = yaml.safe_load(rc_path.read_text(encoding="utf-8"))
    lora = lora_settings(run_config, str(rc_path))
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


@functools.lru_cache(maxsize=4)
def _adapter_weights(path: str, _stamp: float) -> tuple[dict[str, tuple[Any, Any]], LoraSettings]:
    """base weight key -> (A, B) as lazy tensors (each merged box reads its part of them: a model's
    adapters are never held whole), and the settings; found once per version of the checkpoint
    (every source file a conversion opens asks)."""
    ckpt = read_adapter_checkpoint(Path(path))
    pairs: dict[str, dict[str, Any]] = {}
    for key, t in ckpt.tensors.items():
        base, side = adapter_parts(key)  # type: ignore[misc]
        pairs.setdefault(base, {})[side] = t
    for base, sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise CheckpointFormatError(f"holds LoRA's {''.join(sides)} of {base} alone", culprit=path,
                                        hint="re-copy the adapter checkpoint whole")
    return {b: (s["A"], s["B"]) for b, s in pairs.items()}, ckpt.lora


def merged(state: dict[str, Any], source: SourceCheckpoint, adapter: str, module_key: str | None = None
           ) -> dict[str, Any]:
    """``state`` (one opened source file) with each adapted base weight replaced by its merge with
    the LoRA checkpoint at ``adapter``; refuses a base the adapter does not fit (a weight missing, or
    of another shape) and a source of per-rank shards (the adapters are global tensors)."""
    if source.tp != 1 or source.pp != 1 or source.ep != 1:
        raise LayoutError(f"the base is saved in {source.tp} x {source.pp} x {source.ep} (TP x PP x EP) shards; "
                          "the adapter is merged into whole weights", culprit="--merge-adapter",
                          hint="merge into the base's torch_dist or Hugging Face checkpoint, or convert the base "
                               "to TP 1 / PP 1 first")
    root = Path(adapter)
    pairs, lora = _adapter_weights(str(root.resolve()), max((p.stat().st_mtime for p in root.rglob("*")),
                                                            default=0.0))
    key = module_key or next((k for k in ("model", "module") if isinstance(state.get(k), dict)), None)
    if key is None:
        raise LayoutError("the base's files hold no module dict to merge into", culprit="--merge-adapter",
                          hint="merge into a megatron-core or Hugging Face checkpoint")
    module = dict(state[key])
    missing = sorted(b for b in pairs if b not in module)
    if missing:
        raise LayoutError(f"the adapter wraps {len(missing)} weight(s) the base does not hold ({missing[0]}"
                          f"{', ...' if len(missing) > 1 else ''})", culprit=adapter,
                          hint="give the base model the adapter was trained on")
    for base, (a, b) in pairs.items():
        w = module[base]
        if len(w.shape) != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise LayoutError(f"LoRA's B @ A is {b.shape[0]} x {a.shape[1]}; the base's {base} is "
                              f"{' x '.join(map(str, w.shape))}", culprit=adapter,
                              hint="give the base model the adapter was trained on")
        module[base] = LoraMerged(w, a, b, lora.scale)
    return {**state, key: module}
