"""The `mirror` sink mode of the PostgreSQL connector: the sink equals the source's snapshot,
deletes included, in the one fenced transaction (docs/connectors.md, "Mirror")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.models import Datasource, JobBinding
from tests.support import factories
from tests.support.connectors import Ctx, ScratchDB, run_transfer, scratch_db

pytestmark = pytest.mark.django_db

MIRROR = {"table": "t", "mode": "mirror", "key": ["id"]}
# The whole table's contents in one value, to compare a source and a sink table.
CONTENTS = "SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY id), '')) FROM t"


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_mirror_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_mirror_dst")


def test_mirror__200000_rows_with_10_percent_deleted_leaves_the_sink_equal_to_the_source(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id bigint PRIMARY KEY, name text, n integer)")
    src_db.execute("INSERT INTO t SELECT i, 'row ' || i, i FROM generate_series(1, 200000) i")
    spec = {**MIRROR, "create": True}
    first = run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)
    assert first.rows_written == 200000
    assert dst_db.execute(CONTENTS) == src_db.execute(CONTENTS)
    # Between the runs: 10 % deleted, some changed, some new; and a sink row of its own.
    src_db.execute("DELETE FROM t WHERE id % 10 = 0")
    src_db.execute("UPDATE t SET name = 'changed' WHERE id % 7 = 0")
    src_db.execute("INSERT INTO t SELECT i, 'new', i FROM generate_series(200001, 200500) i")
    dst_db.execute("INSERT INTO t VALUES (-1, 'only in the sink', 0)")
    ctx = Ctx()
    second = run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec, ctx)
    assert second.rows_written == 180500
    assert src_db.execute(CONTENTS)[0][0] == 180500
    assert dst_db.execute(CONTENTS) == src_db.execute(CONTENTS)
    # Its receipt is the whole table's (as replace's): the rows the sink now holds.
    assert dst_db.execute(
        "SELECT mode, rows FROM dispatch_receipt WHERE run_id = %s", [ctx.fence.run_id]
    ) == [("mirror", 180500)]


def test_mirror__an_empty_source_empties_the_sink(src_db: ScratchDB, dst_db: ScratchDB) -> None:
    src_db.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
    dst_db.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
    dst_db.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    result = run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, MIRROR)
    assert result.rows_written == 0
    assert dst_db.execute("SELECT count(*) FROM t") == [(0,)]


@pytest.mark.parametrize(
    ("column", "marked"),
    [("deleted", "true"), ("deleted_at", "now()")],
    ids=["boolean", "timestamp"],
)
def test_mirror__rows_marked_by_deleted_column_are_not_in_the_sink(
    src_db: ScratchDB, dst_db: ScratchDB, column: str, marked: str
) -> None:
    kind = "boolean" if column == "deleted" else "timestamptz"
    for db in (src_db, dst_db):
        db.execute(f"CREATE TABLE t (id int PRIMARY KEY, name text, {column} {kind})")
    src_db.execute("INSERT INTO t SELECT i, 'r' || i, NULL FROM generate_series(1, 100) i")
    src_db.execute(f"UPDATE t SET {column} = {marked} WHERE id <= 30")
    if kind == "boolean":
        src_db.execute("UPDATE t SET deleted = false WHERE id > 90")  # false: a live row
    dst_db.execute("INSERT INTO t SELECT i, 'old', NULL FROM generate_series(1, 50) i")
    spec = {**MIRROR, "deleted_column": column}
    ctx = Ctx()
    run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec, ctx)
    assert dst_db.execute("SELECT min(id), max(id), count(*) FROM t") == [(31, 100, 70)]
    assert dst_db.execute("SELECT count(*) FROM t WHERE name = 'old'") == [(0,)]
    # The receipt counts the rows kept; no digest (the streamed rows include the deleted).
    assert dst_db.execute(
        "SELECT rows, digest FROM dispatch_receipt WHERE run_id = %s", [ctx.fence.run_id]
    ) == [(70, None)]


def test_mirror__incremental_deletes_only_rows_marked_deleted_hard_deletes_stay(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    for db in (src_db, dst_db):
        db.execute(
            "CREATE TABLE t (id int PRIMARY KEY, name text, version bigint, deleted boolean)"
        )
    src_db.execute("INSERT INTO t SELECT i, 'r' || i, i, false FROM generate_series(1, 1000) i")
    source = {"table": "t", "incremental": {"cursor": ["version", "id"]}}
    spec = {**MIRROR, "deleted_column": "deleted"}
    run_transfer(PG, src_db.config, source, PG, dst_db.config, spec)
    assert dst_db.execute("SELECT count(*) FROM t") == [(1000,)]
    # Soft deletes move the cursor column; a hard delete leaves nothing to read.
    src_db.execute("UPDATE t SET deleted = true, version = 2000 + id WHERE id <= 100")
    src_db.execute("UPDATE t SET name = 'changed', version = 3000 + id WHERE id > 990")
    src_db.execute("DELETE FROM t WHERE id = 500")
    ctx = Ctx()
    ctx.fence.binding_id = _binding_of(dst_db)
    result = run_transfer(PG, src_db.config, source, PG, dst_db.config, spec, ctx)
    assert result.rows_written == 110  # the increment: 100 marked, 10 changed
    assert dst_db.execute("SELECT count(*), min(id) FROM t") == [(900, 101)]
    assert dst_db.execute("SELECT count(*) FROM t WHERE name = 'changed'") == [(10,)]
    # Invisible to a cursor: the hard-deleted row is still in the sink.
    assert dst_db.execute("SELECT name FROM t WHERE id = 500") == [("r500",)]
    assert dst_db.execute(
        "SELECT mode FROM dispatch_receipt WHERE run_id = %s", [ctx.fence.run_id]
    ) == [("mirror incremental",)]


def _binding_of(dst: ScratchDB) -> object:
    """The binding whose cursor the sink holds (a Ctx's fence names a new one)."""
    [(binding,)] = dst.execute("SELECT binding_id FROM dispatch_cursor")
    return binding


def test_mirror__incremental_without_deleted_column_fails_permanently(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    for db in (src_db, dst_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, version bigint)")
    src_db.execute("INSERT INTO t VALUES (1, 1)")
    dst_db.execute("INSERT INTO t VALUES (7, 7)")
    source = {"table": "t", "incremental": {"cursor": ["version"]}}
    with pytest.raises(PermanentError, match="hard delete"):
        run_transfer(PG, src_db.config, source, PG, dst_db.config, MIRROR)
    assert dst_db.execute("SELECT id FROM t") == [(7,)]


def test_mirror__a_null_or_repeated_key_fails_and_leaves_the_sink_as_it_was(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, name text)")
    dst_db.execute("CREATE TABLE t (id int UNIQUE, name text)")
    dst_db.execute("INSERT INTO t VALUES (1, 'kept')")
    src_db.execute("INSERT INTO t VALUES (2, 'a'), (NULL, 'no key')")
    with pytest.raises(PermanentError, match="NULL key"):
        run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, MIRROR)
    src_db.execute("UPDATE t SET id = 2 WHERE id IS NULL")
    with pytest.raises(PermanentError, match="same key"):
        run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, MIRROR)
    assert dst_db.execute("SELECT id, name FROM t") == [(1, "kept")]


