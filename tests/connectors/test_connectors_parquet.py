"""The `parquet` connector: the manifest and its fence, round trips of PostgreSQL types
read back by pyarrow and DuckDB, incremental reads by new files and by a column."""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

from dispatch.connectors import parquet_manifest as manifest
from dispatch.connectors.base import Column, FenceRejected, LeaseLost, PermanentError
from dispatch.connectors.builtin import GenerateConnector
from dispatch.connectors.parquet import ParquetConnector as PQ
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import Ctx, Fence, ScratchDB, run_transfer, scratch_db


def _cfg(tmp_path: Path) -> dict[str, str]:
    return {"base_dir": str(tmp_path)}


def _generate(tmp_path: Path, rows: int, sink: dict[str, Any], ctx: Ctx | None = None) -> Any:
    return run_transfer(GenerateConnector, {}, {"rows": rows}, PQ, _cfg(tmp_path), sink, ctx)


def _published(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".parquet"))


def _duck(query: str) -> list[tuple[Any, ...]]:
    with duckdb.connect() as con:
        return con.sql(query).fetchall()


# --- the sink: manifest, fence ------------------------------------------------------------
def test_sink__publishes_one_file_through_the_manifest(tmp_path: Path) -> None:
    result = _generate(tmp_path, 12_345, {"path": "orders", "row_group_rows": 5000})
    assert result.rows_written == 12_345
    files = _published(tmp_path / "orders")
    assert len(files) == 1
    meta = pq.ParquetFile(tmp_path / "orders" / files[0]).metadata
    # Rows streamed in row groups of the spec's size, not one group of everything.
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [5000, 5000, 2345]
    current = manifest.read(str(tmp_path / "orders"), "orders")
    assert current.generation == 1
    assert [f["path"] for f in current.files] == files
    assert os.listdir(tmp_path / "orders" / "_dispatch" / "tmp") == []
    glob = str(tmp_path / "orders" / "*.parquet")
    assert _duck(f"SELECT count(*), sum(id) FROM read_parquet('{glob}')") == [
        (12_345, 12_345 * 12_346 // 2)
    ]


def test_sink__replace_publishes_a_new_generation_and_drops_the_old_files(tmp_path: Path) -> None:
    _generate(tmp_path, 10, {"path": "d"})
    first = _published(tmp_path / "d")
    _generate(tmp_path, 7, {"path": "d"})
    second = _published(tmp_path / "d")
    assert len(second) == 1 and second != first
    assert manifest.read(str(tmp_path / "d"), "d").generation == 2
    assert pads.dataset(str(tmp_path / "d"), format="parquet").count_rows() == 7


def test_sink__append_adds_a_file_per_run(tmp_path: Path) -> None:
    for rows in (3, 4, 5):
        _generate(tmp_path, rows, {"path": "d", "mode": "append"})
    assert len(_published(tmp_path / "d")) == 3
    # pyarrow's dataset discovery skips `_dispatch` (names starting with `_`).
    assert pads.dataset(str(tmp_path / "d"), format="parquet").count_rows() == 12


def test_sink__stale_attempt_file_is_never_published(tmp_path: Path) -> None:
    _generate(tmp_path, 5, {"path": "d"})
    before = _published(tmp_path / "d")
    ctx = Ctx()
    ctx.fence.lost = True  # the attempt was taken over while it wrote
    with pytest.raises(LeaseLost):
        _generate(tmp_path, 100, {"path": "d"}, ctx)
    assert ctx.fence.checks == 1
    assert _published(tmp_path / "d") == before
    assert manifest.read(str(tmp_path / "d"), "d").generation == 1
    assert os.listdir(tmp_path / "d" / "_dispatch" / "tmp") == []


def test_sink__older_token_than_the_committed_one_is_fenced(tmp_path: Path) -> None:
    run = uuid.uuid4()
    newer = Ctx(fence=Fence(run_id=run, token=2))
    stale = Ctx(fence=Fence(run_id=run, token=1))
    # Both attempts open (and write) before either commits; the newer one commits first.
    spec = {"path": "d", "mode": "append"}
    PQ.validate_sink_spec(spec)
    cols = list(GenerateConnector.COLUMNS)
    rows = list(GenerateConnector.rows({"rows": 10}))
    with PQ.open_writer(_cfg(tmp_path), spec, stale, cols) as w_stale:
        w_stale.write(rows)
        with PQ.open_writer(_cfg(tmp_path), spec, newer, cols) as w_new:
            w_new.write(rows)
            assert w_new.commit().rows_written == 10
        with pytest.raises(FenceRejected):
            w_stale.commit()
    assert len(_published(tmp_path / "d")) == 1
    assert os.listdir(tmp_path / "d" / "_dispatch" / "tmp") == []
    # A retry of a committed run (its settlement lost) writes nothing again.
    retry = Ctx(fence=Fence(run_id=run, token=3))
    result = _generate(tmp_path, 10, spec, retry)
    assert result.already_committed
    assert len(_published(tmp_path / "d")) == 1


def test_sink__writer_dead_after_its_commit_point_is_rolled_forward(tmp_path: Path) -> None:
    _generate(tmp_path, 4, {"path": "d", "mode": "append"})
    directory = str(tmp_path / "d")
    # Undo the last rename: the manifest is written, the file still under its staged name.
    entry = manifest.read(directory, "d").files[0]
    os.replace(os.path.join(directory, entry["path"]), os.path.join(directory, entry["staged"]))
    assert _published(tmp_path / "d") == []
    # A reader of the manifest still finds the committed rows.
    with PQ.open_reader(_cfg(tmp_path), {"path": "d"}, Ctx()) as r:
        assert sum(len(b) for b in r.batches()) == 4
    # The next commit completes the rename first.
    _generate(tmp_path, 6, {"path": "d", "mode": "append"})
    assert len(_published(tmp_path / "d")) == 2


def test_sink__spec_and_paths_refused_with_the_field_named(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="mode"):
        PQ.validate_sink_spec({"path": "d", "mode": "upsert"})
    with pytest.raises(ValidationError, match="row_group_rows"):
        PQ.validate_sink_spec({"path": "d", "row_group_rows": 0})
    with pytest.raises(ValidationError, match=r"\.\."):
        PQ.validate_sink_spec({"path": "../d"})
    (tmp_path / "inside").mkdir()
    os.symlink("/", tmp_path / "inside" / "out")
    with pytest.raises(PermanentError, match="leaves base_dir"):
        _generate(tmp_path, 1, {"path": "inside/out"})


def test_config__disabled_without_its_own_setting(tmp_path: Path) -> None:
    refused = pytest.raises(ValidationError, match="DISPATCH_PARQUET_BASE_DIRS")
    with override_settings(DISPATCH_PARQUET_BASE_DIRS=[]), refused:
        PQ.validate_config(_cfg(tmp_path))
    elsewhere = [str(tmp_path / "elsewhere")]
    outside = pytest.raises(ValidationError, match="not inside a directory the site allows")
    with override_settings(DISPATCH_PARQUET_BASE_DIRS=elsewhere), outside:
        PQ.validate_config(_cfg(tmp_path))
    PQ.validate_config(_cfg(tmp_path))


# --- types: PostgreSQL -> Parquet -> pyarrow, DuckDB and back -----------------------------
# 30 columns: (name, type, SQL value of row 1); row 2 is all NULL.
TYPES: list[tuple[str, str, str]] = [
    ("c_bool", "boolean", "true"),
    ("c_int2", "smallint", "-32768"),
    ("c_int4", "integer", "2147483647"),
    ("c_int8", "bigint", "-9223372036854775808"),
    ("c_real", "real", "1.5"),
    ("c_double", "double precision", "-2.25e300"),
    ("c_num", "numeric(12,2)", "1234567890.12"),
    ("c_num38", "numeric(38,10)", "1234567890123456789012345678.0123456789"),
    ("c_num60", "numeric(60,4)", "12345678901234567890123456789012345678901234567890.1234"),
    ("c_numeric", "numeric", "3.14159265358979323846264338327950288419716939937510"),
    ("c_text", "text", "'é ü 日本 🚀, \"quoted\"'"),
    ("c_varchar", "character varying(20)", "'short'"),
    ("c_char", "character(3)", "'ab'"),
    ("c_bytea", "bytea", "'\\x00ff10'::bytea"),
    ("c_date", "date", "'2024-02-29'"),
    ("c_time", "time without time zone", "'23:59:59.123456'"),
    ("c_timetz", "time with time zone", "'12:00:00+02'"),
    ("c_ts", "timestamp without time zone", "'2024-01-02 03:04:05.678901'"),
    ("c_tstz", "timestamp with time zone", "'2024-01-02 03:04:05.5+02:00'"),
    ("c_interval", "interval", "'3 days 04:05:06.5'"),
    ("c_json", "json", '\'{"b": [1, 2], "a": null}\''),
    ("c_jsonb", "jsonb", '\'{"k": "v", "n": 1.5}\''),
    ("c_uuid", "uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'"),
    ("c_int_arr", "integer[]", "'{1,NULL,3}'"),
    ("c_text_arr", "text[]", "'{a,\"b c\",NULL}'"),
    ("c_num_arr", "numeric(5,2)[]", "'{1.25,-3.50}'"),
    ("c_tstz_arr", "timestamp with time zone[]", "ARRAY['2024-01-01 00:00:00+00'::timestamptz]"),
    ("c_uuid_arr", "uuid[]", "ARRAY['a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a12'::uuid]"),
    ("c_inet", "inet", "'192.168.0.1/24'"),
    ("c_xml", "xml", "'<a>1</a>'"),
]
TSTZ = dt.datetime(2024, 1, 2, 1, 4, 5, 500000, tzinfo=dt.UTC)
EXPECTED: dict[str, Any] = {
    "c_bool": True,
    "c_int2": -32768,
    "c_int4": 2147483647,
    "c_int8": -9223372036854775808,
    "c_real": 1.5,
    "c_double": -2.25e300,
    "c_num": Decimal("1234567890.12"),
    "c_num38": Decimal("1234567890123456789012345678.0123456789"),
    "c_num60": "12345678901234567890123456789012345678901234567890.1234",  # > 38 digits: text
    "c_numeric": "3.14159265358979323846264338327950288419716939937510",
    "c_text": 'é ü 日本 🚀, "quoted"',
    "c_varchar": "short",
    "c_char": "ab ",
    "c_bytea": b"\x00\xff\x10",
    "c_date": dt.date(2024, 2, 29),
    "c_time": dt.time(23, 59, 59, 123456),
    "c_timetz": "12:00:00+02:00",
    "c_ts": dt.datetime(2024, 1, 2, 3, 4, 5, 678901),
    "c_tstz": TSTZ,
    "c_interval": "3 days 04:05:06.500000",
    "c_json": {"b": [1, 2], "a": None},
    "c_jsonb": {"k": "v", "n": 1.5},
    "c_uuid": uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    "c_int_arr": [1, None, 3],
    "c_text_arr": ["a", "b c", None],
    "c_num_arr": [Decimal("1.25"), Decimal("-3.50")],
    "c_tstz_arr": [dt.datetime(2024, 1, 1, tzinfo=dt.UTC)],
    "c_uuid_arr": ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a12"],  # arrays of uuid: text
    "c_inet": "192.168.0.1/24",
    "c_xml": "<a>1</a>",
}


@pytest.fixture
def typed_db() -> Any:
    yield from scratch_db("pq_types")


def _make_typed(db: ScratchDB) -> None:
    assert len(TYPES) == 30
    db.execute(
        "CREATE TABLE typed (id int PRIMARY KEY, "
        + ", ".join(f"{n} {t}" for n, t, _ in TYPES)
        + ")"
    )
    db.execute(
        "INSERT INTO typed VALUES (1, "
        + ", ".join(v for _, _, v in TYPES)
        + "), (2"
        + ", NULL" * len(TYPES)
        + ")"
    )


def _normal(name: str, value: Any) -> Any:
    """Values as the two readers give them, compared with EXPECTED: JSON parsed, zones to
    UTC."""
    if value is None:
        return None
    if name in ("c_json", "c_jsonb"):
        return json.loads(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC)
    if isinstance(value, list):
        return [_normal(name, v) if isinstance(v, dt.datetime) else v for v in value]
    return value


@pytest.mark.django_db
def test_types__thirty_postgresql_types_read_back_by_pyarrow_and_duckdb(
    tmp_path: Path, typed_db: ScratchDB
) -> None:
    _make_typed(typed_db)
    result = run_transfer(
        PG, typed_db.config, {"table": "typed"}, PQ, _cfg(tmp_path), {"path": "typed"}
    )
    assert result.rows_written == 2
    (name,) = _published(tmp_path / "typed")
    path = str(tmp_path / "typed" / name)
    table = pq.read_table(path).sort_by("id")
    rows = table.to_pylist()
    for column, expected in EXPECTED.items():
        assert _normal(column, rows[0][column]) == expected, column
        assert rows[1][column] is None, column
    # Each field carries its PostgreSQL type.
    field = table.schema.field("c_num")
    assert field.metadata[b"dispatch.postgresql_type"] == b"numeric(12,2)"
    # DuckDB reads the same values, with the logical types Parquet declares.
    names = [n for n, _, _ in TYPES]
    duck = _duck(f"SELECT {', '.join(names)} FROM read_parquet('{path}') ORDER BY id")
    for column, got in zip(names, duck[0], strict=True):
        assert _normal(column, got) == EXPECTED[column], column
    assert all(v is None for v in duck[1])
    kinds = dict((r[0], r[1]) for r in _duck(f"DESCRIBE SELECT * FROM read_parquet('{path}')"))
    assert kinds["c_tstz"] == "TIMESTAMP WITH TIME ZONE"
    assert kinds["c_num"] == "DECIMAL(12,2)"
    assert kinds["c_uuid"] == "UUID"
    assert kinds["c_jsonb"] == "JSON"
    assert kinds["c_int_arr"] == "INTEGER[]"


@pytest.mark.django_db
def test_types__parquet_back_into_postgresql_keeps_types_and_values(
    tmp_path: Path, typed_db: ScratchDB
) -> None:
    _make_typed(typed_db)
    run_transfer(PG, typed_db.config, {"table": "typed"}, PQ, _cfg(tmp_path), {"path": "typed"})
    result = run_transfer(
        PQ,
        _cfg(tmp_path),
        {"path": "typed"},
        PG,
        typed_db.config,
        {"table": "back", "create": True},
    )
    assert result.rows_written == 2
    declared = typed_db.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
        " WHERE a.attrelid = 'back'::regclass AND a.attnum > 0 ORDER BY a.attnum"
    )
    assert dict(declared) == {"id": "integer", **{n: t for n, t, _ in TYPES}}
    # Every value equal to the original, compared by PostgreSQL (interval as the driver
    # carried it: 3 days 04:05:06.5 has no months, so it is exact).
    differ = typed_db.execute(
        "SELECT count(*) FROM typed t JOIN back b USING (id) WHERE "
        + " OR ".join(
            f"t.{n}::text IS DISTINCT FROM b.{n}::text" for n, _, _ in TYPES if n != "c_json"
        )
        + " OR t.c_json::jsonb IS DISTINCT FROM b.c_json::jsonb"
    )
    assert differ == [(0,)]


