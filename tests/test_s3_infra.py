"""The S3 test infrastructure itself: a real SeaweedFS server and the fault-injecting proxy.

Besides proving the helpers work, these tests pin down how s3fs / aiobotocore / aiohttp
react to each fault, which the resumable-upload design relies on:

* 503 SlowDown / 500 InternalError: retried by botocore's standard retry mode (status 500,
  502, 503, 504 are transient).  NB ``retries={"max_attempts": N}`` means N *retries*
  (``total_max_attempts`` = N + 1); ``max_attempts=0`` disables botocore retries.
* reset (RST, no response): aiohttp itself silently re-sends an idempotent request
  (GET/HEAD/PUT/DELETE/OPTIONS/TRACE) once on ClientOSError/ServerDisconnectedError;
  POST (CreateMultipartUpload / CompleteMultipartUpload) is not re-sent by aiohttp and, with
  botocore retries off, surfaces as ``botocore.exceptions.EndpointConnectionError``
  ("Could not connect ...", although the connection was made).  With botocore retries on,
  botocore retries it (ConnectionError is transient).
* truncate (full Content-Length, half the body, FIN): always detected, never silently
  short.  aiohttp raises ``aiohttp.ClientPayloadError`` (ContentLengthError) from
  ``Body.read()`` before botocore's own length check (IncompleteReadError) can run.  s3fs
  retries that itself (``S3_RETRYABLE_ERRORS``, up to ``fs.retries``) in cat_file, the
  buffered-file fetch used by ``open().read()``, and get_file (which resumes with a Range
  from the bytes already written); botocore's retry setting plays no part (the body is
  read after botocore's retry loop).  When every attempt is truncated, the
  ClientPayloadError propagates out of s3fs unchanged (get_file leaves a partial file).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import time
import urllib.parse
import uuid

import aiohttp  # noqa: E402
import botocore.exceptions  # noqa: E402
import pytest
import s3fs  # noqa: E402  (required test dependency)

from faultproxy import FaultProxy  # noqa: E402

MB = 1 << 20
RETRY_CFG = {"retries": {"max_attempts": 10, "mode": "standard"}}


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p


@pytest.fixture(scope="module")
def blob20():
    return os.urandom(20 * MB)


def _bucket(url: str) -> str:
    return url.removeprefix("s3://")


def _fs(s3_server, endpoint_url=None, **kw):
    return s3fs.S3FileSystem(**s3_server.storage_options(endpoint_url=endpoint_url,
                                                         skip_instance_cache=True, **kw))


def _proxied_fs(s3_server, proxy, retries=RETRY_CFG, **kw):
    return _fs(s3_server, proxy.endpoint_url, config_kwargs=dict(retries), **kw)


def _raw(url: str, method: str = "GET", body: bytes | None = None, headers=None,
         chunked: bool = False):
    """One raw http.client request; returns (status, headers, body) or raises."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        target = u.path + (f"?{u.query}" if u.query else "")
        conn.request(method, target, body=body, headers=headers or {},
                     encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


# ---------------------------------------------------------------------------- the server
def test_server_put_get_list(s3_server, s3_bucket):
    assert s3_server.startup_s is not None and s3_server.startup_s < 30
    fs = _fs(s3_server)
    data = os.urandom(3 * MB + 17)
    fs.pipe(f"{s3_bucket}/dir/a.bin", data)
    fs.pipe(f"{s3_bucket}/dir/b.txt", b"hello")
    assert fs.cat_file(f"{s3_bucket}/dir/a.bin") == data
    assert sorted(fs.ls(f"{s3_bucket}/dir", detail=False)) == [
        f"{_bucket(s3_bucket)}/dir/a.bin", f"{_bucket(s3_bucket)}/dir/b.txt"]
    assert fs.info(f"{s3_bucket}/dir/a.bin")["size"] == len(data)
    fs.rm(f"{s3_bucket}/dir/b.txt")
    assert not fs.exists(f"{s3_bucket}/dir/b.txt")


def test_buckets_are_fresh_and_isolated(s3_server, s3_bucket):
    fs = _fs(s3_server)
    assert fs.ls(s3_bucket, refresh=True) == []


def test_wrong_secret_is_permission_error(s3_server, s3_bucket):
    fs = _fs(s3_server, secret="not-the-secret")
    with pytest.raises(PermissionError, match="signature"):
        fs.ls(s3_bucket, refresh=True)
    # underneath: a botocore ClientError with code SignatureDoesNotMatch (403)
    client = s3_server.client()
    client._request_signer._credentials.secret_key = "not-the-secret"  # noqa: SLF001
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        client.list_objects_v2(Bucket=_bucket(s3_bucket))
    assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_unknown_access_key_is_permission_error(s3_server, s3_bucket):
    fs = _fs(s3_server, key="nobody", secret="x")
    with pytest.raises(PermissionError):
        fs.ls(s3_bucket, refresh=True)


def test_read_only_key_reads_but_cannot_write(s3_server, s3_bucket):
    _fs(s3_server).pipe(f"{s3_bucket}/k", b"payload")
    ro = s3fs.S3FileSystem(**s3_server.storage_options(read_only=True, skip_instance_cache=True))
    assert ro.cat_file(f"{s3_bucket}/k") == b"payload"
    assert ro.ls(s3_bucket, detail=False) == [f"{_bucket(s3_bucket)}/k"]
    with pytest.raises(PermissionError, match="Access Denied"):
        ro.pipe(f"{s3_bucket}/new", b"x")
    with pytest.raises(PermissionError):
        ro.rm_file(f"{s3_bucket}/k")  # DeleteObject -> AccessDenied -> PermissionError
    # SURPRISE: fs.rm uses DeleteObjects, whose per-key <Error>s s3fs ignores: no exception
    ro.rm(f"{s3_bucket}/k")
    assert _fs(s3_server).exists(f"{s3_bucket}/k")
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        s3_server.client(read_only=True).put_object(Bucket=_bucket(s3_bucket), Key="n", Body=b"x")
    assert ei.value.response["Error"]["Code"] == "AccessDenied"
    assert _fs(s3_server).cat_file(f"{s3_bucket}/k") == b"payload"


def test_storage_options_merge(s3_server):
    o = s3_server.storage_options(config_kwargs={"retries": {"max_attempts": 3}},
                                  endpoint_url="http://127.0.0.1:1")
    assert o["config_kwargs"] == {"s3": {"addressing_style": "path"},
                                  "retries": {"max_attempts": 3}}
    assert o["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:1",
                                  "region_name": "us-east-1"}
    assert (o["key"], o["secret"]) == (s3_server.access_key, s3_server.secret_key)


# ---------------------------------------------------------------- the proxy, raw requests
@pytest.fixture
def presigned(s3_server, s3_bucket, proxy):
    """(get_url, put_url, body) for an object, presigned against the proxy's address."""
    bucket = _bucket(s3_bucket)
    body = os.urandom(256 * 1024 + 3)
    s3_server.client().put_object(Bucket=bucket, Key="obj", Body=body)
    c = s3_server.client(endpoint_url=proxy.endpoint_url)
    get = c.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "obj"})
    put = c.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "up"})
    return get, put, body


