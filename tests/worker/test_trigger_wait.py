"""`manage.py trigger --wait` says how a run ended (status, reason, the error's first line,
rows read and written, duration), and the worker's log lines carry the error and the
settled attempt's rows and duration."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import CommandError, call_command

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource
from tests.support.factories import BindingFactory, JobFactory
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ERROR = "reader broke at row 7\nDETAIL: the second line says more"


def test_trigger_wait__a_failed_run_prints_reason_error_rows_and_duration(
    processes: Processes,
) -> None:
    source = Datasource(name="breaks", kind="test_failing", config={})
    source.save()
    # Its estimate reaches the attempt with a heartbeat (every lease / 3 = 1 s): the
    # source fails only after a few.
    job = JobFactory(
        source_spec={"rows": 7, "expect": 10, "wait": 3, "error": ERROR},
        max_attempts=3,
        lease_seconds=3,
    )
    BindingFactory(name="breaks-to-null", job=job, source=source)
    worker = processes.worker(
        env=worker_env(DISPATCH_CONNECTORS="tests.support.connectors.FailingSource")
    )
    wait_until(
        lambda: "listening worker=" in processes.output(worker) or worker.poll() is not None,
        message="the worker listening",
    )
    assert worker.poll() is None, processes.output(worker)
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError, match=r"^Run [0-9a-f-]{36} finished FAILED\.$"):
        call_command(
            "trigger", "breaks-to-null", "--wait", "--timeout", "60", stdout=out, stderr=err
        )
    run_id = out.getvalue().strip()
    attempt = Attempt.objects.get(run_id=run_id)
    assert (attempt.status, attempt.reason) == (Status.FAILED, Reason.PERMANENT_ERROR)
    lines = err.getvalue().splitlines()
    summary = lines[-3:]
    assert re.fullmatch(
        rf"Run {run_id} FAILED in \d+\.\d s \(1 attempt\), reason PERMANENT_ERROR\.", summary[0]
    ), lines
    assert summary[1] == "Error: reader broke at row 7"  # the first line only
    assert re.fullmatch(
        r"Rows: 7 read, 7 written \(about 10 expected\), [\d.,]+ rows/s\.", summary[2]
    ), summary
    assert "DETAIL" not in err.getvalue()
    # While it waited (not a terminal): a plain line per status, no drawing.
    assert lines[0].startswith(f"Run {run_id} "), lines
    assert "\x1b" not in err.getvalue()

    log = wait_until(
        lambda: next((t for t in [processes.output(worker)] if "attempt settled" in t), None),
        message="the worker's settled line",
    )
    (settled,) = [line for line in log.splitlines() if "attempt settled" in line]
    assert re.search(
        r"attempt settled status=FAILED reason=PERMANENT_ERROR rows_read=7 rows_written=7 "
        r"duration=\d+\.\d{3}s error=reader broke at row 7\\nDETAIL: the second line says more "
        rf"run={run_id} attempt=1 token=\d+$",
        settled,
    ), settled
