"""The registry of model families (see :mod:`reshard.plugins`): built-ins below, third parties
through :func:`register_family` or the entry-point group ``reshard.models``."""

from __future__ import annotations

from collections.abc import Mapping

from reshard.models.base import ModelFamily
from reshard.plugins import PluginRegistry

#: Built-in families, as "module:class" (imported on first use).
BUILTIN: tuple[str, ...] = ("reshard.models.megatron_gpt:MegatronGPT",)
ENTRY_POINT_GROUP = "reshard.models"

_FAMILIES: PluginRegistry[ModelFamily] = PluginRegistry("model family", ModelFamily, BUILTIN, ENTRY_POINT_GROUP)
#: Read-only view of the registered families (name -> family).
registry: Mapping[str, ModelFamily] = _FAMILIES.view
register_family = _FAMILIES.register
unregister_family = _FAMILIES.unregister
#: Every registered family, in the order the planner asks them.
families = _FAMILIES.all
