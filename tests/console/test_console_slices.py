"""A sliced run in the console: its page shows a table of its slices (done, running,
waiting, failed; rows and rate each, from database times), the run's progress as their
sum, and a page of them at a time (a run of 10,000 slices renders 100 rows, in the same
number of queries as a run of 3); the run list marks slice runs and sliced runs from its
annotations (no query per row)."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatch import services
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Run
from dispatch.worker import claims
from tests.support import factories

pytestmark = pytest.mark.django_db

SPEC = {"table": "items", "slices": {"key": "id", "count": 4}}


def bounds(n: int) -> list[tuple[str | None, str | None]]:
    edges: list[str | None] = [None, *[str(i * 100) for i in range(1, n)], None]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def planned(n: int, in_flight: int | None = None) -> Run:
    """A run planned into `n` slices of `id` by its claimed first attempt."""
    job = factories.JobFactory(max_slices_in_flight=in_flight, max_attempts=1)
    binding = factories.BindingFactory(job=job, max_concurrency=100)
    run = factories.trigger(binding)
    c = claims.claim("planner", run_id=run.pk, limit=1)[0]
    status, _ = claims.plan_slices(
        c.attempt_id, c.lease_token, key="id", key_type="bigint", method="count",
        basis="min/max", bounds=bounds(n), source_spec=SPEC, sink_spec={"table": "copy"},
    )  # fmt: skip
    assert status == Status.WAITING
    return Run.objects.get(pk=run.pk)


def slice_run(parent: Run, number: int) -> Run:
    return Run.objects.get(parent=parent, slice_number=number)


def claim_slice(parent: Run, number: int) -> claims.ClaimedAttempt:
    (c,) = claims.claim("w1", run_id=slice_run(parent, number).pk, limit=1, generic=False)
    return c


def page(client: Client, run: Run, query: str = "") -> str:
    response = client.get(reverse("admin:dispatch_run_change", args=[run.pk]) + query)
    assert response.status_code == 200
    return response.content.decode()


def slice_rows(html: str) -> dict[int, str]:
    """The slice table's rows: number -> data-state."""
    return {
        int(n): state
        for n, state in re.findall(r'<tr data-slice="(\d+)" data-state="(\w+)">', html)
    }


def test_run_page__slices_by_state_with_rows_rate_links_and_the_sum(admin_client: Client) -> None:
    parent = planned(5, in_flight=3)
    done = claim_slice(parent, 1)
    claims.settle(done.attempt_id, done.lease_token, "SUCCEEDED", rows_read=10, rows_written=10)
    # Slice 4 started when slice 1 ended; slice 2 runs: 5,000 rows read 10 s after its
    # claim (database times of its attempt row), 4,000 written.
    running = claim_slice(parent, 2)
    Attempt.objects.filter(pk=running.attempt_id).update(
        rows_read=5_000, rows_written=4_000, heartbeat_at=F("claimed_at") + timedelta(seconds=10)
    )
    failed = claim_slice(parent, 3)
    claims.settle(
        failed.attempt_id, failed.lease_token, "ERROR", reason=Reason.PERMANENT_ERROR,
        error="relation \"items\" does not exist\nLINE 1",
    )  # fmt: skip
    assert Run.objects.get(pk=parent.pk).status == Status.FAILED

    html = page(admin_client, parent)
    assert slice_rows(html) == {1: "done", 2: "running", 3: "failed", 4: "waiting", 5: "waiting"}
    # Slice 4 is queued (its run exists), slice 5 not started (a plan row only).
    row4 = html[html.index('data-slice="4"') : html.index('data-slice="5"')]
    row5 = html[html.index('data-slice="5"') : html.index("</tbody>")]
    assert "waiting (queued)" in row4 and "waiting (not started)" in row5
    assert reverse("admin:dispatch_run_change", args=[slice_run(parent, 4).pk]) in row4
    assert "/dispatch/run/" not in row5
    row2 = html[html.index('data-slice="2"') : html.index('data-slice="3"')]
    assert "<code>id &gt;= 100 and &lt; 200</code>" in row2
    assert "<td>5,000</td>" in row2 and "<td>4,000</td>" in row2
    assert "500 rows/s" in row2
    row3 = html[html.index('data-slice="3"') : html.index('data-slice="4"')]
    assert "relation &quot;items&quot; does not exist" in row3 and "LINE 1" not in row3
    # The run's progress is the sum of its slices: 10 rows of slice 1 and 4,000 of 2.
    summary = re.search(r'id="dsp-slices-progress"[^>]*>(.*?)</span>', html, re.S)
    assert summary is not None
    assert '<progress max="5" value="1"></progress>' in summary.group(1)
    assert "1 of 5 slices done (20 %) · 4,010 rows written" in summary.group(1)
    assert 'data-count="failed">1 failed' in html
    assert 'data-count="not-started">1 not started' in html
    # The plan's error names the failed slice and its range.
    assert "slice 3 of 5 (id &gt;= 200 and &lt; 300)" in html


