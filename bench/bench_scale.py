"""Scale out (issue 21): S3 -> S3 conversions on the tests' loopback SeaweedFS, measured for what
a worker needs of its own machine — peak RSS and peak local disk — as the model grows, the flow
against ``--direct``, and one Dask worker against two.

    python bench/bench_scale.py                 # 1x, 2x, 4x the 3 GB model (~25 minutes, ~40 GB of disk)
    python bench/bench_scale.py --sizes 6       # the 3 GB model only
    python bench/bench_scale.py --quick         # 41 MB sources: checks the benchmark runs
    python bench/bench_scale.py --deepseek      # issue 34's FP8 conversions, DeepSeek-V3 tensor sizes (~20 minutes)

Sources: ``make_source.py``'s fp16 TP 8 GPT at 6, 12 and 24 layers (2.97, 5.9, 11.8 GB), each
uploaded once (s3fs ``put``) to a bucket of its own; every conversion is TP 8 -> TP 2 into a
fresh bucket, deleted after, each run its own process with a fresh ``--cache-dir``. Per run: wall
time and peak RSS (``wait4``), and peak local disk — the allocated bytes (``st_blocks``) under
the run's cache folder (shard cache, work folders, Prefect results: everything reshard writes
locally), sampled every 20 ms. Methods:

* ``--direct``                 ``reshard run --direct s3://... s3://... --target-tp 2``
* flow                         ``reshard run`` (Prefect, embedded server), same conversion
* flow, Dask 1 / 2 workers     ``reshard run --dask-address`` to a scheduler with one, then two
                               ``dask worker`` processes (own HOME and cache each, 2 threads)

The outputs of every run are checked equal (sha256 from the manifests) to the first run's.
Results also go to ``bench/out/results_scale.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from bench_reshard import finish, log, machine, tool  # noqa: E402

TARGET_TP = 2


def allocated(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def measure(cmd: list[str], env: dict[str, str], watch: Path, logfile: Path) -> dict[str, Any]:
    """Wall time, peak RSS (wait4) and the peak of ``watch``'s allocated bytes while ``cmd`` runs."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], allocated(watch))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    with open(logfile, "ab") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n".encode())
        lf.flush()
        sampler.start()
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=lf, stderr=lf, env=env)
        _pid, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
    return {"wall": wall, "rss_mib": ru.ru_maxrss / 1024, "disk_mib": peak[0] / 2**20,
            "rc": os.waitstatus_to_exitcode(status)}


