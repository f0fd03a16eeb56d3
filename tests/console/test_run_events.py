"""The event timeline of a run: on the run page beside the attempts (with the dropped
count and the external log link), in the HTTP API's run detail, in `dispatch runs show`;
and the system check of DISPATCH_EXTERNAL_LOG_URL."""

from __future__ import annotations

import json
import re
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client, override_settings
from django.urls import reverse

from dispatch import checks
from dispatch.core.states import Status
from dispatch.models import Run
from dispatch.worker import claims
from dispatch.worker.events import EventBuffer
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import claim_one

pytestmark = pytest.mark.django_db(transaction=True)


def logged_run() -> Run:
    """A run whose one attempt logged five events and failed; the cap (3) dropped two."""
    run = trigger(BindingFactory(job__max_attempts=1))
    c = claim_one()
    buffer = EventBuffer(cap=100)
    buffer.record("claimed", "claimed by worker w1", worker="w1")
    buffer.record("connected", "connected to the source (postgresql, server 15.2)")
    buffer.record("lock_wait", "waited 2.5s for a lock: the sink's fence row", seconds=2.5)
    buffer.record("progress", "100 rows read, 90 written, 4096 bytes", rows_read=100)
    buffer.record("read_started", "dropped by the cap")
    events, lost = buffer.take()
    with override_settings(DISPATCH_EVENTS_PER_ATTEMPT=4):
        claims.heartbeat(
            "w1", [(c.attempt_id, c.lease_token, 100, 90, (EventBuffer.as_json(events), lost))], {}
        )
        claims.settle(
            c.attempt_id,
            c.lease_token,
            "PERMANENT",
            reason="PERMANENT_ERROR",
            error="boom",
            events=(EventBuffer.as_json([(events[0][0], "error", "boom", {})]), 0),
        )
    return run


def timeline(html: str) -> list[str]:
    return re.findall(r'data-kind="([a-z_]+)"', html)


def test_run_page__shows_the_events_beside_the_attempts_and_what_was_dropped(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    run = logged_run()
    url = reverse("admin:dispatch_run_change", args=[run.pk])
    with django_assert_max_num_queries(15):
        page = admin_client.get(url).content.decode()
    assert timeline(page) == ["claimed", "connected", "lock_wait", "progress", "settled"]
    assert "waited 2.5s for a lock: the sink&#x27;s fence row" in page
    assert "PERMANENT_ERROR" in page.split('data-kind="settled"')[1]
    assert "2 events dropped" in page  # the fifth of the heartbeat and the error
    assert 'id="dsp-external-log"' not in page
    with override_settings(DISPATCH_EXTERNAL_LOG_URL="https://logs.example.com/q?run={run_id}"):
        page = admin_client.get(url).content.decode()
    assert f'href="https://logs.example.com/q?run={run.pk}"' in page
    # A template E021 refuses is never evaluated at render (checks do not run under every
    # server): no link, and no error.
    leaky = "https://logs.example.com/{run_id.__class__.__name__}"
    with override_settings(DISPATCH_EXTERNAL_LOG_URL=leaky):
        response = admin_client.get(url)
    assert response.status_code == 200
    assert 'id="dsp-external-log"' not in response.content.decode()


def test_api_and_runs_show__return_the_events(admin_client: Client) -> None:
    run = logged_run()
    detail = admin_client.get(f"/api/v1/runs/{run.pk}").json()
    [attempt] = detail["attempts"]
    assert [e["kind"] for e in attempt["events"]] == [
        "claimed",
        "connected",
        "lock_wait",
        "progress",
        "settled",
    ]
    assert [e["seq"] for e in attempt["events"]] == [1, 2, 3, 4, 7]
    assert attempt["events"][2]["data"] == {"seconds": 2.5}
    assert attempt["events_dropped"] == 2
    out = StringIO()
    call_command("dispatch", "runs", "show", str(run.pk), stdout=out)
    shown = out.getvalue()
    assert "lock_wait     waited 2.5s for a lock" in shown
    assert "2 events dropped" in shown
    out = StringIO()
    call_command("dispatch", "runs", "show", str(run.pk), "--json", stdout=out)
    shown_events = json.loads(out.getvalue())["attempts"][0]["events"]
    assert [(e["seq"], e["kind"], e["message"]) for e in shown_events] == [
        (e["seq"], e["kind"], e["message"]) for e in attempt["events"]
    ]
    assert Run.objects.get(pk=run.pk).status == Status.FAILED


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("https://logs.example.com/q?run={run_id}", ""),
        ("https://logs.example.com/q?run={run}", "only placeholder"),
        ("https://logs.example.com/q?run={run_id!r}", "only placeholder"),
        ("https://logs.example.com/q?run={run_id", "not a valid template"),
        ("https://logs.example.com/q", "no {run_id}"),
        ("javascript:alert({run_id})", "http"),
        (["https://x/{run_id}"], "not a string"),
    ],
)
def test_external_log_url__checked(template: Any, problem: str) -> None:
    assert problem in checks.external_log_url_problem(template)
    assert bool(checks.external_log_url_problem(template)) == bool(problem)
    with override_settings(DISPATCH_EXTERNAL_LOG_URL=template):
        found = [e.id for e in checks.check_event_log_settings()]
    assert found == (["dispatch.E021"] if problem else [])
