"""Schedules: a 5-field cron expression in an IANA timezone on a binding (contract section 7).

The reconciler (`scheduling.reconciler`) owns `next_fire_at`, `last_fired_at`,
`last_run` and the skip fields; a form or a `save()` never writes a stale copy of them
back (see `Schedule.save`).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatch.core.db import db_now
from dispatch.models import JobBinding, Run
from dispatch.models.core import managed_by_field
from dispatch.security import names
from scheduling import cron as cronexpr
from scheduling import wakeup


class MisfirePolicy(models.TextChoices):
    """What happens to slots missed while nothing fired them (late by the grace or more)."""

    # One catch-up run for the latest missed slot (none of its own when an on-time slot
    # is due in the same pass: that run is the catch-up). The default.
    FIRE_ONCE = "FIRE_ONCE", "Fire once"
    # No run for missed slots; the skip is recorded (reason MISFIRE).
    SKIP = "SKIP", "Skip"


class OverlapPolicy(models.TextChoices):
    """What happens to a slot that comes due while this schedule's previous run is live."""

    # No run for the slot; the skip is recorded (reason OVERLAP). The default.
    SKIP = "SKIP", "Skip"
    # Create the run; it waits behind the binding's max_concurrency like any other run.
    QUEUE = "QUEUE", "Queue"


class SkipReason(models.TextChoices):
    """Why a due slot created no run (`Schedule.last_skip_reason`)."""

    BINDING_DISABLED = "BINDING_DISABLED", "Binding disabled"
    JOB_DISABLED = "JOB_DISABLED", "Job disabled"
    OVERLAP = "OVERLAP", "Overlap (previous run live)"
    MISFIRE = "MISFIRE", "Misfire (slot missed)"


def validate_cron(value: str) -> None:
    try:
        cronexpr.check_expression(value)
    except cronexpr.CronError as exc:
        raise ValidationError(str(exc), code="invalid_cron") from None


def validate_timezone(value: str) -> None:
    try:
        cronexpr.zone(value)
    except cronexpr.CronError as exc:
        raise ValidationError(str(exc), code="invalid_timezone") from None


class ScheduleQuerySet(models.QuerySet["Schedule"]):
    def enabled(self) -> ScheduleQuerySet:
        return self.filter(enabled=True)

    def due(self) -> ScheduleQuerySet:
        return self.filter(enabled=True, next_fire_at__lte=Now())


# Written by the reconciler only; `save()` re-reads them under the row lock.
RECONCILER_FIELDS = (
    "next_fire_at",
    "last_fired_at",
    "last_run_id",
    "skip_count",
    "last_skip_reason",
    "last_skip_at",
)


