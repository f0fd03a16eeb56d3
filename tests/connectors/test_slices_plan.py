"""Planning the slices of a `postgresql` table source (dispatch/connectors/postgresql/
slices.py), on a real source database: every row belongs to exactly one slice whatever
the keys look like (empty, one row, NULL keys, all equal, more slices asked than values,
integer, timestamptz and uuid keys), the spec's rules at save, and the key's type checked
at planning with a permanent error naming the column."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import PermanentError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql import slices
from tests.support.connectors import Ctx, ScratchDB, connect, scratch_db

pytestmark = pytest.mark.django_db


@pytest.fixture
def src() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_slices_plan")


def plan(db: ScratchDB, table: str, **sliced: object) -> slices.Plan:
    return PG.plan_slices(db.config, {"table": table, "slices": sliced}, Ctx())


def owners(db: ScratchDB, table: str, key: str, p: slices.Plan) -> list[int]:
    """For every row of the table, how many slices' WHERE select it (each must be 1)."""
    with connect(db.name) as conn:
        counts: dict[object, int] = {}
        for lower, upper in p.bounds:
            q = slices.where(key, lower, upper).as_string(conn)
            for (rid,) in conn.execute(f"SELECT ctid::text FROM {table} WHERE {q}"):  # noqa: S608
                counts[rid] = counts.get(rid, 0) + 1
        total = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608
    assert len(counts) == total, "a row belongs to no slice"
    return sorted(set(counts.values()))


def test_plan__integer_key_in_equal_widths_with_open_ends(src: ScratchDB) -> None:
    src.execute("CREATE TABLE t (id bigint, v text)")
    src.execute("INSERT INTO t SELECT i, 'x' FROM generate_series(1, 1000) i")
    p = plan(src, "t", key="id", count=4)
    assert p.key_type == "bigint" and p.method == "count"
    assert p.bounds == [(None, "251"), ("251", "501"), ("501", "751"), ("751", None)]
    assert owners(src, "t", "id", p) == [1]
    # A row added after planning, beyond the maximum, still falls in the last slice; one
    # below the minimum and a NULL key in the first.
    src.execute("INSERT INTO t VALUES (5000, 'late'), (-7, 'early'), (NULL, 'null')")
    assert owners(src, "t", "id", p) == [1]


def test_plan__empty_table_and_all_null_keys_make_one_slice_of_everything(
    src: ScratchDB,
) -> None:
    src.execute("CREATE TABLE t (id integer)")
    assert plan(src, "t", key="id", count=8).bounds == [(None, None)]
    src.execute("INSERT INTO t VALUES (NULL), (NULL)")
    p = plan(src, "t", key="id", count=8)
    assert p.bounds == [(None, None)]
    assert owners(src, "t", "id", p) == [1]


def test_plan__one_row_all_equal_keys_and_more_slices_than_values(src: ScratchDB) -> None:
    src.execute("CREATE TABLE one (id integer)")
    src.execute("INSERT INTO one VALUES (42)")
    assert plan(src, "one", key="id", count=8).bounds == [(None, None)]
    src.execute("CREATE TABLE same (id integer)")
    src.execute("INSERT INTO same SELECT 7 FROM generate_series(1, 50)")
    assert plan(src, "same", key="id", count=8).bounds == [(None, None)]
    src.execute("CREATE TABLE few (id smallint)")
    src.execute("INSERT INTO few VALUES (1), (2), (3), (NULL)")
    p = plan(src, "few", key="id", count=10)
    assert p.bounds == [(None, "2"), ("2", "3"), ("3", None)]  # three values, three slices
    assert owners(src, "few", "id", p) == [1]


def test_plan__timestamptz_key(src: ScratchDB) -> None:
    src.execute("CREATE TABLE ev (at timestamptz)")
    src.execute(
        "INSERT INTO ev SELECT '2024-03-30 00:00+00'::timestamptz + i * interval '1 hour'"
        " FROM generate_series(0, 96) i"
    )
    src.execute("INSERT INTO ev VALUES (NULL)")
    p = plan(src, "ev", key="at", count=4)
    assert p.key_type == "timestamp with time zone"
    assert len(p.bounds) == 4
    # 96 hours in four: a day each (to the microsecond: the widths are counted in them)
    assert p.bounds[1][0].startswith("2024-03-31T00:00:00")
    assert owners(src, "ev", "at", p) == [1]


