"""The few stand-ins megatron-core 0.19 and Megatron-Bridge 0.6 need to run on a CPU (side env only).

Both tools assume a GPU and Transformer Engine in a handful of places even where the rest of their
code runs on a CPU with gloo process groups. Each stand-in below replaces exactly one such place and
changes no computation: what they compute and what they save is the tools' own code.

* ``torch.cuda.get_rng_state`` / ``manual_seed``: the CUDA generator's state is 16 bytes (seed and
  offset) on a GPU; Megatron-LM saves it in ``rng_state`` and its RNG tracker forks it around
  parameter initialization. Here a 16-byte state of that shape records the last seed (weights are
  drawn on the CPU, ``use_cpu_initialization``, so no value depends on it).
* ``torch.cuda.synchronize``: dist_checkpointing's save waits for device copies: nothing to wait for.
* ``torch.cuda.current_device``: a scratch buffer's device (MoE's aux-loss scale, the allgather
  dispatcher): "cpu".
* ``torch.cuda.get_device_properties``: Megatron-LM's ``validate_args`` asks the GPU's architecture
  to choose among checks (e.g. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP before Blackwell): an H100's
  (9.0), the GPU most Megatron-LM users run; the launch sets that variable as their scripts do.
* ``megatron.training.checkpointing``'s ``read_metadata`` agrees on the iteration across ranks with
  an all-reduce of a tensor it makes on ``device='cuda'``: that module's ``torch.tensor`` makes it on
  the CPU instead (gloo reduces CPU tensors); nothing else of torch changes for it or anyone else.
* MLA's core attention: megatron-core's multi-latent attention passes ``k_channels`` and
  ``v_channels`` to its core attention, which Transformer Engine's attention takes and megatron-core's
  own local ``DotProductAttention`` does not (it sizes its output by ``kv_channels``, which is not
  MLA's value head width). The stand-in takes both and sizes the output by ``v_channels``; MLA
  passes its own softmax scale, so ``k_channels`` decides nothing else.
* Megatron-Bridge's ``peft/lora_layers.py`` imports ``transformer_engine.pytorch`` at module level
  (only to test ``isinstance`` against TE's linears). A stand-in module is served to that one
  module's import and removed right after, so no other module sees Transformer Engine as present
  (several set ``HAVE_TE`` at import: they must keep seeing it absent).
* Megatron-Bridge's model providers default to Transformer Engine's layer spec and fusions (and
  DeepSeek's to grouped-GEMM experts and the all-to-all dispatcher). ``AutoBridge.to_megatron_provider``
  (which ``import_ckpt`` and ``to_megatron_model`` call) is wrapped to hand out the provider with
  megatron-core's local spec, fusions off, and for MoE the allgather dispatcher and ``SequentialMLP``
  experts (whose torch_dist keys megatron-core makes the same as grouped experts'). These settings
  are recorded in the ``run_config.yaml`` Megatron-Bridge writes beside the checkpoint.
* ``megatron.bridge.peft.utils.HAVE_TE``: it is True whenever megatron-core's TE extension module
  defines its class names, which it does as placeholders without Transformer Engine; LoRA then
  wraps megatron-core's local linears as if they were TE's. Set False.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

_CUDA_STATE = {"seed": 0}


def _cuda_rng_state(device: Any = "cuda") -> torch.Tensor:
    """16 bytes like a CUDA generator's state: the last seed, then a zero offset."""
    return torch.tensor(list(int(_CUDA_STATE["seed"]).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)


def _cuda_manual_seed(seed: int) -> None:
    _CUDA_STATE["seed"] = int(seed)


def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    _CUDA_STATE["seed"] = int.from_bytes(bytes(new_state[:8].tolist()), "little")


def install_cuda_standins() -> None:
    """Replace the CUDA calls the tools make outside any computation (see the module docstring)."""
    torch.cuda.get_rng_state = _cuda_rng_state
    torch.cuda.random.get_rng_state = _cuda_rng_state
    torch.cuda.manual_seed = _cuda_manual_seed
    torch.cuda.random.manual_seed = _cuda_manual_seed
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(major=9, minor=0, name="H100")
    from megatron.core.tensor_parallel import random as mrandom

    # megatron-core sets a CUDA generator's state through torch's lazy-call queue, which never runs
    # without CUDA; record it instead, so a forked state reads back as it was set
    mrandom._set_cuda_rng_state = _set_cuda_rng_state


class _TorchOnCPU(types.ModuleType):
    """``torch`` as one module sees it: ``torch.tensor(..., device='cuda')`` lands on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.tensor(*args, device=device, **kwargs)


def install_checkpointing_cpu_tensors() -> None:
    from megatron.training import checkpointing

    checkpointing.torch = _TorchOnCPU()


def install_mla_local_attention() -> None:
    """megatron-core's local core attention, taking (and dropping) MLA's ``k_channels``/``v_channels``."""
    from megatron.core.models import backends
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla

    class MLALocalDotProductAttention(dpa.DotProductAttention):
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # the context is heads x v_channels wide
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
                self.hidden_size_per_attention_head = v_channels

    backends.LocalSpecProvider.core_attention = lambda self: MLALocalDotProductAttention
    mla.HAVE_TE = False


class _TEStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``transformer_engine`` / ``transformer_engine.pytorch`` while armed."""

    NAMES = ("transformer_engine", "transformer_engine.pytorch")

    def __init__(self) -> None:
        self.armed = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if self.armed and name in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=name == "transformer_engine")
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "transformer_engine.pytorch":
            class NotTransformerEngine:  # nothing is an instance of it: every isinstance test is False
                pass

            module.Linear = module.LayerNormLinear = NotTransformerEngine
            module.ops = types.SimpleNamespace(Sequential=NotTransformerEngine)


