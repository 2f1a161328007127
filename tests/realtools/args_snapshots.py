"""Megatron-LM's own ``args`` for each kind of model reshard writes: the test authority (side env
only): ``make realtools-args``.

* ``tests/fixtures/realtools/megatron-lm-args/<kind>.json``: for each kind of :data:`KINDS`, the
  ``vars(args)`` megatron-core 0.19's ``megatron.training`` leaves after ``parse_args`` and
  ``validate_args`` on the model's ``pretrain_gpt.py`` command line (what ``pretrain_gpt.py`` saves in a
  checkpoint's ``args``, ``padded_vocab_size`` aside: the tokenizer sets it later), with the command
  line and versions. ``tests/test_megatron_args.py`` compares the ``args`` reshard writes for the same
  models with them.
* ``reshard/models/megatron_args.json`` (``--defaults``): the same for the smallest command line
  Megatron-LM takes, less the keys it sets (the model's): the defaults reshard completes the ``args``
  it makes from (``reshard/models/megatron_args.py``).

Values JSON cannot hold are tagged (:func:`encode`): an enum member as its class, name and value, a
torch dtype by name, a tuple as a list. Only the process's own rank and world are set (``RANK=0``,
``WORLD_SIZE=1``: ``validate_args`` reads them); nothing is started, no process group, no model.
"""

from __future__ import annotations

import argparse
import enum
import importlib.metadata as md
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = REPO / "tests" / "fixtures" / "realtools" / "megatron-lm-args"
DEFAULTS = REPO / "reshard" / "models" / "megatron_args.json"
sys.path.insert(0, str(HERE))

from write_fixtures import HF_AS_MEGATRON_LM  # noqa: E402

#: kind -> the model's Megatron-LM flags: the same models as reshard's imports of the real-tool fixtures'
#: Hugging Face folders (Llama, DeepSeek-V3) and of the GPT-2 and Mixtral folders
#: ``tests/test_megatron_args.py`` makes, each as its import describes it (so DeepSeek-V3's
#: router trained without an auxiliary loss, as its Hugging Face model computes none).
KINDS: dict[str, str] = {
    # GPT-2: LayerNorm, GELU (tanh: gelu_new, --openai-gelu), learned positions, biases, tied embeddings
    "gpt2": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --openai-gelu "
            "--norm-epsilon 1e-5 --max-position-embeddings 64",
    "llama": HF_AS_MEGATRON_LM["llama"],
    # Mixtral: every layer MoE, top-2 of 4 experts, no shared expert
    "mixtral": "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --group-query-attention "
               "--num-query-groups 4 --kv-channels 8 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 "
               "--position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights "
               "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 "
               "--max-position-embeddings 256",
    # YaRN as MLA's rotary (Megatron-LM's MLA default, which reshard and Megatron-Bridge record by name)
    "deepseek-v3": HF_AS_MEGATRON_LM["deepseek-v3"] + " --rope-type yarn --moe-router-load-balancing-type none",
    # Nemotron-H (tests/test_nemotron_h.py's model): the layer pattern under megatron-core 0.19's flag
    # (--hybrid-layer-pattern; 0.16's --hybrid-override-pattern is deprecated), Mamba-2 mixers, squared-ReLU
    # MLP and MoE (sigmoid router with expert bias, a shared expert), attention without position embedding
    "nemotron-h": "--hybrid-layer-pattern M-*EME --hidden-size 32 --ffn-hidden-size 48 --num-attention-heads 4 "
                  "--group-query-attention --num-query-groups 2 --kv-channels 8 --squared-relu --normalization "
                  "RMSNorm --position-embedding-type none --disable-bias-linear "
                  "--untie-embeddings-and-output-weights --mamba-state-dim 8 --mamba-head-dim 8 "
                  "--mamba-num-groups 2 --mamba-num-heads 8 --num-experts 4 --moe-router-topk 2 "
                  "--moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 24 "
                  "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --max-position-embeddings 64",
}
#: what a checkpoint's args say beside the model: its sequence length (the model's positions), the
#: smallest batch validate_args takes, the vocabulary, bf16 weights (the dtype of the models here)
RUN = "--seq-length {max_pos} --micro-batch-size 1 --vocab-size 128 --bf16"

#: The smallest command line Megatron-LM takes: the defaults table is its args, less the keys it sets
#: (:data:`MODEL_KEYS`), which reshard always takes from the model.
MINIMAL = ("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --max-position-embeddings 8 --seq-length 8 "
           "--micro-batch-size 1")