class Bench:
    def __init__(self, ns: argparse.Namespace) -> None:
        from s3server import SeaweedS3

        self.ns = ns
        self.work = ns.work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="scale-", dir=self.work))
        self.logfile = self.work / "bench_scale.log"
        self.logfile.write_text("")
        self.srv = SeaweedS3(start_timeout=60).start()
        log(f"weed mini on {self.srv.endpoint_url}, data in {self.srv.root}")
        self.client = self.srv.client()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_API_URL"))}
        self.env.update(AWS_ACCESS_KEY_ID=self.srv.access_key, AWS_SECRET_ACCESS_KEY=self.srv.secret_key,
                        AWS_DEFAULT_REGION=self.srv.region, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                        DO_NOT_TRACK="1", PREFECT_HOME=str(self.tmp / "prefect-home"))
        # a migrated database, as `make` leaves the default one (else the first run pays the migrations)
        subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                       env=self.env, check=True, capture_output=True)
        self.so = ["--storage-option", f"endpoint_url={self.srv.endpoint_url}",
                   "--storage-option", f"region_name={self.srv.region}"]
        self.cluster: list[subprocess.Popen] = []

    def bucket(self) -> str:
        return self.srv.make_bucket(f"b-{uuid.uuid4().hex[:12]}")

    def drop_bucket(self, name: str) -> None:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        for up in self.client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        self.client.delete_bucket(Bucket=name)

    def upload(self, src: Path) -> str:
        """``src`` into a new bucket, by a process of its own: this one stays small, as each
        measured command starts as its copy (``ru_maxrss`` counts the pages it forks with)."""
        b = self.bucket()
        t0 = time.perf_counter()
        code = ("import s3fs, sys, json; fs = s3fs.S3FileSystem(**json.loads(sys.argv[1])); "
                "fs.put(sys.argv[2] + '/', sys.argv[3] + '/', recursive=True)")
        subprocess.run([sys.executable, "-c", code, json.dumps(self.srv.storage_options()), str(src), f"{b}/ckpt"],
                       check=True)
        log(f"uploaded {src.name} in {time.perf_counter() - t0:.1f} s")
        return f"s3://{b}/ckpt"

    def manifest(self, bucket: str) -> dict[str, str]:
        body = self.client.get_object(Bucket=bucket, Key="out/reshard_manifest.json")["Body"].read()
        return {f["path"]: f["sha256"] for f in json.loads(body)["files"]}

    def convert(self, label: str, src_url: str, extra: list[str], env: dict[str, str] | None = None,
                target: tuple[str, ...] = ("--target-tp", str(TARGET_TP))) -> dict:
        b = self.bucket()
        cache = self.tmp / f"cache-{uuid.uuid4().hex[:8]}"
        cache.mkdir()
        try:
            subprocess.run(["sync"], check=False)
            cmd = tool("reshard") + ["run", src_url, f"s3://{b}/out", *target,
                                     "--cache-dir", str(cache), *self.so, *extra]
            r = measure(cmd, dict(env or self.env), cache, self.logfile)
            if r["rc"]:
                sys.exit(f"{label} failed (exit {r['rc']}):\n{self.logfile.read_text()[-3000:]}")
            r["files"] = self.manifest(b)
            log(f"{label:40s} {r['wall']:7.2f} s  {r['rss_mib']:6.0f} MiB RSS  {r['disk_mib']:8.1f} MiB local disk")
            return r
        finally:
            self.drop_bucket(b)
            shutil.rmtree(cache, ignore_errors=True)

    def start_cluster(self, workers: int) -> str:
        from prefect_server import free_port, spawn

        self.stop_cluster()
        port = free_port()
        dask = str(Path(sys.executable).parent / "dask")
        root = self.tmp / f"dask-{uuid.uuid4().hex[:6]}"
        root.mkdir()
        self.cluster.append(spawn([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                                  self.env, root / "scheduler.log"))
        for i in range(workers):
            home = root / f"w{i}"
            (home / "home").mkdir(parents=True)
            env = dict(self.env, HOME=str(home / "home"), RESHARD_CACHE_DIR=str(home / "cache"),
                       PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"))
            self.cluster.append(spawn([dask, "worker", f"tcp://127.0.0.1:{port}", "--no-nanny", "--nthreads", "2",
                                       "--no-dashboard", "--local-directory", str(home / "dask")], env,
                                      home / "worker.log"))
        from distributed import Client

        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):  # the scheduler is not up yet
                with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
                    if len(c.scheduler_info()["workers"]) == workers:
                        return f"tcp://127.0.0.1:{port}"
            if time.monotonic() > deadline:
                sys.exit("the Dask workers did not join")
            time.sleep(0.5)

    def stop_cluster(self) -> None:
        from prefect_server import stop

        for p in self.cluster:
            stop(p, grace=10)
        self.cluster = []

    def close(self) -> None:
        self.stop_cluster()
        self.srv.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def source(layers: int, quick: bool) -> Path:
    folder = HERE / "data" / (f"gpt_quick_l{layers}_tp8_fp16" if quick else f"gpt_h4096_l{layers}_tp8_fp16")
    if not (folder / ".complete").exists():
        cmd = [sys.executable, str(HERE / "make_source.py"), "--layers", str(layers), "--out", str(folder)]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True)
    return folder


#: ``--deepseek``: bench_fp8.py's DeepSeek-V3-shaped folders (layers, routed experts) and the conversions
#: of issue 34, each S3 -> S3 with ``--direct``: (label, source "bf16"/"fp8", target arguments).
DEEPSEEK_SIZES = [(2, 8), (4, 8), (2, 16)]
DEEPSEEK_CONVERSIONS = [("bf16 -> FP8 hf", "bf16", ("--to", "hf", "--quantize", "fp8")),
                        ("FP8 -> bf16 hf", "fp8", ("--to", "hf")),
                        ("FP8 -> TP 8 x EP 8", "fp8", ("--target-tp", "8", "--target-ep", "8"))]


