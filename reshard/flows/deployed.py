"""The ``reshard`` flow with flat parameters: the entrypoint of the ``reshard/8to2``-style deployments.

``reshard.flows.reshard_flow:reshard_flow`` takes one pydantic model (``params: ReshardParams``).
That is right for Python callers but awkward for deployments: Prefect merges a run's parameters
into the deployment's defaults one top-level key deep, so ``--param params='{"source": ...}'``
would replace the deployment's ``target_tp`` as well, and an event trigger would have to template
a whole nested object. This flow has the same name (``reshard``) and the same task graph, but one
top-level parameter per :class:`~reshard.flows.params.ReshardParams` field, so that

    prefect deployment run reshard/8to2 --param source='"s3://ckpt/run7/global_step1000"'

overrides just ``source`` and keeps the deployment's ``target_tp: 2``. ``destination`` is a
template (``{source}``, ``{parent}``, ``{name}``, ``{target_tp}``); a plain URL is used as is.
The body runs ``reshard_flow``'s steps inside this flow run (no nested run), so the run's task
graph, caching, retries, artifact and return value are exactly those of ``reshard run``.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from reshard.flows.params import ReshardParams
from reshard.result import ConversionResult

#: default ``destination``: a sibling of the source, e.g. ``s3://ckpt/run7/global_step1000-tp2``
DEFAULT_DESTINATION = "{source}-tp{target_tp}"
TEMPLATE_FIELDS = ("source", "parent", "name", "target_tp")


def render_destination(template: str, source: str, target_tp: int | str | None, **extra: Any) -> str:
    """Fill a destination template; fields: ``{source}`` (URL without a trailing slash),
    ``{parent}`` (its folder), ``{name}`` (its last component), ``{target_tp}``, plus ``extra``."""
    src = source.rstrip("/")
    scheme, sep, path = src.rpartition("://")
    head, _, name = (path if sep else src).rpartition("/")
    parent = f"{scheme}{sep}{head}" if sep else head
    values = {"source": src, "parent": parent, "name": name, "target_tp": target_tp, **extra}
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError) as exc:
        from reshard.core.errors import LayoutError

        raise LayoutError(f"bad destination template {template!r} ({exc!r})", culprit="destination",
                          hint=f"use only the fields {', '.join('{' + f + '}' for f in values)}") from None


@flow(name="reshard", validate_parameters=True, task_runner=ThreadPoolTaskRunner(max_workers=4))
def reshard_deployment(
    source: str,
    target_tp: int | None,
    destination: str = DEFAULT_DESTINATION,
    storage_options: dict[str, Any] | None = None,
    target_pp: int | None = None,
    target_vpp: int | None = None,
    target_first_stage_layers: int | None = None,
    target_last_stage_layers: int | None = None,
    target_pipeline_layout: str | None = None,
    target_ep: int | None = None,
    target_etp: int | None = None,
    quantize: bool | Literal["int8", "fp8", "mxfp4", "w4a16", "fp8-channel", "nvfp4", "like-source"] | None = None,
    quantize_like: str | None = None,
    fp8_block: str | list[int] | None = None,
    group_size: int | None = None,
    bits: int = 8,
    groups: int = 64,
    mlp_extra_grouping: bool = True,
    version: float | None = None,
    num_heads: int | None = None,
    num_query_groups: int | None = None,
    swiglu: bool | None = None,
    vocab_size: int | None = None,
    make_vocab_size_divisible_by: int | None = None,
    hf_model_config: dict[str, Any] | None = None,
    normalization: str | None = None,
    position_embedding_type: str | None = None,
    rotary_base: float | None = None,
    norm_epsilon: float | None = None,
    to: str | None = None,
    merge_adapter: str | None = None,
    hf_architecture: str | None = None,
    max_shard_size: str | int | None = None,
    weights: str = "module",
    module_key: str = "auto",
    overwrite: bool = False,
    device: str | None = None,
    target_config: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_sources: bool = False,
    gpu_resource: bool = False,
    gpu_concurrency_limit: str | None = None,
) -> ConversionResult:
    """Reshard ``source`` to ``target_tp`` (flat parameters; see ``ReshardParams`` for each)."""
    fields = dict(locals())  # exactly the parameters (first statement)
    from reshard.flows.reshard_flow import reshard_flow

    fields["destination"] = render_destination(destination, source, target_tp if target_tp is not None else to)
    fields["storage_options"] = storage_options or {}
    return reshard_flow.fn(ReshardParams(**fields))
