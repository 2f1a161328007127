"""What a model family is: a rule table (parameter name -> how it is partitioned), the answers
that depend on the family's naming, and the deciders of its model facts. A family knows no file
layout (it never imports :mod:`reshard.formats`) and no storage."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import reshard.models.facts as facts
from reshard.core.errors import LayoutError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ModelFacts, ParamPlan, SourceStage
from reshard.core.rules import Rule, layer_index
from reshard.core.source import SourceCheckpoint


class ModelFamily(ABC):
    """One family, registered in :mod:`reshard.models.registry`. The planner asks the families,
    in ``priority`` order, which one claims a checkpoint's parameter names, and resolves every
    name against that family's ``rules`` (a name no rule matches is refused, never guessed)."""

    name: ClassVar[str]
    rules: ClassVar[tuple[Rule, ...]]
    #: Lower first; a catch-all family (claims every checkpoint) goes last.
    priority: ClassVar[int] = 100
    #: What its table reads, in words (the hint when a name matches no rule).
    supported: ClassVar[str] = ""
    #: Its names of an untied output layer (what the tied-embeddings decider looks for), and, per
    #: naming, the name under which the last pipeline stage holds its copy of tied word embeddings
    #: (what a pipeline split recreates). Defaults: Megatron-LM's, as for the deciders.
    output_keys: ClassVar[tuple[str, ...]] = facts.OUTPUT_KEYS
    tied_head_keys: ClassVar[Mapping[str, str]] = MappingProxyType(facts.TIED_HEAD_KEYS)
    #: How its names start for layers that sit beside the stack of layers (numbered apart from it,
    #: placed on a stage by their rules, never renumbered per stage). Default: none.
    beside_stack: ClassVar[tuple[str, ...]] = ()
    #: A stage copy (:meth:`keeps_stage_copy`) in the words of the check before one is dropped and of
    #: the warning that says so: (the copy, what it is a copy of).
    stage_copy_words: ClassVar[tuple[str, str]] = ("the last stage's copy",
                                                   "the last stage's copy of the first stage's entries")

    @abstractmethod
    def claims(self, keys: Sequence[str]) -> bool:
        """Are these parameter names this family's? (Names only, no tensors.)"""

    def layer_index(self, key: str) -> int | None:
        """The layer of the stack parameter ``key`` belongs to (its number in the name), None for
        an entry of no stack layer: embeddings, final norm, a layer beside the stack
        (:attr:`beside_stack`). The planner numbers, orders and places layers by it."""
        return None if key.startswith(self.beside_stack) else layer_index(key)

    def keeps_stage_copy(self, keys: Iterable[str]) -> bool:
        """Whether a pipeline stage holding parameters ``keys`` keeps its own copy of the first
        stage's entries (the embeddings), which the planner then places first on the last stage,
        drops at one stage (after checking it equals the original) and makes from the first stage's
        when a source of one stage has none. Default: no stage keeps one."""
        return False

    def naming(self, keys: Sequence[str]) -> str:
        """The naming variant the names follow (recorded in the model facts)."""
        return self.name

    def expert_tp(self, keys: Sequence[str]) -> int | None:
        """The one expert tensor-parallel degree the model of parameter names ``keys`` is built at
        (its routed experts split over that many ranks whatever the TP), None: any degree dividing
        the TP. The planner makes it the output's default and refuses another ``--target-etp``.
        Default: any."""
        return None

    def split_sections(self, rule: Rule, key: str, rank_rows: int, n: int, args: Any) -> tuple[tuple[int, int], ...]:
        """The fused sections of parameter ``key`` (its rule names them, ``Rule.sections``): for each,
        in order along the split dim, ``(rows on one of the n source ranks, indivisible unit)``. Each
        section is split over the target ranks on its own, as megatron-core's sharded state dict
        splits a state-space mixer's input projection. Refuse (a ``LayoutError`` naming the field)
        what the saved ``args`` cannot size. A family whose table names sections overrides this."""
        raise LayoutError(f"the {self.name} family's table names fused sections {rule.sections!r}, which it "
                          f"does not size", culprit=key, hint="the family must override split_sections")

    #: torch_dist: whether megatron-core's sharded state dict stacks the layers of this family's stack
    #: along a leading axis when they hold the same entries (a GPT model's ``TransformerBlock`` does;
    #: a stack that keys every layer apart does not).
    dist_stacks_layers: ClassVar[bool] = True
    #: torch_dist: the per-rank entries megatron-core's sharded state dict leaves out (None: a GPT
    #: model's, :data:`reshard.models.megatron_gpt.PER_RANK_ONLY`).
    dist_per_rank_only: ClassVar[frozenset[str] | None] = None
    #: torch_dist: whether its layers' separate norms (``input_layernorm``, ``pre_mlp_layernorm``) are keyed
    #: there under the fused layers' names, as megatron-core's local layer spec's
    #: ``sharded_state_dict_keys_map`` keys them. False for a family megatron-core builds from Transformer
    #: Engine's specs alone, which have no keys map: an MoE layer's separate ``pre_mlp_layernorm`` keeps
    #: its name.
    dist_keys_map: ClassVar[bool] = True

    def dist_parts(self, name: str, args: Any = None) -> tuple[tuple[str, int | None], ...] | None:
        """torch_dist: the parts per-rank entry ``name`` (a whole model's, TP 1) is stored as when
        megatron-core's sharded state dict splits it — keys ``name + "." + part``, in order along dim
        0, each a global tensor of its own — with each part's rows as the saved ``args`` size them
        (None without ``args``); None for an entry stored whole. The torch_dist format fuses the parts
        on reading and splits them on writing. Default: none."""
        return None

    def describe(self) -> list[str]:
        """Further lines for ``reshard formats`` (e.g. the Hugging Face architectures a family maps)."""
        return []

    def summary(self, args: Any, model_facts: ModelFacts, experts: int) -> dict[str, Any]:
        """What ``inspect`` shows of the model beyond its facts (name -> JSON value, None where it
        has none): here the routing of a mixture-of-experts model (``moe``; ``experts`` per MoE
        layer). A family with more to say (multi-latent attention) adds to it."""
        return {"moe": facts.moe_routing(args, experts)}

    # -- the deciders of the model facts ------------------------------------------------------------
    # The planner asks the family for each fact. The defaults are Megatron-LM's (the flags, then
    # the saved Megatron ``args``, then the shapes; see :mod:`reshard.models.facts`): every family
    # built in writes Megatron-LM's ``args``. A family whose checkpoints say a fact another way
    # overrides its decider; each records where its answer came from in ``origin``.

    def decide_heads(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                     origin: dict[str, str], where: str) -> tuple[int | None, int | None, int | None]:
        """(hidden size, attention heads, head dim), None where unknown."""
        return facts.head_facts(options, args, params, origin, where)

    def decide_groups(self, options: ReshardOptions, args: Any, heads: int | None, params: list[CanonicalParam],
                      head_dim: int | None, n: int, origin: dict[str, str], where: str) -> int | None:
        """Query groups of the attention (``heads`` for multi-head attention), None where unknown."""
        return facts.decide_groups(options, args, heads, params, head_dim, n, origin, where)

    def decide_swiglu(self, options: ReshardOptions, args: Any, params: list[CanonicalParam], n: int, m: int,
                      origin: dict[str, str], where: str) -> bool | None:
        """Whether the MLP is gated (its fc1 holds [gate; up] rows per rank)."""
        return facts.decide_swiglu(options, args, params, n, m, origin, where)

    def decide_vocab(self, options: ReshardOptions, args: Any, params: list[CanonicalParam], n: int, m: int,
                     origin: dict[str, str], where: str, padded_for: int | None = None,
                     default_divisor: int | None = None) -> facts.Vocab:
        """The vocabulary rows at source and target TP (padding)."""
        return facts.decide_vocab(options, args, params, n, m, origin, where, padded_for, default_divisor)

    def decide_family_facts(self, options: ReshardOptions, args: Any, params: list[CanonicalParam],
                            origin: dict[str, str], where: str) -> dict[str, Any]:
        """The family's own facts, beyond those every family has (name -> JSON value; recorded in
        :attr:`~reshard.core.plan_types.ModelFacts.family_facts`, each with its ``origin``). Default:
        none."""
        return {}

    def decide_tied(self, args: Any, naming: str, params: list[ParamPlan], stages: list[SourceStage],
                    origin: dict[str, str], source: SourceCheckpoint) -> bool | None:
        """Whether the output layer is the word embeddings (tied)."""
        return facts.decide_tied(args, naming, params, stages, origin, source, self.output_keys)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
