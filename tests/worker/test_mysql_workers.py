"""The `mysql` connector through real worker processes: the stale-worker fence on a MySQL
sink (a worker stopped past its lease while its successor commits), and incremental reads
exactly once when a worker is killed (a MySQL source into PostgreSQL, and PostgreSQL into
a MySQL sink)."""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource, Run
from tests.connectors.test_incremental_crash import (
    _holder,
    _kill_while_held,
    _succeed,
    holders,  # noqa: F401 - fixture
)
from tests.support import factories
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.mariadb import MyDB
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def pg() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_mysqlw_pg")


def _fence(my: MyDB, run: Run) -> tuple[Any, ...] | None:
    if not my.execute("SHOW TABLES LIKE 'dispatch_fence'"):
        return None
    rows = my.execute(
        "SELECT token, attempt_id, committed_at IS NOT NULL FROM dispatch_fence WHERE run_id = %s",
        [str(run.id)],
    )
    return rows[0] if rows else None


def test_fence__a_worker_stopped_past_its_lease_cannot_commit_over_its_successor(
    mydb: MyDB, processes: Processes
) -> None:
    mydb.execute("CREATE TABLE orders (id BIGINT, customer TEXT, amount DECIMAL(12,2),"
                 " created_at DATETIME(6))")  # fmt: skip
    source = Datasource(name="gen", kind="generate", config={})
    source.save()
    sink = Datasource(name="my", kind="mysql", config=mydb.config)
    sink.save()
    job = factories.JobFactory(
        source_spec={"rows": 6000, "batch": 100, "delay_ms": 25, "seed": 3},
        sink_spec={"table": "orders", "mode": "append"},
        lease_seconds=2,
        max_attempts=3,
        backoff_seconds=0,
    )
    run = factories.trigger(factories.BindingFactory(job=job, source=source, sink=sink))
    stale = processes.worker("--worker-id", "stale")
    first = wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING).first(),
        message="attempt 1 running",
    )
    wait_until(lambda: _fence(mydb, run), message="attempt 1's fence raised in the sink")
    stale.send_signal(signal.SIGSTOP)
    try:
        successor = processes.worker("--worker-id", "successor")
        wait_until(
            lambda: Run.objects.filter(pk=run.pk, status=Status.SUCCEEDED).exists(),
            timeout=90,
            message="the successor commits the run",
        )
        winner = Attempt.objects.get(run=run, status=Status.SUCCEEDED)
        assert winner.pk != first.pk
    finally:
        stale.send_signal(signal.SIGCONT)
    # The stale worker wakes holding uncommitted rows: its commit is refused (the fence is
    # at the successor's token and committed), it records nothing.
    wait_until(
        lambda: (
            "refused" in processes.output(stale)
            or "stopped without recording" in processes.output(stale)
        ),
        timeout=60,
        message="the stale worker gives the attempt up",
    )
    wait_until(
        lambda: (
            not mydb.execute(
                "SELECT 1 FROM information_schema.INNODB_TRX WHERE trx_rows_modified > 0"
            )
        ),
        timeout=60,
        message="the stale transaction rolled back",
    )
    assert mydb.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM orders") == [(6000, 6000)]
    token, attempt_id, committed = _fence(mydb, run)  # type: ignore[misc]
    assert committed and attempt_id == str(winner.pk) and token > 1
    first.refresh_from_db()
    assert first.status == Status.RETRY_SCHEDULED and first.reason == Reason.LEASE_EXPIRED
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0


ROWS = 2000
GATED_FROM = 1500


