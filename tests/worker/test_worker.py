"""`runworker` as a real process: wake-ups, lost and bogus notifications, kill -9,
cancellation, SIGTERM drain, blocked work, a lost LISTEN connection."""

from __future__ import annotations

import signal
import uuid

import psycopg
import pytest
from django.test import override_settings

from dispatch import services
from dispatch.core.states import BlockedReason, Origin, Reason, Status
from dispatch.models import Attempt, JobBinding, Run, Worker
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of
from tests.support.processes import Processes, test_database_url, wait_until, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


# A job that runs for about rows * delay_ms / batch milliseconds.
def slow_spec(seconds: float) -> dict[str, int]:
    return {"rows": int(seconds * 10), "batch": 1, "delay_ms": 100}


def start_worker(processes: Processes, *args: str, env: dict[str, str] | None = None):
    proc = processes.worker(*args, env=env)
    wait_until(
        lambda: "listening worker=" in processes.output(proc) or proc.poll() is not None,
        message="worker listening",
    )
    assert proc.poll() is None, processes.output(proc)
    return proc


def status_of(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.pk)


def finished(run: Run, expected: str = Status.SUCCEEDED, timeout: float = 30):
    wait_until(
        lambda: status_of(run) in (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED),
        timeout=timeout,
        message=f"run {run.id} to finish",
    )
    assert status_of(run) == expected
    return Run.objects.get(pk=run.pk)


def notify(payload: str) -> None:
    with psycopg.connect(test_database_url(), autocommit=True) as conn:
        conn.execute("SELECT pg_notify('dispatch_runs', %s)", [payload])


def test_worker__a_notified_run_is_claimed_by_the_directed_path(processes):
    proc = start_worker(processes, "--poll-interval", "60", "--worker-id", "w-directed")
    run = trigger(BindingFactory())
    finished(run)
    assert attempts_of(run)[0].worker_id == "w-directed"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert Worker.objects.get(pk="w-directed").stats["directed_hits"] == 1


def test_worker__run_triggered_before_the_worker_started_is_not_lost(processes):
    run = trigger(BindingFactory())  # its notification reached nobody
    start_worker(processes, "--poll-interval", "60")
    finished(run)


def test_worker__without_notifications_polling_finds_the_work(processes):
    start_worker(processes, "--poll-interval", "0.5")
    with override_settings(DISPATCH_CHANNEL="nobody_listens"):
        run = trigger(BindingFactory())
    finished(run)


def test_worker__unknown_garbage_and_duplicate_notifications_change_nothing(processes):
    proc = start_worker(processes, "--poll-interval", "60", "--worker-id", "w-bogus")
    with override_settings(DISPATCH_CHANNEL="nobody_listens"):
        silent = trigger(BindingFactory())
    for payload in ["not-a-uuid", "", "'; DROP TABLE dispatch_run; --", str(uuid.uuid4())]:
        notify(payload)
    # The unknown id's directed claim misses and falls back to the oldest due work.
    finished(silent)
    loud = trigger(BindingFactory())
    for _ in range(5):
        notify(str(loud.id))
    finished(loud)
    assert [a.status for a in attempts_of(loud)] == [Status.SUCCEEDED]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    stats = Worker.objects.get(pk="w-bogus").stats
    assert stats["notifications_malformed"] >= 3
    assert stats["directed_misses"] >= 1


def test_worker__kill_9_mid_run_is_retried_by_another_worker(processes):
    binding = BindingFactory(job__lease_seconds=2, job__source_spec=slow_spec(3))
    victim = start_worker(processes, "--worker-id", "victim")
    run = trigger(binding)
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING, worker_id="victim").exists(),
        message="victim running the attempt",
    )
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    start_worker(processes, "--worker-id", "rescuer")
    finished(run, timeout=40)
    first, second = attempts_of(run)
    assert (first.worker_id, first.status, first.reason) == (
        "victim",
        Status.RETRY_SCHEDULED,
        Reason.LEASE_EXPIRED,
    )
    assert (second.worker_id, second.origin, second.status) == (
        "rescuer",
        Origin.RETRY,
        Status.SUCCEEDED,
    )
    assert second.rows_written == 30


