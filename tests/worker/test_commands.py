"""The management commands: thin, with clear errors for bad input."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import CommandError, call_command

from dispatch.core.states import Status
from dispatch.models import Run
from tests.support.factories import BindingFactory, trigger

pytestmark = pytest.mark.django_db(transaction=True)


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_trigger__by_name_prints_the_run_id():
    binding = BindingFactory(name="nightly-orders")
    run_id = run_command("trigger", "nightly-orders").strip()
    assert Run.objects.get(pk=run_id).binding_id == binding.pk


def test_trigger__by_id_with_idempotency_key_is_idempotent():
    binding = BindingFactory()
    first = run_command("trigger", str(binding.pk), "--idempotency-key", "k").strip()
    second = run_command("trigger", str(binding.pk), "--idempotency-key", "k").strip()
    assert first == second and Run.objects.count() == 1


@pytest.mark.parametrize("args", [("trigger", "no-such-binding"), ("trigger", str(uuid.uuid4()))])
def test_trigger__unknown_binding_is_a_clear_error(args):
    with pytest.raises(CommandError, match="No binding with id or name"):
        run_command(*args)
    assert Run.objects.count() == 0


@pytest.mark.parametrize("command", ["cancel", "retry"])
def test_cancel_and_retry__unknown_or_malformed_run_ids_are_clear_errors(command):
    with pytest.raises(CommandError, match="is not a run id"):
        run_command(command, "abc")
    with pytest.raises(CommandError, match="No run with id"):
        run_command(command, str(uuid.uuid4()))


def test_cancel_then_retry_report_outcomes_and_refusals():
    run = trigger(BindingFactory())
    assert run_command("cancel", str(run.id)).strip() == f"{run.id} CANCELLED"
    with pytest.raises(CommandError, match="already finished"):
        run_command("cancel", str(run.id))
    assert run_command("retry", str(run.id)).strip() == f"{run.id} RETRIED"
    assert Run.objects.get(pk=run.pk).status == Status.PENDING


def test_recover__prints_what_it_settled():
    assert "settled 0 expired attempt(s)" in run_command("recover")


def test_runworker__rejects_bad_arguments():
    with pytest.raises(CommandError, match="--concurrency must be at least 1"):
        run_command("runworker", "--concurrency", "0")
