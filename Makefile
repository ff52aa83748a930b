# The two set-up commands from README.md. Each creates or refreshes .venv, so a fresh machine
# (Debian, Python 3.11, build tools) needs nothing installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PIP     = $(VENV)/bin/pip
# GPU=cuda builds llama-cpp-python with CUDA (needs the CUDA toolkit: nvcc on PATH); empty = CPU.
GPU    ?=
# instructor, for its test against the gateway (tests/gateway/test_gateway_clients.py), installed after slotq
# without its dependencies: its pins (jiter<0.15, rich<15) make pip take openai back to 3.3 and pydantic-ai with
# it. What it imports besides is in the test extra. .ci/test-python reads this line too.
INSTRUCTOR = instructor==1.17.0
STAMP   = $(VENV)/.installed-$(shell { cat pyproject.toml; echo '$(INSTRUCTOR)'; } | sha1sum | cut -c1-12)$(if $(GPU),-$(GPU))
LLAMA_CPP = $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
CMAKE_ARGS_cuda = -DGGML_CUDA=on

CHROMIUM ?= /usr/bin/chromium
# Pythons besides .venv's 3.11 (requires-python >= 3.11) that the fast part of the suite runs on: the newest
# one, so CI tests the oldest and the newest supported. 3.12 lies between them; a run of its own cost CI
# 8.5 minutes, and no failure in its history here was specific to 3.12: `make test-pythons PYTHONS="3.12 3.13"` adds it.
PYTHONS ?= 3.13
# slow: tests that mostly wait (timeouts, failovers, clusters forming); `make test` runs them once, on .venv's Python
FAST     = not real_model and not fault and not browser and not install and not slow
# Processes the suite runs in (pytest-xdist): most tests wait on servers, timeouts and child processes, so two
# share a 2-core machine well (the whole suite 23.0 -> 12.7-13.4 min there, 2026-12-07). Each process starts its own
# session fixtures (Valkey servers, clusters, model files on free ports and in its own temporary folders).
# More were not tried; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: demo lint test test-fast test-pythons test-deps bench install

$(STAMP): pyproject.toml
	@if [ -n "$(GPU)" ] && [ -z "$(CMAKE_ARGS_$(GPU))" ]; then echo "GPU=$(GPU): unknown; use GPU=cuda, or CMAKE_ARGS for another backend"; exit 2; fi
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@echo "installing slotq (llama-cpp-python compiles from source the first time: ~6 min on 2 cores)"
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps '$(INSTRUCTOR)'
ifneq ($(GPU),)
	@echo "rebuilding $(LLAMA_CPP) for GPU=$(GPU) (CMAKE_ARGS=$(CMAKE_ARGS_$(GPU))); not from pip's cache, which holds the CPU build"
	CMAKE_ARGS="$(CMAKE_ARGS_$(GPU))" $(PIP) install --quiet --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python '$(LLAMA_CPP)'
endif
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

## demo: install, then run the zero-config demo (embedded Redis, bundled model, a dozen jobs)
demo: $(STAMP)
	$(VENV)/bin/slotq demo

## test-deps: tools the tests use beyond Python, installed with apt-get when missing and running as
## root: promtool (Debian's prometheus package) for the alert-rule tests, chromium for the dashboard
## test. If one cannot be installed the suite still runs: its tests fail under CI=true, skip elsewhere.
test-deps:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing promtool (Debian package prometheus, no recommends)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
	      || echo "WARNING: could not install prometheus (promtool); the alert-rule tests will fail under CI=true"; \
	  else \
	    echo "note: promtool not found (apt-get install prometheus as root); the alert-rule tests will skip"; \
	  fi; }
	@[ -x "$(CHROMIUM)" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the dashboard test"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "WARNING: could not install chromium; the dashboard test will fail under CI=true"; \
	  else \
	    echo "note: $(CHROMIUM) not found (apt-get install chromium as root); the dashboard test will skip"; \
	  fi; }

## lint: ruff (pyproject's [tool.ruff]) on everything, mypy strict on all of slotq
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

## test: install, lint, then run the whole test suite (starts its own Redis servers on free ports); with CI=true
## (.ci/run) also its fast part on each of PYTHONS (test-pythons)
test: $(STAMP) test-deps lint
	$(VENV)/bin/python -m pytest -q -ra --durations=20 -n $(TEST_WORKERS)
ifeq ($(CI),true)
	$(MAKE) --no-print-directory test-pythons
endif

## test-fast: skip the tests on the real bundled model, the fault-injection, browser and fresh-venv install tests,
## and the slow ones that mostly wait
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "$(FAST)" -n $(TEST_WORKERS)

## test-pythons: test-fast's selection on each of PYTHONS, each in its own .venv-X.Y (.ci/test-python: pyenv's
## interpreter; a missing one is skipped with a note, and fails under CI=true, whose image has them)
test-pythons: $(STAMP)
	@for v in $(PYTHONS); do .ci/test-python $$v -q -m "$(FAST)" -n $(TEST_WORKERS) || exit 1; done

## bench: the benchmarks, tables written to bench/results/
bench: $(STAMP)
	$(PIP) install --quiet -e '.[test,bench]'
	$(VENV)/bin/slotq bench engine
	$(VENV)/bin/slotq bench queue
	$(VENV)/bin/slotq bench prefix
	$(VENV)/bin/slotq bench gateway
	$(VENV)/bin/slotq bench gateway-batch
	$(VENV)/bin/slotq bench fleet
	$(VENV)/bin/slotq bench fleet --cluster 1,3,6
	$(VENV)/bin/slotq bench bulk
	$(VENV)/bin/slotq bench peers
	$(VENV)/bin/slotq bench overhead
	$(VENV)/bin/slotq bench constraints
	$(VENV)/bin/slotq bench logprobs
	$(VENV)/bin/slotq bench step-costs
	$(VENV)/bin/slotq bench embeddings
	$(VENV)/bin/slotq bench rerank
	$(VENV)/bin/slotq bench spec
	$(VENV)/bin/slotq bench on-demand
	$(VENV)/bin/slotq bench lora
	$(VENV)/bin/slotq bench api-shapes
	$(VENV)/bin/slotq bench clients
