"""Cross-rank checks: the ranks of one checkpoint must hold the same keys, and tensors that are
replicated must be bit-identical on every rank (else the ranks come from different checkpoints or
diverged)."""

from __future__ import annotations

from typing import Any

import torch

from reshard.core.errors import InconsistentShardsError
from reshard.core.lazy import materialized
from reshard.core.pages import PageDropper
from reshard.core.plan_types import ParamPlan, SourceStage


def check_same_keys(modules: list[dict[str, Any]], names: list[str]) -> None:
    ref = set(modules[0])
    for mod, name in zip(modules[1:], names[1:]):
        keys = set(mod)
        if keys != ref:
            missing, extra = sorted(ref - keys), sorted(keys - ref)
            detail = "; ".join(x for x in (f"missing {missing[:5]}" if missing else "",
                                          f"extra {extra[:5]}" if extra else "") if x)
            raise InconsistentShardsError(f"parameter names differ from rank 0: {detail}", culprit=name,
                                          hint="all rank files must come from one checkpoint")


def check_replicated(params: list[ParamPlan], stages: list[SourceStage], expert_tp: int | None = None) -> None:
    """Replicated tensors must be bit-identical on every rank: report, don't pick rank 0.
    (Pages read are given back at once: peak memory must not grow with the layer count.)
    A routed expert's are compared over the first ``expert_tp`` files of its row, which hold its
    expert (with expert tensor parallelism the row's other positions may stand for other ranks)."""
    pages = PageDropper(name for st in stages for name in st.names)
    for p in params:
        if p.spec is not None:
            continue
        st = stages[p.stage]
        ref = st.modules[0][p.src_key]
        upto = expert_tp if expert_tp is not None and p.rule.expert else len(st.modules)
        for mod, name in zip(st.modules[1:upto], st.names[1:upto]):
            if not bit_equal(ref, mod[p.src_key]):
                raise InconsistentShardsError(
                    f"replicated parameter {p.src_key} differs from rank 0", culprit=name,
                    hint="the ranks diverged during training or come from different checkpoints")
            pages.drop_tensor(mod[p.src_key])
        pages.drop_tensor(ref)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:  # a headers-only plan stands one file in for every rank of its stage
        return True
    a, b = materialized(a).contiguous(), materialized(b).contiguous()  # type: ignore[attr-defined]
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_copy_equals(copy: ParamPlan, original: ParamPlan, stages: list[SourceStage], what: str, hint: str) -> None:
    """Refuse to drop a later stage's copy of the first stage's tensor (a tied head, a stage copy
    of the embeddings) unless it equals the original on every rank: where they
    differ, the model computes with both and dropping one would change it."""
    a, b = stages[original.stage], stages[copy.stage]
    for ma, mb, name in zip(a.modules, b.modules, b.names):
        if not bit_equal(ma[original.src_key], mb[copy.src_key]):
            raise InconsistentShardsError(f"{what} {copy.src_key} differs from {original.src_key}", culprit=name,
                                          hint=hint)
