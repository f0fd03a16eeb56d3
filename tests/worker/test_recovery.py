"""Leases, heartbeats, fencing and recovery (contract sections 4 and 5)."""

from __future__ import annotations

import pytest
from django.db.models import F

from dispatch import services
from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, Job, Run
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of, claim_one, expire, in_threads

pytestmark = pytest.mark.django_db(transaction=True)


def beat(c: claims.ClaimedAttempt, worker: str = "w1") -> bool:
    return c.attempt_id in claims.heartbeat(worker, [(c.attempt_id, c.lease_token, 1, 1)], {})


def test_recover__cancel_requested_becomes_cancelled():
    run = trigger(BindingFactory())
    c = claim_one()
    assert services.cancel_run(run) == services.Outcome.CANCEL_REQUESTED
    expire(Attempt(pk=c.attempt_id))
    settled = claims.recover()
    assert [(r.run_id, r.outcome) for r in settled] == [(run.id, Status.CANCELLED)]
    [a] = attempts_of(run)
    assert (a.status, a.reason) == (Status.CANCELLED, Reason.CANCELLED_BY_OPERATOR)
    assert Run.objects.get(pk=run.pk).status == Status.CANCELLED


def test_recover__retry_allowed_schedules_one_new_attempt_after_backoff():
    run = trigger(
        BindingFactory(job__max_attempts=3, job__backoff_seconds=60, job__backoff_max_seconds=600)
    )
    c = claim_one()
    expire(Attempt(pk=c.attempt_id))
    assert [r.outcome for r in claims.recover()] == [Status.RETRY_SCHEDULED]
    first, second = attempts_of(run)
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED)
    assert first.source_snapshot is None and first.sink_snapshot is None  # erased at the end
    assert first.source_redacted == {}  # the redacted copy stays
    assert (second.number, second.origin, second.status) == (2, Origin.RETRY, Status.PENDING)
    # Equal jitter: between half and all of backoff_seconds * 2^0.
    delay = (second.available_at - first.finished_at).total_seconds()
    assert 30 <= delay <= 60
    assert Run.objects.get(pk=run.pk).status == Status.PENDING
    assert claims.claim("w2", limit=1) == []  # not before its backoff


def test_recover__budget_exhausted_fails_with_lease_expired():
    run = trigger(BindingFactory(job__max_attempts=1))
    c = claim_one()
    expire(Attempt(pk=c.attempt_id))
    assert [r.outcome for r in claims.recover()] == [Status.FAILED]
    [a] = attempts_of(run)
    assert (a.status, a.reason) == (Status.FAILED, Reason.LEASE_EXPIRED)
    run.refresh_from_db()
    assert run.status == Status.FAILED and run.finished_at is not None


def test_recover__backoff_is_exponential_and_capped():
    run = trigger(
        BindingFactory(job__max_attempts=10, job__backoff_seconds=10, job__backoff_max_seconds=25)
    )
    delays = []
    for _ in range(3):
        Attempt.objects.filter(run=run, status=Status.PENDING).update(available_at=F("created_at"))
        c = claim_one()
        expire(Attempt(pk=c.attempt_id))
        claims.recover()
        finished = Attempt.objects.get(pk=c.attempt_id).finished_at
        nxt = Attempt.objects.get(run=run, status=Status.PENDING)
        delays.append((nxt.available_at - finished).total_seconds())
    # Nominal 10, 20, 25 (capped); equal jitter keeps each in [nominal/2, nominal].
    for delay, nominal in zip(delays, [10, 20, 25], strict=True):
        assert nominal / 2 <= delay <= nominal


def test_recover__two_passes_at_once_create_one_new_attempt_each():
    binding = BindingFactory(max_concurrency=100, job__max_attempts=5)
    runs = [trigger(binding) for _ in range(40)]
    for c in claims.claim("w1", limit=40):
        expire(Attempt(pk=c.attempt_id))
    results = in_threads(2, lambda i: claims.recover(limit=7))
    assert sum(len(r) for r in results) == 40
    for run in runs:
        assert [(a.number, a.status) for a in attempts_of(run)] == [
            (1, Status.RETRY_SCHEDULED),
            (2, Status.PENDING),
        ]


def test_recover__leaves_unexpired_leases_alone():
    trigger(BindingFactory())
    claim_one()
    assert claims.recover() == []
    assert Attempt.objects.get().status == Status.RUNNING


def test_heartbeat__after_expiry_but_before_recovery_succeeds_and_recovery_leaves_it():
    trigger(BindingFactory(job__lease_seconds=30))
    c = claim_one()
    expire(Attempt(pk=c.attempt_id))
    assert beat(c)
    assert claims.recover() == []
    a = Attempt.objects.get(pk=c.attempt_id)
    assert a.status == Status.RUNNING and a.rows_read == 1


def test_completion__after_expiry_but_before_recovery_succeeds():
    run = trigger(BindingFactory())
    c = claim_one()
    expire(Attempt(pk=c.attempt_id))
    assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED") == Status.SUCCEEDED
    assert claims.recover() == []
    assert Run.objects.get(pk=run.pk).status == Status.SUCCEEDED


