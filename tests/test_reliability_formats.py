"""The reliability matrix over the formats added after the legacy per-rank one (``test_reliability.py``
covers that): torch_dist sources and outputs (cut into files), Hugging Face sources (sharded, with
the index) and outputs, ZeRO optimizer files (``--weights master``, ``--to universal``) and MoE
per-rank folders — S3 to S3 through the fault proxy, SIGKILL at an early, a middle and a late point
of the flow then resume, and truncated or corrupt files of each format. Every surviving run's
output is byte-identical to a clean local ``--direct`` run of the same conversion; a failing one
commits nothing and says one line; the source is never written.

The sources are what the real tools wrote: megatron-core 0.16.1 (per-rank, torch_dist, MoE),
transformers (``save_pretrained`` with ``max_shard_size``) and DeepSpeed's engine (ZeRO).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import cache_records, record_kinds, run_reshard_cli
from mcore_fixtures import mcore_checkpoints, mcore_dist_checkpoints, mcore_moe_checkpoints, needs_mcore
from reshard.cli import main
from reshard.core.errors import ManifestMismatchError
from reshard.core.options import ReshardOptions
from reshard.direct import run_direct
from reshard.storage.cache import ShardCache
from reshard.storage.location import open_location
from reshard.storage.manifest import MANIFEST_NAME, verify

pytestmark = [needs_mcore, pytest.mark.slow]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, zero_checkpoint) -> dict[str, Path]:
    """One local source per format, as the real tools wrote it."""
    from test_hf_import import make_hf_model

    root = tmp_path_factory.mktemp("relf")
    hf = root / "hf"
    make_hf_model("llama", hf)  # sharded at 100KB: model-0000N-of-0000M.safetensors + the index
    assert (hf / "model.safetensors.index.json").is_file()
    mcore = mcore_checkpoints(root / "mcore")
    return {"per-rank": mcore[("gqa_swiglu", 2, 1)], "llama": mcore[("llama", 2, 1)],
            "torch_dist": mcore_dist_checkpoints(root / "dist")[("gqa_swiglu", 2, 1)],
            "moe": mcore_moe_checkpoints(root / "moe")[("moe", 1, 2, 1)],
            "hf": hf, "zero": zero_checkpoint(2, "fp32", 2)}


#: case -> (source, options): every new read and write path once
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "torch_dist-in": ("torch_dist", {"target_tp": 2}),
    "torch_dist-out-cut": ("per-rank", {"to": "torch_dist", "max_shard_size": "40KB"}),
    "hf-out-sharded": ("llama", {"to": "hf", "max_shard_size": "40KB"}),
    "hf-in-sharded": ("hf", {"target_tp": 2}),
    "zero-master": ("zero", {"target_tp": 1, "weights": "master"}),
    "zero-universal": ("zero", {"to": "universal"}),
    "moe-per-rank": ("moe", {"target_tp": 2, "target_ep": 1}),
}


def _flags(options: dict[str, Any]) -> list[str]:
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _tree(url: str, so: dict) -> dict[str, bytes]:
    """Every file under ``url`` (relative path -> bytes), the manifest and reshard's own folders left out."""
    loc = open_location(url, so)
    loc.fs.invalidate_cache()
    base = loc.path.rstrip("/") + "/"
    return {p[len(base):]: loc.fs.cat_file(p) for p in sorted(loc.fs.find(loc.path))
            if not p.endswith(MANIFEST_NAME) and "/.reshard" not in p}


def _listing(url: str, so: dict) -> dict[str, tuple]:
    loc = open_location(url, so)
    loc.fs.invalidate_cache()
    return {p: (i["size"], i.get("ETag")) for p, i in loc.fs.find(loc.path, detail=True).items()}


@pytest.fixture(scope="module")
def clean(sources, tmp_path_factory) -> Callable[[str], dict[str, bytes]]:
    """The bytes of a clean local ``--direct`` run of a case (each run once)."""
    done: dict[str, dict[str, bytes]] = {}
    root = tmp_path_factory.mktemp("relf-clean")

    def get(case: str) -> dict[str, bytes]:
        if case not in done:
            src, options = CASES[case]
            out = root / case
            run_direct(str(sources[src]), str(out), ReshardOptions.checked(**options))
            done[case] = _tree(str(out), {})
        return done[case]

    return get


def _upload(folder: Path, url: str, so: dict) -> None:
    loc = open_location(url, so)
    loc.fs.put(str(folder) + "/", loc.path + "/", recursive=True)


