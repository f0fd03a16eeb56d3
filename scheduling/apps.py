from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"
    default_auto_field = "django.db.models.BigAutoField"
    # Read by dispatch's invariant checker (dispatch.verify.invariants.app_checks), which
    # never imports this app: the schedules' slots against the runs they created.
    invariant_checks = ("scheduling.verify.check",)
    # Read by dispatch's definition files (dispatch.ascode.kinds.all_kinds), which never
    # import this app: the `schedules` section.
    ascode_kinds = ("scheduling.ascode.ScheduleKind",)

    def ready(self) -> None:
        # Registers the system checks. No database access here: `migrate` must work on an
        # empty database; schedules are registered when the site or a reconciler starts.
        from scheduling import checks  # noqa: F401
