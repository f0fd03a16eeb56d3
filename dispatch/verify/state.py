"""What the invariant checker reads: the runs in a `Scope`, their attempts and their
bindings (`load`), and what a check reports (`Violation`, or `Findings` for a check an
installed app adds, see `dispatch.verify.invariants.app_checks`). Only reads."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection

from dispatch.ops import retention


@dataclass(frozen=True)
class Violation:
    check: str
    subject: str
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.subject}: {self.message}"


@dataclass(frozen=True)
class Scope:
    """Which runs to check: listed ids, runs tagged with `requested_by`, runs of the
    listed schedules; everything when all three are empty."""

    run_ids: frozenset[uuid.UUID] = frozenset()
    requested_by: str | None = None
    schedule_ids: frozenset[uuid.UUID] = frozenset()

    @property
    def everything(self) -> bool:
        return not self.run_ids and not self.requested_by and not self.schedule_ids


@dataclass(frozen=True)
class RunRow:
    id: uuid.UUID
    binding_id: uuid.UUID
    status: str
    created_at: datetime
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    schedule_id: uuid.UUID | None
    scheduled_for: datetime | None
    # A slice run: its sliced run and its number in that run's plan.
    parent_id: uuid.UUID | None = None
    slice_number: int | None = None


@dataclass(frozen=True)
class PlanRow:
    """A sliced run's plan (dispatch_sliceplan) and its counters."""

    run_id: uuid.UUID
    key: str
    key_type: str
    total: int
    succeeded: int
    failed: int
    live: int
    rows_written: int
    error: str
    started: int  # slices started so far: numbers 1..started have a run


@dataclass(frozen=True)
class SliceRow:
    """One range of a plan (dispatch_slice); run_id None: not started."""

    parent_id: uuid.UUID
    number: int
    lower: str | None
    upper: str | None
    run_id: uuid.UUID | None
    rows_written: int


@dataclass(frozen=True)
class AttemptRow:
    id: uuid.UUID
    run_id: uuid.UUID
    number: int
    origin: str
    status: str
    reason: str | None
    worker_id: str | None
    lease_token: int | None
    lease_until: datetime | None
    created_at: datetime
    claimed_at: datetime | None
    finished_at: datetime | None
    blocked_reason: str | None = None
    rows_written: int = 0


@dataclass(frozen=True)
class BindingRow:
    id: uuid.UUID
    max_attempts: int
    source_kind: str
    source_spec: dict[str, Any]
    sink_id: uuid.UUID
    sink_kind: str
    sink_spec: dict[str, Any]
    source_id: uuid.UUID | None = None
    enabled: bool = True
    # The binding's health row (dispatch_bindinghealth), None when it has none yet.
    health_state: str | None = None
    health_reason: str = ""
    name: str = ""


@dataclass
class State:
    """What the checks read: the runs in scope, their attempts and their bindings."""

    scope: Scope
    runs: dict[uuid.UUID, RunRow] = field(default_factory=dict)
    attempts: dict[uuid.UUID, list[AttemptRow]] = field(default_factory=dict)
    bindings: dict[uuid.UUID, BindingRow] = field(default_factory=dict)
    # Sliced runs in scope: their plans, and their ranges by number.
    plans: dict[uuid.UUID, PlanRow] = field(default_factory=dict)
    slices: dict[uuid.UUID, list[SliceRow]] = field(default_factory=dict)
    db_now: datetime | None = None
    # Runs finished up to here may have been deleted by retention (dispatch.ops.retention).
    pruned_through: datetime | None = None

    def attempts_of(self, run_id: uuid.UUID) -> list[AttemptRow]:
        return self.attempts.get(run_id, [])

    def slice_runs(self, parent_id: uuid.UUID) -> list[RunRow]:
        """The slice runs of a sliced run that are in scope, by number."""
        return sorted(
            (r for r in self.runs.values() if r.parent_id == parent_id),
            key=lambda r: r.slice_number or 0,
        )


