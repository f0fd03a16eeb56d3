"""The `postgresql` connector against real scratch databases on the test server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import PermanentError, TransientError
from dispatch.connectors.builtin import GenerateConnector
from dispatch.connectors.csv import CSVConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql import parse_table
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource
from tests.support import factories
from tests.support.connectors import (
    Ctx,
    ScratchDB,
    connect,
    run_transfer,
    scratch_db,
)
from tests.support.processes import Processes, wait_until


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_conn_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_conn_dst")


TYPES_TABLE = """
CREATE TABLE public.everything (
    id integer PRIMARY KEY,
    small smallint,
    big bigint,
    price numeric(12,2),
    ratio numeric(7,5),
    anynum numeric,
    dbl double precision,
    label text,
    code character varying(20),
    flag boolean,
    at timestamp with time zone,
    local_at timestamp without time zone,
    day date,
    doc jsonb,
    ident uuid,
    tags text[],
    scores integer[],
    blob bytea
)
"""
TYPES_ROWS = """
INSERT INTO public.everything VALUES
 (1, -32768, 9223372036854775807, 1234567890.12, 0.12345, 3.141592653589793238462643383279,
  1.0000000000000002, 'tab	and "quotes", back\\slash, é ✓', 'code-1', true,
  '2024-02-29 23:59:59.999999+00', '2024-01-01 00:00:00', '2024-12-31',
  '{"a": [1, 2, {"b": null}], "s": "x"}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
  ARRAY['a', 'b,c', NULL, 'd"e'], ARRAY[1, NULL, 3], '\\x00ff10'),
 (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL),
 (3, 0, -1, -0.01, 0, 'NaN', '-Infinity', '', 'multi
line', false, '1970-01-01 00:00:00+00', '0001-01-01 00:00:00', '2000-02-29',
  '[]', '00000000-0000-0000-0000-000000000000', '{}', '{}', '\\x')
