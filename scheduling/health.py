"""Are the schedules being fired? Enabled schedules overdue by more than
`conf.STALLED_AFTER_SECONDS` while no reconciler has started a pass for as long mean that
nothing runs the reconciler (a site whose workers all run with --no-scheduler, say).

Said in three places, all from here: the system check `scheduling.W001`, a notice on the
console's overview (`overview_notices`, found by dispatch through
`SchedulingConfig.overview_notices`), and a note beside each overdue schedule in the
schedules list (`overdue_note`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DatabaseError, connection, transaction
from django.urls import NoReverseMatch, reverse

from scheduling import conf, sqlfiles

OVERDUE_CAP = 1000
HINT = (
    "Run the reconciler: every `manage.py runworker` runs it unless started with "
    "--no-scheduler (one per fleet is enough), or run `manage.py reconcile_schedules --loop`."
)


def when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def not_run_since(beat_at: datetime | None) -> str:
    if beat_at is None:
        return "no schedule reconciler has ever run"
    return f"no schedule reconciler has run since {when(beat_at)}"


@dataclass(frozen=True)
class Stalled:
    """Schedules overdue and no recent reconciler pass."""

    overdue: int  # counted up to OVERDUE_CAP
    oldest: datetime
    beat_at: datetime | None
    now: datetime

    def message(self) -> str:
        count = f"{OVERDUE_CAP:,}+" if self.overdue >= OVERDUE_CAP else str(self.overdue)
        return (
            f"Schedules are not firing: {count} enabled schedule(s) overdue, the oldest "
            f"since {when(self.oldest)}, and {not_run_since(self.beat_at)}."
        )


def stalled(after: float | None = None) -> Stalled | None:
    """The stall, or None when no schedule is overdue by more than `after` seconds
    (default `conf.STALLED_AFTER_SECONDS`) or a reconciler started a pass within them.

    One read-only statement; inside a transaction, in a savepoint of its own (a missing
    table must not break the caller's transaction). Raises DatabaseError when the
    database cannot answer (unreachable, not migrated)."""
    after = conf.STALLED_AFTER_SECONDS if after is None else after
    guard = transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext()
    with guard, connection.cursor() as cursor:
        cursor.execute(sqlfiles.query("stalled"), {"after": after})
        overdue, oldest, beat_at, now = cursor.fetchone()
    if not overdue or oldest is None:
        return None
    if beat_at is not None and beat_at >= now - timedelta(seconds=after):
        return None
    return Stalled(overdue, oldest, beat_at, now)


def stalled_or_unknown() -> Stalled | None:
    """`stalled()`, or None when the database cannot say (a check at start-up or a page
    must not fail for that: the commands that need the database report it)."""
    try:
        return stalled()
    except DatabaseError:
        return None


def overview_notices(site_name: str) -> list[dict[str, str]]:
    """The console overview's notices from this app (`SchedulingConfig.overview_notices`):
    each a dict with the notice's `text`, and a `url` and `link` text to look further."""
    found = stalled_or_unknown()
    if found is None:
        return []
    try:
        url = reverse("admin:scheduling_schedule_changelist", current_app=site_name)
    except NoReverseMatch:
        url = ""
    return [{"text": f"{found.message()} {HINT}", "url": url, "link": "Schedules"}]


def overdue_note(
    next_fire_at: datetime | None, beat_at: datetime | None, now: datetime
) -> str | None:
    """The schedules list's note beside one enabled schedule: None unless its slot is
    overdue by more than `conf.STALLED_AFTER_SECONDS` and no reconciler started a pass
    within them (values read in the list's own query, in database time)."""
    stale = now - timedelta(seconds=conf.STALLED_AFTER_SECONDS)
    if next_fire_at is None or next_fire_at >= stale:
        return None
    if beat_at is not None and beat_at >= stale:
        return None
    return f"overdue since {when(next_fire_at)}: {not_run_since(beat_at)}"
