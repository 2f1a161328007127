"""Open any fsspec URL (plain path, ``file://``, ``s3://``, ``gs://``, ``az://``, ``memory://``).

Credentials and endpoints come from the usual places (environment, profiles) plus explicit
``storage_options``. Request-level retries stay in the storage client: for S3 we configure
botocore's retry mode and attempt count (unless the caller already did) and never retry
individual requests ourselves. Backend packages (s3fs, gcsfs, adlfs) are imported lazily by
fsspec only when their protocol is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.errors import ReshardError, StorageError

#: botocore retry policy applied to s3 unless the caller passes its own ``config_kwargs.retries``.
DEFAULT_S3_RETRIES: dict[str, Any] = {"max_attempts": 10, "mode": "standard"}

#: How long a garbage-collected S3 filesystem's finalizer waits for its client to close (only in a
#: thread that runs no event loop of its own, e.g. the main thread at exit; never blocks a loop).
CLIENT_CLOSE_WAIT_SECONDS = 1.0

_EXTRAS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
           "abfss": "adlfs"}


@dataclass(frozen=True)
class Location:
    """A filesystem plus a path on it; ``url`` is what the user gave (for messages)."""

    fs: Any
    path: str
    url: str

    @property
    def is_local(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return "file" in protocols or "local" in protocols

    def join(self, *names: str) -> str:
        return "/".join([self.path.rstrip("/"), *names])

    def child_url(self, *names: str) -> str:
        return "/".join([self.url.rstrip("/"), *names])


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _with_defaults(protocol: str, options: Mapping[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if protocol in ("s3", "s3a"):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", dict(DEFAULT_S3_RETRIES))
        opts["config_kwargs"] = cfg
        # listings must be fresh: identity (ETag, size) is read at discovery time
        opts.setdefault("use_listings_cache", False)
        opts.setdefault("skip_instance_cache", True)
    return opts


def close_client_on_its_loop(loop: Any, creator: Any) -> None:
    """Close an s3fs filesystem's aiobotocore client on ``loop``, the loop that created it.

    Installed as the filesystem's ``close_session`` (s3fs registers it as the instance's
    ``weakref.finalize`` callback). s3fs's own version schedules the close on whatever loop is
    *running in the thread where the garbage collector happens to free the filesystem*: in a
    process that also runs other event loops (Prefect's API/log/event threads, an ASGI server,
    a Dask worker) that is another loop, and aiohttp fails with "Future attached to a different
    loop", logged by asyncio as "Task exception was never retrieved". Here the close always
    runs on ``loop`` (fsspec's IO loop for every synchronous filesystem reshard opens).
    """
    if creator is None:
        return
    if loop is not None and loop.is_running() and not loop.is_closed():
        closing = creator.__aexit__(None, None, None)
        try:
            future = asyncio.run_coroutine_threadsafe(closing, loop)
        except RuntimeError:  # the loop closed meanwhile: close the sockets below
            closing.close()
        else:
            future.add_done_callback(_retrieve)
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # a plain thread (e.g. the main thread at exit): wait a little
                try:
                    future.result(timeout=CLIENT_CLOSE_WAIT_SECONDS)
                except (Exception, concurrent.futures.CancelledError):  # not closed in time, or failed
                    pass
            return
    try:  # no loop left to run the close (interpreter shutdown): close the sockets themselves
        creator._client._endpoint.http_session._connector._close()
    except Exception:  # best effort at shutdown: the process is going away with its sockets
        pass


def _retrieve(future: concurrent.futures.Future[Any]) -> None:
    """Mark a close's outcome as seen (an error closing a client at GC time is not reportable)."""
    if not future.cancelled():
        future.exception()


def _close_clients_on_their_loop(fs: Any) -> None:
    """Make an s3fs filesystem close its client(s) on their own loop (see
    :func:`close_client_on_its_loop`); other filesystems are left alone."""
    for each in (fs, getattr(fs, "fs", None)):  # the filesystem, or the one a caching wrapper wraps
        if type(each).__module__.split(".", 1)[0] == "s3fs" and hasattr(each, "close_session"):
            # an instance attribute: s3fs registers ``self.close_session`` as the finalizer when it connects
            each.close_session = close_client_on_its_loop


@functools.cache
def botocore_data_loader(data_path: str | None) -> Any:
    """The process's one botocore data loader for ``data_path`` (botocore's ``data_path`` setting).

    Why: every botocore session parses botocore's data files again when its first client is made
    (the endpoint rules, the partitions, the S3 service model: over a megabyte of JSON, about 0.1 s
    of CPU), and reshard opens a fresh filesystem, so a fresh session, for every location
    (``skip_instance_cache``: listings and identity are read fresh) — a flow's every task did that
    work again. The files never change while the process runs; the loader caches what it read."""
    from botocore.loaders import create_loader

    return create_loader(data_path)


def _share_botocore_data(fs: Any, url: str) -> None:
    """Give an s3fs filesystem that has no session yet the session s3fs would make (from the
    same keyword arguments), reading botocore's data through :func:`botocore_data_loader`.
    Credentials, region and configuration stay the session's own. A storage option neither s3fs
    nor botocore's session takes is refused here, by name, before anything is read."""
    for each in (fs, getattr(fs, "fs", None)):
        if type(each).__module__.split(".", 1)[0] == "s3fs" and getattr(each, "session", False) is None:
            import inspect

            from aiobotocore.session import AioSession

            kwargs = dict(getattr(each, "kwargs", {}))
            unknown = sorted(set(kwargs) - set(inspect.signature(AioSession).parameters))
            if unknown:
                raise StorageError(f"unknown storage option {', '.join(map(repr, unknown))}", culprit=url,
                                   hint="s3 takes s3fs.S3FileSystem's options: key, secret, token, endpoint_url, "
                                        "region_name, client_kwargs, config_kwargs, ...")
            session = AioSession(**kwargs)
            session.register_component("data_loader", botocore_data_loader(session.get_config_variable("data_path")))
            each.session = session


def open_location(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Location:
    """Resolve ``url`` into a :class:`Location`; a missing backend package is a clear error."""
    from fsspec.core import url_to_fs

    url = os.fspath(url)
    protocol = protocol_of(url)
    try:
        fs, path = url_to_fs(url, **_with_defaults(protocol, storage_options or {}))
    except ImportError as exc:
        pkg = _EXTRAS.get(protocol, protocol)
        raise StorageError(f"support for {protocol}:// is not installed ({exc})", culprit=url,
                           hint=f"pip install {pkg}") from None
    except ValueError as exc:
        raise StorageError(f"cannot open: {exc}", culprit=url, hint="check the URL and storage options") from None
    _close_clients_on_their_loop(fs)
    _share_botocore_data(fs, url)
    return Location(fs, path, url)


def parse_storage_options(items: list[str] | None) -> dict[str, Any]:
    """``["endpoint_url=http://...", "key=..."]`` -> storage options. ``endpoint_url`` and
    ``region_name`` go into ``client_kwargs`` (where s3fs expects them); values that parse as
    JSON numbers/booleans become those."""
    import json

    opts: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise StorageError(f"storage option {item!r} is not KEY=VALUE", culprit="--storage-option",
                               hint="e.g. --storage-option endpoint_url=http://127.0.0.1:9000")
        k, v = item.split("=", 1)
        try:
            value: Any = json.loads(v) if v[:1] in "0123456789-tfn[{" else v
        except json.JSONDecodeError:
            value = v
        if k in ("endpoint_url", "region_name"):
            opts.setdefault("client_kwargs", {})[k] = value
        else:
            opts[k] = value
    return opts


def describe_storage_error(exc: BaseException) -> str | None:
    """Map backend exceptions onto a short cause; None when it is not a storage failure."""
    if isinstance(exc, FileNotFoundError):
        return "no such bucket, prefix or object"
    if isinstance(exc, PermissionError):
        return "permission denied (check the credentials and their rights)"
    name = type(exc).__name__
    text = str(exc)
    for code, what in (("InvalidAccessKeyId", "unknown access key"),
                       ("SignatureDoesNotMatch", "wrong secret key"),
                       ("AccessDenied", "permission denied"),
                       ("NoSuchBucket", "no such bucket"),
                       ("InvalidBucketName", "invalid bucket name")):
        if code in text or code == name:
            return what
    if name in ("ClientError", "NoCredentialsError"):
        return text.splitlines()[0][:200] if text else name
    return None


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn backend exceptions into one :class:`StorageError` naming the URL (never the secret)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:  # backends raise many types; only known permanent failures are mapped
        what = None if is_transient_error(exc) else describe_storage_error(exc)
        if what is None:
            raise
        raise StorageError(what, culprit=url,
                           hint="check the URL, the credentials and --storage-option settings") from None


_TRANSIENT_NAMES = {
    "ConnectionError", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "TimeoutError",
    "IncompleteRead", "ResponseStreamingError", "ReadTimeoutError", "ConnectTimeoutError",
    "EndpointConnectionError", "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
}


def is_transient_error(exc: BaseException | None) -> bool:
    """True for network hiccups and verification failures after retries; False for bad input."""
    if exc is None:
        return False
    if isinstance(exc, StorageError):
        return exc.transient
    if isinstance(exc, ReshardError):
        return False
    if isinstance(exc, (PermissionError, FileNotFoundError)):
        return False
    if type(exc).__name__ in _TRANSIENT_NAMES or isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    # s3fs turns 5xx/throttling into OSError(EREMOTEIO/EBUSY/ETIMEDOUT) and keeps the ClientError as cause
    if isinstance(exc, OSError) and exc.errno in (errno.EREMOTEIO, errno.EBUSY, errno.ETIMEDOUT):
        return True
    text = str(exc)
    if any(code in text for code in ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                                     "503", "500 ")):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient_error(cause)