"""


def _columns(db: ScratchDB, table: str) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in db.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
    ]


# --- round trip ---------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize("rows_only", [False, True], ids=["copy-fast-path", "decoded-rows"])
def test_roundtrip__every_supported_type_identical_after_create(
    src_db: ScratchDB, dst_db: ScratchDB, rows_only: bool
) -> None:
    src_db.execute(TYPES_TABLE)
    src_db.execute(TYPES_ROWS)
    result = run_transfer(
        PG,
        src_db.config,
        {"table": "public.everything"},
        PG,
        dst_db.config,
        {"table": "copy", "mode": "replace", "create": True},
        rows_only=rows_only,
    )
    assert result.rows_written == 3
    assert _columns(dst_db, "public.copy") == _columns(src_db, "public.everything")
    # As Python values (row 3 holds NaN, which never equals itself) ...
    query = "SELECT * FROM {} WHERE id < 3 ORDER BY id"
    assert dst_db.execute(query.format("copy")) == src_db.execute(query.format("everything"))
    # ... and as text: NaN, -Infinity, numeric scale and every other value exactly.
    text = "SELECT t::text FROM {} t ORDER BY id"
    assert dst_db.execute(text.format("copy")) == src_db.execute(text.format("everything"))


@pytest.mark.django_db
def test_query_source__reports_exact_types_and_reads_one_snapshot(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, amount numeric(10,3), name varchar(5))")
    src_db.execute("INSERT INTO t SELECT i, i / 7.0, 'n' || i FROM generate_series(1, 10) i")
    spec = {"query": "SELECT id, amount, name, amount * 2 AS doubled FROM t WHERE id > 3;"}
    with PG.open_reader(src_db.config, spec, Ctx()) as reader:
        assert [(c.name, c.type) for c in reader.columns] == [
            ("id", "integer"),
            ("amount", "numeric(10,3)"),
            ("name", "character varying(5)"),
            ("doubled", "numeric"),
        ]
        # Rows inserted after the reader opened are not in its snapshot.
        src_db.execute("INSERT INTO t VALUES (100, 1, 'late')")
        rows = [row for batch in reader.batches() for row in batch]
    assert sorted(r[0] for r in rows) == list(range(4, 11))


@pytest.mark.django_db
def test_append__into_existing_table_with_compatible_types_uses_text(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, amount numeric(10,2))")
    src_db.execute("INSERT INTO t SELECT i, i * 1.5 FROM generate_series(1, 2500) i")
    dst_db.execute("CREATE SCHEMA s")
    dst_db.execute("CREATE TABLE s.t (extra text DEFAULT 'x', amount numeric, id bigint)")
    for _ in range(2):
        ctx = Ctx()
        result = run_transfer(
            PG,
            src_db.config,
            {"table": "t"},
            PG,
            dst_db.config,
            {"table": "s.t", "mode": "append"},
            ctx,
        )
        assert result.rows_written == 2500
        assert ctx.rows_read == 2500
    assert dst_db.execute("SELECT count(*), sum(id), min(extra) FROM s.t") == [
        (5000, 2 * 2500 * 2501 // 2, "x")
    ]
    # The fence lives in the sink table's schema.
    assert dst_db.execute(
        "SELECT count(*) FROM s.dispatch_fence WHERE committed_at IS NOT NULL"
    ) == [(2,)]


# --- replace ------------------------------------------------------------------------------
class Poller(threading.Thread):
    """A second connection reading the sink table over and over during a replace."""

    def __init__(self, db: ScratchDB) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.seen: list[tuple[Any, ...]] = []
        self.done = threading.Event()

    def wait_for_reads(self, message: str) -> None:
        seen = len(self.seen)
        wait_until(lambda: len(self.seen) > seen + 5, message=message)

    def run(self) -> None:
        with connect(self.db.name) as conn:
            while not self.done.is_set():
                self.seen.append(
                    conn.execute(
                        "SELECT count(*), min(customer), max(customer) FROM orders"
                    ).fetchone()  # type: ignore[arg-type]
                )


@pytest.mark.django_db
def test_replace__concurrent_reader_sees_old_or_new_never_empty_or_partial(
    dst_db: ScratchDB,
) -> None:
    dst_db.execute(
        "CREATE TABLE orders (id bigint, customer text, amount numeric(12,2), created_at timestamptz)"
    )
    dst_db.execute("INSERT INTO orders SELECT i, 'old', 1, now() FROM generate_series(1, 500) i")
    old = (500, "old", "old")
    # A REPEATABLE READ reader whose snapshot predates the replace's commit.
    rr = connect(dst_db.name, autocommit=False)
    rr.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    assert rr.execute("SELECT 1").fetchone() == (1,)
    poller = Poller(dst_db)
    poller.start()
    ctx = Ctx()
    spec = {"rows": 20_000, "batch": 1000, "seed": 3}
    with (
        GenerateConnector.open_reader({}, spec, ctx) as reader,
        PG.open_writer(
            dst_db.config, {"table": "orders", "mode": "replace"}, ctx, reader.columns
        ) as writer,
    ):
        for i, batch in enumerate(reader.batches()):
            writer.write(batch)
            if i == 10:  # half-loaded: the poller must read several times right now
                poller.wait_for_reads("reads during the load")
        poller.wait_for_reads("reads before commit")
        writer.commit()
    poller.wait_for_reads("reads after commit")
    poller.done.set()
    poller.join(10)
    new_state = dst_db.execute("SELECT count(*), min(customer), max(customer) FROM orders")[0]
    assert new_state[0] == 20_000 and new_state[1].startswith("customer-")
    assert set(poller.seen) == {old, new_state}
    assert poller.seen.index(new_state) > 0  # the old contents were seen first
    # The REPEATABLE READ snapshot still sees the old contents, not an empty table.
    assert rr.execute("SELECT count(*), min(customer) FROM orders").fetchone() == (500, "old")
    rr.close()


@pytest.mark.django_db
def test_replace__failure_mid_copy_leaves_old_contents(dst_db: ScratchDB) -> None:
    dst_db.execute(
        "CREATE TABLE orders (id bigint, customer text, amount numeric(12,2) CHECK (amount < 5000), created_at timestamptz)"
    )
    dst_db.execute("INSERT INTO orders SELECT i, 'old', 1, now() FROM generate_series(1, 50) i")
    with pytest.raises(TransientError, match="fail_after"):
        run_transfer(
            GenerateConnector,
            {},
            {"rows": 5000, "batch": 500, "fail_after": 3000},
            PG,
            dst_db.config,
            {"table": "orders", "mode": "replace"},
        )
    assert dst_db.execute("SELECT count(*), max(customer) FROM orders") == [(50, "old")]
    # A source row that violates a sink constraint: permanent, and nothing changed.
    with pytest.raises(PermanentError, match="orders_amount_check"):
        run_transfer(
            GenerateConnector,
            {},
            {"rows": 5000, "batch": 500},
            PG,
            dst_db.config,
            {"table": "orders", "mode": "replace"},
        )
    assert dst_db.execute("SELECT count(*), max(customer) FROM orders") == [(50, "old")]
    assert dst_db.execute("SELECT count(*) FROM dispatch_fence WHERE committed_at IS NOT NULL") == [
        (0,)
    ]


# --- upsert -------------------------------------------------------------------------------
@pytest.mark.django_db
def test_upsert__updates_existing_keys_inserts_new_and_is_idempotent(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, name text, n numeric(6,1))")
    src_db.execute("INSERT INTO t SELECT i, 'new-' || i, i FROM generate_series(5, 15) i")
    dst_db.execute("CREATE TABLE t (id int PRIMARY KEY, name text, n numeric(6,1), note text)")
    dst_db.execute("INSERT INTO t SELECT i, 'old-' || i, 0, 'kept' FROM generate_series(1, 10) i")
    spec = {"table": "t", "mode": "upsert", "key": ["id"]}
    ctx = Ctx()
    result = run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec, ctx)
    assert result.rows_written == 11 and not result.already_committed
    expected = [(i, f"old-{i}", 0, "kept") for i in range(1, 5)]
    expected += [(i, f"new-{i}", i, "kept" if i <= 10 else None) for i in range(5, 16)]
    rows = dst_db.execute("SELECT id, name, n::int, note FROM t ORDER BY id")
    assert rows == expected
    # The same attempt again: its fence is committed, nothing is written twice.
    again = run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec, ctx)
    assert again.already_committed and again.rows_written == 0
    # Another run with the same data: the upsert itself is idempotent.
    run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)
    assert dst_db.execute("SELECT id, name, n::int, note FROM t ORDER BY id") == expected


@pytest.mark.django_db
def test_upsert__create_makes_primary_key_and_duplicate_keys_fail_permanently(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, name text)")
    src_db.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
    spec = {"table": "t", "mode": "upsert", "key": ["id"], "create": True}
    run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)
    assert dst_db.execute(
        "SELECT count(*) FROM pg_constraint WHERE conrelid = 't'::regclass AND contype = 'p'"
    ) == [(1,)]
    src_db.execute("INSERT INTO t VALUES (1, 'again')")
    with pytest.raises(PermanentError, match="same key"):
        run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)


# --- validation and errors ----------------------------------------------------------------
def test_parse_table__accepts_name_or_schema_name_only() -> None:
    assert parse_table("orders") == (None, "orders")
    assert parse_table("Sales.Order Lines") == ("Sales", "Order Lines")
    for bad in ["a.b.c", ".x", "x.", "", '"x"', 3]:
        with pytest.raises(ValidationError, match="table"):
            parse_table(bad)


def test_validate__names_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        PG.validate_config({"host": "h", "port": 99999, "dbname": "d", "sslmode": "maybe"})
    assert set(exc.value.message_dict) == {"port", "sslmode"}
    with pytest.raises(ValidationError) as exc:
        PG.validate_config({"url": "mysql://u:p@h/d"})
    assert set(exc.value.message_dict) == {"url"}
    with pytest.raises(ValidationError) as exc:
        PG.validate_config({"dbname": "d"})
    assert set(exc.value.message_dict) == {"host"}
    PG.validate_config({"url": "postgresql://u:p@h:5432/d"})
    for spec, field in [
        ({"table": "t", "query": "select 1"}, "exactly one"),
        ({"query": "select 1; drop table t"}, "query"),
        ({"table": "t", "statement_timeout_seconds": 0}, "statement_timeout_seconds"),
        ({"table": "t", "colour": 1}, "colour"),
    ]:
        with pytest.raises(ValidationError, match=field):
            PG.validate_source_spec(spec)
    for spec, field in [
        ({"mode": "append"}, "table"),
        ({"table": "t", "mode": "merge"}, "mode"),
        ({"table": "t", "mode": "upsert"}, "key"),
        ({"table": "t", "mode": "append", "key": ["id"]}, "key"),
        ({"table": "t", "create": "yes"}, "create"),
    ]:
        with pytest.raises(ValidationError, match=field):
            PG.validate_sink_spec(spec)


@pytest.mark.django_db
def test_errors__classified_and_free_of_secrets(src_db: ScratchDB, dst_db: ScratchDB) -> None:
    secret = "pw-Zq81-never-shown"
    src_db.execute("CREATE TABLE t (id int)")
    config = {**src_db.config, "password": secret}
    permanent = [
        ({"table": "missing"}, config, "missing"),
        ({"query": "SELECT nope FROM t"}, config, "nope"),
        ({"query": "SELEC 1"}, config, "syntax"),
        # The transaction is READ ONLY: a query that writes is refused for good.
        ({"query": "SELECT nextval('s')"}, config, "s"),
        ({"table": "t"}, {**config, "dbname": "dispatch_conn_no_such_db"}, "does not exist"),
        (
            {"table": "t"},
            {"url": f"postgresql://nobody:{secret}@127.0.0.1:{config['port']}/x"},
            "does not exist",
        ),
    ]
    src_db.execute("CREATE SEQUENCE s")
    for spec, cfg, fragment in permanent:
        with pytest.raises(PermanentError, match=fragment) as exc:
            run_transfer(PG, cfg, spec, PG, dst_db.config, {"table": "x", "create": True})
        assert secret not in str(exc.value)
    with pytest.raises(TransientError) as transient:
        PG.test_connection({"host": "127.0.0.1", "port": 1, "dbname": "x", "password": secret})
    assert secret not in str(transient.value)
    PG.test_connection(src_db.config)
    with pytest.raises(PermanentError, match="does not exist"):
        run_transfer(GenerateConnector, {}, {"rows": 1}, PG, dst_db.config, {"table": "absent"})


@pytest.mark.django_db
def test_sink__lock_timeout_is_transient(dst_db: ScratchDB) -> None:
    dst_db.execute(
        "CREATE TABLE orders (id bigint, customer text, amount numeric, created_at timestamptz)"
    )
    holder = connect(dst_db.name, autocommit=False)
    holder.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
    try:
        with pytest.raises(TransientError, match="55P03"):
            run_transfer(
                GenerateConnector,
                {},
                {"rows": 1},
                PG,
                dst_db.config,
                {"table": "orders", "mode": "replace", "lock_timeout_seconds": 1},
            )
    finally:
        holder.close()


# --- through runworker --------------------------------------------------------------------
def _datasource(name: str, kind: str, config: dict[str, Any]) -> Datasource:
    ds = Datasource(name=name, kind=kind, config=config)
    ds.full_clean()
    ds.save()
    return ds


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_runworker__pg_to_pg_and_csv_to_pg_succeed(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes, tmp_path: Path
) -> None:
    src_db.execute(
        "CREATE TABLE orders AS SELECT i::bigint AS id, 'c' || i AS customer,"
        " (i / 100.0)::numeric(12,2) AS amount FROM generate_series(1, 30000) i"
    )
    (tmp_path / "in.csv").write_text('id,name\n1,"a, b"\n2,"line\nbreak"\n3,é\n', encoding="utf-8")
    pg_src = _datasource("src", "postgresql", src_db.config)
    pg_dst = _datasource("dst", "postgresql", dst_db.config)
    files = _datasource("files", "csv", {"base_dir": str(tmp_path)})
    pg_job = factories.JobFactory(
        source_spec={"table": "public.orders"},
        sink_spec={"table": "public.orders_copy", "mode": "replace", "create": True},
    )
    csv_job = factories.JobFactory(
        source_spec={"path": "in.csv"},
        sink_spec={"table": "people", "mode": "append", "create": True},
    )
    b1 = factories.BindingFactory(job=pg_job, source=pg_src, sink=pg_dst)
    b2 = factories.BindingFactory(job=csv_job, source=files, sink=pg_dst)
    b1.full_clean()
    b2.full_clean()
    runs = [factories.trigger(b1), factories.trigger(b2)]
    worker = processes.worker("--burst", "--concurrency", "2")
    assert worker.wait(60) == 0, processes.output(worker)
    for run in runs:
        run.refresh_from_db()
        assert run.status == Status.SUCCEEDED, processes.output(worker)
    assert dst_db.execute(
        "SELECT count(*), sum(id), sum(amount) FROM orders_copy"
    ) == src_db.execute("SELECT count(*), sum(id), sum(amount) FROM orders")
    assert dst_db.execute("SELECT id, name FROM people ORDER BY id") == [
        ("1", "a, b"),
        ("2", "line\nbreak"),
        ("3", "é"),
    ]
    attempt = Attempt.objects.get(run=runs[0])
    assert attempt.rows_written == 30000


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_runworker__permanent_sink_error_fails_once_without_secret(
    src_db: ScratchDB, processes: Processes
) -> None:
    # The server trusts 127.0.0.1, so a wrong password would be accepted; a missing
    # database is the permanent error here, and the password is still in the config so
    # the test can show it never reaches the stored error.
    secret = "Sink-Pw-4711-secret"
    src_db.execute("CREATE TABLE t AS SELECT 1 AS id")
    sink_cfg = {**src_db.config, "dbname": "dispatch_conn_missing", "password": secret}
    job = factories.JobFactory(
        source_spec={"table": "t"}, sink_spec={"table": "t", "create": True}, max_attempts=3
    )
    binding = factories.BindingFactory(
        job=job,
        source=_datasource("src", "postgresql", src_db.config),
        sink=_datasource("sink", "postgresql", sink_cfg),
    )
    run = factories.trigger(binding)
    worker = processes.worker("--burst")
    assert worker.wait(60) == 0, processes.output(worker)
    attempts = list(Attempt.objects.filter(run=run))
    assert len(attempts) == 1
    assert attempts[0].status == Status.FAILED
    assert attempts[0].reason == Reason.PERMANENT_ERROR
    assert "dispatch_conn_missing" in attempts[0].error
    assert secret not in attempts[0].error
    assert secret not in processes.output(worker)


@pytest.mark.django_db
def test_csv_untyped_columns_become_text(dst_db: ScratchDB, tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("x,y\n1,\n", encoding="utf-8")
    run_transfer(
        CSVConnector,
        {"base_dir": str(tmp_path)},
        {"path": "a.csv", "null": ""},
        PG,
        dst_db.config,
        {"table": "a", "create": True},
    )
    assert _columns(dst_db, "a") == [("x", "text"), ("y", "text")]
    assert dst_db.execute("SELECT x, y FROM a") == [("1", None)]


# --- first use of a fresh sink ------------------------------------------------------------
@pytest.mark.django_db
def test_first_use__two_first_runs_racing_into_a_fresh_sink_both_succeed(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    src_db.execute("CREATE TABLE t (id int, name text)")
    src_db.execute("INSERT INTO t SELECT i, 'n' || i FROM generate_series(1, 20) i")
    rounds = 6
    for r in range(rounds):
        dst_db.execute(f"CREATE SCHEMA s{r}")
    errors: list[BaseException] = []

    def first_run(schema: str, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=30)
            spec = {"table": f"{schema}.t", "mode": "append", "create": True}
            run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for r in range(rounds):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=first_run, args=(f"s{r}", barrier)) for _ in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert errors == []
    for r in range(rounds):
        assert dst_db.execute(f"SELECT count(*) FROM s{r}.t") == [(40,)]
        assert dst_db.execute(
            f"SELECT count(*) FROM s{r}.dispatch_fence WHERE committed_at IS NOT NULL"
        ) == [(2,)]


@pytest.mark.django_db
def test_first_use__fence_creation_waits_for_a_concurrent_creator(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """A rival inside its first use (lock taken, table created, not committed): the
    writer waits on the set-up lock instead of racing the catalog, then uses the rival's
    table once it commits."""
    src_db.execute("CREATE TABLE t (id int)")
    src_db.execute("INSERT INTO t VALUES (1)")
    done: list[Any] = []
    with connect(dst_db.name) as rival:
        rival.autocommit = False
        rival.execute(
            "SELECT pg_advisory_xact_lock(hashtext('dispatch_fence'), hashtext('public'))"
        )
        rival.execute(
            "CREATE TABLE public.dispatch_fence (run_id uuid PRIMARY KEY, binding_id uuid,"
            " token bigint NOT NULL, attempt_id uuid, committed_at timestamptz)"
        )

        def first_run() -> None:
            try:
                spec = {"table": "t", "create": True}
                done.append(
                    run_transfer(PG, src_db.config, {"table": "t"}, PG, dst_db.config, spec)
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                done.append(exc)

        thread = threading.Thread(target=first_run)
        thread.start()
        wait_until(
            lambda: dst_db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
            )[0][0],
            message="the writer waits on the set-up lock",
        )
        rival.commit()
        thread.join(timeout=60)
    assert len(done) == 1 and not isinstance(done[0], BaseException), done
    assert dst_db.execute("SELECT count(*) FROM t") == [(1,)]


# --- a hostile source ---------------------------------------------------------------------
@pytest.mark.django_db
def test_hostile_source__shadowed_format_type_cannot_make_the_sink_run_its_sql(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """The source defines public.format_type and puts public ahead of pg_catalog: what it
    returns would be raw SQL in the sink's CREATE TABLE. The sink must run none of it."""
    src_db.execute("CREATE TABLE t (id int, name text)")
    src_db.execute("INSERT INTO t VALUES (1, 'a')")
    src_db.execute(
        "CREATE FUNCTION public.format_type(oid, integer) RETURNS text LANGUAGE sql AS"
        " $$SELECT 'integer); CREATE TABLE public.pwned (x int); CREATE TABLE public.z (y int'$$"
    )
    src_db.execute(f'ALTER DATABASE "{src_db.name}" SET search_path = public, pg_catalog')
    run_transfer(
        PG, src_db.config, {"table": "t"}, PG, dst_db.config, {"table": "t", "create": True}
    )
    assert _columns(dst_db, "t") == [("id", "integer"), ("name", "text")]
    assert dst_db.execute("SELECT to_regclass('public.pwned'), to_regclass('public.z')") == [
        (None, None)
    ]
    # The session's search_path never puts a schema ahead of pg_catalog.
    with PG.open_reader(src_db.config, {"table": "t"}, Ctx()) as reader:
        conn = reader.conn
        assert conn.execute("SHOW search_path").fetchone()[0] == '"public", pg_temp'
        assert conn.execute("SELECT format_type(23, -1)").fetchone()[0] == "integer"


@pytest.mark.django_db
def test_hostile_source__type_names_checked_against_the_sink(dst_db: ScratchDB) -> None:
    from dispatch.connectors import sqlsafety

    with connect(dst_db.name) as conn:
        assert sqlsafety.check_type_name(conn, "a", "numeric(12,2)[]") == "numeric(12,2)[]"
        assert sqlsafety.check_type_name(conn, "a", 'pg_catalog."varchar"(20)')
        for bad in (
            "integer); DROP TABLE x; --",
            "integer -- comment",
            "integer /* c */",
            "text DEFAULT 'x'",
            "",
        ):
            with pytest.raises(PermanentError, match="column a"):
                sqlsafety.check_type_name(conn, "a", bad)
        with pytest.raises(PermanentError, match="column a: type 'no_such_type' is not a type"):
            sqlsafety.check_type_name(conn, "a", "no_such_type")
        # Well-formed but more than one type name: regtype takes exactly one.
        with pytest.raises(PermanentError, match="column a"):
            sqlsafety.check_type_name(conn, "a", "integer, b text")
    assert sqlsafety.split_search_path('"$user", public, "We, ""x""" ') == [
        '"$user"',
        "public",
        'We, "x"',
    ]
