# The README's quick start: `make run` and `make test`. Both set a fresh checkout up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per set of extras: `make run` installs only what the demo runs, `make test`
# adds the development tools (pytest, mypy, playwright, ...).
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
RUN_EXTRAS := site,embedded
TEST_EXTRAS := site,dev,embedded

.PHONY: run test bench chaos clean

# $(call install,EXTRAS): the virtualenv (created once), then the checkout with EXTRAS.
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(1)]'
	touch $@
endef

$(RUN_STAMP): pyproject.toml
	$(call install,$(RUN_EXTRAS))

$(TEST_STAMP): pyproject.toml
	$(call install,$(TEST_EXTRAS))

## Migrate, seed a demo, and run the admin plus a worker (embedded PostgreSQL without DATABASE_URL).
run: $(RUN_STAMP)
	$(PY) -m project.dev run

## Lint, type-check and run every test against a real PostgreSQL.
test: $(TEST_STAMP)
	$(PY) -m project.dev test $(PYTEST_ARGS)

## Every benchmark against the machine's PostgreSQL (BENCH_SERVER, default 127.0.0.1:5432);
## each appends its section to docs/benchmarks.md. Takes about half an hour.
BENCH_SERVER ?= postgres://postgres@127.0.0.1:5432
bench: $(TEST_STAMP)
	$(PY) -m pip install --quiet -e '.[$(TEST_EXTRAS),bench]'
	$(PY) -m bench all --server $(BENCH_SERVER)

## The fault-injection campaign (docs/reliability.md): 5 minutes of faults against an
## embedded PostgreSQL of its own on port CHAOS_PORT, then the invariant check (exit 1 on
## any violation). Logs and summary.json go to .data/chaos/.
CHAOS_SEED ?= 42
CHAOS_PORT ?= 54341
chaos: $(TEST_STAMP)
	DJANGO_SETTINGS_MODULE=tests.settings \
	DATABASE_URL=postgres://postgres@127.0.0.1:$(CHAOS_PORT)/dispatch_chaos \
	$(PY) manage.py chaos --duration 300 --workers 4 --seed $(CHAOS_SEED) --port $(CHAOS_PORT)

## Everything `make run` and `make test` created, the embedded PostgreSQL servers included.
clean:
	-test ! -x $(PY) || $(PY) -m project.dev clean
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache .hypothesis .grimp_cache .import_linter_cache
