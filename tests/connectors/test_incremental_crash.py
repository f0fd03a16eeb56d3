"""Incremental syncs across crashes and stops, through real worker processes: whatever
happens to a worker, the sink holds every source row once and the committed cursor is the
last committed row's (docs/connectors.md, "Incremental reads").

Each test holds a lock that stops the worker's sink session at a chosen point, then kills
or stops the worker there: in the middle of the COPY (a foreign key whose parent row is
locked), after the last row was read (the cursor row of the commit), and after the sink
commit (the run row, so the settlement waits)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, BindingCursor, Run
from tests.support import factories
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.gates import (
    Holders,
    Proc,
    Session,
    crash_binding,
    gate_table,
    kill_in_settlement,
    kill_while_held,
    stopped,
    succeed,
    succeeded,
    waiting_on,
)
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROWS = 2000
GATED_FROM = 1500  # rows from this id reference the gate row 'b'


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_inccrash_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_inccrash_dst")


def _setup(src: ScratchDB, dst: ScratchDB) -> Any:
    src.execute(
        "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz NOT NULL, gate text)"
    )
    _add_rows(src, 1, ROWS)
    # The sink's rows reference a gate row: a session holding 'b' FOR UPDATE stops the
    # COPY at the first row that needs it (the foreign-key check), in the middle.
    gate_table(dst)
    dst.execute("CREATE TABLE copy (id bigint, updated_at timestamptz, gate text REFERENCES gate)")
    return crash_binding(
        ("postgresql", src.config),
        ("postgresql", dst.config),
        {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}},
        {"table": "copy", "mode": "append"},
    )


def _add_rows(src: ScratchDB, first: int, last: int) -> None:
    # Equal timestamps in pairs: the cursor's second column (id) keeps them apart.
    src.execute(
        "INSERT INTO items SELECT i, '2024-01-01'::timestamptz + (i / 2) * interval '1 minute',"
        " CASE WHEN i >= %s::int THEN 'b' ELSE 'a' END FROM generate_series(%s::int, %s::int) i",
        [GATED_FROM, first, last],
    )


def _assert_exactly_once(src: ScratchDB, dst: ScratchDB, binding: Any) -> None:
    """Every source row once in the sink, and the sink's cursor at the last of them."""
    total = src.execute("SELECT count(*) FROM items")[0][0]
    assert dst.execute("SELECT count(*), count(DISTINCT id) FROM copy") == [(total, total)]
    assert dst.execute(
        "SELECT count(*) FROM copy c WHERE c.gate IS NULL OR c.updated_at IS NULL"
    ) == [(0,)]
    [(cursor,)] = dst.execute(
        "SELECT cursor FROM dispatch_cursor WHERE binding_id = %s", [binding.pk]
    )
    last = src.execute(
        "SELECT %s::timestamptz = updated_at AND %s::bigint = id FROM items"
        " ORDER BY updated_at DESC, id DESC LIMIT 1",
        [cursor[0], cursor[1]],
    )
    assert last == [(True,)], cursor


def _sink_backends(dst: ScratchDB) -> list[int]:
    return [
        r[0]
        for r in dst.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
    ]


def _gated_run(
    src: ScratchDB, dst: ScratchDB, processes: Processes, holders: Holders, worker_id: str
) -> tuple[Any, Session, Run, Proc]:
    """The binding, a session holding the gate row, a run and the worker `worker_id`
    whose COPY will wait on that row: (binding, gate session, run, worker process)."""
    binding = _setup(src, dst)
    gate = holders.gate(dst)
    run = factories.trigger(binding)
    return binding, gate, run, processes.worker("--worker-id", worker_id)


