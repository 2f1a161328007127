"""Reliability and security suite (figures in docs/reliability.md): crash anywhere, fault
anywhere, bad input everywhere — nothing lost, nothing partial reads as complete, the source is
never modified, a checkpoint from an untrusted place cannot run code."""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

from conftest import cache_records, record_kinds, run_reshard_cli, task_states
from reshard.cli import main
from reshard.core.errors import (
    CheckpointFormatError,
    ConfigError,
    CorruptCheckpointError,
    DestinationError,
    InconsistentShardsError,
    LayoutError,
    ManifestMismatchError,
    StorageError,
    UnknownParameterError,
    UnsafeCheckpointError,
)
from reshard.direct import run_direct
from reshard.execution.plan import ReshardOptions
from reshard.sample import GPTConfig, write_sample_checkpoint
from reshard.storage.cache import ShardCache
from reshard.storage.location import open_location
from reshard.storage.manifest import MANIFEST_NAME, verify

CFG = GPTConfig(layers=2, hidden=128, heads=8, vocab=256, seq=16)


@pytest.fixture(scope="module")
def local_tp8(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("rel") / "tp8"
    write_sample_checkpoint(folder, tp=8, cfg=CFG)
    return folder


@pytest.fixture(scope="module")
def clean_tp2(local_tp8, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("relref") / "tp2"
    run_direct(str(local_tp8), str(out), ReshardOptions(target_tp=2))
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != MANIFEST_NAME}


def _upload(folder: Path, url: str, so: dict) -> None:
    loc = open_location(url, so)
    for p in sorted(folder.iterdir()):
        loc.fs.put_file(str(p), loc.join(p.name))


def _listing(url: str, so: dict) -> dict[str, tuple]:
    loc = open_location(url, so)
    loc.fs.invalidate_cache()
    return {p: (i["size"], i.get("ETag")) for p, i in loc.fs.find(loc.path, detail=True).items()}


def _outputs(url: str, so: dict) -> dict[str, bytes]:
    loc = open_location(url, so)
    loc.fs.invalidate_cache()
    return {p.rsplit("/", 1)[-1]: loc.fs.cat_file(p) for p in loc.fs.find(loc.path)
            if not p.endswith(MANIFEST_NAME) and "/.reshard" not in p}


@pytest.fixture
def s3_source(s3_server, s3_bucket, local_tp8):
    so = s3_server.storage_options()
    url = f"{s3_bucket}/train/global_step100"
    _upload(local_tp8, url, so)
    return s3_bucket, url, so


# --- crash matrix ------------------------------------------------------------------------------

CRASH_POINTS = ["fetching:1", "fetched:4", "planned:1", "converted:1", "uploading:1", "uploaded:1",
                "uploading:2", "uploaded:2", "staged-all:1", "copying:1", "committed-files:1"]


def _cli_env(prefect_env: dict, server, tmp_path: Path) -> dict[str, str]:
    return dict(prefect_env, AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key,
                RESHARD_CACHE_DIR=str(tmp_path / "cache"))


_cli = run_reshard_cli


@pytest.mark.parametrize("crash", CRASH_POINTS)
def test_sigkill_anywhere_then_resume(s3_server, s3_source, prefect_env, tmp_path, clean_tp2, reshard_cli_here, crash):
    bucket, src, so = s3_source
    dst = f"{bucket}/out/tp2"
    before = _listing(src, so)
    env = _cli_env(prefect_env, s3_server, tmp_path)
    args = ["run", src, dst, "--target-tp", "2", "--json",
            "--storage-option", f"endpoint_url={s3_server.endpoint_url}", "--storage-option", "region_name=us-east-1"]
    records_before = cache_records(prefect_env)
    killed = _cli(args, env, crash)
    written = record_kinds(cache_records(prefect_env) - records_before)  # what the killed run recorded
    assert killed.returncode == -9, killed.stderr[-3000:]
    with pytest.raises(ManifestMismatchError):  # nothing committed is visible after a kill
        verify(dst, so)
    resumed = reshard_cli_here(args, env)  # the kill needs its own process; the resume does not
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _outputs(dst, so) == clean_tp2
    verify(dst, so)
    assert _listing(src, so) == before, "the source must never be written"
    states = task_states(json.loads(resumed.stdout)["flow_run_id"], expect={"upload-target": 2})
    point, n = crash.split(":")
    if point in ("planned", "converted", "uploading", "uploaded", "staged-all", "copying", "committed-files"):
        assert states["fetch-shard"] == ["Cached"] * 8, states  # every fetch finished before the kill
    # every upload the killed run recorded is reused, no more and no less. Which ones depends on
    # timing at "uploaded:2": Prefect commits a task's cache record just after the task reports
    # Completed, and the two uploads run concurrently, so the 2nd one's SIGKILL may come first.
    assert states["upload-target"].count("Cached") == written.count("upload"), (states, written)
    if point in ("staged-all", "copying", "committed-files"):  # the commit step started: both recorded
        assert written.count("upload") == 2, written


# --- fault matrix --------------------------------------------------------------------------------

FAULTS = [("503", 10), ("503", 3), ("500", 10), ("500", 3), ("reset", 10), ("reset", 3),
          ("truncate", 10), ("truncate", 3), ("latency", 5)]


@pytest.mark.parametrize("kind,every", FAULTS, ids=[f"{k}-1in{n}" for k, n in FAULTS])
def test_faults_are_survived(s3_server, s3_source, tmp_path, clean_tp2, quick_backoff, kind, every):
    from faultproxy import FaultProxy

    bucket, src, so = s3_source
    dst = f"{bucket}/faulty"
    before = _listing(src, so)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        extra = {"config_kwargs": {"read_timeout": 0.5, "connect_timeout": 2}} if kind == "latency" else {}
        faulty = s3_server.storage_options(endpoint_url=proxy.endpoint_url, **extra)
        with proxy.faulting(kind, every, latency_s=1.5):
            run_direct(src, dst, ReshardOptions(target_tp=2), storage_options=faulty,
                       cache=ShardCache(tmp_path / "cache", chunksize=256 << 10))
        assert proxy.faults_injected > 0
    assert _outputs(dst, so) == clean_tp2
    verify(dst, so)
    assert _listing(src, so) == before


def test_beyond_the_retry_budget_fails_clearly_without_commit(s3_server, s3_source, tmp_path, capsys):
    from faultproxy import FaultProxy

    bucket, src, so = s3_source
    dst = f"{bucket}/doomed"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        # every PUT fails: reading works, nothing can be written
        with proxy.faulting("500", 1, method="PUT"):
            code = main(["run", "--direct", src, dst, "--target-tp", "2", "--cache-dir", str(tmp_path / "c"),
                         "--storage-option", f"endpoint_url={proxy.endpoint_url}",
                         "--storage-option", "region_name=us-east-1",
                         "--storage-option", f"key={s3_server.access_key}",
                         "--storage-option", f"secret={s3_server.secret_key}",
                         "--storage-option", 'config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}}'])
    err = capsys.readouterr().err
    assert code == 75, err  # EX_TEMPFAIL: transient, retry later
    assert len(err.strip().splitlines()) == 1 and "after all retries" in err and "nothing was committed" in err
    assert s3_server.secret_key not in err
    with pytest.raises(ManifestMismatchError):
        verify(dst, so)


# --- bad-input matrix ---------------------------------------------------------------------------

def _mutate_rank(folder: Path, rank: int, fn) -> None:
    p = folder / f"mp_rank_{rank:02d}_model_states.pt"
    sd = torch.load(p, weights_only=False)
    fn(sd)
    torch.save(sd, p)


def _other_model(folder: Path) -> None:
    other = folder.parent / "other"
    write_sample_checkpoint(other, tp=8, cfg=GPTConfig(layers=2, hidden=64, heads=8, vocab=256, seq=16))
    (other / "mp_rank_05_model_states.pt").replace(folder / "mp_rank_05_model_states.pt")


def _bad_zero(folder: Path) -> None:
    for r in range(8):
        _mutate_rank(folder, r, lambda sd: sd.update(ds_config={"zero_optimization": {"stage": 3}}))


BAD = {
    "truncated-shard": (lambda f: (f / "mp_rank_02_model_states.pt").write_bytes(
        (f / "mp_rank_02_model_states.pt").read_bytes()[:5000]), [], CorruptCheckpointError, "mp_rank_02"),
    "zero-byte-shard": (lambda f: (f / "mp_rank_03_model_states.pt").write_bytes(b""), [], CorruptCheckpointError,
                        "mp_rank_03"),
    "non-zip-file": (lambda f: (f / "mp_rank_04_model_states.pt").write_text("not a checkpoint"), [],
                     CorruptCheckpointError, "mp_rank_04"),
    "shard-of-another-model": (_other_model, [], InconsistentShardsError, "mp_rank_05"),
    "missing-rank": (lambda f: (f / "mp_rank_06_model_states.pt").unlink(), [], CheckpointFormatError, "missing [6]"),
    "duplicate-rank": (lambda f: (f / "mp_rank_1_model_states.pt").write_bytes(
        (f / "mp_rank_01_model_states.pt").read_bytes()), [], CheckpointFormatError, "rank 1 appears in 2 files"),
    "inconsistent-shapes": (lambda f: _mutate_rank(f, 7, lambda sd: sd["module"].__setitem__(
        "transformer.layers.1.mlp.dense_h_to_4h.bias", torch.zeros(3))), [], InconsistentShardsError,
        "transformer.layers.1.mlp.dense_h_to_4h.bias"),
    "replicated-mismatch": (lambda f: _mutate_rank(f, 3, lambda sd: sd["module"]["transformer.final_layernorm.bias"]
                                                   .add_(0.5)), [], InconsistentShardsError, "final_layernorm.bias"),
    "unknown-parameter": (lambda f: [_mutate_rank(f, r, lambda sd: sd["module"].__setitem__(
        "transformer.layers.0.attention.rotary.inv_freq", torch.ones(4))) for r in range(8)], [],
        UnknownParameterError, "rotary.inv_freq"),
    "indivisible-target-tp": (lambda f: None, ["--target-tp", "3"], LayoutError, "over 3 target ranks"),
    "unsafe-pickle": (lambda f: _mutate_rank(f, 0, lambda sd: sd.update(hook=_Evil(f.parent / "pwned"))), [],
                      UnsafeCheckpointError, "mp_rank_00"),
    "zero-stage-3": (_bad_zero, [], LayoutError, "ZeRO stage 3"),
    "bad-version": (lambda f: None, ["--version", "7"], CheckpointFormatError, "unknown checkpoint_version 7.0"),
}


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run_bad(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_matrix_on_s3(s3_server, s3_bucket, local_tp8, tmp_path, capsys, case):
    mutate, extra, err_cls, culprit = BAD[case]
    folder = tmp_path / "src"
    import shutil

    shutil.copytree(local_tp8, folder)
    mutate(folder)
    so = s3_server.storage_options()
    src, dst = f"{s3_bucket}/bad/{case}", f"{s3_bucket}/bad-out/{case}"
    _upload(folder, src, so)
    before = _listing(src, so)
    common = ["--cache-dir", str(tmp_path / "cache"), "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
              "--storage-option", "region_name=us-east-1", "--storage-option", f"key={s3_server.access_key}",
              "--storage-option", f"secret={s3_server.secret_key}"]
    args = ["run", "--direct", src, dst, *(extra if "--target-tp" in extra else ["--target-tp", "2", *extra]), *common]
    code, err = _run_bad(capsys, args)
    assert code == 2, err
    line = err.strip()
    assert len(line.splitlines()) == 1 and culprit in line and "Traceback" not in line, line
    assert s3_server.secret_key not in line
    with pytest.raises(err_cls):  # the exact error class, from the Python API
        run_direct(src, dst, _opts(extra), storage_options=so, cache=ShardCache(tmp_path / "cache"))
    assert _listing(src, so) == before
    with pytest.raises(ManifestMismatchError):
        verify(dst, so)
    assert not (tmp_path / "pwned").exists()


def _opts(extra: list[str]) -> ReshardOptions:
    tp = int(extra[extra.index("--target-tp") + 1]) if "--target-tp" in extra else 2
    version = float(extra[extra.index("--version") + 1]) if "--version" in extra else None
    return ReshardOptions(target_tp=tp, version=version)


def test_bad_storage_inputs(s3_server, s3_source, tmp_path, capsys):
    bucket, src, so = s3_source
    cases = [
        (f"s3://nobucket-{uuid.uuid4().hex[:8]}/x", f"{bucket}/o1", so, StorageError, "no such bucket"),
        (src, f"{bucket}/o2", s3_server.storage_options(secret="wrong"), StorageError, "permission denied"),
        (src, src, so, DestinationError, "inside"),
        (src, f"{src}/converted", so, DestinationError, "inside"),
    ]
    for s, d, opts, cls, text in cases:
        with pytest.raises(cls, match=text) as info:
            run_direct(s, d, ReshardOptions(target_tp=2), storage_options=opts, cache=ShardCache(tmp_path / "c"))
        assert "wrong" not in str(info.value) and s3_server.secret_key not in str(info.value)
    # malformed descriptor JSON and an invalid target ZeRO config
    loc = open_location(src, so)
    loc.fs.pipe_file(loc.join("bad.json"), b'{"type": "Megatron", "checkpoints": [')
    with pytest.raises(StorageError, match="malformed descriptor JSON"):
        run_direct(f"{src}/bad.json", f"{bucket}/o3", ReshardOptions(target_tp=2), storage_options=so,
                   cache=ShardCache(tmp_path / "c"))
    with pytest.raises(ConfigError, match="ratio"):
        run_direct(src, f"{bucket}/o4", ReshardOptions(target_tp=2), storage_options=so,
                   cache=ShardCache(tmp_path / "c"),
                   target_config={"zero_optimization": {"stage": 1,
                                                        "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})


# --- security ------------------------------------------------------------------------------------

def test_path_traversal_in_object_keys_and_descriptors(s3_server, s3_source, tmp_path):
    bucket, src, so = s3_source
    loc = open_location(src, so)
    data = loc.fs.cat_file(loc.join("mp_rank_00_model_states.pt"))
    # SeaweedFS itself rejects keys with '..' segments; an in-memory store keeps them verbatim
    with pytest.raises(OSError):
        loc.fs.pipe_file(f"{bucket}/trav/sub/../mp_rank_00_model_states.pt", data)
    root = f"memory://trav-{uuid.uuid4().hex[:6]}"
    mem = open_location(root)
    mem.fs.pipe_file(f"{mem.path}/ckpt/sub/../mp_rank_00_model_states.pt", data)
    with pytest.raises(StorageError, match="escapes its folder"):
        run_direct(f"{root}/ckpt", f"{root}/out", ReshardOptions(target_tp=1), cache=ShardCache(tmp_path / "c"))
    assert not mem.fs.exists(f"{mem.path}/out/{MANIFEST_NAME}")
    desc = {"type": "Megatron", "checkpoints": ["../global_step100/mp_rank_00_model_states.pt"], "version": 2.0,
            "parallelization": "tp"}
    loc.fs.pipe_file(f"{bucket}/desc/ckpt.json", json.dumps(desc).encode())
    with pytest.raises(StorageError, match="not a relative path"):
        run_direct(f"{bucket}/desc/ckpt.json", f"{bucket}/desc-out", ReshardOptions(target_tp=1),
                   storage_options=so, cache=ShardCache(tmp_path / "c"))


def test_credentials_never_become_flow_parameters_or_logs(s3_server, s3_source, prefect_env, tmp_path):
    from reshard.flows.params import ReshardParams

    bucket, src, so = s3_source
    with pytest.raises(ValueError, match="environment"):
        ReshardParams(source=src, destination=f"{bucket}/x", target_tp=2, storage_options=so)
    env = _cli_env(prefect_env, s3_server, tmp_path)
    env.pop("AWS_SECRET_ACCESS_KEY")
    env.pop("AWS_ACCESS_KEY_ID")
    out = _cli(["run", src, f"{bucket}/cred-out", "--target-tp", "2", "--json", "-v",
                "--storage-option", f"endpoint_url={s3_server.endpoint_url}",
                "--storage-option", "region_name=us-east-1",
                "--storage-option", f"key={s3_server.access_key}",
                "--storage-option", f"secret={s3_server.secret_key}"],
               env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert s3_server.secret_key not in out.stdout + out.stderr
    run_id = json.loads(out.stdout)["flow_run_id"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(uuid.UUID(run_id))
        assert s3_server.secret_key not in json.dumps(run.parameters, default=str)
        arts = client.read_artifacts()
        assert arts and all(s3_server.secret_key not in str(a.data) for a in arts)
        logs = client.read_logs()
        assert all(s3_server.secret_key not in (lg.message or "") for lg in logs)


# --- concurrency ---------------------------------------------------------------------------------

def test_two_conversions_to_one_destination_exactly_one_commits(s3_source, tmp_path):
    bucket, src, so = s3_source
    dst = f"{bucket}/contended"
    results: dict[int, BaseException | None] = {}
    barrier = threading.Barrier(2)

    def run(tp: int) -> None:
        barrier.wait()
        try:
            run_direct(src, dst, ReshardOptions(target_tp=tp), storage_options=so,
                       cache=ShardCache(tmp_path / f"c{tp}"))
            results[tp] = None
        except BaseException as exc:  # recorded and asserted below
            results[tp] = exc

    threads = [threading.Thread(target=run, args=(tp,)) for tp in (2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    winners = [tp for tp, exc in results.items() if exc is None]
    losers = [exc for exc in results.values() if exc is not None]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], DestinationError), repr(losers[0])
    manifest = verify(dst, so)
    assert manifest["target"]["tp"] == winners[0]


def test_conversions_to_different_destinations_run_in_parallel(s3_source, tmp_path, clean_tp2):
    bucket, src, so = s3_source
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            run_direct(src, f"{bucket}/par-{i}", ReshardOptions(target_tp=2), storage_options=so,
                       cache=ShardCache(tmp_path / "shared-cache"))
        except BaseException as exc:  # recorded and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    for i in range(3):
        assert _outputs(f"{bucket}/par-{i}", so) == clean_tp2
