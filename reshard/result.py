"""What a finished conversion returns, to Python callers and to a parent Prefect flow alike.

One record for both ways of running it (:func:`reshard.convert` in-process, the ``reshard``
flow): what was written (each file with its size and sha256, the committed manifest), from
what, and what the user should know (warnings such as a kept vocabulary padding). The CLI's
summary line and its ``--json`` are made from it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class OutputFile(BaseModel):
    """One committed file, as the manifest lists it."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="path relative to the destination")
    size: int = Field(description="bytes")
    sha256: str = Field(description="hex digest of the file's bytes")


def _quantization(recorded: Any) -> str | None:
    """A manifest's ``quantize`` (``true`` in manifests written before the option took a value: int8)."""
    return "int8" if recorded is True else recorded or None


class ConversionResult(BaseModel):
    """A committed conversion (or one found already committed: ``up_to_date``)."""

    model_config = ConfigDict(frozen=True)

    source: str
    destination: str
    source_tp: int | None = Field(description="tensor-parallel degree of the source")
    target_tp: int | None = Field(description="of the output; None for a layout of global tensors (hf, torch_dist)")
    target_format: str | None = Field(description="the output's format (registry name)")
    version: float | None = Field(default=None, description="the source's checkpoint_version")
    quantized: str | None = Field(default=None, description="the quantization written (int8, fp8), else None")
    up_to_date: bool = Field(description="the destination already held this exact conversion: nothing was written")
    conversion_id: str | None = Field(default=None, description="identity of sources + options + code")
    files: list[OutputFile] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    manifest: dict[str, Any] = Field(default_factory=dict, description="the committed reshard_manifest.json")
    seconds: float | None = Field(default=None, description="wall time of an in-process conversion")
    flow_run_id: str | None = Field(default=None, description="the Prefect flow run that converted it")
    steps: int | None = Field(default=None, description="the flow's fetch/check/convert/upload steps")
    reused: int = Field(default=0, description="steps served from an earlier run's cached results")
    resumed: dict[str, str] = Field(default_factory=dict,
                                    description="output file -> how an earlier, interrupted run of this conversion to "
                                                "this destination had left it, reused instead of made again: 'staged' "
                                                "(at the destination) or 'converted' (in the work folder)")
    converted_on: dict[str, str | None] = Field(default_factory=dict,
                                                description="output file -> the worker that converted it")

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], destination: str, *, up_to_date: bool,
                      **run: Any) -> ConversionResult:
        """The record of a committed ``manifest``; ``run``: what only the run knows (``seconds``,
        the flow run) or says as it was asked (the source URL as given)."""
        fields: dict[str, Any] = {
            "source": manifest["source"]["url"], "destination": destination, "source_tp": manifest["source"]["tp"],
            "target_tp": manifest["target"]["tp"], "target_format": manifest["target"]["format"],
            "version": manifest["source"].get("version"),
            "quantized": _quantization(manifest.get("options", {}).get("quantize")), "up_to_date": up_to_date,
            "conversion_id": manifest.get("conversion_id"),
            "files": [OutputFile(**{k: f[k] for k in ("path", "size", "sha256")}) for f in manifest["files"]],
            "warnings": list(manifest.get("warnings", [])), "manifest": manifest}
        return cls(**{**fields, **run})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)