def test_types__a_foreign_file_maps_arrow_types(tmp_path: Path) -> None:
    _duck(
        f"COPY (SELECT 1::TINYINT AS a, 2::UBIGINT AS b, 'x' AS s, [1, 2] AS l,"
        f" {{'k': 1}} AS st, DATE '2024-01-01' AS d) TO '{tmp_path / 'f.parquet'}'"
    )
    with PQ.open_reader(_cfg(tmp_path), {"path": "f.parquet"}, Ctx()) as r:
        assert [(c.name, c.type) for c in r.columns] == [
            ("a", "smallint"),
            ("b", "numeric(20,0)"),
            ("s", "text"),
            ("l", "integer[]"),
            ("st", "jsonb"),
            ("d", "date"),
        ]
        rows = [row for batch in r.batches() for row in batch]
    assert rows == [(1, 2, "x", [1, 2], '{"k": 1}', dt.date(2024, 1, 1))]


# --- the source -----------------------------------------------------------------------------
def test_source__hive_partitions_read_as_columns(tmp_path: Path) -> None:
    for region, n in (("eu", 2), ("us", 3)):
        part = tmp_path / "ds" / f"region={region}"
        part.mkdir(parents=True)
        _duck(f"COPY (SELECT range AS id FROM range({n})) TO '{part / 'data.parquet'}'")
    (tmp_path / "ds" / "_SUCCESS").write_text("")
    (tmp_path / "ds" / ".part.parquet.crc").write_text("")
    ctx = Ctx()
    with PQ.open_reader(_cfg(tmp_path), {"path": "ds"}, ctx) as r:
        assert [c.name for c in r.columns] == ["id", "region"]
        rows = sorted(row for batch in r.batches() for row in batch)
    assert rows == [(0, "eu"), (0, "us"), (1, "eu"), (1, "us"), (2, "us")]
    assert ctx.estimates == [5]


