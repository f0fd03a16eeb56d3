"""Values that must survive the trip: one column of each of 35 types with awkward values,
PostgreSQL -> CSV -> PostgreSQL, compared value by value (`row::text` per key)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatch.connectors.csv import CSVConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.test_connectors_helpers import ScratchDB, run_transfer, scratch_db


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_values_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_values_dst")


# 35 value columns besides the key. The awkward values are the ones a trip through Python
# objects changed or refused: an interval's units, json's key order, duplicate keys and
# number spelling, ranges, infinite and BC dates, 24:00, NaN and infinities.
TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE {table} (
    id integer PRIMARY KEY,
    c_smallint smallint, c_integer integer, c_bigint bigint,
    c_numeric numeric, c_numeric_p numeric(12, 2), c_real real, c_double double precision,
    c_text text, c_varchar varchar(20), c_char char(5), c_boolean boolean,
    c_date date, c_timestamp timestamp, c_timestamptz timestamptz, c_time time,
    c_timetz timetz, c_interval interval, c_json json, c_jsonb jsonb, c_uuid uuid,
    c_bytea bytea, c_inet inet, c_cidr cidr, c_macaddr macaddr, c_int4range int4range,
    c_numrange numrange, c_tstzrange tstzrange, c_daterange daterange, c_text_array text[],
    c_int_matrix integer[], c_point point, c_bit bit(4), c_tsvector tsvector,
    c_enum mood, c_domain posint
)
"""

ROWS = r"""
INSERT INTO source VALUES
 (1, -32768, 2147483647, 9223372036854775807, 'NaN', 1234567890.12, 'Infinity',
  '-Infinity', 'tab	"quote", comma, back\slash, é ✓ 🚀', 'varchar', 'ab',
  true, 'infinity', '0044-03-15 12:00:00 BC', '-infinity', '24:00:00', '23:59:59+05:30',
  '1 year 2 mons 3 days 04:05:06.789', '{"b": 2.50, "a": [1, 2], "b": "dup"}',
  '{"z": 1e3, "a": null}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\x00ff5c22',
  '2001:db8::1/64', '10.0.0.0/8', '08:00:2b:01:02:03', '(,6)', '[1.5,2.5)',
  '["2024-01-01 00:00:00+00","infinity")', 'empty', ARRAY['a', 'b,c', NULL, 'd"e', ''],
  '{{1,2},{3,NULL}}', '(1.5,-2)', B'1010', 'a:1 fat:2,4 cat', 'happy', 7),
 (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL),
 (3, 0, 0, 0, -0.000000000000000000001, -0.01, 1.17549435e-38, 5e-324,
  E'line one\nline two\r\nthree', '', '', false, '2000-02-29', '1970-01-01 00:00:00',
  '2024-02-29 23:59:59.999999+00', '00:00:00', '00:00:00-12', '-1 days +23:59:59.999999',
  '[]', '{}', '00000000-0000-0000-0000-000000000000', '\x', '0.0.0.0', '::/0',
  'ff:ff:ff:ff:ff:ff', '[-2147483648,2147483647)', '(,)', 'empty', '[2000-01-01,)',
  '{}', '{}', '(0,0)', B'0000', '', 'sad', 1)
"""


def _rows(db: ScratchDB, table: str) -> dict[int, str]:
    return {r[0]: r[1] for r in db.execute(f"SELECT id, t::text FROM {table} t ORDER BY id")}


@pytest.mark.django_db
def test_values__pg_to_csv_to_pg_every_type_exactly(
    src_db: ScratchDB, dst_db: ScratchDB, tmp_path: Path
) -> None:
    src_db.execute(TYPES.format(table="source"))
    src_db.execute(ROWS)
    dst_db.execute(TYPES.format(table="target"))
    files = {"base_dir": str(tmp_path)}
    # A null marker no value uses: PostgreSQL's CSV tells NULL (unquoted) from '' (quoted),
    # a CSV reader does not.
    csv_spec = {"path": "values.csv", "null": "\\N"}
    written = run_transfer(
        PG, src_db.config, {"table": "public.source"}, CSVConnector, files, csv_spec
    )
    assert written.rows_written == 3
    text = (tmp_path / "values.csv").read_text(encoding="utf-8")
    # PostgreSQL's own spelling, never a Python object's.
    assert "1 year 2 mons 3 days 04:05:06.789" in text
    assert '{""b"": 2.50, ""a"": [1, 2], ""b"": ""dup""}' in text
    assert "(,6)" in text and "24:00:00" in text and "0044-03-15 12:00:00 BC" in text
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
