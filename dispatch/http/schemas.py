"""The types of the HTTP API: what each endpoint takes and returns, what the OpenAPI
document describes, and what `manage.py dispatch runs|bindings --json` prints.

No type carries a datasource's settings: a binding names its source and sink, an attempt
its reason and its (sanitized) error, never a config, a snapshot or a redacted copy.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime
from typing import Any

from ninja import Schema
from pydantic import Field

from dispatch.api import MAX_KEY_LENGTH
from dispatch.core.states import TERMINAL_RUN_STATUSES
from dispatch.models import Attempt, BindingCursor, BindingEdge, BindingHealth, JobBinding, Run


class HealthOut(Schema):
    """The failure streak the health scan keeps (docs/operations.md)."""

    state: str
    consecutive_failures: int
    failing_since: datetime | None
    last_success_at: datetime | None
    last_failure_at: datetime | None
    reason: str


class CursorOut(Schema):
    """The console's copy of the incremental cursor committed in the sink."""

    columns: list[str] | None
    cursor: list[Any] | None
    version: int
    committed_at: datetime | None
    recorded_at: datetime | None
    changed_by: str
    run_id: uuid.UUID | None


class BindingOut(Schema):
    id: uuid.UUID
    name: str
    job: str
    source: str
    sink: str
    enabled: bool
    max_concurrency: int
    # Held by definition files (`manage.py dispatch apply`).
    managed: bool
    created_at: datetime
    # None: no finished run scanned yet.
    health: HealthOut | None
    # None: no cursor recorded (not incremental, or nothing committed yet).
    cursor: CursorOut | None


class EdgeOut(Schema):
    # The other binding of the edge, and when it fires: SUCCESS or COMPLETION.
    binding: str
    on: str


class BindingDetail(BindingOut):
    # The bindings it waits for (upstreams) and those that wait for it (downstreams).
    after: list[EdgeOut]
    before: list[EdgeOut]


class BindingPage(Schema):
    items: list[BindingOut]
    # Pass as `cursor` for the next page; None: this is the last page.
    next_cursor: str | None


class EventOut(Schema):
    """One event of an attempt's log (docs/architecture.md, "The event log")."""

    seq: int
    at: datetime
    # claimed, connected, lock_wait, read_started, progress, fence_raised, committed,
    # error, settled.
    kind: str
    # Sanitized as a stored error is: no datasource secret.
    message: str
    data: dict[str, Any]


class AttemptOut(Schema):
    number: int
    status: str
    origin: str
    reason: str | None
    # Stored sanitized: no datasource secret.
    error: str
    blocked_reason: str | None
    worker_id: str | None
    created_at: datetime
    available_at: datetime | None
    claimed_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    rows_read: int
    rows_written: int
    rows_estimated: int | None
    # The attempt's event log in order, and how many events the cap (or its worker's full
    # buffer) left out.
    events: list[EventOut] = []
    events_dropped: int = 0


class RunOut(Schema):
    id: uuid.UUID
    binding: str
    binding_id: uuid.UUID
    trigger: str
    status: str
    # SUCCEEDED, FAILED or CANCELLED: nothing more will happen to it.
    finished: bool
    created_at: datetime
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    scheduled_for: datetime | None
    idempotency_key: str | None
    requested_by: str
    # A slice run: the sliced run it belongs to and its number there (None otherwise). A
    # sliced run is WAITING while its slices copy the rows.
    parent_id: uuid.UUID | None = None
    slice_number: int | None = None


class RunDetail(RunOut):
    attempts: list[AttemptOut]


class RunPage(Schema):
    items: list[RunOut]
    # Pass as `cursor` for the next page; None: this is the last page.
    next_cursor: str | None


class TriggerIn(Schema):
    # The same key returns the same run (200) instead of a new one (201).
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LENGTH)


class ActionOut(Schema):
    # What happened: CANCELLED, CANCEL_REQUESTED (a running run stops at its worker's
    # next heartbeat) or RETRIED.
    outcome: str
    run: RunDetail


class CursorIn(Schema):
    # One string per cursor column, e.g. ["2024-01-01T00:00:00+00:00", "42"].
    cursor: list[str] = Field(max_length=64)


class CursorResult(Schema):
    binding: str
    # The new cursor (None after a reset: the next run reads the whole source).
    cursor: list[Any] | None
    version: int
    # What the reset or set replaced that could not be read (a CSV file's state); "".
    replaced: str


# --- model rows as schemas --------------------------------------------------------------
def health_out(binding: JobBinding) -> HealthOut | None:
    try:
        h: BindingHealth = binding.health  # type: ignore[attr-defined]
    except BindingHealth.DoesNotExist:
        return None
    return HealthOut(
        state=h.state,
        consecutive_failures=h.consecutive_failures,
        failing_since=h.failing_since,
        last_success_at=h.last_success_at,
        last_failure_at=h.last_failure_at,
        reason=h.reason,
    )


