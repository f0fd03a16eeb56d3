"""The console's display mappings (a tone, a symbol and a label for every status,
reason and blocked reason; tests/console/test_admin_mappings.py checks each covers every
state) and the badges, bars and durations built from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from dispatch import services
from dispatch.core.progress import Progress, rate_text, seconds_text
from dispatch.core.states import (
    TERMINAL_RUN_STATUSES,
    BlockedReason,
    Origin,
    Reason,
    Status,
)

if TYPE_CHECKING:
    pass


# --- display mappings (tests/console/test_admin_mappings.py checks each covers every state) ---

# Tone of a status badge: one CSS class per tone, colours for light and dark mode live in
# admin/dispatch/includes/console_style.html.
STATUS_TONE: dict[str, str] = {
    Status.PENDING: "wait",
    Status.RUNNING: "live",
    Status.SUCCEEDED: "ok",
    Status.FAILED: "bad",
    Status.CANCELLED: "off",
    Status.RETRY_SCHEDULED: "warn",
    Status.WAITING: "live",
}
# A symbol beside the colour, so a badge reads without colour vision (and in print).
STATUS_SYMBOL: dict[str, str] = {
    Status.PENDING: "◷",
    Status.RUNNING: "▶",
    Status.SUCCEEDED: "✓",
    Status.FAILED: "✗",
    Status.CANCELLED: "■",
    Status.RETRY_SCHEDULED: "↻",
    Status.WAITING: "⋯",
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
    Reason.SLICES_PLANNED: "ok",
}
# What an operator can do about a blocked attempt.
BLOCKED_HINT: dict[str, str] = {
    BlockedReason.JOB_DISABLED: "enable the job",
    BlockedReason.BINDING_DISABLED: "enable the binding",
    BlockedReason.SOURCE_DISABLED: "enable the source datasource",
    BlockedReason.SINK_DISABLED: "enable the sink datasource",
    BlockedReason.BINDING_AT_CAPACITY: "waits for a running attempt of the binding to end",
    BlockedReason.WAITING_UPSTREAM: "starts when its other upstream runs of the chain end",
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
    "SLICE_RUN": "a slice of a sliced run (act on the sliced run)",
    "BUSY": "its slices changed meanwhile; try again",
    "ALREADY_ENABLED": "already enabled",
    "ALREADY_DISABLED": "already disabled",
    "CONNECTION_FAILED": "connection failed",
    "ALREADY_REVOKED": "already revoked",
    "GONE": "deleted meanwhile (retention)",
}
# Refusals whose message is shown, not only the object's name (a cursor's: our own text,
# saying what was wrong with the value).
DETAILED_REFUSALS = frozenset({"CONNECTION_FAILED", "BAD_CURSOR", "SLICE_RUN"})
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
    "REVOKED": "revoked",
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


def progress_bar(p: Progress, *, detail: bool = False) -> SafeString:
    """Rows read against the source's estimate (while running, or where a failed attempt
    stopped), or all of them once it succeeded; without an estimate the bar is
    indeterminate while running. `detail` adds rows written, the rate and the time left."""
    if not p.started:
        return format_html("{}", "—")
    fraction, total = p.fraction, p.total
    if fraction is None:
        # No value: an indeterminate bar (the total is unknown), or none once finished.
        bar = mark_safe("<progress></progress>" if p.running else "")  # a constant
    else:
        bar = format_html('<progress max="100" value="{}"></progress>', round(100 * fraction))
    if total is None or p.succeeded:
        count = f"{p.rows_read:,} rows"
    else:
        count = f"{p.rows_read:,} of ~{total:,} rows ({100 * (fraction or 0):.0f} %)"
    title = f"{p.rows_read:,} read, {p.rows_written:,} written" + (
        f", {p.rows_estimated:,} estimated" if p.rows_estimated is not None else ""
    )
    html = format_html('<span class="dsp-progress" title="{}">{} {}</span>', title, bar, count)
    if not detail:
        return html
    parts = [f"{p.rows_written:,} written"]
    if p.rate is not None:
        parts.append(rate_text(p.rate))
    if p.eta_seconds is not None:
        parts.append(f"about {seconds_text(p.eta_seconds)} left")
    return format_html('{} <span class="dsp-progress-detail">· {}</span>', html, " · ".join(parts))


# One way of writing a duration in the console, the commands and the API.
duration_text = seconds_text
