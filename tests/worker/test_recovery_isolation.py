"""Time arithmetic clamped in SQL, and a recovery pass that isolates a failing row.

A job whose backoff would overflow the timestamp cannot be stored (CHECK constraints bound
the settings); to prove the SQL clamp on its own, each test drops the constraint inside its
own transaction (rolled back at the end) and writes the bad values with a direct UPDATE."""

from __future__ import annotations

import pytest
from django.db import connection

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Job, Run
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of, claim_one, expire

pytestmark = pytest.mark.django_db

MAX_DELAY_SECONDS = 31_622_400  # dispatch_settle_v3's clamp (366 days)


def overflowing_backoff(job: Job) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "ALTER TABLE dispatch_job DROP CONSTRAINT IF EXISTS dispatch_job_backoff_max"
        )
        cursor.execute(
            "UPDATE dispatch_job SET backoff_seconds = 1e300, backoff_max_seconds = 1e300 "
            "WHERE id = %s",
            [job.pk],
        )


def test_settle__an_overflowing_backoff_is_clamped_not_raised():
    run = trigger(BindingFactory(job__max_attempts=3))
    overflowing_backoff(run.binding.job)
    c = claim_one()
    assert (
        claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR, error="x")
        == Status.RETRY_SCHEDULED
    )
    first, second = attempts_of(run)
    delay = (second.available_at - first.finished_at).total_seconds()
    assert MAX_DELAY_SECONDS / 2 <= delay <= MAX_DELAY_SECONDS


def test_recover__a_failing_row_is_reported_and_skipped_and_the_rest_are_settled():
    runs = [trigger(BindingFactory(job__max_attempts=3)) for _ in range(3)]
    held = [claim_one() for _ in runs]
    for i, c in enumerate(held):
        expire(Attempt(pk=c.attempt_id), seconds_ago=10 - i)  # held[0] is recovered first
    bad = held[0]
    # A real failure inside the settlement of one row: a trigger that raises on its update.
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION dispatch_test_boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'boom for %', OLD.id; END $$;
            """
        )
        cursor.execute(
            f"""
            CREATE TRIGGER dispatch_test_boom BEFORE UPDATE ON dispatch_attempt
            FOR EACH ROW WHEN (OLD.id = '{bad.attempt_id}'::uuid)
            EXECUTE FUNCTION dispatch_test_boom()
            """
        )
    # limit=1: the failing row fills a whole batch, and must not be picked again.
    results = claims.recover(limit=1)
    by_attempt = {r.attempt_id: r for r in results}
    assert set(by_attempt) == {c.attempt_id for c in held}
    failed = by_attempt[bad.attempt_id]
    assert failed.outcome is None and failed.error is not None and "boom for" in failed.error
    assert Attempt.objects.get(pk=bad.attempt_id).status == Status.RUNNING  # rolled back alone
    assert Run.objects.get(pk=bad.run_id).status == Status.RUNNING
    for c in held[1:]:
        assert by_attempt[c.attempt_id].outcome == Status.RETRY_SCHEDULED
        assert Attempt.objects.get(pk=c.attempt_id).status == Status.RETRY_SCHEDULED
        assert Run.objects.get(pk=c.run_id).status == Status.PENDING


def test_recover__an_overflowing_backoff_is_settled_beside_the_others():
    runs = [trigger(BindingFactory(job__max_attempts=3)) for _ in range(2)]
    overflowing_backoff(runs[0].binding.job)
    held = [claim_one() for _ in runs]
    for c in held:
        expire(Attempt(pk=c.attempt_id))
    assert sorted(str(r.outcome) for r in claims.recover()) == [Status.RETRY_SCHEDULED] * 2