def test_worker__cancel_of_a_running_run_stops_it_within_a_heartbeat(processes):
    binding = BindingFactory(job__lease_seconds=6, job__source_spec=slow_spec(60))
    start_worker(processes)
    run = trigger(binding)
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING, rows_read__gt=0).exists(),
        message="attempt running with progress",
    )
    assert services.cancel_run(run) == services.Outcome.CANCEL_REQUESTED
    done = finished(run, Status.CANCELLED, timeout=6 / 3 + 5)
    [a] = attempts_of(run)
    assert (a.status, a.reason) == (Status.CANCELLED, Reason.CANCELLED_BY_OPERATOR)
    assert 0 < a.rows_read < 600
    # The cancel notification made the worker heartbeat at once (well within lease / 3).
    assert (done.finished_at - done.cancel_requested_at).total_seconds() < 6 / 3


def test_worker__operator_retry_of_a_cancelled_run_runs_to_completion(processes):
    run = trigger(BindingFactory())
    services.cancel_run(run)
    services.retry_run(run)
    start_worker(processes)
    finished(run)
    assert [(a.origin, a.status) for a in attempts_of(run)] == [
        (Origin.TRIGGER, Status.CANCELLED),
        (Origin.OPERATOR, Status.SUCCEEDED),
    ]


def test_worker__sigterm_drains_releases_and_another_worker_takes_over_at_once(processes):
    binding = BindingFactory(
        job__lease_seconds=30, job__backoff_seconds=3600, job__source_spec=slow_spec(20)
    )
    draining = start_worker(
        processes, "--worker-id", "draining", env=worker_env(DISPATCH_SHUTDOWN_GRACE_SECONDS="1")
    )
    run = trigger(binding)
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING).exists(), message="running"
    )
    draining.send_signal(signal.SIGTERM)
    assert draining.wait(15) == 0
    first, second = attempts_of(run)
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.SHUTDOWN_RELEASED)
    assert (second.origin, second.status) == (Origin.RELEASE, Status.PENDING)
    assert second.available_at <= first.finished_at  # no backoff: due at once
    assert Worker.objects.get(pk="draining").stopped_at is not None
    start_worker(processes, "--worker-id", "successor")
    wait_until(
        lambda: Attempt.objects.filter(
            pk=second.pk, status=Status.RUNNING, worker_id="successor"
        ).exists(),
        message="successor claimed the released attempt",
    )


def test_worker__sigterm_lets_a_short_run_finish_within_the_grace_period(processes):
    binding = BindingFactory(job__source_spec=slow_spec(1.5))
    proc = start_worker(processes)
    run = trigger(binding)
    wait_until(
        lambda: Attempt.objects.filter(run=run, status=Status.RUNNING).exists(), message="running"
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert status_of(run) == Status.SUCCEEDED
    assert [a.status for a in attempts_of(run)] == [Status.SUCCEEDED]


def test_worker__blocked_work_waits_visibly_and_never_starves_others(processes):
    blocked = BindingFactory(enabled=False, max_concurrency=8, job__source_spec={"rows": 1})
    blocked_runs = [trigger(blocked) for _ in range(100)]
    enabled = BindingFactory(max_concurrency=8, job__source_spec={"rows": 1})
    enabled_runs = [trigger(enabled) for _ in range(10)]
    start_worker(processes, "--concurrency", "4")
    for run in enabled_runs:
        finished(run)
    assert (
        Run.objects.filter(pk__in=[r.pk for r in blocked_runs], status=Status.PENDING).count()
        == 100
    )
    assert (
        Attempt.objects.filter(
            run__in=blocked_runs, blocked_reason=BlockedReason.BINDING_DISABLED
        ).count()
        == 100
    )
    JobBinding.objects.filter(pk=blocked.pk).update(enabled=True)
    wait_until(
        lambda: (
            Run.objects.filter(pk__in=[r.pk for r in blocked_runs], status=Status.SUCCEEDED).count()
            == 100
        ),
        timeout=60,
        message="the formerly blocked runs to finish",
    )
    assert Attempt.objects.filter(run__in=blocked_runs, blocked_reason__isnull=False).count() == 0


def test_worker__reconnects_after_its_listen_connection_is_terminated(processes):
    proc = start_worker(processes, "--poll-interval", "60", "--worker-id", "w-listen")
    with psycopg.connect(test_database_url(), autocommit=True) as conn:
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            ["dispatch-listen w-listen%"],
        ).fetchall()
    assert killed == [(True,)]
    wait_until(
        lambda: processes.output(proc).count("listening worker=") >= 2, message="re-listening"
    )
    run = trigger(BindingFactory())
    finished(run, timeout=10)
    assert attempts_of(run)[0].worker_id == "w-listen"


