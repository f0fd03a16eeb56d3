"""Trigger, cancel, retry, run now, release: outcomes, refusals and races."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from dispatch import services
from dispatch.core.states import BlockedReason, Origin, Reason, Status, Trigger
from dispatch.models import Attempt, Run
from dispatch.services import ActionRefused, Outcome
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of, claim_one, in_threads, raw_connection
from tests.support.processes import test_database_url, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def listener() -> psycopg.Connection:
    conn = psycopg.connect(test_database_url(), autocommit=True)
    conn.execute("LISTEN dispatch_runs")
    return conn


def received(conn: psycopg.Connection, timeout: float = 0.5) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout)]


def test_trigger__creates_run_and_attempt_one_and_notifies_only_the_run_id():
    binding = BindingFactory()
    with listener() as conn:
        run = trigger(binding, requested_by="alice")
        assert received(conn) == [str(run.id)]
    [a] = attempts_of(run)
    assert (run.status, run.trigger, run.requested_by) == (Status.PENDING, Trigger.MANUAL, "alice")
    assert (a.number, a.origin, a.status, a.blocked_reason) == (
        1,
        Origin.TRIGGER,
        Status.PENDING,
        None,
    )
    assert a.available_at == a.created_at


def test_trigger__is_one_round_trip_with_its_wakeup() -> None:
    binding = BindingFactory()
    with listener() as conn:
        with CaptureQueriesContext(connection) as ctx:
            run = services.trigger(binding)
        assert received(conn) == [str(run.id)]
    # The run, its attempt, the commit and then the NOTIFY in one statement (a procedure
    # that commits before it notifies); no binding fetch, no BEGIN/COMMIT of their own.
    texts = [q["sql"] for q in ctx.captured_queries]
    assert len(texts) == 1, texts
    assert "CALL dispatch_trigger_notify_v4" in texts[0]
    assert Run.objects.get(pk=run.pk).status == Status.PENDING


def test_trigger__the_wakeup_follows_the_commit_inside_the_call() -> None:
    # The listener hears the run id only once the run is visible to another session:
    # the procedure commits the run before it sends the wake-up.
    binding = BindingFactory()
    with listener() as conn, raw_connection() as other:
        other.autocommit = True
        run = services.trigger(binding)
        [note] = list(conn.notifies(timeout=2, stop_after=1))
        row = other.execute(
            "SELECT r.status, a.status FROM dispatch_run r JOIN dispatch_attempt a"
            " ON a.run_id = r.id WHERE r.id = %s",
            [note.payload],
        ).fetchall()
    assert note.payload == str(run.id) and row == [("PENDING", "PENDING")]


def test_trigger_many__overlapping_keys_in_opposite_orders_do_not_deadlock() -> None:
    # A holds k3 and waits for k2 (held by a third session); B, in its own order, would
    # hold k1 and wait for A's k3 while A, once k2 is free, waits for B's k1: a deadlock.
    # Inserted in one order (by key), B waits for A's k1 and then finds both runs.
    # (The function itself: the service would ask again after a deadlock.)
    binding = BindingFactory()
    call = (
        "SELECT run_id, created FROM dispatch_trigger_v4("
        " ARRAY(SELECT gen_random_uuid() FROM unnest(%s::text[])),"
        " array_fill(%s::uuid, ARRAY[cardinality(%s::text[])]), 'MANUAL', '', %s::text[])"
    )
    holder = raw_connection()
    holder.execute(call, [["k2"], binding.pk, ["k2"], ["k2"]])
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(name: str, keys: list[str]) -> None:
        try:
            with psycopg.connect(test_database_url(), autocommit=True) as conn:
                results[name] = conn.execute(call, [keys, binding.pk, keys, keys]).fetchall()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def lock_waits() -> int:
        with raw_connection() as probe:
            return probe.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE '%%dispatch_trigger_v4%%'"
                " AND pid <> pg_backend_pid()"
            ).fetchone()[0]

    a = threading.Thread(target=run, args=("a", ["k3", "k2", "k1"]))
    a.start()
    wait_until(lambda: lock_waits() == 1, message="A waiting for k2")
    b = threading.Thread(target=run, args=("b", ["k1", "k3"]))
    b.start()
    wait_until(lambda: lock_waits() == 2, message="B waiting too")
    holder.rollback()
    holder.close()
    a.join(30)
    b.join(30)
    assert errors == []
    assert [created for _, created in results["a"]] == [True, True, True]
    assert [created for _, created in results["b"]] == [False, False]
    a_ids = [run_id for run_id, _ in results["a"]]
    assert [run_id for run_id, _ in results["b"]] == [a_ids[2], a_ids[0]]  # k1, k3
    keys = dict(Run.objects.filter(id__in=a_ids).values_list("id", "idempotency_key"))
    assert [keys[i] for i in a_ids] == ["k3", "k2", "k1"]  # in the order given
    assert Run.objects.count() == 3 and Attempt.objects.count() == 3


def test_trigger_many__creates_every_run_in_one_statement_and_wakes_each_once() -> None:
    bindings = [BindingFactory() for _ in range(3)]
    chosen = [bindings[i % 3] for i in range(20)]
    keys = [f"k{i}" for i in range(20)]
    with listener() as conn:
        with CaptureQueriesContext(connection) as ctx:
            runs = services.trigger_many(chosen, idempotency_keys=keys, trigger=Trigger.API)
        got = received(conn)
    assert len(ctx.captured_queries) == 1  # the runs and every wake-up in one statement
    assert sorted(got) == sorted(str(r.id) for r in runs)
    assert [r.binding_id for r in runs] == [b.pk for b in chosen]
    assert Attempt.objects.filter(run__in=[r.id for r in runs], number=1).count() == 20
    # Again with the same keys (and one new): the existing runs, nothing created or woken.
    with listener() as conn:
        again = services.trigger_many([*chosen, bindings[0]], idempotency_keys=[*keys, "new"])
        assert received(conn) == [str(again[-1].id)]
    assert [r.id for r in again[:-1]] == [r.id for r in runs]
    assert {r.trigger for r in again[:-1]} == {Trigger.API}  # the stored runs, not rebuilt
    assert Run.objects.count() == 21


def test_trigger_many__an_unknown_binding_creates_nothing() -> None:
    binding = BindingFactory()
    ghost = BindingFactory.build()  # never saved
    with pytest.raises(IntegrityError, match="no binding"):
        services.trigger_many([binding, ghost])
    assert Run.objects.count() == 0


def test_trigger_many__lists_must_pair_with_the_bindings() -> None:
    with pytest.raises(ValueError, match="idempotency_keys has 1 items for 2 bindings"):
        services.trigger_many([BindingFactory(), BindingFactory()], idempotency_keys=["a"])


def test_trigger__wakeup_waits_for_the_outer_transaction_to_commit():
    binding = BindingFactory()
    with listener() as conn:
        with transaction.atomic():
            run = trigger(binding)
            assert received(conn, timeout=0.2) == []
        assert received(conn) == [str(run.id)]


def test_trigger__rolled_back_sends_no_wakeup_and_leaves_nothing():
    binding = BindingFactory()
    with listener() as conn:
        with pytest.raises(RuntimeError), transaction.atomic():
            trigger(binding)
            raise RuntimeError("abort")
        assert received(conn, timeout=0.2) == []
    assert Run.objects.count() == 0 and Attempt.objects.count() == 0


@override_settings(DISPATCH_CHANNEL="")
def test_trigger__a_failing_wakeup_never_fails_the_trigger(caplog):
    # pg_notify refuses an empty channel name: the wake-up fails after the commit.
    run = trigger(BindingFactory())
    assert Run.objects.filter(pk=run.pk, status=Status.PENDING).exists()
    assert Run.objects.count() == 1 and Attempt.objects.count() == 1  # not created twice
    assert "failed (DataError) after its commit" in caplog.text
    assert f"wake-up for run={run.pk} not sent" in caplog.text
    # Inside a transaction the wake-up is its own statement after the commit.
    with transaction.atomic():
        later = trigger(BindingFactory())
    assert Run.objects.filter(pk=later.pk).exists()
    assert f"wake-up for run={later.pk} not sent" in caplog.text


def test_trigger__idempotency_key_returns_the_existing_run():
    binding = BindingFactory()
    first = trigger(binding, idempotency_key="k-1")
    again = trigger(binding, idempotency_key="k-1")
    assert again.pk == first.pk and Run.objects.count() == 1


def test_trigger__idempotency_key_race_creates_one_run():
    binding = BindingFactory()
    ids = in_threads(4, lambda i: trigger(binding, idempotency_key="same").pk)
    assert len(set(ids)) == 1 and Run.objects.count() == 1 and Attempt.objects.count() == 1


def test_trigger__disabled_binding_queues_a_blocked_run():
    run = trigger(BindingFactory(enabled=False))
    assert attempts_of(run)[0].blocked_reason == BlockedReason.BINDING_DISABLED


def test_trigger__rejects_unknown_trigger_kind():
    with pytest.raises(ValueError, match="trigger must be one of"):
        trigger(BindingFactory(), trigger="CRON")


def test_cancel__pending_run_is_cancelled_at_once():
    run = trigger(BindingFactory())
    assert services.cancel_run(run) == Outcome.CANCELLED
    run.refresh_from_db()
    [a] = attempts_of(run)
    assert (run.status, a.status, a.reason) == (
        Status.CANCELLED,
        Status.CANCELLED,
        Reason.CANCELLED_BY_OPERATOR,
    )
    assert claims.claim("w1", limit=1) == []


def test_cancel__running_run_gets_a_request_and_a_wakeup():
    run = trigger(BindingFactory())
    claim_one()
    with listener() as conn:
        assert services.cancel_run(run) == Outcome.CANCEL_REQUESTED
        assert received(conn) == [str(run.id)]
    run.refresh_from_db()
    assert run.status == Status.RUNNING and run.cancel_requested_at is not None
    with pytest.raises(ActionRefused) as refused:
        services.cancel_run(run)
    assert refused.value.code == "CANCEL_ALREADY_REQUESTED"


def test_cancel__finished_run_is_refused():
    run = trigger(BindingFactory())
    c = claim_one()
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    with pytest.raises(ActionRefused) as refused:
        services.cancel_run(run)
    assert refused.value.code == "ALREADY_FINISHED"


def test_cancel__racing_a_claim_settles_with_one_outcome():
    """The claim holds the run and attempt; cancel waits for it, then sees RUNNING."""
    binding = BindingFactory()
    runs = [trigger(binding) for _ in range(20)]
    binding.max_concurrency = 20
    binding.save()

    def act(i: int) -> object:
        if i == 0:
            return claims.claim("w1", limit=20)
        return [services.cancel_run(r) for r in runs]

    claimed, outcomes = in_threads(2, act)
    claimed_ids = {c.run_id for c in claimed}
    for run, outcome in zip(runs, outcomes, strict=True):
        run.refresh_from_db()
        live = Attempt.objects.filter(run=run, status__in=[Status.PENDING, Status.RUNNING]).count()
        if run.id in claimed_ids:
            assert (outcome, run.status) == (Outcome.CANCEL_REQUESTED, Status.RUNNING)
            assert live == 1
        else:
            assert (outcome, run.status) == (Outcome.CANCELLED, Status.CANCELLED)
            assert live == 0


def test_cancel__racing_a_completion_has_one_outcome():
    run = trigger(BindingFactory())
    c = claim_one()
    with raw_connection() as holder:
        # The completion holds the run lock (as dispatch_settle_v3 does) ...
        holder.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [run.id])
        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(outcome=_cancel_or_refusal(run)))
        t.start()
        wait_until(
            lambda: holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted"
            ).fetchone()[0],
            message="cancel waiting on the run lock",
        )
        holder.execute(
            "SELECT dispatch_settle_v3(%s, %s, 'SUCCEEDED', NULL, NULL, 1, 1, NULL, NULL, NULL)",
            [c.attempt_id, c.lease_token],
        )
        holder.commit()
        t.join(30)
    # ... so the cancel, which waited, sees the finished run: exactly one outcome.
    assert result["outcome"] == "ALREADY_FINISHED"
    assert Run.objects.get(pk=run.pk).status == Status.SUCCEEDED


def _cancel_or_refusal(run: Run) -> str:
    from django.db import connection

    try:
        return str(services.cancel_run(run))
    except ActionRefused as exc:
        return exc.code
    finally:
        connection.close()


def test_retry__failed_run_gets_an_operator_attempt_and_clears_the_cancel_request():
    run = trigger(BindingFactory(job__max_attempts=1))
    c = claim_one()
    services.cancel_run(run)
    claims.settle(c.attempt_id, c.lease_token, "CANCELLED", reason=Reason.CANCELLED_BY_OPERATOR)
    with listener() as conn:
        assert services.retry_run(run) == Outcome.RETRIED
        assert received(conn) == [str(run.id)]
    run.refresh_from_db()
    assert (run.status, run.cancel_requested_at, run.finished_at) == (Status.PENDING, None, None)
    assert [(a.number, a.origin, a.status) for a in attempts_of(run)] == [
        (1, Origin.TRIGGER, Status.CANCELLED),
        (2, Origin.OPERATOR, Status.PENDING),
    ]


@pytest.mark.parametrize("state", ["pending", "running", "succeeded"])
def test_retry__refused_unless_failed_or_cancelled(state):
    run = trigger(BindingFactory())
    if state != "pending":
        c = claim_one()
        if state == "succeeded":
            claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    with pytest.raises(ActionRefused) as refused:
        services.retry_run(run)
    assert refused.value.code == "NOT_RETRYABLE"
    assert Attempt.objects.filter(run=run).count() == 1


def test_retry__two_operators_at_once_add_one_attempt():
    run = trigger(BindingFactory(job__max_attempts=1))
    c = claim_one()
    claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR)

    def retry(i: int) -> str:
        try:
            return str(services.retry_run(run))
        except ActionRefused as exc:
            return exc.code

    assert sorted(in_threads(2, retry)) == ["NOT_RETRYABLE", "RETRIED"]
    assert Attempt.objects.filter(run=run).count() == 2


def test_run_now__makes_a_backoff_wait_due_now():
    run = trigger(BindingFactory(job__backoff_seconds=3600, job__backoff_max_seconds=3600))
    c = claim_one()
    claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR)
    assert claims.claim("w1", limit=1) == []
    assert services.run_now(run) == Outcome.MADE_AVAILABLE
    assert claim_one(run_id=run.id).run_id == run.id


def test_run_now__refused_when_not_waiting():
    run = trigger(BindingFactory())
    with pytest.raises(ActionRefused) as refused:
        services.run_now(run)
    assert refused.value.code == "NOT_WAITING"


def test_release__settles_at_once_with_a_successor_due_now():
    run = trigger(BindingFactory(job__backoff_seconds=3600))
    c = claim_one("gone")
    assert services.release_attempt(Attempt(pk=c.attempt_id)) == Outcome.RELEASED
    first, second = attempts_of(run)
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.RELEASED_BY_OPERATOR)
    assert (second.origin, second.status) == (Origin.RELEASE, Status.PENDING)
    assert claim_one("next").attempt_id == second.id  # due now, not after a backoff
    # The released worker is fenced.
    assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED") is None


def test_release__refused_for_an_attempt_that_is_not_running():
    run = trigger(BindingFactory())
    with pytest.raises(ActionRefused) as refused:
        services.release_attempt(attempts_of(run)[0])
    assert refused.value.code == "NOT_RUNNING"


def test_status_of_run_is_always_its_latest_attempts():
    binding = BindingFactory(job__max_attempts=3, max_concurrency=10)
    for _ in range(5):
        trigger(binding)
    for c in claims.claim("w", limit=5):
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR)
    Attempt.objects.filter(status=Status.PENDING).update(available_at=F("created_at"))
    claims.claim("w", limit=2)
    for run in Run.objects.all():
        assert run.status == attempts_of(run)[-1].status


def test_release__of_a_run_with_a_cancel_request_settles_the_cancel():
    run = trigger(BindingFactory())
    c = claim_one()
    services.cancel_run(run)
    assert services.release_attempt(Attempt(pk=c.attempt_id)) == Outcome.CANCELLED
    assert [a.status for a in attempts_of(run)] == [Status.CANCELLED]
    assert Run.objects.get(pk=run.pk).status == Status.CANCELLED


def test_notify__inside_a_transaction_is_sent_only_after_the_commit():
    run = trigger(BindingFactory())
    with listener() as conn:
        with transaction.atomic():
            services.notify(run.id)
            assert received(conn, timeout=0.2) == []
        assert received(conn) == [str(run.id)]
