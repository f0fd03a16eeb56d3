"""Schedules in definition files (docs/as-code.md): the `schedules` kind, named by
`SchedulingConfig.ascode_kinds`, so dispatch finds it without importing this app."""

from __future__ import annotations

from typing import Any

from dispatch.ascode.kinds import Definition, Field, Kind
from scheduling import cron
from scheduling.admin import TRIGGER_PERMISSION, needs_trigger_permission, stored_firing
from scheduling.models import MisfirePolicy, OverlapPolicy, Schedule


class ScheduleKind(Kind):
    key = "schedules"
    label = "schedule"
    model = Schedule
    order = 40  # after the bindings they fire for
    fields = (
        Field("binding", (str,), required=True, ref="bindings"),
        Field("cron", (str,), required=True),
        Field("timezone", (str,)),
        Field("enabled", (bool,)),
        Field("misfire_policy", (str,), choices=tuple(MisfirePolicy.values)),
        Field("overlap_policy", (str,), choices=tuple(OverlapPolicy.values)),
    )

    def prepare(self, definition: Definition, problem: Any) -> None:
        # As the model stores it (one space between fields), so a file that spaces it
        # otherwise is no change.
        definition.values["cron"] = cron.normalize(definition.values["cron"])

    def permissions(self, obj: Any, stored: Any | None, action: str) -> set[str]:
        # A schedule is a standing trigger: creating or re-timing an enabled one needs the
        # trigger permission too (scheduling.admin).
        needed = super().permissions(obj, stored, action)
        if action != "delete" and needs_trigger_permission(obj, stored_firing(obj)):
            needed.add(TRIGGER_PERMISSION)
        return needed
