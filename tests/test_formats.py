"""Formats are plug-ins: a registry in the style of fsspec's (a private dict behind a read-only
view, conflicting registration raises), and a format defined in the tests folder
(``plugin_format.py``: one safetensors file per rank) reshards through the CLI, ``--direct`` and
the Prefect flow with no edit inside reshard — read, planned, written in its own layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import load_modules
from plugin_format import SafetensorsPerRank, read_modules, write_as_safetensors
from reshard.cli import main
from reshard.core.options import ReshardOptions
from reshard.direct import run_direct
from reshard.formats import (
    CheckpointFormat,
    available,
    get_format,
    listing_patterns,
    locate,
    register_format,
    registry,
    unregister_format,
)
from reshard.storage.manifest import MANIFEST_NAME


@pytest.fixture
def plugin():
    fmt = register_format(SafetensorsPerRank)
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)


def _pt(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".pt"}


def test_builtin_formats_in_detection_order():
    names = [f.name for f in available()]
    assert names[:6] == ["torch_dist", "megatron", "deepspeed-pipeline", "deepspeed", "deepspeed-zero3",
                         "deepspeed-descriptor"]
    assert get_format("deepspeed").name == "deepspeed"
    with pytest.raises(KeyError, match="no checkpoint format 'nope'"):
        get_format("nope")


def test_the_registry_is_read_only_and_refuses_a_conflicting_registration(plugin):
    with pytest.raises(TypeError):
        registry["x"] = plugin  # type: ignore[index]

    class Other(CheckpointFormat):
        name = plugin.name

        def locate(self, path):
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register_format(Other)
    assert registry[plugin.name] is plugin
    register_format(SafetensorsPerRank)  # the same format again: no conflict
    assert isinstance(register_format(Other, clobber=True), Other)
    register_format(SafetensorsPerRank, clobber=True)


def test_a_registered_format_is_located_and_discovered(plugin, sample_factory, tmp_path):
    src = write_as_safetensors(sample_factory(4, 2.0), tmp_path / "st")
    located = locate(src)
    assert located.format == plugin.name and [f.name for f in located.files] == \
        [f"rank-{r:02d}.safetensors" for r in range(4)]
    assert any(p.search("run/rank-00.safetensors") for p in listing_patterns())
    unregister_format(plugin.name)
    with pytest.raises(Exception, match="holds no complete checkpoint reshard reads"):
        locate(src)


def _same_modules(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in y)


def test_a_plugin_format_reshards_through_direct_cli_and_flow(plugin, sample_factory, tmp_path, prefect_env, capsys):
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    ref = sample_factory(4, 2.0)
    run_direct(str(ref), str(tmp_path / "ref"), ReshardOptions(target_tp=2))  # the built-in layout, TP 2
    src = write_as_safetensors(ref, tmp_path / "st")
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(target_tp=2))
    assert main(["run", "--direct", str(src), str(tmp_path / "cli"), "--target-tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("committed")
    run_flow(ReshardParams(source=str(src), destination=str(tmp_path / "flow"), target_tp=2,
                           cache_dir=str(tmp_path / "cache")))
    want = load_modules(tmp_path / "ref")
    for out in ("direct", "cli", "flow"):
        names = sorted(p.name for p in (tmp_path / out).iterdir())
        assert names == ["rank-00.safetensors", "rank-01.safetensors", MANIFEST_NAME], (out, names)
        _same_modules(read_modules(tmp_path / out), want)
    # and back to TP 4 in its own format: the original tensors
    run_direct(str(tmp_path / "direct"), str(tmp_path / "back"), ReshardOptions(target_tp=4))
    _same_modules(read_modules(tmp_path / "back"), read_modules(src))


def test_the_flow_checks_each_plugin_file_with_the_plugins_own_reader(plugin, sample_factory, tmp_path, prefect_env):
    from reshard.core.errors import CheckpointFormatError
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow
    from reshard.formats import classify

    src = write_as_safetensors(sample_factory(4, 2.0), tmp_path / "st")
    names = sorted(p.name for p in src.iterdir())
    kind = classify(names)["rank-03.safetensors"]
    assert (kind.marker, kind.reader, kind.checker, kind.role) == (False, plugin.name, plugin.name, "rank")
    bad = src / "rank-03.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    from reshard.formats import check_file

    with pytest.raises(CheckpointFormatError, match="cannot read safetensors"):  # what the check-shard task runs
        check_file(str(bad), kind.checker, kind.role, "auto", str(bad))
    with pytest.raises(CheckpointFormatError, match="cannot read safetensors") as info:
        run_flow(ReshardParams(source=str(src), destination=str(tmp_path / "out"), target_tp=2,
                               cache_dir=str(tmp_path / "cache")))
    assert info.value.culprit == str(bad)


def test_discovery_classifies_each_listed_object_once_for_the_whole_flow(plugin, sample_factory, tmp_path,
                                                                         prefect_env, monkeypatch):
    """The formats classify the listing once, in discovery; fetch order, streaming and the per-shard
    checks read that record (carried between tasks) instead of asking the formats again."""
    import reshard.discovery
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    calls: list[list[str]] = []
    real = reshard.discovery.classify
    monkeypatch.setattr(reshard.discovery, "classify", lambda names: calls.append(list(names)) or real(names))
    src = write_as_safetensors(sample_factory(4, 2.0), tmp_path / "st")
    run_flow(ReshardParams(source=str(src), destination=str(tmp_path / "out"), target_tp=2,
                           cache_dir=str(tmp_path / "cache")))
    assert calls == [sorted(p.name for p in src.iterdir())]


def test_a_format_that_cannot_write_is_refused_in_one_typed_error(sample_factory, tmp_path):
    from reshard.core.errors import LayoutError
    from reshard.execution.planner import build_plan

    class ReadOnly(SafetensorsPerRank):
        name = "test-read-only"
        priority = 40
        target_name = CheckpointFormat.target_name

        def locate(self, path):
            import dataclasses

            return dataclasses.replace(super().locate(path), format=self.name)

    fmt = register_format(ReadOnly)
    try:
        src = write_as_safetensors(sample_factory(4, 2.0), tmp_path / "st")
        with pytest.raises(LayoutError, match="test-read-only format is read-only") as info:
            build_plan(str(src), ReshardOptions(target_tp=2))
        assert info.value.hint and info.value.culprit == str(src)
    finally:
        unregister_format(fmt.name)


def test_registry_functions_pickle_by_reference():
    """Dask ships Prefect task functions pickled by value, with the globals they use: the registry's
    entry points must pickle by reference, not drag the registry (and its lock) along."""
    import pickle

    from reshard.formats import available, get_format
    from reshard.models.registry import families

    for fn in (get_format, available, register_format, unregister_format, families):
        assert pickle.loads(pickle.dumps(fn)) is fn


def test_the_iteration_tracker_text_and_its_folder_are_inverse():
    from reshard.core.source import iteration_dir, iteration_text

    for folder in ("iter_0001000", "iter_0000000", "release"):
        assert iteration_dir(iteration_text(folder)) == folder
    assert iteration_dir(" 7\n") == "iter_0000007"
    assert iteration_dir("../etc") is None and iteration_dir("") is None


@pytest.mark.parametrize("sizes,limit,groups", [
    ([4, 4, 4], 8, [0, 2]), ([4, 9, 1], 8, [0, 1, 2]), ([9, 0, 4], 8, [0, 2]), ([0, 9, 0, 0], 8, [0]),
    ([8, 8], 8, [0, 1]), ([4, 4], None, [0]), ([], 8, [0]),
])
def test_size_groups_cut_between_tensors_and_never_start_a_file_with_no_bytes(sizes, limit, groups):
    """The cut behind ``--max-shard-size`` (hf and torch_dist outputs): a file never exceeds the
    limit unless it is one tensor; entries of no bytes stay with the tensor before them."""
    from reshard.formats.base import size_groups

    assert size_groups(sizes, limit) == groups
