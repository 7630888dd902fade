# The two commands a newcomer needs (see README.md):
#   make quickstart   set up .venv and train a tiny VLM on a synthetic visual task (CPU)
#   make test         set up .venv, lint, and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup quickstart test lint format bench

setup:
	bash scripts/install.sh

quickstart: setup
	$(PY) examples/prepare_quickstart.py
	$(PY) -m vlrl.trainer.main config=examples/quickstart.yaml

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest -q

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
