"""Sink-side fencing (contract section 4) on a real PostgreSQL sink."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dispatch.connectors.base import FenceRejected
from dispatch.connectors.builtin import GenerateConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource
from tests.support import factories
from tests.support.connectors import (
    Ctx,
    Fence,
    ScratchDB,
    run_transfer,
    scratch_db,
)
from tests.support.gates import Holders, kill_in_settlement
from tests.support.processes import Processes, wait_until


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_conn_dst")


ORDERS = (
    "CREATE TABLE orders (id bigint, customer text, amount numeric(12,2), created_at timestamptz)"
)


def _fence_row(db: ScratchDB, run_id: uuid.UUID) -> tuple[Any, ...] | None:
    if db.execute("SELECT to_regclass('dispatch_fence')") == [(None,)]:
        return None  # the first writer has not created the fence table yet
    rows = db.execute(
        "SELECT token, attempt_id, committed_at IS NOT NULL FROM dispatch_fence WHERE run_id = %s",
        [run_id],
    )
    return rows[0] if rows else None


@pytest.mark.django_db
def test_fence__newer_token_aborts_the_stale_commit(dst_db: ScratchDB) -> None:
    dst_db.execute(ORDERS)
    run_id, binding_id = uuid.uuid4(), uuid.uuid4()
    stale = Ctx(Fence(run_id=run_id, binding_id=binding_id, token=5))
    fresh = Ctx(Fence(run_id=run_id, binding_id=binding_id, token=6))
    spec = {"table": "orders", "mode": "append"}
    with (
        GenerateConnector.open_reader({}, {"rows": 300, "seed": 5}, stale) as r5,
        PG.open_writer(dst_db.config, spec, stale, r5.columns) as w5,
    ):
        for batch in r5.batches():
            w5.write(batch)  # token 5 has written (uncommitted) when token 6 starts
        assert _fence_row(dst_db, run_id)[0] == 5
        result6 = run_transfer(
            GenerateConnector, {}, {"rows": 200, "seed": 6}, PG, dst_db.config, spec, fresh
        )
        assert result6.rows_written == 200
        with pytest.raises(FenceRejected, match="token 5"):
            w5.commit()
    assert dst_db.execute("SELECT count(*), min(id), max(id) FROM orders") == [(200, 1, 200)]
    token, attempt, committed = _fence_row(dst_db, run_id)
    assert (token, attempt, committed) == (6, fresh.fence.attempt_id, True)


@pytest.mark.django_db
def test_fence__raised_before_stale_commit_even_when_the_newer_attempt_is_still_copying(
    dst_db: ScratchDB,
) -> None:
    dst_db.execute(ORDERS)
    run_id = uuid.uuid4()
    stale, fresh = Ctx(Fence(run_id=run_id, token=5)), Ctx(Fence(run_id=run_id, token=6))
    spec = {"table": "orders", "mode": "append"}
    with (
        GenerateConnector.open_reader({}, {"rows": 10}, stale) as r5,
        PG.open_writer(dst_db.config, spec, stale, r5.columns) as w5,
    ):
        for batch in r5.batches():
            w5.write(batch)
        with (
            GenerateConnector.open_reader({}, {"rows": 20}, fresh) as r6,
            PG.open_writer(dst_db.config, spec, fresh, r6.columns) as w6,
        ):
            # Token 6 has raised the fence but not committed: token 5 still cannot commit.
            with pytest.raises(FenceRejected):
                w5.commit()
            for batch in r6.batches():
                w6.write(batch)
            w6.commit()
    assert dst_db.execute("SELECT count(*) FROM orders") == [(20,)]


@pytest.mark.django_db
def test_fence__older_token_cannot_raise_and_committed_run_is_not_written_again(
    dst_db: ScratchDB,
) -> None:
    dst_db.execute(ORDERS)
    run_id = uuid.uuid4()
    spec = {"table": "orders", "mode": "append"}
    # Token 7 raises the fence (and is then lost); token 6 arrives late: refused at once.
    with (
        GenerateConnector.open_reader({}, {"rows": 1}, Ctx()) as r,
        PG.open_writer(dst_db.config, spec, Ctx(Fence(run_id=run_id, token=7)), r.columns),
    ):
        pass
    with pytest.raises(FenceRejected, match="token 7"):
        run_transfer(
            GenerateConnector,
            {},
            {"rows": 5},
            PG,
            dst_db.config,
            spec,
            Ctx(Fence(run_id=run_id, token=6)),
        )
    done = run_transfer(
        GenerateConnector,
        {},
        {"rows": 5},
        PG,
        dst_db.config,
        spec,
        Ctx(Fence(run_id=run_id, token=8)),
    )
    assert done.rows_written == 5
    # A successor of a committed run writes nothing and reports it.
    ctx = Ctx(Fence(run_id=run_id, token=9))
    again = run_transfer(GenerateConnector, {}, {"rows": 5}, PG, dst_db.config, spec, ctx)
    assert again.already_committed and again.rows_written == 0 and ctx.rows_read == 0
    assert dst_db.execute("SELECT count(*) FROM orders") == [(5,)]
    assert _fence_row(dst_db, run_id)[0] == 8


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_exactly_once__worker_killed_between_sink_commit_and_outcome(
    dst_db: ScratchDB, processes: Processes, holders: Holders
) -> None:
    dst_db.execute(ORDERS)
    source = Datasource(name="gen", kind="generate", config={})
    source.save()
    sink = Datasource(name="sink", kind="postgresql", config=dst_db.config)
    sink.save()
    job = factories.JobFactory(
        source_spec={"rows": 3000, "batch": 100, "delay_ms": 20, "seed": 9},
        sink_spec={"table": "orders", "mode": "append"},
        lease_seconds=2,
        max_attempts=3,
    )
    binding = factories.BindingFactory(job=job, source=source, sink=sink)
    run = factories.trigger(binding)
    worker = processes.worker("--worker-id", "doomed")
    first = wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING).first(),
        message="attempt 1 running",
    )
    # A second connection holds the run row: the worker's settlement (which locks the run
    # first) waits behind it, so the window between the sink commit and the outcome stays
    # open until the worker is killed.
    holder = holders.run_row(run)
    wait_until(
        lambda: (_fence_row(dst_db, run.id) or (0, 0, False))[2],
        timeout=60,
        message="the sink commit",
    )
    # The settlement has reached the server and waits on our lock: the worker is killed
    # there and its backend ended, so the outcome is lost for good.
    kill_in_settlement(holder, worker)
    first.refresh_from_db()
    assert first.status == Status.RUNNING  # the outcome was never recorded
    successor = processes.worker("--worker-id", "successor")
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.SUCCEEDED).exists(),
        timeout=60,
        message="the successor's outcome",
    )
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    assert [(a.status, a.reason) for a in attempts] == [
        (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED),
        (Status.SUCCEEDED, Reason.ALREADY_COMMITTED),
    ]
    # Each row once: the append sink was not written a second time.
    assert dst_db.execute("SELECT count(*), count(DISTINCT id) FROM orders") == [(3000, 3000)]
    assert _fence_row(dst_db, run.id)[1] == first.id
    successor.send_signal(signal.SIGTERM)
    assert successor.wait(20) == 0


@pytest.mark.django_db
def test_fence__attempt_ended_without_successor_cannot_commit(dst_db: ScratchDB) -> None:
    """Recovery or an operator ended the attempt (FAILED/CANCELLED, no successor): no newer
    token raised the fence, so the commit re-checks the attempt itself and refuses."""
    dst_db.execute(ORDERS)
    ctx = Ctx(Fence(token=7))
    spec = {"table": "orders", "mode": "append"}
    with (
        GenerateConnector.open_reader({}, {"rows": 50, "seed": 7}, ctx) as reader,
        PG.open_writer(dst_db.config, spec, ctx, reader.columns) as writer,
    ):
        for batch in reader.batches():
            writer.write(batch)
        ctx.fence.lost = True  # e.g. paused past its lease, then settled by recovery
        with pytest.raises(FenceRejected, match="no longer this worker's"):
            writer.commit()
    assert dst_db.execute("SELECT count(*) FROM orders") == [(0,)]
    token, attempt, committed = _fence_row(dst_db, ctx.fence.run_id)
    assert (token, committed) == (7, False)