def test_incremental__killed_in_the_middle_of_the_copy(
    src_db: ScratchDB,
    dst_db: ScratchDB,
    processes: Processes,
    holders: Holders,
) -> None:
    binding, holder, run, doomed = _gated_run(src_db, dst_db, processes, holders, "doomed")
    kill_while_held(dst_db, holder, doomed)
    assert dst_db.execute("SELECT count(*) FROM copy") == [(0,)]  # nothing committed
    succeed(processes, run, "successor")
    _assert_exactly_once(src_db, dst_db, binding)
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    first, last = attempts[0], attempts[-1]
    assert first.status == Status.RETRY_SCHEDULED and first.reason == Reason.LEASE_EXPIRED
    assert last.status == Status.SUCCEEDED and last.reason is None  # it copied again
    assert first.cursor_from is None and last.cursor_from is None  # both from the start
    assert last.cursor_to == first.cursor_to  # the same snapshot bound: no new rows


def test_incremental__killed_after_reading_every_row_before_the_commit(
    src_db: ScratchDB,
    dst_db: ScratchDB,
    processes: Processes,
    holders: Holders,
) -> None:
    binding = _setup(src_db, dst_db)
    # The first commit of a binding's cursor inserts its row: a holder that inserted the
    # same row first makes that commit wait, after the last row was copied.
    dst_db.execute(
        "CREATE TABLE dispatch_cursor (binding_id uuid PRIMARY KEY, columns text[],"
        " cursor text[], version bigint NOT NULL DEFAULT 0, run_id uuid, attempt_id uuid,"
        " committed_at timestamptz)"
    )
    holder = holders.session(dst_db)
    holder.execute("INSERT INTO dispatch_cursor (binding_id) VALUES (%s)", [binding.pk])
    run = factories.trigger(binding)
    doomed = processes.worker("--worker-id", "doomed")
    wait_until(lambda: waiting_on(dst_db, holder), timeout=60, message="the commit waits")
    progress = dst_db.execute("SELECT count(*) FROM pg_stat_progress_copy")
    assert progress == [(0,)]  # the COPY is over: every row was read and sent
    kill_while_held(dst_db, holder, doomed)
    assert dst_db.execute("SELECT count(*) FROM copy") == [(0,)]
    succeed(processes, run, "successor")
    _assert_exactly_once(src_db, dst_db, binding)


def test_incremental__killed_after_the_sink_commit_before_settlement_then_continued(
    src_db: ScratchDB,
    dst_db: ScratchDB,
    processes: Processes,
    holders: Holders,
) -> None:
    binding, gate, run, doomed = _gated_run(src_db, dst_db, processes, holders, "doomed")
    wait_until(lambda: waiting_on(dst_db, gate), timeout=60, message="the COPY waits")
    # Claimed and copying: now hold the run row, so the settlement (which locks the run
    # first) waits and the window between the sink commit and the outcome stays open.
    holder = holders.run_row(run)
    gate.rollback()
    wait_until(
        lambda: (
            dst_db.execute("SELECT count(*) FROM pg_tables WHERE tablename = 'dispatch_cursor'")
            == [(1,)]
            and dst_db.execute("SELECT count(*) FROM dispatch_cursor") == [(1,)]
        ),
        timeout=60,
        message="the sink commit",
    )
    kill_in_settlement(holder, doomed)
    successor = succeed(processes, run, "successor")
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert [(a.status, a.reason) for a in attempts] == [
        (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED),
        (Status.SUCCEEDED, Reason.ALREADY_COMMITTED),
    ]
    _assert_exactly_once(src_db, dst_db, binding)
    # The console's copy: the dead attempt's commit, found by its successor.
    copy = BindingCursor.objects.get(binding=binding)
    assert copy.run_id == run.id and copy.attempt_id == attempts[0].id and copy.version == 1
    # The next run starts from that cursor: only the new rows, each once.
    _add_rows(src_db, ROWS + 1, ROWS + 300)
    nxt = factories.trigger(binding)
    succeeded(nxt, message="the next run")
    attempt = Attempt.objects.get(run=nxt)
    assert attempt.cursor_from == copy.cursor and attempt.rows_written == 300
    assert attempt.cursor_to == [attempt.cursor_to[0], str(ROWS + 300)]
    _assert_exactly_once(src_db, dst_db, binding)
    copy.refresh_from_db()
    assert copy.cursor == attempt.cursor_to and copy.run_id == nxt.id and copy.version == 2
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0


