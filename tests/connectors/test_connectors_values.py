"""Values that must survive the trip: one column of each of 35 types with awkward values,
PostgreSQL -> CSV -> PostgreSQL, compared value by value (`row::text` per key)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatch.connectors.csv import CSVConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import ScratchDB, run_transfer, scratch_db
from tools.typesample import ROWS, TYPES


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_values_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_values_dst")


def _rows(db: ScratchDB, table: str) -> dict[int, str]:
    return {r[0]: r[1] for r in db.execute(f"SELECT id, t::text FROM {table} t ORDER BY id")}


@pytest.mark.django_db
@pytest.mark.parametrize("null", [None, "\\N"], ids=["default-null", "null-marker"])
def test_values__pg_to_csv_to_pg_every_type_exactly(
    src_db: ScratchDB, dst_db: ScratchDB, tmp_path: Path, null: str | None
) -> None:
    src_db.execute(TYPES.format(table="source"))
    src_db.execute(ROWS)
    dst_db.execute(TYPES.format(table="target"))
    files = {"base_dir": str(tmp_path)}
    # The default marker is the empty field: NULL is written unquoted, '' quoted, and the
    # reader tells the two apart (row 2 is all NULLs, row 3 holds empty strings).
    csv_spec = {"path": "values.csv"} if null is None else {"path": "values.csv", "null": null}
    written = run_transfer(
        PG, src_db.config, {"table": "public.source"}, CSVConnector, files, csv_spec
    )
    assert written.rows_written == 3
    text = (tmp_path / "values.csv").read_text(encoding="utf-8")
    # PostgreSQL's own spelling, never a Python object's.
    assert "1 year 2 mons 3 days 04:05:06.789" in text
    assert '{""b"": 2.50, ""a"": [1, 2], ""b"": ""dup""}' in text
    assert "(,6)" in text and "24:00:00" in text and "0044-03-15 12:00:00 BC" in text
    if null is None:
        assert ',"",' in text and "\n2,,," in text
    loaded = run_transfer(
        CSVConnector, files, csv_spec, PG, dst_db.config, {"table": "target", "mode": "append"}
    )
    assert loaded.rows_written == 3
    source, target = _rows(src_db, "source"), _rows(dst_db, "target")
    assert sorted(target) == [1, 2, 3]
    for key, value in source.items():
        assert target[key] == value, f"row {key} changed on the way"
    # Sanity: the comparison compares something (35 values and the key per row).
    assert source[1].count(",") >= 35


def _types(db: ScratchDB, table: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in db.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
    ]


@pytest.mark.django_db
def test_values__pg_to_pg_create_takes_the_table_definition_and_append_keeps_every_value(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(TYPES.format(table="source"))
    src_db.execute(ROWS)
    # The sink knows the enum and the domain (a type it does not know fails the run at
    # its start, naming the column); `create: true` must use them, not their base types.
    dst_db.execute(TYPES.format(table="unused"))
    run_transfer(
        PG, src_db.config, {"table": "public.source"}, PG, dst_db.config,
        {"table": "created", "create": True},
    )  # fmt: skip
    assert _types(dst_db, "created") == _types(src_db, "source")
    assert ("c_domain", "posint") in _types(dst_db, "created")
    assert _rows(dst_db, "created") == _rows(src_db, "source")
    # Appending into an existing table of the same definition (the binary COPY path).
    run_transfer(
        PG, src_db.config, {"table": "public.source"}, PG, dst_db.config,
        {"table": "unused", "mode": "append"},
    )  # fmt: skip
    assert _rows(dst_db, "unused") == _rows(src_db, "source")


@pytest.mark.django_db
def test_values__a_type_the_sink_lacks_fails_at_the_start_naming_the_column(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    from dispatch.connectors.base import PermanentError

    src_db.execute(TYPES.format(table="source"))
    src_db.execute(ROWS)
    with pytest.raises(
        PermanentError, match="column c_enum: type 'mood' is not a type on the sink"
    ):
        run_transfer(
            PG, src_db.config, {"table": "public.source"}, PG, dst_db.config,
            {"table": "created", "create": True},
        )  # fmt: skip
    assert dst_db.execute("SELECT to_regclass('public.created')") == [(None,)]
