"""The event log written by a real `runworker`: a successful, a failed and a killed
(SIGKILL, then recovered) attempt, on one pair of worker processes."""

from __future__ import annotations

import pytest

from dispatch.core.states import Status
from dispatch.models import Attempt, AttemptEvent, Run
from tests.support.factories import BindingFactory, trigger
from tests.support.gates import kill
from tests.support.helpers import attempts_of
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def start(processes: Processes, worker_id: str):
    # A progress event every second (the smallest the setting takes).
    proc = processes.worker(
        "--worker-id", worker_id, env=worker_env(DISPATCH_EVENT_PROGRESS_SECONDS="1")
    )
    wait_until(
        lambda: "listening worker=" in processes.output(proc) or proc.poll() is not None,
        message="worker listening",
    )
    assert proc.poll() is None, processes.output(proc)
    return proc


def finished(run: Run, timeout: float = 30) -> str:
    return wait_until(
        lambda: (
            Run.objects.filter(pk=run.pk, finished_at__isnull=False)
            .values_list("status", flat=True)
            .first()
        ),
        timeout=timeout,
        message=f"run {run.id} to finish",
    )


def kinds(attempt: Attempt) -> list[str]:
    return list(attempt.events.order_by("seq").values_list("kind", flat=True))


def test_worker_events__success_failure_and_a_killed_attempt(processes):
    victim = start(processes, "victim")

    ok = trigger(BindingFactory())
    assert finished(ok) == Status.SUCCEEDED
    [attempt] = attempts_of(ok)
    assert kinds(attempt) == [
        "claimed",
        "connected",
        "connected",
        "read_started",
        "committed",
        "settled",
    ]
    claimed, source, sink = attempt.events.order_by("seq")[:3]
    assert claimed.data["worker"] == "victim" and claimed.data["token"] == attempt.lease_token
    assert (source.data["side"], source.data["connector"]) == ("source", "generate")
    assert (sink.data["side"], sink.data["connector"]) == ("sink", "null")
    committed = attempt.events.get(kind="committed")
    assert committed.data["rows_written"] == 10
    assert attempt.events.get(kind="settled").data["status"] == Status.SUCCEEDED
    assert attempt.events_dropped == 0

    bad = trigger(
        BindingFactory(job__max_attempts=1, job__source_spec={"rows": 10, "fail_after": 3})
    )
    assert finished(bad) == Status.FAILED
    [failed] = attempts_of(bad)
    assert kinds(failed)[-2:] == ["error", "settled"]
    error = failed.events.get(kind="error")
    assert error.data["error_class"] == "TransientError"
    assert "fail_after=3" in error.message
    assert failed.events.get(kind="settled").data["status"] == Status.FAILED

    # Killed mid-run: what its heartbeats wrote stays; recovery adds the settlement.
    slow = trigger(
        BindingFactory(
            job__lease_seconds=2, job__source_spec={"rows": 50, "batch": 1, "delay_ms": 100}
        )
    )
    wait_until(
        lambda: AttemptEvent.objects.filter(
            attempt__run=slow, attempt__worker_id="victim", kind="progress"
        ).exists(),
        message="a heartbeat to write the victim's progress",
    )
    kill(victim)
    start(processes, "rescuer")
    assert finished(slow, timeout=40) == Status.SUCCEEDED
    first, second = attempts_of(slow)
    assert first.worker_id == "victim" and second.worker_id == "rescuer"
    logged = kinds(first)
    assert logged[:4] == ["claimed", "connected", "connected", "read_started"]
    assert "progress" in logged and logged[-1] == "settled"
    settled = first.events.get(kind="settled")
    assert settled.data["outcome"] == "EXPIRED" and settled.message.startswith("lease expired")
    progress = first.events.filter(kind="progress").first()
    assert progress is not None and progress.data["rows_read"] > 0
    assert kinds(second)[0] == "claimed" and kinds(second)[-2:] == ["committed", "settled"]
    assert second.events.get(kind="claimed").data["worker"] == "rescuer"