def test_proxy_passthrough_and_counters(proxy, presigned, s3_server, s3_bucket):
    get, put, body = presigned
    assert _raw(get)[::2] == (200, body)
    status, _, _ = _raw(put, "PUT", body=b"x" * 100_000)
    assert status == 200
    # a chunked request body is relayed verbatim
    status, _, _ = _raw(put, "PUT", body=iter([b"a" * 70_000, b"b" * 5, b"c" * 1]),
                        chunked=True)
    assert status == 200
    got = s3_server.client().get_object(Bucket=_bucket(s3_bucket), Key="up")["Body"].read()
    assert got == b"a" * 70_000 + b"bbbbb" + b"c"
    st = proxy.stats()
    assert st["requests"] == 3 and st["faults"] == 0
    assert proxy.records[-1]["transfer-encoding"] == "chunked"


@pytest.mark.parametrize("kind,code", [("503", "SlowDown"), ("500", "InternalError")])
def test_proxy_error_status(proxy, presigned, kind, code):
    get, put, body = presigned
    proxy.set_fault(kind, every=2)
    results = [_raw(get) for _ in range(4)]
    assert [r[0] for r in results] == [200, int(kind), 200, int(kind)]
    assert results[0][2] == body
    assert f"<Code>{code}</Code>".encode() in results[1][2]
    # the request body of a faulted PUT is drained before answering
    assert _raw(put, "PUT", body=b"z" * 3 * MB)[0] == 200
    assert _raw(put, "PUT", body=b"z" * 3 * MB)[0] == int(kind)
    assert proxy.stats() | {"by_kind": None} == {
        "requests": 6, "matched": 6, "faults": 3, "by_kind": None, "truncate_noop": 0,
        "upstream_errors": 0}
    assert proxy.faults_injected == 3 and proxy.requests_seen == 6