@dataclass
class Findings:
    """What an app's own check returns: its violations, counts for the report's summary
    line and notes (facts worth reading that are not violations)."""

    violations: list[Violation] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


# --- reading ------------------------------------------------------------------------------
def rows(sql_text: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql_text, params)
        return list(cursor.fetchall())


def json_object(value: Any) -> dict[str, Any]:
    # Django's cursor hands jsonb back as text (its JSONField decodes it, not the driver).
    decoded = json.loads(value) if isinstance(value, str) else value
    return decoded if isinstance(decoded, dict) else {}


def load(scope: Scope) -> State:
    """Read the runs in scope (a sliced run's slice runs with it), their attempts and
    bindings, and the plans and ranges of the sliced ones (one statement each)."""
    state = State(scope=scope)
    state.db_now = rows("SELECT now()", {})[0][0]
    state.pruned_through = retention.pruned_through()
    for row in rows(
        "SELECT id, binding_id, status, created_at, finished_at, cancel_requested_at,"
        "       schedule_id, scheduled_for, parent_id, slice_number"
        "  FROM dispatch_run r"
        " WHERE %(all)s OR r.id = ANY(%(ids)s::uuid[]) OR r.requested_by = %(tag)s"
        "    OR r.schedule_id = ANY(%(schedules)s::uuid[])"
        "    OR r.parent_id = ANY(%(ids)s::uuid[])",
        {
            "all": scope.everything,
            "ids": list(scope.run_ids),
            "tag": scope.requested_by,
            "schedules": list(scope.schedule_ids),
        },
    ):
        state.runs[row[0]] = RunRow(*row)
    run_ids = list(state.runs)
    for row in rows(
        "SELECT id, run_id, number, origin, status, reason, worker_id, lease_token,"
        "       lease_until, created_at, claimed_at, finished_at, blocked_reason, rows_written"
        "  FROM dispatch_attempt WHERE run_id = ANY(%(runs)s::uuid[])"
        " ORDER BY run_id, number",
        {"runs": run_ids},
    ):
        state.attempts.setdefault(row[1], []).append(AttemptRow(*row))
    for row in rows(
        "SELECT run_id, key, key_type, total, succeeded, failed, live, rows_written, error,"
        "       started"
        "  FROM dispatch_sliceplan WHERE run_id = ANY(%(runs)s::uuid[])",
        {"runs": run_ids},
    ):
        state.plans[row[0]] = PlanRow(*row)
    for row in rows(
        "SELECT parent_id, number, lower, upper, run_id, rows_written FROM dispatch_slice"
        " WHERE parent_id = ANY(%(runs)s::uuid[]) ORDER BY parent_id, number",
        {"runs": list(state.plans)},
    ):
        state.slices.setdefault(row[0], []).append(SliceRow(*row))
    binding_ids = list({r.binding_id for r in state.runs.values()})
    for row in rows(
        "SELECT b.id, j.max_attempts, src.kind, j.source_spec, snk.id, snk.kind, j.sink_spec,"
        "       src.id, b.enabled, h.state, h.reason, b.name"
        "  FROM dispatch_jobbinding b JOIN dispatch_job j ON j.id = b.job_id"
        "  JOIN dispatch_datasource src ON src.id = b.source_id"
        "  JOIN dispatch_datasource snk ON snk.id = b.sink_id"
        "  LEFT JOIN dispatch_bindinghealth h ON h.binding_id = b.id"
        " WHERE b.id = ANY(%(ids)s::uuid[])",
        {"ids": binding_ids},
    ):
        (
            b_id,
            max_attempts,
            source_kind,
            source_spec,
            sink_id,
            sink_kind,
            sink_spec,
            src,
            enabled,
            health_state,
            health_reason,
            name,
        ) = row
        state.bindings[b_id] = BindingRow(
            b_id,
            max_attempts,
            source_kind,
            json_object(source_spec),
            sink_id,
            sink_kind,
            json_object(sink_spec),
            src,
            enabled,
            health_state,
            health_reason or "",
            name,
        )
    return state
