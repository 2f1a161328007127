"""The GPU worker pool on one machine (issue #37): the same conversions with ``--device cuda`` and
``--device cpu``, their outputs compared file by file (and tensor by tensor where they differ), the
throughput of each (GB/s of tensor bytes written), where a device's time goes for the arithmetic
(host-to-device copy, kernels, device-to-host copy), and one Prefect flow run with
``gpu_concurrency_limit`` whose tensor tasks must carry the ``reshard-gpu`` tag.

    python bench/gpu_check.py --work DIR [--quick]      # prints and writes DIR/gpu_check.json

Runs where there is no GPU too (only the CPU side, marked so): the script itself is exercised on
CPU before a GPU machine's minutes are spent on it. Conversions (each its own process, the source
warm): megatron-core per-rank TP 8 -> 2 (fp16, Llama-shaped); the same with ``--quantize int8``; a
bf16 Hugging Face folder with DeepSeek-V3's tensor sizes -> ``--to hf --quantize fp8``; its FP8
form -> ``--to hf`` (dequantized while read: on the CPU whatever the device, see the report).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_fp8  # noqa: E402
import bench_torch_dist  # noqa: E402


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-8:])} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


reshard = bench_torch_dist.reshard


def digests(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "reshard_manifest.json"):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        out[f.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def tensor_differences(a: Path, b: Path) -> list[dict[str, Any]]:
    """Which tensors differ between two outputs, and by how much (safetensors or torch.save files)."""
    import torch

    def tensors(folder: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(folder.rglob("*.safetensors")):
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                out |= {k: st.get_tensor(k) for k in st.keys()}
        for f in sorted(folder.rglob("*.pt")):
            from reshard.core.safe_load import load_shard

            sd = load_shard(f)  # weights-only, reshard's allowlist
            module = sd.get("model") or sd.get("module") or {}
            out |= {f"{f.parent.name}/{k}": v for k, v in module.items() if isinstance(v, torch.Tensor)}
        return out

    x, y = tensors(a), tensors(b)
    diffs = []
    for k in sorted(set(x) | set(y)):
        if k not in x or k not in y:
            diffs.append({"tensor": k, "only in": "cpu" if k in x else "cuda"})
            continue
        p, q = x[k], y[k]
        if p.dtype != q.dtype or p.shape != q.shape:
            diffs.append({"tensor": k, "cpu": f"{p.dtype} {list(p.shape)}", "cuda": f"{q.dtype} {list(q.shape)}"})
        elif not torch.equal(p.view(-1).view(torch.uint8), q.view(-1).view(torch.uint8)):
            pf, qf = p.float(), q.float()
            diffs.append({"tensor": k, "elements differing": int((pf != qf).sum()), "of": p.numel(),
                          "max abs difference": float((pf - qf).abs().max())})
    return diffs


def kernel_times(device: str) -> dict[str, Any]:
    """One DeepSeek-V3 expert weight (2048 x 7168 bf16) through each codec on ``device``: copy in,
    compute, copy out, each timed alone (medians of 5 after a warm-up)."""
    import statistics

    import torch

    from reshard.core.fp8_block import dequantize, quantize
    from reshard.core.quantize_blocked import quantize_groups_blocked

    dev = torch.device(device)
    w = (torch.randn(2048, 7168) * 0.02).to(torch.bfloat16)
    q, s = quantize(w)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(f: Any) -> float:
        f()
        sync()
        got = []
        for _ in range(5):
            t0 = time.perf_counter()
            f()
            sync()
            got.append(time.perf_counter() - t0)
        return statistics.median(got)

    wd, qd, sd = w.to(dev), q.to(dev), s.to(dev)
    gb = w.numel() * w.element_size() / 1e9
    rec = {"tensor": "bf16 [2048, 7168]", "h2d s": timed(lambda: w.to(dev)),
           "fp8 quantize s": timed(lambda: quantize(wd)),
           "fp8 dequantize s": timed(lambda: dequantize(qd, sd, (128, 128))),
           "int8 quantize s": timed(lambda: quantize_groups_blocked(wd, 8, 64)),
           "d2h s": timed(lambda: wd.cpu())}
    rec["GB/s"] = {k[:-2]: round(gb / v, 2) for k, v in rec.items() if k.endswith(" s") and v > 0}
    same = torch.equal(quantize(wd)[0].cpu().view(torch.uint8), q.view(torch.uint8))
    rec["fp8 quantize equals the CPU's"] = bool(same)
    return rec


def flow_with_limit(src: Path, dst: Path, device: str, work: Path) -> dict[str, Any]:
    """A flow run whose tensor tasks claim slots of a global concurrency limit (1 per GPU)."""
    import uuid

    from reshard.flows.server import start_embedded

    # the server first, its URL in the environment before Prefect is imported: Prefect reads its
    # settings once, and a client made without the URL starts a temporary server of its own
    server = start_embedded(work / "cache")
    server.wait_ready(120)
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        from reshard.flows.params import ReshardParams
        from reshard.flows.runner import run_flow

        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="reshard-gpu", limit=1))
        t0 = time.perf_counter()
        out = run_flow(ReshardParams(source=str(src), destination=str(dst), target_tp=2, device=device,
                                     gpu_concurrency_limit="reshard-gpu", cache_dir=str(work / "cache")))
        seconds = time.perf_counter() - t0
        time.sleep(5)  # task runs reach the server as events after the flow returns
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
                any_=[uuid.UUID(str(out["flow_run_id"]))])))
            limit = client.read_global_concurrency_limit_by_name("reshard-gpu")
        tags = sorted({(r.name.rsplit("-", 1)[0], tuple(sorted(r.tags))) for r in runs})
        return {"seconds": round(seconds, 2), "files": len(out["files"]), "server": server.api_url,
                "limit": {"name": limit.name, "limit": limit.limit, "active slots after": limit.active_slots},
                "task tags": {name: list(t) for name, t in tags}}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny models: a check of the script itself")
    ap.add_argument("--skip-flow", action="store_true")
    ns = ap.parse_args(argv)
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    data = ns.work / "data"
    core_shape = (dict(hidden=256, ffn=512, heads=16, groups=8, vocab=1024, tp=8) if ns.quick else
                  dict(hidden=4096, ffn=11008, heads=32, groups=8, vocab=32768, tp=8))
    core = bench_torch_dist.make_source(data / "core_tp8", 2 if ns.quick else 6, **core_shape)
    hf_shape = bench_fp8.QUICK_SHAPE if ns.quick else bench_fp8.DSV3_SHAPE
    bf16 = data / "hf_bf16"
    if not (bf16 / "config.json").is_file():
        bench_fp8.make_source(bf16, 2, 8, hf_shape)
    fp8 = data / "hf_fp8"
    if not (fp8 / "config.json").is_file():
        run(reshard(str(bf16), str(fp8), "--to", "hf", "--quantize", "fp8", "--device", "cpu"))
    conversions = {"TP 8 -> 2": (core, ["--target-tp", "2"]),
                   "TP 8 -> 2, int8": (core, ["--target-tp", "2", "--quantize", "int8"]),
                   "bf16 -> FP8 hf": (bf16, ["--to", "hf", "--quantize", "fp8"]),
                   "FP8 -> bf16 hf (decoded on the CPU)": (fp8, ["--to", "hf"])}
    report: dict[str, Any] = {"devices": devices, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
                              "cpu cores": os.cpu_count(), "conversions": {}}
    for name, (src, flags) in conversions.items():
        rec: dict[str, Any] = {}
        outs = {}
        for device in devices:
            out = ns.work / "out" / f"{len(report['conversions'])}_{device}"
            shutil.rmtree(out, ignore_errors=True)
            bench_torch_dist.warm(src)
            try:
                seconds = run(reshard(str(src), str(out), *flags, "--device", device))
            except RuntimeError as err:  # one failed conversion must not cost the rest of the lease
                rec[device] = {"failed": str(err)[-2000:]}
                print(name, device, "FAILED", err, flush=True)
                continue
            written = bench_torch_dist.size(out)
            rec[device] = {"seconds": round(seconds, 2), "GB written": round(written / 1e9, 2),
                           "GB/s": round(written / 1e9 / seconds, 3)}
            outs[device] = out
        if len(outs) == 2:
            same = digests(outs["cpu"]) == digests(outs["cuda"])
            rec["byte-identical"] = same
            if not same:
                rec["differences"] = tensor_differences(outs["cpu"], outs["cuda"])[:20]
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
        report["conversions"][name] = rec
        print(name, json.dumps(rec), flush=True)
        (ns.work / "gpu_check.json").write_text(json.dumps(report, indent=2))  # what a timeout leaves
    report["kernels"] = {d: kernel_times(d) for d in devices}
    print("kernels", json.dumps(report["kernels"]), flush=True)
    if not ns.skip_flow:
        out = ns.work / "out" / "flow"
        shutil.rmtree(out, ignore_errors=True)
        report["flow"] = flow_with_limit(core, out, devices[-1], ns.work)
        print("flow", json.dumps(report["flow"]), flush=True)
    (ns.work / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