def test_proxy_reset(proxy, presigned):
    get, _, body = presigned
    proxy.set_fault("reset", every=2)
    assert _raw(get)[2] == body
    with pytest.raises(ConnectionResetError):
        _raw(get)
    assert _raw(get)[2] == body
    assert proxy.stats()["by_kind"] == {"reset": 1}


def test_proxy_reset_after_upstream_applies_the_request(proxy, presigned, s3_server, s3_bucket):
    _, put, _ = presigned
    proxy.set_fault("reset", every=1, reset_after_upstream=True)
    with pytest.raises(ConnectionResetError):
        _raw(put, "PUT", body=b"applied")
    got = s3_server.client().get_object(Bucket=_bucket(s3_bucket), Key="up")["Body"].read()
    assert got == b"applied"


def test_proxy_truncate(proxy, presigned):
    get, _, body = presigned
    proxy.set_fault("truncate", every=2, method="GET")
    assert _raw(get)[2] == body
    with pytest.raises(http.client.IncompleteRead) as ei:
        _raw(get)
    assert ei.value.partial == body[: len(body) // 2]
    assert ei.value.expected == len(body) - len(body) // 2
    assert _raw(get)[2] == body
    assert proxy.stats()["by_kind"] == {"truncate": 1}


def test_proxy_truncate_noop_on_bodiless(proxy, s3_server, s3_bucket):
    bucket = _bucket(s3_bucket)
    s3_server.client().put_object(Bucket=bucket, Key="h", Body=b"12345")
    c = s3_server.client(endpoint_url=proxy.endpoint_url)
    proxy.set_fault("truncate", every=1)
    assert c.head_object(Bucket=bucket, Key="h")["ContentLength"] == 5
    st = proxy.stats()
    assert (st["faults"], st["truncate_noop"]) == (0, 1)


def test_proxy_latency(proxy, presigned):
    get, _, body = presigned
    proxy.set_fault("latency", every=1, latency_s=0.6, path=r"/obj\?")
    t = time.monotonic()
    assert _raw(get)[2] == body
    assert time.monotonic() - t >= 0.6
    proxy.set_fault("latency", every=1, latency_s=5, path=r"/nomatch")
    t = time.monotonic()
    assert _raw(get)[2] == body
    assert time.monotonic() - t < 2
    assert proxy.stats()["matched"] == 0


def test_proxy_filters_and_max_faults(proxy, presigned):
    get, put, body = presigned
    proxy.set_fault("503", every=1, method="PUT", max_faults=1)
    assert _raw(get)[0] == 200
    assert _raw(put, "PUT", body=b"1")[0] == 503
    assert _raw(put, "PUT", body=b"1")[0] == 200
    assert proxy.stats()["requests"] == 3 and proxy.stats()["matched"] == 2
    proxy.set_fault("500", every=3, start=1,
                    predicate=lambda m, target, headers: m == "GET")
    assert [_raw(get)[0] for _ in range(5)] == [500, 200, 200, 500, 200]
    proxy.clear_fault()
    assert _raw(get)[0] == 200
    with proxy.faulting("503"):
        assert _raw(get)[0] == 503
    assert _raw(get)[0] == 200


def test_proxy_stop_releases_port(s3_server):
    p = FaultProxy(s3_server.endpoint_url).start()
    port = urllib.parse.urlsplit(p.endpoint_url).port
    p.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---------------------------------------------------- s3fs through the proxy, 20 MB object
def _write_multipart(fs, path, data, part=5 * MB):
    with fs.open(path, "wb", block_size=part) as f:
        for i in range(0, len(data), part):
            f.write(data[i:i + part])


def _read_all_ways(fs, path, tmp_path):
    out = {"cat_file": fs.cat_file(path)}
    local = tmp_path / f"get-{uuid.uuid4().hex}"
    fs.get_file(path, str(local))
    out["get_file"] = local.read_bytes()
    with fs.open(path, "rb") as f:
        out["open.read"] = f.read()
    return out


@pytest.mark.parametrize("kind", ["503", "500", "reset"])
def test_s3fs_survives_fault_every_2(s3_server, s3_bucket, proxy, blob20, kind, tmp_path):
    fs = _proxied_fs(s3_server, proxy)
    digest = hashlib.sha256(blob20).digest()
    # start=1: the 1st, 3rd, 5th... request fails, so every operation's first try is hit
    proxy.set_fault(kind, every=2, start=1)
    fs.pipe(f"{s3_bucket}/single.bin", blob20)            # one PutObject
    _write_multipart(fs, f"{s3_bucket}/multi.bin", blob20)  # Create + 4 x UploadPart + Complete
    for name in ("single.bin", "multi.bin"):
        for how, got in _read_all_ways(fs, f"{s3_bucket}/{name}", tmp_path).items():
            assert hashlib.sha256(got).digest() == digest, (kind, name, how)
    st = proxy.stats()
    assert st["faults"] >= 10 and st["requests"] >= 2 * st["faults"], st
    proxy.clear_fault()
    assert _fs(s3_server).cat_file(f"{s3_bucket}/multi.bin") == blob20


def test_reset_on_post_without_botocore_retries_surfaces(s3_server, s3_bucket, proxy):
    """aiohttp re-sends idempotent requests once after a reset, but not POST."""
    fs = _proxied_fs(s3_server, proxy, retries={"retries": {"max_attempts": 0}})
    proxy.set_fault("reset", every=1, max_faults=1)
    fs.pipe(f"{s3_bucket}/put", b"x" * 1000)  # PUT: reset, aiohttp re-sends, fine
    assert proxy.stats()["requests"] == 2
    proxy.set_fault("reset", every=1, method="POST", max_faults=1)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        _write_multipart(fs, f"{s3_bucket}/mp", b"y" * (6 * MB))
    # with botocore retries, the same POST reset is retried
    fs = _proxied_fs(s3_server, proxy)
    proxy.set_fault("reset", every=1, method="POST", max_faults=2)
    _write_multipart(fs, f"{s3_bucket}/mp", b"y" * (6 * MB))
    assert proxy.stats()["faults"] == 2


def test_botocore_max_attempts_counts_retries(s3_server, s3_bucket, proxy):
    """retries={"max_attempts": N} is N retries, N+1 attempts in all."""
    bucket = _bucket(s3_bucket)
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    fs = _proxied_fs(s3_server, proxy, retries={"retries": {"max_attempts": 1,
                                                            "mode": "standard"}})
    proxy.set_fault("500", every=1, max_faults=1)
    r = fs.call_s3("head_object", Bucket=bucket, Key="k")
    assert r["ResponseMetadata"]["RetryAttempts"] == 1
    fs = _proxied_fs(s3_server, proxy, retries={"retries": {"max_attempts": 0}})
    proxy.set_fault("500", every=1, max_faults=1)
    with pytest.raises(OSError):  # s3fs maps the bare 500 on HEAD to OSError(EREMOTEIO)
        fs.call_s3("head_object", Bucket=bucket, Key="k")


@pytest.mark.parametrize("how", ["cat_file", "cat_file_range", "get_file", "open.read"])
def test_s3fs_truncated_body_is_detected(s3_server, s3_bucket, proxy, blob20, how, tmp_path):
    path = f"{s3_bucket}/t.bin"
    _fs(s3_server).pipe(path, blob20)
    fs = _proxied_fs(s3_server, proxy)
    fs.retries = 3  # s3fs's own retry count for retryable errors (default 5)

    def read():
        if how == "cat_file":
            return fs.cat_file(path)
        if how == "cat_file_range":
            return fs.cat_file(path, start=0, end=len(blob20))
        if how == "get_file":
            local = tmp_path / "t.bin"
            fs.get_file(path, str(local))
            return local.read_bytes()
        with fs.open(path, "rb") as f:
            return f.read()

    # one truncated GET: s3fs retries it itself and returns the right bytes
    proxy.set_fault("truncate", every=1, method="GET", max_faults=1)
    assert read() == blob20
    assert proxy.stats()["faults"] == 1
    # every GET truncated: the short body is never returned silently
    proxy.set_fault("truncate", every=1, method="GET")
    with pytest.raises(aiohttp.ClientPayloadError, match="Not enough data"):
        read()
    assert proxy.stats()["faults"] == 3  # == fs.retries attempts
    if how == "get_file":  # resumed with Range requests from the bytes already written
        ranges = [r.get("range") for r in list(proxy.records)[-3:]]
        assert ranges[0] is None and ranges[1] == f"bytes={10 * MB}-" \
            and ranges[2] == f"bytes={15 * MB}-", ranges


def test_botocore_body_read_raises_client_payload_error(s3_server, s3_bucket, proxy):
    """The raw streaming body: aiohttp's ContentLengthError, not botocore IncompleteReadError."""
    bucket = _bucket(s3_bucket)
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"0123456789" * 1000)
    fs = _proxied_fs(s3_server, proxy)
    proxy.set_fault("truncate", every=1, method="GET")

    async def go():
        resp = await fs._call_s3("get_object", Bucket=bucket, Key="k")  # noqa: SLF001
        try:
            return await resp["Body"].read()
        finally:
            resp["Body"].close()

    from fsspec.asyn import sync

    with pytest.raises(aiohttp.ClientPayloadError) as ei:
        sync(fs.loop, go)
    assert "received 5000 of 10000 bytes" in str(ei.value)
    assert not isinstance(ei.value, botocore.exceptions.BotoCoreError)