def test_run_page__a_finished_run_rates_its_rows_over_its_time(admin_client: Client) -> None:
    parent = planned(2)
    for number, rows in ((1, 3_000), (2, 7_000)):
        c = claim_slice(parent, number)
        claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=rows, rows_written=rows)
    # The run took 20 s, trigger to the last slice's settlement (database times).
    Run.objects.filter(pk=parent.pk).update(finished_at=F("created_at") + timedelta(seconds=20))
    parent.refresh_from_db()
    assert parent.status == Status.SUCCEEDED
    html = page(admin_client, parent)
    assert slice_rows(html) == {1: "done", 2: "done"}
    assert "2 of 2 slices done (100 %) · 10,000 rows written · 500 rows/s" in html
    assert "Finished: succeeded." in html


def test_run_page__10000_slices_render_a_page_of_100_in_the_queries_of_3(
    admin_client: Client,
) -> None:
    small, big = planned(3), planned(10_000, in_flight=2)
    with CaptureQueriesContext(connection) as few:
        html = page(admin_client, small)
    assert slice_rows(html) == {1: "waiting", 2: "waiting", 3: "waiting"}
    with CaptureQueriesContext(connection) as many:
        html = page(admin_client, big)
    assert list(slice_rows(html)) == list(range(1, 101))
    assert len(many.captured_queries) == len(few.captured_queries)
    assert "Slices 1–100 of 10000 (page 1 of 100" in html
    assert 'href="?slices=2#slices" rel="next"' in html and 'rel="prev"' not in html
    html = page(admin_client, big, "?slices=57")
    assert list(slice_rows(html)) == list(range(5_601, 5_701))
    assert 'href="?slices=56#slices" rel="prev"' in html
    # Past the end: the last page; not a number: the first.
    assert list(slice_rows(page(admin_client, big, "?slices=100000")))[-1] == 10_000
    assert list(slice_rows(page(admin_client, big, "?slices=x")))[0] == 1


def test_slice_run_page__names_its_range_and_links_its_sliced_run(admin_client: Client) -> None:
    parent = planned(4)
    html = page(admin_client, slice_run(parent, 2))
    parent_url = reverse("admin:dispatch_run_change", args=[parent.pk])
    assert (
        f'slice 2 of 4 (id &gt;= 100 and &lt; 200) of run <a href="{parent_url}">'
        f"{str(parent.pk)[:8]}</a>"
    ) in html
    assert 'id="slices"' not in html  # a slice has no slices
    # A plain run has neither.
    plain = factories.trigger()
    html = page(admin_client, plain)
    assert 'id="slices"' not in html and "slice 1" not in html


def test_run_page__a_slice_run_cannot_be_retried_alone(admin_client: Client) -> None:
    parent = planned(2)
    c = claim_slice(parent, 1)
    claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.PERMANENT_ERROR, error="x")
    child = slice_run(parent, 1)
    assert Run.objects.get(pk=parent.pk).status == Status.FAILED
    # The Retry button is on the sliced run's page, not on its slice's.
    assert "/do/retry_run/" not in page(admin_client, child)
    assert f"/{parent.pk}/do/retry_run/" in page(admin_client, parent)
    url = reverse("admin:dispatch_run_object_action", args=[child.pk, "retry_run"])
    response = admin_client.post(url, follow=True)
    assert response.status_code == 200
    text = " ".join(str(m) for m in response.context["messages"])
    assert f"is slice 1 of run {parent.pk}" in text
    assert Attempt.objects.filter(run=child).count() == 1


def list_ids(client: Client, query: str = "") -> str:
    response = client.get(reverse("admin:dispatch_run_changelist") + query)
    assert response.status_code == 200
    return response.content.decode()


def test_run_list__marks_slice_runs_and_sliced_runs_without_a_query_per_row(
    admin_client: Client,
) -> None:
    for _ in range(3):
        factories.trigger()
    with CaptureQueriesContext(connection) as plain:
        list_ids(admin_client)
    parent = planned(8, in_flight=6)
    c = claim_slice(parent, 3)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=42, rows_written=42)
    with CaptureQueriesContext(connection) as sliced:
        html = list_ids(admin_client)
    assert len(sliced.captured_queries) == len(plain.captured_queries)
    short = str(parent.pk)[:8]
    for number in range(1, 8):
        assert f"slice {number}/8 of {short}" in html
    assert "sliced: 1/8 done" in html
    assert '<progress max="8" value="1"></progress> 42 rows' in html


def test_services_view__counts_match_the_plan(admin_client: Client) -> None:
    parent = planned(6, in_flight=2)
    view = services.run_slices(parent)
    assert view is not None
    assert view.counts == {
        "done": 0, "failed": 0, "queued_or_running": 2, "not_started": 4, "total": 6,
    }  # fmt: skip
    assert services.run_slices(uuid.uuid4()) is None
