"""Incremental reads: the cursor commits with the data (docs/connectors.md, "Incremental
reads"). Connector-level tests on real scratch databases, driven as the runner drives a
transfer."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors import incremental
from dispatch.connectors.base import PermanentError, TransientError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import (
    Ctx,
    Fence,
    ScratchDB,
    connect,
    run_transfer,
    scratch_db,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_inc_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_inc_dst")


ITEMS = "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz NOT NULL, payload text)"
CURSOR = {"cursor": ["updated_at", "id"]}


def _spec(**inc: Any) -> dict[str, Any]:
    return {"table": "items", "incremental": {**CURSOR, **inc}}


def _run(
    src: ScratchDB,
    dst: ScratchDB,
    binding: uuid.UUID,
    *,
    mode: str = "append",
    source_spec: dict[str, Any] | None = None,
) -> Any:
    sink_spec: dict[str, Any] = {"table": "copy", "mode": mode, "create": True}
    if mode == "upsert":
        sink_spec["key"] = ["id"]
    return run_transfer(
        PG,
        src.config,
        source_spec or _spec(),
        PG,
        dst.config,
        sink_spec,
        Ctx(Fence(binding_id=binding)),
    )


def _committed(dst: ScratchDB, binding: uuid.UUID) -> tuple[Any, ...]:
    return dst.execute(
        "SELECT cursor, version FROM dispatch_cursor WHERE binding_id = %s", [binding]
    )[0]


def test_incremental_spec__validation_names_the_field() -> None:
    good = PG.validate_source_spec(_spec(start=["2024-01-01 00:00:00+00", 0]))
    assert incremental.parse(good) == incremental.IncrementalSpec(
        ("updated_at", "id"), ("2024-01-01 00:00:00+00", "0")
    )
    cases = [
        ({"cursor": []}, "incremental.cursor"),
        ({"cursor": "updated_at"}, "incremental.cursor"),
        ({"cursor": ["a", "a"]}, "incremental.cursor: a column is named twice"),
        ({"cursor": ["a"], "start": [1, 2]}, "incremental.start"),
        ({"cursor": ["a"], "start": [None]}, "incremental.start"),
        ({"cursor": ["a"], "lookback_seconds": 0}, "incremental.lookback_seconds"),
        ({"cursor": ["a"], "lookback_seconds": True}, "incremental.lookback_seconds"),
        ({"cursor": ["a"], "since": 1}, "incremental: unknown field(s) since"),
        ("yes", "incremental: must be an object"),
    ]
    for block, message in cases:
        with pytest.raises(ValidationError) as err:
            PG.validate_source_spec({"table": "items", "incremental": block})
        assert message in " ".join(err.value.messages), (block, err.value.messages)


def test_incremental__reads_only_rows_above_the_committed_cursor(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(ITEMS)
    src_db.execute(
        "INSERT INTO items SELECT i, '2024-01-01'::timestamptz + i * interval '1 s', 'v1'"
        " FROM generate_series(1, 100) i"
    )
    binding = uuid.uuid4()
    assert _run(src_db, dst_db, binding).rows_written == 100
    assert _committed(dst_db, binding) == (["2024-01-01 00:01:40+00", "100"], 1)
    # Nothing new: no row, the cursor stays, the version moves (the run committed).
    assert _run(src_db, dst_db, binding).rows_written == 0
    assert _committed(dst_db, binding) == (["2024-01-01 00:01:40+00", "100"], 2)
    src_db.execute(
        "UPDATE items SET payload = 'v2', updated_at = updated_at + interval '1 h' WHERE id <= 10"
    )
    assert _run(src_db, dst_db, binding).rows_written == 10
    assert dst_db.execute("SELECT count(*), count(DISTINCT id) FROM copy") == [(110, 100)]
    assert dst_db.execute("SELECT count(*) FROM copy WHERE payload = 'v2'") == [(10,)]
    assert _committed(dst_db, binding)[0] == ["2024-01-01 01:00:10+00", "10"]


def test_incremental__equal_timestamps_split_across_two_runs(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """The whole tuple is compared strictly: rows sharing the cursor's timestamp with the
    last row read are neither lost nor read twice."""
    src_db.execute(ITEMS)
    src_db.execute(
        "INSERT INTO items SELECT i, '2024-06-01 12:00', 'a' FROM generate_series(1, 5) i"
    )
    binding = uuid.uuid4()
    assert _run(src_db, dst_db, binding).rows_written == 5
    assert _committed(dst_db, binding)[0] == ["2024-06-01 12:00:00+00", "5"]
    # Same timestamp, ids above and below the committed one (the ones below were never
    # committed before: a tuple cursor does not promise them; see the late-commit test).
    src_db.execute(
        "INSERT INTO items SELECT i, '2024-06-01 12:00', 'b' FROM generate_series(6, 9) i"
    )
    assert _run(src_db, dst_db, binding).rows_written == 4
    rows = dst_db.execute("SELECT id, count(*) FROM copy GROUP BY id ORDER BY id")
    assert rows == [(i, 1) for i in range(1, 10)]
    assert _committed(dst_db, binding)[0] == ["2024-06-01 12:00:00+00", "9"]


def test_incremental__start_reset_and_set_cursor(src_db: ScratchDB, dst_db: ScratchDB) -> None:
    src_db.execute(ITEMS)
    src_db.execute(
        "INSERT INTO items SELECT i, '2024-01-01'::timestamptz + i * interval '1 day', 'x'"
        " FROM generate_series(1, 30) i"
    )
    binding = uuid.uuid4()
    spec = _spec(start=["2024-01-20 00:00:00+00", "0"])
    assert _run(src_db, dst_db, binding, mode="upsert", source_spec=spec).rows_written == 12
    with connect(dst_db.name) as conn:
        reset = incremental.set_committed(
            conn, "public", binding, columns=("updated_at", "id"), cursor=None
        )
    assert reset.cursor is None and reset.version == 2
    # After a reset the read starts again from the spec's start (or everything).
    assert _run(src_db, dst_db, binding, mode="upsert").rows_written == 30
    assert dst_db.execute("SELECT count(*) FROM copy") == [(30,)]
    with connect(dst_db.name) as conn:
        incremental.set_committed(
            conn,
            "public",
            binding,
            columns=("updated_at", "id"),
            cursor=["2024-01-25 00:00:00+00", "24"],
        )
    assert _run(src_db, dst_db, binding, mode="upsert").rows_written == 6


def test_incremental__rows_inserted_while_a_run_reads_go_to_the_next_run(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(ITEMS)
    src_db.execute("INSERT INTO items SELECT i, now(), 'a' FROM generate_series(1, 50) i")
    binding = uuid.uuid4()
    ctx = Ctx(Fence(binding_id=binding))
    spec = {"table": "copy", "mode": "append", "create": True}
    with (
        PG.open_reader(src_db.config, _spec(), ctx) as reader,
        PG.open_writer(dst_db.config, spec, ctx, reader.columns) as writer,
    ):
        prepared = incremental.prepare(reader, writer)
        assert prepared is not None and prepared.bounds is not None
        # Committed after the reader's snapshot: not in this run, not lost either.
        src_db.execute(
            "INSERT INTO items SELECT i, now() + interval '1 min', 'b' FROM generate_series(51, 60) i"
        )
        for data, rows in reader.copy_chunks(writer.copy_format(reader.columns)):
            writer.write_copy(data, rows)
        assert writer.commit().rows_written == 50
    assert _run(src_db, dst_db, binding).rows_written == 10
    assert dst_db.execute("SELECT count(*), count(DISTINCT id) FROM copy") == [(60, 60)]


def test_incremental__concurrent_cursor_move_aborts_the_commit(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """Two runs of one binding read the same cursor: the second to commit finds the
    version moved, rolls back its rows and fails transiently (its retry starts above)."""
    src_db.execute(ITEMS)
    src_db.execute("INSERT INTO items SELECT i, now(), 'a' FROM generate_series(1, 20) i")
    dst_db.execute(ITEMS.replace("items", "copy").replace(" PRIMARY KEY", ""))
    binding = uuid.uuid4()
    spec = {"table": "copy", "mode": "append", "create": True}
    first = Ctx(Fence(binding_id=binding))
    with (
        PG.open_reader(src_db.config, _spec(), first) as reader,
        PG.open_writer(dst_db.config, spec, first, reader.columns) as writer,
    ):
        incremental.prepare(reader, writer)
        for batch in reader.batches():
            writer.write(batch)
        assert _run(src_db, dst_db, binding).rows_written == 20
        with pytest.raises(TransientError, match="cursor moved"):
            writer.commit()
    assert dst_db.execute("SELECT count(*) FROM copy") == [(20,)]
    assert dst_db.execute(
        "SELECT count(*) FROM dispatch_fence WHERE run_id = %s AND committed_at IS NOT NULL",
        [first.fence.run_id],
    ) == [(0,)]


def test_incremental__refused_for_replace_sinks_and_changed_columns(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(ITEMS)
    src_db.execute("INSERT INTO items VALUES (1, now(), 'a')")
    binding = uuid.uuid4()
    with pytest.raises(PermanentError, match="append or upsert"):
        _run(src_db, dst_db, binding, mode="replace")
    with pytest.raises(PermanentError, match="lookback_seconds re-reads rows"):
        _run(src_db, dst_db, binding, source_spec=_spec(lookback_seconds=60))
    with pytest.raises(PermanentError, match="no column"):
        _run(
            src_db,
            dst_db,
            binding,
            source_spec={"table": "items", "incremental": {"cursor": ["nope"]}},
        )
    _run(src_db, dst_db, binding)
    with pytest.raises(PermanentError, match="reset the binding's cursor"):
        _run(
            src_db,
            dst_db,
            binding,
            source_spec={"table": "items", "incremental": {"cursor": ["id"]}},
        )


def test_incremental__query_source_and_quoted_names(src_db: ScratchDB, dst_db: ScratchDB) -> None:
    src_db.execute('CREATE TABLE "Odd Items" ("Changed At" timestamptz, "ID" int, v text)')
    src_db.execute("""INSERT INTO "Odd Items" SELECT now(), i, 'x' FROM generate_series(1, 7) i""")
    binding = uuid.uuid4()
    spec = {
        "query": 'SELECT "ID", "Changed At", v FROM "Odd Items" WHERE v = \'x\'',
        "incremental": {"cursor": ["Changed At", "ID"]},
    }
    assert _run(src_db, dst_db, binding, source_spec=spec).rows_written == 7
    src_db.execute("""INSERT INTO "Odd Items" VALUES (now(), 8, 'x'), (now(), 9, 'y')""")
    assert _run(src_db, dst_db, binding, source_spec=spec).rows_written == 1


def _late_commit(src: ScratchDB) -> psycopg.Connection[Any]:
    """A transaction that took its timestamp (now() is its start) and inserted a row, but
    has not committed: its row is invisible to a read that happens now."""
    late = connect(src.name, autocommit=False)
    late.execute("INSERT INTO items VALUES (1000, now(), 'late')")
    return late


def test_incremental__late_commit_is_missed_by_a_plain_cursor(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """What a plain cursor promises: rows whose cursor value is above the committed
    cursor when they become visible. A row committed after a read passed its timestamp
    is never read (docs: the commit-order trap)."""
    src_db.execute(ITEMS)
    late = _late_commit(src_db)
    try:
        src_db.execute("INSERT INTO items VALUES (1, now(), 'early')")
        binding = uuid.uuid4()
        assert _run(src_db, dst_db, binding).rows_written == 1
    finally:
        late.commit()
        late.close()
    assert _run(src_db, dst_db, binding).rows_written == 0
    assert dst_db.execute("SELECT id FROM copy") == [(1,)]


def test_incremental__late_commit_within_the_lookback_reaches_an_upsert_sink(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(ITEMS)
    late = _late_commit(src_db)
    binding = uuid.uuid4()
    spec = _spec(lookback_seconds=600)
    try:
        src_db.execute("INSERT INTO items VALUES (1, now(), 'early')")
        assert _run(src_db, dst_db, binding, mode="upsert", source_spec=spec).rows_written == 1
    finally:
        late.commit()
        late.close()
    # The next read re-reads the window below the cursor: the late row arrives, the early
    # one is merged to the same values.
    _run(src_db, dst_db, binding, mode="upsert", source_spec=spec)
    assert dst_db.execute("SELECT id, payload FROM copy ORDER BY id") == [
        (1, "early"),
        (1000, "late"),
    ]
