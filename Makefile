# `make demo` and `make test` each build .venv from nothing. torch is pinned to the CPU build that installs from
# this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test lint clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[demo,test,lint]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/encoderstack convert --force
	$(BIN)/encoderstack finetune --force

# One worker per core (pytest-xdist), each test file on one worker: module fixtures are built once.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -n auto --dist loadfile

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) encoderstack-all-MiniLM-L6-v2 encoderstack-finetuned
