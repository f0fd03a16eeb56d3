"""docs/api.md's orchestrator task, executed as the doc writes it: against a live server
and a real worker process, it waits for the run, returns it when it succeeded, raises when
it failed, and a retried task (same orchestrator run id) finds the run it started."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from dispatch.models import Run
from tests.http.conftest import make_token, make_user
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, Processes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MARK = "<!-- the orchestrator example: executed by tests/http/test_orchestrator_example.py -->"


def example() -> Callable[..., dict[str, Any]]:
    text = (ROOT / "docs" / "api.md").read_text()
    after = text[text.index(MARK) + len(MARK) :]
    block = re.match(r"\s*```python\n(.*?)```", after, re.S)
    assert block, "the example's code block follows its marker"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "docs/api.md", "exec"), namespace)
    return namespace["sync"]  # type: ignore[no-any-return]


def test_the_orchestrator_example_runs_against_a_real_worker(
    live_server: Any, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    BindingFactory(name="nightly-orders", job__source_spec={"rows": 30, "batch": 10})
    BindingFactory(
        name="breaks",
        job__max_attempts=1,
        job__source_spec={"rows": 10, "batch": 2, "fail_after": 4},
    )
    user = make_user("airflow", "dispatch.trigger_binding", "dispatch.view_run")
    _, token = make_token(user, name="airflow")
    monkeypatch.setenv("DISPATCH_URL", live_server.url + "/")
    monkeypatch.setenv("DISPATCH_TOKEN", token)
    sync = example()
    processes.worker()

    run = sync("nightly-orders", "scheduled__2026-01-01T00:00:00+00:00", timeout=60)
    assert run["status"] == "SUCCEEDED"
    assert run["attempts"][-1]["rows_written"] == 30
    assert run["idempotency_key"] == "scheduled__2026-01-01T00:00:00+00:00:nightly-orders"
    # The orchestrator retries the task: the same run comes back, none is created.
    again = sync("nightly-orders", "scheduled__2026-01-01T00:00:00+00:00", timeout=60)
    assert again["id"] == run["id"]
    assert Run.objects.filter(binding__name="nightly-orders").count() == 1

    with pytest.raises(RuntimeError, match=r"breaks: run .* ended FAILED"):
        sync("breaks", "manual__1", timeout=60)
