# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create or reuse .venv and install what they need themselves.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TEST_STAMP := $(VENV)/.installed-test-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: venv venv-test demo tool-agent byo-learning test suite test-unit test-integration test-chaos soak lint bench clean images compose-test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch==2.13.0` takes the index's CUDA build (5 GB of
	# nvidia-* wheels). The script tries a local +cpu wheel, then the PyTorch CPU index, and falls back
	# to a CUDA build only with a banner saying so.
	bash scripts/install-cpu-torch.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[agents]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

# The test tools on top (pytest, mypy, ruff, the compose binary, the SDKs the tests drive, pyarrow).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

venv: $(STAMP)
venv-test: $(TEST_STAMP)

# Two bounded runs: digit reversal (learns; the batch window drops stale groups), then a multi-turn agent
# whose episodes straddle weight updates (the window and the span cap of partial rollout both act).
demo: venv
	$(BIN)/dressage up --config configs/cpu-demo.yaml --demo
	$(BIN)/dressage up --config configs/cpu-demo-agent.yaml --demo

# A tool-using agent trained end to end (lookup task, examples/agents/tool_agent.py on the openai SDK):
# the printed report shows reward and the share of well-formed tool calls (docs/proxy.md).
tool-agent: venv
	$(BIN)/dressage init-model --task lookup --out models/lookup-habit-tiny --warm-steps 450 --guess-share 0.5 --target-accuracy 0 --if-missing
	$(BIN)/dressage up --config configs/tool-agent.yaml --demo

# mypy: shared/, services/ and tools/ strict (pyproject.toml); tests less strict (tests/mypy.ini), one run per
# test directory (each has its own conftest); a type: ignore in shared/, services/, tools/ or tests/ must say
# why after it.
lint: venv-test
	$(BIN)/ruff check shared services tools tests bench
	$(BIN)/mypy shared services tools
	$(BIN)/mypy --config-file tests/mypy.ini tests/unit tests/conftest.py tests/rollout_factory.py tests/trainer_factory.py
	$(BIN)/mypy --config-file tests/mypy.ini tests/integration
	$(BIN)/mypy --config-file tests/mypy.ini tests/chaos
	$(BIN)/mypy --config-file tests/mypy.ini tests/compose
	@! grep -rnE --include='*.py' 'type: ignore(\[[^]]*\])? *$$' shared services tools tests || \
		(echo "type: ignore without a reason (add '  # why')"; exit 1)

# The lint beside the tests, and the tests in two processes (pytest-xdist): whole files each, so a file's module
# and session fixtures (the compose stack, the chaos engine) are built once and its tests keep their order; the
# files in tests/scheduling.py's SPREAD go one test at a time. TEST_JOBS=0: one process.
TEST_JOBS ?= 2
test: venv-test
	$(MAKE) --no-print-directory -j2 lint suite

suite: venv-test
	$(BIN)/python -m pytest -q -x -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile tests

test-unit: venv-test
	$(BIN)/python -m pytest -q tests/unit

test-integration: venv-test
	$(BIN)/python -m pytest -q tests/integration

test-chaos: venv-test
	$(BIN)/python -m pytest -q tests/chaos

# The worked example of docs/guides/ trained over 3 seeds; fails unless the reward's rise is clear of 0
# (about 17-25 min on 2 cores; `make test` runs the guides' bounded end-to-end run instead).
byo-learning: venv-test
	DRESSAGE_LEARNING=1 $(BIN)/python -m pytest -q -s -p no:cacheprovider \
		tests/integration/test_byo_example.py::test_the_example_learns_over_seeds

# The 10-minute chaos soak (every service faulted, Redis crashed once); `make test` runs a 20-s preset.
# CHAOS_SEED picks the fault schedule; the figures land in runs/soak-figures.jsonl (docs/reliability.md).
soak: venv-test
	mkdir -p runs
	CHAOS_SOAK_S=$${CHAOS_SOAK_S:-600} CHAOS_FIGURES=runs/soak-figures.jsonl \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/chaos/test_chaos_soak.py

# Docker (docs/operations.md "With Docker"): `images` builds the base images when Docker Hub cannot be
# reached (scripts/local-base-images.sh: Debian's packages, debootstrap) and the CPU image on them, and
# writes images.env for compose. `compose-test` runs the compose tier, its short preset (also in `make
# test`) then its full one: the stack built, up, scaled, inspected, crashed, restarted from its volumes,
# `down -v` (4 min here with the images built, about 10 on a bare engine). Exit 77 from scripts/compose-test.sh:
# no Docker engine can run on this machine.
images:
	scripts/docker-engine.sh
	scripts/images.sh images.env

compose-test: venv-test
	scripts/compose-test.sh

bench: venv-test
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
