"""A fault (an exception no connector expects) is never swallowed: the attempt records it,
and the worker log keeps its message, sanitized as the attempt's error is (a datasource's
secrets, URL credentials and password=... pairs masked), and where it was raised."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from dispatch.connectors.postgresql import PostgreSQLConnector
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt
from dispatch.worker.runner import ExecutionControl, Runner, StopCause
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory, trigger
from tests.support.helpers import claim_one
from tests.support.processes import wait_until

TEXT = "xyzzy-not-for-the-log"
PASSWORD = "pw-9f3e-in-the-config"
FAULT = (
    f"could not read with {PASSWORD} from postgresql://app:hunter2@db/x"
    "\n  password=hunter2 on the second line"
)


def raise_fault(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(TEXT)


def raise_secret_fault(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(FAULT)


@pytest.mark.django_db(transaction=True)
def test_runner__a_connector_fault_is_the_attempts_error_and_logged_sanitized_with_where_it_was_raised(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PostgreSQLConnector, "open_reader", classmethod(raise_secret_fault))
    source = DatasourceFactory(
        kind="postgresql",
        config={"host": "127.0.0.1", "dbname": "src", "user": "app", "password": PASSWORD},
    )
    job = JobFactory(source_spec={"table": "items"})
    run = trigger(BindingFactory(job=job, source=source))
    claimed = claim_one()
    with caplog.at_level(logging.INFO, logger="dispatch.runner"):
        status = Runner(claimed, ExecutionControl(claimed)).execute()
    assert status == Status.RETRY_SCHEDULED
    attempt = Attempt.objects.get(pk=claimed.attempt_id)
    assert attempt.reason == Reason.ERROR
    assert attempt.error.startswith("RuntimeError: could not read with ********")
    (record,) = [r for r in caplog.records if r.getMessage().startswith("attempt error")]
    message = record.getMessage()
    first = message.splitlines()[0]
    assert first == (
        "attempt error RuntimeError: could not read with ******** from "
        # The line break of the error is escaped (one log line per record).
        "postgresql://********@db/x\\n  password=******** on the second line "
        f"run={run.pk} attempt=1 token={claimed.lease_token}"
    )
    assert "in raise_secret_fault" in message  # the frame that raised it
    (settled,) = [r for r in caplog.records if r.getMessage().startswith("attempt settled")]
    line = settled.getMessage()
    assert "status=RETRY_SCHEDULED reason=ERROR rows_read=0 rows_written=0 duration=" in line
    assert (
        "error=RuntimeError: could not read with ******** from postgresql://********@db/x" in line
    )
    for text in (message, line):
        assert PASSWORD not in text and "hunter2" not in text
        assert "\n  password" not in text


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
