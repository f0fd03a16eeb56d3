"""The scheduling app's settings, read lazily so that `override_settings` works."""

from __future__ import annotations

from django.conf import settings

from dispatch.core import conf as dispatch_conf

# The loop never sleeps longer than this, whatever the earliest next_fire_at: a lost
# notification or a schedule written by SQL is picked up within this bound.
MAX_SLEEP_SECONDS = 30.0

# Ten of the loop's longest sleeps: a schedule overdue by more than this while no
# reconciler has started a pass for as long means nothing runs the schedules (system
# check scheduling.W001, the console's overview and the schedules list say so).
STALLED_AFTER_SECONDS = 10 * MAX_SLEEP_SECONDS


def schedule_channel() -> str:
    """The LISTEN/NOTIFY channel that tells reconcilers a schedule was saved."""
    return str(getattr(settings, "DISPATCH_SCHEDULE_CHANNEL", "dispatch_schedules"))


def misfire_grace_seconds() -> float:
    """A slot later than this when it is fired is a misfire (`DISPATCH_MISFIRE_GRACE_SECONDS`)."""
    return dispatch_conf.misfire_grace_seconds()