class Schedule(models.Model):
    """A cron schedule on a binding; each slot creates one run (trigger SCHEDULE)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # The stable name definition files key a schedule by. Left blank, `save()` derives one
    # from the binding's; NULL only on rows written around the model (older releases, SQL).
    name = models.CharField(
        max_length=200,
        unique=True,
        null=True,
        blank=True,
        validators=[names.validate_name],
        help_text="A stable name (definition files use it); blank: derived from the binding.",
    )
    binding = models.ForeignKey(JobBinding, on_delete=models.PROTECT, related_name="schedules")
    cron = models.CharField(
        max_length=200,
        validators=[validate_cron],
        help_text="Five fields: minute hour day-of-month month day-of-week, e.g. "
        "<code>*/15 * * * *</code> or <code>30 2 * * MON-FRI</code>.",
    )
    timezone = models.CharField(
        max_length=64,
        default="UTC",
        validators=[validate_timezone],
        help_text="IANA time zone the expression is read in, e.g. Europe/Berlin.",
    )
    enabled = models.BooleanField(default=True)
    misfire_policy = models.CharField(
        max_length=20, choices=MisfirePolicy.choices, default=MisfirePolicy.FIRE_ONCE
    )
    overlap_policy = models.CharField(
        max_length=20, choices=OverlapPolicy.choices, default=OverlapPolicy.SKIP
    )
    next_fire_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_fired_at = models.DateTimeField(null=True, blank=True, editable=False)
    # No database constraint: dispatch may purge runs without knowing about schedules; a
    # purged run reads as no link (the admin joins it with a LEFT JOIN).
    last_run = models.ForeignKey(
        Run,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        editable=False,
        related_name="+",
    )
    skip_count = models.PositiveIntegerField(default=0, editable=False)
    last_skip_reason = models.CharField(
        max_length=40, choices=SkipReason.choices, null=True, blank=True, editable=False
    )
    last_skip_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    managed_by = managed_by_field()

    objects = ScheduleQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(misfire_policy__in=MisfirePolicy.values),
                name="scheduling_schedule_misfire_valid",
            ),
            models.CheckConstraint(
                condition=Q(overlap_policy__in=OverlapPolicy.values),
                name="scheduling_schedule_overlap_valid",
            ),
            models.CheckConstraint(
                condition=Q(skip_count__gte=0), name="scheduling_schedule_skip_count_min"
            ),
            names.name_check("scheduling_schedule"),
        ]
        indexes = [
            # The reconciler's due_schedule (next_fire_at <= now()) and next_due_in
            # (min(next_fire_at)) statements.
            models.Index(
                fields=["next_fire_at"],
                condition=Q(enabled=True),
                name="scheduling_schedule_due_idx",
            ),
        ]

    def __str__(self) -> str:
        binding = self.binding.name if self.binding_id else "?"
        return f"{binding}: {self.cron} ({self.timezone})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Validate, keep the reconciler's fields, and register.

        In one transaction: lock the stored row (the reconciler holds it while firing, so
        a save waits milliseconds instead of overwriting a fresh next_fire_at with a stale
        one), copy the reconciler-owned fields from it, clear next_fire_at when the cron
        or timezone changed or the schedule was (re-)enabled or disabled, and set it from
        database now() when the schedule is enabled and has none. Reconcilers are woken
        after the commit.
        """
        self.cron = cronexpr.normalize(self.cron or "")
        self._validate_expression()
        if not self.name:
            self.name = self.default_name()
        update_fields = kwargs.get("update_fields")
        with transaction.atomic():
            if not self._state.adding:
                stored = (
                    type(self)
                    .objects.select_for_update()
                    .filter(pk=self.pk)
                    .values("cron", "timezone", "enabled", *RECONCILER_FIELDS)
                    .first()
                )
                if stored is not None:
                    for name in RECONCILER_FIELDS:
                        setattr(self, name, stored[name])
                    if (
                        stored["cron"] != self.cron
                        or stored["timezone"] != self.timezone
                        or stored["enabled"] != self.enabled
                    ):
                        self.next_fire_at = None
            if not self.enabled:
                self.next_fire_at = None
            elif self.next_fire_at is None:
                self.next_fire_at = self.slots().next_after(db_now())
            if update_fields is not None:
                kwargs["update_fields"] = {*update_fields, "next_fire_at"}
            super().save(*args, **kwargs)
            schedule_id = self.pk
            # After the commit, outside any transaction: a wake-up that fails (a full
            # notification queue) must never fail the save (scheduling.wakeup).
            transaction.on_commit(lambda: wakeup.notify(schedule_id))

    def default_name(self) -> str:
        """`<binding>-<8 hex digits of the id>`: unique by the id, readable by the binding."""
        binding = self.binding.name if self.binding_id else "schedule"
        return f"{binding[:190]}-{self.id.hex[:8]}"

    def slots(self) -> cronexpr.Slots:
        return cronexpr.Slots(self.cron, self.timezone)

    def clean_fields(self, exclude: Any = None) -> None:
        self.cron = cronexpr.normalize(self.cron or "")
        super().clean_fields(exclude=exclude)

    def _validate_expression(self) -> None:
        errors: dict[str, list[str]] = {}
        for name, validator in (("cron", validate_cron), ("timezone", validate_timezone)):
            try:
                validator(getattr(self, name))
            except ValidationError as exc:
                errors[name] = exc.messages
        if errors:
            raise ValidationError(errors)


class ReconcilerBeat(models.Model):
    """The one row saying when a schedule reconciler last started a pass, and which one.

    Upserted in database time by every pass of every reconciler (`survey` in
    scheduling/sql/queries.sql: one statement, whatever the number of schedules); read by
    the system check `scheduling.W001`, the console's overview and the schedules list,
    which warn when schedules are overdue and no reconciler has run for a while.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    beat_at = models.DateTimeField()
    reconciler = models.CharField(max_length=200)

    class Meta:
        verbose_name = "reconciler heartbeat"
        constraints = [
            models.CheckConstraint(condition=Q(id=1), name="scheduling_reconcilerbeat_one_row"),
        ]

    def __str__(self) -> str:
        return f"{self.reconciler} at {self.beat_at.isoformat()}"
