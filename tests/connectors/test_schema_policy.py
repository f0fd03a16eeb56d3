"""Schema changes by policy in the PostgreSQL sink: a column added, removed and widened
between two runs, under each policy (docs/connectors.md, "Schema changes")."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import Column, PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql.schema_policy import is_wider
from dispatch.worker.runner import Runner
from tests.support.connectors import Ctx, ScratchDB, scratch_db

pytestmark = pytest.mark.django_db
# One binding for every run of a test: its receipts tell which columns it last wrote.
BINDING = uuid.uuid4()


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_policy_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_policy_dst")


def _columns(db: ScratchDB) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in db.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 't'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        )
    ]


def _run(src: ScratchDB, dst: ScratchDB, **policy: Any) -> tuple[Any, Ctx, list[dict[str, Any]]]:
    """One run of the same binding into `t` (mode append); (result, ctx, the changes)."""
    ctx = Ctx()
    ctx.fence.binding_id = BINDING
    spec = {"table": "t", "create": True, **policy}
    with (
        PG.open_reader(src.config, {"table": "t"}, ctx) as reader,
        PG.open_writer(dst.config, spec, ctx, reader.columns) as writer,
    ):
        Runner._transfer(ctx, reader, writer)  # type: ignore[arg-type]
        result = writer.commit()
        return result, ctx, writer.schema_changes


def _first_run(src: ScratchDB, dst: ScratchDB) -> None:
    src.execute("CREATE TABLE t (id int, code varchar(10), n integer)")
    src.execute("INSERT INTO t SELECT i, 'c' || i, i FROM generate_series(1, 5) i")
    _run(src, dst)
    assert _columns(dst) == [("id", "integer"), ("code", "character varying(10)"), ("n", "integer")]


# --- a column added to the source ---------------------------------------------------------
def test_new_column__fail_by_default_names_it_and_leaves_the_sink_as_it_was(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ADD COLUMN extra numeric(8,2)")
    with pytest.raises(PermanentError, match=r"has no column\(s\) extra \(on_new_column"):
        _run(src_db, dst_db)
    assert [c for c, _ in _columns(dst_db)] == ["id", "code", "n"]
    assert dst_db.execute("SELECT count(*) FROM t") == [(5,)]


def test_new_column__add_alters_the_sink_with_the_sources_type_and_loads_it(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ADD COLUMN extra numeric(8,2)")
    src_db.execute("UPDATE t SET extra = id * 1.5")
    _, _, changes = _run(src_db, dst_db, on_new_column="add")
    assert changes == [{"column": "extra", "change": "added", "type": "numeric(8,2)"}]
    assert _columns(dst_db)[-1] == ("extra", "numeric(8,2)")
    # The first run's rows take NULL; the second's carry the new column.
    assert dst_db.execute("SELECT count(*), count(extra), sum(extra) FROM t") == [
        (10, 5, pytest.approx(22.5))
    ]
    # The next run finds nothing to change.
    assert _run(src_db, dst_db, on_new_column="add")[2] == []


def test_new_column__ignore_loads_the_other_columns_and_records_it(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ADD COLUMN extra text DEFAULT 'x'")
    result, ctx, changes = _run(src_db, dst_db, on_new_column="ignore", receipt=True)
    assert result.rows_written == 5
    assert changes == [{"column": "extra", "change": "ignored", "type": "text"}]
    assert [c for c, _ in _columns(dst_db)] == ["id", "code", "n"]
    assert dst_db.execute("SELECT count(*), count(DISTINCT id) FROM t") == [(10, 5)]
    # The receipt names the loaded columns and holds no digest (the streamed rows had
    # one column more).
    assert dst_db.execute(
        "SELECT columns, rows, digest FROM dispatch_receipt WHERE run_id = %s",
        [ctx.fence.run_id],
    ) == [(["id", "code", "n"], 5, None)]


# --- a column removed from the source -----------------------------------------------------
def test_missing_column__null_by_default_records_it_once(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t DROP COLUMN n")
    _, _, changes = _run(src_db, dst_db)
    assert changes == [{"column": "n", "change": "missing", "type": "integer"}]
    assert dst_db.execute("SELECT count(*), count(n) FROM t") == [(10, 5)]
    # The previous delivery no longer wrote it: not a change any more.
    assert _run(src_db, dst_db)[2] == []
    assert dst_db.execute("SELECT count(*), count(n) FROM t") == [(15, 5)]


def test_missing_column__fail_names_it(src_db: ScratchDB, dst_db: ScratchDB) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t DROP COLUMN n")
    with pytest.raises(PermanentError, match=r"the source has no column\(s\) n of sink"):
        _run(src_db, dst_db, on_missing_column="fail")
    assert dst_db.execute("SELECT count(*) FROM t") == [(5,)]


# --- a column widened in the source -------------------------------------------------------
def test_type_change__fail_by_default_names_both_types(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ALTER COLUMN code TYPE varchar(20)")
    with pytest.raises(
        PermanentError,
        match=r"column code: the source's type character varying\(20\) does not fit the "
        r"sink's character varying\(10\)",
    ):
        _run(src_db, dst_db)
    assert _columns(dst_db)[1] == ("code", "character varying(10)")


def test_type_change__widen_alters_varchar_and_integer_columns(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ALTER COLUMN code TYPE varchar(20)")
    src_db.execute("ALTER TABLE t ALTER COLUMN n TYPE bigint")
    src_db.execute("UPDATE t SET code = 'twenty-characters-xx', n = 5000000000 WHERE id = 1")
    _, _, changes = _run(src_db, dst_db, on_type_change="widen")
    assert changes == [
        {
            "column": "code",
            "change": "widened",
            "type": "character varying(20)",
            "from": "character varying(10)",
        },
        {"column": "n", "change": "widened", "type": "bigint", "from": "integer"},
    ]
    assert _columns(dst_db) == [
        ("id", "integer"),
        ("code", "character varying(20)"),
        ("n", "bigint"),
    ]
    assert dst_db.execute("SELECT code, n FROM t WHERE n > 2147483647") == [
        ("twenty-characters-xx", 5000000000)
    ]


def test_type_change__a_sink_type_that_holds_the_sources_is_no_change(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    _first_run(src_db, dst_db)
    src_db.execute("ALTER TABLE t ALTER COLUMN code TYPE varchar(5)")
    src_db.execute("ALTER TABLE t ALTER COLUMN n TYPE smallint")
    result, _, changes = _run(src_db, dst_db)
    assert changes == [] and result.rows_written == 5


def test_is_wider__within_a_family_only() -> None:
    wider = [
        ("character varying(10)", "character varying(20)"),
        ("character varying(10)", "text"),
        ("character varying(10)", "character varying"),
        ("smallint", "integer"),
        ("integer", "bigint"),
        ("real", "double precision"),
        ("numeric(8,2)", "numeric(10,2)"),
        ("numeric(8,2)", "numeric(8,3)"),
        ("numeric(8,2)", "numeric"),
    ]
    for sink, source in wider:
        assert is_wider(sink, source), (sink, source)
    holds = [
        ("bigint", "integer"),
        ("text", "character varying(20)"),
        ("numeric(10,2)", "numeric(8,2)"),
        ("numeric", "numeric(30,10)"),
        ("integer", "integer"),
        # Different families: the sink's server parses each value, as before.
        ("integer", "text"),
        ("numeric", "bigint"),
        ("integer[]", "bigint[]"),
    ]
    for sink, source in holds:
        assert not is_wider(sink, source), (sink, source)


# --- what reaches the sink's SQL, and what is refused -------------------------------------
def test_new_column__a_hostile_type_name_never_reaches_the_sink(dst_db: ScratchDB) -> None:
    dst_db.execute("CREATE TABLE t (id int)")
    dst_db.execute("CREATE TABLE victim (id int)")
    columns = [Column("id", "integer"), Column("x", "integer); DROP TABLE victim; --")]
    spec = {"table": "t", "on_new_column": "add"}
    with (
        PG.open_writer(dst_db.config, spec, Ctx(), columns) as writer,
        pytest.raises(PermanentError, match="column x: the source's type"),
    ):
        writer.write([[1, 2]])
    assert dst_db.execute("SELECT count(*) FROM pg_tables WHERE tablename = 'victim'") == [(1,)]
    assert [c for c, _ in _columns(dst_db)] == ["id"]


def test_policies__validated_with_the_field_named() -> None:
    for spec, field in [
        ({"table": "t", "on_new_column": "drop"}, "on_new_column: must be one of fail, add"),
        ({"table": "t", "on_missing_column": "default"}, "on_missing_column"),
        ({"table": "t", "on_type_change": "cast"}, "on_type_change"),
    ]:
        with pytest.raises(ValidationError, match=field):
            PG.validate_sink_spec(spec)
    sliced = {"table": "t", "slices": {"key": "id", "count": 2}}
    assert PG.sink_spec_errors_with_source(
        {"table": "t", "on_new_column": "add", "on_type_change": "widen"}, sliced
    ) == [
        "on_new_column: add cannot take a sliced source (each slice commits on its own): "
        "leave the sink table's columns as they are",
        "on_type_change: widen cannot take a sliced source (each slice commits on its own): "
        "leave the sink table's columns as they are",
    ]
    assert (
        PG.sink_spec_errors_with_source({"table": "t", "on_missing_column": "fail"}, sliced) == []
    )


def test_new_column__ignore_with_a_keyed_mode_merges_the_other_columns(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, name text, extra jsonb)")
    src_db.execute("INSERT INTO t SELECT i, 'n' || i, '{}' FROM generate_series(1, 20) i")
    dst_db.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
    dst_db.execute("INSERT INTO t VALUES (1, 'old'), (99, 'gone')")
    _, _, changes = _run(
        src_db, dst_db, mode="mirror", key=["id"], on_new_column="ignore", create=False
    )
    assert changes == [{"column": "extra", "change": "ignored", "type": "jsonb"}]
    assert dst_db.execute("SELECT count(*), min(id), max(id) FROM t") == [(20, 1, 20)]
    assert dst_db.execute("SELECT name FROM t WHERE id = 1") == [("n1",)]
