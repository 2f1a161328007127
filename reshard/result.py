"""What a finished conversion returns, to Python callers and to a parent Prefect flow alike.

One record for both ways of running it (:func:`reshard.convert` in-process, the ``reshard``
flow): what was written (each file with its size and sha256, the committed manifest), from
what, and what the user should know (warnings such as a kept vocabulary padding). The CLI's
summary line and its ``--json`` are made from it.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    source_format: str | None = Field(default=None, description="the source's format (registry name)")
    target_format: str | None = Field(description="the output's format (registry name)")
    source_pp: int | None = Field(default=None, description="pipeline-parallel degree of the source")
    target_pp: int | None = Field(default=None, description="of the output")
    source_ep: int | None = Field(default=None, description="expert-parallel degree of the source")
    target_ep: int | None = Field(default=None, description="of the output")
    source_etp: int | None = Field(default=None, description="expert tensor-parallel degree of the source (its TP "
                                                             "unless its experts are split apart)")
    target_etp: int | None = Field(default=None, description="of the output; None: its TP")
    version: float | None = Field(default=None, description="the source's checkpoint_version")
    source_quantized: str | None = Field(default=None, description="the quantization the source's weights were "
                                                                   "stored in and read from (fp8, mxfp4), else None")
    quantized: str | None = Field(default=None, description="the quantization written (int8, fp8, mxfp4, w4a16, "
                                                            "fp8-channel, nvfp4, like-source: the --quantize-like "
                                                            "release's), else None")
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
        src, tgt = manifest["source"], manifest["target"]
        fields: dict[str, Any] = {
            "source": src["url"], "destination": destination, "source_tp": src["tp"], "target_tp": tgt["tp"],
            "source_format": src.get("format"), "target_format": tgt["format"], "source_pp": src.get("pp"),
            "target_pp": tgt.get("pp"), "source_ep": src.get("ep"), "target_ep": tgt.get("ep"),
            "source_etp": src.get("etp"), "target_etp": tgt.get("etp"), "version": src.get("version"),
            "source_quantized": src.get("quantized"),
            "quantized": _quantization(manifest.get("options", {}).get("quantize")), "up_to_date": up_to_date,
            "conversion_id": manifest.get("conversion_id"),
            "files": [OutputFile(**{k: f[k] for k in ("path", "size", "sha256")}) for f in manifest["files"]],
            "warnings": list(manifest.get("warnings", [])), "manifest": manifest}
        return cls(**{**fields, **run})

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def summary(self) -> str:
        """The conversion in one line (what ``reshard run`` prints after the destination): its
        :func:`conversion_head` and what was written: ``hf fp8 -> megatron, TP 1 -> 2, EP 1 -> 2,
        9 files, 1.2 MiB``."""
        from reshard.cli_progress import fmt_bytes

        head = conversion_head(self.model_dump())
        return ", ".join([head, f"{len(self.files)} files", fmt_bytes(self.total_bytes)])


def conversion_head(rec: Mapping[str, Any]) -> str:
    """A conversion in words, from a record with :class:`ConversionResult`'s fields (a result, or
    ``reshard plan``'s record): the source's and the output's format with their quantization, then
    every parallel degree that changed (a per-rank output) or, for a layout of global tensors, the
    degrees it gathers: ``megatron (TP 2, EP 2) -> hf fp8``."""

    def named(fmt: str | None, quantized: str | None, held: list[str]) -> str:
        return " ".join(x for x in (fmt or "?", quantized, f"({', '.join(held)})" if held else None) if x)

    tp, ttp, etp, tetp = rec.get("source_tp"), rec.get("target_tp"), rec.get("source_etp"), rec.get("target_etp")
    etp_apart = tetp is not None or etp not in (None, tp)
    degrees = [("TP", tp, ttp), ("PP", rec.get("source_pp"), rec.get("target_pp")),
               ("EP", rec.get("source_ep"), rec.get("target_ep")),
               ("ETP", etp, tetp or ttp) if etp_apart else ("ETP", None, None)]
    if ttp is None:  # global tensors: the source's degrees are gathered
        held = [f"{name} {a}" for name, a, _ in degrees[:3] if a is not None and a > 1]
        changed = []
    else:
        held = []
        changed = [f"{name} {a} -> {b}" for name, a, b in degrees if a is not None and b is not None and a != b]
    head = named(rec.get("source_format"), rec.get("source_quantized"), held) + " -> " + \
        named(rec.get("target_format"), rec.get("quantized"), [])
    return ", ".join([head, *changed])