def _mysql_items(my: MyDB, first: int, last: int) -> None:
    # Equal timestamps in pairs: the cursor's second column (id) keeps them apart.
    rows = [
        (i, dt.datetime(2024, 1, 1) + dt.timedelta(minutes=i // 2), "b" if i >= GATED_FROM else "a")
        for i in range(first, last + 1)
    ]
    conn = my.server.root(database=my.name)
    try:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO items VALUES (%s, %s, %s)", rows)
    finally:
        conn.close()


def test_incremental__mysql_source_killed_mid_copy_then_exactly_once(
    mydb: MyDB,
    pg: ScratchDB,
    processes: Processes,
    holders: list[psycopg.Connection[Any]],  # noqa: F811 - the fixture imported above
) -> None:
    mydb.execute("CREATE TABLE items (id BIGINT PRIMARY KEY, updated_at DATETIME(6) NOT NULL,"
                 " gate VARCHAR(1), KEY (updated_at, id))")  # fmt: skip
    _mysql_items(mydb, 1, ROWS)
    pg.execute("CREATE TABLE gate (name text PRIMARY KEY)")
    pg.execute("INSERT INTO gate VALUES ('a'), ('b')")
    pg.execute("CREATE TABLE copy (id numeric, updated_at timestamp, gate text REFERENCES gate)")
    source = Datasource(name="my-src", kind="mysql", config=mydb.config)
    source.save()
    sink = Datasource(name="pg-sink", kind="postgresql", config=pg.config)
    sink.save()
    job = factories.JobFactory(
        source_spec={"table": "items", "incremental": {"cursor": ["updated_at", "id"]}},
        sink_spec={"table": "copy", "mode": "append"},
        lease_seconds=2,
        max_attempts=5,
        backoff_seconds=0,
    )
    binding = factories.BindingFactory(job=job, source=source, sink=sink)
    gate = _holder(holders, pg)
    gate.execute("SELECT 1 FROM gate WHERE name = 'b' FOR UPDATE")
    run = factories.trigger(binding)
    doomed = processes.worker("--worker-id", "doomed")
    _kill_while_held(processes, pg, gate, doomed)
    assert pg.execute("SELECT count(*) FROM copy") == [(0,)]  # nothing committed
    successor = _succeed(processes, run, "successor")
    _check_once(mydb, pg, binding)
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert attempts[0].reason == Reason.LEASE_EXPIRED and attempts[-1].cursor_from is None
    # The next run reads only the new rows, each once.
    _mysql_items(mydb, ROWS + 1, ROWS + 300)
    nxt = factories.trigger(binding)
    wait_until(
        lambda: Run.objects.filter(pk=nxt.pk, status=Status.SUCCEEDED).exists(),
        timeout=60,
        message="the next run",
    )
    attempt = Attempt.objects.get(run=nxt)
    assert attempt.rows_written == 300 and attempt.cursor_to[1] == str(ROWS + 300)
    _check_once(mydb, pg, binding)
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0


def _check_once(my: MyDB, pg: ScratchDB, binding: Any) -> None:
    [(total,)] = my.execute("SELECT COUNT(*) FROM items")
    assert pg.execute("SELECT count(*), count(DISTINCT id) FROM copy") == [(total, total)]
    [(cursor,)] = pg.execute(
        "SELECT cursor FROM dispatch_cursor WHERE binding_id = %s", [binding.pk]
    )
    last = my.execute("SELECT CAST(updated_at AS CHAR), CAST(id AS CHAR) FROM items"
                      " ORDER BY updated_at DESC, id DESC LIMIT 1")  # fmt: skip
    assert [tuple(cursor)] == last


def test_incremental__postgresql_into_mysql_killed_mid_copy_then_exactly_once(
    mydb: MyDB,
    pg: ScratchDB,
    processes: Processes,
) -> None:
    pg.execute("CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamp NOT NULL,"
               " gate text)")  # fmt: skip
    pg.execute(
        "INSERT INTO items SELECT i, '2024-01-01'::timestamp + (i / 2) * interval '1 minute',"
        " CASE WHEN i >= %s THEN 'b' ELSE 'a' END FROM generate_series(1, %s) i",
        [GATED_FROM, ROWS],
    )
    mydb.execute("CREATE TABLE gate (name VARCHAR(1) PRIMARY KEY) ENGINE=InnoDB")
    mydb.execute("INSERT INTO gate VALUES ('a'), ('b')")
    mydb.execute("CREATE TABLE copy (id BIGINT, updated_at DATETIME(6), gate VARCHAR(1),"
                 " FOREIGN KEY (gate) REFERENCES gate (name)) ENGINE=InnoDB")  # fmt: skip
    source = Datasource(name="pg-src", kind="postgresql", config=pg.config)
    source.save()
    sink = Datasource(name="my-sink", kind="mysql", config=mydb.config)
    sink.save()
    job = factories.JobFactory(
        source_spec={"table": "items", "incremental": {"cursor": ["updated_at", "id"]}},
        sink_spec={"table": "copy", "mode": "append", "lock_timeout_seconds": 600},
        lease_seconds=2,
        max_attempts=5,
        backoff_seconds=0,
    )
    binding = factories.BindingFactory(job=job, source=source, sink=sink)
    # A session of our own holds the gate row 'b': the sink's INSERT of the first row that
    # references it waits (InnoDB's foreign-key check), in the middle of the copy.
    gate = mydb.server.root(database=mydb.name)
    try:
        with gate.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute("SELECT 1 FROM gate WHERE name = 'b' FOR UPDATE")
        run = factories.trigger(binding)
        doomed = processes.worker("--worker-id", "doomed")
        # The sink's load waits on the gate: a row lock wait, or (MariaDB's bulk load into
        # an empty table, which defers its rows and shows no lock wait) its LOAD DATA
        # statement still running; either way nothing of it can commit.
        waiting = (
            "SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX"
            " WHERE trx_state = 'LOCK WAIT'"
            " UNION SELECT id FROM information_schema.PROCESSLIST"
            " WHERE info LIKE 'LOAD DATA LOCAL INFILE%'"
        )
        wait_until(lambda: mydb.execute(waiting), timeout=60, message="the sink's load waits")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        for (thread,) in mydb.execute(waiting):
            mydb.execute(f"KILL {int(thread)}")
    finally:
        gate.rollback()
        gate.close()
    assert mydb.execute("SELECT COUNT(*) FROM copy") == [(0,)]  # nothing committed
    successor = _succeed(processes, run, "successor")
    assert mydb.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM copy") == [(ROWS, ROWS)]
    [(cursor,)] = mydb.execute(
        "SELECT cursor_value FROM dispatch_cursor WHERE binding_id = %s", [str(binding.pk)]
    )
    assert cursor == f'["2024-01-01 16:40:00", "{ROWS}"]'
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert attempts[0].reason == Reason.LEASE_EXPIRED and attempts[-1].status == Status.SUCCEEDED
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0
