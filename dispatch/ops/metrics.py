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
from typing import Any, Protocol

from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dispatch.core import conf
from dispatch.core.sqlfiles import ops_query
from dispatch.models.ops import HealthState
from dispatch.ops import binding_metrics
from dispatch.worker.listen import UNHEALTHY_STATES, probe_report
from dispatch.worker.stats import WorkerSnapshot

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

    due_truncated = False  # the last scrape's due series left bindings out

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
        due_rows, self.due_truncated = _capped("metrics_due")
        for binding, reason, n, age in due_rows:
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
            # As `workerhealth --require-listen` judges: wake-ups stopped arriving (a
            # worker still starting, or polling behind a pooler by design, is not).
            if probe_report(stats).state in UNHEALTHY_STATES:
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


class BindingCountersCollector:
    """The per-binding counters the maintenance loop folds in (dispatch.ops.binding_metrics):
    finished runs, attempts, rows moved, attempt duration and queue wait. One indexed
    read of at most `MAX_BINDINGS` rows; they lag finished runs by up to a health
    interval (60 s by default). Collected after `dispatch` (registration order), it also
    says whether that collector's due series were cut."""

    def __init__(self, dispatch: DispatchCollector) -> None:
        self.dispatch = dispatch

    def collect(self) -> Iterator[Metric]:
        runs = CounterMetricFamily(
            "dispatch_runs_finished",
            "Runs that reached a final status, by binding and status.",
            labels=["binding", "status"],
        )
        attempts = CounterMetricFamily(
            "dispatch_attempts_finished",
            "Attempts of finished runs, by binding and outcome.",
            labels=["binding", "status"],
        )
        read = CounterMetricFamily(
            "dispatch_rows_read", "Rows read from sources, by binding.", labels=["binding"]
        )
        written = CounterMetricFamily(
            "dispatch_rows_written", "Rows written to sinks, by binding.", labels=["binding"]
        )
        duration = HistogramMetricFamily(
            "dispatch_run_duration_seconds",
            "How long each attempt of a finished run executed (claim to settlement).",
            labels=["binding"],
        )
        wait = HistogramMetricFamily(
            "dispatch_queue_wait_seconds",
            "How long each attempt of a finished run waited from due to claimed.",
            labels=["binding"],
        )
        counter_rows, counters_cut = _capped("metrics_binding_counters")
        for name, stored in counter_rows:
            c = binding_metrics.Counters.load(
                json.loads(stored) if isinstance(stored, str) else stored
            )
            for status, n in sorted(c.runs.items()):
                runs.add_metric([name, status], n)
            for status, n in sorted(c.attempts.items()):
                attempts.add_metric([name, status], n)
            read.add_metric([name], c.rows_read)
            written.add_metric([name], c.rows_written)
            duration.add_metric([name], c.duration.cumulative(), c.duration.total)
            wait.add_metric([name], c.wait.cumulative(), c.wait.total)
        yield from (runs, attempts, read, written, duration, wait)
        yield _truncated_gauge(
            {"due": self.dispatch.due_truncated, "binding_counters": counters_cut}
        )

        health = GaugeMetricFamily(
            "dispatch_bindings_by_health",
            "Bindings by health (OK, WARNED, AUTO_DISABLED; a binding with no finished run "
            "scanned yet counts as none).",
            labels=["state"],
        )
        counted = dict(_rows("metrics_binding_health"))
        for state in HealthState.values:
            health.add_metric([state], counted.get(state, 0))
        yield health

        lag = GaugeMetricFamily(
            "dispatch_maintenance_lag_seconds",
            "How far the health scan's (task=health) and the metrics fold's (task=metrics) "
            "cursors are behind now, over runs and over attempts: a value that keeps "
            "growing means alerts and counters fall behind (and retention waits for them).",
            labels=["task", "cursor"],
        )
        for task, cursor, seconds in _rows("maintenance_lag"):
            lag.add_metric([task, cursor], max(0.0, float(seconds)))
        yield lag

        alerts = GaugeMetricFamily(
            "dispatch_alerts_last_day",
            "Alerts created in the last 24 hours, by status and kind.",
            labels=["status", "kind"],
        )
        for status, kind, n in _rows("metrics_alerts_last_day"):
            alerts.add_metric([status, kind], n)
        yield alerts


def _capped(name: str) -> tuple[list[tuple[Any, ...]], bool]:
    """At most MAX_BINDINGS rows of a per-binding statement, and whether more exist (one
    row more is read to tell)."""
    rows = _rows(name, {"limit": MAX_BINDINGS + 1})
    return rows[:MAX_BINDINGS], len(rows) > MAX_BINDINGS


def _truncated_gauge(families: dict[str, bool]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(
        "dispatch_metrics_series_truncated",
        f"1 when a per-binding family shows only its first {MAX_BINDINGS} bindings (by name "
        "for the counters, by count for the due attempts) and leaves the others out.",
        labels=["family"],
    )
    for family, cut in families.items():
        gauge.add_metric([family], 1.0 if cut else 0.0)
    return gauge


def registry() -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    dispatch = DispatchCollector()
    reg.register(dispatch)  # type: ignore[arg-type]
    reg.register(BindingCountersCollector(dispatch))  # type: ignore[arg-type]
    return reg


# Every binding's name and failure counts: as much as the run list shows.
METRICS_PERMISSION = "dispatch.view_run"


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.has_perm(METRICS_PERMISSION):
        return True
    token = conf.metrics_token()
    header = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


@never_cache
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The site's metrics: users who may view runs (`dispatch.view_run`), or a bearer token
    equal to DISPATCH_METRICS_TOKEN."""
    if not _allowed(request):
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


# --- a worker's own metrics port (runworker --metrics-port) --------------------------------
class WorkerSource(Protocol):
    """What a worker shows its metrics port (dispatch.worker.coordinator implements it)."""

    def metrics_snapshot(self) -> WorkerSnapshot: ...


class WorkerCollector:
    """This process's counters, read from memory at each scrape (no database call: a
    worker's port answers while its database does not)."""

    def __init__(self, source: WorkerSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snap = self.source.metrics_snapshot()
        events = CounterMetricFamily(
            "dispatch_worker_events",
            "This worker's counters since it started: claims by path, directed hits and "
            "misses, notifications, lease expiries recovered, leases lost, fenced commits, "
            "rows read and written, ...",
            labels=["event"],
        )
        for name, n in sorted(snap.counters.items()):
            events.add_metric([name], n)
        yield events
        slots = GaugeMetricFamily(
            "dispatch_worker_slots", "This worker's executor slots by use.", labels=["state"]
        )
        slots.add_metric(["busy"], snap.busy)
        slots.add_metric(["free"], max(0, snap.concurrency - snap.busy))
        yield slots
        listen = GaugeMetricFamily(
            "dispatch_worker_listen_healthy",
            "1 while this worker's LISTEN self-probe says wake-ups arrive, else 0.",
            labels=["state"],
        )
        listen.add_metric([snap.listen_state], int(snap.listen_healthy))
        yield listen
        duration = HistogramMetricFamily(
            "dispatch_worker_execution_seconds",
            "How long this worker's executions ran, claim to settlement.",
        )
        duration.add_metric([], snap.execution_seconds.cumulative(), snap.execution_seconds.total)
        yield duration


def serve_worker_metrics(source: WorkerSource, port: int, addr: str) -> Any:
    """Serve `source`'s metrics on addr:port in a daemon thread; returns the server
    (its `server_address` tells the port when 0 asked the system for one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(WorkerCollector(source))  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=addr, registry=reg)
    return server