def test_source__missing_path_and_hard_links_refused(tmp_path: Path) -> None:
    with pytest.raises(PermanentError, match="does not exist"):
        PQ.open_reader(_cfg(tmp_path), {"path": "nothing"}, Ctx()).__enter__()
    _duck(f"COPY (SELECT 1 AS a) TO '{tmp_path / 'a.parquet'}'")
    os.link(tmp_path / "a.parquet", tmp_path / "b.parquet")
    with pytest.raises(PermanentError, match="hard links"):
        PQ.open_reader(_cfg(tmp_path), {"path": "a.parquet"}, Ctx()).__enter__()
    with pytest.raises(ValidationError, match="incremental.by"):
        PQ.validate_source_spec({"path": "x", "incremental": {"by": "mtime"}})


def _into_table(tmp_path: Path, db: ScratchDB, source_spec: dict[str, Any], ctx: Ctx) -> int:
    sink = {"table": "landed", "mode": "append", "create": True}
    return run_transfer(PQ, _cfg(tmp_path), source_spec, PG, db.config, sink, ctx).rows_written


@pytest.mark.django_db
def test_incremental__by_new_files_reads_each_file_once(
    tmp_path: Path, typed_db: ScratchDB
) -> None:
    # The source dataset is written by dispatch runs (append: one file per run).
    spec = {"path": "src", "incremental": {"by": "file"}}
    binding = uuid.uuid4()

    def step() -> int:
        return _into_table(tmp_path, typed_db, spec, Ctx(fence=Fence(binding_id=binding)))

    _generate(tmp_path, 3, {"path": "src", "mode": "append"})
    assert step() == 3
    assert step() == 0  # nothing new
    _generate(tmp_path, 4, {"path": "src", "mode": "append"})
    _generate(tmp_path, 5, {"path": "src", "mode": "append"})
    assert step() == 9
    assert typed_db.execute("SELECT count(*), count(DISTINCT id) FROM landed") == [(12, 5)]
    (cursor,) = typed_db.execute("SELECT cursor FROM dispatch_cursor")
    assert cursor[0] == [_published(tmp_path / "src")[-1]]