@pytest.fixture
def on_s3(s3_server, s3_bucket, sources) -> Callable[[str], str]:
    """Upload a source (once per test) and return its URL."""
    so = s3_server.storage_options()
    urls: dict[str, str] = {}

    def put(src: str) -> str:
        if src not in urls:
            urls[src] = f"{s3_bucket}/src/{src}"
            _upload(sources[src], urls[src], so)
        return urls[src]

    return put


# --- faults ---------------------------------------------------------------------------------------

#: the kinds of failure, one per case in turn (every kind meets several formats, in both directions)
FAULTS = ("503", "reset", "truncate")


@pytest.mark.parametrize("case", sorted(CASES))
def test_faults_on_every_new_format_are_survived(s3_server, s3_bucket, on_s3, clean, tmp_path, quick_backoff, case):
    """1 request in 5 failing (a 503, a reset connection or a truncated body) on every request of an
    S3 -> S3 conversion: the output equals the clean local run."""
    from faultproxy import FaultProxy

    src, options = CASES[case]
    kind = FAULTS[sorted(CASES).index(case) % len(FAULTS)]
    url, so = on_s3(src), s3_server.storage_options()
    before = _listing(url, so)
    dst = f"{s3_bucket}/out"
    # a universal checkpoint is four small files per parameter: its uploads fail like any other
    # output's (the other cases), and its reads of the optimizer files are what is new
    only = {"method": "GET"} if case == "zero-universal" else {}
    with FaultProxy(s3_server.endpoint_url) as proxy:
        faulty = s3_server.storage_options(endpoint_url=proxy.endpoint_url)
        with proxy.faulting(kind, 5, **only):
            run_direct(url, dst, ReshardOptions.checked(**options), storage_options=faulty,
                       cache=ShardCache(tmp_path / "cache", chunksize=256 << 10))
        assert proxy.faults_injected > 0, kind
    assert _tree(dst, so) == clean(case), kind
    verify(dst, so)
    assert _listing(url, so) == before, "the source must never be written"


# --- SIGKILL, then resume -------------------------------------------------------------------------

#: case -> where the flow is killed: early (a shard fetched), middle (a target converted), late
#: (every output in place, the manifest not yet written)
KILLS = {"torch_dist-in": "fetched:1", "torch_dist-out-cut": "converted:2", "hf-out-sharded": "committed-files:1",
         "hf-in-sharded": "converted:1", "zero-master": "fetched:2", "moe-per-rank": "committed-files:1"}


@pytest.mark.parametrize("case", sorted(KILLS))
def test_a_killed_flow_resumes_to_the_clean_bytes(s3_server, s3_bucket, on_s3, clean, prefect_env, tmp_path,
                                                  reshard_cli_here, case):
    src, options = CASES[case]
    url, so = on_s3(src), s3_server.storage_options()
    dst = f"{s3_bucket}/killed"
    env = dict(prefect_env, AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
               RESHARD_CACHE_DIR=str(tmp_path / "cache"))
    args = ["run", url, dst, *_flags(options), "--json", "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
            "--storage-option", "region_name=us-east-1"]
    before = _listing(url, so)
    records = cache_records(prefect_env)
    killed = run_reshard_cli(args, env, KILLS[case])
    assert killed.returncode == -9, killed.stderr[-3000:]
    written = record_kinds(cache_records(prefect_env) - records)
    with pytest.raises(ManifestMismatchError):  # nothing committed is visible after a kill
        verify(dst, so)
    resumed = reshard_cli_here(args, env)  # the kill needs its own process; the resume does not
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert _tree(dst, so) == clean(case)
    verify(dst, so)
    assert _listing(url, so) == before
    if KILLS[case].startswith(("converted", "committed-files")):
        assert summary["reused"] >= written.count("fetch") > 0, (summary, written)  # finished work not redone


# --- truncated and corrupt files ------------------------------------------------------------------

def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garbage_header(data: bytes) -> bytes:
    return (len(data) * 4).to_bytes(8, "little") + data[8:]  # a safetensors header longer than the file


