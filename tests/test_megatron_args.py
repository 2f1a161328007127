"""The ``args`` reshard writes are Megatron-LM's own: every key its ``parse_args`` + ``validate_args``
leave for the model, with their values, as megatron-core 0.19.2's parser gives them for the model's
command line (the snapshots under ``tests/fixtures/realtools/megatron-lm-args/``, written in the side
environment by ``tests/realtools/args_snapshots.py``; this test needs neither it nor megatron-core 0.19).

Checked for each kind of model reshard makes ``args`` for: a Hugging Face import (GPT-2, Llama,
Mixtral, DeepSeek-V3) and a Megatron-Bridge checkpoint (its ``run_config.yaml``), in both the per-rank
files and torch_dist's ``common.pt``; and the written ``args`` unpickle under megatron-core 0.16.1's own
safe globals (what its loader allows), so the outputs load there too.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.core.foreign import Foreign
from reshard.core.safe_load import load_shard
from reshard.models import megatron_args

REALTOOLS = Path(__file__).resolve().parent / "fixtures" / "realtools"
SNAPSHOTS = REALTOOLS / "megatron-lm-args"
BRIDGE = REALTOOLS / "megatron-bridge-0.6.2"

#: Keys the output's layout and files decide, not the model: its degrees, format, the layer
#: implementation its names follow (reshard's imports write megatron-core's local spec; a Megatron-Bridge
#: checkpoint records its own), the padded vocabulary (Megatron-LM's tokenizer sets it after
#: validate_args, so the snapshots hold None), and that a torch_dist output holds no optimizer or RNG state.
LAYOUT = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
          "expert_tensor_parallel_size", "ckpt_format", "transformer_impl", "padded_vocab_size", "world_size",
          "data_parallel_size", "use_dist_ckpt", "no_save_optim", "no_save_rng"}
#: Keys reshard writes beyond megatron-core 0.19's: the names older Megatron-LM reads (``norm_epsilon``
#: before 0.19, ``use_legacy_models``), YaRN's widths, which MLA's config takes from ``args`` by name though
#: no 0.19 flag sets them, and reshard's record of a Hugging Face model's token ids (for its export).
EXTRA = {"norm_epsilon", "use_legacy_models", "beta_fast", "beta_slow", "original_max_position_embeddings",
         "hf_token_ids"}
#: A Megatron-Bridge checkpoint's own record where it differs from the snapshot's command line: its
#: DeepSeek-V3 trains with the sequence-wise auxiliary loss.
BRIDGE_RECORDS = {"deepseek-v3": {"moe_router_load_balancing_type": "seq_aux_loss"}}


def _hf_folder(kind: str, root: Path) -> Path:
    """The Hugging Face folder of ``kind``: a real-tool fixture's, or made here (the GPT-2 and Mixtral
    models of the snapshots' command lines, bf16)."""
    if kind in ("llama", "deepseek-v3"):
        return BRIDGE / kind / "hf"
    import transformers

    folder = root / f"hf-{kind}"
    if not folder.is_dir():
        if kind == "gpt2":
            config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                             n_inner=256, activation_function="gelu_new", layer_norm_epsilon=1e-5)
        else:
            config = transformers.MixtralConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


#: (kind, source) pairs: each kind's Hugging Face import, and Megatron-Bridge's checkpoints
CASES = [(k, "hf") for k in ("gpt2", "llama", "mixtral", "deepseek-v3")] + \
        [(k, "bridge") for k in ("llama", "deepseek-v3")]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[tuple[str, str, str], Any]:
    """(kind, source, output) -> the ``args`` reshard wrote: per-rank (TP 1) and torch_dist's ``common.pt``."""
    from reshard import api

    root = tmp_path_factory.mktemp("megatron_args")
    out: dict[tuple[str, str, str], Any] = {}
    for kind, source in CASES:
        src = _hf_folder(kind, root) if source == "hf" else BRIDGE / kind / "checkpoint"
        for output, options in (("per-rank", {"target_tp": 1}), ("torch_dist", {"to": "torch_dist"})):
            dst = root / f"{kind}-{source}-{output}"
            api.convert(str(src), str(dst), **options)
            f = next(dst.rglob("model_optim_rng.pt" if output == "per-rank" else "common.pt"))
            out[kind, source, output] = load_shard(f, mmap=False)["args"]
    return out


def snapshot(kind: str) -> dict[str, Any]:
    return json.loads((SNAPSHOTS / f"{kind}.json").read_text())["args"]


def comparable(value: Any) -> Any:
    """An args value as the snapshots hold it (JSON, enums tagged) for comparison."""
    if isinstance(value, Foreign):  # an enum member reshard writes as megatron-core's: class and value
        return ("enum", value.qualname, value.foreign_args)
    if isinstance(value, dict) and "__enum__" in value:
        return ("enum", value["__enum__"], (value["value"],))
    if isinstance(value, dict):
        return comparable(megatron_args.decode(value))
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v) for v in value)
    return value


@pytest.mark.parametrize("output", ["per-rank", "torch_dist"])
@pytest.mark.parametrize(("kind", "source"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_written_args_are_megatron_lms_own_for_the_model(written, kind, source, output):
    args = vars(written[kind, source, output])
    want = snapshot(kind)
    left_out = set(megatron_args.table()["left_out"])
    assert not (set(want) - left_out) - set(args), f"missing: {sorted((set(want) - left_out) - set(args))}"
    assert not set(args) - set(want) - EXTRA, f"not Megatron-LM's: {sorted(set(args) - set(want) - EXTRA)}"
    records = BRIDGE_RECORDS.get(kind, {}) if source == "bridge" else {}
    differ = {k: (comparable(args[k]), comparable(want[k])) for k in sorted(set(want) - left_out - LAYOUT)
              if comparable(args[k]) != comparable(records.get(k, want[k]))}
    assert not differ, f"(written, Megatron-LM's): {differ}"


def test_the_defaults_table_and_the_snapshots_come_from_one_parser():
    """Every key of a snapshot is the table's (a default, a model key or one left out) and back: the
    table reshard completes from and the test authority were generated from one megatron-core."""
    t = megatron_args.table()
    keys = set(t["defaults"]) | set(t["model_keys"]) | set(t["left_out"])
    for f in sorted(SNAPSHOTS.glob("*.json")):
        snap = json.loads(f.read_text())
        assert set(snap["args"]) == keys, f.name
        assert snap["versions"]["megatron-core"] == t["versions"]["megatron-core"]


def test_the_written_args_unpickle_under_megatron_core_016s_safe_globals(written):
    """megatron-core loads ``common.pt`` (and Megatron-LM its per-rank files) weights-only, allowing
    the globals of its ``megatron.core.safe_globals``: 0.16.1's lacks 0.18's enums, which are left out."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    for key, args in written.items():
        buf = io.BytesIO()
        from reshard.core import foreign

        foreign.save({"args": args}, buf)
        buf.seek(0)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            loaded = torch.load(buf, weights_only=True)["args"]
        assert vars(loaded).keys() == vars(args).keys(), key
