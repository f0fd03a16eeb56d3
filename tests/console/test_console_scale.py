"""The console with a large history: every list (each filter), a run's page, a binding's
page and the overview answer in a bounded number of queries, and no query of theirs scans
the runs or attempts table (EXPLAIN (ANALYZE, BUFFERS): no Seq Scan on them, and a buffer
count far below the tables' size).

100,000 runs with one attempt each, inserted by INSERT ... SELECT generate_series and
ANALYZEd, are enough: the planner decides from the statistics, and a full scan or full sort
of 100,000 rows reads the whole table (thousands of buffers) where a bounded read takes a
few hundred at most. A million rows only makes that gap larger and the test slower."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatch.models import JobBinding, Run
from tests.support.factories import BindingFactory

N = 100_000
MAX_QUERIES = 25
# A bounded read: a page of 100 rows and their per-row attempt lookups, a capped count
# (10,001 matching rows, and those a filtered walk skips on the way: the planner picks
# a seq scan under the LIMIT only when matches are dense; attempts of one binding pay
# their run lookups too: about 35,000 here). A full scan reads 100,000 (and a hash join
# of both tables, 120,000).
MAX_ROWS_READ = 40_000
BIG = {"dispatch_run", "dispatch_attempt"}


def fill(a: JobBinding, b: JobBinding) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, finished_at,
                                      requested_by)
            SELECT gen_random_uuid(),
                   CASE WHEN i %% 2 = 0 THEN %(a)s::uuid ELSE %(b)s::uuid END,
                   CASE WHEN i %% 10 = 0 THEN 'SCHEDULE' WHEN i %% 97 = 0 THEN 'API'
                        ELSE 'MANUAL' END,
                   CASE WHEN i %% 50 = 0 THEN 'FAILED' WHEN i %% 333 = 0 THEN 'CANCELLED'
                        ELSE 'SUCCEEDED' END,
                   now() - make_interval(secs => i * 6),
                   now() - make_interval(secs => i * 6 - 2),
                   ''
            FROM generate_series(1, %(n)s) AS i
            """,
            {"a": str(a.pk), "b": str(b.pk), "n": N},
        )
        cursor.execute(
            """
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, finished_at, reason, error,
                                          rows_read, rows_written)
            SELECT gen_random_uuid(), r.id, 1,
                   CASE WHEN r.status = 'CANCELLED' THEN 'OPERATOR' ELSE 'TRIGGER' END,
                   r.status, r.created_at, r.created_at, r.finished_at,
                   CASE r.status WHEN 'FAILED' THEN 'ERROR'
                                 WHEN 'CANCELLED' THEN 'CANCELLED_BY_OPERATOR' END,
                   CASE WHEN r.status = 'FAILED' THEN 'boom' ELSE '' END, 10, 10
            FROM dispatch_run r
            """
        )
        cursor.execute("ANALYZE dispatch_run")
        cursor.execute("ANALYZE dispatch_attempt")


def plan_nodes(node: dict[str, Any], limited: bool = False):
    """Every node of a plan, marked with whether a Limit above it stops it early."""
    node["_limited"] = limited
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child, limited or node["Node Type"] == "Limit")


def check_queries(url: str, queries: list[dict[str, str]]) -> list[tuple[int, str]]:
    assert len(queries) <= MAX_QUERIES, f"{url}: {len(queries)} queries"
    costs = []
    with connection.cursor() as cursor:
        for q in queries:
            text = q["sql"]
            if not text.lstrip().upper().startswith("SELECT") or not any(t in text for t in BIG):
                continue
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {text}")
            plan = cursor.fetchone()[0]
            if isinstance(plan, str):
                plan = json.loads(plan)
            top = plan[0]["Plan"]
            scans = [
                n["Relation Name"]
                for n in plan_nodes(top)
                # A Seq Scan under a Limit (a capped count) stops early; its rows are
                # counted below like any other scan's.
                if n["Node Type"] == "Seq Scan"
                and n.get("Relation Name") in BIG
                and not n["_limited"]
            ]
            assert not scans, f"{url}: Seq Scan on {scans}\n{text[:400]}"
            # Rows every scan of a big table produced or filtered away, over all its loops.
            read = sum(
                (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0))
                * n.get("Actual Loops", 1)
                for n in plan_nodes(top)
                if "Scan" in n["Node Type"]
                and (
                    n.get("Relation Name") in BIG
                    or "dispatch_run" in n.get("Index Name", "")
                    or "dispatch_attempt" in n.get("Index Name", "")
                )
            )
            assert read <= MAX_ROWS_READ, f"{url}: {read} rows read\n{text[:400]}"
            costs.append((read, text[:80]))
    return costs


@pytest.mark.django_db
def test_console_pages_at_scale_are_bounded(admin_client: Client) -> None:
    a, b = BindingFactory(), BindingFactory()
    fill(a, b)
    run = Run.objects.filter(binding=a, status="FAILED").first()
    assert run is not None
    day = "2026-01-01T00:00:00%2B00:00"
    runs = reverse("admin:dispatch_run_changelist")
    attempts = reverse("admin:dispatch_attempt_changelist")
    urls = [
        runs,
        f"{runs}?status__exact=FAILED",
        f"{runs}?status__exact=SUCCEEDED",
        f"{runs}?status__exact=RUNNING",
        f"{runs}?trigger__exact=API",
        f"{runs}?trigger__exact=MANUAL",
        f"{runs}?binding__id__exact={a.pk}",
        f"{runs}?binding__job__id__exact={a.job_id}",
        f"{runs}?created_at__gte={day}",
        f"{runs}?finished_at__gte={day}",
        f"{runs}?p=3",
        attempts,
        f"{attempts}?status__exact=FAILED",
        f"{attempts}?run__binding__id__exact={a.pk}",
        f"{attempts}?origin__exact=OPERATOR",
        f"{attempts}?origin__exact=RELEASE",
        f"{attempts}?reason__exact=ERROR",
        f"{attempts}?reason__exact=LEASE_EXPIRED",
        f"{attempts}?blocked_reason__exact=BINDING_DISABLED",
        f"{attempts}?created_at__gte={day}",
        f"{attempts}?finished_at__gte={day}",
        reverse("admin:dispatch_run_change", args=[run.pk]),
        reverse("admin:dispatch_jobbinding_change", args=[a.pk]),
        reverse("admin:dispatch_jobbinding_changelist"),
        reverse("admin:dispatch_overview"),
    ]
    report = []
    for url in urls:
        with CaptureQueriesContext(connection) as ctx:
            response = admin_client.get(url)
        assert response.status_code == 200, url
        costs = check_queries(url, ctx.captured_queries)
        report.append((url, len(ctx.captured_queries), int(max((c for c, _ in costs), default=0))))
    # A capped count, not the exact one, on a list of more than the cap.
    assert "10001 runs" in admin_client.get(runs).content.decode()
    print("\n".join(f"{n:3d} queries, at most {buf:6d} rows read  {url}" for url, n, buf in report))
