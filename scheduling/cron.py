"""Cron slots of a schedule: 5-field expressions evaluated in an IANA timezone.

The expression is evaluated on local wall-clock time (cronsim on naive datetimes), and
each local time is then mapped to one instant:

- a local time that exists once is that instant;
- a repeated local time (the hour a fall-back transition repeats) is its *first*
  occurrence, so it fires once;
- a nonexistent local time (the gap of a spring-forward transition) is the first valid
  instant after the gap, i.e. the transition itself; several slots in one gap collapse
  into that one instant.

The mapping is monotonic in local time, so the slots are strictly increasing instants.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from cronsim import CronSim, CronSimError

FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
# How far past an instant the backwards search for the latest slot starts, so a slot in
# the second pass of a repeated hour (whose local time is later than the instant's) is
# still found. Larger than any fall-back transition in the IANA database.
_FOLD_MARGIN = timedelta(hours=3)
# Candidates skipped (inside a repeated hour) before giving up; a repeated hour of an
# every-minute schedule skips 60.
_MAX_SKIPPED = 10_000


class CronError(ValueError):
    """An expression or timezone that cannot be evaluated; the message names the part."""


def normalize(expression: str) -> str:
    return " ".join(str(expression).split())


def check_expression(expression: str) -> str:
    """Return the normalised expression, or raise `CronError` saying what is wrong."""
    expression = normalize(expression)
    parts = expression.split(" ") if expression else []
    if len(parts) != 5:
        raise CronError(
            f"a cron expression has 5 fields ({' '.join(FIELDS)}); {expression!r} has {len(parts)}"
        )
    try:
        iterator = CronSim(expression, datetime(2000, 1, 1))
    except CronSimError as exc:
        detail = str(exc)
        if detail.startswith("Bad "):
            detail = f"bad {detail[4:]} field"
        raise CronError(f"{expression!r} is not a valid cron expression: {detail}") from None
    try:
        next(iterator)
    except StopIteration:
        raise CronError(f"{expression!r} never matches a date") from None
    return expression


@cache
def _zone_names() -> frozenset[str]:
    return frozenset(available_timezones())


def zone(name: str) -> ZoneInfo:
    """The IANA zone `name`, or `CronError` (never a path, never a POSIX TZ string)."""
    names = _zone_names()
    if names and name not in names:
        raise CronError(f"{name!r} is not an IANA time zone name (e.g. Europe/Berlin or UTC)")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CronError(
            f"{name!r} is not an IANA time zone name (e.g. Europe/Berlin or UTC)"
        ) from None


def _local(instant: datetime, tz: ZoneInfo) -> datetime:
    return instant.astimezone(tz).replace(tzinfo=None)


def resolve(local: datetime, tz: ZoneInfo) -> datetime:
    """The instant (UTC) of the naive local time `local` in `tz`, by the rules above."""
    first = local.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if _local(first, tz) == local:
        # fold=0 is the earlier of two occurrences of a repeated time.
        return first
    # A gap: fold=0 read `local` with the offset before the transition (an instant after
    # it), fold=1 with the offset after (an instant before it). The transition is the
    # first instant between them whose local time is past `local`; local time is
    # monotonic in that interval, so bisect on whole seconds.
    lo = local.replace(tzinfo=tz, fold=1).astimezone(UTC)
    hi = first
    if lo > hi:
        lo, hi = hi, lo
    low, high = 0, int((hi - lo).total_seconds())
    while low < high:
        middle = (low + high) // 2
        if _local(lo + timedelta(seconds=middle), tz) > local:
            high = middle
        else:
            low = middle + 1
    return lo + timedelta(seconds=low)


class Slots:
    """The fire times of one (expression, timezone), as aware UTC datetimes."""

    def __init__(self, expression: str, timezone: str) -> None:
        self.expression = check_expression(expression)
        self.timezone = timezone
        self.tz = zone(timezone)

    def _local_after(self, start: datetime) -> Iterator[datetime]:
        return iter(CronSim(self.expression, start))

    def next_after(self, instant: datetime) -> datetime:
        """The first slot strictly after `instant`."""
        candidates = self._local_after(_local(instant, self.tz))
        for skipped, candidate in enumerate(candidates):
            slot = resolve(candidate, self.tz)
            if slot > instant:
                return slot
            # Inside the second pass of a repeated hour: these local times already
            # fired at their first occurrence.
            if skipped > _MAX_SKIPPED:
                break
        raise CronError(f"{self.expression!r} has no slot after {instant.isoformat()}")

    def latest_at_or_before(self, instant: datetime) -> datetime | None:
        """The last slot at or before `instant` (None if there is none within 50 years)."""
        start = _local(instant, self.tz) + _FOLD_MARGIN
        for candidate in CronSim(self.expression, start, reverse=True):
            slot = resolve(candidate, self.tz)
            if slot <= instant:
                return slot
        return None

    def upcoming(self, after: datetime, count: int) -> list[datetime]:
        """`count` slots from `after` on (a slot at `after` itself included)."""
        slots: list[datetime] = []
        cursor = after - timedelta(microseconds=1)
        for _ in range(count):
            cursor = self.next_after(cursor)
            slots.append(cursor)
        return slots

    def explain(self) -> str:
        try:
            return CronSim(self.expression, datetime(2000, 1, 1)).explain()
        except (CronSimError, NotImplementedError):
            # A description is optional: an expression the library cannot parse, or a
            # form its explainer does not implement, has none. Anything else is a bug.
            return ""
