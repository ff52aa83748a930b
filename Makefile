# The two set-up commands from README.md. Each creates or refreshes .venv, so a fresh machine
# (Debian, Python 3.11, build tools) needs nothing installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test test-fast bench install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@echo "installing slotq (llama-cpp-python compiles from source the first time: ~6 min on 2 cores)"
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## demo: install, then run the zero-config demo (embedded Redis, bundled model, a dozen jobs)
demo: $(STAMP)
	$(VENV)/bin/slotq demo

## test: install, then run the whole test suite (starts its own Redis servers on free ports)
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra

## test-fast: skip the tests on the real bundled model and the fault-injection tests
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not real_model and not fault"

## bench: the benchmarks, tables written to bench/results/
bench: $(STAMP)
	$(VENV)/bin/slotq bench engine
	$(VENV)/bin/slotq bench queue
	$(VENV)/bin/slotq bench prefix
	$(VENV)/bin/slotq bench bulk