def test_mirror__validation_names_the_field() -> None:
    for spec, field in [
        ({"table": "t", "mode": "mirror"}, "key: mirror needs"),
        ({"table": "t", "mode": "upsert", "key": ["id"], "deleted_column": "d"}, "deleted_column"),
        ({**MIRROR, "deleted_column": ""}, "deleted_column"),
        ({**MIRROR, "deleted_column": "id"}, "deleted_column: must not be a key"),
    ]:
        with pytest.raises(ValidationError, match=field):
            PG.validate_sink_spec(spec)
    PG.validate_sink_spec({**MIRROR, "deleted_column": "deleted"})


def test_mirror__refused_on_save_with_slices_or_an_incremental_read_without_deleted_column() -> (
    None
):
    src = Datasource(name="pg-src", kind="postgresql", config={"host": "h", "dbname": "d"})
    src.save()
    dst = Datasource(name="pg-dst", kind="postgresql", config={"host": "h2", "dbname": "d"})
    dst.save()
    sliced = factories.JobFactory(
        source_spec={"table": "t", "slices": {"key": "id", "count": 4}}, sink_spec=MIRROR
    )
    with pytest.raises(ValidationError, match="mirror cannot take a sliced source"):
        JobBinding(name="b-sliced", job=sliced, source=src, sink=dst).full_clean()
    incremental = factories.JobFactory(
        source_spec={"table": "t", "incremental": {"cursor": ["id"]}}, sink_spec=MIRROR
    )
    with pytest.raises(ValidationError, match="deleted_column: mirror with incremental"):
        JobBinding(name="b-inc", job=incremental, source=src, sink=dst).full_clean()
    incremental.sink_spec = {**MIRROR, "deleted_column": "deleted"}
    JobBinding(name="b-inc", job=incremental, source=src, sink=dst).full_clean()
