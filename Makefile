# `make run` and `make test` are the two commands the README opens with; each
# builds the virtual environment first, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-quick bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

run: $(BIN)/.installed
	$(BIN)/python scripts/bench_cache.py

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

bench: run

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
