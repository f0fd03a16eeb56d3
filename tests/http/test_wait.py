"""The long-poll: `GET runs/{id}/wait` answers once a real worker (a subprocess) has
settled the run, well before its timeout; without a worker it answers at the timeout
with the run as it stands."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dispatch.models import Run
from tests.support.factories import BindingFactory
from tests.support.processes import Processes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_wait__answers_when_the_worker_settles_the_run(
    http: Any, operator_token: str, processes: Processes
) -> None:
    BindingFactory(name="slow", job__source_spec={"rows": 20, "batch": 5, "delay_ms": 200})
    run = http("POST", "/bindings/slow/trigger", token=operator_token).json
    answers: list[tuple[Any, float]] = []
    started = time.monotonic()

    def wait() -> None:
        answer = http("GET", f"/runs/{run['id']}/wait?timeout=50", token=operator_token)
        answers.append((answer, time.monotonic() - started))

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The run stays PENDING until a worker exists: the wait is under way before it can end.
    worker = processes.worker("--burst")
    waiter.join(60)
    assert answers, "the long-poll never answered"
    answer, elapsed = answers[0]
    assert answer.status == 200, answer.text
    assert answer.json["status"] == "SUCCEEDED" and answer.json["finished"]
    assert answer.json["attempts"][-1]["rows_written"] == 20
    assert elapsed < 45, f"answered after {elapsed:.1f} s: at the timeout, not at settlement"
    assert Run.objects.get(pk=run["id"]).finished_at is not None
    assert worker.wait(30) == 0


def test_wait__at_the_timeout_answers_the_run_as_it_stands(http: Any, operator_token: str) -> None:
    BindingFactory(name="idle")
    run = http("POST", "/bindings/idle/trigger", token=operator_token).json
    started = time.monotonic()
    answer = http("GET", f"/runs/{run['id']}/wait?timeout=1.5", token=operator_token)
    elapsed = time.monotonic() - started
    assert answer.status == 200
    assert answer.json["status"] == "PENDING" and not answer.json["finished"]
    assert 1.5 <= elapsed < 10