def test_stale_worker__cannot_heartbeat_or_succeed_after_recovery():
    trigger(BindingFactory(job__max_attempts=3))
    stale = claim_one("stale")
    expire(Attempt(pk=stale.attempt_id))
    claims.recover()
    assert not beat(stale, "stale")
    assert claims.settle(stale.attempt_id, stale.lease_token, "SUCCEEDED") is None
    first = Attempt.objects.get(pk=stale.attempt_id)
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED)


def test_stale_worker__fenced_once_a_successor_is_claimed():
    run = trigger(BindingFactory(job__max_attempts=3))
    stale = claim_one("stale")
    expire(Attempt(pk=stale.attempt_id))
    claims.recover()
    Attempt.objects.filter(run=run, status=Status.PENDING).update(available_at=F("created_at"))
    fresh = claim_one("fresh")
    assert fresh.lease_token > stale.lease_token
    assert not beat(stale, "stale")
    assert claims.settle(stale.attempt_id, stale.lease_token, "SUCCEEDED") is None
    assert claims.settle(stale.attempt_id, stale.lease_token, "ERROR", reason="ERROR") is None
    assert beat(fresh, "fresh")
    assert claims.settle(fresh.attempt_id, fresh.lease_token, "SUCCEEDED") == Status.SUCCEEDED
    assert [(a.status, a.reason) for a in attempts_of(run)] == [
        (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED),
        (Status.SUCCEEDED, None),
    ]


def test_heartbeat__extends_lease_and_reports_cancel_request():
    run = trigger(BindingFactory(job__lease_seconds=30))
    c = claim_one()
    before = Attempt.objects.get(pk=c.attempt_id).lease_until
    services.cancel_run(run)
    beats = claims.heartbeat("w1", [(c.attempt_id, c.lease_token, 5, 4)], {"x": 1})
    assert beats[c.attempt_id].cancel_requested
    a = Attempt.objects.get(pk=c.attempt_id)
    assert a.lease_until > before and (a.rows_read, a.rows_written) == (5, 4)


def test_heartbeat__another_workers_token_is_refused():
    trigger(BindingFactory())
    c = claim_one("owner")
    assert not beat(c, "intruder")


def test_error__retries_then_fails_permanently_or_by_budget():
    run = trigger(BindingFactory(job__max_attempts=2))
    c = claim_one()
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR, error="e1")
        == Status.RETRY_SCHEDULED
    )
    c = claim_one()
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR, error="e2")
        == Status.FAILED
    )
    assert [(a.status, a.error) for a in attempts_of(run)] == [
        (Status.RETRY_SCHEDULED, "e1"),
        (Status.FAILED, "e2"),
    ]


def test_error__permanent_is_not_retried():
    run = trigger(BindingFactory(job__max_attempts=5))
    c = claim_one()
    status = claims.settle(
        c.attempt_id, c.lease_token, "PERMANENT", reason=Reason.PERMANENT_ERROR, error="no table"
    )
    assert status == Status.FAILED
    assert [(a.status, a.reason) for a in attempts_of(run)] == [
        (Status.FAILED, Reason.PERMANENT_ERROR)
    ]


def test_error__cancel_request_wins_over_retry():
    run = trigger(BindingFactory(job__max_attempts=5))
    c = claim_one()
    services.cancel_run(run)
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR) == Status.CANCELLED
    )


def test_budget__release_successors_do_not_count_and_operator_retry_opens_a_new_budget():
    run = trigger(BindingFactory(job__max_attempts=2))
    c = claim_one()
    services.release_attempt(Attempt(pk=c.attempt_id))  # RELEASE successor: outside the budget
    c = claim_one()
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR)
        == Status.RETRY_SCHEDULED
    )
    c = claim_one()
    assert claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR) == Status.FAILED
    services.retry_run(run)
    c = claim_one()
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR)
        == Status.RETRY_SCHEDULED
    )
    # Attempt 1 (released) and its RELEASE successor 2 are one try; 3 is the second and
    # last of the budget; the operator's retry (4) opens a new budget, so 5 is allowed.
    assert [a.origin for a in attempts_of(run)] == [
        Origin.TRIGGER,
        Origin.RELEASE,
        Origin.RETRY,
        Origin.OPERATOR,
        Origin.RETRY,
    ]


def test_lease_seconds_below_two_is_rejected_by_the_database():
    from django.db import IntegrityError, transaction

    job = BindingFactory().job
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(lease_seconds=1)


def test_attempt_fence__check_fails_once_the_attempt_is_settled_or_heartbeats_are_stale():
    from dispatch.connectors.base import LeaseLost
    from dispatch.worker.runner import AttemptFence, ExecutionControl

    run = trigger(BindingFactory(job__max_attempts=1))
    c = claim_one()
    control = ExecutionControl(c)
    fence = AttemptFence(control)
    fence.check()  # ours: RUNNING with our token, heartbeat fresh
    control.last_heartbeat_ok -= c.lease_seconds + 1  # our own clock says the lease is gone
    with pytest.raises(LeaseLost, match="no successful heartbeat"):
        fence.check()
    control.last_heartbeat_ok += c.lease_seconds + 1
    services.cancel_run(run)
    expire(Attempt(pk=c.attempt_id))
    claims.recover()  # CANCELLED, no successor
    with pytest.raises(LeaseLost, match="no longer this worker's"):
        fence.check()
