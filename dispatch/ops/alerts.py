"""Failure alerts and auto-disable (docs/operations.md, "Alerts and auto-disable").

Two maintenance tasks every worker runs (dispatch.ops.maintenance), neither on a claim or an
execution path:

- **the health scan** reads the runs that finished since its last pass (a keyset over
  `(finished_at, id)` on the run table's finished index, a few seconds behind now so a
  settlement's commit is visible), recomputes each touched binding's failure streak from
  its latest runs (a bounded read: at most the disable threshold), moves its
  `BindingHealth` (OK -> WARNED -> AUTO_DISABLED, back to OK on a success or when an
  operator re-enables it), disables a binding at the threshold with the reason recorded,
  and writes the alerts into the outbox (`dispatch_alert`), one per event and notifier
  (a unique de-duplication key, so a pass that runs twice enqueues nothing twice), or
  SUPPRESSED past the rate limit;
- **the drain** sends due PENDING alerts: it leases a few (`FOR UPDATE SKIP LOCKED`, the
  lease moves `next_attempt_at` forward and commits before anything is sent), sends each
  through its notifier, and records SENT, or a retry with backoff, or FAILED after the
  last attempt. A slow or dead webhook holds only the maintenance thread, for at most its
  timeout per alert.

Notifiers: `email` (Django's mail: the binding's `alert_emails` at the site's alert
domains, else the site's ADMINS) and `webhook` (a JSON POST signed with HMAC-SHA256 over
the timestamp and the body: header `X-Dispatch-Signature: t=<unix time>,v1=<hex>`). Which
are on is `DISPATCH_ALERT_NOTIFIERS`; see dispatch.core.conf for every setting.

An alert carries the run's link, status, reason and counts (`PAYLOAD_FIELDS`), never an
error text: a source's or sink's error may quote the data, and the console shows it to
whoever may view runs. A binding's own recipients (its addresses, its named webhook) get
alerts of events after they were added only (`BindingHealth.alert_settings_changed_at`);
earlier ones go to the site's ADMINS and default webhook (docs/security.md, "Alerts").
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatch.connectors.postgresql.schema_policy import ALERTED, describe_changes
from dispatch.core import conf
from dispatch.core.db import db_now, storable
from dispatch.core.states import Status
from dispatch.models.ops import (
    Alert,
    AlertKind,
    AlertStatus,
    BindingHealth,
    HealthState,
    alert_addresses,
    domain_allowed,
)
from dispatch.ops import binding_metrics
from dispatch.ops.retention import begin_pass

log = logging.getLogger("dispatch.alerts")

SCAN_KEY = "health"
# Runs read per scan pass at most (the rest waits for the next pass).
SCAN_BATCH = 1000
# Alerts leased per drain pass, and how long a lease keeps others off an alert.
DRAIN_BATCH = 20
LEASE_SECONDS = 120.0
ERROR_CHARS = 500

# What an alert says, in this order: the run's link, status, reason and counts, the
# binding's health; never an error text (a source's or sink's error may quote a value of
# the data). The email's body and the webhook's JSON carry these keys and no other, so an
# outbox row written with more by an earlier release sends none of it.
PAYLOAD_FIELDS = (
    "kind",
    "binding",
    "binding_id",
    "run_id",
    "link",
    "status",
    "reason",
    "attempts",
    "rows_read",
    "rows_written",
    "finished_at",
    "health",
    "consecutive_failures",
    "event",
    "schema_changes",
)


@dataclass
class ScanReport:
    runs: int = 0
    bindings: int = 0
    warned: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    alerts: int = 0
    suppressed: int = 0


# --- the health scan -----------------------------------------------------------------------
def _state() -> dict[str, Any]:
    from dispatch.models.ops import OpsState

    row = OpsState.objects.filter(key=SCAN_KEY).values_list("data", flat=True).first()
    return row if isinstance(row, dict) else {}


def _save_state(data: dict[str, Any]) -> None:
    from dispatch.models.ops import OpsState

    OpsState.objects.update_or_create(key=SCAN_KEY, defaults={"data": data})


def maybe_scan_and_drain() -> tuple[ScanReport, int] | None:
    """The maintenance task: a scan, the metrics fold (dispatch.ops.binding_metrics), then a
    drain, if no worker ran them within `DISPATCH_HEALTH_INTERVAL` (one gate for all
    three: one transaction when it is not the turn of this worker)."""
    if not begin_pass(SCAN_KEY, conf.health_interval()):
        return None
    report = scan()
    sent = drain()
    # Last, and on its own: a fold that fails or catches up on a long history neither
    # delays nor stops the alerts.
    try:
        binding_metrics.fold()
    except DatabaseError as exc:
        log.warning("metrics fold failed, retried next pass: %s", " ".join(str(exc).split()))
    return report, sent


def scan(*, now: datetime | None = None, budget: float | None = None) -> ScanReport:
    """One pass: the runs finished since the last one, in batches of `SCAN_BATCH` for as
    long as they come back full and at most `budget` seconds (default: half a health
    interval), then the time-based thresholds. Idempotent: a pass over runs already seen
    changes nothing and enqueues nothing."""
    report = ScanReport()
    budget = conf.health_interval() / 2 if budget is None else budget
    until = time.monotonic() + budget
    while _scan_batch(report) == SCAN_BATCH and time.monotonic() < until:
        pass
    _scan_failing(report)
    if report.warned or report.disabled or report.recovered or report.alerts:
        log.info(
            "health scan runs=%d warned=%s disabled=%s recovered=%s alerts=%d suppressed=%d",
            report.runs,
            report.warned,
            report.disabled,
            report.recovered,
            report.alerts,
            report.suppressed,
        )
    return report


def _scan_batch(report: ScanReport) -> int:
    """The next `SCAN_BATCH` finished runs after the cursor; returns how many."""
    from dispatch.models import Run

    state = _state()
    after_at = state.get("after_at")
    after_id = state.get("after_id")
    q = Q(
        finished_at__isnull=False,
        finished_at__lte=Now() - timedelta(seconds=conf.health_scan_lag()),
    )
    if after_at:
        # The lower bound is the index condition (dispatch_run_finished_idx); the OR only
        # breaks ties at the cursor's instant. Without it every batch read the history
        # before the cursor.
        q &= Q(finished_at__gte=after_at) & (
            Q(finished_at__gt=after_at) | Q(finished_at=after_at, id__gt=after_id)
        )
    runs = list(
        Run.objects.filter(q)
        .order_by("finished_at", "id")
        .values_list("id", "binding_id", "status", "finished_at")[:SCAN_BATCH]
    )
    report.runs += len(runs)
    touched: dict[uuid.UUID, list[tuple[uuid.UUID, str]]] = {}
    for run_id, binding_id, status, _ in runs:
        touched.setdefault(binding_id, []).append((run_id, status))
    for binding_id, finished in touched.items():
        _scan_binding(binding_id, finished, report)
    if runs:
        last_id, _, _, last_at = runs[-1]
        assert last_at is not None  # the filter's
        _save_state({**state, "after_at": last_at.isoformat(), "after_id": str(last_id)})
    report.bindings += len(touched)
    return len(runs)


def _streak(binding_id: uuid.UUID, since: datetime) -> tuple[int, datetime | None, Any, Any]:
    """(failed runs since the latest success, the first of them, the latest success's
    finished_at, the latest failure's finished_at), from the binding's latest finished
    runs created after `since`: a bounded read (the disable threshold + 1 runs)."""
    from dispatch.models import Run

    limit = conf.auto_disable_failures() + 1
    rows = list(
        Run.objects.filter(
            binding_id=binding_id,
            created_at__gte=since,
            status__in=[Status.SUCCEEDED, Status.FAILED],
        )
        .order_by("-created_at")
        .values_list("status", "created_at", "finished_at")[:limit]
    )
    failures, first_failure, last_success, last_failure = 0, None, None, None
    for status, created, finished in rows:
        if status == Status.SUCCEEDED:
            last_success = finished
            break
        failures += 1
        first_failure = created
        last_failure = last_failure or finished
    return failures, first_failure, last_success, last_failure


def _scan_binding(
    binding_id: uuid.UUID, finished: list[tuple[uuid.UUID, str]], report: ScanReport
) -> None:
    from dispatch.models import JobBinding

    with transaction.atomic():
        binding = JobBinding.objects.filter(pk=binding_id).first()
        if binding is None:
            return
        # A binding's first scan counts its runs from the start.
        BindingHealth.objects.get_or_create(
            binding_id=binding_id, defaults={"counted_since": binding.created_at}
        )
        health = BindingHealth.objects.select_for_update().get(binding_id=binding_id)
        _reset_if_reenabled(binding, health, report)
        was_failing = health.consecutive_failures > 0
        failures, first_failure, last_success, last_failure = _streak(
            binding_id, health.counted_since
        )
        health.consecutive_failures = failures
        health.failing_since = first_failure if failures else None
        if last_success is not None:
            health.last_success_at = max(filter(None, [health.last_success_at, last_success]))
        if last_failure is not None:
            health.last_failure_at = max(filter(None, [health.last_failure_at, last_failure]))
        for run_id, status in finished:
            if status == Status.FAILED:
                _enqueue(AlertKind.RUN_FAILED, binding, health, report, run_id=run_id)
        for run_id, changes in _schema_changes(finished):
            _enqueue(
                AlertKind.SCHEMA_CHANGED,
                binding,
                health,
                report,
                run_id=run_id,
                extra={"schema_changes": changes},
            )
        success = next((r for r, s in reversed(finished) if s == Status.SUCCEEDED), None)
        if (
            was_failing
            and failures == 0
            and success is not None
            and health.state != HealthState.AUTO_DISABLED
        ):
            health.state = HealthState.OK
            health.reason = ""
            health.warned_at = None
            report.recovered.append(binding.name)
            _enqueue(AlertKind.BINDING_RECOVERED, binding, health, report, run_id=success)
        _thresholds(binding, health, report)
        health.updated_at = Now()
        health.save()


def _schema_changes(
    finished: list[tuple[uuid.UUID, str]],
) -> list[tuple[uuid.UUID, list[dict[str, Any]]]]:
    """The schema changes the sinks of the succeeded runs among `finished` applied or
    found (columns added, widened, or missing from the source), run by run: the column
    names and types only, never a value. A column a policy ignores is on the attempt's
    page, not in an alert (it changes nothing in the sink)."""
    from dispatch.models import Attempt

    succeeded = [run_id for run_id, status in finished if status == Status.SUCCEEDED]
    if not succeeded:
        return []
    found = []
    for run_id, changes in (
        Attempt.objects.filter(run_id__in=succeeded, schema_changes__isnull=False)
        .order_by("run_id", "number")
        .values_list("run_id", "schema_changes")
    ):
        alerted = [c for c in changes or [] if c.get("change") in ALERTED]
        if alerted:
            found.append((run_id, alerted))
    return found


def _reset_if_reenabled(binding: Any, health: BindingHealth, report: ScanReport) -> None:
    """An operator re-enabled an auto-disabled binding: count its failures afresh."""
    if health.state == HealthState.AUTO_DISABLED and binding.enabled:
        health.state = HealthState.OK
        health.reason = ""
        health.warned_at = None
        health.consecutive_failures = 0
        health.failing_since = None
        # Runs from the disable on count (one created while it was disabled ran only
        # after the re-enable).
        health.counted_since = health.disabled_at or Now()
        health.disabled_at = None
        report.reset.append(binding.name)


def _thresholds(binding: Any, health: BindingHealth, report: ScanReport) -> None:
    """Warn, then disable, by failure count or by time since the streak began."""
    if health.state == HealthState.AUTO_DISABLED or not health.consecutive_failures:
        return
    now = db_now()
    days = (now - health.failing_since).total_seconds() / 86400 if health.failing_since else 0
    n = health.consecutive_failures
    disable_n, disable_days = conf.auto_disable_failures(), conf.auto_disable_days()
    warn_n, warn_days = conf.warn_failures(), conf.warn_days()
    if (disable_n and n >= disable_n) or (disable_days and days >= disable_days):
        why = (
            f"{n} consecutive failed runs (threshold {disable_n})"
            if disable_n and n >= disable_n
            else f"no successful run for {days:.1f} days (threshold {disable_days:g})"
        )
        # The reason stays on the health row, shown on the binding's page and the
        # overview; no admin history entry, which would need a user, and none did it.
        type(binding).objects.filter(pk=binding.pk, enabled=True).update(enabled=False)
        health.state = HealthState.AUTO_DISABLED
        health.reason = f"auto-disabled: {why}"[:200]
        health.disabled_at = Now()
        report.disabled.append(binding.name)
        _enqueue(AlertKind.BINDING_AUTO_DISABLED, binding, health, report, event=why)
        return
    if health.state == HealthState.OK and (
        (warn_n and n >= warn_n) or (warn_days and days >= warn_days)
    ):
        why = (
            f"{n} consecutive failed runs (warning at {warn_n})"
            if warn_n and n >= warn_n
            else f"no successful run for {days:.1f} days (warning at {warn_days:g})"
        )
        health.state = HealthState.WARNED
        health.reason = f"warned: {why}"[:200]
        health.warned_at = Now()
        report.warned.append(binding.name)
        _enqueue(AlertKind.BINDING_WARNED, binding, health, report, event=why)


def _scan_failing(report: ScanReport) -> None:
    """The time-based thresholds of bindings that are failing but ran nothing new (the
    partial index on failing_since: as many rows as failing bindings)."""
    from dispatch.models import JobBinding

    ids = list(
        BindingHealth.objects.filter(failing_since__isnull=False)
        .exclude(state=HealthState.AUTO_DISABLED)
        .values_list("binding_id", flat=True)[:SCAN_BATCH]
    )
    for binding_id in ids:
        with transaction.atomic():
            health = BindingHealth.objects.select_for_update().get(binding_id=binding_id)
            binding = JobBinding.objects.get(pk=binding_id)
            _thresholds(binding, health, report)
            health.updated_at = Now()
            health.save()


# --- the outbox ----------------------------------------------------------------------------
def _admins() -> list[str]:
    from django.conf import settings

    return [address for _, address in getattr(settings, "ADMINS", [])]


def _recipients(health: BindingHealth, event_at: datetime | None) -> tuple[list[str], list[str]]:
    """The addresses an alert of an event at `event_at` (None: now) goes to, and the
    binding's own addresses withheld from it, each with why. Its own addresses count
    when `DISPATCH_ALERT_EMAIL_DOMAINS` allows them and the event came after the latest
    recipient was added; without any, the site's ADMINS (always allowed: the site owner's
    choice)."""
    domains = conf.alert_email_domains()
    before = event_at is not None and event_at <= health.alert_settings_changed_at
    own, withheld = [], []
    for address in alert_addresses(health.alert_emails):
        if not domain_allowed(address, domains):
            withheld.append(f"{address}: outside DISPATCH_ALERT_EMAIL_DOMAINS")
        elif before:
            withheld.append(f"{address}: recipients added after the event")
        else:
            own.append(address)
    return own or _admins(), withheld


def _notifiers(health: BindingHealth, event_at: datetime | None) -> list[str]:
    """This binding's notifiers for an event at `event_at`: `email` when it has
    recipients; `webhook:NAME` for its own named webhook if chosen before the event, else
    `webhook` when the site has a default URL."""
    chosen = []
    before = event_at is not None and event_at <= health.alert_settings_changed_at
    for notifier in conf.alert_notifiers():
        if notifier == "email":
            if _recipients(health, event_at)[0]:
                chosen.append(notifier)
        elif notifier == "webhook":
            if health.alert_webhook and not before:
                chosen.append(f"webhook:{health.alert_webhook}")
            elif conf.alert_webhook_url():
                chosen.append(notifier)
        else:
            chosen.append(notifier)
    return chosen


def _run_link(run_id: uuid.UUID) -> str:
    """The run's page in the console, as a path (no setting names the site's address);
    "" when the host site mounts no admin."""
    from django.urls import NoReverseMatch, reverse

    try:
        return reverse("admin:dispatch_run_change", args=[run_id])
    except NoReverseMatch:
        return ""


def _payload(
    kind: str, binding: Any, health: BindingHealth, run_id: uuid.UUID | None, event: str
) -> tuple[dict[str, Any], datetime | None]:
    """The alert's `PAYLOAD_FIELDS`, and when its event happened (the run's end; None
    for a threshold, which the scan crosses now)."""
    from dispatch.models import Attempt, Run

    payload: dict[str, Any] = {
        "kind": kind,
        "binding": binding.name,
        "binding_id": str(binding.pk),
        "consecutive_failures": health.consecutive_failures,
        "health": str(health.state),
        "event": event,
    }
    if run_id is None:
        return payload, None
    payload.update(run_id=str(run_id), link=_run_link(run_id))
    run = Run.objects.filter(pk=run_id).values("status", "finished_at").first()
    finished_at = run["finished_at"] if run else None
    if run:
        payload.update(
            status=run["status"],
            finished_at=finished_at.isoformat() if finished_at else None,
        )
    last = (
        Attempt.objects.filter(run_id=run_id)
        .order_by("-number")
        .values("number", "reason", "rows_read", "rows_written")
        .first()
    )
    if last:
        payload.update(
            attempts=last["number"],
            reason=last["reason"],
            rows_read=last["rows_read"],
            rows_written=last["rows_written"],
        )
    return payload, finished_at


def _enqueue(
    kind: str,
    binding: Any,
    health: BindingHealth,
    report: ScanReport,
    *,
    run_id: uuid.UUID | None = None,
    event: str = "",
    extra: dict[str, Any] | None = None,
) -> None:
    """One outbox row per notifier; the de-duplication key makes a second enqueue of the
    same event a no-op. Past the rate limit (per binding and kind, per hour) the row is
    SUPPRESSED: visible in the console, never sent."""
    if health.alerts_muted:
        return
    payload, event_at = _payload(kind, binding, health, run_id, event)
    payload.update(extra or {})
    notifiers = _notifiers(health, event_at)
    if not notifiers:
        return
    recipients, withheld = _recipients(health, event_at)
    # One alert per run, or per failing streak and kind (its first failure names it).
    streak = health.failing_since.isoformat() if health.failing_since else "-"
    event_key = str(run_id) if run_id else streak
    limit = conf.alert_rate_limit()
    for notifier in notifiers:
        recent = Alert.objects.filter(
            binding_id=binding.pk,
            kind=kind,
            notifier=notifier,
            created_at__gte=Now() - timedelta(hours=1),
        ).count()
        status = AlertStatus.SUPPRESSED if limit and recent >= limit else AlertStatus.PENDING
        key = f"{kind}:{binding.pk}:{event_key}:{notifier}"[:300]
        try:
            with transaction.atomic():
                Alert.objects.create(
                    kind=kind,
                    notifier=notifier,
                    binding_id=binding.pk,
                    binding_name=binding.name,
                    run_id=run_id,
                    dedup_key=key,
                    status=status,
                    payload={**payload, "recipients": recipients, "withheld": withheld}
                    if notifier == "email"
                    else payload,
                )
        except IntegrityError:
            continue  # enqueued before: de-duplicated
        if status == AlertStatus.SUPPRESSED:
            report.suppressed += 1
        else:
            report.alerts += 1


# --- the drain -----------------------------------------------------------------------------
def _lease(limit: int) -> list[Alert]:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE dispatch_alert SET next_attempt_at = now() + make_interval(secs => %s),"
            " attempts = attempts + 1"
            " WHERE id IN (SELECT id FROM dispatch_alert WHERE status = 'PENDING'"
            " AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT %s"
            " FOR UPDATE SKIP LOCKED) RETURNING id",
            [LEASE_SECONDS, limit],
        )
        ids = [row[0] for row in cursor.fetchall()]
    return list(Alert.objects.filter(id__in=ids).order_by("created_at"))


# What a notifier raises when delivery fails: a setting (ValueError), the webhook's answer
# (RuntimeError, see _send_webhook), the network or the mail server (OSError, which
# smtplib's errors are). Anything else is a bug: still retried, its traceback logged.
DELIVERY_ERRORS: tuple[type[Exception], ...] = (ValueError, RuntimeError, OSError)


def drain(*, limit: int = DRAIN_BATCH) -> int:
    """Send the due alerts; returns how many were sent."""
    sent = 0
    for alert in _lease(limit):
        try:
            send(alert)
        except Exception as exc:  # noqa: BLE001 - the outbox's boundary: the alert is retried
            if not isinstance(exc, DELIVERY_ERRORS):
                log.error(
                    "alert notifier raised %s (a bug) kind=%s notifier=%s",
                    type(exc).__name__,
                    alert.kind,
                    alert.notifier,
                    exc_info=True,
                )
            error = storable(" ".join(str(exc).split()))[:ERROR_CHARS] or type(exc).__name__
            final = alert.attempts >= conf.alert_max_attempts()
            delay = min(conf.alert_backoff() * 2 ** (alert.attempts - 1), 3600.0)
            Alert.objects.filter(pk=alert.pk).update(
                status=AlertStatus.FAILED if final else AlertStatus.PENDING,
                last_error=error,
                next_attempt_at=Now() + timedelta(seconds=delay),
            )
            log.warning(
                "alert not sent kind=%s binding=%s notifier=%s attempt=%d final=%s error=%s",
                alert.kind,
                alert.binding_name,
                alert.notifier,
                alert.attempts,
                final,
                error,
            )
            continue
        # The payload too: the email notifier records the recipients it dropped.
        Alert.objects.filter(pk=alert.pk).update(
            status=AlertStatus.SENT, sent_at=Now(), last_error="", payload=alert.payload
        )
        sent += 1
    return sent


SUBJECTS = {
    AlertKind.RUN_FAILED: "run of {binding} failed for good",
    AlertKind.BINDING_RECOVERED: "{binding} succeeded again",
    AlertKind.BINDING_WARNED: "{binding} keeps failing",
    AlertKind.BINDING_AUTO_DISABLED: "{binding} was disabled",
    AlertKind.SCHEMA_CHANGED: "{binding} changed its sink table's columns",
}


def send(alert: Alert) -> None:
    if alert.notifier == "email":
        _send_email(alert)
    elif alert.notifier == "webhook":
        _send_webhook(alert, conf.alert_webhook_url(), conf.alert_webhook_secret())
    elif alert.notifier.startswith("webhook:"):
        name = alert.notifier.partition(":")[2]
        hook = conf.alert_webhooks().get(name)
        if hook is None or not hook["url"]:
            raise ValueError(f"webhook {name!r} is not in DISPATCH_ALERT_WEBHOOKS")
        _send_webhook(alert, hook["url"], hook["secret"])
    else:
        raise ValueError(f"unknown notifier {alert.notifier!r}")


# The body's labels where they differ from the payload's keys.
BODY_LABELS = {"link": "run"}
BODY_FOOTER = (
    "The run's page in the console shows its error, if any, to whoever may view runs; "
    "alerts never carry it."
)


def body_text(payload: dict[str, Any]) -> str:
    """An email's body: one `label: value` line per `PAYLOAD_FIELDS` key that has one."""
    lines = [
        f"{BODY_LABELS.get(key, key)}: "
        + (describe_changes(payload[key]) if key == "schema_changes" else str(payload[key]))
        for key in PAYLOAD_FIELDS
        if payload.get(key) not in (None, "")
    ]
    return "\n".join([*lines, "", BODY_FOOTER])