def cursor_out(binding: JobBinding) -> CursorOut | None:
    try:
        c: BindingCursor = binding.cursor_copy  # type: ignore[attr-defined]
    except BindingCursor.DoesNotExist:
        return None
    return CursorOut(
        columns=c.columns,
        cursor=c.cursor,
        version=c.version,
        committed_at=c.committed_at,
        recorded_at=c.recorded_at,
        changed_by=c.changed_by,
        run_id=c.run_id,
    )


def binding_out(binding: JobBinding) -> BindingOut:
    """Expects `job`, `source`, `sink`, `health` and `cursor_copy` selected with it."""
    return BindingOut(
        id=binding.pk,
        name=binding.name,
        job=binding.job.name,
        source=binding.source.name,
        sink=binding.sink.name,
        enabled=binding.enabled,
        max_concurrency=binding.max_concurrency,
        managed=bool(binding.managed_by),
        created_at=binding.created_at,
        health=health_out(binding),
        cursor=cursor_out(binding),
    )


def binding_detail(
    binding: JobBinding, scope: Collection[uuid.UUID] | None = None
) -> BindingDetail:
    """A binding with its edges (two indexed reads); a token narrowed to some bindings
    (`scope`) sees only the edges between those."""
    ups = BindingEdge.objects.filter(downstream_id=binding.pk).select_related("upstream")
    downs = BindingEdge.objects.filter(upstream_id=binding.pk).select_related("downstream")
    if scope is not None:
        ups = ups.filter(upstream_id__in=list(scope))
        downs = downs.filter(downstream_id__in=list(scope))
    return BindingDetail(
        **binding_out(binding).dict(),
        after=[EdgeOut(binding=e.upstream.name, on=e.on) for e in ups.order_by("upstream__name")],
        before=[
            EdgeOut(binding=e.downstream.name, on=e.on) for e in downs.order_by("downstream__name")
        ],
    )


def run_out(run: Run) -> RunOut:
    """Expects `binding` selected with it (its name)."""
    return RunOut(**_run_fields(run))


def run_detail(run: Run, attempts: list[Attempt]) -> RunDetail:
    return RunDetail(
        **_run_fields(run),
        attempts=[
            AttemptOut(
                number=a.number,
                status=a.status,
                origin=a.origin,
                reason=a.reason,
                error=a.error,
                blocked_reason=a.blocked_reason,
                worker_id=a.worker_id,
                created_at=a.created_at,
                available_at=a.available_at,
                claimed_at=a.claimed_at,
                heartbeat_at=a.heartbeat_at,
                finished_at=a.finished_at,
                rows_read=a.rows_read,
                rows_written=a.rows_written,
                rows_estimated=a.rows_estimated,
                events=[
                    EventOut(seq=e.seq, at=e.at, kind=e.kind, message=e.message, data=e.data)
                    for e in a.events.all()
                ],
                events_dropped=a.events_dropped,
            )
            for a in attempts
        ],
    )


def _run_fields(run: Run) -> dict[str, Any]:
    return {
        "id": run.pk,
        "binding": run.binding.name,
        "binding_id": run.binding_id,
        "trigger": run.trigger,
        "status": run.status,
        "finished": run.status in TERMINAL_RUN_STATUSES,
        "created_at": run.created_at,
        "finished_at": run.finished_at,
        "cancel_requested_at": run.cancel_requested_at,
        "scheduled_for": run.scheduled_for,
        "idempotency_key": run.idempotency_key,
        "requested_by": run.requested_by,
        "parent_id": run.parent_id,
        "slice_number": run.slice_number,
    }


# --- errors -----------------------------------------------------------------------------
class FieldError(Schema):
    # The field's path: "idempotency_key", "cursor[0]", "limit", "body".
    field: str
    message: str


class ProblemOut(Schema):
    """Every error: application/problem+json (RFC 9457)."""

    type: str
    title: str
    status: int
    detail: str
    # Invalid input: one entry per wrong field.
    errors: list[FieldError] | None = None
    # A refused action's stable code (ALREADY_FINISHED, NOT_RETRYABLE, ...).
    code: str | None = None


# The errors every authenticated endpoint may answer with, for the OpenAPI document.
PROBLEMS: dict[int, type[ProblemOut]] = {
    status: ProblemOut for status in (400, 401, 403, 404, 413, 422)
}


def responses(ok: dict[int, Any], *extra: int) -> dict[int, Any]:
    return {**ok, **PROBLEMS, **{status: ProblemOut for status in extra}}