def test_s3fs_latency_with_read_timeout(s3_server, s3_bucket, proxy):
    """A response slower than read_timeout is a ReadTimeoutError, retried; the request was
    nevertheless forwarded (late) to the server."""
    path = f"{s3_bucket}/lat"
    _fs(s3_server).pipe(path, b"v" * 1000)
    fs = _fs(s3_server, proxy.endpoint_url,
             config_kwargs={"retries": {"max_attempts": 3, "mode": "standard"},
                            "read_timeout": 1})
    proxy.set_fault("latency", every=1, method="GET", latency_s=2.0, max_faults=1)
    t = time.monotonic()
    assert fs.cat_file(path) == b"v" * 1000
    assert 1.0 <= time.monotonic() - t < 10
    assert proxy.stats()["faults"] == 1 and proxy.stats()["matched"] == 2


def test_proxy_handles_concurrent_requests(s3_server, s3_bucket, proxy):
    fs = _proxied_fs(s3_server, proxy)
    objs = {f"{s3_bucket}/c/{i}": os.urandom(300_000 + i) for i in range(12)}
    fs.pipe(objs)  # s3fs issues these concurrently (asyncio.gather)
    proxy.set_fault("503", every=3)
    got = fs.cat(list(objs))
    assert {k.removeprefix("s3://"): v for k, v in objs.items()} == got
    assert proxy.stats()["faults"] >= 4
