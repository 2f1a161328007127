"""Deployments, schedules and event triggers (issue 7), against a real ``prefect server start``.

Fast checks first (no server): the flat ``reshard`` flow mirrors ``ReshardParams``, destination
templates, the event's shape and which deployment triggers of ``deployments/prefect.yaml`` cover
it (Prefect's own server-side matcher), the checkpoint scan of the sweep, and that ``reshard serve``
builds what ``prefect deploy`` registers.

Then one module-scoped stack: a Prefect server on a free port (SQLite under a temp folder),
``reshard deploy`` (= ``prefect deploy --all``), a process worker on the ``gpu`` pool, and the
session's SeaweedFS S3 server holding TP=8 sample checkpoints. The worker gets S3 credentials and
endpoint from its environment (``AWS_*``), as a GPU machine would; flow parameters never carry
secrets. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from prefect_server import PrefectServer, spawn, stop, tail, wait_for

ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
PREFECT = str(Path(sys.executable).with_name("prefect"))
RUN_TIMEOUT = 180  # seconds for one deployment run to finish (a few seconds when healthy)


# --------------------------------------------------------------------------- fast checks

def test_flat_flow_mirrors_reshard_params():
    import inspect

    from reshard.flows.deployed import reshard_deployment
    from reshard.flows.params import ReshardParams

    sig = inspect.signature(reshard_deployment.fn)
    assert set(sig.parameters) == set(ReshardParams.model_fields)
    for name, field in ReshardParams.model_fields.items():
        p = sig.parameters[name]
        if name in ("source", "target_tp"):
            assert p.default is inspect.Parameter.empty
        elif name == "destination":
            assert p.default == "{source}-tp{target_tp}"
        elif name == "storage_options":
            assert p.default is None
        else:
            assert p.default == field.get_default(call_default_factory=True), name
    assert reshard_deployment.name == "reshard"


def test_destination_templates():
    from reshard.core.errors import ReshardError
    from reshard.flows.deployed import render_destination as r

    assert r("{source}-tp{target_tp}", "s3://b/run7/global_step1000/", 2) == "s3://b/run7/global_step1000-tp2"
    assert r("{parent}/serve/{name}/tp{target_tp}", "s3://b/run7/step9", 1) == "s3://b/run7/serve/step9/tp1"
    assert r("{parent}/{name}.tp{target_tp}", "/data/run/iter_0000100", 4) == "/data/run/iter_0000100.tp4"
    assert r("gs://out/fixed", "s3://b/x", 2) == "gs://out/fixed"
    with pytest.raises(ReshardError, match="bad destination template"):
        r("{dest}/x", "s3://b/x", 2)


def _yaml_triggers() -> dict[str, list[dict[str, Any]]]:
    from reshard.deploy import load_specs

    return {s["full_name"]: s.get("triggers") or [] for s in load_specs(PREFECT_YAML)}


def _fired(kwargs: dict[str, Any]) -> set[str]:
    """Deployments whose prefect.yaml trigger covers the event (Prefect's server-side matcher)."""
    from datetime import datetime, timezone

    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent

    event = ReceivedEvent(occurred=datetime.now(timezone.utc), event=kwargs["event"], resource=kwargs["resource"],
                          related=kwargs["related"], payload=kwargs["payload"], id=uuid.uuid4())
    fired = set()
    for name, triggers in _yaml_triggers().items():
        for t in triggers:
            spec = {k: v for k, v in t.items() if k not in ("type", "enabled", "name", "parameters")}
            if EventTrigger(**spec).covers(event):
                fired.add(name)
    return fired


def test_event_shape_and_which_deployments_it_fires():
    from reshard.core.errors import ReshardError
    from reshard.events import training_completed_event as ev

    url = "s3://ckpt/run7/global_step1000"
    kw = ev(url, 8, 1000, targets=[2])
    assert kw["event"] == "reshard.training.completed"
    assert kw["resource"]["prefect.resource.id"] == f"reshard.checkpoint.{url}"
    assert kw["resource"]["reshard.url"] == url and kw["resource"]["reshard.tp"] == "8"
    assert kw["payload"] == {"url": url, "tp": 8, "step": 1000, "targets": [2]}
    assert _fired(kw) == {"reshard/8to2"}
    assert _fired(ev(url, 8, 1000, targets=[1, 2])) == {"reshard/8to2", "reshard/8to1"}
    # no targets: every 8->M deployment, and the Hugging Face export (any TP)
    assert _fired(ev(url, 8, 1000)) == {"reshard/8to2", "reshard/8to1", "reshard/to-hf"}
    assert _fired(ev(url, 2, 5)) == {"reshard/2to8", "reshard/to-hf"}
    assert _fired(ev(url, 4, 5)) == {"reshard/to-hf"}
    assert _fired(ev(url, 8, 5, targets=[4])) == set()
    kw = ev(url, 8, 5, targets=["hf", "2", 2])
    assert kw["payload"]["targets"] == [2, "hf"] and _fired(kw) == {"reshard/8to2", "reshard/to-hf"}
    assert _fired(ev(url, 4, 5, targets=["hf"])) == {"reshard/to-hf"}
    for bad in (dict(url="", tp=8), dict(url=url, tp=0), dict(url=url, tp=8, targets=[]),
                dict(url=url, tp=8, targets=[0]), dict(url=url, tp=8, targets=["HF!"])):
        with pytest.raises(ReshardError):
            ev(**bad)
    for name, triggers in _yaml_triggers().items():  # the run gets the event's URL
        for t in triggers:
            assert t["parameters"] == {"source": "{{ event.resource['reshard.url'] }}"}, name


def test_emit_without_a_server_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_API_URL="http://127.0.0.1:9/api")
    out = subprocess.run([sys.executable, "-m", "reshard.cli", "emit-training-completed", "s3://b/x", "--tp", "8"],
                         env=env, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "does not answer" in lines[0], out.stderr


def _touch(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_sweep_scan_finds_finished_checkpoints_only(tmp_path):
    from reshard.flows.sweep import find_finished_checkpoints

    src = tmp_path / "train"
    for r in range(4):  # DeepSpeed run: `latest` names the newest tag; older tags are not taken
        _touch(src / "runA" / "global_step500" / f"mp_rank_{r:02d}_model_states.pt")
        _touch(src / "runA" / "global_step900" / f"mp_rank_{r:02d}_model_states.pt")
    _touch(src / "runA" / "latest", "global_step900\n")
    for t in range(2):  # Megatron-LM run folder
        for p in range(2):
            _touch(src / "runB" / "iter_0000100" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt")
    _touch(src / "runB" / "latest_checkpointed_iteration.txt", "100")
    for r in range(8):  # completion marker
        _touch(src / "runC" / "final" / f"mp_rank_{r:02d}_model_states.pt")
    _touch(src / "runC" / "final" / "reshard.complete", "")
    _touch(src / "runD" / "global_step1" / "mp_rank_00_model_states.pt")  # no marker: still training
    _touch(src / "runE" / "latest", "global_step7")  # marker without files
    _touch(src / "runF" / "latest", "../../etc")  # not a folder name
    for r in range(2):  # Megatron-DeepSpeed writes both trackers; the DeepSpeed one names the folder
        _touch(src / "runG" / "global_step30" / f"mp_rank_{r:02d}_model_states.pt")
    _touch(src / "runG" / "latest", "global_step30")
    _touch(src / "runG" / "latest_checkpointed_iteration.txt", "30")
    for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"):  # torch_dist run folder
        _touch(src / "runH" / "iter_0000040" / f)
    _touch(src / "runH" / "latest_checkpointed_iteration.txt", "40")
    out = src / "converted" / "runC" / "final" / "tp2"  # an output inside the scanned tree
    _touch(out / "mp_rank_00_model_states.pt")
    _touch(out / "reshard.complete")
    _touch(out / "reshard_manifest.json", "{}")
    _touch(src / "dest" / "x" / "reshard.complete")  # under the destination root
    _touch(src / "dest" / "x" / "mp_rank_00_model_states.pt")

    found, ignored = find_finished_checkpoints(str(src), markers=["latest", "latest_checkpointed_iteration.txt",
                                                                  "reshard.complete"], exclude=[str(src / "dest")])
    got = {f["relative_path"]: (f["marker"], f["source_tp"]) for f in found}
    assert got == {"runA/global_step900": ("latest", 4), "runB/iter_0000100": ("latest_checkpointed_iteration.txt", 2),
                   "runC/final": ("reshard.complete", 8), "runG/global_step30": ("latest", 2),
                   "runH/iter_0000040": ("latest_checkpointed_iteration.txt", None)}
    assert found[0]["source"] == str(src / "runA" / "global_step900")
    assert sorted((Path(i["path"]).relative_to(src).as_posix(), i["reason"]) for i in ignored) == [
        ("runE/global_step7", "latest present but no model-state files"),
        ("runF/latest", "names '../../etc', not a folder")]


def test_serve_builds_what_the_file_declares(monkeypatch):
    from reshard.deploy import load_specs, runner_deployments

    monkeypatch.setenv("RESHARD_SWEEP_SOURCE", "s3://b/train")
    monkeypatch.setenv("RESHARD_SWEEP_DEST", "s3://b/serve")
    specs = {s["full_name"]: s for s in load_specs(PREFECT_YAML)}
    assert set(specs) == {"reshard/8to2", "reshard/8to1", "reshard/2to8", "reshard/to-hf",
                          "reshard-sweep/post-training"}
    deps = {f"{d.flow_name}/{d.name}": d for d in runner_deployments(PREFECT_YAML)}
    assert set(deps) == set(specs)
    assert deps["reshard/8to2"].parameters == {"target_tp": 2}
    assert deps["reshard/to-hf"].parameters == {"target_tp": None, "to": "hf", "destination": "{source}-hf"}
    assert deps["reshard/2to8"].entrypoint == "reshard.flows.deployed.reshard_deployment"
    sweep = deps["reshard-sweep/post-training"]
    assert sweep.parameters == {"source_root": "s3://b/train", "dest_root": "s3://b/serve", "targets": [2, 1]}
    assert [s.schedule.cron for s in sweep.schedules] == ["0 * * * *"]
    trig = deps["reshard/8to1"].triggers[0]
    assert trig.expect == {"reshard.training.completed"} and trig.parameters == {
        "source": "{{ event.resource['reshard.url'] }}"}


# --------------------------------------------------------------------------- the real stack

class Stack:
    def __init__(self, server: PrefectServer, env: dict[str, str], bucket: str, storage_options: dict[str, Any],
                 s3: Any, root: Path, timings: dict[str, float]):
        self.server, self.env, self.bucket, self.s3, self.root = server, env, bucket, s3, root
        self.storage_options = storage_options
        self.timings = timings
        self.worker: subprocess.Popen | None = None
        self.worker_log = root / "worker.log"

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.server.api_url)

    def cli(self, *args: str, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env={**self.env, **extra}, capture_output=True, text=True, timeout=timeout,
                              cwd=self.root)

    def logs(self) -> str:
        return f"--- worker\n{tail(self.worker_log)}\n--- server\n{tail(self.server.log, 2000)}"

    def upload_sample(self, folder: Path, url: str, marker: tuple[str, str] | None = None) -> None:
        key = url.removeprefix("s3://")
        if self.s3.exists(f"{key}/{sorted(folder.iterdir())[-1].name}"):
            return  # uploaded by an earlier test
        for f in sorted(folder.iterdir()):
            self.s3.put_file(str(f), f"{key}/{f.name}")
        if marker:
            self.s3.pipe(f"{key}/{marker[0]}" if marker[0] == "reshard.complete" else
                         f"{key.rsplit('/', 1)[0]}/{marker[0]}", marker[1].encode())

    def deployment(self, name: str) -> Any:
        with self.client() as c:
            return c.read_deployment_by_name(name)

    def runs_of(self, deployment: str) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        dep = self.deployment(deployment)
        with self.client() as c:
            return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    def wait_final(self, flow_run_id: Any, timeout: float = RUN_TIMEOUT) -> Any:
        def final():
            with self.client() as c:
                run = c.read_flow_run(flow_run_id)
            return run if run.state and run.state.is_final() else None

        run = wait_for(final, timeout, f"flow run {flow_run_id} to finish", on_timeout=self.logs)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{self.logs()}"
        return run

    def manifest(self, url: str) -> dict[str, Any] | None:
        path = url.removeprefix("s3://") + "/reshard_manifest.json"
        self.s3.invalidate_cache()
        return json.loads(self.s3.cat_file(path)) if self.s3.exists(path) else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_server):
    import s3fs

    timings: dict[str, float] = {}
    root = tmp_path_factory.mktemp("prefect-stack")
    bucket = s3_server.make_bucket(f"rs-deploy-{uuid.uuid4().hex[:12]}")
    s3 = s3fs.S3FileSystem(**s3_server.storage_options(), use_listings_cache=False, skip_instance_cache=True)
    s3.pipe(f"{bucket}/scheduled-src/README", b"the cron sweep scans here during the tests\n")
    t0 = time.monotonic()
    server = PrefectServer(root).start()
    timings["server start"] = time.monotonic() - t0
    env = server.client_env(AWS_ACCESS_KEY_ID=s3_server.access_key, AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
                            AWS_ENDPOINT_URL_S3=s3_server.endpoint_url, AWS_DEFAULT_REGION=s3_server.region,
                            RESHARD_SWEEP_SOURCE=f"s3://{bucket}/scheduled-src",
                            RESHARD_SWEEP_DEST=f"s3://{bucket}/scheduled-dst")
    # non-secret options a run may carry as a parameter (the credentials stay in the environment)
    storage_options = {"client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": s3_server.region},
                       "config_kwargs": {"s3": {"addressing_style": "path"}}}
    st = Stack(server, env, bucket, storage_options, s3, root, timings)
    try:
        t0 = time.monotonic()
        out = st.cli(sys.executable, "-m", "reshard.cli", "deploy", "--file", str(PREFECT_YAML))
        timings["reshard deploy"] = time.monotonic() - t0
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        t0 = time.monotonic()
        st.worker = spawn([PREFECT, "worker", "start", "--pool", "gpu", "--name", "test-gpu-worker", "--limit", "4"],
                          env, st.worker_log, cwd=root)

        def online():
            from prefect.client.schemas.filters import WorkerFilter, WorkerFilterStatus

            if st.worker.poll() is not None:
                raise AssertionError(f"worker exited:\n{tail(st.worker_log)}")
            with st.client() as c:
                return c.read_workers_for_work_pool(
                    "gpu", worker_filter=WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"])))

        wait_for(online, 90, "the gpu worker to come online", on_timeout=st.logs)
        timings["worker online"] = time.monotonic() - t0
        yield st
    finally:
        t0 = time.monotonic()
        stop(st.worker, grace=20)
        server.stop()
        timings["teardown"] = time.monotonic() - t0
        print("\n[test_deployments timings] " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


def _expected_shards(sample: Path, tmp_path: Path, target_tp: int) -> dict[str, str]:
    from reshard.direct import run_direct
    from reshard.execution.plan import ReshardOptions

    report = run_direct(str(sample), str(tmp_path / f"expected-tp{target_tp}"), ReshardOptions(target_tp=target_tp))
    return {f["path"]: f["sha256"] for f in report.manifest["files"] if f["path"].endswith(".pt")}


def _shards(manifest: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in manifest["files"] if f["path"].endswith(".pt")}


@pytest.mark.slow
def test_deploy_registers_the_yaml(stack):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    with stack.client() as c:
        pool = c.read_work_pool("gpu")
        automations = {a.name: a for a in c.read_automations()}
    assert pool.type == "process"
    for name, tp in (("8to2", 2), ("8to1", 1), ("2to8", 8)):
        dep = stack.deployment(f"reshard/{name}")
        assert dep.work_pool_name == "gpu" and dep.parameters == {"target_tp": tp}, dep
        assert dep.entrypoint == "reshard.flows.deployed:reshard_deployment" and dep.pull_steps == []
        assert "source" in dep.parameter_openapi_schema["required"]
        auto = automations[f"reshard-{name}-on-training-completed"]
        assert auto.trigger.expect == {"reshard.training.completed"}
        assert auto.actions[0].deployment_id == dep.id
        assert auto.actions[0].parameters == {"source": "{{ event.resource['reshard.url'] }}"}
    hf = stack.deployment("reshard/to-hf")  # any TP -> Hugging Face, on reshard.target.hf or .all
    assert hf.parameters == {"target_tp": None, "to": "hf", "destination": "{source}-hf"}, hf
    assert automations["reshard-to-hf-on-training-completed"].actions[0].deployment_id == hf.id
    sweep = stack.deployment("reshard-sweep/post-training")
    assert sweep.parameters == {"source_root": f"s3://{stack.bucket}/scheduled-src",
                                "dest_root": f"s3://{stack.bucket}/scheduled-dst", "targets": [2, 1]}
    assert [(s.schedule.cron, s.active) for s in sweep.schedules] == [("0 * * * *", True)]

    def scheduled():  # the server's scheduler turns the cron into Scheduled runs on the hour
        with stack.client() as c:
            runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"]))))
        return [r for r in runs if r.deployment_id == sweep.id]

    runs = wait_for(scheduled, 60, "the scheduler to create the sweep's cron runs", on_timeout=stack.logs)
    assert all(r.expected_start_time.minute == 0 and r.expected_start_time.second == 0 for r in runs)


@pytest.mark.slow
def test_prefect_deployment_run_8to2_commits_tp2_on_s3(stack, sample_factory, tmp_path):
    sample = sample_factory(8)
    src = f"s3://{stack.bucket}/ckpts/run7/global_step1000"
    stack.upload_sample(sample, src)
    t0 = time.monotonic()
    out = stack.cli(PREFECT, "deployment", "run", "reshard/8to2", "--param", f"source={json.dumps(src)}",
                    "--param", f"storage_options={json.dumps(stack.storage_options)}",
                    "--watch", "--watch-interval", "1", "--watch-timeout", str(RUN_TIMEOUT),
                    timeout=RUN_TIMEOUT + 60)
    stack.timings["deployment run 8to2"] = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:] + stack.logs()
    runs = [r for r in stack.runs_of("reshard/8to2") if r.parameters.get("source") == src]
    assert len(runs) == 1 and runs[0].state.is_completed()
    assert runs[0].parameters["storage_options"] == stack.storage_options
    manifest = stack.manifest(src + "-tp2")
    assert manifest is not None, "no committed output at the default destination {source}-tp2"
    assert manifest["target"] == {"url": src + "-tp2", "format": "deepspeed", "tp": 2, "pp": 1, "ep": 1,
                                  "etp": None}
    assert manifest["source"]["tp"] == 8
    assert _shards(manifest) == _expected_shards(sample, tmp_path, 2)
    from reshard.storage.manifest import verify

    verify(src + "-tp2", {**stack.storage_options, "key": stack.env["AWS_ACCESS_KEY_ID"],
                          "secret": stack.env["AWS_SECRET_ACCESS_KEY"]})


@pytest.mark.slow
def test_training_completed_event_fires_the_matching_deployment(stack, sample_factory):
    src = f"s3://{stack.bucket}/ckpts/run8/global_step2000"
    stack.upload_sample(sample_factory(8), src)
    before = {name: {r.id for r in stack.runs_of(name)}
              for name in ("reshard/8to2", "reshard/8to1", "reshard/2to8", "reshard/to-hf")}
    t0 = time.monotonic()
    out = stack.cli(sys.executable, "-m", "reshard.cli", "emit-training-completed", src, "--tp", "8",
                    "--step", "2000", "--target", "2", timeout=120)
    stack.timings["emit (CLI process)"] = time.monotonic() - t0
    assert out.returncode == 0 and "emitted reshard.training.completed" in out.stdout, out.stderr

    def triggered():
        return [r for r in stack.runs_of("reshard/8to2") if r.id not in before["reshard/8to2"]]

    runs = wait_for(triggered, 60, "the event to create a reshard/8to2 run", on_timeout=stack.logs)
    assert len(runs) == 1 and runs[0].parameters == {"target_tp": 2, "source": src}
    run = stack.wait_final(runs[0].id)
    stack.timings["event -> completed run"] = time.monotonic() - t0
    assert run.created_by is not None and run.created_by.type == "AUTOMATION", run.created_by
    manifest = stack.manifest(src + "-tp2")
    assert manifest is not None and manifest["target"]["tp"] == 2 and manifest["source"]["url"] == src
    for other in ("reshard/8to1", "reshard/2to8", "reshard/to-hf"):  # --target 2: only 8to2 fires
        assert {r.id for r in stack.runs_of(other)} == before[other], other


@pytest.mark.slow
def test_sweep_converts_pending_checkpoints_once(stack, sample_factory):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    sample = sample_factory(8)
    root, dest = f"s3://{stack.bucket}/sweep-src", f"s3://{stack.bucket}/sweep-dst"
    stack.upload_sample(sample, f"{root}/runA/global_step1000", ("latest", "global_step1000"))
    stack.upload_sample(sample, f"{root}/runB/final", ("reshard.complete", ""))
    stack.upload_sample(sample, f"{root}/runC/global_step10")  # no marker: still training

    def sweep() -> tuple[Any, list[Any]]:
        out = stack.cli(PREFECT, "deployment", "run", "reshard-sweep/post-training",
                        "--param", f"source_root={json.dumps(root)}", "--param", f"dest_root={json.dumps(dest)}",
                        "--param", "targets=[2]", "--param", f"storage_options={json.dumps(stack.storage_options)}",
                        "--watch", "--watch-interval", "1", "--watch-timeout", str(RUN_TIMEOUT),
                        timeout=RUN_TIMEOUT + 60)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:] + stack.logs()
        runs = [r for r in stack.runs_of("reshard-sweep/post-training") if r.parameters.get("source_root") == root]
        latest = max(runs, key=lambda r: r.created)
        assert latest.state.is_completed()
        with stack.client() as c:
            children = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[latest.id])))
        return latest, children

    t0 = time.monotonic()
    _, children = sweep()
    stack.timings["sweep 1 (2 conversions)"] = time.monotonic() - t0
    assert sorted(r.parameters["params"]["source"] for r in children) == [f"{root}/runA/global_step1000",
                                                                          f"{root}/runB/final"]
    assert all(r.state.is_completed() for r in children)
    outputs = [f"{dest}/runA/global_step1000/tp2", f"{dest}/runB/final/tp2"]
    manifests = [stack.manifest(u) for u in outputs]
    assert all(manifests), outputs
    assert stack.manifest(f"{dest}/runC/global_step10/tp2") is None

    t0 = time.monotonic()
    _, children = sweep()
    stack.timings["sweep 2 (nothing to do)"] = time.monotonic() - t0
    assert children == [], "a second sweep must convert nothing"
    assert [stack.manifest(u) for u in outputs] == manifests


