"""Tables of the operations side: maintenance state, binding health and the alert outbox.

They are imported by `dispatch.models` (Django finds models there); nothing in the claim
path reads or writes them.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

# At most this many addresses for one binding's alerts (a list address serves more):
# whoever may edit a binding cannot turn the site's mail server into a mass mailer.
MAX_ALERT_RECIPIENTS = 20


def alert_addresses(text: str) -> list[str]:
    """The addresses of an `alert_emails` value, in order, blanks dropped."""
    return [a.strip() for a in text.split(",") if a.strip()]


def domain_allowed(address: str, domains: frozenset[str]) -> bool:
    """Whether `domains` (`dispatch.core.conf.alert_email_domains()`) let a binding's alerts go
    to `address`: its domain is listed, or "*" is."""
    from dispatch.core.conf import ANY_DOMAIN

    return ANY_DOMAIN in domains or address.rsplit("@", 1)[-1].lower() in domains


class OpsState(models.Model):
    """One row per maintenance task ("retention", "health"): when it last ran, what it
    did, and its cursor. Written with conditional updates, so any number of workers may
    run the task without a leader."""

    key = models.CharField(max_length=40, primary_key=True)
    data = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "maintenance state"

    def __str__(self) -> str:
        return self.key


class HealthState(models.TextChoices):
    # In: the health scan, when the binding has neither warning nor disabling failures;
    # re-enabling an auto-disabled binding. Out: the health scan (-> WARNED, AUTO_DISABLED).
    OK = "OK", "OK"
    # In: the health scan at the warn threshold. Out: a success (-> OK), the disable
    # threshold (-> AUTO_DISABLED).
    WARNED = "WARNED", "Warned"
    # In: the health scan at the disable threshold (it also disables the binding).
    # Out: an operator re-enables the binding (-> OK, failures counted afresh).
    AUTO_DISABLED = "AUTO_DISABLED", "Auto-disabled"


class BindingHealth(models.Model):
    """Failure streak of a binding (for alerts and auto-disable) and its alert settings.

    The streak counts runs created after `counted_since`: re-enabling an auto-disabled
    binding moves it forward, so old failures never disable it again.
    """

    binding = models.OneToOneField(
        "dispatch.JobBinding", on_delete=models.CASCADE, primary_key=True, related_name="health"
    )
    state = models.CharField(max_length=20, choices=HealthState.choices, default=HealthState.OK)
    consecutive_failures = models.PositiveIntegerField(default=0)
    # The first failed run after the latest success (NULL: not failing).
    failing_since = models.DateTimeField(null=True, blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    counted_since = models.DateTimeField(db_default=Now())
    reason = models.CharField(max_length=200, blank=True, default="")
    warned_at = models.DateTimeField(null=True, blank=True)
    disabled_at = models.DateTimeField(null=True, blank=True)
    # Alert settings of this binding.
    alert_emails = models.TextField(
        blank=True,
        default="",
        help_text="Comma-separated addresses for this binding's alerts; empty: the site's ADMINS.",
    )
    alert_webhook = models.CharField(
        max_length=100,
        blank=True,
        default="",
        # A database default too: workers of the previous release insert health rows
        # without this column while a rolling upgrade runs (docs/deployment.md).
        db_default="",
        help_text="The name of one of the site's DISPATCH_ALERT_WEBHOOKS for this binding's "
        "alerts; empty: the site's default webhook (DISPATCH_ALERT_WEBHOOK_URL), if any.",
    )
    alerts_muted = models.BooleanField(
        default=False, help_text="Send no alerts for this binding (auto-disable still applies)."
    )
    # When an address or a named webhook was last added (database time; the trigger
    # dispatch_alert_recipients_changed moves it, whatever writes the row). Alerts of
    # events before it go to the site's ADMINS and default webhook, never to recipients
    # that were not there when it happened (dispatch.ops.alerts).
    alert_settings_changed_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "binding health"
        verbose_name_plural = "binding health"
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=HealthState.values), name="dispatch_health_state_valid"
            ),
        ]
        indexes = [
            # The overview's warned / auto-disabled bindings and the health scan's
            # time-based pass (failing for D days).
            models.Index(
                fields=["failing_since"],
                condition=Q(failing_since__isnull=False),
                name="dispatch_health_failing_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"health of {self.binding_id}"

    # The alert settings an operator edits; everything else is the health scan's.
    SETTINGS_FIELDS = ("alert_emails", "alert_webhook", "alerts_muted")

    def _stored_webhook(self) -> str | None:
        if self._state.adding:
            return None
        rows = type(self).objects.filter(pk=self.pk).values_list("alert_webhook", flat=True)
        return rows.first()

    def clean(self) -> None:
        from django.core.exceptions import ValidationError
        from django.core.validators import validate_email

        from dispatch.core import conf

        errors: dict[str, str] = {}
        addresses = alert_addresses(self.alert_emails)
        domains = conf.alert_email_domains()
        for address in addresses:
            try:
                validate_email(address)
            except ValidationError:
                errors["alert_emails"] = f"{address[:100]!r} is not an email address."
                break
            if not domains:
                errors["alert_emails"] = (
                    f"{address[:100]!r} cannot get this binding's alerts: "
                    "DISPATCH_ALERT_EMAIL_DOMAINS allows no binding's own addresses (its "
                    "alerts go to the site's ADMINS)."
                )
                break
            if not domain_allowed(address, domains):
                errors["alert_emails"] = (
                    f"{address[:100]!r} is not at one of the site's alert domains "
                    f"(DISPATCH_ALERT_EMAIL_DOMAINS: {', '.join(sorted(domains))})."
                )
                break
        if len(addresses) > MAX_ALERT_RECIPIENTS and "alert_emails" not in errors:
            errors["alert_emails"] = (
                f"{len(addresses)} addresses; a binding's alerts go to at most "
                f"{MAX_ALERT_RECIPIENTS} (use a list address for more)."
            )
        names = sorted(conf.alert_webhooks())
        if (
            self.alert_webhook
            and self.alert_webhook not in names
            # A name the site dropped since it was stored is reported on the page, not a
            # reason to refuse every other edit of the binding.
            and self.alert_webhook != self._stored_webhook()
        ):
            errors["alert_webhook"] = (
                f"{self.alert_webhook[:100]!r} is not one of the site's webhooks "
                f"(DISPATCH_ALERT_WEBHOOKS: {', '.join(names) or 'none configured'})."
            )
        if errors:
            raise ValidationError(errors)


class AlertKind(models.TextChoices):
    RUN_FAILED = "RUN_FAILED", "Run failed for good"
    BINDING_RECOVERED = "BINDING_RECOVERED", "Failing binding succeeded again"
    BINDING_WARNED = "BINDING_WARNED", "Binding warned (failing)"
    BINDING_AUTO_DISABLED = "BINDING_AUTO_DISABLED", "Binding auto-disabled"
    SCHEMA_CHANGED = "SCHEMA_CHANGED", "Sink table's columns changed by policy"


class AlertStatus(models.TextChoices):
    # In: the health scan enqueues it. Out: a drainer sends it (-> SENT) or gives up
    # after the last retry (-> FAILED).
    PENDING = "PENDING", "Pending"
    SENT = "SENT", "Sent"
    FAILED = "FAILED", "Failed (gave up)"
    # In: the health scan, when the rate limit for its binding/kind or the site is hit.
    SUPPRESSED = "SUPPRESSED", "Suppressed (rate limit)"


class Alert(models.Model):
    """The alert outbox: one row per notification and notifier, written by the health
    scan, sent by any worker's drainer (never on a worker's execution path)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=30, choices=AlertKind.choices)
    notifier = models.CharField(max_length=50)
    # Plain values, no foreign keys: an alert outlives a pruned run.
    binding_id = models.UUIDField(null=True, blank=True)
    binding_name = models.CharField(max_length=200, blank=True, default="")
    run_id = models.UUIDField(null=True, blank=True)
    # De-duplication: one alert per event and notifier, whoever enqueues it.
    dedup_key = models.CharField(max_length=300, unique=True)
    status = models.CharField(
        max_length=20, choices=AlertStatus.choices, default=AlertStatus.PENDING
    )
    payload = models.JSONField(default=dict)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(db_default=Now())
    created_at = models.DateTimeField(db_default=Now())
    sent_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=AlertStatus.values), name="dispatch_alert_status_valid"
            ),
        ]
        indexes = [
            # The drainer: due PENDING alerts, oldest first.
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(status="PENDING"),
                name="dispatch_alert_due_idx",
            ),
            # The rate limit: recent alerts of one binding and kind.
            models.Index(
                fields=["binding_id", "kind", "-created_at"], name="dispatch_alert_binding_idx"
            ),
            # Retention and the overview's alerts of the last 24 h.
            models.Index(fields=["created_at"], name="dispatch_alert_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.binding_name} via {self.notifier}"


class BindingMetrics(models.Model):
    """Cumulative counters of a binding's finished runs, for the site's metrics: runs by
    final status, attempts by outcome, rows read and written, and the buckets of two
    histograms (attempt duration, queue wait). Folded in by the maintenance loop from the
    runs finished since its cursor, in the transaction that moves the cursor, so each
    finished run is counted once (`dispatch.ops.binding_metrics`). They survive worker
    restarts and retention; deleting the binding deletes them."""

    binding = models.OneToOneField(
        "dispatch.JobBinding", on_delete=models.CASCADE, primary_key=True, related_name="metrics"
    )
    # {"runs": {status: n}, "attempts": {outcome: n}, "rows_read": n, "rows_written": n,
    #  "duration": [n per bucket], "duration_sum": s, "wait": [...], "wait_sum": s}
    counters = models.JSONField(default=dict)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "binding metrics"
        verbose_name_plural = "binding metrics"

    def __str__(self) -> str:
        return f"metrics of {self.binding_id}"
