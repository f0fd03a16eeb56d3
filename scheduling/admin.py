"""Schedule admin: list with upcoming fire times, last run and skips; enable/disable.

Creating or enabling a schedule, or changing when or for which binding an enabled one
fires (binding, cron, time zone, policies), also needs the trigger permission
(`dispatch.trigger_binding`) of the binding(s) involved: a schedule is a standing trigger. The form says so as an error; an action refuses with 403.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet, Subquery
from django.db.models.functions import Now
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils import timezone as dj_timezone
from django.utils.html import format_html, format_html_join

from dispatch.console.managed import ManagedByFilesAdmin
from scheduling import cron, health
from scheduling.models import ReconcilerBeat, Schedule

TRIGGER_PERMISSION = "dispatch.trigger_binding"
UPCOMING = 5
POLICY_FIELDS = ["misfire_policy", "overlap_policy"]


def _link(modeladmin: Any, viewname: str, pk: Any, text: str) -> str:
    """A link to another page of the admin site `modeladmin` is registered on, or the
    plain text when that page is not registered there."""
    try:
        url = reverse(viewname, args=[pk], current_app=modeladmin.admin_site.name)
        return format_html('<a href="{}">{}</a>', url, text)
    except NoReverseMatch:
        return text


# Every field that decides when, how often or for which binding an enabled schedule fires.
FIRING_FIELDS = ("enabled", "binding_id", "cron", "timezone", "misfire_policy", "overlap_policy")


def stored_firing(schedule: Schedule) -> dict[str, Any] | None:
    """The stored values of FIRING_FIELDS, or None for a schedule not saved yet."""
    if schedule.pk is None or schedule._state.adding:
        return None
    return Schedule.objects.filter(pk=schedule.pk).values(*FIRING_FIELDS).first()


def needs_trigger_permission(schedule: Schedule, stored: Mapping[str, object] | None) -> bool:
    """True when saving `schedule` leaves an enabled schedule that fires differently than
    before: created or enabled, moved to another binding, a new cron or time zone (yearly to
    every minute), other misfire/overlap policies. Disabling never needs it."""
    if not schedule.enabled:
        return False
    if stored is None:
        return True
    current = {f: getattr(schedule, f) for f in FIRING_FIELDS}
    current["cron"] = cron.normalize(current["cron"] or "")
    return any(stored[f] != current[f] for f in FIRING_FIELDS)


def bindings_involved(schedule: Schedule, stored: Mapping[str, object] | None) -> list[Any]:
    """The binding the schedule fires for, and the one it is moved away from."""
    ids: list[Any] = [schedule.binding_id]
    if stored is not None and stored["binding_id"] not in ids:
        ids.append(stored["binding_id"])
    return [i for i in ids if i is not None]


def may_trigger(user: Any, binding_ids: list[Any]) -> bool:
    """The trigger permission for every binding: the model permission, or an object
    permission on each binding where the site has a backend for those."""
    if user.has_perm(TRIGGER_PERMISSION):
        return True
    from dispatch.models import JobBinding

    bindings = list(JobBinding.objects.filter(pk__in=binding_ids))
    return len(bindings) == len(set(binding_ids)) and all(
        user.has_perm(TRIGGER_PERMISSION, b) for b in bindings
    )


class ScheduleForm(forms.ModelForm):
    request: HttpRequest | None = None

    class Meta:
        model = Schedule
        fields = [
            "name",
            "binding",
            "cron",
            "timezone",
            "enabled",
            "misfire_policy",
            "overlap_policy",
        ]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        request = self.request
        if request is None or not (data.get("binding") or self.instance.binding_id):
            return data
        stored = stored_firing(self.instance)
        candidate = Schedule(
            binding=data.get("binding") or self.instance.binding,
            enabled=bool(data.get("enabled")),
            cron=data.get("cron", self.instance.cron),
            timezone=data.get("timezone", self.instance.timezone),
            misfire_policy=data.get("misfire_policy", self.instance.misfire_policy),
            overlap_policy=data.get("overlap_policy", self.instance.overlap_policy),
        )
        if needs_trigger_permission(candidate, stored) and not may_trigger(
            request.user, bindings_involved(candidate, stored)
        ):
            raise forms.ValidationError(
                "Creating, enabling or changing when or for which binding an enabled "
                "schedule fires needs the trigger permission of the binding(s) involved "
                "(dispatch | binding | Can trigger a run of a binding) as well. Save it "
                "disabled, or ask for that permission.",
                code="trigger_permission",
            )
        return data


@admin.register(Schedule)
class ScheduleAdmin(ManagedByFilesAdmin):
    form = ScheduleForm
    list_display = [
        "cron_expression",
        "name",
        "binding_link",
        "timezone",
        "enabled",
        "misfire_policy",
        "overlap_policy",
        "upcoming",
        "last_run_link",
        "skip_count",
        "last_skip_reason",
    ]
    list_display_links = ["cron_expression"]
    list_filter = ["enabled", "misfire_policy", "overlap_policy", "last_skip_reason", "timezone"]
    search_fields = ["name", "binding__name", "cron", "timezone"]
    # One query for the page: the binding and the last run are joined, the upcoming
    # times are computed from the row itself.
    list_select_related = ["binding", "last_run"]
    state_fields = [
        "next_fire_at",
        "upcoming",
        "last_fired_at",
        "last_run_link",
        "skip_count",
        "last_skip_reason",
        "last_skip_at",
        "created_at",
    ]
    readonly_fields = ["explanation", *state_fields]
    actions = ["enable_schedules", "disable_schedules"]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        main = ["name", "binding", "cron", "timezone", "enabled"]
        if obj is None:  # nothing to show about a schedule that does not exist yet
            return [(None, {"fields": main}), ("Policies", {"fields": POLICY_FIELDS})]
        return [
            (None, {"fields": [*main[:4], "explanation", main[4]]}),
            ("Policies", {"fields": POLICY_FIELDS}),
            ("State", {"fields": self.state_fields}),
        ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        # The last reconciler beat and database now() in the page's own query (one
        # scalar subquery on a one-row table), for the note beside overdue schedules.
        beat = ReconcilerBeat.objects.filter(pk=1).values("beat_at")
        return (
            super()
            .get_queryset(request)
            .annotate(reconciler_beat_at=Subquery(beat[:1]), db_now=Now())
        )

    # --- permissions ------------------------------------------------------------------------
    def has_trigger_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(TRIGGER_PERMISSION)

    def has_enable_permission(self, request: HttpRequest) -> bool:
        # Action permissions are alternatives (any one suffices); enabling needs both.
        return self.has_change_permission(request) and self.has_trigger_permission(request)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        # A subclass per request, so concurrent requests never share the attribute.
        return type(form.__name__, (form,), {"request": request})

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        # The form already refused; this guards every other path into save_model.
        stored = stored_firing(obj) if change else None
        if needs_trigger_permission(obj, stored) and not may_trigger(
            request.user, bindings_involved(obj, stored)
        ):
            raise PermissionDenied
        super().save_model(request, obj, form, change)

    # --- columns ------------------------------------------------------------------------------
    @admin.display(description="cron", ordering="cron")
    def cron_expression(self, obj: Schedule) -> str:
        return format_html('<span style="white-space: nowrap">{}</span>', obj.cron)

    @admin.display(description="binding", ordering="binding__name")
    def binding_link(self, obj: Schedule) -> str:
        return _link(self, "admin:dispatch_jobbinding_change", obj.binding_id, obj.binding.name)

    @admin.display(description=f"next {UPCOMING} fire times")
    def upcoming(self, obj: Schedule) -> str:
        if not obj.enabled:
            return "disabled"
        try:
            slots = obj.slots()
            start = obj.next_fire_at or dj_timezone.now()
            times = slots.upcoming(start, UPCOMING)
        except cron.CronError as exc:
            return f"cannot be evaluated: {exc}"
        upcoming = format_html_join(
            "",
            '<div style="white-space: nowrap">{}</div>',
            ((t.astimezone(slots.tz).strftime("%Y-%m-%d %H:%M %Z"),) for t in times),
        )
        note = self.overdue_note(obj)
        if note is None:
            return upcoming
        return format_html('<div class="errornote">{}</div>{}', note, upcoming)

    @staticmethod
    def overdue_note(obj: Schedule) -> str | None:
        """'overdue since …: no reconciler has run since …' for an overdue schedule while
        no reconciler runs; from the values `get_queryset` reads with the row."""
        now = getattr(obj, "db_now", None)
        if now is None:
            return None
        return health.overdue_note(obj.next_fire_at, getattr(obj, "reconciler_beat_at", None), now)

    @admin.display(description="last run")
    def last_run_link(self, obj: Schedule) -> str:
        run = obj.last_run
        if run is None:
            return "-"
        return format_html(
            "{} {}", _link(self, "admin:dispatch_run_change", run.pk, str(run.pk)[:8]), run.status
        )

    @admin.display(description="meaning")
    def explanation(self, obj: Schedule) -> str:
        if not obj.cron:
            return "-"
        try:
            return cron.Slots(obj.cron, obj.timezone).explain() or "-"
        except cron.CronError as exc:
            return str(exc)

    # --- actions -------------------------------------------------------------------------------
    @admin.action(description="Enable selected schedules", permissions=["enable"])
    def enable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        if not self.has_enable_permission(request):
            raise PermissionDenied
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected schedules", permissions=["change"])
    def disable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._set_enabled(request, queryset, False)

    def _set_enabled(
        self, request: HttpRequest, queryset: QuerySet[Schedule], enabled: bool
    ) -> None:
        changed = unchanged = 0
        for schedule in queryset.select_related("binding"):
            if schedule.enabled == enabled:
                unchanged += 1
                continue
            schedule.enabled = enabled
            # save() registers (or clears) next_fire_at and wakes the reconcilers.
            schedule.save()
            self.log_change(request, schedule, "Enabled" if enabled else "Disabled")
            changed += 1
        word = "enabled" if enabled else "disabled"
        message = f"{changed} schedule(s) {word}"
        if unchanged:
            message += f"; {unchanged} skipped (already {word})"
        self.message_user(request, message + ".", messages.SUCCESS)
