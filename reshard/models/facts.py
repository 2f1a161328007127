"""Model-fact inference: heads, query groups, head size, gated MLP, vocabulary padding, tied
embeddings and checkpoint version, each from the options (flags), the saved Megatron ``args`` or
the tensors' shapes, in that order of precedence, with where each came from recorded in
``origin``. A fact that is needed and still unknown is refused (:class:`MissingModelFactError`),
never guessed; a flag that contradicts the saved ``args`` is refused too."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reshard.core.checks import bit_equal
from reshard.core.errors import CheckpointFormatError, InconsistentShardsError, LayoutError, MissingModelFactError
from reshard.core.options import ReshardOptions
from reshard.core.plan_types import CanonicalParam, ParamPlan, SourceStage
from reshard.core.rules import Kind, Place, QuantSlot
from reshard.core.source import SourceCheckpoint, parse_version

#: Model facts Megatron-LM saves in ``args`` under a name that depends on its version: megatron-core
#: 0.19 generates Megatron-LM's arguments from its config dataclasses, so ``--norm-epsilon`` is saved
#: as ``layernorm_epsilon`` and ``--apply-layernorm-1p`` as ``layernorm_zero_centered_gamma``;
#: earlier versions saved the flag's name. Fact -> its names, the one reshard's flags and outputs
#: use first.
ARG_SPELLINGS: dict[str, tuple[str, ...]] = {
    "norm_epsilon": ("norm_epsilon", "layernorm_epsilon"),
    "apply_layernorm_1p": ("apply_layernorm_1p", "layernorm_zero_centered_gamma"),
}


_SPELLINGS: dict[str, tuple[str, ...]] = {name: names for names in ARG_SPELLINGS.values() for name in names}


def saved_arg(args: Any, *names: str, default: Any = None) -> Any:
    """The saved value of the first fact of ``names`` that ``args`` hold, each looked up under any
    of its names (:data:`ARG_SPELLINGS`); ``default`` when they hold none. Several names: a fact
    Megatron-LM saved under different flags (``max_position_embeddings`` or ``seq_length``)."""
    for name in names:
        for spelling in _SPELLINGS.get(name, (name,)):
            v = getattr(args, spelling, None) if args is not None else None
            if v is not None:
                return v
    return default


def int_arg(args: Any, name: str) -> int | None:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def bool_arg(args: Any, name: str) -> bool | None:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, bool) else None


def hidden_and_heads(options: ReshardOptions, args: Any, raw: list[CanonicalParam], origin: dict[str, str],
                     where: str) -> tuple[int | None, int | None]:
    """(hidden size, attention heads): args and flags first, hidden from the QKV shape."""
    hidden = int_arg(args, "hidden_size")
    if hidden is not None:
        origin["hidden"] = "args"
    heads = _decide_heads(options, args, where)
    if heads is not None:
        origin["heads"] = "--num-heads" if options.num_heads is not None else "args"
    for r in raw:
        if r.rule.quant is QuantSlot.QKV and len(r.shape) == 2 and hidden is None:
            hidden = r.shape[1]
            origin["hidden"] = "shapes"
    return hidden, heads


def head_facts(options: ReshardOptions, args: Any, raw: list[CanonicalParam], origin: dict[str, str], where: str
               ) -> tuple[int | None, int | None, int | None]:
    """(hidden size, attention heads, head dim): :func:`hidden_and_heads`, and the head dim from
    ``args.kv_channels``, else Megatron-LM's default ``hidden / heads``."""
    hidden, heads = hidden_and_heads(options, args, raw, origin, where)
    head_dim = int_arg(args, "kv_channels")
    if head_dim is not None:
        origin["head_dim"] = "args"
    elif heads is not None and hidden is not None:
        if hidden % heads:
            raise LayoutError(f"hidden size {hidden} is not divisible by {heads} heads", culprit=where,
                              hint="check --num-heads")
        head_dim = hidden // heads
        origin["head_dim"] = "hidden/heads"
    return hidden, heads, head_dim


