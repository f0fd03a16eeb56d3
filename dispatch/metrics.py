"""Prometheus metrics served by the site (`prometheus_client`'s own exposition).

Every scrape reads the database through a fixed number of indexed, bounded statements
(`dispatch/sql/ops.sql`, names starting `metrics_`), so its cost follows the live queue,
not the history. Labels are bounded: statuses, blocked reasons, binding names (at most
`MAX_BINDINGS` series), event names; never run ids.
"""

from __future__ import annotations

import hmac
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dispatch import conf
from dispatch.sqlfiles import ops_query

MAX_BINDINGS = 200
# Worker counters (dispatch_worker.stats) exported, summed over live workers.
WORKER_EVENTS = (
    "claims_generic",
    "claims_directed",
    "directed_hits",
    "directed_misses",
    "recovered",
    "lease_lost",
    "fenced_commits",
    "released",
    "settle_failed",
    "notifications",
    "notifications_malformed",
    "listen_reconnects",
    "listen_probes_missed",
)


def _rows(name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(ops_query(name), params or {})
        return list(cursor.fetchall())


class DispatchCollector:
    """Reads the gauges from the database at each scrape."""

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            "dispatch_runs", "Live runs by status (PENDING, RUNNING).", labels=["status"]
        )
        for status, n in _rows("metrics_live_runs"):
            live.add_metric([status], n)
        yield live

        finished = GaugeMetricFamily(
            "dispatch_runs_finished_last_hour",
            "Runs that reached a final status in the last hour, by status.",
            labels=["status"],
        )
        for status, n in _rows("metrics_finished_last_hour"):
            finished.add_metric([status], n)
        yield finished

        due = GaugeMetricFamily(
            "dispatch_due_unclaimed",
            "Due PENDING attempts not claimed yet, by binding and blocked reason.",
            labels=["binding", "blocked_reason"],
        )
        oldest = GaugeMetricFamily(
            "dispatch_oldest_wait_seconds",
            "How long the oldest due, unblocked attempt has waited (0 when none).",
        )
        wait = 0.0
        for binding, reason, n, age in _rows("metrics_due", {"limit": MAX_BINDINGS}):
            due.add_metric([binding, reason], n)
            if reason == "NONE":
                wait = max(wait, float(age))
        oldest.add_metric([], wait)
        yield due
        yield oldest

        workers = GaugeMetricFamily(
            "dispatch_live_workers", "Workers not stopped that heartbeated in the last 45 s."
        )
        events = GaugeMetricFamily(
            "dispatch_worker_events",
            "Counters of the live workers (since each started), summed: claims by path, "
            "directed hits and misses, lease expiries recovered, leases lost, fenced commits.",
            labels=["event"],
        )
        listen = GaugeMetricFamily(
            "dispatch_listen_unhealthy_workers",
            "Live workers whose LISTEN self-probe says wake-ups are not arriving.",
        )
        totals: Counter[str] = Counter()
        unhealthy = 0
        rows = _rows("metrics_live_workers")
        for (stats,) in rows:
            stats = json.loads(stats) if isinstance(stats, str) else (stats or {})
            for event in WORKER_EVENTS:
                totals[event] += int(stats.get(event, 0) or 0)
            if "listen_healthy" in stats and not stats.get("listen_healthy"):
                unhealthy += 1
        workers.add_metric([], len(rows))
        for event in WORKER_EVENTS:
            events.add_metric([event], totals[event])
        listen.add_metric([], unhealthy)
        yield workers
        yield events
        yield listen

        dead = GaugeMetricFamily(
            "dispatch_table_dead_tuples", "Dead tuples of the dispatch tables.", labels=["table"]
        )
        rows_est = GaugeMetricFamily(
            "dispatch_table_live_tuples", "Live tuples of the dispatch tables.", labels=["table"]
        )
        for table, n_live, n_dead in _rows("metrics_tables"):
            dead.add_metric([table], n_dead)
            rows_est.add_metric([table], n_live)
        yield dead
        yield rows_est


def registry() -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DispatchCollector())  # type: ignore[arg-type]
    return reg


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    token = conf.metrics_token()
    header = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


@never_cache
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The site's metrics: staff users, or a bearer token equal to DISPATCH_METRICS_TOKEN."""
    if not _allowed(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
