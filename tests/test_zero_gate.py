"""The pipeline's ZeRO gate: source config from the shards, optional target config, before any transfer."""

from __future__ import annotations

import json

from reshard.cli import main


def test_zero3_source_is_refused_with_an_explanation(sample_factory, tmp_path, capsys):
    src = sample_factory(8, 2.0, zero_stage=3)
    code = main(["run", "--direct", str(src), str(tmp_path / "dst"), "--target-tp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "ZeRO stage 3" in err and "placeholders" in err
    assert "zero_to_fp32" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "dst").exists()


def test_zero2_source_converts(sample_factory, tmp_path):
    src = sample_factory(8, 2.0, zero_stage=2)
    assert main(["run", "--direct", str(src), str(tmp_path / "dst"), "--target-tp", "2"]) == 0


def test_incompatible_target_config_fails_before_any_transfer(sample_factory, tmp_path, capsys):
    cfg = tmp_path / "target.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2,
                                                     "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    code = main(["run", "--direct", str(sample_factory(8, 2.0)), str(tmp_path / "dst"), "--target-tp", "2",
                 "--target-config", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "ratio" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "dst").exists()
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert main(["run", "--direct", str(sample_factory(8, 2.0)), str(tmp_path / "dst"), "--target-tp", "2",
                 "--target-config", str(cfg)]) == 0


def test_validate_config_cli(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e8}}))
    assert main(["validate-config", str(good), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "prefetch_bucket_size" in json.dumps(out)
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 5, "overlap_com": true}}')
    assert main(["validate-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "zero_optimization.stage" in err and "overlap_comm" in err
