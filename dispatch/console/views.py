"""The operator console's building blocks: status badges, the action runner that every
admin action and object button goes through, and the overview page.

Every action calls the service function the management commands use, writes one admin
history entry per object (who, what, outcome, refusals too) and reports counts of what
was done and what was skipped and why.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.db.models import Count, Min, Model, Q
from django.db.models.functions import TruncHour
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from dispatch import conf, services
from dispatch.console.paging import COUNT_CAP, capped_counts
from dispatch.db import db_now
from dispatch.models import Attempt, JobBinding, Run, Worker
from dispatch.services import ActionRefused
from dispatch.states import (
    TERMINAL_RUN_STATUSES,
    BlockedReason,
    Origin,
    Reason,
    Status,
)
from dispatch.worker import listen

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

# --- display mappings (tests/test_admin_mappings.py checks each covers every state) ---

# Tone of a status badge: one CSS class per tone, colours for light and dark mode live in
# admin/dispatch/includes/console_style.html.
STATUS_TONE: dict[str, str] = {
    Status.PENDING: "wait",
    Status.RUNNING: "live",
    Status.SUCCEEDED: "ok",
    Status.FAILED: "bad",
    Status.CANCELLED: "off",
    Status.RETRY_SCHEDULED: "warn",
}
# A symbol beside the colour, so a badge reads without colour vision (and in print).
STATUS_SYMBOL: dict[str, str] = {
    Status.PENDING: "◷",
    Status.RUNNING: "▶",
    Status.SUCCEEDED: "✓",
    Status.FAILED: "✗",
    Status.CANCELLED: "■",
    Status.RETRY_SCHEDULED: "↻",
}
ORIGIN_LABEL: dict[str, str] = {
    Origin.TRIGGER: "first try",
    Origin.RETRY: "automatic retry",
    Origin.OPERATOR: "operator retry",
    Origin.RELEASE: "after release",
}
REASON_TONE: dict[str, str] = {
    Reason.ERROR: "warn",
    Reason.PERMANENT_ERROR: "bad",
    Reason.LEASE_EXPIRED: "warn",
    Reason.CANCELLED_BY_OPERATOR: "off",
    Reason.TIMEOUT: "bad",
    Reason.SNAPSHOT_UNREADABLE: "bad",
    Reason.SHUTDOWN_RELEASED: "off",
    Reason.RELEASED_BY_OPERATOR: "off",
    Reason.ALREADY_COMMITTED: "ok",
}
# What an operator can do about a blocked attempt.
BLOCKED_HINT: dict[str, str] = {
    BlockedReason.JOB_DISABLED: "enable the job",
    BlockedReason.BINDING_DISABLED: "enable the binding",
    BlockedReason.SOURCE_DISABLED: "enable the source datasource",
    BlockedReason.SINK_DISABLED: "enable the sink datasource",
    BlockedReason.BINDING_AT_CAPACITY: "waits for a running attempt of the binding to end",
}
# Bars of the overview chart: one colour per terminal run status.
CHART_ORDER: tuple[str, ...] = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
assert set(CHART_ORDER) == set(TERMINAL_RUN_STATUSES)

# Refusal codes of dispatch.services.ActionRefused, as an operator reads them in a count.
REFUSAL_TEXT: dict[str, str] = {
    "ALREADY_FINISHED": "already finished",
    "CANCEL_ALREADY_REQUESTED": "cancel already requested",
    "NOT_RETRYABLE": "not failed or cancelled",
    "NOT_WAITING": "not waiting on a backoff (claimed meanwhile, or already due)",
    "NOT_RUNNING": "not running (finished, released or claimed anew meanwhile)",
    "ALREADY_ENABLED": "already enabled",
    "ALREADY_DISABLED": "already disabled",
    "CONNECTION_FAILED": "connection failed",
}
# Refusals whose message is shown, not only the object's name.
DETAILED_REFUSALS = frozenset({"CONNECTION_FAILED"})
OUTCOME_TEXT: dict[str, str] = {
    services.Outcome.TRIGGERED: "triggered",
    services.Outcome.EXISTING: "already had a run",
    services.Outcome.CANCELLED: "cancelled",
    services.Outcome.CANCEL_REQUESTED: "cancel requested (the worker stops at its next heartbeat)",
    services.Outcome.RETRIED: "retried (a new attempt is pending)",
    services.Outcome.MADE_AVAILABLE: "made available now",
    services.Outcome.RELEASED: "released (a successor attempt is pending now)",
    "ENABLED": "enabled",
    "DISABLED": "disabled",
    "CONNECTION_OK": "connection OK",
    "CURSOR_RESET": "cursor reset (the next run reads the whole source)",
    "CURSOR_SET": "cursor set (the next run reads the rows above it)",
}


def status_badge(status: str | None) -> SafeString:
    if not status:
        return format_html('<span class="dsp-badge dsp-none">{}</span>', "—")
    label = Status(status).label if status in Status.values else status
    return format_html(
        '<span class="dsp-badge dsp-{}" title="{}">{} {}</span>',
        STATUS_TONE.get(status, "off"),
        status,
        STATUS_SYMBOL.get(status, "?"),
        label,
    )


def reason_badge(reason: str | None) -> SafeString:
    if not reason:
        return format_html("{}", "")
    label = Reason(reason).label if reason in Reason.values else reason
    return format_html(
        '<span class="dsp-reason dsp-{}" title="{}">{}</span>',
        REASON_TONE.get(reason, "off"),
        label,
        reason,
    )


def blocked_badge(blocked: str | None) -> SafeString:
    if not blocked:
        return format_html("{}", "")
    label = BlockedReason(blocked).label if blocked in BlockedReason.values else blocked
    return format_html(
        '<span class="dsp-reason dsp-warn" title="{}">{}</span>',
        BLOCKED_HINT.get(blocked, ""),
        label,
    )


def progress_bar(rows_read: int | None, rows_written: int | None) -> SafeString:
    """Rows written against rows read (the total is unknown until a source ends)."""
    read = rows_read or 0
    written = rows_written or 0
    pct = 100 if read == 0 and written == 0 else min(100, round(100 * written / max(read, 1)))
    return format_html(
        '<span class="dsp-progress" title="{} read, {} written">'
        '<progress max="100" value="{}"></progress> {} / {}</span>',
        f"{read:,}",
        f"{written:,}",
        pct if read or written else 0,
        f"{written:,}",
        f"{read:,}",
    )


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    return f"{hours // 24} d {hours % 24} h"


# --- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionSpec:
    """One operator action: the service it calls and how it is guarded and shown."""

    name: str
    label: str  # button and action label
    perm: str  # "app_label.codename" the user must hold
    destructive: bool  # a confirmation page first
    call: Callable[[HttpRequest, Any], ActionResult]  # raises ActionRefused to refuse
    describe: str = ""  # one line on the confirmation page
    applies: Callable[[Any], bool] = lambda obj: True  # show the object button?
    # A value the confirmation page asks for (posted as `value`; `call` reads it).
    input_label: str = ""


@dataclass
class ActionResult:
    outcome: str  # a services.Outcome or another code of OUTCOME_TEXT
    detail: str = ""  # for the history entry (e.g. the new run's id)
    warning: str = ""  # shown to the operator as a warning (e.g. the run waits)
    created: Any = None  # a row the action created (a run)


@dataclass
class ActionReport:
    done: Counter[str] = field(default_factory=Counter)  # outcome code -> count
    # refusal code -> (object, message) pairs
    skipped: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    notes: list[str] = field(default_factory=list)  # extra warnings (e.g. a blocked run)
    created: list[Any] = field(default_factory=list)  # rows the action created (runs)

    @property
    def done_count(self) -> int:
        return sum(self.done.values())

    @property
    def skipped_count(self) -> int:
        return sum(len(v) for v in self.skipped.values())


def run_action(
    modeladmin: ModelAdmin[Any], request: HttpRequest, objects: Iterable[Model], spec: ActionSpec
) -> ActionReport:
    """Apply `spec` to each object; record every outcome (refusals too) in the history and
    tell the operator what was done and what was skipped and why."""
    report = ActionReport()
    for obj in objects:
        try:
            result = spec.call(request, obj)
        except ActionRefused as refused:
            report.skipped[refused.code].append((str(obj), refused.message))
            modeladmin.log_change(
                request, obj, f"{spec.label}: refused ({refused.code}): {refused.message}"
            )
            continue
        report.done[result.outcome] += 1
        if result.warning:
            report.notes.append(result.warning)
        if result.created is not None:
            report.created.append(result.created)
        detail = "; ".join(x for x in (result.detail, result.warning) if x)
        modeladmin.log_change(
            request, obj, f"{spec.label}: {result.outcome}" + (f" ({detail})" if detail else "")
        )
    _report_messages(modeladmin, request, spec, report)
    return report


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _report_messages(
    modeladmin: ModelAdmin[Any], request: HttpRequest, spec: ActionSpec, report: ActionReport
) -> None:
    opts = modeladmin.model._meta
    if report.done:
        parts = [
            f"{_plural(n, str(opts.verbose_name), str(opts.verbose_name_plural))} "
            f"{OUTCOME_TEXT.get(code, code.lower())}"
            for code, n in sorted(report.done.items())
        ]
        modeladmin.message_user(
            request, f"{spec.label}: " + "; ".join(parts) + ".", messages.SUCCESS
        )
    for note in report.notes:
        modeladmin.message_user(request, note, messages.WARNING)
    if report.skipped:
        parts = []
        for code, pairs in sorted(report.skipped.items()):
            if code in DETAILED_REFUSALS:
                # The error text is the point (it is secret-free by the connector contract
                # and scrubbed again by the caller).
                names = [f"{name}: {message}" for name, message in pairs]
            else:
                names = [name for name, _ in pairs]
            parts.append(
                f"{len(pairs)} {REFUSAL_TEXT.get(code, code.lower())} ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''})"
            )
        modeladmin.message_user(
            request,
            f"{spec.label}: skipped {_plural(report.skipped_count, str(opts.verbose_name), str(opts.verbose_name_plural))}: "
            + "; ".join(parts)
            + ".",
            messages.WARNING if report.done else messages.ERROR,
        )
    if not report.done and not report.skipped:
        modeladmin.message_user(request, f"{spec.label}: nothing selected.", messages.WARNING)


def confirmation_page(
    modeladmin: ModelAdmin[Any],
    request: HttpRequest,
    spec: ActionSpec,
    objects: Sequence[Model],
    *,
    action_url: str | None = None,
) -> HttpResponse:
    """The page a destructive action shows first; posting it back (with `post=yes`)
    applies the action. `action_url` set = an object button, else a changelist action."""
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": f"{spec.label}: are you sure?",
        "spec": spec,
        "objects": objects,
        "opts": opts,
        "action_url": action_url,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media,
    }
    return TemplateResponse(request, "admin/dispatch/action_confirmation.html", context)


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
        "run_changelist": reverse(
            "admin:dispatch_run_changelist", current_app=modeladmin.admin_site.name
        ),
    }
    return TemplateResponse(request, "admin/dispatch/overview.html", context)
