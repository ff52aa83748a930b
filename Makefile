# The two set-up commands from README.md. Each creates or refreshes .venv, so a fresh machine
# (Debian, Python 3.11, build tools) needs nothing installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

CHROMIUM ?= /usr/bin/chromium

.PHONY: demo test test-deps test-fast bench install

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

## test-deps: Debian's chromium for the dashboard test, installed when missing and run as root.
## If it cannot be installed the suite still runs: the browser test then fails in CI (CI=true)
## and is skipped, saying why, elsewhere.
test-deps:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the dashboard test"; \
	    ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null ) \
	      || echo "WARNING: could not install chromium: the browser test will fail in CI, be skipped elsewhere"; \
	  else \
	    echo "NOTE: $(CHROMIUM) is missing and this is not root: install chromium for the browser test"; \
	  fi; \
	fi

## test: install, then run the whole test suite (starts its own Redis servers on free ports)
test: $(STAMP) test-deps
	$(VENV)/bin/python -m pytest -q -ra

## test-fast: skip the tests on the real bundled model and the fault-injection tests
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not real_model and not fault and not browser"

## bench: the benchmarks, tables written to bench/results/
bench: $(STAMP)
	$(VENV)/bin/slotq bench engine
	$(VENV)/bin/slotq bench queue
	$(VENV)/bin/slotq bench prefix
	$(VENV)/bin/slotq bench gateway
