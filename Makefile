# phi2-server. Every target creates (or reuses) the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
REQUIREMENTS := requirements-$(if $(filter Darwin,$(shell uname -s)),mac,linux).txt

.PHONY: help install run demo test bench bench-overhead clean

help:
	@echo "make demo     serve the tiny offline demo model on http://127.0.0.1:8000"
	@echo "make run      serve PHI2_MODEL (default microsoft/phi-2)"
	@echo "make test     run the test suite"
	@echo "make bench    start a server on a free port, benchmark it (BENCH_ARGS), stop it"
	@echo "make bench-overhead  the same request in-process and over HTTP, and the ratio"
	@echo "make install  create $(VENV) with $(REQUIREMENTS)"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: $(REQUIREMENTS) | $(PY)
	$(PIP) -r $(REQUIREMENTS)
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

install: $(VENV)/.runtime

run: install
	$(PY) phi2_server.py

demo: install
	PHI2_MODEL=tiny $(PY) phi2_server.py

test: $(VENV)/.dev
	$(PY) -m pytest -q

# PHI2_MODEL defaults to Phi-2 when it is in the Hugging Face cache, else the tiny demo model;
# PHI2_MODEL=random:phi-2 is Phi-2's architecture with random weights (see BENCHMARKS.md).
BENCH_ARGS ?= --concurrency 1,4,16
OVERHEAD_ARGS ?= --max-tokens 200 --runs 6

bench: install
	$(PY) bench.py --spawn $(BENCH_ARGS)

bench-overhead: install
	$(PY) bench.py --overhead $(OVERHEAD_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
