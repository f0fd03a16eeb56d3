"""The `mysql` connector through real worker processes: the stale-worker fence on a MySQL
sink (a worker stopped past its lease just before its commit while its successor commits:
its commit is refused by the fence inside the MariaDB transaction), and incremental reads
exactly once when a worker is killed (a MySQL source into PostgreSQL, and PostgreSQL into
a MySQL sink)."""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Run, Worker
from tests.support import factories
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.gates import (
    Holders,
    crash_binding,
    gate_table,
    kill,
    kill_while_held,
    succeed,
    succeeded,
)
from tests.support.mariadb import MyDB
from tests.support.mysql_pausing import PAUSE_VARIABLE, PAUSED
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def pg() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_mysqlw_pg")


def _fence(my: MyDB, run: Run) -> tuple[Any, ...] | None:
    rows = my.execute(
        "SELECT token, attempt_id, committed_at IS NOT NULL FROM dispatch_fence WHERE run_id = %s",
        [str(run.id)],
    )
    return rows[0] if rows else None


def test_fence__a_stale_commit_after_sigstop_past_its_lease_is_refused_by_the_sink_fence(
    mydb: MyDB, processes: Processes, settings: Any
) -> None:
    settings.DISPATCH_CONNECTORS = [PAUSING]
    env = {"DISPATCH_CONNECTORS": PAUSING}
    # One row before the run: no load of the run is into an empty table (MariaDB's bulk
    # insert into an empty table locks it for the whole transaction).
    mydb.execute("CREATE TABLE orders (id BIGINT, customer TEXT, amount DECIMAL(12,2),"
                 " created_at DATETIME(6)) ENGINE=InnoDB")  # fmt: skip
    mydb.execute("INSERT INTO orders (id) VALUES (0)")
    binding = crash_binding(
        ("generate", {}),
        ("test_mysql_pausing", mydb.config),
        {"rows": 2000, "batch": 500, "seed": 3},
        {"table": "orders", "mode": "append"},
        job={"max_attempts": 3},
    )
    run = factories.trigger(binding)
    # The stale worker copies every row, passes its last lease check, and stops itself
    # just before the sink's fenced commit (tests/support/mysql_pausing.py).
    stale = processes.worker("--worker-id", "stale", env=worker_env(**env, **{PAUSE_VARIABLE: "1"}))
    wait_until(lambda: _stopped(processes, stale), timeout=60, message="the stale worker stops")
    _end_stopped_transactions()
    first = Attempt.objects.get(run=run, number=1)
    assert first.worker_id == "stale" and first.status == Status.RUNNING
    # Its rows in its open transaction, the fence row untouched by it since the raise.
    assert _uncommitted(mydb) == [(2000,)]
    assert _fence(mydb, run) == (first.lease_token, None, 0)
    try:
        successor = processes.worker("--worker-id", "successor", env=worker_env(**env))
        succeeded(run, message="the successor commits the run")
        winner = Attempt.objects.get(run=run, status=Status.SUCCEEDED)
        assert winner.number == 2 and winner.worker_id == "successor"
        assert _fence(mydb, run) == (winner.lease_token, str(winner.pk), 1)
        assert _stopped(processes, stale)  # still stopped at its commit
    finally:
        stale.send_signal(signal.SIGCONT)
    # The stale worker wakes and sends its fenced UPDATE: the fence row is at the
    # successor's token, committed, so no row matches; the transaction rolls back.
    wait_until(
        lambda: "stale commit refused by the sink fence" in processes.output(stale),
        timeout=60,
        message="the stale commit refused",
    )
    assert f"no longer at token {first.lease_token}" in processes.output(stale)
    wait_until(lambda: not _uncommitted(mydb), timeout=30, message="the stale rows rolled back")
    assert mydb.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM orders") == [(2001, 2001)]
    assert _fence(mydb, run) == (winner.lease_token, str(winner.pk), 1)
    first.refresh_from_db()
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED)
    assert Attempt.objects.filter(run=run).count() == 2
    # The stale worker counts the refusal (its next heartbeat records its counters).
    wait_until(
        lambda: Worker.objects.filter(pk="stale", stats__fenced_commits=1).exists(),
        timeout=30,
        message="the refusal counted",
    )
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0


