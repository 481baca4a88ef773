# Every target creates .venv on first use. torch (the local CPU build pinned in
# requirements/lock-constraints.txt) goes in first,
# so that the bare "torch" requirement never pulls a multi-GB CUDA build; everything else comes
# at the exact versions of requirements/lock.txt, so that what CI tested is what users install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements/lock.txt
LOCK_CONSTRAINTS := requirements/lock-constraints.txt
# Parallel test workers (pytest-xdist). Tests that need the whole machine share one
# xdist_group, which --dist loadgroup runs on a single worker.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
# test-latest: a separate venv holding the newest versions pyproject's ranges allow.
LATEST_VENV := .venv-latest

.PHONY: test test-all test-latest lock demo demo-hash serve lint bench clean

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c $(LOCK_CONSTRAINTS) torch
	$(PY) -m pip install -q -c $(LOCK) -e ".[dev]"
	touch $@

# The CI suite: everything but the tests marked slow (long randomized runs, soak tests), which test-all adds.
test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# The suite on the newest versions the ranges allow (torch stays the local CPU build, as in the lock);
# prints what moved past the lock first. When it passes, `make lock` takes the new versions.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q -c $(LOCK_CONSTRAINTS) torch
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager \
		-c $(LOCK_CONSTRAINTS) -e ".[dev]"
	$(LATEST_VENV)/bin/python tools/compare_lock.py $(LOCK)
	$(LATEST_VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_PARALLEL)

# Recompile the lock from pyproject.toml's ranges at the newest versions they allow. The local
# CPU build's "+cpu" label is dropped, so that the pin also matches a torch from PyPI.
lock: $(VENV)/.installed
	$(PY) -m pip install -q pip-tools
	$(VENV)/bin/pip-compile -q --upgrade --extra dev --strip-extras --no-emit-index-url \
		--no-emit-find-links --constraint $(LOCK_CONSTRAINTS) --output-file $(LOCK) pyproject.toml
	sed -i 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/' $(LOCK)

demo: $(VENV)/.installed
	$(VENV)/bin/kvflow generate "The capital of France is" "Once upon a time" "She walked into the room and" --max-tokens 32 --show-stats

demo-hash: $(VENV)/.installed
	$(VENV)/bin/kvflow demo

serve: $(VENV)/.installed
	$(VENV)/bin/kvflow serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check kvflow tests benchmarks tools
	$(VENV)/bin/ruff check kvflow tests benchmarks tools

bench: $(VENV)/.installed
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) *.egg-info
