"""A table source's `columns`: select, exclude, rename (and hash) on the 35-type sample
table, PostgreSQL -> PostgreSQL, with the types exact and every value compared."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from psycopg import sql

from dispatch.connectors import columns as column_spec
from dispatch.connectors import receipt as receipts
from dispatch.connectors.base import PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import Ctx, ScratchDB, connect, run_transfer, scratch_db
from tools.typesample import ROWS, TYPES


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_columns_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_columns_dst")


@pytest.fixture
def sample(src_db: ScratchDB, dst_db: ScratchDB) -> tuple[ScratchDB, ScratchDB]:
    src_db.execute(TYPES.format(table="source"))
    src_db.execute(ROWS)
    # The sink knows the enum and the domain, so `create` can use them.
    dst_db.execute(TYPES.format(table="unused"))
    return src_db, dst_db


def _types(db: ScratchDB, table: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in db.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
    ]


def _values(db: ScratchDB, table: str, cols: list[str]) -> list[tuple[str | None, ...]]:
    """Each column's output text, row by row in id order (NULL stays None)."""
    return [
        tuple(r)
        for r in db.execute(
            sql.SQL("SELECT {} FROM {} ORDER BY 1").format(
                sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in cols),
                sql.Identifier(table),
            )
        )
    ]


def _copy(src: ScratchDB, dst: ScratchDB, columns: dict[str, Any], **sink: Any) -> Any:
    return run_transfer(
        PG, src.config, {"table": "source", "columns": columns}, PG, dst.config,
        {"table": "created", "create": True, **sink},
    )  # fmt: skip


@pytest.mark.django_db
def test_columns__select_delivers_those_columns_in_its_order_with_exact_types(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    # The order is select's (c_domain, the table's last column, comes before c_numeric_p).
    order = ["id", "c_domain", "c_numeric_p", "c_varchar", "c_enum", "c_int_matrix", "c_json"]
    result = _copy(src, dst, {"select": order})
    assert result.rows_written == 3
    src_types = dict(_types(src, "source"))
    assert _types(dst, "created") == [(c, src_types[c]) for c in order]
    assert ("c_numeric_p", "numeric(12,2)") in _types(dst, "created")
    assert _values(dst, "created", order) == _values(src, "source", order)


@pytest.mark.django_db
def test_columns__exclude_keeps_the_rest_in_table_order_every_value_exact(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    dropped = {"c_json", "c_bytea", "c_tsvector"}
    _copy(src, dst, {"exclude": sorted(dropped)})
    kept = [(n, t) for n, t in _types(src, "source") if n not in dropped]
    assert len(kept) == 33
    assert _types(dst, "created") == kept
    names = [n for n, _ in kept]
    assert _values(dst, "created", names) == _values(src, "source", names)


@pytest.mark.django_db
@pytest.mark.parametrize("receipt", [False, True], ids=["binary", "receipt-text"])
def test_columns__rename_delivers_under_the_sink_names_and_the_receipt_describes_them(
    sample: tuple[ScratchDB, ScratchDB], receipt: bool
) -> None:
    src, dst = sample
    rename = {"id": "order_id", "c_text": "Note Text", "c_interval": "span"}
    ctx = Ctx()
    result = run_transfer(
        PG, src.config, {"table": "source", "columns": {"rename": rename}}, PG, dst.config,
        {"table": "created", "create": True, "receipt": receipt}, ctx,
    )  # fmt: skip
    assert result.rows_written == 3
    src_types = _types(src, "source")
    assert _types(dst, "created") == [(rename.get(n, n), t) for n, t in src_types]
    names = [n for n, _ in src_types]
    assert _values(dst, "created", [rename.get(n, n) for n in names]) == _values(
        src, "source", names
    )
    (row,) = dst.execute("SELECT columns, rows, digest FROM dispatch_receipt")
    assert row[0][:1] == ["order_id"] and "Note Text" in row[0] and "id" not in row[0]
    assert row[1] == 3
    if receipt:
        # The sink's own rows, hashed by SQL, give the digest the worker committed.
        with connect(dst.name) as conn:
            conn.execute(receipts.OUTPUT_SETTINGS_SQL)
            again = conn.execute(receipts.digest_sql(sql.Identifier("created"), row[0])).fetchone()
        assert again is not None and (again[1], again[2]) == (3, row[2])
    else:
        assert row[2] is None


@pytest.mark.django_db
def test_columns__a_column_the_table_lacks_fails_at_open_naming_it(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    with pytest.raises(PermanentError, match=r"the source has no column\(s\) c_gone, nope"):
        _copy(src, dst, {"select": ["id", "nope", "c_gone"]})
    assert dst.execute("SELECT to_regclass('public.created')") == [(None,)]


@pytest.mark.django_db
def test_columns__compose_with_an_incremental_read_on_an_excluded_cursor(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    spec = {
        "table": "source",
        "columns": {"select": ["c_text"], "rename": {"c_text": "t"}},
        "incremental": {"cursor": ["id"], "start": ["1"]},
    }
    result = run_transfer(
        PG, src.config, spec, PG, dst.config, {"table": "created", "create": True}
    )
    assert result.rows_written == 2  # ids 2 and 3, above the start
    assert _types(dst, "created") == [("t", "text")]
    assert sorted(dst.execute("SELECT t FROM created"), key=str) == sorted(
        src.execute("SELECT c_text FROM source WHERE id > 1"), key=str
    )


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ([], "columns: must be an object"),
        ({"pick": ["a"]}, "unknown field.*pick"),
        ({"select": ["a"], "exclude": ["b"]}, "select or exclude, not both"),
        ({"select": []}, "columns.select: must be a non-empty list"),
        ({"select": ["a", "a"]}, "columns.select: a named more than once"),
        ({"exclude": [1]}, "columns.exclude: must be a non-empty column name"),
        ({"rename": {"a": ""}}, "columns.rename: must be a non-empty column name"),
        ({"rename": {"a": "x" * 64}}, "longer than 63 bytes"),
        ({"select": ["a"], "rename": {"b": "c"}}, "columns.rename: b not among the columns"),
        ({"exclude": ["a"], "hash": ["a"]}, "columns.hash: a not among the columns read"),
    ],
)
def test_columns__bad_specs_are_refused_naming_the_field(columns: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PG.validate_source_spec({"table": "t", "columns": columns})


def test_columns__a_query_source_takes_no_columns() -> None:
    with pytest.raises(ValidationError, match="for table sources only"):
        PG.validate_source_spec({"query": "SELECT 1 AS a", "columns": {"select": ["a"]}})


def test_columns__two_columns_renamed_to_one_sink_name_are_refused() -> None:
    parsed = column_spec.parse({"columns": {"rename": {"a": "b"}}})
    assert parsed is not None
    with pytest.raises(PermanentError, match="the sink would get b twice"):
        column_spec.project(parsed, ["a", "b"])
