"""Many-to-one tensors (:mod:`reshard.models.stacked`): one Hugging Face tensor stacked from many
megatron-core ones. The transform is checked against plain torch (stack, transpose, interleave);
the plug-in architecture of ``tests/plugin_stacked_moe.py`` (GPT-OSS's stacked experts) is
imported to megatron-core at EP 1 and EP 2 and exported back bit for bit, one slab held at a time,
each stacked tensor in one file whatever ``--max-shard-size`` cuts."""

from __future__ import annotations

import json
import struct
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mapped_pages import resident_bytes
from mcore_fixtures import TOKENS, mcore_forward_moe, needs_mcore
from plugin_stacked_moe import DOWN, GATE_UP, StackedMoe
from reshard.cli import main
from reshard.core.lazy import LazyTensor
from reshard.core.safe_load import load_shard
from reshard.core.safetensors_read import MappedSafetensors, SafeTensor
from reshard.formats.base import cut_points
from reshard.models.hf_architectures import OutTensor
from reshard.models.hf_registry import register_hf_architecture, unregister_hf_architecture
from reshard.models.stacked import SlabView, Stacked

E, H, F, LAYERS, VOCAB = 8, 256, 1024, 2, 256
SLAB = H * 2 * F * 4  # bytes of one gate_up slab (float32): the largest slab
CONFIG = {"architectures": ["StackedMoeForCausalLM"], "model_type": "stacked_moe", "hidden_size": H,
          "intermediate_size": F, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 10000.0, "num_local_experts": E,
          "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
          "eos_token_id": 2, "dtype": "float32", "attention_bias": True, "mlp_bias": True}


# --- the transform against plain torch ------------------------------------------------------------

def _reference_gate_up(fc1s: list[torch.Tensor]) -> torch.Tensor:
    """GPT-OSS's ``gate_up_proj`` from megatron-core's ``[gate; up]`` fc1s: ``x @ W[e]``, gate on
    the even columns, up on the odd ones."""
    out = []
    for w in fc1s:
        gate, up = w.chunk(2)
        out.append(torch.stack([gate.t(), up.t()], dim=-1).reshape(w.shape[1], w.shape[0]))
    return torch.stack(out)


