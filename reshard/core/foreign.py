"""Stand-ins for the few foreign classes real Megatron checkpoints reference, kept as inert data.

A Megatron-LM ``model_optim_rng.pt`` references classes reshard must not import (and may not
have installed): ``args.attention_backend`` is a ``megatron.core`` enum, ``rng_state`` holds
numpy arrays, ``rerun_state_machine`` holds megatron enums. Allowlisting the real classes would
run their code on load (and need megatron/numpy importable); refusing them would refuse every
modern Megatron-LM checkpoint.

Instead each allowlisted qualified name is bound to a generated :class:`Foreign` subclass. The
weights-only unpickler calls it exactly as it would call the real class (``REDUCE`` with the
pickled arguments, ``NEWOBJ``, then ``BUILD`` with the pickled state); the stand-in only
records those values. :func:`save` re-pickles a stand-in with the *same* global name,
arguments and state, so entries reshard carries (``args``, ``rerun_state_machine``) come out
as they went in and load with the real classes wherever those are installed.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
from argparse import Namespace
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, ClassVar

import torch


class Foreign:
    """An instance of an allowlisted foreign class, as data: constructor args and state."""

    qualname: ClassVar[str] = ""
    __slots__ = ("foreign_args", "foreign_state", "foreign_newobj")

    def __new__(cls, *args: Any) -> Foreign:
        obj = super().__new__(cls)
        obj.foreign_args = args
        obj.foreign_state = None
        obj.foreign_newobj = True  # NEWOBJ calls only __new__ ...
        return obj

    def __init__(self, *args: Any) -> None:  # ... REDUCE calls cls(*args), i.e. __init__ too
        self.foreign_newobj = False

    def __setstate__(self, state: Any) -> None:
        self.foreign_state = state

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return (type(self), self.foreign_args, self.foreign_state)

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and other.foreign_args == self.foreign_args  # type: ignore[attr-defined]
                and other.foreign_state == self.foreign_state)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.qualname, repr(self.foreign_args)))

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self.foreign_args)
        return f"<foreign {self.qualname}({args})>"


def stand_in(qualname: str) -> type[Foreign]:
    """A new :class:`Foreign` subclass standing in for the class or function ``qualname``."""
    short = qualname.rsplit(".", 1)[-1]
    return type(f"Foreign_{short}", (Foreign,), {"qualname": qualname, "__slots__": ()})


#: Foreign names real Megatron-LM / megatron-core checkpoints reference (cf. megatron-core's own
#: ``megatron.core.safe_globals``), each bound to an inert stand-in.
FOREIGN_NAMES: tuple[str, ...] = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    # megatron-core >= 0.18: Megatron-LM's validate_args always saves args.inference_cuda_graph_scope
    # as this enum (``none`` by default) and args.cuda_graph_modules as a list of CudaGraphModule
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "numpy.dtypes.Float64DType",
    "numpy.dtypes.Int64DType",
    "pathlib.PosixPath",
    "pathlib._local.PosixPath",  # how Python 3.13 pickles a PosixPath (CPython gh-133789)
    "signal.Signals",
    # rng_state's tracker states with CUDA-graph-safe RNG (megatron-core's random.py): a generator,
    # pickled as Generator(device) and its (seed, offset, state tensor), recorded as data
    "torch._C.Generator",
    # DeepSpeed ZeRO optimizer files (``*_optim_states.pt``): the loss scaler, the stage enum, the
    # per-parameter fragment addresses. Read as data; DeepSpeed is never imported.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class ForeignMember(Foreign):
    """``getattr(<stand-in class>, "name")``: an enum member pickled *by name*.

    Some Python releases (3.11.2, Debian 12's ``python3``, for one; 3.11.7 pickles by value)
    write every enum member as ``getattr(EnumClass, 'member')``, so a Megatron checkpoint saved
    there references ``builtins.getattr`` for ``args.attention_backend``. The stand-in only
    records the pair, and only for a stand-in class and a string name: a real ``getattr`` is
    never called, and ``getattr`` on anything else is refused like any unlisted global.
    """

    qualname = "builtins.getattr"
    __slots__ = ()

    def __new__(cls, *args: Any) -> Foreign:
        if (len(args) != 2 or not (isinstance(args[0], type) and issubclass(args[0], Foreign))
                or issubclass(args[0], ForeignMember) or type(args[1]) is not str):
            raise pickle.UnpicklingError(
                f"getattr is allowed only as an enum member by name on an allowlisted class, "
                f"not getattr{args!r}")
        return super().__new__(cls, *args)


STAND_INS: dict[str, type[Foreign]] = {
    **{name: stand_in(name) for name in FOREIGN_NAMES},
    ForeignMember.qualname: ForeignMember,
}

#: ``(stand-in, qualified name)`` pairs for ``torch.serialization.safe_globals``.
SAFE_STAND_INS: tuple[tuple[type[Foreign], str], ...] = tuple((cls, name) for name, cls in STAND_INS.items())


def contains_foreign(obj: Any, _depth: int = 0) -> bool:
    """Whether ``obj`` (containers, namespaces) holds a stand-in anywhere (tensors skipped)."""
    return find_foreign(obj, _depth) is not None


def find_foreign(obj: Any, _depth: int = 0) -> str | None:
    """The qualified name of the first stand-in in ``obj`` (containers, namespaces; tensors
    skipped), an enum member by name as ``Class.member``; None when it holds none."""
    if _depth > 50 or isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, ForeignMember):
        cls, member = obj.foreign_args
        return f"{cls.qualname}.{member}"
    if isinstance(obj, Foreign) or (isinstance(obj, type) and issubclass(obj, Foreign)):
        return obj.qualname
    items: Iterable[Any]
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    elif isinstance(obj, (Namespace, SimpleNamespace)):
        items = vars(obj).values()
    else:
        return None
    return next((name for x in items if (name := find_foreign(x, _depth + 1)) is not None), None)


class _ForeignPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pure-Python pickler that writes each stand-in class as its original global name."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Foreign) and obj.qualname:
            module, _, attr = obj.qualname.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Foreign):
            if obj.foreign_newobj:
                return (copyreg.__newobj__, (type(obj), *obj.foreign_args), obj.foreign_state)
            return (type(obj), obj.foreign_args, obj.foreign_state)
        return NotImplemented


class ForeignPickleModule:
    """The ``pickle_module`` for ``torch.save`` (or :func:`reshard.core.torch_writer.save`) of an
    object that :func:`contains_foreign` stand-ins, so they are written back under their original
    names; writers that save such objects themselves pass it. Only ``Pickler`` is used for saving."""

    Pickler = _ForeignPickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)
    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)


def save(obj: Any, f: str | os.PathLike[str] | io.BufferedIOBase) -> None:
    """``torch.save``; stand-ins (if any) are written back under their original names."""
    if contains_foreign(obj):
        torch.save(obj, f, pickle_module=ForeignPickleModule)  # type: ignore[arg-type]
    else:
        torch.save(obj, f)
