# Two commands set up a fresh machine: `make repro` (the whole DAG on the demo world) and
# `make test`. Both create the virtual environment on first use and reuse it after.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv repro test test-fast bench lint format deps lock clean-venv

# pip's find-links (these machines keep the CPU build of torch there); uv does not read pip's config
LINKS = $$($(PY) -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
# uv installs in seconds what pip takes a minute and more for; pip wherever uv cannot be had or
# fails. Compiled to bytecode at install as pip does: where PYTHONDONTWRITEBYTECODE is set,
# nothing else would, and every stage process would compile its imports again (3 s of each export).
	$(PY) -m pip install -qq --disable-pip-version-check uv || true
# torch first: the pinned CPU build is a file on these machines that pip's configuration points
# at (find-links, which uv does not read: passed on to it; 3 s against pip's 16 here), and with it
# installed nothing pulls the CUDA build. Where pip is pointed at no such place, pip installs it.
	links=$(LINKS); \
	if [ -n "$$links" ] && [ -x $(VENV)/bin/uv ] && $(VENV)/bin/uv pip install --quiet --compile-bytecode \
		--python $(PY) $$(for d in $$links; do printf -- '--find-links %s ' "$$d"; done) torch==2.13.0; then :; \
	else $(PY) -m pip install -qq --disable-pip-version-check torch==2.13.0; fi
# The rest at the versions requirements.lock pins (every machine resolves the same set; pyproject's
# ranges stay for users who install the package), then the package itself.
# The lock was resolved for CPython 3.11 on Linux x86-64: where it cannot install, pyproject's ranges.
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -r requirements.lock -e '.[dev,s3]' || \
		{ echo "uv did not install the package: installing with pip"; \
		  $(PY) -m pip install -qq --disable-pip-version-check -r requirements.lock -e '.[dev,s3]'; } || \
		{ echo "requirements.lock does not install on this machine: installing pyproject.toml's ranges"; \
		  $(PY) -m pip install -qq --disable-pip-version-check -e '.[dev,s3]'; }
	touch $(STAMP)

venv: $(STAMP)

# dvc.yaml's commands call `python`: the venv's, whether or not it is activated. `halludetect repro` is
# `dvc repro` with a line per stage: running k of N, elapsed, about how long left (runner/repro.py);
# --jobs auto runs independent stages side by side, one per core (runner/parallel_repro.py).
repro: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/halludetect repro --jobs auto

# Two workers, a test module each at a time (an end-to-end module keeps one DVC repository and
# runs its tests in order), in collection order: tests/conftest.py starts building the end-to-end
# modules' DAG in the background once collected and puts those two modules last, so the unit
# modules run beside the build and each worker ends with one of them. Every test process runs
# single-threaded (tests/conftest.py pins numerics).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not e2e"

# Benchmarks print one JSON object each (last line); they need the demo world's model, questions
# and generations.
BENCHES := generation logprob_check dump engine_dump judge nli detectors training allocator world_threads score evidence
bench: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/dvc repro prepare@world generate@world-world dump@world-world judge@world-world cluster@world-world
	@for b in $(BENCHES); do \
		echo "== python -m bench.$$b"; \
		out=$$($(PY) -m bench.$$b 2>&1) || { echo "$$out" | tail -n 30; exit 1; }; \
		echo "$$out" | tail -n 1; \
	done

# No stage lists code files: the code stage depends on the code folders and writes a digest per
# stage (per method) that each stage lists (halludetect/core/code_deps.py). This rewrites the code
# stage's folders (an in-repository plugin's joins them); the contract test fails until then.
deps: $(STAMP)
	$(PY) -m halludetect.core.code_deps --write

# requirements.lock from pyproject.toml's ranges: the newest versions they admit today (torch left
# out: pinned in pyproject, installed first, from the CPU build where pip's find-links has it).
# tests/test_lock.py checks that the lock pins every dependency within its range.
lock: $(STAMP)
	links=$(LINKS); $(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra s3 --python-version 3.11 \
		--no-emit-package torch --quiet $$(for d in $$links; do printf -- '--find-links %s ' "$$d"; done) \
		-o requirements.lock

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean-venv:
	rm -rf $(VENV)