@pytest.mark.django_db
def test_incremental__by_column_reads_rows_above_the_cursor(
    tmp_path: Path, typed_db: ScratchDB
) -> None:
    path = tmp_path / "events.parquet"
    _duck(
        "COPY (SELECT range AS id, TIMESTAMPTZ '2024-01-01 00:00:00+00' + range * INTERVAL 1"
        f" HOUR AS at FROM range(10)) TO '{path}'"
    )
    spec = {"path": "events.parquet", "incremental": {"cursor": ["at", "id"]}}
    binding = uuid.uuid4()

    def step() -> int:
        return _into_table(tmp_path, typed_db, spec, Ctx(fence=Fence(binding_id=binding)))

    assert step() == 10
    assert step() == 0
    _duck(
        "COPY (SELECT range AS id, TIMESTAMPTZ '2024-01-01 00:00:00+00' + range * INTERVAL 1"
        f" HOUR AS at FROM range(13)) TO '{path}'"
    )
    assert step() == 3
    assert typed_db.execute("SELECT count(*), count(DISTINCT id), max(id) FROM landed") == [
        (13, 13, 12)
    ]


@pytest.mark.django_db
def test_incremental__into_a_parquet_sink_commits_the_cursor_in_the_manifest(
    tmp_path: Path, typed_db: ScratchDB
) -> None:
    typed_db.execute("CREATE TABLE ev (id bigint PRIMARY KEY)")
    typed_db.execute("INSERT INTO ev SELECT generate_series(1, 5)")
    source = {"table": "ev", "incremental": {"cursor": ["id"]}}
    binding = uuid.uuid4()
    sink = {"path": "out", "mode": "append"}

    def step() -> int:
        ctx = Ctx(fence=Fence(binding_id=binding))
        return run_transfer(PG, typed_db.config, source, PQ, _cfg(tmp_path), sink, ctx).rows_written

    assert step() == 5
    typed_db.execute("INSERT INTO ev SELECT generate_series(6, 8)")
    assert step() == 3
    held = manifest.read(str(tmp_path / "out"), "out").cursor_of(binding)
    assert (held.columns, held.cursor, held.version) == (("id",), ["8"], 2)
    assert pads.dataset(str(tmp_path / "out"), format="parquet").count_rows() == 8
    # An operator's reset: the next run reads everything again.
    PQ.set_cursor(_cfg(tmp_path), sink, binding, ("id",), None)
    assert step() == 8
    with pytest.raises(PermanentError, match="append"):
        run_transfer(PG, typed_db.config, source, PQ, _cfg(tmp_path), {"path": "o2"}, Ctx())


