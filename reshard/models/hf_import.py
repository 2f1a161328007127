"""A Hugging Face model folder read as the megatron-core model it computes: its tensors as
megatron-core's per-rank module at TP 1 (lazy: each megatron-core tensor a view of the Hugging Face
ones, by the architecture's name table and the transforms of :mod:`reshard.models.hf_architectures`),
and Megatron-LM's per-rank state of it. ``config.json`` is read by the architecture it names (its
``read_config``, through :func:`reshard.models.hf_registry.read_config`).

Pure: no files. The ``hf`` format (:mod:`reshard.formats.hf`) reads the folder.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError
from reshard.core.lazy import LazyTensor
from reshard.models.hf_architectures import HFModel
from reshard.models.megatron_args import MadeArgs
from reshard.models.megatron_gpt import core_module

#: Tensors some saved folders hold that are buffers, not weights (recomputed by the model): the
#: rotary embedding's frequencies (an architecture's own buffers: its
#: :meth:`~reshard.models.hf_architectures.HFArchitectureFamily.table_name`).
BUFFERS = (re.compile(r"\.rotary_emb\.inv_freq$"),)


def core_tensors(tensors: Mapping[str, LazyTensor], model: HFModel) -> dict[str, Any]:
    """megatron-core's per-rank module at TP 1 from the Hugging Face ``tensors`` (name -> lazy
    tensor): each row of the architecture's name table gathers its Hugging Face tensors into the
    megatron-core tensor (its first megatron-core name), then megatron-core's order and extra states
    (the architecture's :meth:`~reshard.models.hf_architectures.HFArchitectureFamily.core_module`). A tensor
    no row names, or one a row misses, is an error; a tied model's ``lm_head`` copy is dropped
    (transformers ties it to the embedding on load, as megatron-core does); names saved without
    the base model's prefix (:attr:`HFModel.base_prefix`) are read with it; the architecture's
    hooks say how its table spells the folder's names and which it does not import
    (:meth:`~reshard.models.hf_architectures.HFArchitectureFamily.table_name`)."""
    table = model.names
    prefix = model.base_prefix
    family = model.family
    if prefix and not any(k.startswith(prefix) for k in tensors):
        tensors = {(k if k.startswith("lm_head.") else prefix + k): v for k, v in tensors.items()}
    if family is not None:
        renamed = ((family.table_name(k, model.facts), v) for k, v in tensors.items())
        tensors = {k: v for k, v in renamed if k is not None}

    def folder_name(name: str) -> str:
        return family.folder_name(name, model.facts) if family is not None else name

    found: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
    for name in tensors:
        if any(p.search(name) for p in BUFFERS):
            continue
        hit = next(((i, j, m) for i, row in enumerate(table) if row.transform is not None
                    for j, m in enumerate(p.match(name) for p in row.hf_patterns) if m), None)
        if hit is None:
            name = folder_name(name)
            raise CheckpointFormatError(f"{name} has no counterpart in megatron-core's {model.architecture}",
                                        culprit=name, hint="import a model of the architecture config.json names")
        i, j, m = hit
        found.setdefault((i, tuple(sorted(m.groupdict().items()))), {})[j] = name
    module: dict[str, Any] = {}
    stacks: dict[tuple[Any, ...], dict[str, int]] = {}  # slabs of the stacked tensors of one layer
    for (i, fields), parts in found.items():
        row = table[i]
        names = tuple(t.format(**dict(fields)) for t in row.hf)
        missing = [n for j, n in enumerate(names) if j not in parts]
        if missing:
            missing = [folder_name(n) for n in missing]
            raise CheckpointFormatError(f"{missing[0]} is missing (beside {parts[min(parts)]})", culprit=missing[0],
                                        hint="the weights are incomplete; re-copy the folder")
        transform: Any = row.transform  # never None: such rows match no name above
        if transform.stacks is not None:  # one Hugging Face tensor, many megatron-core ones
            fanned = transform.fan_out(names, [tensors[n] for n in names], model.facts)
            counts = stacks.setdefault((transform.stacks, fields), {})
            counts[names[0]] = len(fanned)
            if len(set(counts.values())) > 1:
                held = ", ".join(f"{n} {c}" for n, c in counts.items())
                raise CheckpointFormatError(f"stacked tensors of one layer hold different numbers of "
                                            f"{transform.stacks}s: {held}", culprit=names[0],
                                            hint="the weights are incomplete; re-copy the folder")
            for j, t in enumerate(fanned):
                module[row.core[0].format(**dict(fields), **{transform.stacks: j})] = t
            continue
        key = row.core[0].format(**dict(fields))
        if key == "output_layer.weight" and model.facts.tied_embeddings:
            continue
        module[key] = transform.gather(names, [tensors[n] for n in names], model.facts)
    _check_layers(module, model)
    return family.core_module(module) if family is not None else core_module(module)


def _check_layers(module: Mapping[str, Any], model: HFModel) -> None:
    layers = {int(k.split(".")[2]) for k in module if k.startswith("decoder.layers.")}
    if layers != set(range(model.facts.num_layers)):
        raise CheckpointFormatError(f"holds layers {sorted(layers)[:8]}{'...' if len(layers) > 8 else ''}, "
                                    f"config.json says {model.facts.num_layers}", culprit="config.json",
                                    hint="the weights and config.json do not belong together")
    emb = module.get("embedding.word_embeddings.weight")
    if not isinstance(emb, LazyTensor) or emb.shape != (model.facts.vocab_size, model.facts.hidden):
        shape = tuple(emb.shape) if isinstance(emb, LazyTensor) else None
        raise CheckpointFormatError(f"the input embedding is {shape}, config.json implies "
                                    f"{(model.facts.vocab_size, model.facts.hidden)}", culprit="config.json",
                                    hint="the weights and config.json do not belong together")


def megatron_state(tensors: Mapping[str, LazyTensor], model: HFModel) -> dict[str, Any]:
    """What Megatron-LM's per-rank file of a TP 1 ``release`` checkpoint holds for this model:
    ``args`` (with the weights' dtype; completed as Megatron-LM's own when written:
    :class:`~reshard.models.megatron_args.MadeArgs`; with what the weights decide:
    :meth:`~reshard.models.hf_architectures.HFArchitectureFamily.args_from_weights`),
    the checkpoint version, the module (:func:`core_tensors`)."""
    module = core_tensors(tensors, model)
    dtype = module["embedding.word_embeddings.weight"].dtype
    args = MadeArgs(**vars(model.args), params_dtype=dtype, bf16=dtype == torch.bfloat16,
                    fp16=dtype == torch.float16)
    if model.family is not None:
        for key, value in model.family.args_from_weights(module, model).items():
            setattr(args, key, value)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": module}
