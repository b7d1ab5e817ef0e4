# `make demo` and `make test` each set up .venv on a fresh machine, then do their job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml setup.py cython_ext/_native.pyx
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/expertd demo

# The suite runs twice: with the Cython hot paths and with their pure-Python twins (the tests
# that exercise them; see the markers in pyproject.toml and tests/conftest.py). Two pytest-xdist
# workers: every test has its own daemon, runtime directory and temp files, and most of a test's
# time is spent waiting on processes, so two at once take about 60% of the time of one.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=20
	EXPERTD_PURE_PYTHON=1 $(BIN)/python -m pytest -q -n 2 -m "not slow and not once"

# ruff, with the rules in pyproject.toml; CI runs it beside the tests.
lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) build *.egg-info expertd/*.so cython_ext/*.c
