# `make demo` and `make test` each build .venv from nothing. torch is pinned to the CPU build that installs from
# this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test lint clean transformers-tests

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[demo,test,lint]"
	$(MAKE) transformers-tests
	touch $@

# transformers' common model tests are not in its wheel: unpack them from the installed release's source distribution
# (tests/test_transformers_common_tests.py runs them)
transformers-tests:
	rm -rf $(VENV)/transformers-tests $(VENV)/transformers-sdist
	version=$$($(BIN)/python -c "import transformers; print(transformers.__version__)") && \
	$(BIN)/pip download --quiet --no-deps --no-binary :all: --no-build-isolation -d $(VENV)/transformers-sdist \
		"transformers==$$version" && \
	mkdir -p $(VENV)/transformers-tests && \
	tar -xzf $(VENV)/transformers-sdist/transformers-$$version.tar.gz -C $(VENV)/transformers-tests \
		--strip-components=2 "transformers-$$version/tests/test_modeling_common.py" && \
	echo "$$version" > $(VENV)/transformers-tests/VERSION
	rm -rf $(VENV)/transformers-sdist

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
