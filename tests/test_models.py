"""Model families are plug-ins: each a rule table (name -> partitioning) plus the deciders of its
model facts, in a registry like the formats'. A family defined here, extending the built-in table by
one name, makes a checkpoint plannable that the built-in family refuses; another, deciding one fact
its own way, plans a checkpoint whose saved settings the built-in deciders cannot read — each with
no edit inside reshard."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import torch

from reshard.core.errors import LayoutError, MissingModelFactError, UnknownParameterError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam
from reshard.core.rules import Kind, Place, Rule
from reshard.execution.planner import build_plan
from reshard.models import ModelFamily, families, register_family, registry, resolve_family, unregister_family
from reshard.models.megatron_gpt import MEGATRON_GPT_RULES, MegatronGPT


class GPTWithLMHead(ModelFamily):
    """Legacy GPT plus an untied ``lm_head.weight`` (vocabulary-parallel, last stage)."""

    name = "test-gpt-lm-head"
    priority = 10
    rules = MEGATRON_GPT_RULES + (Rule("lm_head", r"^lm_head\.weight$", Kind.COLUMN, vocab=True, place=Place.LAST),)

    def claims(self, keys: Sequence[str]) -> bool:
        return "lm_head.weight" in keys

    def naming(self, keys: Sequence[str]) -> str:
        return "legacy"  # the facts' deciders treat it as legacy GPT


def test_builtin_family_and_registry_rules():
    assert [f.name for f in families()] == ["gpt-oss", "qwen3-next", "megatron-gpt-mtp", "nemotron-h",
                                            "deepseek-te", "deepseek", "megatron-gpt"]  # the catch-all last
    family, res = resolve_family(["transformer.layers.0.attention.dense.weight"])
    assert family.name == "megatron-gpt" and family.naming(["decoder.layers.0.x"]) == "megatron-core"
    assert res.by_key["transformer.layers.0.attention.dense.weight"].name == "attn.dense.weight"
    with pytest.raises(TypeError):
        registry["x"] = family  # type: ignore[index]

    class Clash(GPTWithLMHead):
        name = "megatron-gpt"

    with pytest.raises(ValueError, match="already registered"):
        register_family(Clash)


def test_a_plugin_family_makes_a_new_parameter_name_plannable(sample_factory, tmp_path):
    src = shutil.copytree(sample_factory(2, 2.0), tmp_path / "src")
    for r, f in enumerate(sorted(src.glob("mp_rank_*_model_states.pt"))):
        sd = torch.load(f, weights_only=False)
        sd["module"]["lm_head.weight"] = torch.full((64, 64), float(r))  # 128 vocab rows over 2 ranks
        torch.save(sd, f)
    with pytest.raises(UnknownParameterError, match="lm_head.weight") as refused:
        build_plan(str(src), ReshardOptions(target_tp=1))
    assert "megatron-core GPT names" in refused.value.hint  # the claiming family says what it reads
    register_family(GPTWithLMHead)
    try:
        plan = build_plan(str(src), ReshardOptions(target_tp=1))
        head = next(p for p in plan.params if p.key == "lm_head.weight")
        assert head.rule.name == "lm_head" and head.spec is not None and head.spec.dim == 0
    finally:
        unregister_family(GPTWithLMHead.name)


class GPTWithOwnSettings(ModelFamily):
    """Megatron GPT names, but the head count saved as ``args.n_head`` (as GPT-2-style trainers save
    it): the family's own decider reads it; every other fact is decided the default way."""

    name = "test-gpt-own-settings"
    priority = 10
    rules = MEGATRON_GPT_RULES

    def claims(self, keys: Sequence[str]) -> bool:
        return True

    def naming(self, keys: Sequence[str]) -> str:
        return "legacy"

    def decide_heads(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                     origin: dict[str, str], where: str) -> tuple[int | None, int | None, int | None]:
        hidden, heads, head_dim = super().decide_heads(options, args, params, origin, where)
        n_head = getattr(args, "n_head", None)
        if heads is None and isinstance(n_head, int):
            heads, origin["heads"] = n_head, "args.n_head"
            head_dim = hidden // heads if hidden else None
        return hidden, heads, head_dim

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        """A fact of this family alone, added without editing the core's record."""
        origin["head_count_arg"] = "args"
        return {"head_count_arg": "n_head" if hasattr(args, "n_head") else "num_attention_heads"}


