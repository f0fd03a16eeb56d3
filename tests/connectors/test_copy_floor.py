"""The copy at the floor: a CSV file passed through to PostgreSQL as raw COPY blocks, and
incremental reads that stream in the cursor's index order."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dispatch.connectors import csv as csv_connector
from dispatch.connectors.base import PermanentError
from dispatch.connectors.csv import CSVConnector as CSV
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import Ctx, Fence, ScratchDB, run_transfer, scratch_db

pytestmark = pytest.mark.django_db


@pytest.fixture
def db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_floor_copy")


TYPED = (
    "CREATE TABLE {} (id int, name text, note text, amount numeric(8,2), flag boolean, doc jsonb)"
)
# Quoted delimiters, quotes, newlines and CRLF inside quotes, UTF-8 and a byte-order mark,
# an empty quoted field (data) beside an empty unquoted one (NULL by default), the null
# marker unquoted, `\.` inside a line.
TRICKY = (
    "\ufeffid;name;note;amount;flag;doc\r\n"
    '1;"semi; inside";"quote "" inside";1.50;true;"{""a"": [1, 2]}"\r\n'
    '2;"line one\nline two";"carriage\r\nreturn";2;false;{}\r\n'
    '3;"é ü ß 日本 ✓ 🚀";"";-7;f;"{}"\r\n'
    "4;NULL;;0;t;null\r\n"
    '5;"\\.";x \\. y;0;t;[]\r\n'
)


def _transfer(
    tmp_path: Path, db: ScratchDB, table: str, source_spec: dict[str, Any], *, rows_only: bool
) -> Ctx:
    db.execute(TYPED.format(table))
    ctx = Ctx(fence=Fence())
    run_transfer(
        CSV,
        {"base_dir": str(tmp_path)},
        source_spec,
        PG,
        db.config,
        {"table": table},
        ctx,
        rows_only=rows_only,
    )
    return ctx


def _rows(db: ScratchDB, table: str) -> list[tuple[Any, ...]]:
    return db.execute(f"SELECT * FROM {table} ORDER BY id")  # noqa: S608 - the test's own name


@pytest.mark.parametrize(
    "options",
    [{"delimiter": ";"}, {"delimiter": ";", "null": "NULL"}, {"delimiter": ";", "null": None}],
    ids=["default-null", "null-marker", "no-null"],
)
def test_csv_to_postgresql__passes_the_file_through_with_the_rows_paths_result(
    tmp_path: Path, db: ScratchDB, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    (tmp_path / "in.csv").write_bytes(TRICKY.encode())
    spec = {"path": "in.csv", **options}
    _transfer(tmp_path, db, "by_rows", spec, rows_only=True)

    def no_rows(self: Any) -> Any:
        raise AssertionError("the pass-through decoded rows")

    monkeypatch.setattr(csv_connector._Reader, "batches", no_rows)
    ctx = _transfer(tmp_path, db, "passed", spec, rows_only=False)
    expected = _rows(db, "by_rows")
    assert len(expected) == 5
    assert _rows(db, "passed") == expected
    # The file's newlines, an estimate the runner replaces by the sink's count.
    assert ctx.rows_read >= 5


def test_csv_to_postgresql__reads_a_file_without_header(tmp_path: Path, db: ScratchDB) -> None:
    (tmp_path / "in.csv").write_text('1,a,,2.5,true,"[1]"\n2,b,x,,false,\n')
    db.execute(TYPED.format("t").replace("id int", "column1 int"))
    db.execute(
        "ALTER TABLE t RENAME name TO column2; ALTER TABLE t RENAME note TO column3;"
        " ALTER TABLE t RENAME amount TO column4; ALTER TABLE t RENAME flag TO column5;"
        " ALTER TABLE t RENAME doc TO column6"
    )
    run_transfer(
        CSV, {"base_dir": str(tmp_path)}, {"path": "in.csv", "header": False}, PG, db.config,
        {"table": "t"},
    )  # fmt: skip
    rows = db.execute("SELECT * FROM t ORDER BY column1")
    assert [(r[0], r[1], r[2], str(r[3]) if r[3] is not None else None) for r in rows] == [
        (1, "a", None, "2.50"),
        (2, "b", "x", None),
    ]
    assert rows[0][5] == [1] and rows[1][5] is None


@pytest.mark.parametrize("block", [1 << 20, 4, 3, 2])
@pytest.mark.parametrize(
    "text", ["id,name\n1,a\n\\.\n2,b\n", "id,name\n1,a\n\\."], ids=["inside", "last-line"]
)
def test_csv_to_postgresql__an_unquoted_end_marker_line_is_refused(
    tmp_path: Path,
    db: ScratchDB,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    block: int,
) -> None:
    """PostgreSQL's COPY would stop at a line holding only `\\.`: the rows after it would
    be lost without a word, so the run fails and says why (wherever the blocks cut)."""
    monkeypatch.setattr(csv_connector, "COPY_BLOCK_BYTES", block)
    (tmp_path / "in.csv").write_text(text)
    db.execute("CREATE TABLE t (id text, name text)")
    with pytest.raises(PermanentError, match=r"holding only \\\.") as err:
        run_transfer(
            CSV, {"base_dir": str(tmp_path)}, {"path": "in.csv"}, PG, db.config, {"table": "t"}
        )
    assert "in.csv" in str(err.value)
    assert db.execute("SELECT count(*) FROM t") == [(0,)]


def test_csv_to_postgresql__a_short_line_is_a_permanent_error(
    tmp_path: Path, db: ScratchDB
) -> None:
    (tmp_path / "in.csv").write_text("id,name\n1,a\n2\n")
    db.execute("CREATE TABLE t (id int, name text)")
    with pytest.raises(PermanentError, match="missing data for column"):
        run_transfer(
            CSV, {"base_dir": str(tmp_path)}, {"path": "in.csv"}, PG, db.config, {"table": "t"}
        )


# --- incremental reads in the cursor's index order ---------------------------------------------
ITEMS = (
    "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz NOT NULL, payload text)"
    " WITH (autovacuum_enabled = false)"
)
SPEC = {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}}
START = ["2020-01-01 00:00:00+00", "0"]


def _fill(db: ScratchDB, rows: int = 20_000) -> None:
    # Inserted in random order: the heap is not in cursor order, so a planner left alone
    # prefers reading it whole and sorting over an index scan of most of the table.
    db.execute(ITEMS)
    db.execute(
        "INSERT INTO items SELECT i, timestamptz '2024-01-01' + i * interval '1 second',"
        " repeat('x', 40) FROM generate_series(1, %s) AS i ORDER BY random()",
        [rows],
    )


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _explain(reader: Any, *, product_settings: bool = True) -> list[dict[str, Any]]:
    from psycopg import sql

    conn = reader.conn
    if not product_settings:
        conn.execute("SELECT set_config('enable_sort', 'on', true),"
                     " set_config('enable_bitmapscan', 'on', true)")  # fmt: skip
    row = conn.execute(
        sql.SQL("EXPLAIN (FORMAT JSON) {}").format(reader._read_relation())
    ).fetchone()
    plan = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return list(_nodes(plan[0]["Plan"]))


@pytest.mark.parametrize("stats", ["fresh", "misleading"])
def test_incremental__reads_in_the_cursors_index_order_without_a_sort(
    db: ScratchDB, stats: str
) -> None:
    _fill(db)
    db.execute("CREATE INDEX items_cursor ON items (updated_at, id)")
    db.execute("ANALYZE items")
    # A server whose cache is small beside the table (as it is for a large table): left
    # to itself, the planner reads the table whole and sorts rather than follow the
    # index to random heap pages.
    db.execute(f"ALTER DATABASE {db.name} SET effective_cache_size = '64kB'")
    if stats == "misleading":
        # The statistics say every row is in the increment; the rows then move below the
        # start, so the increment is in fact a few rows the planner does not know of.
        db.execute("UPDATE items SET updated_at = updated_at - interval '10 years' WHERE id > 100")
    with PG.open_reader(db.config, SPEC, Ctx()) as reader:  # type: ignore[arg-type]
        assert reader.index_needed is None
        reader.bound(START)
        nodes = _explain(reader)
        types = [n["Node Type"] for n in nodes]
        assert "Sort" not in types and "Incremental Sort" not in types, types
        assert not any("Bitmap" in t for t in types), types
        scans = [n for n in nodes if n["Node Type"] in ("Index Scan", "Index Only Scan")]
        assert [(s["Index Name"], s["Scan Direction"]) for s in scans] == [
            ("items_cursor", "Forward")
        ]
        # The same statement under the server's defaults sorts (so the settings are what
        # keeps it in index order here).
        default = [n["Node Type"] for n in _explain(reader, product_settings=False)]
        assert "Sort" in default, default


def test_incremental__a_table_without_a_cursor_index_is_named_with_the_index_to_create(
    db: ScratchDB, caplog: pytest.LogCaptureFixture
) -> None:
    _fill(db, 100)
    db.execute("CREATE INDEX wrong_order ON items (id, updated_at)")
    db.execute("CREATE INDEX mixed ON items (updated_at DESC, id)")
    with (
        caplog.at_level(logging.WARNING, logger="dispatch.connectors"),
        PG.open_reader(db.config, SPEC, Ctx()) as reader,  # type: ignore[arg-type]
    ):
        assert reader.index_needed == "CREATE INDEX ON public.items (updated_at, id)"
        # The read still runs.
        reader.bound(None)
        assert reader.bounds is not None and reader.bounds.end is not None
    (record,) = [r for r in caplog.records if "without an index" in r.getMessage()]
    assert "CREATE INDEX ON public.items (updated_at, id)" in record.getMessage()


def test_incremental__a_descending_cursor_index_serves_the_read(db: ScratchDB) -> None:
    _fill(db, 100)
    db.execute("CREATE INDEX backwards ON items (updated_at DESC, id DESC)")
    with PG.open_reader(db.config, SPEC, Ctx()) as reader:  # type: ignore[arg-type]
        assert reader.index_needed is None


def test_incremental__rows_arrive_in_cursor_order_through_the_index(db: ScratchDB) -> None:
    _fill(db, 500)
    db.execute("CREATE INDEX items_cursor ON items (updated_at, id)")
    dst = f"copy_{uuid.uuid4().hex[:8]}"
    with PG.open_reader(db.config, SPEC, Ctx()) as reader:  # type: ignore[arg-type]
        reader.bound(START)
        data = b"".join(block for block, _ in reader.copy_chunks("text"))
    ids = [int(line.split(b"\t")[0]) for line in data.splitlines()]
    assert ids == list(range(1, 501)), dst


# --- a session's set-up in two round trips ------------------------------------------------------
def test_open_session__keeps_every_setting_after_its_pipeline(db: ScratchDB) -> None:
    from dispatch.connectors.postgresql.connect import open_session

    db.execute("CREATE SCHEMA other")
    db.execute(f"ALTER DATABASE {db.name} SET search_path = pg_catalog, other, public")
    session = open_session(
        db.config, {"lock_timeout_seconds": 3, "statement_timeout_seconds": 7}, what="test"
    )
    try:
        conn = session.conn
        assert not conn.autocommit
        row = conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'),"
            " current_setting('search_path'), current_setting('DateStyle'),"
            " current_setting('idle_in_transaction_session_timeout'), pg_backend_pid()"
        ).fetchone()
        assert row == ("3s", "7s", '"other", "public", pg_temp', "ISO, MDY", "7s", session.pid)
        assert session.schema == "other"
    finally:
        session.conn.close()


# --- replace: DELETE by default, TRUNCATE when asked ----------------------------------------------
@pytest.mark.parametrize(
    ("spec", "lock"),
    [({}, "ShareRowExclusiveLock"), ({"truncate": True}, "AccessExclusiveLock")],
    ids=["delete", "truncate"],
)
def test_replace__clears_the_table_under_the_lock_its_strategy_needs(
    db: ScratchDB, spec: dict[str, Any], lock: str
) -> None:
    from dispatch.connectors.base import Column

    db.execute("CREATE TABLE t (id int)")
    db.execute("INSERT INTO t SELECT generate_series(1, 10)")
    sink_spec = PG.validate_sink_spec({"table": "t", "mode": "replace", **spec})
    with PG.open_writer(db.config, sink_spec, Ctx(), [Column("id", "integer")]) as writer:  # type: ignore[arg-type]
        writer.write([[100], [200]])
        held = db.execute(
            "SELECT mode FROM pg_locks WHERE relation = 't'::regclass AND granted"
            " AND pid <> pg_backend_pid()"
        )
        assert (lock,) in held
        # Before COMMIT another session still sees the old rows (DELETE), or waits (TRUNCATE:
        # not asked here, it would block).
        if lock == "ShareRowExclusiveLock":
            assert db.execute("SELECT count(*) FROM t") == [(10,)]
        writer.commit()
    assert db.execute("SELECT id FROM t ORDER BY id") == [(100,), (200,)]


def test_replace__truncate_is_validated() -> None:
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="only used with mode replace"):
        PG.validate_sink_spec({"table": "t", "mode": "append", "truncate": True})
    with pytest.raises(ValidationError, match="true or false"):
        PG.validate_sink_spec({"table": "t", "mode": "replace", "truncate": "yes"})