def decide_version(shards: list[dict[str, Any]], names: list[str], source: SourceCheckpoint,
                   options: ReshardOptions) -> float:
    saved = [parse_version(sd.get("checkpoint_version", 0), name) for sd, name in zip(shards, names)]
    if len(set(saved)) > 1:
        raise InconsistentShardsError(f"ranks disagree on checkpoint_version: {sorted(set(saved))}",
                                      culprit=source.origin, hint="pass --version to state the QKV layout")
    if options.version is not None:
        return parse_version(options.version, "--version")
    if source.descriptor_version is not None:
        return source.descriptor_version
    return saved[0]


def _decide_heads(options: ReshardOptions, args: Any, where: str) -> int | None:
    saved = int_arg(args, "num_attention_heads")
    if options.num_heads is not None:  # positive: checked by ReshardOptions
        if saved is not None and saved != options.num_heads:
            raise LayoutError(f"--num-heads {options.num_heads} contradicts the saved "
                              f"args.num_attention_heads={saved}", culprit=where,
                              hint="drop --num-heads or correct it")
        return options.num_heads
    return saved


def _qkv_rows(raw: list[CanonicalParam]) -> int | None:
    """Rows of one source rank's QKV weight (all layers agree, checked by shapes per layer)."""
    for r in raw:
        if r.rule.quant is QuantSlot.QKV:
            return r.shape[0]
    return None


def decide_groups(options: ReshardOptions, args: Any, heads: int | None, raw: list[CanonicalParam], hn: int | None,
                  n: int, origin: dict[str, str], where: str) -> int | None:
    """Query groups: the flag, else args (``group_query_attention``/``num_query_groups``), else MHA
    when the QKV shape holds exactly ``3 * heads`` head rows; None when unknown."""
    saved = None
    gqa = bool_arg(args, "group_query_attention")
    if gqa is True:
        saved = int_arg(args, "num_query_groups")
    elif gqa is False:
        saved = heads
    flag = options.num_query_groups
    if flag is not None:
        if saved is not None and saved != flag:
            raise LayoutError(f"--num-query-groups {flag} contradicts the saved args (num_query_groups={saved})",
                              culprit=where, hint="drop --num-query-groups or correct it")
        groups, origin["query_groups"] = flag, "--num-query-groups"
    elif saved is not None:
        groups, origin["query_groups"] = saved, "args"
    else:
        rows = _qkv_rows(raw)
        if heads is not None and hn is not None and rows is not None and rows * n == 3 * heads * hn:
            groups, origin["query_groups"] = heads, "shapes (multi-head: 3 x heads rows)"
        else:
            return None
    if heads is not None and heads % groups:
        raise LayoutError(f"{heads} attention heads do not form {groups} equal query groups", culprit=where,
                          hint="check --num-heads / --num-query-groups")
    return groups


#: fc1 -> fc2 in a parameter name (legacy and megatron-core MLPs, experts included).
_FC_PAIRS = (("dense_h_to_4h", "dense_4h_to_h"), ("linear_fc1", "linear_fc2"))


def _fc2_key(fc1_key: str) -> str:
    for a, b in _FC_PAIRS:
        fc1_key = fc1_key.replace(a, b)
    return fc1_key