def test_a_plugin_family_decides_a_model_fact_its_own_way(sample_factory, tmp_path):
    ref = sample_factory(2, 2.0)
    src = shutil.copytree(ref, tmp_path / "src")
    for f in sorted(src.glob("mp_rank_*_model_states.pt")):
        sd = torch.load(f, weights_only=False)
        saved = vars(sd["args"])
        saved["n_head"] = saved.pop("num_attention_heads")
        sd["args"] = argparse.Namespace(**saved)
        torch.save(sd, f)
    with pytest.raises(MissingModelFactError, match="head"):  # the QKV rows move with the heads: needed
        build_plan(str(src), ReshardOptions(target_tp=4))
    assert "family_facts" not in build_plan(str(ref), ReshardOptions(target_tp=4)).facts.to_record()  # built-in: none
    register_family(GPTWithOwnSettings)
    try:
        plan = build_plan(str(src), ReshardOptions(target_tp=4))
        expected = build_plan(str(ref), ReshardOptions(target_tp=4))
        assert plan.facts.origin["heads"] == "args.n_head" and plan.facts.heads == expected.facts.heads
        assert plan.facts.family_facts == {"head_count_arg": "n_head"} and plan.facts.origin["head_count_arg"] == "args"
        assert plan.facts.to_record()["family_facts"] == {"head_count_arg": "n_head"}
        # the Megatron-LM names the tied decider and a pipeline split look for are every family's defaults
        assert GPTWithOwnSettings.output_keys == MegatronGPT.output_keys == ("output_layer.weight",
                                                                             "language_model.output_layer.weight")
        assert GPTWithOwnSettings.tied_head_keys["legacy"] == "word_embeddings_for_head.weight"
        assert plan.facts.tied_embeddings == expected.facts.tied_embeddings
        assert [(p.key, p.spec) for p in plan.params] == [(p.key, p.spec) for p in expected.params]
    finally:
        unregister_family(GPTWithOwnSettings.name)


class GPTWithDraftLayers(ModelFamily):
    """megatron-core GPT names plus layers of its own beside the stack, ``draft.layers.N`` (as a
    model with extra prediction heads keeps them, on the last pipeline stage), whose stage keeps its
    own copy of the embeddings: what the planner needs of them is asked of the family's hooks."""

    name = "test-gpt-draft-layers"
    priority = 10
    rules = MEGATRON_GPT_RULES + (Rule("draft", r"^draft\.layers\.\d+\.norm\.weight$", Kind.REPLICATED, family="core",
                                       place=Place.LAST),)
    beside_stack = ("draft.layers.",)
    stage_copy_words = ("the draft stage's copy", "the draft layers' copy of the embeddings")

    def claims(self, keys: Sequence[str]) -> bool:
        return any(k.startswith("draft.layers.") for k in keys)

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def keeps_stage_copy(self, keys: Iterable[str]) -> bool:
        return self.claims(list(keys))


def _with_draft_layer(src, pp: int) -> None:
    """Give the last stage of the sample run ``src`` a draft layer and, at PP > 1, its copy of the embeddings."""
    files = sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    first = torch.load(files[0], weights_only=False)["model"]
    sd = torch.load(files[-1], weights_only=False)
    if pp > 1:
        sd["model"] = {"embedding.word_embeddings.weight": first["embedding.word_embeddings.weight"].clone(),
                       **sd["model"]}
    sd["model"]["draft.layers.0.norm.weight"] = torch.ones(64)
    torch.save(sd, files[-1])


def test_a_plugin_family_places_its_layers_beside_the_stack_and_their_stage_copy(tmp_path):
    """The family says which layers are the stack's (``layer_index``, ``beside_stack``) and that
    their stage keeps a copy of the embeddings (``keeps_stage_copy``): the draft layer keeps its
    number and goes last; the copy is dropped at one stage with the family's words, and made again,
    first on the last stage, when the stages are split."""
    from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint

    cfg = CoreGPTConfig(layers=4, rope=True)
    staged, single = tmp_path / "pp2", tmp_path / "pp1"
    write_core_sample_checkpoint(staged, tp=1, pp=2, cfg=cfg)
    write_core_sample_checkpoint(single, tp=1, pp=1, cfg=cfg)
    _with_draft_layer(staged, 2)
    _with_draft_layer(single, 1)
    register_family(GPTWithDraftLayers)
    try:
        merged = build_plan(str(staged), ReshardOptions(target_tp=1, target_pp=1))
        assert merged.facts.num_layers == 4
        assert "dropped embedding.word_embeddings.weight of the last pipeline stage: the draft layers' copy of the " \
               "embeddings is not stored at PP 1" in merged.warnings
        (target,) = merged.targets
        keys = [tp.out_key for tp in target.params]
        assert keys.count("embedding.word_embeddings.weight") == 1 and "draft.layers.0.norm.weight" in keys

        split = build_plan(str(single), ReshardOptions(target_tp=1, target_pp=2))
        assert split.facts.num_layers == 4
        first, last = ([tp.out_key for tp in t.params] for t in split.targets)
        assert first[0] == last[0] == "embedding.word_embeddings.weight"  # the stage copy, first on its stage
        assert "draft.layers.0.norm.weight" in last and "decoder.layers.1.input_layernorm.weight" in last
        assert not any(k.startswith("draft.") for k in first)
    finally:
        unregister_family(GPTWithDraftLayers.name)


