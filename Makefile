# Two entry points: `make serve` (demo model server) and `make test` (the whole suite; its 20 slowest tests are listed
# at the end, so that CI shows where its 15 minutes go).
# ARGS passes flags through: make serve ARGS="--port 8001 --max-num-seqs 32".
PY ?= python3
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install serve test bench
install: $(STAMP)

serve: $(STAMP)
	$(BIN)/llmserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 tests

bench: $(STAMP)
	$(BIN)/llmserve bench offline $(ARGS)
