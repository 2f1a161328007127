"""A fault-injecting HTTP reverse proxy for S3 tests.

``FaultProxy(upstream_url)`` listens on 127.0.0.1:<free port> and forwards every request to
``upstream_url`` with the request line, ``Host`` header and all end-to-end headers unchanged
(so SigV4 signatures still verify; only hop-by-hop ``Connection``/``Keep-Alive``/``Expect``
are dropped, none of which botocore signs).  Request bodies are streamed (``Content-Length``
or ``Transfer-Encoding: chunked`` relayed verbatim, which covers ``aws-chunked``); response
bodies are streamed back.  Every response carries ``Connection: close`` (one request per
client connection), which keeps the proxy simple and makes faults per-request.

At runtime (thread-safe)::

    proxy.set_fault("503", every=2, method="GET", path=r"/bucket/", max_faults=None)
    proxy.clear_fault()
    with proxy.faulting("reset", every=3): ...       # set, then clear on exit

Fault kinds (``FAULT_KINDS``):

``"503"``      drain the request body, answer 503 with an S3 XML error (Code ``SlowDown``)
``"500"``      drain the request body, answer 500 with Code ``InternalError``
``"reset"``    drain the request body, then abort the client connection with a TCP RST
               (SO_LINGER 0) and no response.  ``reset_after_upstream=True`` forwards the
               request first (the upstream *does* apply it) and resets instead of relaying
               the response: a "lost ack".
``"truncate"`` forward; relay the upstream status and headers (full ``Content-Length``) but
               only ``truncate_fraction`` (default half) of the body, then close (FIN).
               A response without a body passes unchanged and counts as ``truncate_noop``.
``"latency"``  sleep ``latency_s`` seconds, then forward normally.

Only requests that match the optional filter count towards "every Nth": ``method`` (a name
or a collection of names), ``path`` (regex searched in the raw request target, query
included) and ``predicate(method, target, headers) -> bool``.  The Nth, 2Nth, ... matching
requests get the fault (``start=1`` shifts that to the 1st, (N+1)th, ...), until
``max_faults`` faults have been injected.

``proxy.stats()`` -> ``{"requests", "matched", "faults", "by_kind", "truncate_noop",
"upstream_errors"}``; ``proxy.records`` is a bounded deque of per-request dicts (method,
target, fault, status, a few framing headers) for inspection.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import http.server
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable

__all__ = ["FaultProxy", "FAULT_KINDS"]

FAULT_KINDS = ("503", "500", "reset", "truncate", "latency")

_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "upgrade", "te"}
_RESP_DROP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
_LOG_HEADERS = ("content-length", "transfer-encoding", "content-encoding", "expect",
                "x-amz-content-sha256", "x-amz-decoded-content-length", "x-amz-trailer",
                "range")
_BUF = 1 << 16

_ERRORS = {
    "503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError",
            "We encountered an internal error. Please try again."),
}


class _Fault:
    __slots__ = ("kind", "every", "start", "method", "path", "predicate", "latency_s",
                 "max_faults", "truncate_fraction", "reset_after_upstream")

    def __init__(self, kind, every, start, method, path, predicate, latency_s, max_faults,
                 truncate_fraction, reset_after_upstream):
        kind = str(kind)
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {FAULT_KINDS}")
        if every < 1:
            raise ValueError("every must be >= 1")
        self.kind, self.every = kind, int(every)
        self.start = self.every if start is None else int(start)
        if self.start < 1:
            raise ValueError("start must be >= 1")
        if method is None:
            self.method = None
        elif isinstance(method, str):
            self.method = {method.upper()}
        else:
            self.method = {m.upper() for m in method}
        self.path = re.compile(path) if isinstance(path, str) else path
        self.predicate = predicate
        self.latency_s = float(latency_s)
        self.max_faults = max_faults
        self.truncate_fraction = float(truncate_fraction)
        self.reset_after_upstream = bool(reset_after_upstream)

    def matches(self, method: str, target: str, headers) -> bool:
        if self.method is not None and method.upper() not in self.method:
            return False
        if self.path is not None and not self.path.search(target):
            return False
        if self.predicate is not None and not self.predicate(method, target, headers):
            return False
        return True


class FaultProxy:
    """Threaded reverse proxy in front of ``upstream_url`` with runtime-configurable faults."""

    def __init__(self, upstream_url: str, *, host: str = "127.0.0.1", port: int = 0,
                 upstream_timeout: float = 120.0, client_timeout: float = 120.0,
                 max_records: int = 2000):
        u = urllib.parse.urlsplit(upstream_url)
        if u.scheme != "http":
            raise ValueError("only http:// upstreams are supported")
        self.upstream_url = upstream_url
        self.upstream_host = u.hostname
        self.upstream_port = u.port or 80
        self.upstream_timeout = upstream_timeout
        self.client_timeout = client_timeout
        self._bind = (host, port)
        self._lock = threading.Lock()
        self._fault: _Fault | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.records: collections.deque = collections.deque(maxlen=max_records)
        self.endpoint_url: str | None = None
        self.reset_counters()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FaultProxy:
        if self._server is not None:
            return self
        self._server = _Server(self._bind, _Handler)
        self._server.proxy = self
        host, port = self._server.server_address[:2]
        self.endpoint_url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name=f"faultproxy-{port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self._server = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ configuration
    def set_fault(self, kind: str | int, every: int = 1, *, start: int | None = None,
                  method: str | Iterable[str] | None = None, path: str | None = None,
                  predicate: Callable[[str, str, object], bool] | None = None,
                  latency_s: float = 1.0, max_faults: int | None = None,
                  truncate_fraction: float = 0.5, reset_after_upstream: bool = False,
                  reset_counters: bool = True) -> FaultProxy:
        """Inject ``kind`` into every ``every``-th matching request (see module docstring).

        The matching requests numbered ``start, start+every, start+2*every, ...`` (1-based;
        ``start`` defaults to ``every``) are faulted, at most ``max_faults`` of them.
        ``reset_counters`` (default) zeroes the counters so numbering starts afresh.
        """
        fault = _Fault(kind, every, start, method, path, predicate, latency_s, max_faults,
                       truncate_fraction, reset_after_upstream)
        with self._lock:
            self._fault = fault
            if reset_counters:
                self._reset_counters_locked()
        return self

    def clear_fault(self) -> None:
        with self._lock:
            self._fault = None

    @contextlib.contextmanager
    def faulting(self, kind, every: int = 1, **kw):
        self.set_fault(kind, every, **kw)
        try:
            yield self
        finally:
            self.clear_fault()

    def reset_counters(self) -> None:
        with self._lock:
            self._reset_counters_locked()

    def _reset_counters_locked(self) -> None:
        self._requests = self._matched = self._faults = 0
        self._by_kind: collections.Counter = collections.Counter()
        self._truncate_noop = 0
        self._upstream_errors = 0

    def stats(self) -> dict:
        with self._lock:
            return {"requests": self._requests, "matched": self._matched,
                    "faults": self._faults, "by_kind": dict(self._by_kind),
                    "truncate_noop": self._truncate_noop,
                    "upstream_errors": self._upstream_errors}

    @property
    def requests_seen(self) -> int:
        return self.stats()["requests"]

    @property
    def faults_injected(self) -> int:
        return self.stats()["faults"]

    # ------------------------------------------------------------------ internals
    def _decide(self, method: str, target: str, headers) -> _Fault | None:
        with self._lock:
            self._requests += 1
            f = self._fault
            if f is None or not f.matches(method, target, headers):
                return None
            self._matched += 1
            k = self._matched
            if k < f.start or (k - f.start) % f.every:
                return None
            if f.max_faults is not None and self._faults >= f.max_faults:
                return None
            self._faults += 1
            self._by_kind[f.kind] += 1
            return f

    def _note(self, **kw) -> None:
        with self._lock:
            if kw.pop("truncate_noop", False):
                self._truncate_noop += 1
                self._faults -= 1
                self._by_kind["truncate"] -= 1
            if kw.pop("upstream_error", False):
                self._upstream_errors += 1


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    proxy: FaultProxy

    def handle_error(self, request, client_address):  # client went away etc.: stay quiet
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self):
        self.timeout = self.server.proxy.client_timeout
        super().setup()

    def log_message(self, *args):  # silence stderr access log
        pass

    # every method goes through _proxy
    def _proxy(self):
        proxy = self.server.proxy
        self.close_connection = True
        method, target = self.command, self.path
        rec = {"method": method, "target": target, "fault": None, "status": None,
               **{h: self.headers[h] for h in _LOG_HEADERS if h in self.headers}}
        proxy.records.append(rec)
        fault = proxy._decide(method, target, self.headers)
        kind = fault.kind if fault else None
        rec["fault"] = kind

        if kind == "latency":
            time.sleep(fault.latency_s)
        if kind in ("503", "500"):
            self._read_body(None)
            rec["status"] = self._send_error_xml(kind, target)
            return
        if kind == "reset" and not fault.reset_after_upstream:
            self._read_body(None)
            self._reset()
            rec["status"] = "reset"
            return

        try:
            up = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port,
                                            timeout=proxy.upstream_timeout)
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in _HOP:
                    up.putheader(k, v)
            up.putheader("Connection", "close")
            up.endheaders()
            self._read_body(up.sock)
            resp = up.getresponse()
        except (OSError, http.client.HTTPException) as e:
            proxy._note(upstream_error=True)
            rec["status"] = f"upstream error: {e!r}"
            try:
                self._send_simple(502, "Bad Gateway", b"")
            except OSError:
                pass
            return
        try:
            if kind == "reset":  # reset_after_upstream: upstream applied it, client never hears
                resp.read()
                self._reset()
                rec["status"] = "reset-after-upstream"
                return
            rec["status"] = resp.status
            self._relay_response(resp, fault if kind == "truncate" else None, rec)
        finally:
            up.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _proxy

    # ---- request body: relay verbatim (or drain when sink is None)
    def _read_body(self, sink: socket.socket | None) -> None:
        send = sink.sendall if sink is not None else (lambda b: None)
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        rfile = self.rfile
        if "chunked" in te:
            while True:
                line = rfile.readline(65537)
                if not line:
                    raise ConnectionError("client closed mid chunked body")
                send(line)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers up to the empty line
                        t = rfile.readline(65537)
                        send(t)
                        if t in (b"\r\n", b"\n", b""):
                            return
                self._copy(size, send)
                send(rfile.readline(65537))  # CRLF after the chunk data
        else:
            n = int(self.headers.get("Content-Length") or 0)
            self._copy(n, send)

    def _copy(self, n: int, send) -> None:
        while n > 0:
            b = self.rfile.read(min(n, _BUF))
            if not b:
                raise ConnectionError("client closed mid body")
            send(b)
            n -= len(b)

    # ---- responses
    def _relay_response(self, resp: http.client.HTTPResponse, fault: _Fault | None,
                        rec: dict) -> None:
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _RESP_DROP]
        has_body = self.command != "HEAD" and resp.status not in (204, 304) and \
            not 100 <= resp.status < 200
        length = resp.getheader("Content-Length")
        body_prefetched = None
        if fault is not None and has_body and length is None:
            body_prefetched = resp.read()  # chunked upstream: need the length to lie about it
            headers.append(("Content-Length", str(len(body_prefetched))))
            length = str(len(body_prefetched))
        limit = None
        if fault is not None:
            # decide (and count) before the client can see anything
            total = int(length) if has_body else 0
            if total == 0:
                self.server.proxy._note(truncate_noop=True)
                rec["fault"] = "truncate-noop"
                fault = None
            else:
                limit = int(total * fault.truncate_fraction)
                rec["status"] = f"{resp.status} truncated {limit}/{total}"
        out = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n"]
        out += [f"{k}: {v}\r\n" for k, v in headers]
        out.append("Connection: close\r\n\r\n")
        w = self.wfile
        w.write("".join(out).encode("latin-1"))
        if not has_body:
            return
        if body_prefetched is not None:
            w.write(body_prefetched[:limit])
            return
        sent = 0
        while limit is None or sent < limit:
            want = _BUF if limit is None else min(_BUF, limit - sent)
            b = resp.read(want)
            if not b:
                break
            w.write(b)
            sent += len(b)

    def _send_simple(self, status: int, reason: str, body: bytes,
                     ctype: str = "application/xml") -> None:
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        self.wfile.write(head if self.command == "HEAD" else head + body)

    def _send_error_xml(self, kind: str, target: str) -> int:
        status, reason, code, msg = _ERRORS[kind]
        resource = target.split("?", 1)[0]
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{msg}</Message>"
                f"<Resource>{resource}</Resource>"
                f"<RequestId>faultproxy-{time.monotonic_ns()}</RequestId></Error>").encode()
        self._send_simple(status, reason, body)
        return status

    def _reset(self) -> None:
        """Abort the client connection: SO_LINGER(on, 0) + close sends RST, not FIN."""
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        for f in (self.rfile, self.wfile):
            try:
                f.close()
            except OSError:
                pass
        sock.close()
