# Two entry points for a fresh machine: `make demo` and `make test` (`make test-fast`
# runs the tests not marked slow, in under 3 minutes on 2 cores).
# Both create the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := $(shell sed -n 's/^torch==//p' constraints.txt)
WORK ?= workspace

.PHONY: venv test test-fast demo bench clean

venv: $(STAMP)

# torch goes in first and pinned: an unpinned torch requirement would pull a
# multi-GB CUDA build where only the CPU wheel is wanted.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/llmflow demo --workspace $(WORK)

bench: $(STAMP)
	$(PY) -m bench.train_step

clean:
	rm -rf $(VENV) $(WORK) build *.egg-info
