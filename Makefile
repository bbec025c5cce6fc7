# Two commands do everything on a fresh machine: `make demo` and `make test`.
# torch is pinned for installs here because a CPU wheel of 2.13.0 lies on these machines;
# an unpinned torch would pull a multi-GB CUDA build. The package itself asks for torch>=2.4.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The main job: plan the micro-batch for a 200MB budget (the effective batch of 64 then
# runs as 4 or more micro-batches), train the byte-level GPT on the Python standard library's source,
# write runs/gpt-TIME/.
demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m gradaccum train --budget 200MB

# pytest exits 5 when it collects no test; that is a failure of the suite, not a pass,
# but it is reported as such by name rather than as a bare make error.
# Two workers (pytest-xdist), one thread each, keep both cores busy: much of the suite waits
# on subprocesses it starts (the CLI, torchrun), which set their own thread counts; worksteal
# hands a worker that ran out of tests some of the other's, so a few long ones at the end do
# not leave one core idle.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist worksteal; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

# The unit tests alone (tests/unit/, in-process, under a minute): the loop while you work.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist worksteal tests/unit

# The heavy tier (tests marked slow: torchrun CLI runs, signals and resumes, the kills, the
# planner's fresh-process checks), outside make test's budget; CI runs it after make test.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist worksteal -m slow

# Benchmarks are never part of `make test`: they time and measure, and write bench/results/.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	for script in bench/*.py; do OMP_NUM_THREADS=2 $(PY) $$script || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
