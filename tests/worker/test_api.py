"""`dispatch.api`, the Python API for host code: triggers with idempotency keys, cancel,
retry and wait, with clear errors."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connections

from dispatch import api
from dispatch.core.states import Origin, Reason, Status, Trigger
from dispatch.models import Attempt, Run
from dispatch.services import Outcome
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.factories import BindingFactory, JobFactory
from tests.support.helpers import claim_one


@pytest.mark.django_db(transaction=True)
def test_trigger__the_same_idempotency_key_twice_returns_the_same_run() -> None:
    binding = BindingFactory()
    first = api.trigger(binding, idempotency_key="order-17", requested_by="shop")
    # By instance, by name and by id: one run.
    again = api.trigger(binding.name, idempotency_key="order-17")
    by_id = api.trigger(str(binding.pk), idempotency_key="order-17")
    assert first.pk == again.pk == by_id.pk
    assert Run.objects.count() == 1 and Attempt.objects.count() == 1
    stored = Run.objects.get()
    assert stored.trigger == Trigger.API
    assert stored.idempotency_key == "order-17" and stored.requested_by == "shop"
    # Without a key, a new run each time.
    assert api.trigger(binding.pk).pk != first.pk


@pytest.mark.django_db(transaction=True)
def test_trigger__a_key_of_another_bindings_run_is_a_conflict_and_creates_nothing() -> None:
    one, other = BindingFactory(), BindingFactory()
    run = api.trigger(one, idempotency_key="k")
    with pytest.raises(api.IdempotencyConflict, match=f"'k' already names run {run.pk}") as info:
        api.trigger(other, idempotency_key="k")
    assert info.value.run.pk == run.pk
    with pytest.raises(api.IdempotencyConflict):
        api.trigger_many([one, other], idempotency_keys=["fresh", "k"])
    assert Run.objects.count() == 1  # neither "fresh" nor a second "k"


@pytest.mark.django_db(transaction=True)
def test_trigger__bad_references_and_keys_are_clear_errors() -> None:
    binding = BindingFactory()
    with pytest.raises(api.NotFound, match="no binding with id or name 'nope'"):
        api.trigger("nope")
    with pytest.raises(api.NotFound, match="no binding with id or name"):
        api.trigger(uuid.uuid4())
    with pytest.raises(TypeError, match="a binding is a JobBinding, its id or its name, not int"):
        api.trigger(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty string"):
        api.trigger(binding, idempotency_key="")
    with pytest.raises(ValueError, match="at most 200 characters, not 201"):
        api.trigger(binding, idempotency_key="x" * 201)
    with pytest.raises(ValueError, match="idempotency_keys has 1 items for 2 bindings"):
        api.trigger_many([binding, binding], idempotency_keys=["a"])
    with pytest.raises(TypeError, match="use trigger"):
        api.trigger_many(binding)  # type: ignore[arg-type]
    with pytest.raises(api.NotFound, match="'x' is not a run id"):
        api.cancel("x")
    with pytest.raises(api.NotFound, match="no run"):
        api.retry(uuid.uuid4())
    assert Run.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_trigger_many__creates_runs_in_order_and_each_key_once() -> None:
    a, b = BindingFactory(), BindingFactory()
    runs = api.trigger_many([a, b.name, a], idempotency_keys=["k1", None, "k3"])
    assert [r.binding_id for r in runs] == [a.pk, b.pk, a.pk]
    assert [r.idempotency_key for r in runs] == ["k1", None, "k3"]
    again = api.trigger_many([a, a], idempotency_keys=["k3", "k1"])
    assert [r.pk for r in again] == [runs[2].pk, runs[0].pk]
    assert Run.objects.count() == 3
    assert set(Run.objects.values_list("trigger", flat=True)) == {Trigger.API}
    assert api.trigger_many([]) == []


@pytest.mark.django_db(transaction=True)
def test_cancel_and_retry__outcomes_and_refusals() -> None:
    run = api.trigger(BindingFactory())
    assert api.cancel(run) == Outcome.CANCELLED
    with pytest.raises(api.ActionRefused, match="already finished") as refused:
        api.cancel(str(run.pk))
    assert refused.value.code == "ALREADY_FINISHED"
    assert api.retry(run.pk, by="ops") == Outcome.RETRIED
    latest = Attempt.objects.filter(run=run).order_by("-number").first()
    assert latest is not None and (latest.number, latest.origin) == (2, Origin.OPERATOR)
    with pytest.raises(api.ActionRefused) as refused:
        api.retry(run)
    assert refused.value.code == "NOT_RETRYABLE"
    assert isinstance(refused.value, api.DispatchError)


@pytest.mark.django_db(transaction=True)
def test_wait__times_out_with_the_run_as_last_seen() -> None:
    run = api.trigger(BindingFactory())  # no worker: it stays PENDING
    seen: list[str] = []
    started = time.monotonic()
    with pytest.raises(api.WaitTimeout, match=f"run {run.pk} is still PENDING after 0.5 s") as info:
        api.wait(run, timeout=0.5, poll_interval=0.2, on_progress=lambda r: seen.append(r.status))
    waited = time.monotonic() - started
    assert 0.5 <= waited < 5
    assert info.value.result.status == Status.PENDING and not info.value.result.finished
    # A read at once, then backing off: a handful of reads, not a busy loop.
    assert 2 <= len(seen) <= 8, seen
    with pytest.raises(ValueError, match="timeout must be at least 0"):
        api.wait(run, timeout=-1)
    with pytest.raises(api.NotFound):
        api.wait(uuid.uuid4(), timeout=1)


@pytest.mark.django_db(transaction=True)
def test_wait__returns_the_finished_run_with_its_reason_error_rows_and_duration() -> None:
    job = JobFactory(source_spec={"rows": 10, "batch": 5, "fail_after": 5}, max_attempts=1)
    run = api.trigger(BindingFactory(job=job))

    polled = threading.Event()

    def work() -> None:
        try:
            polled.wait(30)  # the wait below has seen the run unfinished
            claimed = claim_one()
            Runner(claimed, ExecutionControl(claimed)).execute()
        finally:
            connections.close_all()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        result = api.wait(run.pk, timeout=30, on_progress=lambda r: polled.set())
    finally:
        worker.join(30)
    assert result.status == Status.FAILED and result.finished and not result.succeeded
    assert result.reason == Reason.ERROR
    assert result.error_line == "generate: fail_after=5 rows reached"
    assert (result.rows_read, result.rows_written, result.attempts) == (5, 5, 1)
    assert result.duration_seconds > 0
    assert result.binding == run.binding.name
