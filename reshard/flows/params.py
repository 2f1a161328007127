"""The ``reshard`` flow's parameters: one pydantic model (what a deployment or event fills in)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reshard.core.plan import ReshardOptions


#: Storage-option names that carry credentials. Flow parameters are stored in Prefect's
#: database and shown in its UI, so these are refused there (use the environment/profiles).
SECRET_OPTION_NAMES = frozenset({"secret", "password", "token", "session_token", "aws_secret_access_key",
                                 "aws_session_token", "account_key", "sas_token", "client_secret",
                                 "credentials", "connection_string"})


def find_secret_options(options: Any, path: str = "") -> list[str]:
    """Paths of credential-bearing entries in (nested) storage options."""
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            p = f"{path}.{k}" if path else str(k)
            if str(k).lower() in SECRET_OPTION_NAMES:
                found.append(p)
            found.extend(find_secret_options(v, p))
    return found


class ReshardParams(BaseModel):
    """Everything a conversion needs. Only ``options()`` fields change the output bytes."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="checkpoint folder or descriptor JSON URL (s3://, gs://, file path, ...)")
    destination: str = Field(description="output folder URL; must not hold a different committed checkpoint")
    target_tp: int = Field(ge=1, description="tensor-parallel degree of the output")
    quantize: bool = False
    bits: int = Field(default=8, ge=1, le=8)
    groups: int = Field(default=64, ge=1)
    mlp_extra_grouping: bool = True
    version: float | None = Field(default=None, description="override the checkpoint version (QKV layout)")
    num_heads: int | None = Field(default=None, ge=1)
    module_key: str = "auto"
    target_pp: int | None = Field(default=None, ge=1, description="pipeline stages of the output (default: as source)")
    num_query_groups: int | None = Field(default=None, ge=1)
    swiglu: bool | None = None
    vocab_size: int | None = Field(default=None, ge=1)
    make_vocab_size_divisible_by: int | None = Field(default=None, ge=1)
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="fsspec options (endpoint_url, key, secret, ...)")
    overwrite: bool = False
    device: str | None = Field(default=None, description="torch device; default cuda when present, else cpu")
    target_config: dict[str, Any] | None = Field(default=None, description="DeepSpeed config of the loading job")
    cache_dir: str | None = Field(default=None, description="shard cache folder (default ~/.cache/reshard)")
    gpu_resource: bool = Field(default=False,
                               description="annotate tensor tasks with the Dask resource GPU=1 (Dask runner)")
    gpu_concurrency_limit: str | None = Field(
        default=None, description="name of a Prefect global concurrency limit capping tensor tasks per GPU")

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, value: dict[str, Any]) -> dict[str, Any]:
        secrets = find_secret_options(value)
        if secrets:
            raise ValueError(f"storage option(s) {', '.join(secrets)} would be stored in Prefect's database and "
                             "UI as flow parameters; pass credentials through the environment "
                             "(e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or profiles instead")
        return value

    def options(self) -> ReshardOptions:
        """The core's options: every field of ReshardOptions, taken by name."""
        names = ReshardOptions.__dataclass_fields__
        return ReshardOptions(**{k: v for k, v in self.model_dump().items() if k in names})
