"""``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration`` (transformers 5.24's
``models/qwen3_5``, ``qwen3_5_moe``: the vision-language folders Qwen3.5 is released as) imported as
their language model, which is :mod:`reshard.models.hf_qwen3_next`'s ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM`` under another prefix:

======================================  ========================================================
the folder                              read as
======================================  ========================================================
``config.json``'s ``text_config``       the text class's ``config.json`` (``tie_word_embeddings``
                                        the top level's, which transformers ties by)
``model.language_model.{rest}``         the text class's ``model.{rest}``
``lm_head.weight``                      the same
``model.visual.*`` (the vision tower)   not imported: megatron-core's GPT model is the language
                                        model alone; one warning line names it
``mtp.*``                               not imported, as for the text class
======================================  ========================================================

Why a warning and no refusal: a Qwen3.5 release is this folder (there is no text-only one), so
refusing its vision tower would refuse every Qwen3.5 import; what the output lacks is said once,
as for the release's multi-token prediction layers. The language model computes on text what the
text class computes: transformers gives text tokens equal M-RoPE positions on its three axes, where
M-RoPE (``mrope_section``) is the plain rotary embedding megatron-core applies. The imported model is
exported as the text class (neither class here claims a megatron-core model: the vision tower is not
in it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.core.errors import CheckpointFormatError, LayoutError
from reshard.core.plan_types import ModelFacts
from reshard.models.hf_architectures import HFArchitecture
from reshard.models.hf_qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextFamily

#: The language model's prefix in the folder, and the text class's.
LANGUAGE, TEXT = "model.language_model.", "model."
#: The vision tower's prefix in the folder.
VISUAL = "model.visual."


def text_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The language model's ``config.json`` (``text_config``, tied as the top level says), or the
    refusal of a folder without one."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise CheckpointFormatError(f"{config.get('architectures')} without a text_config", culprit=where,
                                    hint="config.json is incomplete; re-copy the folder")
    return {**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


class LanguageModelOf(Qwen3NextFamily):
    """A vision-language class read as its language model's text class (the next class in the MRO)."""

    def imported_config(self, config: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        return text_config(config, where)

    def import_warnings(self, config: Mapping[str, Any], args: Any) -> list[str]:
        """The vision tower, not imported; and what the text class says of its language model."""
        vision = config.get("vision_config")
        depth = vision.get("depth") if isinstance(vision, Mapping) else None
        line = (f"{self.name}'s vision tower ({VISUAL}*{f', depth {depth}' if depth else ''}) is not imported: "
                f"megatron-core's GPT model holds its language model alone ({self.text_name}'s)")
        return [line, *super().import_warnings(text_config(config, "config.json"), args)]

    def table_name(self, name: str, facts: ModelFacts) -> str | None:
        if name.startswith(VISUAL):
            return None
        return super().table_name(TEXT + name[len(LANGUAGE):] if name.startswith(LANGUAGE) else name, facts)

    def folder_name(self, name: str, facts: ModelFacts) -> str:
        real = super().folder_name(name, facts)
        return LANGUAGE + real[len(TEXT):] if real.startswith(TEXT) else real

    def decide(self, args: Any, facts: ModelFacts, keys: set[str], dtype: torch.dtype,
               widths: Mapping[str, int]) -> HFArchitecture | None:
        return None  # no megatron-core model holds the vision tower: the text class claims it

    def export(self, decided: HFArchitecture) -> HFArchitecture:
        raise LayoutError(f"{self.name} holds a vision tower, which no megatron-core GPT model has",
                          culprit="--hf-architecture", hint=f"write the language model: --hf-architecture "
                                                            f"{self.text_name}, or drop it")

    @property
    def text_name(self) -> str:
        """The text class this class's language model is (the next class in the MRO)."""
        return super().name


class Qwen3_5ForConditionalGeneration(LanguageModelOf, Qwen3_5ForCausalLM):
    """transformers' ``Qwen3_5ForConditionalGeneration``: ``Qwen3_5ForCausalLM``'s language model beside
    a vision tower."""

    name = "Qwen3_5ForConditionalGeneration"
    model_types = ("qwen3_5",)


class Qwen3_5MoeForConditionalGeneration(LanguageModelOf, Qwen3_5MoeForCausalLM):
    """transformers' ``Qwen3_5MoeForConditionalGeneration``: ``Qwen3_5MoeForCausalLM``'s language model
    beside a vision tower."""

    name = "Qwen3_5MoeForConditionalGeneration"
    model_types = ("qwen3_5_moe",)


QWEN3_5_VL = Qwen3_5ForConditionalGeneration()
QWEN3_5_MOE_VL = Qwen3_5MoeForConditionalGeneration()