class _Mapped(LazyTensor):
    """A lazy tensor over a tensor in memory that counts the bytes its box reads return."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype, self.read = t, tuple(t.shape), t.dtype, 0

    def read_box(self, offsets, sizes, out=None):
        box = self.t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        self.read += box.numel() * box.element_size()
        return box.contiguous() if out is None else out.copy_(box)


def test_the_stacked_transform_is_torchs_stack_transpose_and_interleave():
    torch.manual_seed(0)
    fc1s = [torch.randn(2 * 6, 5) for _ in range(3)]
    fc2s = [torch.randn(5, 6) for _ in range(3)]
    want = _reference_gate_up(fc1s)
    assert torch.equal(torch.stack([GATE_UP.convert(w, None)[0] for w in fc1s]), want)
    assert torch.equal(torch.stack([DOWN.convert(w, None)[0] for w in fc2s]), torch.stack([w.t() for w in fc2s]))
    bias = torch.arange(12.0)  # [gate; up] of a bias: interleaved, not transposed
    assert Stacked(halves=2, interleave=True).convert(bias, None)[0].tolist() == \
        [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    # the import reads each expert back from its slab, any box
    lazy = _Mapped(want)
    experts = GATE_UP.fan_out(("gate_up_proj",), [lazy], None)
    assert [tuple(x.shape) for x in experts] == [(12, 5)] * 3
    slab = want[0].numel() * 4
    for w, x in zip(fc1s, experts):
        assert torch.equal(x.materialize(), w)
        assert lazy.read == slab  # its slab, read once for both halves
        assert torch.equal(x.read_box((4, 1), (5, 3)), w[4:9, 1:4])  # across the gate/up boundary
        assert lazy.read == 2 * slab  # read whole again (the last read served every element) ...
        assert torch.equal(x.read_box((7, 0), (2, 5)), w[7:9])  # up rows 1, 2: the slab's rows 3..5
        assert lazy.read == 2 * slab  # ... once for the boxes of it that follow
        lazy.read = 0
    down = Stacked(transpose=True).fan_out(("down_proj",), [_Mapped(torch.stack([w.t() for w in fc2s]))], None)
    assert all(torch.equal(x.read_box((1, 2), (3, 4)), w[1:4, 2:6]) for x, w in zip(down, fc2s))
    biases = torch.stack([torch.arange(12.0), torch.arange(12.0) + 100])  # gate 0, up 0, gate 1, ...
    fanned = Stacked(halves=2, interleave=True).fan_out(("bias",), [_Mapped(biases)], None)
    assert fanned[1].materialize().tolist() == [100 + i for i in (0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11)]
    assert fanned[0].read_box((5,), (3,)).tolist() == [10, 1, 3]


def test_the_slabs_transpose_is_made_without_transposing():
    """What MXFP4 encodes, the slab ``[in, out]`` transposed back: the fc1's rows interleaved (whole
    rows moved), the fc2 itself."""
    torch.manual_seed(0)
    fc1, fc2 = torch.randn(2 * 6, 5), torch.randn(5, 6)
    (w1,) = GATE_UP.convert_transposed(fc1, None)
    assert torch.equal(w1, GATE_UP.convert(fc1, None)[0].t()) and w1.is_contiguous()
    assert DOWN.convert_transposed(fc2, None)[0] is fc2


@pytest.mark.parametrize("wrong", [Stacked(transpose=True, halves=2), Stacked(halves=2, interleave=True)],
                         ids=["concatenated", "not-transposed"])
def test_the_reference_catches_a_stack_concatenated_or_not_transposed(wrong):
    torch.manual_seed(0)
    fc1s = [torch.randn(2 * 3, 6) for _ in range(3)]  # square: a missing transpose keeps the shape
    made = torch.stack([wrong.convert(w, None)[0] for w in fc1s])
    assert made.shape == _reference_gate_up(fc1s).shape and not torch.equal(made, _reference_gate_up(fc1s))
    experts = wrong.fan_out(("gate_up_proj",), [_Mapped(_reference_gate_up(fc1s))], None)
    assert not all(torch.equal(x.materialize(), w) for x, w in zip(experts, fc1s))


def test_the_export_marks_each_slab_and_refuses_a_tensor_that_is_no_slab():
    from reshard.core.errors import LayoutError
    from reshard.core.plan_types import ModelFacts
    from reshard.models.hf_architectures import HFArchitecture, export_of

    arch = HFArchitecture(name=StackedMoe.name, config={}, reason="", names=StackedMoe.names)
    facts = ModelFacts(naming="megatron-core", num_layers=2, hidden=8, heads=2, query_groups=2, head_dim=4,
                       swiglu=True, tied_embeddings=False, vocab_size=16, padded_vocab_source=16,
                       padded_vocab_target=None, make_vocab_size_divisible_by=None, source_pp_layers=(2,),
                       target_pp_layers=(2,))
    key = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    exp = export_of(key.format(3), (12, 8), 4, facts, arch)
    assert (exp.part, exp.outputs, exp.linear) == (3, (OutTensor("model.layers.1.mlp.experts.gate_up_proj", (8, 12)),),
                                                   False)
    with pytest.raises(LayoutError, match="no slab of 2 equal row blocks"):
        export_of(key.format(0), (11, 8), 4, facts, arch)


def test_cut_points_keep_interleaved_groups_together():
    assert cut_points([None, None, None]) == [0, 1, 2]
    assert cut_points([None, "a", "b", "a", "b", None]) == [0, 1, 5]
    assert cut_points(["a", None, "a", "b"]) == [0, 3]
    assert cut_points([]) == [0]


# --- the plug-in, round trip ------------------------------------------------------------------------

class _Held:
    """What the stacked transform holds: the bytes of the tensors it makes alive at once (export:
    each slab converted; import: a box it reads without a buffer to read into), counted from when
    they are made until their storage is freed, and the largest read of a stacked tensor's bytes."""

    def __init__(self) -> None:
        self.live = self.peak = self.made = self.largest_read = 0
        self.lock = threading.Lock()

    def add(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        n = storage.nbytes()
        with self.lock:
            self.live += n
            self.made += n
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, n)
        return t

    def _free(self, n: int) -> None:
        with self.lock:
            self.live -= n

    def read(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.made += t.numel() * t.element_size()
            self.largest_read = max(self.largest_read, t.numel() * t.element_size())
        return t


def _counted(mp: pytest.MonkeyPatch, held: _Held) -> None:
    """Count what the transform makes (:class:`_Held`) while a conversion runs."""
    convert, slab_read, file_read = Stacked.convert, SlabView.read_box, SafeTensor.read_box

    def converted(self, t, facts):
        return [held.add(x) for x in convert(self, t, facts)]

    def slab_box(self, offsets, sizes, out=None):
        got = slab_read(self, offsets, sizes, out)
        return held.add(got) if out is None else got

    def file_box(self, offsets, sizes, out=None):
        got = file_read(self, offsets, sizes, out)
        return held.read(got) if len(self.shape) == 3 else got

    mp.setattr(Stacked, "convert", converted)
    mp.setattr(SlabView, "read_box", slab_box)
    mp.setattr(SafeTensor, "read_box", file_box)


def _hf_folder(root: Path, E: int = E, H: int = H, F: int = F) -> dict[str, torch.Tensor]:  # noqa: N803
    torch.manual_seed(5)
    q, kv = H, H // 2
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, H), "model.norm.weight": torch.rand(H) + 0.5,
         "lm_head.weight": torch.randn(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.rand(H) + 0.5, p + "post_attention_layernorm.weight": torch.rand(H),
              p + "self_attn.q_proj.weight": torch.randn(q, H), p + "self_attn.k_proj.weight": torch.randn(kv, H),
              p + "self_attn.v_proj.weight": torch.randn(kv, H), p + "self_attn.o_proj.weight": torch.randn(H, q),
              p + "mlp.router.weight": torch.randn(E, H), p + "mlp.experts.gate_up_proj": torch.randn(E, H, 2 * F),
              p + "mlp.experts.down_proj": torch.randn(E, F, H), p + "mlp.experts.down_proj_bias": torch.randn(E, H),
              p + "mlp.experts.gate_up_proj_bias": torch.randn(E, 2 * F)}
        t |= {p + f"self_attn.{x}_proj.bias": torch.randn(n) for x, n in (("q", q), ("k", kv), ("v", kv), ("o", H))}
    root.mkdir()
    save_file(t, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": H, "intermediate_size": F,
                                                  "num_local_experts": E}))
    return t


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()[:8]
    (n,) = struct.unpack("<Q", raw)
    return 8 + n, json.loads(path.read_bytes()[8:8 + n])


