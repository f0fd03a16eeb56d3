"""The console's overview page: runs by status, queue latency, runs finished per hour,
blocked runs, workers, failures, and the operations (health, alerts, retention)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db.models import Count, Min, Q
from django.db.models.functions import TruncHour
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from dispatch.console.paging import COUNT_CAP, capped_counts
from dispatch.core import conf, hooks
from dispatch.core.db import db_now
from dispatch.core.states import (
    Reason,
    Status,
)
from dispatch.models import Attempt, JobBinding, Run, Worker
from dispatch.worker import listen

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
from dispatch.console.badges import (
    BLOCKED_HINT,
    CHART_ORDER,
    STATUS_TONE,
    blocked_badge,
    duration_text,
    status_badge,
)

# --- overview ---------------------------------------------------------------------------

FAILURE_WINDOW = timedelta(hours=24)


def worker_dead_after(held_leases: Sequence[int]) -> float:
    """Seconds of heartbeat silence after which a not-stopped worker is flagged dead:
    three leases of the shortest lease it holds, or three idle heartbeat periods."""
    if held_leases:
        return 3.0 * min(held_leases)
    return 3.0 * conf.idle_heartbeat_seconds()


def overview_context(now: datetime | None = None) -> dict[str, Any]:
    """Everything the overview shows, in a fixed number of queries."""
    now = now or db_now()
    since = now - FAILURE_WINDOW
    # One capped count per status through the (status, created_at) index: at a million
    # finished runs, "more than 10,000" instead of a scan of the table.
    counts = capped_counts(
        {s: Run.objects.filter(status=s) for s in Status.values if s != Status.RETRY_SCHEDULED}
    )
    by_status = []
    for s, n in counts.items():
        by_status.append(
            {
                "status": s,
                "badge": status_badge(s),
                "count": f"{COUNT_CAP:,}+" if n > COUNT_CAP else n,
                "n": n,
            }
        )
    # Queue latency: the oldest due attempt that nothing blocks (what workers should have
    # taken already), and the oldest blocked one apart.
    oldest = (
        Attempt.objects.filter(status=Status.PENDING, available_at__lte=now)
        .values("blocked_reason")
        .annotate(oldest=Min("available_at"), n=Count("id"))
        .order_by()
    )
    due: dict[str, Any] = {"n": 0, "oldest": None}
    blocked_counts: list[dict[str, Any]] = []
    for row in oldest:
        if row["blocked_reason"] is None:
            due = {"n": row["n"], "oldest": row["oldest"]}
        else:
            blocked_counts.append(
                {
                    "reason": row["blocked_reason"],
                    "badge": blocked_badge(row["blocked_reason"]),
                    "hint": BLOCKED_HINT.get(row["blocked_reason"], ""),
                    "count": row["n"],
                    "age": duration_text((now - row["oldest"]).total_seconds()),
                }
            )
    blocked = list(
        Attempt.objects.blocked().select_related("run__binding").order_by("available_at")[:20]
    )
    # Running attempts per binding from the RUNNING partial index (never a join through
    # every run and attempt of every binding).
    running = dict(
        Attempt.objects.running().values_list("run__binding").annotate(n=Count("id")).order_by()
    )
    at_capacity = []
    for b in JobBinding.objects.filter(pk__in=list(running)).select_related("job").order_by("name"):
        b.running = running[b.pk]  # type: ignore[attr-defined]
        if b.running >= b.max_concurrency:  # type: ignore[attr-defined]
            at_capacity.append(b)
    at_capacity = at_capacity[:50]
    waiting = (
        dict(
            Attempt.objects.filter(
                status=Status.PENDING, run__binding__in=[b.pk for b in at_capacity]
            )
            .values_list("run__binding")
            .annotate(n=Count("id"))
            .order_by()
        )
        if at_capacity
        else {}
    )
    for b in at_capacity:
        b.waiting = waiting.get(b.pk, 0)  # type: ignore[attr-defined]

    workers = list(
        Worker.objects.filter(Q(stopped_at__isnull=True) | Q(stopped_at__gte=since)).order_by(
            "stopped_at", "-heartbeat_at"
        )[:100]
    )
    held: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in (
        Attempt.objects.running()
        .filter(worker_id__in=[w.id for w in workers])
        .select_related("run__binding__job")
        .order_by("claimed_at")
    ):
        held[attempt.worker_id or ""].append(attempt)
    worker_rows = []
    for w in workers:
        attempts = held.get(w.id, [])
        age = (now - w.heartbeat_at).total_seconds()
        dead_after = worker_dead_after([a.run.binding.job.lease_seconds for a in attempts])
        worker_rows.append(
            {
                "worker": w,
                "attempts": attempts,
                "age": duration_text(age),
                "dead": w.stopped_at is None and age > dead_after,
                "dead_after": duration_text(dead_after),
                "listen": listen.probe_report(w.stats),
            }
        )

    failures_qs = Attempt.objects.filter(
        finished_at__gte=since,
        status__in=[Status.FAILED, Status.RETRY_SCHEDULED],
    ).exclude(reason__in=[Reason.SHUTDOWN_RELEASED, Reason.RELEASED_BY_OPERATOR])
    failure_counts = dict(failures_qs.values_list("reason").annotate(n=Count("id")).order_by())
    failures = list(failures_qs.select_related("run__binding").order_by("-finished_at")[:20])
    failed_runs = Run.objects.filter(status=Status.FAILED, finished_at__gte=since).count()

    return {
        "now": now,
        "by_status": by_status,
        "due": due,
        "due_age": duration_text((now - due["oldest"]).total_seconds()) if due["oldest"] else None,
        "blocked_counts": blocked_counts,
        "blocked": blocked,
        "at_capacity": at_capacity,
        "workers": worker_rows,
        "failures": failures,
        "failure_counts": sorted(failure_counts.items()),
        "failed_runs": failed_runs,
        "chart": hourly_chart(now),
        **operations_context(since),
    }


def operations_context(since: datetime) -> dict[str, Any]:
    """Warned and auto-disabled bindings, alerts of the last 24 hours by status, and the
    retention task's last pass: three small indexed queries."""
    from dispatch.models.ops import Alert, BindingHealth, HealthState
    from dispatch.ops import retention

    unhealthy = list(
        BindingHealth.objects.exclude(state=HealthState.OK)
        .select_related("binding")
        .order_by("-updated_at")[:50]
    )
    alerts = dict(
        Alert.objects.filter(created_at__gte=since)
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    )
    state = retention.read_state()
    return {
        "unhealthy": unhealthy,
        "alert_counts": sorted(alerts.items()),
        "retention": {"started_at": state["started_at"], **state["data"]},
    }


