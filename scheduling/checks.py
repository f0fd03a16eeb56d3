"""System checks of the scheduling app (ids scheduling.E001, ...)."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, register

from scheduling import conf


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