#: The model's own keys in MINIMAL's args (given, or derived from them by validate_args)
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length",
              "kv_channels", "ffn_hidden_size")
#: Classes megatron-core 0.16.1 cannot unpickle (its ``megatron.core.safe_globals`` lacks them: they
#: are 0.18's): args holding one would not load there, so their keys are left to the loader's defaults.
NEWER_THAN_016 = ("megatron.core.transformer.enums.InferenceCudaGraphScope",
                  "megatron.core.transformer.enums.CudaGraphModule")


def encode(value: Any) -> Any:
    """A JSON value for an ``args`` value: enum members, dtypes and tuples tagged, the rest as is."""
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {"__enum__": f"{cls.__module__}.{cls.__qualname__}", "name": value.name, "value": value.value}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"args value {value!r} of type {type(value).__name__}: no JSON form")


def command_line(kind: str) -> list[str]:
    flags = shlex.split(KINDS[kind])
    max_pos = flags[flags.index("--max-position-embeddings") + 1]
    return ["pretrain_gpt.py", *flags, *shlex.split(RUN.format(max_pos=max_pos))]


def megatron_args(argv: list[str], parsed: dict[str, Any] | None = None) -> dict[str, Any]:
    """``vars(args)`` after ``parse_args`` + ``validate_args`` on the command line ``argv`` (and, into
    ``parsed``, ``vars(args)`` as ``parse_args`` left them)."""
    import cpu_shims
    from megatron.training.arguments import parse_args, validate_args

    cpu_shims.install_cuda_standins()  # validate_args asks the GPU's architecture
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.argv = list(argv)
    args = parse_args()
    if parsed is not None:
        parsed.update(vars(args))
    validate_args(args, {})
    return vars(args)


def unportable(value: Any) -> bool:
    return isinstance(value, enum.Enum) and f"{type(value).__module__}.{type(value).__qualname__}" in NEWER_THAN_016 \
        or isinstance(value, (list, tuple)) and any(unportable(v) for v in value)


def defaults_table() -> dict[str, Any]:
    argv = ["pretrain_gpt.py", *shlex.split(MINIMAL)]
    parsed: dict[str, Any] = {}
    args = megatron_args(argv, parsed)
    left_out = sorted(k for k, v in args.items() if unportable(v))
    # the parser's own default where validate_args changed it for this command line (the rules that
    # change it again for other models start from it: reshard/models/megatron_args.py's derived())
    changed = {k: encode(v) for k, v in sorted(parsed.items())
               if k in args and v != args[k] and k not in MODEL_KEYS and k not in left_out and not isinstance(v, str)}
    return {"made_by": "tests/realtools/args_snapshots.py --defaults (make realtools-args): vars(args) after "
                       "megatron.training.arguments.parse_args + validate_args (RANK=0, WORLD_SIZE=1)",
            "command_line": shlex.join(argv), "versions": versions(),
            "model_keys": list(MODEL_KEYS),
            "left_out": {k: f"holds {type(args[k]).__qualname__}, which megatron-core 0.16.1 cannot unpickle"
                         for k in left_out},
            "defaults": {k: encode(v) for k, v in sorted(args.items()) if k not in MODEL_KEYS and k not in left_out},
            "parser_defaults": changed}


def versions() -> dict[str, str]:
    return {"megatron-core": md.version("megatron-core"), "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", help="some kinds only")
    p.add_argument("--defaults", action="store_true", help=f"write {DEFAULTS.relative_to(REPO)} instead")
    a = p.parse_args()
    if a.defaults:
        DEFAULTS.write_text(json.dumps(defaults_table(), indent=1) + "\n")
        print(f"defaults -> {DEFAULTS}")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        if a.only and kind not in a.only:
            continue
        argv = command_line(kind)
        args = megatron_args(argv)
        snapshot = {"command_line": shlex.join(argv),
                    "made_by": "megatron.training.arguments.parse_args + validate_args (RANK=0, WORLD_SIZE=1)",
                    "versions": versions(), "args": {k: encode(v) for k, v in sorted(args.items())}}
        (OUT / f"{kind}.json").write_text(json.dumps(snapshot, indent=1) + "\n")
        print(f"{kind}: {len(args)} args -> {OUT / f'{kind}.json'}")


if __name__ == "__main__":
    main()
