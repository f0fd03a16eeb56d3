"""A fault (an exception no connector expects) is never swallowed: the attempt records it,
and the worker log keeps where it was raised but not its text, which may carry a
datasource's secrets."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from dispatch.connectors.builtin import GenerateConnector
from dispatch.models import Attempt
from dispatch.states import Reason, Status
from dispatch.worker.runner import ExecutionControl, Runner, StopCause
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import claim_one
from tests.support.processes import wait_until

TEXT = "xyzzy-not-for-the-log"


def raise_fault(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(TEXT)


@pytest.mark.django_db(transaction=True)
def test_runner__a_connector_fault_is_the_attempts_error_and_logged_with_where_it_was_raised(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(GenerateConnector, "open_reader", classmethod(raise_fault))
    run = trigger(BindingFactory())
    claimed = claim_one()
    with caplog.at_level(logging.WARNING, logger="dispatch.runner"):
        status = Runner(claimed, ExecutionControl(claimed)).execute()
    assert status == Status.RETRY_SCHEDULED
    attempt = Attempt.objects.get(pk=claimed.attempt_id)
    assert attempt.reason == Reason.ERROR
    assert f"RuntimeError: {TEXT}" in (attempt.error or "")
    (record,) = [r for r in caplog.records if r.getMessage().startswith("attempt error")]
    message = record.getMessage()
    assert f"attempt error RuntimeError run={run.pk}" in message
    assert "in raise_fault" in message  # the frame that raised it
    assert TEXT not in message


@pytest.mark.django_db(transaction=False)
def test_control__a_failing_interrupt_is_logged_with_where_it_was_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    control = ExecutionControl(SimpleNamespace(lease_seconds=30, timeout_seconds=None))  # type: ignore[arg-type]
    control.on_stop(raise_fault)
    with caplog.at_level(logging.WARNING, logger="dispatch.runner"):
        control.stop(StopCause.CANCEL)
        record = wait_until(
            lambda: next((r for r in caplog.records if "interrupting" in r.getMessage()), None),
            message="the interrupt's log line",
        )
    message = record.getMessage()
    assert "error=RuntimeError" in message
    assert "in raise_fault" in message
    assert TEXT not in message
