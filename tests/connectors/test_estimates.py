"""Sources report how many rows they will read before the first one (the total progress
is shown against): an exact count for a small table, the planner's estimate otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dispatch.connectors.builtin import GenerateConnector, NullConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql.reader import EXACT_COUNT_BELOW
from tests.support.connectors import Ctx, ScratchDB, run_transfer, scratch_db

pytestmark = pytest.mark.django_db


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_est_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_est_dst")


def _items(db: ScratchDB, rows: int) -> None:
    # No autovacuum: the test decides when the statistics change.
    db.execute(
        "CREATE TABLE items (id bigint PRIMARY KEY, payload text) WITH (autovacuum_enabled = false)"
    )
    db.execute(f"INSERT INTO items SELECT i, 'row ' || i FROM generate_series(1, {rows}) i")


@pytest.mark.parametrize("rows_only", [False, True], ids=["copy", "rows"])
def test_table_source__a_small_table_is_counted_exactly_before_any_analyze(
    src_db: ScratchDB, dst_db: ScratchDB, rows_only: bool
) -> None:
    _items(src_db, 1234)  # never analyzed: the planner alone would guess from its size
    ctx = Ctx()
    result = run_transfer(
        PG,
        src_db.config,
        {"table": "items"},
        PG,
        dst_db.config,
        {"table": "copy", "create": True},
        ctx,
        rows_only=rows_only,
    )
    assert result.rows_written == 1234
    assert ctx.estimates == [1234]


def test_table_source__a_large_table_keeps_the_planners_estimate(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _items(src_db, 3 * EXACT_COUNT_BELOW)
    src_db.execute("ANALYZE items")
    # Two thirds deleted and not vacuumed: the statistics still say 300,000, the table
    # holds 100,000. A count would say 100,000; the estimate is the planner's.
    src_db.execute(f"DELETE FROM items WHERE id > {EXACT_COUNT_BELOW}")
    ctx = Ctx()
    result = run_transfer(
        PG, src_db.config, {"table": "items"}, NullConnector, {}, {}, ctx, rows_only=True
    )
    assert result.rows_written == EXACT_COUNT_BELOW
    (estimate,) = ctx.estimates
    assert 2.5 * EXACT_COUNT_BELOW <= estimate <= 3.5 * EXACT_COUNT_BELOW


def test_query_source__reports_the_planners_estimate_without_running_it_twice(
    src_db: ScratchDB,
) -> None:
    _items(src_db, 1000)
    src_db.execute("ANALYZE items")
    ctx = Ctx()
    result = run_transfer(
        PG,
        src_db.config,
        {"query": "SELECT * FROM items WHERE id <= 50"},
        NullConnector,
        {},
        {},
        ctx,
        rows_only=True,
    )
    assert result.rows_written == 50
    (estimate,) = ctx.estimates
    assert 25 <= estimate <= 100  # the planner's, from the statistics of id


def test_generate_source__reports_its_exact_row_count() -> None:
    ctx = Ctx()
    run_transfer(GenerateConnector, {}, {"rows": 42, "batch": 10}, NullConnector, {}, {}, ctx)
    assert ctx.estimates == [42]