PAUSING = "tests.support.mysql_pausing.PausingMySQLSink"


def _stopped(processes: Processes, proc: Any) -> bool:
    """The process printed that it pauses, and every thread of it is stopped (state T)."""
    if PAUSED not in processes.output(proc):
        return False
    for stat in Path(f"/proc/{proc.pid}/task").glob("*/stat"):
        text = stat.read_text()
        if text[text.rindex(")") + 2] != "T":
            return False
    return True


def _end_stopped_transactions() -> None:
    """A transaction the stopped worker has open in the coordination database (its
    heartbeat thread stopped between the statements of one) holds its attempt's row until
    the worker wakes, and recovery skips a locked attempt: the server ends it, as its
    idle_in_transaction_session_timeout would."""
    others = (
        "SELECT pid, state FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    )
    with connection.cursor() as cursor:

        def settled() -> bool:  # nothing of the stopped worker still running
            cursor.execute(others)
            return not any(state == "active" for _, state in cursor.fetchall())

        wait_until(settled, message="the stopped worker's statements done")
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND state IN ('idle in transaction', 'idle in transaction (aborted)')"
        )


def _uncommitted(my: MyDB) -> list[tuple[Any, ...]]:
    return my.execute(
        "SELECT trx_rows_modified FROM information_schema.INNODB_TRX WHERE trx_rows_modified > 0"
    )


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
    holders: Holders,
) -> None:
    mydb.execute("CREATE TABLE items (id BIGINT PRIMARY KEY, updated_at DATETIME(6) NOT NULL,"
                 " gate VARCHAR(1), KEY (updated_at, id))")  # fmt: skip
    _mysql_items(mydb, 1, ROWS)
    gate_table(pg)
    pg.execute("CREATE TABLE copy (id numeric, updated_at timestamp, gate text REFERENCES gate)")
    binding = crash_binding(
        ("mysql", mydb.config),
        ("postgresql", pg.config),
        {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}},
        {"table": "copy", "mode": "append"},
    )
    gate = holders.gate(pg)
    run = factories.trigger(binding)
    doomed = processes.worker("--worker-id", "doomed")
    kill_while_held(pg, gate, doomed)
    assert pg.execute("SELECT count(*) FROM copy") == [(0,)]  # nothing committed
    successor = succeed(processes, run, "successor")
    _check_once(mydb, pg, binding)
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert attempts[0].reason == Reason.LEASE_EXPIRED and attempts[-1].cursor_from is None
    # The next run reads only the new rows, each once.
    _mysql_items(mydb, ROWS + 1, ROWS + 300)
    nxt = factories.trigger(binding)
    succeeded(nxt, message="the next run")
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
    binding = crash_binding(
        ("postgresql", pg.config),
        ("mysql", mydb.config),
        {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}},
        {"table": "copy", "mode": "append", "lock_timeout_seconds": 600},
    )
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
        kill(doomed)
        for (thread,) in mydb.execute(waiting):
            mydb.execute(f"KILL {int(thread)}")
    finally:
        gate.rollback()
        gate.close()
    assert mydb.execute("SELECT COUNT(*) FROM copy") == [(0,)]  # nothing committed
    successor = succeed(processes, run, "successor")
    assert mydb.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM copy") == [(ROWS, ROWS)]
    [(cursor,)] = mydb.execute(
        "SELECT cursor_value FROM dispatch_cursor WHERE binding_id = %s", [str(binding.pk)]
    )
    assert cursor == f'["2024-01-01 16:40:00", "{ROWS}"]'
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert attempts[0].reason == Reason.LEASE_EXPIRED and attempts[-1].status == Status.SUCCEEDED
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0
