"""The registry of checkpoint formats (see :mod:`reshard.plugins`): built-ins below, third
parties through :func:`register_format` or the entry-point group ``reshard.formats`` (each entry
point names a :class:`~reshard.formats.base.CheckpointFormat` subclass or instance)."""

from __future__ import annotations

from collections.abc import Mapping

from reshard.formats.base import CheckpointFormat
from reshard.plugins import PluginRegistry

#: Built-in formats, as "module:class" (imported on first use).
BUILTIN: tuple[str, ...] = (
    "reshard.formats.torch_dist:TorchDistFormat",
    "reshard.formats.megatron:MegatronFormat",
    "reshard.formats.deepspeed_pipeline:DeepSpeedPipelineFormat",
    "reshard.formats.deepspeed:DeepSpeedFormat",
    "reshard.formats.deepspeed:DeepSpeedZero3Format",
    "reshard.formats.deepspeed:DeepSpeedDescriptorFormat",
    "reshard.formats.hf:HFFormat",
)
ENTRY_POINT_GROUP = "reshard.formats"

_FORMATS: PluginRegistry[CheckpointFormat] = PluginRegistry("checkpoint format", CheckpointFormat, BUILTIN,
                                                            ENTRY_POINT_GROUP)
#: Read-only view of the registered formats (name -> format); see :func:`available`.
registry: Mapping[str, CheckpointFormat] = _FORMATS.view
register_format = _FORMATS.register
unregister_format = _FORMATS.unregister
#: Every registered format, built-ins and plug-ins loaded, in detection order.
available = _FORMATS.all
get_format = _FORMATS.get