#: bad input -> (source, options, file to spoil (a name under the source), how, words of the one line)
BAD: dict[str, tuple[str, dict[str, Any], str, Callable[[bytes], bytes], str]] = {
    "distcp-truncated": ("torch_dist", {"target_tp": 2}, "iter_0000007/__0_0.distcp", _truncate, "__0_0.distcp"),
    "metadata-corrupt": ("torch_dist", {"target_tp": 2}, "iter_0000007/.metadata", lambda d: b"\x80\x04junk" + d[:50],
                         ".metadata"),
    "safetensors-header": ("hf", {"target_tp": 2}, "model-00001-of-", _garbage_header, "model-00001-of-"),
    "safetensors-index": ("hf", {"target_tp": 2}, "model.safetensors.index.json", lambda d: d[: len(d) // 3],
                          "model.safetensors.index.json"),
    "optimizer-truncated": ("zero", {"to": "universal"}, "zero_pp_rank_1_mp_rank_00_optim_states.pt", _truncate,
                            "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "moe-rank-truncated": ("moe", {"target_tp": 2, "target_ep": 1}, "iter_0000007/mp_rank_00_001/model_optim_rng.pt",
                           _truncate, "mp_rank_00_001"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_spoiled_file_of_each_format_is_one_line_and_nothing_committed(s3_server, s3_bucket, sources, tmp_path,
                                                                         capsys, case):
    src, options, name, spoil, needle = BAD[case]
    so = s3_server.storage_options()
    url = f"{s3_bucket}/bad/{case}"
    _upload(sources[src], url, so)
    loc = open_location(url, so)
    target = next(p for p in sorted(loc.fs.find(loc.path)) if p[len(loc.path) + 1:].startswith(name))
    loc.fs.pipe_file(target, spoil(loc.fs.cat_file(target)))
    before = _listing(url, so)
    dst = f"{s3_bucket}/bad-out/{case}"
    capsys.readouterr()
    code = main(["run", "--direct", url, dst, *_flags(options), "--cache-dir", str(tmp_path / "c"),
                 "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
                 "--storage-option", "region_name=us-east-1",
                 "--storage-option", f"key={s3_server.access_key}",
                 "--storage-option", f"secret={s3_server.secret_key}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("reshard: error: ") and needle in lines[0] and "(fix: " in lines[0], lines[0]
    with pytest.raises(ManifestMismatchError):
        verify(dst, so)
    assert _listing(url, so) == before


# --- a source object replaced while the conversion runs -------------------------------------------

#: case -> the object replaced (a name under the source): each format's tensor data
REPLACED = {"torch_dist-in": "iter_0000007/__1_0.distcp", "hf-in-sharded": "model-00002-of-",
            "zero-universal": "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "moe-per-rank": "iter_0000007/mp_rank_00_001/model_optim_rng.pt"}


def _flip_middle(data: bytes) -> bytes:
    """A new version of the same size whose structure still parses: one byte in the middle changed."""
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "flow"])
@pytest.mark.parametrize("case", sorted(REPLACED))
def test_a_source_object_replaced_mid_run_fails_in_one_line(s3_server, s3_bucket, sources, tmp_path, capsys,
                                                            monkeypatch, request, case, direct):
    """The object is replaced (same size, other bytes) once the source has been listed: every read
    after that carries the listed ETag (If-Match), so the run stops with one line naming the object,
    and nothing is committed — never an output mixing two versions."""
    from reshard import discovery as source_view

    if not direct:
        request.getfixturevalue("prefect_env")
    src, options = CASES[case]
    so = s3_server.storage_options()
    url = f"{s3_bucket}/replaced/{case}-{direct}"
    _upload(sources[src], url, so)
    loc = open_location(url, so)
    target = next(p for p in sorted(loc.fs.find(loc.path)) if p[len(loc.path) + 1:].startswith(REPLACED[case]))
    listed = source_view.list_objects

    def list_then_replace(*args: Any, **kwargs: Any) -> Any:
        # after every listing: the CLI lists once in its checks before Prefect starts and again in the
        # flow, and whichever listing the reads use must be stale by the time they come
        objs = listed(*args, **kwargs)
        loc.fs.pipe_file(target, _flip_middle(loc.fs.cat_file(target)))
        replaced.append(target)
        return objs

    replaced: list[str] = []
    monkeypatch.setattr(source_view, "list_objects", list_then_replace)
    dst = f"{s3_bucket}/replaced-out/{case}-{direct}"
    capsys.readouterr()
    code = main(["run", *(["--direct"] if direct else []), url, dst, *_flags(options),
                 "--cache-dir", str(tmp_path / "c"),
                 "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
                 "--storage-option", "region_name=us-east-1",
                 "--storage-option", f"key={s3_server.access_key}",
                 "--storage-option", f"secret={s3_server.secret_key}"])
    err = capsys.readouterr().err
    # the flow's first run on its own --cache-dir also says it creates that Prefect database (once)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("[", "reshard: first run: "))]
    assert replaced and code != 0 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    assert "changed" in lines[0] and REPLACED[case].rstrip("-") in lines[0], lines[0]
    with pytest.raises(ManifestMismatchError):
        verify(dst, so)