def _sendable(recorded: list[str]) -> tuple[list[str], list[str]]:
    """The recorded recipients the settings allow now (the site's ADMINS, or at
    `DISPATCH_ALERT_EMAIL_DOMAINS`: it may have narrowed since the alert was written),
    else ADMINS; and those dropped, with why."""
    admins, domains = _admins(), conf.alert_email_domains()
    kept, dropped = [], []
    for address in recorded:
        if address in admins or domain_allowed(address, domains):
            kept.append(address)
        else:
            dropped.append(f"{address}: outside DISPATCH_ALERT_EMAIL_DOMAINS")
    return kept or admins, dropped


def _send_email(alert: Alert) -> None:
    from django.core.mail import send_mail

    recipients, dropped = _sendable(list(alert.payload.get("recipients", [])))
    if dropped:
        withheld = list(alert.payload.get("withheld", []))
        alert.payload = {**alert.payload, "recipients": recipients, "withheld": withheld + dropped}
    if not recipients:
        raise ValueError("no recipients (the binding's alert_emails and ADMINS are empty)")
    subject = "[dispatch] " + SUBJECTS[AlertKind(alert.kind)].format(binding=alert.binding_name)
    send_mail(subject, body_text(alert.payload), None, recipients, fail_silently=False)


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """HMAC-SHA256 of `timestamp.body` under the shared secret, hex."""
    return hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def webhook_host(url: str) -> str:
    """The host (and port) of a webhook URL, for messages: never its path, query or
    credentials, which may hold a token."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        return f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        return "?"


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: urllib would turn the POST into a GET without its body
    (301/302/303) and send the signature header to the new host. The 3xx then reaches the
    default error handler and is an HTTPError like any other answer outside 2xx."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _send_webhook(alert: Alert, url: str, secret: str) -> None:
    if not url:
        raise ValueError("DISPATCH_ALERT_WEBHOOK_URL is not set")
    fields = {k: alert.payload[k] for k in PAYLOAD_FIELDS if k in alert.payload}
    body = json.dumps(
        {"id": str(alert.id), "created_at": alert.created_at.isoformat(), **fields},
        sort_keys=True,
    ).encode()
    timestamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", "User-Agent": "dispatch-alerts"}
    if secret:
        headers["X-Dispatch-Signature"] = f"t={timestamp},v1={signature(secret, timestamp, body)}"
    host = webhook_host(url)
    try:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        # urlopen's handlers (proxies from the environment, http, https) but for redirects.
        opener = urllib.request.build_opener(_RefuseRedirects)
        with opener.open(request, timeout=conf.alert_webhook_timeout()) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        exc.close()
        # Never the Location: it is the redirecting server's to choose, and may carry a token.
        redirect = " (a redirect: not followed)" if 300 <= exc.code < 400 else ""
        raise RuntimeError(f"webhook at {host} answered HTTP {exc.code}{redirect}") from None
    except urllib.error.URLError as exc:
        # An OSError says what the network said; any other reason may quote the URL.
        detail = f": {exc.reason}" if isinstance(exc.reason, OSError) else ""
        raise RuntimeError(f"webhook at {host} unreachable{detail}") from None
    except OSError as exc:
        raise RuntimeError(f"webhook at {host} unreachable: {exc}") from None
    except (ValueError, http.client.HTTPException) as exc:
        # The messages of these quote the URL, which may carry a token: the kind only.
        raise RuntimeError(f"webhook at {host} failed: {type(exc).__name__}") from None
    if not 200 <= status < 300:
        raise RuntimeError(f"webhook at {host} answered HTTP {status}")
