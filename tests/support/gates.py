"""Killing or stopping a worker process at a chosen point of its work, and waiting for its
successor: the scaffolding of the tests that crash a worker mid-copy.

A session of the test holds a lock the worker's session will need: the sink's `gate` row
that the copied rows reference (the COPY waits at the first row that needs it), a cursor
or fence row (the sink commit waits), or the run row (the settlement waits). The test waits
until the worker's session waits on that lock, then kills (SIGKILL) or stops (SIGSTOP) the
worker there. A killed client's statement would still run once the lock is free (the
server reads it from the socket before it notices the client is gone), so the killed
worker's waiting session is ended too: nothing of it can commit, as when the worker dies a
moment earlier. The `holders` fixture (tests/conftest.py) closes every session whatever the
test's outcome: an open one would stop the teardown's TRUNCATE or DROP DATABASE."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import psycopg

from dispatch.core.states import Status
from dispatch.models import JobBinding, Run
from tests.support import factories
from tests.support.connectors import ScratchDB, connect
from tests.support.processes import Processes, test_database_url, wait_until

Session = psycopg.Connection[Any]
Proc = subprocess.Popen[bytes]


def crash_binding(
    source: tuple[str, dict[str, Any]],
    sink: tuple[str, dict[str, Any]],
    source_spec: dict[str, Any],
    sink_spec: dict[str, Any],
    *,
    job: dict[str, Any] | None = None,
    **binding: Any,
) -> JobBinding:
    """A binding from a new source to a new sink, each given as (kind, config), whose
    job's lease is 2 s and whose retries start at once (up to 5 attempts): a dead
    worker's attempt expires, and its successor claims the retry, within seconds. `job`
    and `binding` set other fields of the job and the binding."""
    return factories.BindingFactory.create(
        job=factories.JobFactory.create(
            source_spec=source_spec,
            sink_spec=sink_spec,
            **{"lease_seconds": 2, "max_attempts": 5, "backoff_seconds": 0, **(job or {})},
        ),
        source=factories.DatasourceFactory.create(kind=source[0], config=source[1]),
        sink=factories.DatasourceFactory.create(kind=sink[0], config=sink[1]),
        **binding,
    )


def gate_table(db: ScratchDB) -> None:
    """The sink's `gate` table, rows 'a' and 'b': its copied rows reference one."""
    db.execute("CREATE TABLE gate (name text PRIMARY KEY)")
    db.execute("INSERT INTO gate VALUES ('a'), ('b')")


class Holders:
    """Sessions of the test, each in a transaction, that hold the locks a worker waits on."""

    def __init__(self) -> None:
        self.opened: list[Session] = []

    def session(self, db: ScratchDB | None = None) -> Session:
        """A session in the scratch database `db`, or else in the coordination database."""
        conn = connect(db.name, autocommit=False) if db else psycopg.connect(test_database_url())
        self.opened.append(conn)
        return conn

    def gate(self, db: ScratchDB, name: str = "b") -> Session:
        """A session holding the sink's gate row `name`: a COPY of rows that reference it
        waits at the first of them (the foreign-key check)."""
        conn = self.session(db)
        conn.execute("SELECT 1 FROM gate WHERE name = %s FOR UPDATE", [name])
        return conn

    def run_row(self, run: Run) -> Session:
        """A session holding the run's row: the settlement (which locks the run first)
        waits, so the window between the sink commit and the outcome stays open."""
        conn = self.session()
        conn.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [run.id])
        return conn

    def close_all(self) -> None:
        for conn in self.opened:
            conn.close()


def waiting_on(db: ScratchDB, holder: Session) -> list[int]:
    """The backends (of any database) that wait on a lock `holder` holds."""
    return [
        r[0]
        for r in db.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            [holder.info.backend_pid],
        )
    ]


def kill(proc: Proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def kill_while_held(
    db: ScratchDB,
    holder: Session,
    worker: Proc,
    *,
    timeout: float = 60,
    message: str = "the sink session waits",
) -> None:
    """Kill `worker` while its session in `db` waits on `holder`, end that session, and
    let go of the lock (the holder ends)."""
    wait_until(lambda: waiting_on(db, holder), timeout=timeout, message=message)
    kill(worker)
    for pid in waiting_on(db, holder):
        db.execute("SELECT pg_terminate_backend(%s)", [pid])
    holder.rollback()
    holder.close()


def kill_in_settlement(holder: Session, worker: Proc) -> None:
    """Kill `worker` while its settlement waits on `holder` (Holders.run_row), end its
    session, and let go of the run row: the outcome is never recorded."""
    blocked = (
        "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
        " AND query ILIKE '%%settle%%'"
    )
    with psycopg.connect(test_database_url(), autocommit=True) as admin:
        wait_until(
            lambda: admin.execute(blocked, [holder.info.backend_pid]).fetchall(),
            message="the settlement waiting on the run lock",
        )
        kill(worker)
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE %s = ANY(pg_blocking_pids(pid))",
            [holder.info.backend_pid],
        )
    holder.rollback()
    holder.close()


@contextlib.contextmanager
def stopped(proc: Proc) -> Iterator[None]:
    """`proc` stopped (SIGSTOP) for the block, continued (SIGCONT) after it, whatever
    the block's outcome."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def succeeded(run: Run, *, timeout: float = 60, message: str = "the run succeeds") -> None:
    wait_until(
        lambda: Run.objects.filter(pk=run.pk, status=Status.SUCCEEDED).exists(),
        timeout=timeout,
        message=message,
    )


def succeed(processes: Processes, run: Run, name: str) -> Proc:
    """Start the worker `name` (the dead one's successor) and wait until `run` succeeds."""
    worker = processes.worker("--worker-id", name)
    succeeded(run, message=f"{name} completes the run")
    return worker
