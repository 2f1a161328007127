"""Import of Hugging Face safetensors folders into megatron-core layouts, checked against transformers.

Sources are tiny random models made by transformers from a config (fixed seed; norms made
distinct from ones), saved with ``save_pretrained``: Llama with GQA (untied, a vocabulary of 200
that Megatron pads to 256, a rotary base and epsilon other than the defaults, sharded into
several files), Llama tied, Qwen2 (QKV biases), GPT-2 (gelu_new, Conv1D weights, tied). Each is
imported at TP 1 and 2 (Llama also into torch_dist); megatron-core builds the model **from the
checkpoint's own saved args** (as ``--use-checkpoint-args`` would), loads it strictly and must
give transformers' logits on the
true vocabulary within 2e-5. The same comparison catches each plausible wrong import far above
that bound: :func:`test_the_logits_comparison_catches_each_plausible_wrong_import`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_fixtures import TOKENS, edit_saved_args, mcore_forward, mcore_forward_dist, needs_mcore
from quantized_releases import ct_dequantized, make_ct_folder, make_modelopt_folder
from reshard.cli import main
from reshard.core.lazy import Converted, RowConcat
from reshard.core.safe_load import load_shard
from reshard.models import hf_architectures as arch
from reshard.models.hf_llama import LLAMA_NAMES

pytestmark = needs_mcore
TOL = 2e-5
_SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
          "max_position_embeddings": 64}
#: name -> (transformers config class, its arguments, save_pretrained's max_shard_size)
MODELS = {
    "llama": ("LlamaConfig", {**_SMALL, "num_key_value_heads": 2, "vocab_size": 200, "rms_norm_eps": 1e-6,
                              "rope_theta": 50000.0, "tie_word_embeddings": False}, "100KB"),
    "llama_tied": ("LlamaConfig", {**_SMALL, "num_key_value_heads": 4, "vocab_size": 256,
                                   "tie_word_embeddings": True}, None),
    # Mistral without its sliding window: Llama's arithmetic (no bias keys in its config)
    "mistral": ("MistralConfig", {**_SMALL, "num_key_value_heads": 2, "vocab_size": 256, "rope_theta": 1e6,
                                  "sliding_window": None, "tie_word_embeddings": False}, None),
    # Mistral-7B-v0.1's kind: a sliding window on every layer, here 4 tokens (shorter than the 12 test tokens)
    "mistral_window": ("MistralConfig", {**_SMALL, "num_key_value_heads": 2, "vocab_size": 256, "rope_theta": 1e6,
                                         "sliding_window": 4, "tie_word_embeddings": False}, None),
    "qwen2": ("Qwen2Config", {**_SMALL, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-6,
                              "rope_theta": 1e6, "tie_word_embeddings": False}, None),
    # Qwen3: query/key RMSNorm per head, a head dim above hidden / heads
    "qwen3": ("Qwen3Config", {**_SMALL, "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16,
                              "rope_theta": 1e6, "tie_word_embeddings": False}, None),
    # GPT-2: LayerNorm, gelu_new (Megatron's --openai-gelu), learned positions, Conv1D weights, tied
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 8, "n_positions": 64, "vocab_size": 250,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, None),
}


def make_hf_model(name: str, folder: Path) -> torch.Tensor:
    """Save model ``name`` (random, seeded) to ``folder``; its transformers logits for the test tokens."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cls, kw, shard = MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw, initializer_range=0.1))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))  # distinct from ones: a misplaced norm must show
    model.eval()
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


#: Quantized releases imported at TP 2 (``tests/quantized_releases.py``; all of them, bit for bit to
#: bf16, in ``tests/test_quantized_releases.py``).
QUANTIZED = ("w4a16_asym", "fp8_channel", "nvfp4", "modelopt")

#: FP8 blocks that leave partial blocks in both dimensions of the small models' projections
#: (q_proj [64, 64], k_proj [16, 64], gate_proj [96, 64], down_proj [64, 96]).
FP8_BLOCK = (32, 48)