#: The plug-in's mixer: rows of each fused section in the whole model (z, x, B, C, dt), and each
#: section's indivisible unit (B and C: whole groups of 4 rows).
MIXER_SECTIONS = ((16, 1), (16, 1), (16, 4), (16, 4), (8, 1))


class GPTWithSectionedMixer(ModelFamily):
    """megatron-core GPT names plus ``mixer.in_proj.weight``, fused sections of unequal widths each
    split over TP on its own (as megatron-core's Mamba mixer's ``[z; x; B; C; dt]``): the family
    sizes them (``split_sections``) from the saved ``args``."""

    name = "test-gpt-sectioned-mixer"
    priority = 10
    rules = MEGATRON_GPT_RULES + (Rule("mixer.in_proj", r"\.mixer\.in_proj\.weight$", Kind.COLUMN, family="core",
                                       sections="mixer.in_proj"),)

    def claims(self, keys: Sequence[str]) -> bool:
        return any(".mixer." in k for k in keys)

    def naming(self, keys: Sequence[str]) -> str:
        return "megatron-core"

    def split_sections(self, rule: Rule, key: str, rank_rows: int, n: int, args: Any) -> tuple[tuple[int, int], ...]:
        assert rule.sections == "mixer.in_proj" and args.tensor_model_parallel_size == n
        return tuple((rows // n, atom) for rows, atom in MIXER_SECTIONS)


def _rank_sections(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s in_proj of the whole-model tensor ``full``: its slice of each section."""
    out, first = [], 0
    for rows, _ in MIXER_SECTIONS:
        out.append(full[first + rank * rows // tp:first + (rank + 1) * rows // tp])
        first += rows
    return torch.cat(out)


def test_a_plugin_family_splits_fused_sections_each_on_its_own(tmp_path):
    """A 2 -> 1 merge and a 1 -> 4 split of a sectioned tensor give each section's own slices; a
    target TP that would cut a unit of B is refused naming it, before anything is written."""
    from reshard.api import convert
    from reshard.sample import CoreGPTConfig, write_core_sample_checkpoint

    rows = sum(r for r, _ in MIXER_SECTIONS)
    full = {layer: torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) + 1000 * layer for layer in range(2)}
    src = tmp_path / "tp2"
    for rank, f in enumerate(write_core_sample_checkpoint(src, tp=2, cfg=CoreGPTConfig())):
        sd = torch.load(f, weights_only=False)
        for layer, w in full.items():
            sd["model"][f"decoder.layers.{layer}.mixer.in_proj.weight"] = _rank_sections(w, 2, rank)
        torch.save(sd, f)
    with pytest.raises(UnknownParameterError, match="mixer.in_proj.weight"):
        build_plan(str(src), ReshardOptions(target_tp=1))
    register_family(GPTWithSectionedMixer)
    try:
        convert(str(src), str(tmp_path / "tp1"), target_tp=1)
        convert(str(tmp_path / "tp1"), str(tmp_path / "tp4"), target_tp=4)
        for tp in (1, 4):
            for rank in range(tp):
                (f,) = (tmp_path / f"tp{tp}").glob(f"iter_*/mp_rank_{rank:02d}/model_optim_rng.pt")
                model = torch.load(f, weights_only=False)["model"]
                for layer, w in full.items():
                    got = model[f"decoder.layers.{layer}.mixer.in_proj.weight"]
                    assert torch.equal(got, _rank_sections(w, tp, rank)), (tp, rank, layer)
        with pytest.raises(LayoutError, match="fused section 2: 4 units of 4 rows cannot be divided evenly over 8") \
                as refused:
            build_plan(str(src), ReshardOptions(target_tp=8))  # B: 4 groups of 4 rows over 8 ranks
        assert refused.value.hint == "choose a target TP among 1, 2, 4"
    finally:
        unregister_family(GPTWithSectionedMixer.name)