def test_worker__job_timeout_ends_the_attempt_with_reason_timeout(processes):
    binding = BindingFactory(
        job__timeout_seconds=1, job__max_attempts=1, job__source_spec=slow_spec(30)
    )
    start_worker(processes)
    run = trigger(binding)
    finished(run, Status.FAILED, timeout=20)
    [a] = attempts_of(run)
    assert a.reason == Reason.TIMEOUT


def test_worker__connector_error_is_retried_then_fails_with_the_error_kept(processes):
    binding = BindingFactory(
        job__max_attempts=2, job__source_spec={"rows": 10, "batch": 2, "fail_after": 5}
    )
    start_worker(processes)
    run = trigger(binding)
    finished(run, Status.FAILED)
    assert [(a.status, a.reason) for a in attempts_of(run)] == [
        (Status.RETRY_SCHEDULED, Reason.ERROR),
        (Status.FAILED, Reason.ERROR),
    ]
    assert "fail_after=5" in attempts_of(run)[-1].error


def test_worker__burst_exits_when_nothing_is_claimable(processes):
    binding = BindingFactory(max_concurrency=4)
    runs = [trigger(binding) for _ in range(6)]
    proc = processes.worker("--burst", "--concurrency", "2")
    assert proc.wait(60) == 0
    assert {status_of(r) for r in runs} == {Status.SUCCEEDED}


def test_worker__sleeps_exactly_until_a_retry_is_due_not_until_the_next_poll(processes):
    binding = BindingFactory(
        job__max_attempts=2,
        job__backoff_seconds=2,
        job__backoff_max_seconds=2,
        job__source_spec={"rows": 4, "batch": 1, "fail_after": 2},
    )
    start_worker(processes, "--poll-interval", "60")
    run = trigger(binding)
    finished(run, Status.FAILED, timeout=20)
    first, second = attempts_of(run)
    waited = (second.claimed_at - first.finished_at).total_seconds()
    # Equal jitter puts the retry 1-2 s after the failure; the worker's timer claims it
    # then, long before its 60 s poll.
    assert (second.available_at - first.finished_at).total_seconds() >= 1
    assert second.claimed_at >= second.available_at
    assert waited < 5


# Polling at 30 s and the other intervals at their defaults: only the timer can claim a
# retry within a second of its available_at.
SLOW_POLLING = {
    "DISPATCH_POLL_INTERVAL": "30",
    "DISPATCH_IDLE_HEARTBEAT_SECONDS": "10",
    "DISPATCH_RECOVERY_INTERVAL": "60",
}


def test_worker__a_retry_that_recovery_creates_is_claimed_when_due_not_at_the_next_pass(
    processes,
):
    from tests.support.helpers import claim_one, expire

    binding = BindingFactory(
        job__max_attempts=2, job__backoff_seconds=3, job__backoff_max_seconds=3
    )
    run = trigger(binding)
    gone = claim_one("gone-worker")  # a worker that died holding the attempt
    expire(Attempt.objects.get(pk=gone.attempt_id))
    start_worker(processes, env=worker_env(**SLOW_POLLING))
    finished(run, Status.SUCCEEDED, timeout=20)
    first, second = attempts_of(run)
    assert (first.status, first.reason) == (Status.RETRY_SCHEDULED, Reason.LEASE_EXPIRED)
    # Recovered by the new worker's first pass; equal jitter puts the retry 1.5-3 s later.
    assert (second.available_at - first.finished_at).total_seconds() >= 1.4
    late = (second.claimed_at - second.available_at).total_seconds()
    assert 0 <= late < 1, late


def test_worker__a_notified_run_not_yet_due_sets_the_timer_of_the_worker_that_misses_it(
    processes,
):
    from datetime import timedelta

    from django.db import transaction
    from django.db.models.functions import Now

    binding = BindingFactory()
    start_worker(processes, env=worker_env(**SLOW_POLLING))
    # An attempt due in 3 s whose notification arrives now (what an operator's "run
    # later" or another worker's retry looks like to this worker).
    with transaction.atomic():
        run = trigger(binding)
        Attempt.objects.filter(run=run).update(available_at=Now() + timedelta(seconds=3))
    finished(run, Status.SUCCEEDED, timeout=20)
    [attempt] = attempts_of(run)
    late = (attempt.claimed_at - attempt.available_at).total_seconds()
    assert 0 <= late < 1, late