class _LoraLayersLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads ``megatron.bridge.peft.lora_layers`` with the TE stand-in armed for its body alone."""

    NAME = "megatron.bridge.peft.lora_layers"

    def __init__(self, te: _TEStandIn) -> None:
        self.te = te
        self.real: Any = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.NAME:
            return None
        for finder in sys.meta_path:
            if finder is self or finder is self.te:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                self.real = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: Any) -> Any:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        # its other imports first, with Transformer Engine absent (peft.utils sets HAVE_TE from them)
        for dep in ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                    "megatron.bridge.peft.lora_merge"):
            importlib.import_module(dep)
        self.te.armed = True
        try:
            self.real.exec_module(module)
        finally:
            self.te.armed = False
            for name in _TEStandIn.NAMES:
                sys.modules.pop(name, None)


def install_lora_layers_te_standin() -> None:
    """Arm the stand-in for ``peft/lora_layers.py`` (before ``megatron.bridge`` is first imported)."""
    te = _TEStandIn()
    sys.meta_path[:0] = [_LoraLayersLoader(te), te]


def install_for_megatron_core() -> None:
    """The stand-ins Megatron-LM's own code needs (megatron.bridge stays unimported: it patches nothing
    the Megatron-LM fixtures would then depend on)."""
    install_cuda_standins()
    install_mla_local_attention()
    install_checkpointing_cpu_tensors()


#: The provider fields that ask for a fused CUDA kernel (Transformer Engine or Apex).
FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "gradient_accumulation_fusion", "persist_layer_norm", "moe_permute_fusion", "cross_entropy_loss_fusion",
           "moe_shared_expert_overlap", "moe_grouped_gemm")


def cpu_provider(provider: Any) -> Any:
    """A Megatron-Bridge model provider set for the CPU (see the module docstring)."""
    from megatron.bridge.models import gpt_provider

    spec = provider.transformer_layer_spec
    if spec in (gpt_provider.default_layer_spec, gpt_provider.transformer_engine_layer_spec):
        provider.transformer_layer_spec = gpt_provider.local_layer_spec
    elif isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        provider.transformer_layer_spec = functools.partial(spec.func, *spec.args,
                                                            **{**spec.keywords, "use_transformer_engine": False})
    for field in FUSIONS:
        if hasattr(provider, field):
            setattr(provider, field, False)
    if provider.num_moe_experts:
        provider.moe_token_dispatcher_type = "allgather"
    return provider


def install_bridge_cpu_provider() -> None:
    from megatron.bridge import AutoBridge

    original = AutoBridge.to_megatron_provider

    @functools.wraps(original)
    def to_megatron_provider(self: Any, *args: Any, **kwargs: Any) -> Any:
        return cpu_provider(original(self, *args, **kwargs))

    AutoBridge.to_megatron_provider = to_megatron_provider


def install_for_bridge() -> None:
    """Every stand-in; imports megatron.bridge (the TE stand-in must be armed before its first import)."""
    install_for_megatron_core()
    install_lora_layers_te_standin()
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
    install_bridge_cpu_provider()
