# The two set-up commands of the README are `make demo` and `make test`; each
# creates .venv if it is missing. torch is pinned first to the CPU wheel
# (TORCH_SPEC) so that pip never resolves `torch` to the multi-GB CUDA build on
# a machine without a GPU; on a GPU machine, install tkern into an environment
# that already has CUDA torch instead.
# The environment holds everything the suite uses (the integrations extra too:
# transformers, accelerate, lightning, safetensors, CPU wheels that reuse the
# installed torch), so `make test` on a fresh clone runs the suite as CI does.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test test-fast compile-gate lint format bench info clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,demo,integrations]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/tkern train

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --dist loadfile --durations=25 tests

# The ahead-of-time compile gate: every kernel compiled for sm_80..sm_120, gfx942 and
# gfx950 on the CPU under the installed triton, and sm_80, sm_90, gfx950 under 3.6 (the GPU
# machines' version; benchmarks/ci_compile_gate.sh says why those three).
compile-gate: $(VENV)/.installed
	PYTHON=$(PY) bash benchmarks/ci_compile_gate.sh

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check tkern tests benchmarks examples
	$(VENV)/bin/ruff format --check tkern tests benchmarks examples

format: $(VENV)/.installed
	$(VENV)/bin/ruff format tkern tests benchmarks examples
	$(VENV)/bin/ruff check --fix tkern tests benchmarks examples

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(VENV)/bin/tkern bench all

info: $(VENV)/.installed
	$(VENV)/bin/tkern info

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
