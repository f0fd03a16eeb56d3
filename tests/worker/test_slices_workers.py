"""Sliced runs through real worker processes and real PostgreSQL source and sink
databases (docs/architecture.md and docs/connectors.md, "Slices").

A 500,000-row table in 8 slices over 2 workers: the sink equals the source (count and an
order-independent digest); a worker SIGKILLed in the middle of a slice: that slice alone
is redone, no row twice; a stale slice's commit after a SIGSTOP past its lease: refused by
the fence. `replace` with slices: a reader of the sink sees the old table until the swap,
then the whole new one, never a mix. A slice that fails for good fails the run, naming the
slice; the operator's retry redoes only what did not commit.

A worker is stopped at a chosen point by a lock a session of the test holds: a foreign key
of the sink's rows to a `gate` row (the COPY waits at the first row that needs it), or the
slice's fence row (its commit waits)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from dispatch import services
from dispatch.connectors.postgresql.writer import staging_name
from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, JobBinding, Run, SlicePlan
from tests.support import factories
from tests.support.connectors import ScratchDB, connect, scratch_db
from tests.support.gates import (
    Holders,
    crash_binding,
    gate_table,
    kill_while_held,
    stopped,
    succeeded,
    waiting_on,
)
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BIG = 500_000
# Sessions of the connectors wait on our locks for longer than the default 10 s.
TIMEOUTS = {"lock_timeout_seconds": 300}
SLICED = 180  # seconds a sliced run may take to succeed


@pytest.fixture
def src() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_slices_src")


@pytest.fixture
def dst() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_slices_dst")


def setup(
    src: ScratchDB,
    dst: ScratchDB,
    *,
    rows: int,
    gated: list[int],
    table: str = "copy",
    mode: str = "append",
    in_flight: int | None = None,
    concurrency: int = 4,
) -> JobBinding:
    """Source `items` with `rows` rows (one INSERT ... SELECT); the ids in `gated` need the
    gate row 'b' in the sink. Sink `gate` and `table`, whose rows reference a gate."""
    src.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text NOT NULL, gate text)")
    src.execute(
        "INSERT INTO items SELECT i, md5(i::text),"
        " CASE WHEN i = ANY(%s::bigint[]) THEN 'b' ELSE 'a' END FROM generate_series(1, %s) i",
        [gated, rows],
    )
    src.execute("ANALYZE items")
    gate_table(dst)
    dst.execute(
        f"CREATE TABLE {table} (id bigint, v text NOT NULL, gate text REFERENCES gate)"  # noqa: S608
    )
    return crash_binding(
        ("postgresql", src.config),
        ("postgresql", dst.config),
        {"table": "items", "slices": {"key": "id", "count": 8}, **TIMEOUTS},
        {"table": table, "mode": mode, **TIMEOUTS},
        job={"max_slices_in_flight": in_flight},
        max_concurrency=concurrency,
    )


def digest(db: ScratchDB, table: str) -> tuple[int, int, int]:
    """(rows, distinct ids, the sum of every row's hash): equal for equal multisets of
    rows, whatever their order."""
    [row] = db.execute(
        f"SELECT count(*), count(DISTINCT id), coalesce(sum(hashtext(t::text)::bigint), 0)"  # noqa: S608
        f" FROM {table} t"
    )
    return row


def the_parent(binding: JobBinding) -> Run:
    return Run.objects.get(binding=binding, parent__isnull=True)


def slice_run(parent: Run, number: int) -> Run:
    return Run.objects.get(parent=parent, slice_number=number)


def attempts(run: Run) -> list[tuple[int, str, str | None]]:
    return [
        (a.number, a.status, a.reason) for a in Attempt.objects.filter(run=run).order_by("number")
    ]


def test_slices__500k_rows_over_two_workers_one_killed_mid_slice_redoes_that_slice_alone(
    src: ScratchDB, dst: ScratchDB, processes: Processes, holders: Holders
) -> None:
    # Slice 5 of 8 is [250001, 312501): row 300000 waits on the gate.
    binding = setup(src, dst, rows=BIG, gated=[300_000])
    gate = holders.gate(dst)
    run = factories.trigger(binding)
    workers = {
        name: processes.worker("--worker-id", name, "--concurrency", "1") for name in ("a", "b")
    }
    wait_until(lambda: waiting_on(dst, gate), timeout=120, message="slice 5's COPY waits")
    parent = the_parent(binding)
    assert parent.pk == run.pk and parent.status == Status.WAITING
    fifth = slice_run(parent, 5)
    holding = Attempt.objects.get(run=fifth, status=Status.RUNNING).worker_id
    kill_while_held(dst, gate, workers[holding])
    processes.worker("--worker-id", "c", "--concurrency", "1")  # two workers again
    succeeded(parent, timeout=SLICED)

    assert digest(dst, "copy") == digest(src, "items")
    assert digest(dst, "copy")[:2] == (BIG, BIG)  # every row, none twice
    assert attempts(fifth) == [
        (1, Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED),
        (2, Status.SUCCEEDED, None),
    ]
    for number in (1, 2, 3, 4, 6, 7, 8):  # the others ran once
        assert attempts(slice_run(parent, number)) == [(1, Status.SUCCEEDED, None)], number
    plan = SlicePlan.objects.get(run=parent)
    assert (plan.succeeded, plan.failed, plan.live, plan.rows_written) == (8, 0, 0, BIG)
    # Each slice committed under its own run's fence.
    assert dst.execute("SELECT count(*) FROM dispatch_fence WHERE committed_at IS NOT NULL") == [
        (8,)
    ]


def test_slices__a_stale_slice_commit_after_sigstop_past_its_lease_is_refused_by_the_fence(
    src: ScratchDB, dst: ScratchDB, processes: Processes, holders: Holders
) -> None:
    # Slice 2 of 8 is [62501, 125001): row 100000 waits on the gate.
    binding = setup(src, dst, rows=BIG, gated=[100_000])
    gate = holders.gate(dst)
    factories.trigger(binding)
    stale = processes.worker("--worker-id", "stale", "--concurrency", "1")
    wait_until(lambda: waiting_on(dst, gate), timeout=120, message="slice 2's COPY waits")
    parent = the_parent(binding)
    second = slice_run(parent, 2)
    first_attempt = Attempt.objects.get(run=second, status=Status.RUNNING)
    assert first_attempt.worker_id == "stale"
    # Hold slice 2's fence row, then let its COPY finish: its commit waits on the row.
    fence = holders.session(dst)
    fence.execute("SELECT 1 FROM dispatch_fence WHERE run_id = %s FOR UPDATE", [second.pk])
    gate.rollback()
    wait_until(lambda: waiting_on(dst, fence), timeout=120, message="the commit waits")
    with stopped(stale):
        fresh = processes.worker("--worker-id", "fresh", "--concurrency", "2")
        # Past its lease, slice 2 is recovered and its successor raises the fence, which
        # waits behind the stale commit.
        wait_until(
            lambda: Attempt.objects.filter(run=second, number=2, status=Status.RUNNING).exists(),
            timeout=120,
            message="slice 2's successor runs",
        )
        # The successor waits behind the stale commit (on its tuple lock), which waits
        # on our session.
        wait_until(
            lambda: (
                dst.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )[0][0]
                >= 2
            ),
            timeout=120,
            message="both commits wait",
        )
        fence.rollback()  # the stale commit takes the row first (it asked first)
    succeeded(parent, timeout=SLICED)
    wait_until(
        lambda: "stale commit refused by the sink fence" in processes.output(stale),
        timeout=60,
        message="the stale worker logs the refusal",
    )
    assert fresh.poll() is None
    assert digest(dst, "copy") == digest(src, "items")
    assert digest(dst, "copy")[:2] == (BIG, BIG)
    assert attempts(second) == [
        (1, Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED),
        (2, Status.SUCCEEDED, None),
    ]
    successor = Attempt.objects.get(run=second, number=2)
    assert dst.execute("SELECT attempt_id FROM dispatch_fence WHERE run_id = %s", [second.pk]) == [
        (successor.pk,)
    ]


def test_slices__replace_keeps_the_old_table_whole_until_the_last_slice_swaps_it(
    src: ScratchDB, dst: ScratchDB, processes: Processes, holders: Holders
) -> None:
    rows = 40_000
    # Slice 8 of 8 is [35001, ...): row 39000 waits on the gate, after the other seven.
    binding = setup(src, dst, rows=rows, gated=[39_000], table="target", mode="replace")
    dst.execute("INSERT INTO target SELECT -i, 'old', 'a' FROM generate_series(1, 1000) i")
    gate = holders.gate(dst)
    run = factories.trigger(binding)

    seen: set[tuple[int, int]] = set()
    done = threading.Event()

    def watch() -> None:  # a reader of the sink, all along
        with connect(dst.name) as conn:
            while not done.is_set():
                seen.add(
                    conn.execute(
                        "SELECT count(*) FILTER (WHERE v = 'old'),"
                        " count(*) FILTER (WHERE v <> 'old') FROM target"
                    ).fetchone()
                )

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for name in ("a", "b"):
            processes.worker("--worker-id", name, "--concurrency", "2")
        wait_until(
            lambda: (
                SlicePlan.objects.filter(run=run, succeeded=7).exists() and waiting_on(dst, gate)
            ),
            timeout=120,
            message="seven slices committed, the last one waits",
        )
        stage = staging_name(str(run.pk))
        # Seven slices' rows are staged; the target is still the old table, whole.
        [(staged,)] = dst.execute(f"SELECT count(*) FROM {stage}")  # noqa: S608
        assert staged == 35_000
        assert dst.execute("SELECT count(*), min(v), max(v) FROM target") == [(1000, "old", "old")]
        before = holders.session(dst)
        before.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert before.execute("SELECT count(*) FROM target").fetchone() == (1000,)
        gate.rollback()
        succeeded(Run.objects.get(pk=run.pk), timeout=SLICED)
    finally:
        done.set()
        watcher.join(30)
    assert digest(dst, "target") == digest(src, "items")
    # Never a mix: the old table or the whole new one.
    assert seen <= {(1000, 0), (0, rows)}, seen
    assert (1000, 0) in seen
    # A snapshot taken before the swap still reads the old rows (MVCC-safe replace).
    assert before.execute("SELECT count(*) FROM target").fetchone() == (1000,)
    before.rollback()
    assert dst.execute("SELECT to_regclass(%s)", [stage]) == [(None,)]  # dropped


def test_slices__a_slice_failing_for_good_fails_the_run_and_the_retry_redoes_only_it(
    src: ScratchDB, dst: ScratchDB, processes: Processes
) -> None:
    rows = 8_000
    binding = setup(src, dst, rows=rows, gated=[], in_flight=3)
    # Slice 4 of 8 is [3001, 4001): row 3333 breaks a check of the sink's.
    dst.execute("ALTER TABLE copy ADD CONSTRAINT not_3333 CHECK (id <> 3333)")
    run = factories.trigger(binding)
    processes.worker("--worker-id", "w", "--concurrency", "2")
    wait_until(
        lambda: SlicePlan.objects.filter(run=run, live=0).exclude(error="").exists(),
        timeout=120,
        message="the run fails and its running slices end",
    )
    run.refresh_from_db()
    plan = SlicePlan.objects.get(run=run)
    assert run.status == Status.FAILED
    assert plan.error.startswith("slice 4 of 8 (id >= 3001 and < 4001): sink ")
    assert "not_3333" in plan.error
    fourth = slice_run(run, 4)
    assert attempts(fourth) == [(1, Status.FAILED, Reason.PERMANENT_ERROR)]
    committed_before = {
        r.slice_number for r in Run.objects.filter(parent=run, status=Status.SUCCEEDED)
    }
    assert 4 not in committed_before and len(committed_before) == plan.succeeded >= 3
    assert plan.started < 8  # no slice started after the failure

    dst.execute("ALTER TABLE copy DROP CONSTRAINT not_3333")
    assert services.retry_run(run) == services.Outcome.RETRIED
    succeeded(run, timeout=SLICED)
    assert digest(dst, "copy") == digest(src, "items")
    assert digest(dst, "copy")[:2] == (rows, rows)
    assert [(a.number, a.origin, a.status) for a in Attempt.objects.filter(run=fourth)] == [
        (1, Origin.TRIGGER, Status.FAILED),
        (2, Origin.OPERATOR, Status.SUCCEEDED),
    ]
    for number in committed_before:  # not redone
        assert attempts(slice_run(run, number)) == [(1, Status.SUCCEEDED, None)], number
