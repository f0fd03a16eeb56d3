"""Slot computation and the firing decision, without a database: DST in Europe/Berlin and
America/New_York, misfire decisions, validation messages, and a property test against
the cron library's own iteration."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling import cron
from scheduling.models import MisfirePolicy, SkipReason
from scheduling.reconciler import Action, decide

BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"


def local(instant: datetime, tz: str) -> str:
    return instant.astimezone(ZoneInfo(tz)).strftime("%Y-%m-%d %H:%M %Z")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# --- DST: the computed slots -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("tz", "start", "expected"),
    [
        # Spring forward 2024-03-31 02:00 -> 03:00: 02:30 does not exist, fires at 03:00.
        (
            BERLIN,
            utc(2024, 3, 29),
            [
                "2024-03-29 02:30 CET",
                "2024-03-30 02:30 CET",
                "2024-03-31 03:00 CEST",
                "2024-04-01 02:30 CEST",
            ],
        ),
        # Fall back 2024-10-27 03:00 -> 02:00: 02:30 happens twice, fires at the first.
        (
            BERLIN,
            utc(2024, 10, 25),
            [
                "2024-10-25 02:30 CEST",
                "2024-10-26 02:30 CEST",
                "2024-10-27 02:30 CEST",
                "2024-10-28 02:30 CET",
            ],
        ),
        # Spring forward 2024-03-10 02:00 -> 03:00.
        (
            NEW_YORK,
            utc(2024, 3, 8, 12),
            [
                "2024-03-09 02:30 EST",
                "2024-03-10 03:00 EDT",
                "2024-03-11 02:30 EDT",
            ],
        ),
        # Fall back 2024-11-03 02:00 -> 01:00: 02:30 exists once (the repeated hour is 01:xx).
        (
            NEW_YORK,
            utc(2024, 11, 1, 12),
            [
                "2024-11-02 02:30 EDT",
                "2024-11-03 02:30 EST",
                "2024-11-04 02:30 EST",
            ],
        ),
    ],
)
def test_daily_0230__dst_slots(tz: str, start: datetime, expected: list[str]) -> None:
    slots = cron.Slots("30 2 * * *", tz)
    assert [local(s, tz) for s in slots.upcoming(start, len(expected))] == expected


def test_fall_back__repeated_local_time_fires_once_for_hourly() -> None:
    slots = cron.Slots("30 * * * *", NEW_YORK)
    got = [local(s, NEW_YORK) for s in slots.upcoming(utc(2024, 11, 3, 4), 4)]
    # 01:30 happens at 05:30 and 06:30 UTC; only the first is a slot.
    assert got == [
        "2024-11-03 00:30 EDT",
        "2024-11-03 01:30 EDT",
        "2024-11-03 02:30 EST",
        "2024-11-03 03:30 EST",
    ]


def test_spring_forward__several_slots_in_the_gap_fire_once_at_its_end() -> None:
    slots = cron.Slots("*/20 2 * * *", BERLIN)
    got = [local(s, BERLIN) for s in slots.upcoming(utc(2024, 3, 30, 12), 4)]
    assert got == [
        "2024-03-31 03:00 CEST",
        "2024-04-01 02:00 CEST",
        "2024-04-01 02:20 CEST",
        "2024-04-01 02:40 CEST",
    ]


def test_next_after__inside_the_second_pass_of_a_repeated_hour() -> None:
    slots = cron.Slots("30 * * * *", NEW_YORK)
    second_pass = utc(2024, 11, 3, 6, 20)  # 01:20 EST, after 01:30 EDT already fired
    assert local(slots.next_after(second_pass), NEW_YORK) == "2024-11-03 02:30 EST"
    assert local(slots.latest_at_or_before(second_pass), NEW_YORK) == "2024-11-03 01:30 EDT"


# --- DST: firing exactly once around each transition ------------------------------------------
def simulate(
    expression: str,
    tz: str,
    start: datetime,
    end: datetime,
    step: timedelta,
    policy: str = MisfirePolicy.FIRE_ONCE,
) -> list[datetime]:
    """A reconciler waking every `step` from `start` to `end`, applying `decide` to a
    schedule registered at `start`. Returns the slots it fired."""
    slots = cron.Slots(expression, tz)
    next_fire_at = slots.next_after(start)
    fired: list[datetime] = []
    now = start
    while now <= end:
        while next_fire_at <= now:
            decision = decide(slots, next_fire_at, now, grace=60, misfire_policy=policy)
            if decision.action == Action.FIRE:
                assert decision.slot is not None
                fired.append(decision.slot)
            next_fire_at = decision.next_fire_at
        now += step
    return fired


@pytest.mark.parametrize(
    ("tz", "start", "transition_day"),
    [
        (BERLIN, utc(2024, 3, 29), "2024-03-31"),
        (BERLIN, utc(2024, 10, 25), "2024-10-27"),
        (NEW_YORK, utc(2024, 3, 8, 12), "2024-03-10"),
        (NEW_YORK, utc(2024, 11, 1, 12), "2024-11-03"),
    ],
)
@pytest.mark.parametrize("step", [timedelta(seconds=20), timedelta(minutes=7)])
def test_daily_0230__fires_exactly_once_each_day_around_the_transition(
    tz: str, start: datetime, transition_day: str, step: timedelta
) -> None:
    fired = simulate("30 2 * * *", tz, start, start + timedelta(days=4), step)
    days = [local(s, tz)[:10] for s in fired]
    assert len(days) == 4
    assert len(set(days)) == 4, days
    assert transition_day in days
    assert fired == sorted(set(fired))


def test_hourly__fall_back_fires_each_local_time_once() -> None:
    fired = simulate(
        "30 * * * *", BERLIN, utc(2024, 10, 26, 20), utc(2024, 10, 27, 6), timedelta(seconds=30)
    )
    times = [local(s, BERLIN)[11:16] for s in fired]
    # 10 hours of UTC, but 02:30 local happens twice and fires once.
    assert times == [
        "22:30",
        "23:30",
        "00:30",
        "01:30",
        "02:30",
        "03:30",
        "04:30",
        "05:30",
        "06:30",
    ]


# --- misfire decisions -------------------------------------------------------------------------
def test_decide__late_within_grace_fires_on_time() -> None:
    slots = cron.Slots("0 * * * *", "UTC")
    decision = decide(
        slots,
        utc(2024, 1, 1, 12),
        utc(2024, 1, 1, 12, 0, 59),
        grace=60,
        misfire_policy=MisfirePolicy.SKIP,
    )
    assert decision.action == Action.FIRE
    assert decision.slot == utc(2024, 1, 1, 12)
    assert decision.next_fire_at == utc(2024, 1, 1, 13)
    assert not decision.catch_up


@pytest.mark.parametrize("policy", list(MisfirePolicy))
def test_decide__misfire_after_downtime(policy: str) -> None:
    slots = cron.Slots("0 * * * *", "UTC")
    due = utc(2024, 1, 1, 9)
    now = utc(2024, 1, 1, 12, 10)
    decision = decide(slots, due, now, grace=60, misfire_policy=policy)
    assert decision.next_fire_at == utc(2024, 1, 1, 13)  # resumes on the right slot
    assert decision.slot == utc(2024, 1, 1, 12)  # the latest missed slot
    if policy == MisfirePolicy.FIRE_ONCE:
        assert (decision.action, decision.catch_up) == (Action.FIRE, True)
    else:
        assert (decision.action, decision.reason) == (Action.SKIP, SkipReason.MISFIRE)


@pytest.mark.parametrize("policy", list(MisfirePolicy))
def test_decide__missed_slots_fold_into_an_on_time_slot(policy: str) -> None:
    slots = cron.Slots("* * * * *", "UTC")
    decision = decide(
        slots, utc(2024, 1, 1, 12), utc(2024, 1, 1, 12, 10, 30), grace=60, misfire_policy=policy
    )
    assert decision.next_fire_at == utc(2024, 1, 1, 12, 10)  # on time: fires next
    expected = Action.ADVANCE if policy == MisfirePolicy.FIRE_ONCE else Action.SKIP
    assert decision.action == expected


# --- validation messages -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "has 0"),
        ("* * * *", "has 4"),
        ("0 * * * * *", "has 6"),
        ("61 * * * *", "bad minute field"),
        ("0 24 * * *", "bad hour field"),
        ("0 0 32 * *", "bad day-of-month field"),
        ("0 0 * 13 *", "bad month field"),
        ("0 0 * * 9", "bad day-of-week field"),
        ("*/0 * * * *", "bad minute field"),
        ("0 0 31 2 *", "bad day-of-month field"),
    ],
)
def test_check_expression__names_what_is_wrong(expression: str, message: str) -> None:
    with pytest.raises(cron.CronError, match=message):
        cron.check_expression(expression)


@pytest.mark.parametrize(
    "name", ["Mars/Olympus", "europe/berlin", "../etc/passwd", "", "EST5EDT,M3"]
)
def test_zone__rejects_names_outside_the_iana_database(name: str) -> None:
    with pytest.raises(cron.CronError, match="not an IANA time zone"):
        cron.zone(name)


def test_check_expression__normalises_whitespace() -> None:
    assert cron.check_expression("  */5   9-17 * *  MON-FRI ") == "*/5 9-17 * * MON-FRI"


# --- property: fired slots follow the library's iteration ---------------------------------------
ZONES = [
    BERLIN,
    NEW_YORK,
    "UTC",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "America/Santiago",
    "Asia/Kolkata",
    "Europe/London",
    "Africa/Casablanca",
    "America/St_Johns",
]


def _field(low: int, high: int) -> st.SearchStrategy[str]:
    number = st.integers(low, high)
    return st.one_of(
        st.just("*"),
        number.map(str),
        st.integers(1, max(1, (high - low) // 2)).map(lambda k: f"*/{k}"),
        st.tuples(number, number).map(lambda p: f"{min(p)}-{max(p)}"),
        st.lists(number, min_size=2, max_size=4, unique=True).map(lambda v: ",".join(map(str, v))),
        st.tuples(number, number, st.integers(1, 5)).map(
            lambda p: f"{min(p[:2])}-{max(p[:2])}/{p[2]}"
        ),
    )


expressions = st.tuples(
    _field(0, 59),
    _field(0, 23),
    st.one_of(st.just("*"), _field(1, 28)),
    _field(1, 12),
    st.one_of(st.just("*"), _field(0, 6)),
).map(" ".join)
instants = st.datetimes(datetime(2020, 1, 1), datetime(2030, 1, 1)).map(
    lambda d: d.replace(tzinfo=UTC)
)


def _oracle(expression: str, tz_name: str, start: datetime, count: int) -> list[datetime]:
    """The library's own wall-clock iteration, each local time taken to an instant by
    stepping over any gap minute by minute (independent of `cron.resolve`)."""
    tz = ZoneInfo(tz_name)
    out: list[datetime] = []
    for naive in CronSim(expression, start.astimezone(tz).replace(tzinfo=None)):
        candidate = naive
        while True:
            instant = candidate.replace(tzinfo=tz).astimezone(UTC)
            if instant.astimezone(tz).replace(tzinfo=None) == candidate:
                break
            candidate += timedelta(minutes=1)  # inside a spring-forward gap
        if instant > start and (not out or instant > out[-1]):
            out.append(instant)
        if len(out) == count:
            return out
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expression=expressions, tz_name=st.sampled_from(ZONES), start=instants)
def test_fired_slots__match_the_library_and_strictly_increase(
    expression: str, tz_name: str, start: datetime
) -> None:
    slots = cron.Slots(expression, tz_name)
    got: list[datetime] = []
    next_fire_at = slots.next_after(start)
    for _ in range(6):
        # A reconciler firing each slot on time.
        decision = decide(
            slots,
            next_fire_at,
            next_fire_at + timedelta(seconds=1),
            grace=60,
            misfire_policy=MisfirePolicy.FIRE_ONCE,
        )
        assert decision.action == Action.FIRE
        assert decision.slot is not None
        got.append(decision.slot)
        next_fire_at = decision.next_fire_at
    assert all(a < b for a, b in zip(got, got[1:], strict=False))
    assert got[0] > start
    assert got == _oracle(expression, tz_name, start, 6)
