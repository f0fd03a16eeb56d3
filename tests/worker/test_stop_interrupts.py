"""A timeout or a cancel stops the statement a connector is blocked in (issue: a source
`SELECT pg_sleep(...)` used to hold its lease until the statement ended).

The worker is a real process; every wait is a deadline on a database state, and the
bounds are read from the database's own timestamps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from dispatch import services
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource, Run
from dispatch.worker.runner import ExecutionControl, StopCause
from tests.support import factories
from tests.support.connectors import ScratchDB, connect, scratch_db
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SLEEP = 60  # far longer than any bound below: ending early proves the interrupt
# How long after the stop the attempt must be settled: a cancel request reaches the
# server at once; the rest is a rollback and one settlement transaction.
WITHIN = 5.0


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_stop_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_stop_dst")


def binding_for(
    src: ScratchDB, dst: ScratchDB, *, source_spec: dict, sink_spec: dict | None = None, **job
):
    source = Datasource(name="src", kind="postgresql", config=src.config)
    source.save()
    sink = Datasource(name="dst", kind="postgresql", config=dst.config)
    sink.save()
    job.setdefault("max_attempts", 1)
    job_row = factories.JobFactory(
        source_spec=source_spec,
        sink_spec=sink_spec or {"table": "out", "mode": "append", "create": True},
        **job,
    )
    return factories.BindingFactory(job=job_row, source=source, sink=sink)


def sleeping(db: ScratchDB) -> int:
    """Backends of `db` running pg_sleep now."""
    with connect("postgres") as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND state = 'active'"
            " AND query ILIKE '%%pg_sleep%%' AND pid <> pg_backend_pid()",
            [db.name],
        ).fetchone()
    return int(row[0]) if row else 0


def settled(run: Run) -> Attempt:
    wait_until(
        lambda: (
            Attempt.objects.filter(run=run)
            .exclude(status=Status.RUNNING)
            .exclude(status=Status.PENDING)
            .exists()
        ),
        timeout=SLEEP / 2,
        message=f"run {run.id}'s attempt to settle",
    )
    return Attempt.objects.get(run=run)


def test_timeout__ends_a_blocked_source_copy_within_seconds(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes
) -> None:
    binding = binding_for(
        src_db,
        dst_db,
        source_spec={"query": f"SELECT 1 AS n FROM pg_sleep({SLEEP})"},
        timeout_seconds=2,
    )
    processes.worker()
    run = factories.trigger(binding)
    wait_until(
        lambda: sleeping(src_db) == 1 or Attempt.objects.filter(run=run, error__gt="").exists(),
        message="the source statement running",
    )
    attempt = settled(run)
    assert (attempt.status, attempt.reason) == (Status.FAILED, Reason.TIMEOUT), attempt.error
    assert attempt.claimed_at is not None and attempt.finished_at is not None
    took = (attempt.finished_at - attempt.claimed_at).total_seconds()
    assert 2 <= took < 2 + WITHIN, took
    assert sleeping(src_db) == 0


def test_cancel__ends_a_blocked_source_statement_within_seconds(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes
) -> None:
    # Not COPY this time: a sink that is not PostgreSQL makes the reader fetch batches.
    binding = binding_for(
        src_db,
        dst_db,
        source_spec={"query": f"SELECT 1 AS n FROM pg_sleep({SLEEP})"},
    )
    null_sink = Datasource(name="null", kind="null", config={})
    null_sink.save()
    binding.sink = null_sink
    binding.save()
    binding.job.sink_spec = {}
    binding.job.save()
    processes.worker()
    run = factories.trigger(binding)
    wait_until(lambda: sleeping(src_db) == 1, message="the source statement running")
    assert services.cancel_run(run) == services.Outcome.CANCEL_REQUESTED
    attempt = settled(run)
    assert (attempt.status, attempt.reason) == (Status.CANCELLED, Reason.CANCELLED_BY_OPERATOR)
    run.refresh_from_db()
    assert run.cancel_requested_at is not None and attempt.finished_at is not None
    assert (attempt.finished_at - run.cancel_requested_at).total_seconds() < WITHIN
    assert sleeping(src_db) == 0


def test_cancel__ends_a_sink_copy_waiting_on_a_lock_within_seconds(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes
) -> None:
    src_db.execute("CREATE TABLE items AS SELECT g AS id FROM generate_series(1, 100) g")
    dst_db.execute("CREATE TABLE out (id integer)")
    binding = binding_for(
        src_db,
        dst_db,
        source_spec={"table": "items"},
        sink_spec={"table": "out", "mode": "append", "lock_timeout_seconds": SLEEP},
    )
    # Another session holds the sink table: the sink's first statement on it waits.
    holder = connect(dst_db.name, autocommit=False)
    try:
        holder.execute("LOCK TABLE out IN ACCESS EXCLUSIVE MODE")
        processes.worker()
        run = factories.trigger(binding)
        wait_until(lambda: waiting_on_lock(dst_db) >= 1, message="the sink waiting on the lock")
        assert services.cancel_run(run) == services.Outcome.CANCEL_REQUESTED
        attempt = settled(run)
        assert (attempt.status, attempt.reason) == (
            Status.CANCELLED,
            Reason.CANCELLED_BY_OPERATOR,
        )
        run.refresh_from_db()
        assert run.cancel_requested_at is not None and attempt.finished_at is not None
        assert (attempt.finished_at - run.cancel_requested_at).total_seconds() < WITHIN
        assert waiting_on_lock(dst_db) == 0
    finally:
        holder.close()
    assert dst_db.execute("SELECT count(*) FROM out") == [(0,)]


def waiting_on_lock(db: ScratchDB) -> int:
    with connect("postgres") as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            [db.name],
        ).fetchone()
    return int(row[0]) if row else 0


# --- the interrupt plumbing, without a worker ---------------------------------------------
def control(timeout: int | None = None) -> ExecutionControl:
    return ExecutionControl(SimpleNamespace(lease_seconds=30, timeout_seconds=timeout))  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=False)
def test_control__interrupts_once_on_stop_at_once_if_already_stopped_and_not_after_unregister():
    c = control()
    calls: list[str] = []
    unregister = c.on_stop(lambda: calls.append("a"))
    c.stop(StopCause.CANCEL)
    # Interrupts run on a thread of their own (a cancel request may take seconds).
    wait_until(lambda: calls == ["a"], message="the interrupt")
    c.stop(StopCause.TIMEOUT)  # a second stop keeps the first cause and interrupts no more
    assert c.cause == StopCause.CANCEL
    c.on_stop(lambda: calls.append("late"))  # registered after the stop: called at once
    wait_until(lambda: calls == ["a", "late"], message="the late interrupt")
    unregister()
    wait_until(lambda: not c._interrupting, message="the first interrupt thread to end")
    c.interrupt()  # the coordinator's repeat reaches only what is still registered
    wait_until(lambda: calls == ["a", "late", "late"], message="the repeat")


@pytest.mark.django_db(transaction=False)
def test_control__a_failing_or_hanging_interrupt_keeps_neither_the_caller_nor_the_others():
    c = control()
    calls: list[str] = []
    release = threading.Event()

    def broken() -> None:
        raise RuntimeError("unreachable server")

    def hanging() -> None:
        release.wait(30)  # a cancel request to a host that does not answer
        calls.append("hung")

    c.on_stop(broken)
    c.on_stop(hanging)
    c.on_stop(lambda: calls.append("b"))
    c.stop(StopCause.RELEASED)  # returns at once, whatever the interrupts do
    assert calls == []
    c.interrupt()  # a repeat while the first is in flight is skipped
    release.set()
    wait_until(lambda: calls == ["hung", "b"], message="the interrupts")


@pytest.mark.django_db(transaction=False)
def test_control__a_passed_deadline_stops_with_timeout_and_interrupts():
    c = control(timeout=1)
    calls: list[str] = []
    c.on_stop(lambda: calls.append("x"))
    assert c.next_deadline() == c.deadline
    c.deadline = time.monotonic() - 0.001  # the deadline has passed
    assert c.should_stop() and c.cause is StopCause.TIMEOUT
    assert c.next_deadline() is None
    wait_until(lambda: calls == ["x"], message="the interrupt")
