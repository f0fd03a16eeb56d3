"""The schedules' invariant (contract section 7), added to dispatch's invariant checker
through `SchedulingConfig.invariant_checks` (dispatch.verify.invariants.app_checks): every
slot fired at most once and only at a real slot of its cron; every slot that came due since
the schedule was created fired, unless a recorded skip accounts for it. Only reads."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection

from dispatch.verify.state import Findings, State, Violation, rows
from scheduling.cron import Slots

# Slots enumerated per schedule at most (a runaway window is a bug in the caller).
MAX_SLOTS = 100_000


@dataclass(frozen=True)
class ScheduleRow:
    id: uuid.UUID
    cron: str
    timezone: str
    enabled: bool
    created_at: datetime
    next_fire_at: datetime | None
    skip_count: int
    # scheduled_for -> how many runs were created for that slot.
    fired: dict[datetime, int]


def _schedule_table_exists() -> bool:
    return "scheduling_schedule" in connection.introspection.table_names()


def load_schedules(state: State) -> list[ScheduleRow]:
    """The schedules in scope with the runs each slot created (all of them, not only the
    runs in scope). Empty when the scheduling app is not installed."""
    if not _schedule_table_exists():
        return []
    scope = state.scope
    found = rows(
        "SELECT s.id, s.cron, s.timezone, s.enabled, s.created_at, s.next_fire_at, s.skip_count"
        "  FROM scheduling_schedule s"
        " WHERE %(all)s OR s.id = ANY(%(ids)s::uuid[])",
        {"all": scope.everything, "ids": list(scope.schedule_ids)},
    )
    fired: dict[uuid.UUID, dict[datetime, int]] = defaultdict(dict)
    for schedule_id, slot, count in rows(
        "SELECT schedule_id, scheduled_for, count(*) FROM dispatch_run"
        " WHERE schedule_id = ANY(%(ids)s::uuid[]) GROUP BY 1, 2",
        {"ids": [r[0] for r in found]},
    ):
        fired[schedule_id][slot] = count
    return [
        ScheduleRow(
            id=r[0],
            cron=r[1],
            timezone=r[2],
            enabled=r[3],
            created_at=r[4],
            next_fire_at=r[5],
            skip_count=r[6],
            fired=fired[r[0]],
        )
        for r in found
    ]


def slots_between(schedule: ScheduleRow, start: datetime, end: datetime) -> list[datetime]:
    """The schedule's slots s with start < s < end."""
    slots = Slots(schedule.cron, schedule.timezone)
    out: list[datetime] = []
    cursor = start
    while len(out) < MAX_SLOTS:
        cursor = slots.next_after(cursor)
        if cursor >= end:
            break
        out.append(cursor)
    return out


def check_schedule_slots(state: State, schedules: list[ScheduleRow]) -> list[Violation]:
    """Every slot fired at most once, only at a real slot of its cron, and every slot that
    came due since the schedule was created (those before `next_fire_at`) fired exactly
    once unless a recorded skip (disabled binding or job, overlap or misfire policy)
    accounts for it."""
    found = []
    for s in schedules:
        subject = f"schedule {s.id} ({s.cron} {s.timezone})"
        for slot, count in s.fired.items():
            if count > 1:
                found.append(
                    Violation(
                        "schedule_slots", subject, f"slot {slot.isoformat()} fired {count} times"
                    )
                )
        if s.next_fire_at is None:
            continue
        # Registration sets next_fire_at to the first slot after the schedule's creation;
        # every slot before the current next_fire_at has been handled by a reconciler.
        due = slots_between(s, s.created_at - timedelta(microseconds=1), s.next_fire_at)
        due_set = set(due)
        extra = sorted(slot for slot in s.fired if slot not in due_set and slot < s.next_fire_at)
        for slot in extra:
            found.append(
                Violation(
                    "schedule_slots", subject, f"a run for {slot.isoformat()}, not a due slot"
                )
            )
        # Retention deletes old runs (never a schedule's latest): a slot that finished no
        # later than the newest pruned run may have lost its run to it.
        missing = [
            slot
            for slot in due
            if slot not in s.fired and (state.pruned_through is None or slot > state.pruned_through)
        ]
        if len(missing) > s.skip_count:
            found.append(
                Violation(
                    "schedule_slots",
                    subject,
                    f"{len(missing)} due slot(s) without a run but only {s.skip_count} recorded "
                    f"skip(s); first missing {missing[0].isoformat()}",
                )
            )
    return found


def check(state: State) -> Findings:
    """The schedules in the state's scope (every schedule when it is everything): their
    slots against the runs they created."""
    schedules = load_schedules(state)
    findings = Findings(violations=check_schedule_slots(state, schedules))
    findings.counts["schedules"] = len(schedules)
    return findings