CHART_W, CHART_H, CHART_PAD = 720, 180, 28


def hourly_chart(now: datetime) -> dict[str, Any]:
    """Runs finished per hour by outcome for the last 24 hours, as bar geometry for a
    server-rendered SVG (no script, no external library)."""
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(hours=24)
    rows = (
        Run.objects.filter(finished_at__gte=start, status__in=CHART_ORDER)
        .annotate(hour=TruncHour("finished_at"))
        .values_list("hour", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    buckets: dict[int, Counter[str]] = defaultdict(Counter)
    for hour, status, n in rows:
        index = int((hour - start).total_seconds() // 3600)
        if 0 <= index < 24:
            buckets[index][status] += n
    peak = max((sum(c.values()) for c in buckets.values()), default=0)
    scale_max = max(1, _nice(peak))
    inner_h = CHART_H - 2 * CHART_PAD
    slot = (CHART_W - 2 * CHART_PAD) / 24
    bars = []
    totals = Counter[str]()
    for i in range(24):
        y = float(CHART_H - CHART_PAD)
        hour = start + timedelta(hours=i)
        for status in CHART_ORDER:
            n = buckets[i][status]
            totals[status] += n
            if not n:
                continue
            h = inner_h * n / scale_max
            y -= h
            bars.append(
                {
                    "x": round(CHART_PAD + i * slot + 2, 1),
                    "y": round(y, 1),
                    "w": round(slot - 4, 1),
                    "h": round(h, 1),
                    "tone": STATUS_TONE[status],
                    "title": f"{hour:%H:00} UTC: {n} {Status(status).label.lower()}",
                }
            )
    labels = [
        {
            "x": round(CHART_PAD + i * slot + slot / 2, 1),
            "text": f"{(start + timedelta(hours=i)):%H}",
        }
        for i in range(0, 24, 3)
    ]
    return {
        "width": CHART_W,
        "height": CHART_H,
        "pad": CHART_PAD,
        "bars": bars,
        "labels": labels,
        "max": scale_max,
        "base_y": CHART_H - CHART_PAD,
        "top_y": CHART_PAD,
        "right_x": CHART_W - CHART_PAD,
        "label_y": CHART_H - CHART_PAD + 16,
        "legend": [
            {"status": s, "tone": STATUS_TONE[s], "label": Status(s).label, "total": totals[s]}
            for s in CHART_ORDER
        ],
        "start": start,
        "end": end,
        "total": sum(totals.values()),
    }


def _nice(n: int) -> int:
    """The axis maximum: n rounded up to 1, 2 or 5 times a power of ten."""
    if n <= 0:
        return 0
    power = 10 ** int(math.floor(math.log10(n)))
    for step in (1, 2, 5, 10):
        if n <= step * power:
            return step * power
    return 10 * power


def overview_view(modeladmin: ModelAdmin[Any], request: HttpRequest) -> HttpResponse:
    # `{% url 'admin:...' %}` in the templates resolves in this admin site's namespace.
    request.current_app = modeladmin.admin_site.name
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Dispatch overview",
        "opts": modeladmin.model._meta,
        **overview_context(),
        # What the apps built on dispatch have to say (scheduling: schedules overdue
        # with no reconciler running), without dispatch importing them.
        "notices": hooks.overview_notices(modeladmin.admin_site.name),
        "run_changelist": reverse(
            "admin:dispatch_run_changelist", current_app=modeladmin.admin_site.name
        ),
    }
    return TemplateResponse(request, "admin/dispatch/overview.html", context)
