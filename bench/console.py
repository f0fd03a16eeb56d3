"""The operator console over a large history: queries per page and rows read per query.

`python -m bench console [--runs N] [--quick]` fills its own database with N finished runs
(default 1,000,000; --quick 100,000) and one attempt each, by INSERT ... SELECT
generate_series, VACUUM ANALYZEs it, then renders every run/attempt list (each filter), a
run's page, a binding's page and the overview, and for every query of each page runs
EXPLAIN (ANALYZE, BUFFERS): the rows the scans of dispatch_run/dispatch_attempt read,
the buffers, and whether any of them is a full Seq Scan. What it reports is work, not
time (the page time is printed too, for orientation only: the machine is shared).
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench import common

DB = "dispatch_bench_console"
BIG = ("dispatch_run", "dispatch_attempt")


def _nodes(node: dict[str, Any], limited: bool = False):
    node["_limited"] = limited
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child, limited or node["Node Type"] == "Limit")


def fill(conn: Any, n: int) -> tuple[str, str]:
    common.reset_dispatch(conn)
    from tests.support.factories import BindingFactory

    a, b = BindingFactory(), BindingFactory()
    conn.execute(
        """
        INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, finished_at,
                                  requested_by)
        SELECT gen_random_uuid(), CASE WHEN i %% 2 = 0 THEN %(a)s::uuid ELSE %(b)s::uuid END,
               CASE WHEN i %% 10 = 0 THEN 'SCHEDULE' WHEN i %% 97 = 0 THEN 'API' ELSE 'MANUAL' END,
               CASE WHEN i %% 50 = 0 THEN 'FAILED' WHEN i %% 333 = 0 THEN 'CANCELLED'
                    ELSE 'SUCCEEDED' END,
               now() - make_interval(secs => i * 6), now() - make_interval(secs => i * 6 - 2), ''
        FROM generate_series(1, %(n)s) AS i
        """,
        {"a": str(a.pk), "b": str(b.pk), "n": n},
    )
    conn.execute(
        """
        INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                      available_at, finished_at, reason, error, rows_read,
                                      rows_written)
        SELECT gen_random_uuid(), r.id, 1,
               CASE WHEN r.status = 'CANCELLED' THEN 'OPERATOR' ELSE 'TRIGGER' END,
               r.status, r.created_at, r.created_at, r.finished_at,
               CASE r.status WHEN 'FAILED' THEN 'ERROR'
                             WHEN 'CANCELLED' THEN 'CANCELLED_BY_OPERATOR' END,
               CASE WHEN r.status = 'FAILED' THEN 'boom' ELSE '' END, 10, 10
        FROM dispatch_run r
        """
    )
    conn.execute("VACUUM ANALYZE dispatch_run")
    conn.execute("VACUUM ANALYZE dispatch_attempt")
    return str(a.pk), str(a.job_id)


def measure(url: str, client: Any) -> tuple[int, int, int, bool, float]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    started = time.perf_counter()
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    elapsed = (time.perf_counter() - started) * 1000
    assert response.status_code == 200, (url, response.status_code)
    rows = buffers = 0
    full_scan = False
    with connection.cursor() as cursor:
        for q in ctx.captured_queries:
            text = q["sql"]
            if not text.lstrip().upper().startswith("SELECT") or not any(t in text for t in BIG):
                continue
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {text}")
            plan = cursor.fetchone()[0]
            top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
            read = 0
            for node in _nodes(top):
                name = node.get("Relation Name", "") + node.get("Index Name", "")
                if "Scan" in node["Node Type"] and any(t in name for t in BIG):
                    read += (
                        node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                    ) * node.get("Actual Loops", 1)
                    if node["Node Type"] == "Seq Scan" and not node["_limited"]:
                        full_scan = True
            rows = max(rows, read)
            buffers = max(
                buffers, top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
            )
    return len(ctx.captured_queries), rows, buffers, full_scan, elapsed


def main(argv: list[str]) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=common.positive, default=None, help="default 1,000,000")
    args = p.parse_args(argv)
    n = args.runs or (100_000 if args.quick else 1_000_000)
    common.setup_django(args.server, DB)
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse

    from dispatch.models import Run

    setup_test_environment()
    with common.connect(args.server, DB) as conn:
        started = time.perf_counter()
        binding, job = fill(conn, n)
        fill_s = time.perf_counter() - started
    user = get_user_model().objects.filter(username="bench").first()
    user = user or get_user_model().objects.create_superuser("bench", "b@example.com", None)
    client = Client()
    client.force_login(user)
    run = Run.objects.filter(binding_id=binding, status="FAILED").first()
    assert run is not None
    runs, attempts = (
        reverse("admin:dispatch_run_changelist"),
        reverse("admin:dispatch_attempt_changelist"),
    )
    day = "2026-01-01T00:00:00%2B00:00"
    urls = [
        runs,
        *(f"{runs}?status__exact={s}" for s in ("FAILED", "SUCCEEDED", "RUNNING")),
        f"{runs}?trigger__exact=API",
        f"{runs}?binding__id__exact={binding}",
        f"{runs}?binding__job__id__exact={job}",
        f"{runs}?created_at__gte={day}",
        f"{runs}?p=50",
        attempts,
        f"{attempts}?status__exact=FAILED",
        f"{attempts}?run__binding__id__exact={binding}",
        f"{attempts}?origin__exact=OPERATOR",
        f"{attempts}?reason__exact=ERROR",
        f"{attempts}?blocked_reason__exact=BINDING_DISABLED",
        f"{attempts}?finished_at__gte={day}",
        reverse("admin:dispatch_run_change", args=[run.pk]),
        reverse("admin:dispatch_jobbinding_change", args=[binding]),
        reverse("admin:dispatch_overview"),
    ]
    rows = []
    for url in urls:
        measure(url, client)  # warm the cache: the second read is the one reported
        q, read, buffers, full, ms = measure(url, client)
        rows.append(
            [
                f"`{url.replace(binding, 'B').replace(job, 'J')}`",
                q,
                f"{read:,}",
                f"{buffers:,}",
                "**yes**" if full else "no",
                f"{ms:.0f}",
            ]
        )
    report = common.Report(f"Console at {n:,} runs", ["console", *argv], args.server)
    report.add(
        f"{n:,} finished runs and as many attempts (filled in {fill_s:.0f} s, VACUUM "
        "ANALYZEd). Per page: queries, the most rows any one query's scans of "
        "dispatch_run/dispatch_attempt read (EXPLAIN ANALYZE), its buffers, whether any "
        "query is a full Seq Scan of them, and the page time (for orientation only).\n\n"
        + common.table(["page", "queries", "max rows read", "max buffers", "full scan", "ms"], rows)
    )
    report.emit(doc=not args.no_doc and not args.quick)
    return 0
