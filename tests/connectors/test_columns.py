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


# --- created sinks like their source ------------------------------------------------------
def _constraints(db: ScratchDB, table: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in db.execute(
            "SELECT contype::text, pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = %s::regclass AND contype IN ('p', 'u') ORDER BY contype, conname",
            [table],
        )
    ]


def _not_null(db: ScratchDB, table: str) -> list[str]:
    return [
        r[0]
        for r in db.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
            " AND attnotnull ORDER BY attnum",
            [table],
        )
    ]


SHAPED = """
CREATE TABLE orders (
    region text NOT NULL, number integer NOT NULL, code text NOT NULL, email text,
    note text, PRIMARY KEY (number, region), UNIQUE (code), UNIQUE (email, note)
);
INSERT INTO orders VALUES ('eu', 1, 'A', 'a@x', NULL), ('us', 1, 'B', NULL, 'n');
"""


@pytest.mark.django_db
def test_create__takes_the_sources_primary_key_and_not_nulls(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(SHAPED)
    spec = {"table": "orders", "columns": {"rename": {"number": "n"}}}
    run_transfer(
        PG, src_db.config, spec, PG, dst_db.config,
        {"table": "created", "create": True, "mode": "replace"},
    )  # fmt: skip
    # The key in the source's key order, under the sink's names; no unique constraint
    # unless asked.
    assert _constraints(dst_db, "created") == [("p", "PRIMARY KEY (n, region)")]
    assert _not_null(dst_db, "created") == ["region", "n", "code"]
    assert dst_db.execute("SELECT count(*) FROM created") == [(2,)]
    # Appending takes the NOT NULLs, not the key: a row may be appended again.
    for _ in range(2):
        run_transfer(PG, src_db.config, spec, PG, dst_db.config, {"table": "log", "create": True})
    assert _constraints(dst_db, "log") == []
    assert _not_null(dst_db, "log") == ["region", "n", "code"]
    assert dst_db.execute("SELECT count(*) FROM log") == [(4,)]


@pytest.mark.django_db
def test_create__unique_constraints_when_asked_and_only_those_wholly_delivered(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(SHAPED)
    run_transfer(
        PG, src_db.config, {"table": "orders", "columns": {"exclude": ["note"]}},
        PG, dst_db.config,
        {"table": "created", "create": True, "create_unique": True, "mode": "replace"},
    )  # fmt: skip
    # (email, note) lost its column `note`: it is not carried.
    assert _constraints(dst_db, "created") == [
        ("p", "PRIMARY KEY (number, region)"),
        ("u", "UNIQUE (code)"),
    ]


@pytest.mark.django_db
def test_create__a_key_excluded_in_part_is_not_carried_and_key_gives_one(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(SHAPED)
    spec = {"table": "orders", "columns": {"exclude": ["region"]}}
    run_transfer(
        PG, src_db.config, spec, PG, dst_db.config,
        {"table": "nokey", "create": True, "mode": "replace"},
    )  # fmt: skip
    assert _constraints(dst_db, "nokey") == []
    # A source without a (delivered) key is given one by the sink spec's `key`.
    run_transfer(
        PG, src_db.config, spec, PG, dst_db.config,
        {"table": "keyed", "create": True, "key": ["code"]},
    )  # fmt: skip
    assert _constraints(dst_db, "keyed") == [("p", "PRIMARY KEY (code)")]


@pytest.mark.django_db
def test_create__the_35_type_sample_keeps_its_primary_key(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    run_transfer(
        PG, src.config, {"table": "source"}, PG, dst.config,
        {"table": "created", "create": True, "mode": "replace"},
    )  # fmt: skip
    assert _constraints(dst, "created") == [("p", "PRIMARY KEY (id)")]
    assert _types(dst, "created") == _types(src, "source")


@pytest.mark.django_db
def test_upsert__a_key_the_sink_does_not_enforce_fails_before_any_row_moves(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute(SHAPED)
    dst_db.execute(
        "CREATE TABLE target (region text, number integer, code text, email text, note text);"
        "CREATE UNIQUE INDEX partial ON target (code) WHERE code <> 'A'"
    )
    ctx = Ctx()
    with pytest.raises(
        PermanentError, match=r"public.target has no unique index or constraint on \(code\)"
    ):
        run_transfer(
            PG, src_db.config, {"table": "orders"}, PG, dst_db.config,
            {"table": "target", "mode": "upsert", "key": ["code"]}, ctx,
        )  # fmt: skip
    assert ctx.rows_read == 0
    # Once the sink enforces it (an index on exactly those columns), the upsert runs.
    dst_db.execute("CREATE UNIQUE INDEX whole ON target (code)")
    result = run_transfer(
        PG, src_db.config, {"table": "orders"}, PG, dst_db.config,
        {"table": "target", "mode": "upsert", "key": ["code"]},
    )  # fmt: skip
    assert result.rows_written == 2


@pytest.mark.parametrize(
    ("sink", "message"),
    [
        ({"key": ["a"]}, "key: only used with mode upsert or mirror, or with create"),
        ({"create": True, "key": "a"}, "key: must be a non-empty list"),
        ({"mode": "upsert", "key": ["a", "a"]}, "key: a column is named more than once"),
        ({"create_unique": True}, "create_unique: only used with create"),
        ({"create": True, "create_unique": "yes"}, "create_unique: must be true or false"),
    ],
)
def test_create__bad_sink_specs_are_refused_naming_the_field(
    sink: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        PG.validate_sink_spec({"table": "t", **sink})


# --- keyed hashes ---------------------------------------------------------------------------
HASHED = ["c_text", "c_timestamptz", "c_json", "c_bytea", "c_int_matrix", "c_enum", "c_boolean"]


def _expected_hashes(db: ScratchDB, key: bytes) -> list[tuple[str | None, ...]]:
    """HMAC-SHA256 of each hashed value's output text (what COPY writes, under dispatch's
    output settings), computed here from the source's own rows."""
    import hashlib
    import hmac

    with connect(db.name) as conn:
        conn.execute(receipts.OUTPUT_SETTINGS_SQL)
        rows = conn.execute(
            sql.SQL("SELECT {} FROM source ORDER BY id").format(
                sql.SQL(", ").join(
                    sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE concat({0}) END").format(
                        sql.Identifier(c)
                    )
                    for c in HASHED
                )
            )
        ).fetchall()
    return [
        tuple(
            None if v is None else hmac.new(key, v.encode(), hashlib.sha256).hexdigest()
            for v in row
        )
        for row in rows
    ]


def _hash_columns(rows_only: bool) -> dict[str, Any]:
    columns: dict[str, Any] = {"hash": HASHED, "rename": {"c_text": "who"}}
    if rows_only:
        # Decoded rows: values Python can hold (the sample's infinite and BC dates
        # cannot be), plus the hashed ones (loaded as text, never decoded).
        columns["select"] = ["id", "c_integer", "c_numeric_p", "c_uuid", *HASHED]
    return columns


def _hash_copy(
    src: ScratchDB, dst: ScratchDB, table: str, key: bytes, rows_only: bool = False, **options: Any
) -> Any:
    return run_transfer(
        PG, src.config,
        {"table": "source", "columns": _hash_columns(rows_only)},
        PG, dst.config, {"table": table, "create": True, "mode": "replace", **options},
        Ctx(hash_key=key), rows_only=rows_only,
    )  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path", ["pass-through", "receipt", "rows"], ids=["pass-through", "receipt", "rows"]
)
def test_hash__values_are_the_keyed_hash_of_their_text_stable_and_per_key(
    sample: tuple[ScratchDB, ScratchDB], path: str
) -> None:
    src, dst = sample
    key, other = b"k" * 32, b"another key, as long"
    options: dict[str, Any] = {"receipt": True} if path == "receipt" else {}
    if path == "rows":
        options["rows_only"] = True
    assert _hash_copy(src, dst, "first", key, **dict(options)).rows_written == 3
    sink_names = ["who" if c == "c_text" else c for c in HASHED]
    expected = _expected_hashes(src, key)
    assert _values(dst, "first", ["id", *sink_names]) == [
        (str(i), *row) for i, row in zip([1, 2, 3], expected, strict=True)
    ]
    # Row 2 is all NULLs: NULL stays NULL; the others are 64 hex digits.
    assert expected[1] == (None,) * len(HASHED)
    assert all(len(v) == 64 for v in expected[0])
    # A hashed column is text; every other column keeps its exact type.
    types = dict(_types(dst, "first"))
    assert all(types[n] == "text" for n in sink_names)
    src_types = dict(_types(src, "source"))
    if path == "rows":
        src_types = {n: t for n, t in src_types.items() if n in _hash_columns(True)["select"]}
    assert all(types[n] == t for n, t in src_types.items() if n not in HASHED)
    others = [n for n in src_types if n not in HASHED]
    assert _values(dst, "first", others) == _values(src, "source", others)
    # Stable across runs, different under another key.
    _hash_copy(src, dst, "again", key, **dict(options))
    _hash_copy(src, dst, "other", other, **dict(options))
    assert _values(dst, "again", sink_names) == _values(dst, "first", sink_names)
    first = dict(_values(dst, "first", ["id", "who"]))
    under_other = dict(_values(dst, "other", ["id", "who"]))
    assert first["1"] != under_other["1"] and first["3"] != under_other["3"]
    assert first["2"] is None and under_other["2"] is None
    if path == "receipt":
        # The receipt describes the rows as the sink holds them (the hashes).
        (row,) = dst.execute(
            "SELECT columns, digest FROM dispatch_receipt ORDER BY committed_at LIMIT 1"
        )
        with connect(dst.name) as conn:
            conn.execute(receipts.OUTPUT_SETTINGS_SQL)
            again = conn.execute(receipts.digest_sql(sql.Identifier("first"), row[0])).fetchone()
        assert again is not None and again[2] == row[1]


@pytest.mark.django_db
def test_hash__a_read_without_its_key_fails_naming_the_option(
    sample: tuple[ScratchDB, ScratchDB],
) -> None:
    src, dst = sample
    with pytest.raises(PermanentError, match="columns.hash: the read was given no hash key"):
        run_transfer(
            PG, src.config, {"table": "source", "columns": {"hash": ["c_text"]}},
            PG, dst.config, {"table": "created", "create": True},
        )  # fmt: skip


# --- the binding's hash key, end to end through the runner ---------------------------------
def _hash_binding(src: ScratchDB, dst: ScratchDB) -> Any:
    from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory

    job = JobFactory(
        source_spec={"table": "people", "columns": {"hash": ["email"]}},
        sink_spec={"table": "people", "create": True, "mode": "replace"},
    )
    return BindingFactory(
        job=job,
        source=DatasourceFactory(kind="postgresql", config=src.config),
        sink=DatasourceFactory(kind="postgresql", config=dst.config),
    )


def _execute(binding: Any) -> tuple[str | None, Any]:
    from dispatch.models import Attempt
    from dispatch.worker import claims
    from dispatch.worker.runner import ExecutionControl, Runner
    from tests.support.factories import trigger

    run = trigger(binding)
    (claimed,) = claims.claim("w-columns", run_id=run.id, limit=1, generic=False)
    status = Runner(claimed, ExecutionControl(claimed)).execute()
    return status, Attempt.objects.get(pk=claimed.attempt_id)


@pytest.mark.django_db(transaction=True)
def test_hash__the_runner_reads_the_bindings_key_and_never_shows_it(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    import hashlib
    import hmac

    from dispatch.core.states import Reason, Status

    src_db.execute("CREATE TABLE people (id integer PRIMARY KEY, email text)")
    src_db.execute("INSERT INTO people VALUES (1, 'ann@example.org'), (2, NULL)")
    binding = _hash_binding(src_db, dst_db)
    # No key: the run fails for good, saying what is missing.
    status, attempt = _execute(binding)
    assert status == Status.FAILED
    assert attempt.reason == Reason.PERMANENT_ERROR
    assert "columns.hash needs the binding's hash key" in attempt.error
    assert dst_db.execute("SELECT to_regclass('public.people')") == [(None,)]
    key = "a key of the binding, long enough"
    binding.set_hash_key(key)
    binding.save()
    assert key not in binding.hash_key_ciphertext
    status, attempt = _execute(binding)
    assert status == Status.SUCCEEDED, attempt.error
    expected = hmac.new(key.encode(), b"ann@example.org", hashlib.sha256).hexdigest()
    assert dst_db.execute("SELECT id, email FROM people ORDER BY id") == [(1, expected), (2, None)]
    for snapshot in (attempt.source_redacted, attempt.sink_redacted):
        assert key not in str(snapshot)


def test_hash_key__a_ciphertext_opens_only_on_its_binding() -> None:
    import uuid

    from dispatch.security import crypto

    one, other = uuid.uuid4(), uuid.uuid4()
    token = crypto.encrypt_binding_secret(one, "hash_key", "sixteen chars at least")
    assert crypto.decrypt_binding_secret(token, expected_id=one, name="hash_key") == (
        "sixteen chars at least"
    )
    with pytest.raises(crypto.SnapshotUnreadable, match="belongs to another binding"):
        crypto.decrypt_binding_secret(token, expected_id=other, name="hash_key")


@pytest.mark.django_db
def test_binding_form__the_hash_key_is_write_only_kept_when_blank_and_checked() -> None:
    from dispatch.console.forms import BindingForm
    from dispatch.security import crypto
    from tests.support.factories import BindingFactory

    binding = BindingFactory()
    base = {
        "name": binding.name,
        "job": binding.job_id,
        "source": binding.source_id,
        "sink": binding.sink_id,
        "enabled": "on",
        "max_concurrency": 1,
    }
    short = BindingForm({**base, "hash_key": "short"}, instance=binding)
    assert not short.is_valid()
    assert "at least 16 characters" in str(short.errors["hash_key"])
    form = BindingForm({**base, "hash_key": "a good long hash key"}, instance=binding)
    assert form.is_valid(), form.errors
    form.save()
    binding.refresh_from_db()
    opened = crypto.decrypt_binding_secret(
        binding.hash_key_ciphertext, expected_id=binding.id, name="hash_key"
    )
    assert opened == "a good long hash key"
    # Never shown back: the form renders no value, and a blank submission keeps the key.
    again = BindingForm(instance=binding)
    assert "a good long hash key" not in str(again["hash_key"])
    assert "one is stored" in str(again["hash_key"].label)
    kept = BindingForm(base, instance=binding)
    assert kept.is_valid(), kept.errors
    kept.save()
    binding.refresh_from_db()
    assert binding.hash_key_ciphertext
    cleared = BindingForm({**base, "clear_hash_key": "on"}, instance=binding)
    assert cleared.is_valid(), cleared.errors
    cleared.save()
    binding.refresh_from_db()
    assert binding.hash_key_ciphertext == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("columns", "fmt"),
    [
        (None, "binary"),
        ({"select": ["c_integer", "c_text"], "rename": {"c_text": "t"}}, "binary"),
        ({"exclude": ["c_json"]}, "binary"),
        ({"hash": ["c_text"]}, "text"),
    ],
    ids=["plain", "select-rename", "exclude", "hash"],
)
def test_columns__select_exclude_rename_keep_the_binary_pass_through(
    sample: tuple[ScratchDB, ScratchDB], columns: dict[str, Any] | None, fmt: str
) -> None:
    """What the option costs, counted: the same COPY path and the same number of blocks
    as a copy without it (the projection is the source server's select list); only
    `hash` moves to text COPY."""
    from dispatch.connectors.base import copy_format

    src, dst = sample
    spec: dict[str, Any] = {"table": "source"}
    if columns is not None:
        spec["columns"] = columns
    ctx = Ctx(hash_key=b"k" * 32)
    with PG.open_reader(src.config, spec, ctx) as reader:
        sink = {"table": "created", "create": True, "mode": "replace"}
        with PG.open_writer(dst.config, sink, ctx, reader.columns) as writer:
            assert copy_format(reader, writer) == fmt
            blocks = list(reader.copy_chunks(fmt))
            # One block (the sample is small), every row counted, no decoded batch.
            assert len(blocks) == 1 and blocks[0][1] == 3
