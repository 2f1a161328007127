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
    "reshard.formats.hf_peft:HFPeftFormat",
    "reshard.formats.megatron_peft_writer:MegatronPeftFormat",
    "reshard.formats.universal:UniversalFormat",
)
ENTRY_POINT_GROUP = "reshard.formats"

_FORMATS: PluginRegistry[CheckpointFormat] = PluginRegistry("checkpoint format", CheckpointFormat, BUILTIN,
                                                            ENTRY_POINT_GROUP)
#: Read-only view of the registered formats (name -> format); see :func:`available`.
registry: Mapping[str, CheckpointFormat] = _FORMATS.view

# Module functions, not the registry's bound methods: a function that uses them can be pickled by
# value (Dask ships Prefect tasks that way) without dragging the registry and its lock along.


def register_format(item: CheckpointFormat | type[CheckpointFormat], *, clobber: bool = False) -> CheckpointFormat:
    """Register a format (an instance or a class to instantiate); a second one of the same name raises
    unless ``clobber``."""
    return _FORMATS.register(item, clobber=clobber)


def unregister_format(name: str) -> None:
    """Remove a registered format (tests, reloads); unknown names are ignored."""
    _FORMATS.unregister(name)


def available() -> list[CheckpointFormat]:
    """Every registered format, built-ins and plug-ins loaded, in detection order."""
    return _FORMATS.all()


def get_format(name: str) -> CheckpointFormat:
    """The registered format called ``name``."""
    return _FORMATS.get(name)


def writable() -> list[str]:
    """Names of the registered formats an output can be written in (the ``--to`` choices)."""
    return [fmt.name for fmt in available() if fmt.writes]
