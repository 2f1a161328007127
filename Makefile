# Two commands for a newcomer:  `make demo`  and  `make test`  (each sets up .venv itself).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: demo test test-quick test-quick-py312 lint install install-dev bytecode clean side-env realtools-fixtures realtools-args check-realtools check-peft-back

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first (2.13.0 is the local CPU wheel), then the project under the committed constraints.
$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[s3]"
	# pre-migrate reshard's own Prefect database so the first run starts its embedded server quickly
	$(PY) -m reshard.flows.server upgrade
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# reshard is installed editable, so pip compiled none of its modules; where the environment sets
# PYTHONDONTWRITEBYTECODE, every process would compile them again on import (the demo's runs, and the
# tests' hundreds of CLI, engine and worker subprocesses). Compiled once here; up-to-date files are skipped.
bytecode: install
	$(PY) -m compileall -q reshard tests

demo: install bytecode
	rm -rf demo-output
	$(VENV)/bin/reshard sample demo-output/tp8 --tp 8 --layers 4 --hidden 256 --heads 16 --vocab 1024
	$(VENV)/bin/reshard inspect demo-output/tp8
	$(VENV)/bin/reshard plan demo-output/tp8 --target-tp 2
	$(VENV)/bin/reshard run demo-output/tp8 demo-output/tp2 --target-tp 2
	$(VENV)/bin/reshard run demo-output/tp8 demo-output/tp2 --target-tp 2
	$(VENV)/bin/reshard verify demo-output/tp2
	$(VENV)/bin/reshard inspect demo-output/tp2

# ruff (pinned in the dev extras, configured in pyproject.toml) first: a lint finding fails in
# seconds, before the tests start.
lint: install-dev
	$(VENV)/bin/ruff check reshard tests bench

# The whole suite on $(JOBS) workers, a test module per worker at a time (its module fixtures built
# once); every real-tool, server and fault-injection test is in it. `.ci/run` runs this.
JOBS ?= 2
test: install-dev lint bytecode
	$(PY) -m pytest -n $(JOBS) --dist loadfile

# The loop's tier (under 5 minutes): the tests that start no real tool or server (see the tiers in
# tests/conftest.py): unit tests, the planner, every format's read and write on tiny inputs, the CLI's errors.
test-quick: install-dev lint bytecode
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not slow and not mcore"

# The quick tier on Python 3.12, the Python of megatron-core >= 0.19 and Megatron-Bridge, in its own venv
# (the same install steps; torch 2.13.0 for 3.12 comes from the index as its CUDA build, which runs on a
# CPU). PYTHON312=/path/to/python3.12 when none is on PATH or under pyenv.
VENV312 ?= .venv-py312
PYTHON312 ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null); do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p && break; done)
test-quick-py312:
	@test -n "$(PYTHON312)" || { echo "make: no Python 3.12 found (fix: install one, or set PYTHON312=/path/to/python3.12)" >&2; exit 2; }
	$(MAKE) test-quick VENV=$(VENV312) PYTHON=$(PYTHON312)

# The side environment of the real-tool fixtures (tests/realtools/README.md): Python 3.12 with
# megatron-core 0.19, Megatron-Bridge 0.6, transformers and torch as pinned there. Not needed by `make test`.
SIDE_VENV ?= .side-venv
SIDE_PY := $(SIDE_VENV)/bin/python

$(SIDE_VENV)/.installed: tests/realtools/requirements.txt tests/realtools/setup_env.sh
	bash tests/realtools/setup_env.sh $(SIDE_VENV)

side-env: $(SIDE_VENV)/.installed

# (re)write tests/fixtures/realtools/ with the real tools (ONLY='name ...' for a few)
realtools-fixtures: side-env
	$(SIDE_PY) tests/realtools/write_fixtures.py $(if $(ONLY),--only $(ONLY))

# (re)write Megatron-LM's own args for each model kind reshard writes (tests/fixtures/realtools/megatron-lm-args/)
# and the defaults reshard completes args from (reshard/models/megatron_args.json)
realtools-args: side-env
	$(SIDE_PY) tests/realtools/args_snapshots.py
	$(SIDE_PY) tests/realtools/args_snapshots.py --defaults

# do megatron-core 0.19 and Megatron-Bridge 0.6 load OUT? (FLAGS: the model's Megatron-LM command
# line, or FIXTURE: a Megatron-LM fixture's; HF: a Hugging Face folder of the model for export_ckpt)
check-realtools: side-env
	$(SIDE_PY) tests/realtools/check_loads.py $(OUT) $(if $(FLAGS),--flags "$(FLAGS)") \
		$(if $(FIXTURE),--fixture $(FIXTURE)) $(if $(HF),--hf $(HF)) $(if $(REFERENCE),--reference $(REFERENCE))

# does Megatron-Bridge 0.6 load the PEFT checkpoints reshard writes (--to megatron-peft of the LoRA
# fixtures' adapters at TP 1 and TP 2, exported back by its export_adapter_ckpt and compared)?
check-peft-back: side-env
	$(SIDE_PY) tests/realtools/check_peft_back.py --reshard $(abspath $(VENV))/bin/reshard

clean:
	rm -rf $(VENV) demo-output .pytest_cache