def _stored(folder: Path) -> dict[str, tuple[Path, bytes]]:
    """Each tensor's file and its bytes as stored."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        base, header = _header(f)
        data = f.read_bytes()
        out |= {k: (f, data[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
                for k, v in header.items() if k != "__metadata__"}
    return out


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacked")
    want = _hf_folder(root / "hf")
    held = {}
    register_hf_architecture(StackedMoe)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for run, argv in (("ep1", ["hf", "ep1", "--target-tp", "1"]),
                              ("ep2", ["hf", "ep2", "--target-tp", "1", "--target-ep", "2"]),
                              ("back1", ["ep1", "back1", "--to", "hf"]),  # the plug-in claims it
                              ("back2", ["ep2", "back2", "--to", "hf", "--hf-architecture", StackedMoe.name,
                                         "--max-shard-size", "5MB"])):
                held[run] = _Held()
                mp.undo()
                _counted(mp, held[run])
                src, dst, *rest = argv
                assert main(["run", "--direct", str(root / src), str(root / dst), *rest]) == 0, run
    finally:
        unregister_hf_architecture(StackedMoe.name)
    return {"root": root, "want": want, "held": held}


@pytest.mark.parametrize("back", ["back1", "back2"])
def test_the_export_gives_back_every_tensor_and_the_stacked_bytes(round_trip, back):
    root, want = round_trip["root"], round_trip["want"]
    got = {}
    for f in sorted((root / back).glob("*.safetensors")):
        got |= load_file(f)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    source, written = _stored(root / "hf"), _stored(root / back)
    stacked = [k for k in want if ".mlp.experts." in k]
    assert len(stacked) == 4 * LAYERS and all(written[k][1] == source[k][1] for k in stacked)
    config = json.loads((root / back / "config.json").read_text())
    assert config["architectures"] == [StackedMoe.name] and config["attention_bias"] and config["mlp_bias"]


def test_a_cut_output_keeps_each_stacked_tensor_whole_in_one_file(round_trip):
    """5 MB shards of a model whose gate_up tensors are 16 MiB: each stacked tensor lies whole in
    its own file (its slabs never split over two), as the index says."""
    back = round_trip["root"] / "back2"
    files = sorted(back.glob("*.safetensors"))
    assert len(files) > 3
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    for f in files:
        _, header = _header(f)
        for k, v in header.items():
            if k != "__metadata__":
                assert index[k] == f.name
                if k.endswith("gate_up_proj"):
                    assert v["shape"] == [E, H, 2 * F]


def test_the_import_deals_each_layers_experts_over_the_expert_parallel_ranks(round_trip):
    root, want = round_trip["root"], round_trip["want"]
    rank_files = {e: next((root / "ep2").glob(f"*/mp_rank_00_00{e}/model_optim_rng.pt")) for e in range(2)}
    for ep, path in rank_files.items():
        model = load_shard(path)["model"]
        for layer in range(LAYERS):
            gate_up = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            down = want[f"model.layers.{layer}.mlp.experts.down_proj"]
            for local in range(E // 2):
                e = ep * E // 2 + local
                p = f"decoder.layers.{layer}.mlp.experts.local_experts.{local}."
                bias = want[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"][e]
                gate, up = gate_up[e][:, 0::2].t(), gate_up[e][:, 1::2].t()
                assert torch.equal(model[p + "linear_fc1.weight"], torch.cat([gate, up])), (ep, layer, local)
                assert torch.equal(model[p + "linear_fc2.weight"], down[e].t()), (ep, layer, local)
                assert torch.equal(model[p + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
                assert torch.equal(model[p + "linear_fc2.bias"],
                                   want[f"model.layers.{layer}.mlp.experts.down_proj_bias"][e])
            assert f"decoder.layers.{layer}.mlp.experts.local_experts.{E // 2}.linear_fc1.weight" not in model


@pytest.mark.parametrize("run", ["ep1", "ep2", "back1", "back2"])
def test_the_stack_is_never_whole_in_memory(round_trip, run):
    """Export: at most a few converted slabs are alive at once (a stacked tensor is 8), and every
    expert went through them. Import: every read of a stacked tensor is one slab at most (a view
    of the mapped file), every expert was read, and the transform itself holds a few slabs at most
    (the engine reads into its own bounded scratch buffers)."""
    held = round_trip["held"][run]
    assert held.made >= LAYERS * E * SLAB * 3 // 2  # both stacked tensors of every layer, each slab once or more
    assert held.peak < 3 * SLAB, (held.peak / SLAB, held.made / SLAB)
    assert held.largest_read <= SLAB, held.largest_read / SLAB


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("quantize", [[], ["--quantize", "mxfp4"]], ids=["same-dtype", "mxfp4"])
def test_an_export_gives_each_slabs_source_pages_back(tmp_path, quantize):
    """A slab wider than the engine's gather block is read a block of megatron-core rows at a time:
    columns of the mapped Hugging Face slab, copied out. Each such read gives back the pages it
    touched, so the source held mapped stays about a slab, not the stacked tensor (a copied box that
    gave nothing back made bf16 -> MXFP4 of GPT-OSS-120B's experts peak at the size of its source)."""
    _hf_folder(tmp_path / "hf", E=4, H=256, F=2048)  # a gate_up slab is 4 MiB: two gather blocks
    src = tmp_path / "hf" / "model.safetensors"
    slab = 256 * 2 * 2048 * 4
    slab_read, held = SlabView.read_box, []

    def sampled(self, offsets, sizes, out=None):
        got = slab_read(self, offsets, sizes, out)
        held.append(resident_bytes(src))
        return got

    register_hf_architecture(StackedMoe)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(SlabView, "read_box", sampled)
            assert main(["run", "--direct", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf",
                         *quantize]) == 0
    finally:
        unregister_hf_architecture(StackedMoe.name)
    assert len(held) >= LAYERS * 4 * 2  # every expert's gate_up read a block at a time
    # the slab being served, and what the faults that mapped it brought beside it (a folio)
    assert max(held) < 2 * slab, (max(held) / slab, src.stat().st_size / slab)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_box_copied_out_of_a_mapped_file_gives_its_pages_back(tmp_path):
    """A box that is no run of whole rows is copied out of the mapping: the rows it lies in were
    touched, and they are given back as when the box is read into a buffer of the caller's (the
    caller of a copy holds no view of the file to give back)."""
    path = tmp_path / "t.safetensors"
    want = torch.randn(4, 512, 1024)
    save_file({"w": want}, path)  # 8 MiB
    t = MappedSafetensors(path).tensor("w")
    box = t.read_box((1, 0, 100), (2, 512, 300))  # columns 100..399 of two slabs
    assert torch.equal(box, want[1:3, :, 100:400])
    assert resident_bytes(path) < 1 << 20, resident_bytes(path)  # not the 4 MiB of rows it lay in
    whole = t.read_box((1, 0, 0), (2, 512, 1024))  # whole rows: a view of the mapping, kept
    assert torch.equal(whole, want[1:3]) and resident_bytes(path) >= 4 << 20


@pytest.mark.parametrize("name, shape, needle", [
    ("model.layers.1.mlp.experts.down_proj", (3, 16, 64), "hold different numbers of experts: "
     "model.layers.1.mlp.experts.down_proj 3, "),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 31), "is (4, 64, 31): not a stack of 2-D slabs of 2 equal"),
    ("model.layers.0.mlp.experts.gate_up_proj", (64, 32), "is (64, 32): not a stack of 2-D slabs")],
    ids=["an-expert-missing", "odd-width", "not-stacked"])
