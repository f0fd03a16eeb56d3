"""System checks of the scheduling app, and the table of their ids (`CHECK_IDS`;
docs/settings.md lists the same, a test keeps the three in step)."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Warning, register

from scheduling import conf, health

CHECK_IDS: dict[str, str] = {
    "scheduling.E001": "DISPATCH_SCHEDULE_CHANNEL is not a usable channel name",
    "scheduling.E002": "DISPATCH_MISFIRE_GRACE_SECONDS is not a positive number",
    "scheduling.W001": "schedules are overdue and no reconciler has run for a while",
}


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    errors: list[Error] = []
    channel = conf.schedule_channel()
    if not channel or len(channel.encode()) > 63:
        errors.append(
            Error(
                f"DISPATCH_SCHEDULE_CHANNEL {channel!r} is not a usable channel name.",
                hint="Use a non-empty name of at most 63 bytes, e.g. dispatch_schedules.",
                id="scheduling.E001",
            )
        )
    try:
        grace = conf.misfire_grace_seconds()
    except (TypeError, ValueError):
        grace = -1.0
    if not grace > 0:
        errors.append(
            Error(
                "DISPATCH_MISFIRE_GRACE_SECONDS must be a positive number of seconds.",
                hint="A slot fired later than this is a misfire; the default is 60.",
                id="scheduling.E002",
            )
        )
    return errors


@register()
def check_reconciler_running(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """scheduling.W001: enabled schedules overdue by more than
    `conf.STALLED_AFTER_SECONDS` and no reconciler pass for as long. Reads the database
    when it can; unreachable or not migrated, it says nothing (the commands that need the
    database report that)."""
    found = health.stalled_or_unknown()
    if found is None:
        return []
    return [Warning(found.message(), hint=health.HINT, id="scheduling.W001")]
