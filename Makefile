# `make run` and `make test` are the two commands the README opens with; each
# builds the virtual environment first, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-quick test-versions ci clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The main job: the cache benchmark on the embedded default tokenizer.
run: $(BIN)/.installed
	$(BIN)/python scripts/bench_cache.py --families

# Every test, the soak runs included.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

# Without the soak runs (marked slow).
test-quick: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

# The transport's tests on the other declared Python versions.
test-versions:
	scripts/test_versions.sh

ci: test test-versions

clean:
	rm -rf $(VENV) .venv-3.* .cache .pytest_cache .hypothesis
