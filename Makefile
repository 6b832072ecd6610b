# Set-up: `make demo` (main job) and `make test` (whole suite) work on a fresh machine with Python and make.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint bench docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_SPEC)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# two test processes (pytest-xdist): most tests wait on subprocesses, sockets or sleeps, so the
# suite takes about half the time on a 2-core machine; TEST_JOBS=0 runs it in one process. Tests
# marked `serial` bound wall time (a prompt Ctrl-C, a deadline) and run alone afterwards.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not serial" -q -n $(TEST_JOBS)
	$(PY) -m pytest -m "serial and not slow" -q

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