def decide_swiglu(options: ReshardOptions, args: Any, raw: list[CanonicalParam], n: int, m: int,
                  origin: dict[str, str], where: str) -> bool | None:
    """Whether fc1 is gated ([W; V] per rank): decided exactly by the shapes — a gated fc1 has twice
    the rows fc2 has input columns — and cross-checked against args.swiglu and --swiglu (Megatron-LM's
    ``--quick-geglu`` is a gated MLP too, whatever ``args.swiglu`` says)."""
    fc1 = [r for r in raw if r.rule.mlp and r.rule.gated]  # every MLP's fc1 weight: dense, expert, shared expert
    fc2 = {r.key: r for r in raw if r.rule.mlp and r.rule.kind is Kind.ROW}
    seen: set[bool] = set()
    for a in fc1:
        b = fc2.get(_fc2_key(a.key))
        if b is None or len(a.shape) != 2 or len(b.shape) != 2:
            continue
        rows, cols = a.shape[0], b.shape[1]
        if rows == 2 * cols:
            seen.add(True)
        elif rows == cols:
            seen.add(False)
        else:
            raise LayoutError(f"fc1 has {rows * n} output rows but fc2 {cols * n} input columns: neither a plain "
                              f"nor a gated (SwiGLU) MLP", culprit=a.key, hint="the checkpoint is inconsistent")
    if len(seen) > 1:
        raise LayoutError("some layers have a gated (SwiGLU) MLP and some do not", culprit=where,
                          hint="reshard needs one MLP kind for all layers")
    shaped = next(iter(seen)) if seen else None
    saved = True if bool_arg(args, "quick_geglu") else bool_arg(args, "swiglu")  # Megatron-LM's gated MLPs
    for value, name in ((saved, "args.swiglu"), (options.swiglu, "--swiglu/--no-swiglu")):
        if value is not None and shaped is not None and value != shaped:
            raise LayoutError(f"{name} says {'gated' if value else 'plain'} but fc1/fc2 shapes are "
                              f"{'gated' if shaped else 'plain'}", culprit=where,
                              hint="correct or drop the flag; the tensors decide")
    if options.swiglu is not None and saved is not None and options.swiglu != saved:
        raise LayoutError(f"--{'' if options.swiglu else 'no-'}swiglu contradicts the saved args.swiglu={saved}",
                          culprit=where, hint="drop the flag")
    if shaped is not None:
        origin["swiglu"] = "shapes (fc1 rows vs fc2 columns)"
        return shaped
    if options.swiglu is not None:
        origin["swiglu"] = "--swiglu/--no-swiglu"
        return options.swiglu
    if saved is not None:
        origin["swiglu"] = "args"
        return saved
    if fc1 and n != m:
        key = fc1[0].key
        raise MissingModelFactError(
            f"whether the MLP is gated (SwiGLU) is unknown, and {n} -> {m} ranks moves its gate and "
            f"up halves differently", culprit=key,
            hint="pass --swiglu or --no-swiglu, or the model's config.json with --model-config")
    return None


@dataclass(frozen=True)
class Vocab:
    """Vocabulary rows: the true size (if known), source and target padded rows, divisor, and the
    warning to give when the target padding is an assumption rather than Megatron's own."""

    true: int | None
    source_rows: int | None
    target_rows: int | None
    divisible_by: int | None
    keep: int | None = None
    warning: str | None = None

    @property
    def resized(self) -> bool:
        return self.source_rows != self.target_rows