def test_incremental__stopped_past_its_lease_while_a_successor_commits(
    src_db: ScratchDB,
    dst_db: ScratchDB,
    processes: Processes,
    holders: Holders,
) -> None:
    binding, holder, run, worker = _gated_run(src_db, dst_db, processes, holders, "stopped")
    wait_until(lambda: waiting_on(dst_db, holder), timeout=60, message="A's COPY waits")
    stopped_pid = waiting_on(dst_db, holder)[0]
    with stopped(worker):
        # A's session holds only shared locks (its rows are uncommitted, the table has no
        # unique index): the successor copies beside it.
        holder.rollback()
        holder.close()
        succeed(processes, run, "successor")
        _assert_exactly_once(src_db, dst_db, binding)
        committed = dst_db.execute(
            "SELECT cursor, version FROM dispatch_cursor WHERE binding_id = %s", [binding.pk]
        )
    # A wakes, finishes its COPY and tries to commit: its cursor compare-and-set (and
    # the fence) refuse it, and its session ends without a row.
    wait_until(
        lambda: (
            stopped_pid not in _sink_backends(dst_db)
            or dst_db.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [stopped_pid])
            in ([("idle",)], [])
        ),
        timeout=60,
        message="A's commit refused",
    )
    wait_until(
        lambda: (
            "stopped without recording" in processes.output(worker)
            or "refused" in processes.output(worker)
        ),
        timeout=60,
        message="A gives the attempt up",
    )
    _assert_exactly_once(src_db, dst_db, binding)
    assert (
        dst_db.execute(
            "SELECT cursor, version FROM dispatch_cursor WHERE binding_id = %s", [binding.pk]
        )
        == committed
    )
    first = Attempt.objects.filter(run=run).order_by("number").first()
    assert first is not None and first.status == Status.RETRY_SCHEDULED
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED


@pytest.mark.parametrize("action", ["reset", "set"])
def test_incremental__operator_reset_and_set_move_the_sink_cursor(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes, action: str
) -> None:
    from dispatch import services

    binding = _setup(src_db, dst_db)
    worker = processes.worker("--worker-id", "w")
    run = factories.trigger(binding)
    succeeded(run, message="the first run")
    dst_db.execute("TRUNCATE copy")
    if action == "reset":
        committed = services.set_binding_cursor(binding, None, by="alice")
        expected = ROWS
    else:
        point = src_db.execute("SELECT updated_at::text FROM items WHERE id = 1000")[0][0]
        committed = services.set_binding_cursor(binding, [point, "1000"], by="alice")
        expected = ROWS - 1000
    assert committed.version == 2
    copy = BindingCursor.objects.get(binding=binding)
    assert (copy.version, copy.changed_by, copy.run_id) == (2, "alice", None)
    again = factories.trigger(binding)
    succeeded(again, message="the run after the operator's change")
    assert dst_db.execute("SELECT count(*), count(DISTINCT id) FROM copy") == [(expected, expected)]
    attempt = Attempt.objects.get(run=again)
    assert attempt.cursor_from == (None if action == "reset" else committed.cursor)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0


def test_incremental__operator_set_refuses_a_cursor_of_the_wrong_shape(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    from dispatch import services

    binding = _setup(src_db, dst_db)
    with pytest.raises(services.ActionRefused, match=r"over \(updated_at, id\): give 2"):
        services.set_binding_cursor(binding, ["2024-01-01"], by="alice")
    plain = factories.BindingFactory()
    with pytest.raises(services.ActionRefused, match="reads its whole source"):
        services.set_binding_cursor(plain, None, by="alice")
    assert not BindingCursor.objects.exists()
