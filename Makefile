# Every target creates .venv on first use. torch==2.13.0 (a local CPU build) goes in first,
# so that the bare "torch" requirement never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-all demo demo-hash serve lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The CI suite: everything but the tests marked slow (long randomized runs, soak tests), which test-all adds.
test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

test-all: $(VENV)/.installed
	$(PY) -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/kvflow generate "The capital of France is" "Once upon a time" "She walked into the room and" --max-tokens 32 --show-stats

demo-hash: $(VENV)/.installed
	$(VENV)/bin/kvflow demo

serve: $(VENV)/.installed
	$(VENV)/bin/kvflow serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check kvflow tests benchmarks
	$(VENV)/bin/ruff check kvflow tests benchmarks

bench: $(VENV)/.installed
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