def test_a_stacked_tensor_that_does_not_fit_is_refused_in_one_line(tmp_path, capsys, name, shape, needle):
    tensors = _hf_folder(tmp_path / "hf", E=4, H=64, F=16)
    tensors[name] = torch.randn(shape)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    register_hf_architecture(StackedMoe)
    try:
        capsys.readouterr()
        assert main(["run", "--direct", str(tmp_path / "hf"), str(tmp_path / "o"), "--target-tp", "1"]) == 2
    finally:
        unregister_hf_architecture(StackedMoe.name)
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


# --- megatron-core computes what the stacked folder holds ---------------------------------------------

@needs_mcore
def test_megatron_core_runs_a_stacked_import_with_the_logits_of_the_mixtral_it_holds(tmp_path):
    """transformers' Mixtral with its experts written in the plug-in's stacked layout (plain torch:
    gate and up columns interleaved, transposed), imported to megatron-core at EP 2: megatron-core's
    forward gives transformers' logits; the same folder with gate and up concatenated does not."""
    import transformers

    torch.manual_seed(7)
    config = transformers.MixtralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=50000.0, initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.rand_like(p))
        want = model(torch.tensor([TOKENS])).logits[0]
    plugin_config = {**CONFIG, **{k: getattr(config, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
        "intermediate_size", "num_local_experts", "num_experts_per_tok", "rms_norm_eps")},
        "rope_theta": 50000.0, "attention_bias": False, "mlp_bias": False}
    for name, interleaved in (("stacked", True), ("concatenated", False)):
        tensors = {}
        for key, v in model.state_dict().items():
            if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2f, h]: gate rows, then up rows
                v = _reference_gate_up(list(v)) if interleaved else v.transpose(1, 2)
            elif key.endswith("mlp.experts.down_proj"):  # [E, h, f]
                v = v.transpose(1, 2)
            tensors[key.replace(".mlp.gate.", ".mlp.router.")] = v.contiguous()
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(plugin_config))
    register_hf_architecture(StackedMoe)
    try:
        for name in ("stacked", "concatenated"):
            assert main(["run", "--direct", str(tmp_path / name), str(tmp_path / f"{name}_ep2"), "--target-tp", "1",
                         "--target-ep", "2"]) == 0
    finally:
        unregister_hf_architecture(StackedMoe.name)
    (got, _), (wrong, _) = mcore_forward_moe([(None, tmp_path / "stacked_ep2", 1, 2),
                                             (None, tmp_path / "concatenated_ep2", 1, 2)], tmp_path)
    assert (got[:, :want.shape[1]] - want).abs().max() < 2e-5
    assert (wrong[:, :want.shape[1]] - want).abs().max() > 1e-3
