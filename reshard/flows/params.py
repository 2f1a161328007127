"""The ``reshard`` flow's parameters: one pydantic model (what a deployment or event fills in)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from reshard.core.options import ReshardOptions

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


class ReshardParams(ReshardOptions):
    """Everything a conversion needs: the options (:class:`~reshard.core.options.ReshardOptions`,
    the only fields that change the output bytes) plus where to read and write, and how to run."""

    source: str = Field(description="checkpoint folder or descriptor JSON URL (s3://, gs://, file path, ...)")
    destination: str = Field(description="output folder URL; must not hold a different committed checkpoint")
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="fsspec options (endpoint_url, region_name, ...)")
    overwrite: bool = False
    device: str | None = Field(default=None, description="torch device; default cuda when present, else cpu")
    target_config: dict[str, Any] | None = Field(default=None, description="DeepSpeed config of the loading job")
    cache_dir: str | None = Field(default=None, description="shard cache folder (default ~/.cache/reshard)")
    cache_sources: bool = Field(default=False, description="fetch a remote source's shards whole into the cache "
                                "(default: read them range by range while converting, only their structure cached)")
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
        """The core's options (this model's option fields)."""
        return ReshardOptions(**self.to_record())
