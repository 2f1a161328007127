"""What a model family is: a rule table (parameter name -> how it is partitioned) and the
answers that depend on the family's naming. A family knows no file layout (it never imports
:mod:`reshard.formats`) and no storage."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from reshard.core.rules import Rule


class ModelFamily(ABC):
    """One family, registered in :mod:`reshard.models.registry`. The planner asks the families,
    in ``priority`` order, which one claims a checkpoint's parameter names, and resolves every
    name against that family's ``rules`` (a name no rule matches is refused, never guessed)."""

    name: ClassVar[str]
    rules: ClassVar[tuple[Rule, ...]]
    #: Lower first; a catch-all family (claims every checkpoint) goes last.
    priority: ClassVar[int] = 100

    @abstractmethod
    def claims(self, keys: Sequence[str]) -> bool:
        """Are these parameter names this family's? (Names only, no tensors.)"""

    def naming(self, keys: Sequence[str]) -> str:
        """The naming variant the names follow (recorded in the model facts)."""
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