def fp8_reference(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's dequantization of one weight, written out block by block (independent of reshard)."""
    out = torch.empty(q.shape, dtype=dtype)
    b0, b1 = FP8_BLOCK
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            out[blk] = (q[blk].to(torch.float32) * s[i, j]).to(dtype)
    return out


def randomized(model_class: Any, config: Any, seed: int = 0) -> Any:
    """``model_class(config)`` in eval mode with random weights the tests can tell apart (norms
    around 1) and a random router ``e_score_correction_bias`` (a buffer transformers leaves at 0)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def tensors_folder(tensors: dict[str, torch.Tensor], like: Path, dst: Path) -> Path:
    """A plain one-file folder of ``tensors`` (transformers' names) with ``like``'s config.json."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text((like / "config.json").read_text())
    return dst


def make_fp8_folder(src: Path, dst: Path, dtype: torch.dtype,
                    linear: str = r"_proj\.weight$") -> dict[str, torch.Tensor]:
    """``src`` as an FP8 block-scaled checkpoint (DeepSeek's layout: every projection of attention and
    MLP — the weights whose names match ``linear`` — float8_e4m3fn with a float32 ``weight_scale_inv``
    per block, the rest in ``dtype``, one file, ``quantization_config`` in config.json); returns the
    tensors the model computes with (each FP8 weight dequantized by :func:`fp8_reference`)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    stored, model = {}, {}
    b0, b1 = FP8_BLOCK
    for key, w in sorted(tensors.items()):
        if not re.search(linear, key):
            stored[key] = model[key] = w.to(dtype)
            continue
        rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
        s = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                s[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448
        per = s.repeat_interleave(b0, 0)[:w.shape[0]].repeat_interleave(b1, 1)[:, :w.shape[1]]
        q = (w.float() / per).clamp(-448, 448).to(torch.float8_e4m3fn)
        stored[key], stored[key + "_scale_inv"] = q, s
        model[key] = fp8_reference(q, s, dtype)
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.update(dtype=str(dtype).removeprefix("torch."), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)})
    (dst / "config.json").write_text(json.dumps(config))
    return model


def transformers_logits(folder: Path, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' logits for the test tokens of the model in ``folder``'s config with ``tensors``."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0]


def _import(src: Path, out: Path, *extra: str) -> Path:
    assert main(["run", "--direct", str(src), str(out), *extra]) == 0
    return out


def _wrong_qkv_order(self, names, parts, facts):
    q, k, v = parts  # all queries, then all keys, then all values: not grouped per query group
    return RowConcat([(q, 0, q.shape[0]), (k, 0, k.shape[0]), (v, 0, v.shape[0])])


def _swapped_kv(self, names, parts, facts):
    return _GATHER[arch.QKVSplit](self, names, [parts[0], parts[2], parts[1]], facts)


def _swapped_gate_up(self, names, parts, facts):
    return _GATHER[arch.GatedSplit](self, names, [parts[1], parts[0]], facts)


def _c_attn_only_transposed(self, names, parts, facts):
    w = parts[0]  # [q; k; v] rows kept as GPT-2 stores them: megatron-core wants [q, k, v] per head
    return Converted(w, lambda t: t.t().contiguous() if t.dim() == 2 else t, tuple(reversed(w.shape)))


_GATHER = {arch.QKVSplit: arch.QKVSplit.gather, arch.GatedSplit: arch.GatedSplit.gather}
#: plausible wrong imports: (transform class, wrong gather) or an edit of the saved args
WRONG = {
    "QKV rows not grouped per query group": (arch.QKVSplit, _wrong_qkv_order),
    "K and V swapped": (arch.QKVSplit, _swapped_kv),
    "gate and up swapped": (arch.GatedSplit, _swapped_gate_up),
    "rotary base 10000 instead of 50000": {"rotary_base": 10000.0},
    "epsilon 1e-5 instead of 1e-6": {"norm_epsilon": 1e-5},
    "gpt2: exact gelu instead of gelu_new": {"openai_gelu": False},
    "gpt2: c_attn not reordered per head": (arch.GPT2QKV, _c_attn_only_transposed),
    "mistral_window: window one token wider": {"window_size": (4, 0)},
    "mistral_window: window one token narrower": {"window_size": (2, 0)},
    "mistral_window: window not written": {"window_size": None},
}


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
    """Every model imported at TP 1 and 2 (llama also into torch_dist, and wrongly in each way of
    :data:`WRONG`), and megatron-core's logits for each — one harness run for all."""
    root = tmp_path_factory.mktemp("hf_import")
    hf, want, runs = {}, {}, {}
    for name in MODELS:
        hf[name] = root / "hf" / name
        want[name] = make_hf_model(name, hf[name])
        for tp in (1, 2):
            runs[(name, tp)] = _import(hf[name], root / f"{name}_tp{tp}", "--target-tp", str(tp))
    dist = _import(hf["llama"], root / "llama_dist", "--to", "torch_dist")
    hf["llama_fp8"] = root / "hf" / "llama_fp8"  # FP8 block-scaled, read as the float32 model it encodes
    want["llama_fp8"] = transformers_logits(hf["llama"], make_fp8_folder(hf["llama"], hf["llama_fp8"], torch.float32))
    runs[("llama_fp8", 2)] = _import(hf["llama_fp8"], root / "llama_fp8_tp2", "--target-tp", "2")
    for scheme in QUANTIZED:  # releases written by compressed-tensors and ModelOpt, read as the float32 models
        name = f"llama_{scheme}"
        hf[name] = root / "hf" / name
        if scheme == "modelopt":
            tensors = make_modelopt_folder(hf["llama"], hf[name], torch.float32)
        else:
            make_ct_folder(hf["llama"], hf[name], scheme, torch.float32, max_shard_size="100KB")
            tensors = ct_dequantized(hf[name], torch.float32)
        want[name] = transformers_logits(hf["llama"], tensors)
        runs[(name, 2)] = _import(hf[name], root / f"{name}_tp2", "--target-tp", "2")
    for what, wrong in WRONG.items():
        out, src = root / f"wrong_{len(runs)}", hf[_model_of(what)]
        if isinstance(wrong, dict):
            edit_saved_args(_import(src, out, "--target-tp", "2"), **wrong)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(wrong[0], "gather", wrong[1])
                _import(src, out, "--target-tp", "2")
        runs[what] = out
    cases = [(None, run, key[1] if isinstance(key, tuple) else 2) for key, run in runs.items()]
    logits = dict(zip(runs, mcore_forward(cases, root / "forward")))
    logits["dist"] = mcore_forward_dist([(None, dist, 2)], root / "forward")[0]
    return {"hf": hf, "want": want, "runs": runs, "logits": logits, "dist": dist}


def _model_of(wrong: str) -> str:
    """The model a :data:`WRONG` entry imports wrongly: the one its ``name:`` prefix names, else llama."""
    return wrong.split(":")[0] if ":" in wrong else "llama"


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got[:, :want.shape[1]] - want).abs().max().item()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_runs_the_import_with_transformers_logits(imported, name, tp):
    diff = _diff(imported["logits"][(name, tp)], imported["want"][name])
    assert diff < TOL, f"{name} at TP {tp}: logits differ by {diff:.2e}"


def test_torch_dist_import_runs_with_transformers_logits(imported):
    assert _diff(imported["logits"]["dist"], imported["want"]["llama"]) < TOL


@pytest.mark.parametrize("what", list(WRONG))
def test_the_logits_comparison_catches_each_plausible_wrong_import(imported, what):
    diff = _diff(imported["logits"][what], imported["want"][_model_of(what)])
    assert diff > 10 * TOL, f"{what}: logits moved only {diff:.2e}"


def test_the_vocabulary_is_padded_as_megatron_pads_it(imported, tmp_path):
    """200 rows at TP 2 with Megatron-LM's default divisor 128: 256 rows, the last 56 zero; the
    args record what Megatron-LM needs to pad alike."""
    sd = [load_shard(f, mmap=False) for f in sorted((imported["runs"][("llama", 2)] / "release").glob("*/*.pt"))]
    emb = torch.cat([s["model"]["embedding.word_embeddings.weight"] for s in sd])
    assert emb.shape[0] == 256 and not emb[200:].any() and emb[:200].abs().sum() > 0
    args = sd[0]["args"]
    assert (args.vocab_size, args.padded_vocab_size, args.make_vocab_size_divisible_by) == (200, 256, 128)
    assert (args.tensor_model_parallel_size, args.rotary_base, args.norm_epsilon) == (2, 50000.0, 1e-6)
    out = _import(imported["hf"]["llama"], tmp_path / "d16", "--target-tp", "2", "--make-vocab-size-divisible-by", "16")
    assert load_shard(out / "release/mp_rank_00/model_optim_rng.pt")["args"].padded_vocab_size == 224


def _as_transformers_4(folder: Path, dst: Path) -> Path:
    """The same model with a transformers 4.x ``config.json`` (rope_theta at the top, torch_dtype)."""
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.46.0"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_transformers_4_config_imports_the_same(imported, tmp_path):
    old = _import(_as_transformers_4(imported["hf"]["llama"], tmp_path / "v4"), tmp_path / "out", "--target-tp", "2")
    new = imported["runs"][("llama", 2)]
    for f in sorted(new.rglob("model_optim_rng.pt")):
        assert (old / f.relative_to(new)).read_bytes() == f.read_bytes(), f


def _refused(capsys, src: Path, dst: Path, needle: str, *extra: str, tp: tuple[str, ...] = ("--target-tp", "2")
             ) -> None:
    capsys.readouterr()
    assert main(["run", "--direct", str(src), str(dst), *tp, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not dst.exists()


def _edited(src: Path, dst: Path, config: dict | None = None, remove: str | None = None,
            index: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if remove:
        (dst / remove).unlink()
    if index:
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        idx["weight_map"].update(index)
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    return dst


def test_folders_that_cannot_be_imported_exactly_are_refused(imported, tmp_path, capsys):
    llama, tied = imported["hf"]["llama"], imported["hf"]["llama_tied"]
    before = {p: p.read_bytes() for p in llama.iterdir()}
    _refused(capsys, _edited(llama, tmp_path / "a", remove="model-00002-of-00004.safetensors"), tmp_path / "o1",
             "model.safetensors.index.json lists model-00002-of-00004.safetensors, which is missing")
    _refused(capsys, _edited(llama, tmp_path / "b", index={"model.norm.weight": "model-00001-of-00004.safetensors"}),
             tmp_path / "o2", "which the index says is in model-00001-of-00004.safetensors")
    _refused(capsys, _edited(llama, tmp_path / "c", config={"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0}}), tmp_path / "o3", "rotary scaling llama3")
    _refused(capsys, _edited(llama, tmp_path / "d", config={"hidden_act": "gelu"}), tmp_path / "o4", "activation gelu")
    _refused(capsys, _edited(llama, tmp_path / "e", config={"architectures": ["PhiForCausalLM"]}), tmp_path / "o5",
             "architecture ['PhiForCausalLM'] is not imported")
    _refused(capsys, _edited(imported["hf"]["mistral"], tmp_path / "e2", config={"sliding_window": 0}),
             tmp_path / "o5b", "config.json: sliding_window 0 is not a positive number of tokens")
    _refused(capsys, _edited(imported["hf"]["qwen2"], tmp_path / "e3", config={"use_sliding_window": True}),
             tmp_path / "o5c", "megatron-core does not compute this Qwen2ForCausalLM exactly: sliding-window attention")
    _refused(capsys, _edited(llama, tmp_path / "f", config={"num_hidden_layers": 3}), tmp_path / "o6",
             "config.json says 3")
    _refused(capsys, _edited(llama, tmp_path / "g", config={"num_key_value_heads": 4}), tmp_path / "o7",
             "config.json implies (64, 32, 32) rows")
    pickled = tmp_path / "bin"
    pickled.mkdir()
    shutil.copy(tied / "config.json", pickled / "config.json")
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, pickled / "pytorch_model.bin")
    _refused(capsys, pickled, tmp_path / "o8", "holds pytorch_model.bin: PyTorch pickle weights")
    assert {p: p.read_bytes() for p in llama.iterdir()} == before  # the source is never modified


def test_the_flow_imports_from_s3_like_direct(imported, tmp_path, s3_server, s3_bucket, monkeypatch, prefect_env):
    """Through the Prefect flow, from S3 (the weights fetched after the plan is laid out from
    config.json and the index): the same files as ``--direct``."""
    from conftest import output_bytes, upload_to_s3
    from reshard.flows.params import ReshardParams
    from reshard.flows.runner import run_flow

    url, so = upload_to_s3(imported["hf"]["llama"], s3_server, s3_bucket, monkeypatch)
    run_flow(ReshardParams(source=url, destination=str(tmp_path / "flow"), storage_options=so, target_tp=2,
                           cache_dir=str(tmp_path / "cache")))
    assert output_bytes(tmp_path / "flow") == output_bytes(imported["runs"][("llama", 2)])
    # listed and fetched with config.json: the generation config transformers saved, carried
    carried = tmp_path / "flow" / "release" / "tokenizer" / "generation_config.json"
    assert carried.read_bytes() == (imported["hf"]["llama"] / "generation_config.json").read_bytes()


def test_an_import_at_two_pipeline_stages_merges_back_to_the_single_stage_import(imported, tmp_path):
    staged = _import(imported["hf"]["llama"], tmp_path / "pp2", "--target-tp", "2", "--target-pp", "2")
    assert sorted(p.parent.name for p in staged.rglob("model_optim_rng.pt")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    merged = _import(staged, tmp_path / "pp1", "--target-tp", "2", "--target-pp", "1")
    want = imported["runs"][("llama", 2)]
    for f in sorted(want.rglob("model_optim_rng.pt")):
        got, ref = load_shard(merged / f.relative_to(want), mmap=False), load_shard(f, mmap=False)
        assert list(got["model"]) == list(ref["model"])
        assert all(v is None or v.equal(got["model"][k]) for k, v in ref["model"].items()), f
        assert vars(got["args"]) == vars(ref["args"])


def test_gpt2_names_without_the_base_model_prefix_import_the_same(imported, tmp_path):
    """The original GPT-2 folders on the hub name tensors ``h.0.attn.c_attn.weight``, ``wte.weight``,
    and hold the attention masks (``h.0.attn.bias``, ``h.0.attn.masked_bias``: buffers, not imported)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "bare"
    shutil.copytree(imported["hf"]["gpt2"], src)
    tensors = load_file(str(src / "model.safetensors"))
    masks = {"h.0.attn.bias": torch.tril(torch.ones(1, 1, 64, 64)), "h.1.attn.masked_bias": torch.tensor(-1e4)}
    save_file({**{k.removeprefix("transformer."): v for k, v in tensors.items()}, **masks},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    out = _import(src, tmp_path / "out", "--target-tp", "2")
    want = imported["runs"][("gpt2", 2)]
    for f in sorted(want.rglob("model_optim_rng.pt")):
        assert (out / f.relative_to(want)).read_bytes() == f.read_bytes(), f


def test_an_export_only_architecture_is_refused_on_import_in_one_line():
    """An architecture reshard writes but does not read (no ``read_config`` of its own) is a clear
    refusal on import, not a KeyError."""
    from reshard.core.errors import LayoutError
    from reshard.models import hf_registry

    class ExportOnly(arch.HFArchitectureFamily):
        name, names = "ExportOnlyForCausalLM", LLAMA_NAMES

    hf_registry.register_hf_architecture(ExportOnly)
    try:
        with pytest.raises(LayoutError, match=r"architecture \['ExportOnlyForCausalLM'\] is not imported"):
            hf_registry.read_config({"architectures": ["ExportOnlyForCausalLM"], "vocab_size": 8}, "config.json")
    finally:
        hf_registry.unregister_hf_architecture("ExportOnlyForCausalLM")


def _st_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_mistral_import_exports_back_as_mistral_bit_for_bit(imported, tmp_path):
    """``--hf-architecture MistralForCausalLM``: the Llama-shaped model written as Mistral (no sliding
    window), every tensor as transformers saved it."""
    out = tmp_path / "mistral"
    assert main(["run", "--direct", str(imported["runs"][("mistral", 2)]), str(out), "--to", "hf",
                 "--hf-architecture", "MistralForCausalLM"]) == 0
    want, got = _st_tensors(imported["hf"]["mistral"]), _st_tensors(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] is None


def test_a_mistral_config_without_sliding_window_has_mistrals_default_window(imported, tmp_path):
    """A config.json without ``sliding_window`` (Mistral-7B-v0.1's says 4096) has MistralConfig's
    default window, 4096 tokens: Megatron-LM's window_size (4095, 0) on every layer."""
    src = _edited(imported["hf"]["mistral"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["sliding_window"]
    (src / "config.json").write_text(json.dumps(cfg))
    args = load_shard(_import(src, tmp_path / "out", "--target-tp", "1") / "release/mp_rank_00/model_optim_rng.pt")[
        "args"]
    assert (args.window_size, args.window_attn_skip_freq) == ((4095, 0), None)


def test_a_windowed_mistral_comes_back_with_its_sliding_window_and_logits(imported, tmp_path):
    """The import at TP 2 exported again: Mistral with sliding_window 4, every tensor bit for bit, and
    transformers' logits of the source (which its window changes: without it they move)."""
    out = tmp_path / "back"
    assert main(["run", "--direct", str(imported["runs"][("mistral_window", 2)]), str(out), "--to", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 4)
    want, got = _st_tensors(imported["hf"]["mistral_window"]), _st_tensors(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    logits = transformers_logits(out, got)
    assert _diff(logits, imported["want"]["mistral_window"]) < TOL
    (out / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert _diff(transformers_logits(out, got), imported["want"]["mistral_window"]) > 10 * TOL


def test_hf_architecture_choices_that_cannot_be_written_are_refused(imported, tmp_path, capsys):
    qwen2, llama = imported["runs"][("qwen2", 1)], imported["runs"][("llama", 1)]
    _refused(capsys, qwen2, tmp_path / "o1", "the model is Qwen2ForCausalLM (RMSNorm, SwiGLU, rotary, biases on the "
             "fused QKV only); MistralForCausalLM does not compute it", "--to", "hf",
             "--hf-architecture", "MistralForCausalLM", tp=())
    _refused(capsys, llama, tmp_path / "o2", "'NopeForCausalLM' is not a Hugging Face architecture reshard knows",
             "--to", "hf", "--hf-architecture", "NopeForCausalLM", tp=())
    _refused(capsys, llama, tmp_path / "o3", "--hf-architecture: names the class of a Hugging Face export",
             "--hf-architecture", "MistralForCausalLM")


@pytest.mark.parametrize("args,needle", [
    ({"window_attn_skip_freq": 2}, "sliding-window attention on some layers only (layers [1] attend fully"),
    ({"window_attn_skip_freq": [1, 0]}, "sliding-window attention on some layers only (layers [1] attend fully"),
    ({"window_size": (3, 1)}, "window_size (3, 1) looks 1 tokens ahead"),
    ({"window_size": (-1, 0)}, "window_size (-1, 0) (Transformer Engine reads a negative side as unbounded"),
    ({"window_size": 4}, "window_size 4 (megatron-core's window is a pair of ints"),
    ({"add_qkv_bias": True}, "a sliding window of 4 tokens on every layer in Qwen2ForCausalLM's model"),
], ids=["skip_freq", "skip_pattern", "look_ahead", "negative", "not_a_pair", "qkv_bias"])
def test_a_window_no_hugging_face_architecture_computes_is_refused_on_export(imported, tmp_path, capsys, args, needle):
    src = shutil.copytree(imported["runs"][("mistral_window", 1)], tmp_path / "src")
    if args.get("add_qkv_bias"):  # a Qwen2-shaped model (biases on QKV) with the window
        src = shutil.copytree(imported["runs"][("qwen2", 1)], tmp_path / "qwen2")
        args = {"window_size": (3, 0)}
    edit_saved_args(src, **args)
    _refused(capsys, src, tmp_path / "out", needle, "--to", "hf", tp=())


def test_no_hf_architecture_choice_drops_the_window(imported, tmp_path, capsys):
    """--hf-architecture Llama for a windowed model is refused (Llama has no window), and so is a
    plug-in whose config.json would leave the window out."""
    src = imported["runs"][("mistral_window", 1)]
    _refused(capsys, src, tmp_path / "o1", "the model is MistralForCausalLM", "--to", "hf",
             "--hf-architecture", "LlamaForCausalLM", tp=())
    from reshard.models import hf_registry

    class Windowless(arch.HFArchitectureFamily):
        name, names = "WindowlessForCausalLM", LLAMA_NAMES

        def export(self, decided):
            return arch.HFArchitecture(name=self.name, config={**decided.config, "sliding_window": None},
                                       names=self.names, reason=decided.reason)

    hf_registry.register_hf_architecture(Windowless)
    try:
        _refused(capsys, src, tmp_path / "o2", "WindowlessForCausalLM's config.json does not keep its sliding window "
                 "of 4 tokens", "--to", "hf", "--hf-architecture", "WindowlessForCausalLM", tp=())
    finally:
        hf_registry.unregister_hf_architecture("WindowlessForCausalLM")


def test_an_fp8_block_scaled_folder_imports_with_the_logits_of_the_model_it_encodes(imported):
    """Partial FP8 blocks in both dimensions, dequantized as DeepSeek does, fused into megatron-core's
    QKV and fc1 at TP 2: megatron-core computes what transformers computes from those weights."""
    assert _diff(imported["logits"][("llama_fp8", 2)], imported["want"]["llama_fp8"]) < TOL


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_a_quantized_release_imports_with_the_logits_of_its_dequantized_model(imported, scheme):
    """A release written by compressed-tensors (INT4 with zero points by group, FP8 by channel, NVFP4)
    or by ModelOpt (NVFP4), sharded, imported at TP 2 (fused into megatron-core's QKV and fc1):
    megatron-core computes what transformers computes from the library's own dequantization."""
    name = f"llama_{scheme}"
    assert _diff(imported["logits"][(name, 2)], imported["want"][name]) < TOL


def test_fp8_to_hf_is_deepseeks_cast_bit_for_bit(imported, tmp_path):
    """``reshard run FP8_DIR DST --to hf`` is DeepSeek's fp8_cast_bf16: every weight the block
    formula's bf16 (partial edge blocks included), no scale left, no quantization_config, the index
    consistent; a transposed scale grid would change the weights (and is refused: below)."""
    src = tmp_path / "fp8"
    want = make_fp8_folder(imported["hf"]["llama"], src, torch.bfloat16)
    out = tmp_path / "bf16"
    assert main(["run", "--direct", str(src), str(out), "--to", "hf", "--max-shard-size", "100KB"]) == 0
    got = _st_tensors(out)
    assert sorted(got) == sorted(want) and all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k])
                                               for k in want)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(want) and set(index.values()) == {f.name for f in out.glob("*.safetensors")}
    import transformers  # the export as transformers loads it (from_pretrained's own checks): the model it encodes

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0]
    assert torch.equal(logits, transformers_logits(imported["hf"]["llama"], want))


def test_fp8_folders_that_cannot_be_read_exactly_are_refused(imported, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "fp8"
    make_fp8_folder(imported["hf"]["llama"], src, torch.bfloat16)
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.0.self_attn.k_proj.weight"  # [16, 64]: scales [1, 2]

    def variant(name: str, **change: torch.Tensor | None) -> Path:
        dst = _edited(src, tmp_path / name)
        edited = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        save_file(edited, dst / "model.safetensors", metadata={"format": "pt"})
        return dst

    _refused(capsys, variant("noscale", **{key + "_scale_inv": None}), tmp_path / "o1",
             f"{key} is float8_e4m3fn but {key}_scale_inv is missing")
    _refused(capsys, variant("transposed", **{key + "_scale_inv": tensors[key + "_scale_inv"].T.contiguous()}),
             tmp_path / "o2", f"{key}_scale_inv has shape [2, 1], not [1, 2]")
    _refused(capsys, variant("unscaled", **{"model.norm.weight_scale_inv": torch.ones(1, 1)}), tmp_path / "o3",
             "model.norm.weight is bfloat16 but has a block scale")
    _refused(capsys, variant("orphan", **{"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}),
             tmp_path / "o6", "model.layers.0.mlp.extra.weight_scale_inv scales no weight")
    _refused(capsys, _edited(src, tmp_path / "gptq", config={"quantization_config": {"quant_method": "gptq"}}),
             tmp_path / "o4", "holds quant_method 'gptq', which reshard does not read")
    bare = _edited(src, tmp_path / "bare")
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["quantization_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    _refused(capsys, bare, tmp_path / "o5", "is float8_e4m3fn but config.json declares no quantization_config")


def _with_tokenizer(folder: Path) -> None:
    """Save a tiny word-level tokenizer (built offline with ``tokenizers``) and a chat template
    into ``folder``, as ``tokenizer.save_pretrained`` does beside a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w5", eos_token="w6", pad_token="w0",
                                  unk_token="w0")
    tok.chat_template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    tok.save_pretrained(folder)


#: What transformers saved beside the weights that the round trips carry, byte for byte.
CARRIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_token_ids_generation_config_and_tokenizer_survive_every_round_trip(tmp_path):
    """A folder transformers saved (token ids of its own, an end-of-sequence list as Llama 3 has,
    ``generation_config.json``) with a tokenizer and chat template, through megatron-core per-rank
    files at TP 2 (and back to TP 1), through torch_dist, and Hugging Face to Hugging Face: every
    export's ``config.json`` has the source's token ids, the side files are the source's bytes
    (the Megatron layouts hold them in the iteration's ``tokenizer/``, where Megatron-LM saves its
    tokenizer), and transformers loads the tokenizer and generation config from it."""
    import transformers

    src = tmp_path / "src"
    cls, kw, _ = MODELS["llama"]
    config = getattr(transformers, cls)(**kw, bos_token_id=5, eos_token_id=[6, 7], pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    _with_tokenizer(src)
    assert all((src / name).is_file() for name in CARRIED)
    tp2 = _import(src, tmp_path / "tp2", "--target-tp", "2")
    tp1 = _import(tp2, tmp_path / "tp1", "--target-tp", "1")
    dist = _import(src, tmp_path / "dist", "--to", "torch_dist")
    for megatron, iteration in ((tp2, "release"), (tp1, "release"), (dist, "iter_0000000")):  # torch_dist: iter_
        assert {n: (megatron / iteration / "tokenizer" / n).read_bytes() for n in CARRIED} == \
               {n: (src / n).read_bytes() for n in CARRIED}, megatron
    exports = {how: _import(folder, tmp_path / f"hf_{how}", "--to", "hf")
               for how, folder in (("tp2", tp2), ("tp1", tp1), ("dist", dist), ("hf", src))}
    want = json.loads((src / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    for how, out in exports.items():
        got = json.loads((out / "config.json").read_text())
        assert {k: got.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
               {"bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 0} == \
               {k: want[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, how
        assert {n: (out / n).read_bytes() for n in CARRIED} == {n: (src / n).read_bytes() for n in CARRIED}, how
        assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [6, 7]
        loaded = transformers.AutoTokenizer.from_pretrained(out)
        messages = [{"role": "user", "content": "w9 w10"}]
        assert loaded("w9 w3 w4").input_ids == tok("w9 w3 w4").input_ids
        assert loaded.apply_chat_template(messages, tokenize=False) == "w5w9 w10w6"


def test_a_token_id_that_is_no_token_number_is_refused_in_one_line(tmp_path, capsys):
    import transformers

    src = tmp_path / "src"
    cls, kw, _ = MODELS["llama"]
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).save_pretrained(src)
    _refused(capsys, _edited(src, tmp_path / "bad", config={"eos_token_id": "</s>"}), tmp_path / "out",
             "config.json: eos_token_id is '</s>', not a token id or a list of them (fix: correct it in config.json)")
