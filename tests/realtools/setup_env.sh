#!/usr/bin/env bash
# Build the side environment the real-tool fixtures are written and checked in (see README.md here):
# Python 3.12, megatron-core, Megatron-Bridge, transformers and torch at the versions pinned in
# requirements.txt. Usage: setup_env.sh VENV_DIR
#
# Every package is pinned there, so it installs with --no-deps: Megatron-Bridge's own requirements
# name GPU-only packages (Transformer Engine, flashinfer, fast-hadamard-transform, ...) that neither
# install nor run on a CPU; requirements.txt holds what its checkpoint code imports instead.
set -euo pipefail

venv=${1:?usage: setup_env.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)

# megatron-core >= 0.19 and Megatron-Bridge need Python 3.12 (Bridge: >=3.12,<3.13)
python=${PYTHON312:-}
if [ -z "$python" ]; then
    if python3.12 --version >/dev/null 2>&1; then
        python=python3.12
    else
        python=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
    fi
fi
if [ -z "$python" ] || ! "$python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "setup_env.sh: error: no Python 3.12 found (fix: install one, or set PYTHON312=/path/to/python3.12)" >&2
    exit 2
fi

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# torch for Python 3.12 comes from the index as its CUDA build (about 5.6 GB); it runs on a CPU
"$venv/bin/pip" install -q --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -c 'import megatron.core, megatron.training, torch, transformers; print("side env:", megatron.core.__version__, torch.__version__, transformers.__version__)'
touch "$venv/.installed"
