# The two commands of the README: `make demo` and `make test`. Each creates .venv if it is missing and
# installs what it needs (every install goes through constraints.txt: see the comment there).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
SOURCES := pyproject.toml setup.py constraints.txt src/tightpack/core/_firstfit.c

.PHONY: demo test fuzz lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-demo: $(PY) $(SOURCES)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[demo]'
	touch $@

$(VENV)/.installed-dev: $(PY) $(SOURCES)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $@ $(VENV)/.installed-demo

$(VENV)/.installed-bench: $(VENV)/.installed-dev
	$(PIP) -e '.[bench]'
	touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/tightpack pack --overwrite

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q

# Every property test (hypothesis marks them) with the deeper `fuzz` profile of tests/conftest.py: 30x the
# examples of `make test`. The statistics report how many examples each test ran.
fuzz: $(VENV)/.installed-dev
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m hypothesis --hypothesis-show-statistics tests

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_pipeline.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_token_budget.py
	$(PY) benchmarks/bench_online.py
	$(PY) benchmarks/bench_mrope.py
	$(PY) benchmarks/bench_probe.py
	$(PY) benchmarks/bench_training.py

clean:
	rm -rf $(VENV) build src/*.egg-info src/tightpack/core/*.so packed-demo
