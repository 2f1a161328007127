"""Formats are plug-ins: a registry in the style of fsspec's (a private dict behind a read-only
view, conflicting registration raises), and a format defined in the tests folder
(``plugin_format.py``) reshards through the CLI, ``--direct`` and the Prefect flow with no edit
inside reshard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plugin_format import ShardOfFormat, write_as_shard_of
from reshard.cli import main
from reshard.core.options import ReshardOptions
from reshard.direct import run_direct
from reshard.formats import (CheckpointFormat, available, get_format, listing_patterns, locate, register_format,
                             registry, unregister_format)
from reshard.storage.manifest import MANIFEST_NAME


@pytest.fixture
def plugin():
    fmt = register_format(ShardOfFormat)
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)


def _pt(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".pt"}


def test_builtin_formats_in_detection_order():
    names = [f.name for f in available()]
    assert names[:5] == ["megatron", "deepspeed-pipeline", "deepspeed", "deepspeed-zero3", "deepspeed-descriptor"]
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
    register_format(ShardOfFormat)  # the same format again: no conflict
    assert isinstance(register_format(Other, clobber=True), Other)
    register_format(ShardOfFormat, clobber=True)


def test_a_registered_format_is_located_and_discovered(plugin, sample_factory, tmp_path):
    src = write_as_shard_of(sample_factory(4, 2.0), tmp_path / "shards")
    assert [f.name for f in locate(src).files] == [f"shard-{r:02d}-of-04.pt" for r in range(4)]
    assert any(p.search("run/shard-00-of-04.pt") for p in listing_patterns())
    unregister_format(plugin.name)
    with pytest.raises(Exception, match="holds no mp_rank_XX_model_states.pt files"):
        locate(src)


def test_a_plugin_format_reshards_through_direct_cli_and_flow(plugin, sample_factory, tmp_path, prefect_env, capsys):
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    ref = sample_factory(4, 2.0)
    run_direct(str(ref), str(tmp_path / "ref"), ReshardOptions(target_tp=2))
    src = write_as_shard_of(ref, tmp_path / "shards")
    run_direct(str(src), str(tmp_path / "direct"), ReshardOptions(target_tp=2))
    assert main(["run", "--direct", str(src), str(tmp_path / "cli"), "--target-tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("committed")
    run_flow(ReshardParams(source=str(src), destination=str(tmp_path / "flow"), target_tp=2,
                           cache_dir=str(tmp_path / "cache")))
    for out in ("direct", "cli", "flow"):
        assert _pt(tmp_path / out) == _pt(tmp_path / "ref"), out
        assert (tmp_path / out / MANIFEST_NAME).is_file()
    assert re.match(r"mp_rank_0[01]_model_states\.pt", sorted(_pt(tmp_path / "flow"))[0])
