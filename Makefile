# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create or reuse .venv and install what they need themselves.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: venv demo test test-unit test-integration test-chaos lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first (from local disk here); a bare `torch` would pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/dressage up --config configs/cpu-demo.yaml --demo

lint: venv
	$(BIN)/ruff check shared services tests bench
	$(BIN)/mypy shared services

test: venv lint
	$(BIN)/python -m pytest -q -x -p no:cacheprovider tests

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

test-integration: venv
	$(BIN)/python -m pytest -q tests/integration

test-chaos: venv
	$(BIN)/python -m pytest -q tests/chaos

bench: venv
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