def deepseek_rows(b: Bench, ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Peak RSS and peak local disk of the DeepSeek conversions as layers, then experts, double."""
    import bench_fp8

    shape = bench_fp8.QUICK_SHAPE if ns.quick else bench_fp8.DSV3_SHAPE
    rows = []
    sizes = [tuple(map(int, s.split("x"))) for s in ns.deepseek_size] if ns.deepseek_size else DEEPSEEK_SIZES
    conversions = [c for c in DEEPSEEK_CONVERSIONS if not ns.deepseek_conversion or c[0] in ns.deepseek_conversion]
    for layers, experts in sizes:
        where = argparse.Namespace(quick=ns.quick, data_dir=HERE / "data")
        folders = dict(zip(("bf16", "fp8"), bench_fp8.sources(where, layers, experts, shape)))
        urls = {k: b.upload(v) for k, v in folders.items()}
        for label, kind, target in conversions:
            r = b.convert(f"{layers} layers x {experts} experts: {label}", urls[kind], ["--direct"], target=target)
            nbytes = sum(f.stat().st_size for f in folders[kind].glob("*.safetensors"))
            rows.append({"layers": f"{layers} layers x {experts} experts", "bytes": nbytes,
                         "method": f"{label} (--direct)", **{k: r[k] for k in ("wall", "rss_mib", "disk_mib")}})
        for url in urls.values():
            b.drop_bucket(url[5:].split("/")[0])
    return rows


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    lines = ["| source | method | wall s | GB/s | peak RSS MiB | peak local disk MiB |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        size = r["layers"] if isinstance(r["layers"], str) else f"{r['layers']} layers"
        lines.append(f"| {size}, {r['bytes'] / 1e9:.2f} GB | {r['method']} | {r['wall']:.2f} | "
                     f"{r['bytes'] / 1e9 / r['wall']:.3f} | {r['rss_mib']:.0f} | {r['disk_mib']:.1f} |")
    if res.get("deepseek"):
        return "\n".join(lines)
    direct = [r for r in rows if r["method"] == "--direct"]
    if len(direct) > 1:
        base = direct[0]
        lines += ["", "As the model grows (--direct): " + ", ".join(
            f"{r['layers']} layers RSS {r['rss_mib'] / base['rss_mib'] - 1:+.1%}, disk "
            f"{r['disk_mib'] / base['disk_mib'] - 1:+.1%}" for r in direct[1:])]
    flow = [r for r in rows if r["method"] == "flow (embedded server)" and r["layers"] == direct[0]["layers"]]
    if direct and flow:
        lines.append(f"Flow vs --direct at {direct[0]['layers']} layers: {flow[0]['wall'] / direct[0]['wall']:.2f}x")
    one = [r for r in rows if r["method"] == "flow, Dask 1 worker"]
    two = [r for r in rows if r["method"] == "flow, Dask 2 workers"]
    if one and two:
        lines.append(f"Dask: 2 workers take {two[0]['wall'] / one[0]['wall']:.2f}x the time of 1")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[6, 12, 24], help="layers of each source")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-dask", action="store_true")
    ap.add_argument("--keep-sources", action="store_true", help="keep the generated local sources")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ap.add_argument("--deepseek", action="store_true",
                    help="instead: issue 34's FP8 conversions of bench_fp8.py's DeepSeek-V3-shaped folders, "
                         "as layers and experts double")
    ap.add_argument("--deepseek-size", action="append", default=None, metavar="LxE",
                    help="with --deepseek: only this source (layers x routed experts, e.g. 2x8; repeatable)")
    ap.add_argument("--deepseek-conversion", action="append", default=None,
                    choices=[c[0] for c in DEEPSEEK_CONVERSIONS], help="with --deepseek: only this conversion")
    ns = ap.parse_args(argv)
    t_start = time.perf_counter()
    b = Bench(ns)
    rows: list[dict[str, Any]] = []
    try:
        for n, layers in enumerate([] if ns.deepseek else ns.sizes):
            src = source(layers, ns.quick)
            nbytes = sum(f.stat().st_size for f in src.glob("*.pt"))
            url = b.upload(src)
            if not ns.keep_sources and not ns.quick:
                shutil.rmtree(src)  # the bucket holds it now: disk for the next size
            methods = [("--direct", ["--direct"], None)]
            if n == 0:
                methods.append(("flow (embedded server)", [], None))
                if not ns.no_dask:
                    methods += [("flow, Dask 1 worker", ["--dask-address", "@1"], None),
                                ("flow, Dask 2 workers", ["--dask-address", "@2"], None)]
            want = None
            for label, extra, env in methods:
                if extra[:1] == ["--dask-address"]:
                    extra = ["--dask-address", b.start_cluster(int(extra[1][1:]))]
                r = b.convert(f"{layers} layers: {label}", url, extra, env)
                b.stop_cluster()
                if want is None:
                    want = r["files"]
                elif r["files"] != want:
                    sys.exit(f"{label}: outputs differ from --direct's")
                rows.append({"layers": layers, "bytes": nbytes, "method": label,
                             **{k: r[k] for k in ("wall", "rss_mib", "disk_mib")}})
            b.drop_bucket(url[5:].split("/")[0])
        if ns.deepseek:
            rows = deepseek_rows(b, ns)
        res = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "rows": rows,
               "machine": machine(), "seconds": time.perf_counter() - t_start, "deepseek": ns.deepseek}
        finish(res, ns.work_dir / ("results_scale_deepseek.json" if ns.deepseek else "results_scale.json"), report)
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
