PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install vllm demo test lint typecheck pytest bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py src/topkv/_copycrc.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,model,kubernetes]'
	touch $(STAMP)

# vLLM (CPU) in its own virtualenv .venv-vllm, for TopKVConnector's end-to-end tests
vllm: install
	scripts/install-vllm.sh

demo: install
	$(BIN)/topkv demo

test: install
	scripts/install-system-deps.sh
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest
	scripts/install-vllm.sh
	.venv-vllm/bin/pytest -p no:cacheprovider tests/integrations/vllm

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info src/*.egg-info src/topkv/*.so
