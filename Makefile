# The two commands a newcomer needs (see README.md):
#   make quickstart   set up .venv and train a tiny VLM on a synthetic visual task (CPU)
#   make reasoning    the same with long, variable-length <think> responses (docs/reasoning.md)
#   make test         set up .venv, lint, type-check (mypy), and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup quickstart reasoning test test-fast lint typecheck format bench

setup:
	bash scripts/install.sh

quickstart: setup
	$(PY) examples/prepare_quickstart.py
	$(PY) -m vlrl.trainer.main config=examples/quickstart.yaml

reasoning: setup
	$(PY) examples/prepare_reasoning.py
	$(PY) -m vlrl.trainer.main config=examples/reasoning_quickstart.yaml

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest -q

# the inner loop: everything but the end-to-end tests that start vLLM, Ray or several processes
test-fast: lint typecheck
	$(VENV)/bin/pytest -q -m "not slow"

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
