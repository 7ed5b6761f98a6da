# Set-up and everyday commands. Each target creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed-stamp

PYPY ?= pypy3
PYPY_VENV ?= .venv-pypy
PYPY_STAMP = $(PYPY_VENV)/.installed-stamp
# PyPy sizes its young generation from the CPU cache it detects; some VMs report
# hundreds of MB of L3, which gives a nursery that large and no major collection
# before ~2 GB. 4 MB is faster and keeps the broker's memory flat.
export PYPY_GC_NURSERY ?= 4MB

.PHONY: run run-cpython run-pypy test test-fast test-ops test-oldest test-pypy lint bench dist failover-drill clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,postgres,mcp]'
	touch $(STAMP)

# `make run` uses PyPy when it is on the machine: its JIT serves two to three times the
# requests of CPython. The CPython venv is made either way: it holds the `relay`
# command the README uses beside the broker.
HAVE_PYPY := $(shell command -v $(PYPY) 2>/dev/null)

## run: start the broker on the shipped config (loopback, sqlite), on PyPy when installed
run: $(STAMP) $(if $(HAVE_PYPY),$(PYPY_STAMP))
ifneq ($(HAVE_PYPY),)
	@echo "make run: the broker runs on PyPy ($(HAVE_PYPY)); 'make run-cpython' runs it on CPython"
	$(PYPY_VENV)/bin/twistd -n relay --config conf/relay.yaml
else
	@echo "make run: the broker runs on CPython; with PyPy installed (apt-get install pypy3) it runs on PyPy, two to three times as fast"
	$(BIN)/twistd -n relay --config conf/relay.yaml
endif

## run-cpython: start the broker on CPython whether or not PyPy is installed
run-cpython: $(STAMP)
	$(BIN)/twistd -n relay --config conf/relay.yaml

## test: lint, then the whole test suite (the MCP tests fail rather than skip
## on CPython 3.10+ when the SDK is missing)
test: $(STAMP)
	$(BIN)/ruff check .
	RELAY_TEST_MCP_REQUIRED=1 $(BIN)/python -m pytest -q

## test-fast: the in-memory tests alone (no process, no PostgreSQL, no browser)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not process and not postgres and not browser"

CI_STAMP = $(VENV)/.ci-installed-stamp

$(CI_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,ci]'
	touch $(CI_STAMP)

## test-ops: fuzz a running broker from docs/openapi.yaml, drive the dashboard and the inbox in
## headless chromium (needs /usr/bin/chromium: apt-get install chromium)
test-ops: $(CI_STAMP)
	$(BIN)/python -m pytest -q tests/processes/fuzz_openapi.py tests/processes/browser_dashboard.py tests/processes/browser_inbox.py

$(PYPY_STAMP): setup.cfg pyproject.toml
	$(PYPY) -m venv $(PYPY_VENV)
	$(PYPY_VENV)/bin/pip install -q --upgrade pip
	$(PYPY_VENV)/bin/pip install -q -e '.[test,postgres]'
	touch $(PYPY_STAMP)

## run-pypy: the broker on PyPy, two to three times as fast (needs pypy3: apt-get install pypy3)
run-pypy: $(PYPY_STAMP)
	$(PYPY_VENV)/bin/twistd -n relay --config conf/relay.yaml

OLDEST_VENV ?= .venv-oldest
OLDEST_STAMP = $(OLDEST_VENV)/.installed-stamp

$(OLDEST_STAMP): setup.cfg pyproject.toml .ci/oldest.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/pip install -q -c .ci/oldest.txt -e '.[test,postgres,mcp]'
	touch $(OLDEST_STAMP)

## test-oldest: the whole test suite on the lowest versions of Twisted, Klein,
## treq and the rest that setup.cfg allows (.ci/oldest.txt)
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest -q

## test-pypy: the whole test suite on PyPy (needs pypy3: apt-get install pypy3)
test-pypy: $(PYPY_STAMP)
	$(PYPY_VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

DIST_STAMP = $(VENV)/.dist-stamp

$(DIST_STAMP): $(STAMP)
	$(BIN)/pip install -q build
	touch $(DIST_STAMP)

## dist: build the wheel and the sdist a release publishes into dist/, and check
## that they hold the dashboard, the SQL scripts, the twistd plugins and the docs
dist: $(DIST_STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python tests/support/check_dist.py dist

## bench: the benchmark suite (prints figures; not part of the tests)
bench: $(STAMP)
	$(BIN)/python bench/run_suite.py --quick

## failover-drill: two brokers on a primary and a synchronous standby of the local
## PostgreSQL (temporary clusters on free ports), the primary killed under load, the
## standby promoted, every acknowledged send and completion checked (about a minute)
failover-drill: $(STAMP)
	$(BIN)/python bench/failover.py

clean:
	rm -rf $(VENV) $(PYPY_VENV) $(OLDEST_VENV) build dist *.egg-info data
