# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := $(shell sed -n 's/^torch==//p' constraints.txt)
WORK ?= workspace

.PHONY: venv system-packages test test-fast demo bench clean

venv: $(STAMP)

# torch goes in first and pinned, through pip and its configuration (an index or wheel folder
# that holds the CPU build): an unpinned torch requirement would pull a multi-GB CUDA build.
# uv installs the rest (pinned in constraints.txt), keeping that torch, in about half pip's
# time; compiled to bytecode as pip does, since environments that set PYTHONDONTWRITEBYTECODE
# would otherwise compile every module again in every process.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -c constraints.txt uv
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -c constraints.txt -e ".[dev]"
	touch $@

# Real services the slow tests start for themselves, from Debian's packages (never downloaded
# binaries or mocks): Chromium and its chromedriver for the browser test, Slurm (slurmctld,
# slurmd, munge) for the Slurm launcher, PostgreSQL for the production stores.
SYSTEM_PACKAGES := chromium chromium-driver slurm-wlm munge postgresql
system-packages:
	@if ! command -v chromium >/dev/null || [ ! -x /usr/bin/chromedriver ] || ! command -v slurmctld >/dev/null \
			|| ! command -v munged >/dev/null || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
			echo "make system-packages: the tests need Debian's $(SYSTEM_PACKAGES); install them as root" >&2; \
			exit 1; \
		fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(SYSTEM_PACKAGES) >/dev/null; \
	fi

# llmflow's own modules (and the tests' helpers), compiled once: where PYTHONDONTWRITEBYTECODE is
# set, each of the suite's few hundred processes (torchrun workers, command lines, servers)
# would compile the modules it imports again, about 0.25 s each.
SOURCES := llmflow models kernels flows tasks tests

# Everything, as CI runs it, in two pytest-xdist processes that take whole test modules (module
# fixtures are built once); the 25 slowest tests and the time per module are listed at the end.
test: $(STAMP) system-packages
	$(VENV)/bin/ruff check .
	$(PY) -m compileall -q $(SOURCES)
	$(PY) -m pytest -n 2 --dist loadfile --durations=25

# The edit-test loop: every test not marked slow (no flows end to end, multi-rank runs,
# browser or finetune). A run that selects no test fails (tests/conftest.py).
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m compileall -q $(SOURCES)
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/llmflow demo --workspace $(WORK)

bench: $(STAMP)
	$(PY) -m bench.train_step
	$(PY) -m bench.moe_step

clean:
	rm -rf $(VENV) $(WORK) build *.egg-info