def test_plan__uuid_key(src: ScratchDB) -> None:
    src.execute("CREATE TABLE u (id uuid)")
    src.execute("INSERT INTO u SELECT gen_random_uuid() FROM generate_series(1, 2000)")
    p = plan(src, "u", key="id", count=5)
    assert p.key_type == "uuid" and len(p.bounds) == 5
    assert owners(src, "u", "id", p) == [1]
    sizes = []
    with connect(src.name) as conn:
        for lower, upper in p.bounds:
            q = slices.where("id", lower, upper).as_string(conn)
            sizes.append(conn.execute(f"SELECT count(*) FROM u WHERE {q}").fetchone()[0])  # noqa: S608
    assert all(200 < n < 700 for n in sizes), sizes  # random keys: about 400 each


def test_plan__rows_per_slice_from_statistics_and_histogram(src: ScratchDB) -> None:
    src.execute("CREATE TABLE t (id bigint)")
    # Skewed keys: equal widths would put nearly all rows in one slice; the histogram
    # puts about as many rows in each.
    src.execute(
        "INSERT INTO t SELECT CASE WHEN i <= 9000 THEN i ELSE i * 1000 END"
        " FROM generate_series(1, 10000) i"
    )
    unanalysed = plan(src, "t", key="id", rows_per_slice=2500)
    assert "counted" in unanalysed.basis and len(unanalysed.bounds) == 4
    src.execute("ANALYZE t")
    p = plan(src, "t", key="id", rows_per_slice=2500)
    assert "histogram" in p.basis and "estimated" in p.basis
    assert len(p.bounds) == 4
    assert owners(src, "t", "id", p) == [1]
    with connect(src.name) as conn:
        sizes = [
            conn.execute(
                f"SELECT count(*) FROM t WHERE {slices.where('id', lo, up).as_string(conn)}"  # noqa: S608
            ).fetchone()[0]
            for lo, up in p.bounds
        ]
    assert max(sizes) < 4000, sizes


def test_plan__key_of_another_type_or_missing_is_a_permanent_error_naming_it(
    src: ScratchDB,
) -> None:
    src.execute("CREATE TABLE t (id bigint, name text)")
    with pytest.raises(PermanentError, match=r"column 'name' of t is of type text"):
        plan(src, "t", key="name", count=2)
    with pytest.raises(PermanentError, match=r"has no column 'nope'"):
        plan(src, "t", key="nope", count=2)


def test_plan__the_range_is_a_literal_never_sql(src: ScratchDB) -> None:
    with connect(src.name) as conn:
        text = slices.where('i"d', "1'; DROP TABLE t; --", None).as_string(conn)
    assert text == "\"i\"\"d\" >= '1''; DROP TABLE t; --'"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"table": "t", "slices": {"key": "id"}}, "exactly one of count or rows_per_slice"),
        ({"table": "t", "slices": {"key": "id", "count": 0}}, "slices.count"),
        ({"table": "t", "slices": {"key": "id", "count": 10**6}}, "slices.count"),
        ({"table": "t", "slices": {"count": 2}}, "slices.key"),
        ({"table": "t", "slices": {"key": "id", "count": 2, "by": 1}}, "unknown field"),
        ({"table": "t", "slices": [1]}, "must be an object"),
        ({"query": "SELECT 1", "slices": {"key": "id", "count": 2}}, "only a table source"),
        (
            {"table": "t", "slices": {"key": "id", "count": 2}, "incremental": {"cursor": ["id"]}},
            "not supported with incremental",
        ),
    ],
)
def test_spec__slices_refused_at_save_with_the_field_named(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PG.validate_source_spec(spec)


def test_spec__valid_slices_accepted() -> None:
    spec = {"table": "t", "slices": {"key": "id", "rows_per_slice": 100_000}}
    assert PG.validate_source_spec(spec) == spec