def test_writer__columns_from_a_source_without_types_are_text(tmp_path: Path) -> None:
    spec = {"path": "d"}
    PQ.validate_sink_spec(spec)
    with PQ.open_writer(_cfg(tmp_path), spec, Ctx(), [Column("a"), Column("b")]) as w:
        w.write([("1", None), ("x", "y")])
        w.commit()
    (name,) = _published(tmp_path / "d")
    assert pq.read_table(tmp_path / "d" / name).to_pylist() == [
        {"a": "1", "b": None},
        {"a": "x", "b": "y"},
    ]


def test_check__entries_refused_themselves_allow_nothing(tmp_path: Path) -> None:
    from dispatch import checks

    listed = ["exports", "/usr/local/bin", str(tmp_path)]
    with override_settings(DISPATCH_PARQUET_BASE_DIRS=listed):
        errors = checks.check_parquet_base_dirs()
        assert [e.id for e in errors] == ["dispatch.E020"] * 2
        assert "'exports' is not an absolute path" in errors[0].msg
        # A listed system directory opens nothing under it either.
        with pytest.raises(ValidationError, match="directory of their own"):
            PQ.validate_config({"base_dir": "/usr/local/bin"})


def test_writer__a_value_that_does_not_fit_names_its_column(tmp_path: Path) -> None:
    spec = {"path": "d"}
    cols = [Column("n", "numeric(5,2)"), Column("grid", "integer[]")]
    for row, column in (((Decimal("NaN"), None), "'n'"), ((None, [[1, 2], [3, 4]]), "'grid'")):
        refused = pytest.raises(PermanentError, match=f"column {column}")
        with PQ.open_writer(_cfg(tmp_path), spec, Ctx(), cols) as w, refused:
            w.write([row])
    # Nothing was published, and no temporary file is left.
    assert not (tmp_path / "d" / "_dispatch" / "manifest-0000000001.json").exists()
    assert os.listdir(tmp_path / "d" / "_dispatch" / "tmp") == []
