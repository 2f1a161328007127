"""Phi-3 (``Phi3ForCausalLM``) as a Hugging Face architecture plug-in, in this one module: its fused
``qkv_proj`` (all queries, all keys, all values) and ``gate_up_proj`` (``[gate; up]``, megatron-core's
fc1 as it is), its ``config.json`` read as Megatron-LM's ``args`` and written back. Registered by the
tests with :func:`reshard.models.hf_registry.register_hf_architecture`; nothing of reshard is edited.

Shapes (``H`` query heads, ``G`` query groups, ``d`` head dim, ``q = H / G``):

==================  =====================================  ==================================
tensor              megatron-core (per query group)        Phi-3
==================  =====================================  ==================================
linear_qkv          ``[G * (q + 2) * d, h]``: ``q*d``       ``qkv_proj [(H + 2G) * d, h]``:
                    query rows, ``d`` key, ``d`` value      every query row, then keys, values
linear_fc1          ``[2f, h]`` = ``[gate; up]``            ``gate_up_proj [2f, h]``, the same
==================  =====================================  ==================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from reshard.core.errors import LayoutError
from reshard.core.lazy import LazyTensor, RowConcat
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import (
    ByteTransform,
    HFArchitecture,
    HFArchitectureFamily,
    HFModel,
    NameRow,
    OutTensor,
    Run,
    Same,
)
from reshard.models.hf_llama import LLAMA_NAMES, read_llama_like

_L, _H = "decoder.layers.{layer}.", "model.layers.{layer}."


class PhiQKV(ByteTransform):
    """megatron-core's grouped QKV <-> Phi-3's ``qkv_proj``: the same rows, regrouped (byte runs)."""

    @staticmethod
    def _dims(facts: ModelFacts) -> tuple[int, int, int]:
        g, heads, d = facts.query_groups or 0, facts.heads or 0, facts.head_dim or 0
        if not (g and heads and d) or heads % g:
            raise LayoutError(f"{heads} heads in {g} groups of dim {d}", culprit="linear_qkv")
        return g, heads // g, d

    def outputs(self, names: tuple[str, ...], shape: tuple[int, ...], facts: ModelFacts) -> list[OutTensor]:
        return [OutTensor(names[0], shape)]

    def runs(self, shape: tuple[int, ...], itemsize: int, facts: ModelFacts) -> list[Run]:
        g, q, d = self._dims(facts)
        row = itemsize * (shape[1] if len(shape) > 1 else 1)
        out = []
        for i in range(g):
            base = i * (q + 2) * d * row
            out += [Run(base, q * d * row, 0, i * q * d * row),
                    Run(base + q * d * row, d * row, 0, (g * q * d + i * d) * row),
                    Run(base + (q + 1) * d * row, d * row, 0, (g * q * d + g * d + i * d) * row)]
        return out

    def gather(self, names: tuple[str, ...], parts: Sequence[LazyTensor], facts: ModelFacts) -> LazyTensor:
        qkv, (g, q, d) = parts[0], self._dims(facts)
        if qkv.shape[0] != (q + 2) * g * d:
            raise LayoutError(f"is {tuple(qkv.shape)}; config.json implies {(q + 2) * g * d} rows", culprit=names[0])
        keys, values = g * q * d, g * q * d + g * d
        return RowConcat([seg for i in range(g)
                          for seg in ((qkv, i * q * d, q * d), (qkv, keys + i * d, d), (qkv, values + i * d, d))])


def _phi3_names() -> tuple[NameRow, ...]:
    """Llama's table with the two fused projections in place of their split rows."""
    fused = {_L + "self_attention.linear_qkv.{p}": NameRow((_L + "self_attention.linear_qkv.weight",), PhiQKV(),
                                                           (_H + "self_attn.qkv_proj.weight",), linear=True),
             _L + "mlp.linear_fc1.{p}": NameRow((_L + "mlp.linear_fc1.weight",), Same(),
                                                (_H + "mlp.gate_up_proj.weight",), linear=True)}
    return tuple(fused.get(row.core[0], row) for row in LLAMA_NAMES)


#: transformers' Phi3Config defaults for what a config.json may leave out.
_DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 4096,
             "attention_bias": False, "mlp_bias": False, "sliding_window": None}


class Phi3(HFArchitectureFamily):
    name = "Phi3ForCausalLM"
    model_types = ("phi3",)
    names = _phi3_names()

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**_DEFAULTS, **config}
        if c.get("sliding_window") is not None:
            raise LayoutError(f"megatron-core does not compute this {self.name} exactly: sliding-window attention",
                              culprit=where)
        return read_llama_like(self.name, self.names, c, where)

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        return self.as_llama_without_biases(decided, "phi3", sliding_window=None, pad_token_id=None)
