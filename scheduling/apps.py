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
    # Read by dispatch (dispatch.core.hooks), which never imports this app. `runworker` runs
    # the reconciler loop in a thread beside the engine unless --no-scheduler, woken
    # through the worker's own LISTEN connection (which listens on the schedule channel
    # too), and under --burst one pass before it drains:
    scheduler_loop = "scheduling.reconciler.run_loop"
    scheduler_channel = "scheduling.conf.schedule_channel"
    scheduler_pass = "scheduling.reconciler.run_pass"
    # `manage.py dispatch schedules ...` is `manage.py reconcile_schedules ...`:
    dispatch_subcommands = {"schedules": "reconcile_schedules"}
    # Notices on the console's overview (schedules overdue with no reconciler running):
    overview_notices = ("scheduling.health.overview_notices",)

    def ready(self) -> None:
        # Registers the system checks. No database access here: `migrate` must work on an
        # empty database; schedules are registered when the site or a reconciler starts.
        from scheduling import checks  # noqa: F401
