# phi2-server. Every target creates (or reuses) the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
REQUIREMENTS := requirements-$(if $(filter Darwin,$(shell uname -s)),mac,linux).txt

.PHONY: help install run demo test clean

help:
	@echo "make demo     serve the tiny offline demo model on http://127.0.0.1:8000"
	@echo "make run      serve PHI2_MODEL (default microsoft/phi-2)"
	@echo "make test     run the test suite"
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

clean:
	rm -rf $(VENV) .pytest_cache
