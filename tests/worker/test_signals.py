"""`dispatch.signals`: run_started, attempt_finished and run_finished, each sent after the
change it reports has committed, in the process that made it; a receiver that raises is
logged and never breaks the worker.

A worker subprocess cannot call this test's receivers, so the worker runs in this process
(the coordinator on a thread of its own, as `runworker --burst`). Every receiver reads the
rows it is told about on a connection of its own: it sees only committed state."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from django.db import connections, transaction

from dispatch import api, services, signals
from dispatch.core.states import Status
from dispatch.models import Attempt, Run
from dispatch.worker import claims
from dispatch.worker.coordinator import WorkerDispatchCoordinator
from tests.support.factories import BindingFactory, JobFactory
from tests.support.helpers import claim_one, expire
from tests.support.processes import test_database_url


@dataclass(frozen=True)
class Event:
    name: str
    kwargs: dict[str, Any]
    # What a connection of the receiver's own read at that moment: the attempt's status
    # and worker, the run's status and whether it has finished_at.
    attempt: tuple[str, str | None] | None
    run: tuple[str, bool] | None


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def receiver(self, name: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            with psycopg.connect(test_database_url(), autocommit=True) as conn:
                attempt = conn.execute(
                    "SELECT status, worker_id FROM dispatch_attempt WHERE id = %s",
                    [kwargs["attempt_id"]],
                ).fetchone()
                run = conn.execute(
                    "SELECT status, finished_at IS NOT NULL FROM dispatch_run WHERE id = %s",
                    [kwargs["run_id"]],
                ).fetchone()
            with self._lock:
                self.events.append(Event(name, kwargs, attempt, run))  # type: ignore[arg-type]

        receive.__qualname__ = f"record_{name}"
        return receive

    def of(self, run: Run) -> list[Event]:
        return [e for e in self.events if e.kwargs["run_id"] == run.pk]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    receivers = [
        (signals.run_started, rec.receiver("run_started")),
        (signals.attempt_finished, rec.receiver("attempt_finished")),
        (signals.run_finished, rec.receiver("run_finished")),
    ]
    for signal, receiver in receivers:
        signal.connect(receiver, weak=False)
    try:
        yield rec
    finally:
        for signal, receiver in receivers:
            signal.disconnect(receiver)


def bad_receiver(sender: Any, **kwargs: Any) -> None:
    raise ValueError("boom token=abc\x1b[2J and\nmore")


def _run_worker(worker_id: str) -> None:
    """`runworker --burst` on a thread of this process (so no signal handlers)."""
    failure: list[BaseException] = []

    coordinator = WorkerDispatchCoordinator(worker_id=worker_id, burst=True, poll_interval=0.2)

    def target() -> None:
        try:
            coordinator.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            failure.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the burst worker did not finish"
    assert not failure, failure
    for t in coordinator._threads:  # each closes its connection as it ends
        t.join(10)


@pytest.mark.django_db(transaction=True)
def test_worker__signals_follow_each_run_after_commit_and_a_raising_receiver_breaks_nothing(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    ok = api.trigger(BindingFactory(job=JobFactory(source_spec={"rows": 20, "batch": 5})))
    failing = api.trigger(
        BindingFactory(
            job=JobFactory(source_spec={"rows": 20, "batch": 5, "fail_after": 5}, max_attempts=2)
        )
    )
    signals.run_started.connect(bad_receiver)
    signals.run_finished.connect(bad_receiver)
    try:
        with caplog.at_level(logging.ERROR, logger="dispatch.signals"):
            _run_worker("w-signals")
    finally:
        signals.run_started.disconnect(bad_receiver)
        signals.run_finished.disconnect(bad_receiver)

    ok_events = recorder.of(ok)
    assert [(e.name, e.kwargs.get("status")) for e in ok_events] == [
        ("run_started", None),
        ("attempt_finished", Status.SUCCEEDED),
        ("run_finished", Status.SUCCEEDED),
    ]
    failing_events = recorder.of(failing)
    assert [(e.name, e.kwargs["attempt"], e.kwargs.get("status")) for e in failing_events] == [
        ("run_started", 1, None),
        ("attempt_finished", 1, Status.RETRY_SCHEDULED),
        ("run_started", 2, None),
        ("attempt_finished", 2, Status.FAILED),
        ("run_finished", 2, Status.FAILED),
    ]
    for run, events in ((ok, ok_events), (failing, failing_events)):
        for e in events:
            assert e.kwargs["run_id"] == run.pk and e.kwargs["binding_id"] == run.binding_id
            assert (
                e.kwargs["attempt_id"]
                == Attempt.objects.get(run=run, number=e.kwargs["attempt"]).pk
            )
            # Each receiver saw the committed state it was told about.
            if e.name == "run_started":
                assert e.kwargs["worker_id"] == "w-signals"
                assert e.attempt == (Status.RUNNING, "w-signals")
            else:
                assert e.attempt is not None and e.attempt[0] == e.kwargs["status"]
            if e.name == "run_finished":
                assert e.run == (e.kwargs["status"], True)

    # The raising receiver ran for every start and finish, and only cost a log line each.
    assert Run.objects.get(pk=ok.pk).status == Status.SUCCEEDED
    failures = [
        r.getMessage() for r in caplog.records if "signal receiver failed" in r.getMessage()
    ]
    assert len(failures) == 3 + 2  # three starts, two finishes
    first = failures[0].splitlines()[0]
    assert "receiver=bad_receiver" in first
    # The receiver's text on one line, its control characters escaped.
    assert "error=ValueError: boom token=abc\\x1b[2J and\\nmore" in first
    assert "\x1b" not in failures[0]
    assert any("in bad_receiver" in m for m in failures)


@pytest.mark.django_db(transaction=True)
def test_cancel__the_signals_wait_for_the_callers_commit_and_a_rollback_sends_none(
    recorder: Recorder,
) -> None:
    binding = BindingFactory()
    rolled_back = api.trigger(binding)
    with pytest.raises(RuntimeError), transaction.atomic():
        api.cancel(rolled_back)
        raise RuntimeError("the caller's transaction fails")
    assert recorder.events == []
    assert Run.objects.get(pk=rolled_back.pk).status == Status.PENDING

    run = api.trigger(binding)
    with transaction.atomic():
        api.cancel(run)
        assert recorder.events == []  # not before the commit
    assert [(e.name, e.kwargs["status"], e.attempt, e.run) for e in recorder.of(run)] == [
        ("attempt_finished", Status.CANCELLED, (Status.CANCELLED, None), (Status.CANCELLED, True)),
        ("run_finished", Status.CANCELLED, (Status.CANCELLED, None), (Status.CANCELLED, True)),
    ]


@pytest.mark.django_db(transaction=True)
def test_recovery_and_release__settlements_outside_a_worker_send_their_signals(
    recorder: Recorder,
) -> None:
    retried = api.trigger(BindingFactory(job=JobFactory(max_attempts=3)))
    expire(Attempt.objects.get(pk=claim_one("w-gone").attempt_id))
    last = api.trigger(BindingFactory(job=JobFactory(max_attempts=1)))
    expire(Attempt.objects.get(pk=claim_one("w-gone").attempt_id))
    settled = claims.recover()  # what `manage.py recover` and every worker's pass run
    assert {r.run_id: r.outcome for r in settled} == {
        retried.pk: Status.RETRY_SCHEDULED,
        last.pk: Status.FAILED,
    }
    assert [(e.name, e.kwargs["status"], e.attempt) for e in recorder.of(retried)] == [
        ("attempt_finished", Status.RETRY_SCHEDULED, (Status.RETRY_SCHEDULED, "w-gone")),
    ]
    assert [(e.name, e.kwargs["status"], e.run) for e in recorder.of(last)] == [
        ("attempt_finished", Status.FAILED, (Status.FAILED, True)),
        ("run_finished", Status.FAILED, (Status.FAILED, True)),
    ]

    released = api.trigger(BindingFactory())
    claimed = claim_one("w-held", run_id=released.pk, generic=False)
    services.release_attempt(claimed.attempt_id, by="ops")
    assert [(e.name, e.kwargs["status"], e.kwargs["attempt"]) for e in recorder.of(released)] == [
        ("attempt_finished", Status.RETRY_SCHEDULED, 1),
    ]
