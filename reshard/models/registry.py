"""The registry of model families (see :mod:`reshard.plugins`): built-ins below, third parties
through :func:`register_family` or the entry-point group ``reshard.models``."""

from __future__ import annotations

from collections.abc import Mapping

from reshard.models.base import ModelFamily
from reshard.plugins import PluginRegistry

#: Built-in families, as "module:class" (imported on first use).
BUILTIN: tuple[str, ...] = ("reshard.models.megatron_gpt:MegatronGPT", "reshard.models.deepseek:DeepSeek",
                            "reshard.models.deepseek:DeepSeekTE", "reshard.models.gpt_oss:GptOss",
                            "reshard.models.qwen3_next:Qwen3Next", "reshard.models.nemotron_h:NemotronH",
                            "reshard.models.glm4_moe:GptWithMtpLayers")
ENTRY_POINT_GROUP = "reshard.models"

_FAMILIES: PluginRegistry[ModelFamily] = PluginRegistry("model family", ModelFamily, BUILTIN, ENTRY_POINT_GROUP)
#: Read-only view of the registered families (name -> family).
registry: Mapping[str, ModelFamily] = _FAMILIES.view


# Module functions, not bound methods: picklable by reference (see reshard.formats.registry).
def register_family(item: ModelFamily | type[ModelFamily], *, clobber: bool = False) -> ModelFamily:
    """Register a model family (an instance or a class); a second one of the same name raises unless ``clobber``."""
    return _FAMILIES.register(item, clobber=clobber)


def unregister_family(name: str) -> None:
    """Remove a registered family (tests, reloads); unknown names are ignored."""
    _FAMILIES.unregister(name)


def families() -> list[ModelFamily]:
    """Every registered family, in the order the planner asks them."""
    return _FAMILIES.all()
