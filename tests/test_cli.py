"""CLI commands other than run's error paths: inspect, plan, verify (and tamper detection)."""

from __future__ import annotations

import json

from reshard.cli import main


def test_inspect_reports_format_version_tp_dtype_and_size(sample_factory, capsys):
    src = sample_factory(8, 1.0, "bf16")
    assert main(["inspect", str(src), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["format"] == "deepspeed" and rec["tp"] == 8 and rec["version"] == 1.0
    assert rec["dtypes"] == ["bfloat16"] and rec["num_heads"] == 8 and rec["zero_stage"] == 1
    # 2 layers of (3h^2+3h + h^2+h + 4h^2+4h + 4h^2+h + 4h) + embeddings + final LN, h=64, vocab 128, seq 16
    h = 64
    per_layer = 12 * h * h + 13 * h
    assert rec["parameters"] == 2 * per_layer + 128 * h + 16 * h + 2 * h
    assert rec["bytes"] == sum(p.stat().st_size for p in src.iterdir())


def test_inspect_prints_sizes_in_binary_units_and_only_what_the_checkpoint_records(sample_factory, capsys):
    from reshard.cli_progress import fmt_bytes

    src = sample_factory(8, 1.0, "bf16")
    size = sum(p.stat().st_size for p in src.iterdir())
    capsys.readouterr()
    assert main(["inspect", str(src)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "format       deepspeed (DeepSpeed mp_rank_XX_model_states)"
    assert f"size         {fmt_bytes(size)} in 8 files" in lines and fmt_bytes(size).endswith(" KiB")
    assert "dtypes       bfloat16" in lines and "version      1.0" in lines and "zero_stage   1" in lines
    assert not any(ln.startswith(("bytes", "layout", "architecture", "quantization", "moe ")) for ln in lines)


def test_the_run_summary_names_the_formats_and_the_changed_degree(sample_factory, tmp_path, capsys):
    capsys.readouterr()
    assert main(["run", "--direct", str(sample_factory(8, 2.0)), str(tmp_path / "tp2"), "--target-tp", "2"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith(f"committed {tmp_path / 'tp2'}: deepspeed -> deepspeed, TP 8 -> 2, 3 files, "), head


def test_plan_shows_which_sources_feed_each_target(sample_factory, capsys):
    assert main(["plan", str(sample_factory(8, 2.0)), "--target-tp", "2", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert [t["sources"] for t in rec["targets"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rec["unused_rules"] == ["final_linear"]
    assert rec["peak_memory_estimate"] > 0 and rec["bytes_written"] > 0
    assert main(["plan", str(sample_factory(2, 2.0)), "--target-tp", "8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert [t["sources"] for t in rec["targets"]] == [[0]] * 4 + [[1]] * 4


def test_verify_detects_tampering(sample_factory, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert main(["run", "--direct", str(sample_factory(8, 2.0)), str(dst), "--target-tp", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["target_tp"] == 2 and len(summary["files"]) == 3
    assert main(["verify", str(dst)]) == 0
    f = dst / "mp_rank_01_model_states.pt"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(dst)]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 2


def test_output_loads_with_plain_torch_load_and_deepspeed_descriptor(sample_factory, tmp_path):
    import torch
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    dst = tmp_path / "dst"
    assert main(["run", "--direct", str(sample_factory(8, 2.0)), str(dst), "--target-tp", "4"]) == 0
    desc = json.loads((dst / "ds_checkpoint.json").read_text())
    files = [str(dst / f) for f in desc["checkpoints"]]
    loader = SDLoaderFactory.get_sd_loader(files, None, desc["type"], desc["version"])
    _, sd, _ = loader.load(4, 3)
    plain = torch.load(files[3], weights_only=False)  # what Megatron/DeepSpeed do
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):  # default weights-only + args
        assert torch.load(files[3])["mp_world_size"] == 4
    assert all(torch.equal(sd["module"][k], plain["module"][k]) for k in plain["module"])