@pytest.mark.slow
def test_two_workers_on_the_gpu_pool_run_8to2_conversions_in_parallel(stack, sample_factory, tmp_path):
    """Two process workers on the ``gpu`` pool, one run at a time each and nothing shared but S3
    and the server (their own HOME, shard cache and result folder): two ``reshard/8to2`` runs
    submitted together are taken one by each and run at the same time, each committing what
    ``--direct`` writes."""
    from prefect.client.schemas.filters import WorkerFilter, WorkerFilterStatus

    stop(stack.worker, grace=20)  # from here on only these two workers take runs
    workers, logs = {}, {}
    for name in ("gpu-a", "gpu-b"):
        home = stack.root / name
        (home / "home").mkdir(parents=True)
        logs[name] = home / "worker.log"
        env = dict(stack.env, HOME=str(home / "home"), RESHARD_CACHE_DIR=str(home / "cache"),
                   PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"))
        workers[name] = spawn([PREFECT, "worker", "start", "--pool", "gpu", "--name", name, "--limit", "1"], env,
                              logs[name], cwd=stack.root)
    try:
        def online():
            with stack.client() as c:
                up = c.read_workers_for_work_pool("gpu", worker_filter=WorkerFilter(
                    status=WorkerFilterStatus(any_=["ONLINE"])))
            return {w.name for w in up} >= set(workers)

        wait_for(online, 90, "both gpu workers to come online", on_timeout=stack.logs)
        sample = sample_factory(8)
        sources = [f"s3://{stack.bucket}/parallel/run{i}/global_step1000" for i in (1, 2)]
        for src in sources:
            stack.upload_sample(sample, src)
        dep = stack.deployment("reshard/8to2")
        with stack.client() as c:  # both submitted at once, as `prefect deployment run` would
            runs = [c.create_flow_run_from_deployment(dep.id, parameters={"source": src,
                                                                          "storage_options": stack.storage_options})
                    for src in sources]
        finals = [stack.wait_final(r.id) for r in runs]
        # a worker that loses the race for a run logs its attempt, then "Aborted submission of flow run '<id>'"
        texts = {name: tail(log, 1_000_000) for name, log in logs.items()}
        taken = {name: [str(r.id) for r in runs if str(r.id) in text
                        and f"Aborted submission of flow run '{r.id}'" not in text] for name, text in texts.items()}
        assert sorted(len(v) for v in taken.values()) == [1, 1], (taken, stack.logs())
        (a, b) = finals
        assert a.start_time < b.end_time and b.start_time < a.end_time, "the two runs did not overlap"
        expected = _expected_shards(sample, tmp_path, 2)
        for src in sources:
            manifest = stack.manifest(src + "-tp2")
            assert manifest is not None and _shards(manifest) == expected
    finally:
        for proc in workers.values():
            stop(proc, grace=20)


@pytest.mark.slow
def test_reshard_serve_registers_the_same_and_runs_it(stack, sample_factory):
    """Last: `reshard serve` takes over 8to1 and the sweep (same names, parameters, schedule and
    trigger; no work pool) and executes a run itself."""
    def snapshot(name: str) -> tuple[Any, ...]:
        dep = stack.deployment(name)
        with stack.client() as c:
            autos = [a for a in c.read_automations()
                     if a.actions and getattr(a.actions[0], "deployment_id", None) == dep.id]
        return (dep.parameters, sorted((s.schedule.cron, s.active) for s in dep.schedules),
                [(a.trigger.model_dump(mode="json"), a.actions[0].parameters) for a in autos],
                dep.entrypoint.replace(":", "."))

    names = ("reshard/8to1", "reshard-sweep/post-training")
    deployed = {n: (snapshot(n), stack.deployment(n).updated) for n in names}
    stop(stack.worker, grace=20)  # from here on only the served process can execute runs
    log = stack.root / "serve.log"
    t0 = time.monotonic()
    proc = spawn([sys.executable, "-m", "reshard.cli", "serve", "--file", str(PREFECT_YAML), "8to1", "post-training"],
                 stack.env, log, cwd=stack.root)
    try:
        wait_for(lambda: proc.poll() is None and "polling for scheduled runs" in tail(log), 90,
                 "reshard serve to register its deployments and poll", on_timeout=lambda: tail(log))
        stack.timings["reshard serve up"] = time.monotonic() - t0
        for n in names:  # re-registered by serve, identical to what prefect deploy registered
            assert stack.deployment(n).updated > deployed[n][1], n
            assert snapshot(n) == deployed[n][0], n
        src = f"s3://{stack.bucket}/ckpts/run7/global_step1000"  # shards already in the worker's cache
        stack.upload_sample(sample_factory(8), src)
        t0 = time.monotonic()
        out = stack.cli(PREFECT, "deployment", "run", "reshard/8to1", "--param", f"source={json.dumps(src)}",
                        "--watch", "--watch-interval", "1", "--watch-timeout", str(RUN_TIMEOUT),
                        timeout=RUN_TIMEOUT + 60)
        stack.timings["served run 8to1"] = time.monotonic() - t0
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:] + tail(log)
        run = [r for r in stack.runs_of("reshard/8to1") if r.parameters.get("source") == src][0]
        assert str(run.id) in tail(log, 100_000), "the served process should have run it"
        assert stack.manifest(src + "-tp1") is not None
    finally:
        stop(proc, grace=20)
