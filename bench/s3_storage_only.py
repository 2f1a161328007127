"""reshard's storage layer alone, without the conversion: used by bench_s3.py (one process per run).

    python bench/s3_storage_only.py fetch  s3://src/ckpt  --cache-dir DIR [--storage-option K=V ...]
    python bench/s3_storage_only.py upload LOCALDIR s3://dst/ckpt --work-dir DIR [--no-commit]

``fetch``  = ``reshard.discovery.materialize`` through a cold ``ShardCache`` (discover,
concurrent ranged reads, size/MD5 verification, hard-linked view) — what ``reshard run`` does
before converting a remote source.

``upload`` = ``S3Destination``: acquire the writer lock, ``open``, ``publish`` every file of
LOCALDIR (hard-linked into the work folder; the sha256 is passed in, as the engine computes it
while writing, so no hashing here: each file goes up as an uncompleted multipart upload to its
final key), then ``commit`` (complete the uploads, manifest last). Variant ``stream``: each file
fed to ``open_stream`` in 8 MiB pieces instead, as a conversion's writer feeds it — what
``reshard run`` does to S3.

Variants (``--variant``) replace reshard's calls by plain s3fs calls with other part sizes or
concurrency, to see what the storage layer could reach; they never touch reshard/:

* fetch:  ``cache:CHUNK_MIB:THREADS:FILES``  a ShardCache(chunksize, max_concurrency) with FILES
  objects at a time (reshard: ``cache:32:8:4``); ``s3fs-get:CHUNK_MIB:CONC:FILES`` s3fs ``get_file``.
* upload: ``s3fs-put:CHUNK_MIB:CONC:FILES`` s3fs ``put_file`` straight to the final keys (no
  commit).

Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; ``--storage-option`` as for
``reshard run``. Prints one JSON line of phase timings on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _opts(items: list[str]) -> dict:
    from reshard.storage.location import parse_storage_options

    return parse_storage_options(items)


def fetch(ns: argparse.Namespace) -> dict:
    from reshard.discovery import discover, materialize
    from reshard.storage.cache import ShardCache
    from reshard.storage.location import open_location

    kind, *nums = ns.variant.split(":")
    chunk, conc, files = (int(n) for n in nums) if nums else (32, 8, 4)
    t0 = time.perf_counter()
    if kind == "reshard":
        cache = ShardCache(ns.cache_dir)
        local = materialize(ns.url, _opts(ns.storage_option), cache, cache.new_workdir("bench"))
        n, nbytes = len(local.objects), sum(o.size for o in local.objects)
    elif kind == "cache":  # the same code with other knobs
        cache = ShardCache(ns.cache_dir, chunksize=chunk << 20, max_concurrency=conc)
        disc = discover(ns.url, _opts(ns.storage_option))
        loc = open_location(ns.url, _opts(ns.storage_option))
        with ThreadPoolExecutor(max_workers=files) as pool:
            list(pool.map(lambda o: cache.fetch(loc, o), disc.objects))
        n, nbytes = len(disc.objects), sum(o.size for o in disc.objects)
    elif kind == "s3fs-get":
        disc = discover(ns.url, _opts(ns.storage_option))
        loc = open_location(ns.url, _opts(ns.storage_option))
        out = Path(ns.cache_dir)
        out.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=files) as pool:
            list(pool.map(lambda o: loc.fs.get_file(o.path, str(out / o.name), chunksize=chunk << 20,
                                                    max_concurrency=conc), disc.objects))
        n, nbytes = len(disc.objects), sum(o.size for o in disc.objects)
    else:
        raise SystemExit(f"unknown fetch variant {ns.variant!r}")
    return {"files": n, "bytes": nbytes, "fetch_s": time.perf_counter() - t0}


def upload(ns: argparse.Namespace) -> dict:
    from reshard.storage.destinations import open_destination
    from reshard.storage.location import open_location

    src = Path(ns.local)
    files = sorted(p for p in src.iterdir() if p.is_file() and p.name.endswith(".pt"))
    nbytes = sum(p.stat().st_size for p in files)
    kind, *nums = ns.variant.split(":")
    out: dict = {"files": len(files), "bytes": nbytes}
    t0 = time.perf_counter()
    streamed = kind == "stream"
    if kind in ("reshard", "stream"):
        if nums:  # reshard:PART_MIB:CONCURRENCY — the same code path with other multipart settings
            import reshard.storage.s3_destination as s3_destination

            s3_destination.UPLOAD_PART_BYTES, s3_destination.UPLOAD_CONCURRENCY = int(nums[0]) << 20, int(nums[1])
        work = Path(ns.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        dest = open_destination(ns.url, _opts(ns.storage_option), overwrite=False, workdir=work)
        dest.acquire(uuid.uuid4().hex, "bench")
        dest.open()
        t1 = time.perf_counter()
        names = [p.name for p in files]

        def publish(p: Path) -> dict:
            if streamed:  # what a conversion does: the file's bytes fed to the upload as they are written
                stream = dest.open_stream(p.name, p.stat().st_size)
                with open(p, "rb") as f:
                    while chunk := f.read(8 << 20):
                        stream.update(chunk)
                return stream.finish("0" * 64)
            os.link(p, dest.staged(p.name))  # publish unlinks its staged copy; the source stays
            return dest.publish(p.name, "0" * 64)

        # reshard:PART:CONC:FILES — FILES outputs published at once (as the flow's upload tasks do)
        with ThreadPoolExecutor(max_workers=int(nums[2]) if len(nums) > 2 else 1) as pool:
            records = list(pool.map(publish, files))
        t2 = time.perf_counter()
        out.update(setup_s=t1 - t0, publish_s=t2 - t1)
        if not ns.no_commit:
            dest.commit(names, {"files": records, "bench": True})
            out["commit_s"] = time.perf_counter() - t2
    elif kind == "s3fs-put":
        chunk, conc, nfiles = (int(n) for n in nums)
        loc = open_location(ns.url, _opts(ns.storage_option))
        with ThreadPoolExecutor(max_workers=nfiles) as pool:
            list(pool.map(lambda p: loc.fs.put_file(str(p), loc.join(p.name), chunksize=chunk << 20,
                                                    max_concurrency=conc), files))
        out["publish_s"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown upload variant {ns.variant!r}")
    out["total_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("url")
    f.add_argument("--cache-dir", required=True)
    u = sub.add_parser("upload")
    u.add_argument("local")
    u.add_argument("url")
    u.add_argument("--work-dir", required=True)
    u.add_argument("--no-commit", action="store_true")
    for p in (f, u):
        p.add_argument("--storage-option", action="append", default=[])
        p.add_argument("--variant", default="reshard")
    ns = ap.parse_args(argv)
    res = fetch(ns) if ns.cmd == "fetch" else upload(ns)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