def decide_vocab(options: ReshardOptions, args: Any, raw: list[CanonicalParam], n: int, m: int,
                 origin: dict[str, str], where: str, padded_for: int | None = None,
                 default_divisor: int | None = None) -> Vocab:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``; at a new
    TP the padded size may change.

    ====================================  ===============================================================
    what is known                         target rows
    ====================================  ===============================================================
    true size V (flag or args) and D      Megatron's: ceil(V / (D*M)) * D*M; rows past V are zeros
    no divisor D                          the source's rows, unchanged (pre-Megatron-LM checkpoints)
    D, and every V the source's padding   that one padding (exact, no warning)
    allows pads alike at TP M
    D only, source rows a multiple of     the source's rows, kept (every merge); warning: Megatron's
    D*M                                   own padding may be smaller
    D only, otherwise                     zero rows appended up to the next multiple of D*M; warning
    ====================================  ===============================================================

    Megatron-LM saves ``padded_vocab_size`` but, for most tokenizers, not the true size; keeping
    the rows is what its own converter and DeepSpeed do. The warning names the assumption and
    ``--vocab-size V`` for Megatron's exact padding.

    ``padded_for``: the TP the source rows were padded at, when not the grid's ``n`` (a torch_dist
    checkpoint's global rows were padded at the TP it was saved with); ``default_divisor``: D when
    neither flag nor args give one (a Hugging Face import pads as Megatron-LM does by default)."""
    padded_for = n if padded_for is None else padded_for
    vocab = [r for r in raw if r.rule.vocab]
    if not vocab:
        return Vocab(None, None, None, None)
    rows = {r.shape[0] * n for r in vocab}
    if len(rows) > 1:
        raise InconsistentShardsError(f"vocabulary-parallel tensors disagree on the vocabulary rows: {sorted(rows)}",
                                      culprit=where, hint="the checkpoint is inconsistent")
    src_rows = rows.pop()
    saved_padded = int_arg(args, "padded_vocab_size")
    if saved_padded is not None and saved_padded != src_rows:
        raise CheckpointFormatError(f"args.padded_vocab_size is {saved_padded} but the embeddings hold {src_rows} rows",
                                    culprit=where, hint="the args do not belong to these tensors")
    d = _flag_or_arg(options.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by",
                     int_arg(args, "make_vocab_size_divisible_by"), "args.make_vocab_size_divisible_by",
                     "make_vocab_size_divisible_by", origin, where)
    if d is None and default_divisor is not None:
        d = default_divisor
        origin["make_vocab_size_divisible_by"] = "Megatron-LM's default"
    true = _flag_or_arg(options.vocab_size, "--vocab-size", int_arg(args, "vocab_size"), "args.vocab_size",
                        "vocab_size", origin, where)
    if true is not None and true > src_rows:
        raise LayoutError(f"vocabulary size {true} exceeds the {src_rows} embedding rows", culprit=where,
                          hint="check --vocab-size")
    if d is None:
        return Vocab(true, src_rows, src_rows, None)
    unit_t = d * m
    if true is not None:
        target = math.ceil(true / unit_t) * unit_t
        origin["padded_vocab_target"] = "vocab_size and divisor"
        return Vocab(true, src_rows, target, d, keep=true if target != src_rows else None)
    if padded_for == m:
        return Vocab(None, src_rows, src_rows, d)
    # the true sizes this padding allows (all of them if the rows are no multiple of D x N)
    unit_s = d * padded_for
    lo = max(1, src_rows - unit_s + 1) if src_rows % unit_s == 0 else 1
    exact = {math.ceil(v / unit_t) * unit_t for v in (lo, src_rows)}
    target = math.ceil(src_rows / unit_t) * unit_t
    keep = min(src_rows, target) if target != src_rows else None
    if exact == {target}:  # every allowed size pads to the same rows: Megatron's padding, exactly
        origin["padded_vocab_target"] = "padded rows and divisor (unambiguous)"
        return Vocab(None, src_rows, target, d, keep=keep)
    origin["padded_vocab_target"] = "source rows kept (true vocabulary size unknown)"
    how = (f"kept the {src_rows} vocabulary rows" if target == src_rows else
           f"padded the {src_rows} vocabulary rows with zero rows to {target}")
    warning = (f"{how} at TP {m}, assuming they are a valid padding; the checkpoint does not record the true "
               f"vocabulary size, so Megatron's own padding at TP {m} may be smaller (pass --vocab-size V for "
               f"Megatron's exact padding)")
    return Vocab(None, src_rows, target, d, keep=keep, warning=warning)


def _flag_or_arg(flag: int | None, flag_name: str, saved: int | None, saved_name: str, fact: str,
                 origin: dict[str, str], where: str) -> int | None:
    if flag is not None:  # positive: checked by ReshardOptions
        if saved is not None and saved != flag:
            raise LayoutError(f"{flag_name} {flag} contradicts the saved {saved_name}={saved}", culprit=where,
                              hint=f"drop {flag_name} or correct it")
        origin[fact] = flag_name
        return flag
    if saved is not None:
        origin[fact] = "args"
    return saved


#: Megatron-LM's names of an untied output layer (megatron-core, legacy) and, per naming, of the last
#: pipeline stage's copy of tied word embeddings (the defaults of :class:`~reshard.models.base.ModelFamily`).
OUTPUT_KEYS = ("output_layer.weight", "language_model.output_layer.weight")
TIED_HEAD_KEYS: dict[str, str] = {"megatron-core": "output_layer.weight", "legacy": "word_embeddings_for_head.weight"}


def decide_tied(args: Any, naming: str, params: list[ParamPlan], stages: list[SourceStage],
                origin: dict[str, str], source: SourceCheckpoint, output_keys: tuple[str, ...]) -> bool | None:
    """Whether output and input embeddings are one tensor: ``args.untie_embeddings_and_output_weights``,
    else the structure (PP = 1: an output layer (one of ``output_keys``) exists only when untied;
    legacy PP > 1: a head copy exists, its rule's ``tied_head``), else a megatron-core last-stage ``output_layer``
    bit-identical to the word embeddings on every rank (tied weights are kept identical)."""
    keys = {p.key: p for p in params}
    emb = next((p for p in params if p.rule.vocab and p.rule.place is Place.FIRST), None)
    out = next((keys[k] for k in output_keys if k in keys), None)
    head = next((p for p in params if p.rule.tied_head), None)
    untie = bool_arg(args, "untie_embeddings_and_output_weights")
    if emb is None:
        return None
    if untie is not None:
        origin["tied_embeddings"] = "args"
        tied = not untie
        if source.pp == 1 and (out is None) != tied:
            has = "has none" if out is None else f"has {out.key}"
            raise CheckpointFormatError(f"args.untie_embeddings_and_output_weights={untie} but the checkpoint {has}",
                                        culprit=source.origin, hint="the args do not belong to these tensors")
        return tied
    if head is not None:
        origin["tied_embeddings"] = "structure (word_embeddings_for_head)"
        return True
    if source.pp == 1:
        origin["tied_embeddings"] = "structure (output layer present or not)"
        return out is None
    if out is None:
        return None
    first, last = stages[emb.stage], stages[out.stage]
    same = all(bit_equal(a[emb.src_key], b[out.src_key]) for a, b in zip(first.modules, last.modules))
    origin["tied_embeddings"] = "tensors (last-stage output layer equals the word embeddings)" if same else \
        "tensors (last-stage output layer differs from the word embeddings)"
    return same


#: Megatron-LM's router ``args`` that say how tokens are routed to experts (inspect's ``moe``):
#: what each is called there.
MOE_ROUTING_ARGS = {"moe_router_topk": "topk", "moe_router_score_function": "score",
                    "moe_router_pre_softmax": "pre_softmax", "moe_router_num_groups": "groups",
                    "moe_router_group_topk": "group_topk", "moe_router_topk_scaling_factor": "scaling",
                    "moe_router_enable_expert_bias": "expert_bias", "moe_ffn_hidden_size": "expert_width",
                    "moe_shared_expert_intermediate_size": "shared_expert_width",
                    "moe_shared_expert_gate": "shared_expert_gate", "moe_layer_freq": "layer_freq"}


def moe_routing(args: Any, experts: int) -> dict[str, Any] | None:
    """A mixture-of-experts model's routing as its saved ``args`` record it (``experts``: per MoE
    layer, from the names), for inspect; None for a dense model. Unrecorded settings are left out."""
    if not experts:
        return None
    out: dict[str, Any] = {"experts": experts}
    for name, key in MOE_ROUTING_ARGS.items():
        value = getattr(args, name, None) if args is not None else None
        if value is not None:
            out[key] = value
    return out
