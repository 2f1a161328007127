"""``MistralForCausalLM`` both ways: Llama's arithmetic without biases, with megatron-core's sliding
window on every layer (``window_size`` ``(W - 1, 0)`` is ``sliding_window`` W:
:func:`~reshard.models.hf_common.window_args` and :func:`~reshard.models.hf_common.sliding_window`),
under Llama's name table. A folder without ``sliding_window`` has MistralConfig's 4096;
``"sliding_window": null`` none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import HFArchitecture, HFArchitectureFamily, HFModel
from reshard.models.hf_common import sliding_window, window_args
from reshard.models.hf_llama import LLAMA, LLAMA_NAMES, read_llama_like


class Mistral(HFArchitectureFamily):
    """Mistral: Llama's arithmetic without biases, and a sliding window on every layer, which
    megatron-core computes from Megatron-LM's ``window_size`` (:func:`window_args`, both ways).
    Exported as the model Llama's decision finds without biases when the args give every layer a
    window (:meth:`decide`), or without one under ``--hf-architecture MistralForCausalLM``."""

    name = "MistralForCausalLM"
    priority = 0
    model_types = ("mistral",)
    names = LLAMA_NAMES
    #: MistralConfig's defaults; its sliding window is on by default (4096).
    defaults: Mapping[str, Any] = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                                   "max_position_embeddings": 131072, "sliding_window": 4096}

    def read_config(self, config: Mapping[str, Any], where: str) -> HFModel:
        c = {**self.defaults, **config}
        window = c["sliding_window"]
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise CheckpointFormatError(f"sliding_window {window!r} is not a positive number of tokens", culprit=where,
                                        hint="check config.json (null: no window)")
        # its linear layers have no biases, whatever the config says
        model = read_llama_like(self.name, self.names, {**c, "attention_bias": False, "mlp_bias": False}, where)
        if window is not None:
            vars(model.args).update(window_args(window))
        return model

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        """A model whose args give every layer a window, if the rest is Llama without biases (Llama's
        decision); None otherwise, left to the others and to the registry's check that no export
        drops a window (:func:`~reshard.models.hf_registry.decide_export`)."""
        window = sliding_window(args, facts.num_layers)
        if window is None:
            return None
        try:
            decided = LLAMA.decide(args, facts, keys, dtype, widths)
        except LayoutError:
            return None  # not Llama's arithmetic: whichever claims it, the window check refuses it
        if decided is None or decided.config.get("attention_bias") or decided.config.get("mlp_bias"):
            return None
        mistral = self.as_llama_without_biases(decided, "mistral", sliding_window=window)
        return dataclasses.replace(mistral, reason=f"{decided.reason}, a sliding window of {window} tokens")

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        return self.as_llama_without_biases(decided, "mistral", sliding_window=None)


MISTRAL = Mistral()
