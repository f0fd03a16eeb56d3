"""The worker's database calls: claim, settle, heartbeat, recovery. Each is one round
trip to a versioned SQL function (see `dispatch/sql/functions/claim.sql`, `settle.sql`,
`recover.sql` and `heartbeat.sql` for its lock and transaction contract), on the calling
thread's own connection, in autocommit. The heartbeat and the settlement carry the
attempts' buffered events (`events.sql`), written under the same guard.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from django.db import DatabaseError, connection, transaction

from dispatch import signals
from dispatch.core import conf, deadline
from dispatch.core.db import storable
from dispatch.core.sqlfiles import query
from dispatch.worker.log import db_error

log = logging.getLogger("dispatch.worker")
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class ClaimedAttempt:
    attempt_id: uuid.UUID
    run_id: uuid.UUID
    number: int
    lease_token: int
    lease_seconds: int
    timeout_seconds: int | None
    binding_id: uuid.UUID
    source_spec: dict[str, Any]
    sink_spec: dict[str, Any]
    source_id: uuid.UUID
    source_kind: str
    source_version: int
    source_snapshot: str
    sink_id: uuid.UUID
    sink_kind: str
    sink_version: int
    sink_snapshot: str
    directed: bool

    def __repr__(self) -> str:  # never print the ciphertexts
        return f"ClaimedAttempt(run={self.run_id}, number={self.number}, token={self.lease_token})"


@dataclass(frozen=True)
class SliceOf:
    """What a claimed slice run copies: its range and its plan's frozen specs."""

    parent_id: uuid.UUID
    number: int
    lower: str | None
    upper: str | None
    total: int
    key: str
    key_type: str
    source_spec: dict[str, Any]
    sink_spec: dict[str, Any]


def is_slice_run(run_id: uuid.UUID) -> bool:
    """A slice run's id is a version-8 UUID (dispatch_slices_start_v1); every other run's
    is version 4. The runner tells a slice from its claim without a round trip."""
    return run_id.version == 8


@dataclass(frozen=True)
class Recovered:
    attempt_id: uuid.UUID
    run_id: uuid.UUID
    number: int
    outcome: str | None  # None: the settlement failed (error says why) and was skipped
    error: str | None = None


def _bounded(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a coordination call under the calling thread's deadline (dispatch.core.deadline):
    a database that stops answering cannot hold the thread longer than that."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with deadline.bounded(fn.__name__):
            return fn(*args, **kwargs)

    return call


def _json(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else (value or {})


@_bounded
def claim(
    worker_id: str, *, run_id: uuid.UUID | None = None, limit: int = 1, generic: bool = True
) -> list[ClaimedAttempt]:
    """Directed claim of `run_id` (if given) plus generic claims up to `limit`."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("claim"), {"worker": worker_id, "run": run_id, "limit": limit, "generic": generic}
        )
        rows = cursor.fetchall()
    return [_claimed(row) for row in rows]


def _claimed(row: Sequence[Any]) -> ClaimedAttempt:
    fields = list(row)
    fields[7] = _json(fields[7])
    fields[8] = _json(fields[8])
    return ClaimedAttempt(*fields)


@_bounded
def slice_of(run_id: uuid.UUID) -> SliceOf | None:
    """The range and plan of a slice run (None: no plan names it)."""
    with connection.cursor() as cursor:
        cursor.execute(query("slice_of"), {"run": run_id})
        row = cursor.fetchone()
    if row is None:
        return None
    fields = list(row)
    fields[7] = _json(fields[7])
    fields[8] = _json(fields[8])
    return SliceOf(*fields)


@_bounded
def plan_slices(
    attempt_id: uuid.UUID,
    token: int,
    *,
    key: str,
    key_type: str,
    method: str,
    basis: str,
    bounds: Sequence[tuple[str | None, str | None]],
    source_spec: dict[str, Any],
    sink_spec: dict[str, Any],
) -> tuple[str | None, list[uuid.UUID]]:
    """Record a sliced run's plan and start its first slices, guarded by the planning
    attempt's status + token (dispatch_slices_plan_v1, one transaction): the run's new
    status (WAITING; CANCELLED if it had a cancel request; None: the attempt was lost) and
    the slice runs started."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("slices_plan"),
            {
                "attempt": attempt_id,
                "token": token,
                "key": key,
                "key_type": key_type,
                "method": method,
                "basis": storable(basis),
                "lowers": [b[0] for b in bounds],
                "uppers": [b[1] for b in bounds],
                "source_spec": json.dumps(source_spec),
                "sink_spec": json.dumps(sink_spec),
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None, []
    return row[0], list(row[1] or [])


@_bounded
def record_cursor(
    attempt_id: uuid.UUID, token: int, cursor_from: list[str] | None, cursor_to: list[str] | None
) -> bool:
    """Store an incremental attempt's start and end cursors on its row (status + token
    guarded). False: the attempt is no longer ours."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("record_cursor"),
            {
                "attempt": attempt_id,
                "token": token,
                "cursor_from": None if cursor_from is None else json.dumps(cursor_from),
                "cursor_to": None if cursor_to is None else json.dumps(cursor_to),
            },
        )
        return cursor.rowcount == 1


@_bounded
def record_receipt(attempt_id: uuid.UUID, token: int, rows: int, digest: str | None) -> bool:
    """Store the receipt the sink committed on the attempt's row (status + token
    guarded). False: the attempt is no longer ours."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("record_receipt"),
            {"attempt": attempt_id, "token": token, "rows": rows, "digest": digest},
        )
        return cursor.rowcount == 1


@_bounded
def binding_hash_key(attempt_id: uuid.UUID, token: int) -> tuple[str, uuid.UUID] | None:
    """The encrypted hash key of a claimed attempt's binding and the binding's id, read
    only while the attempt is still ours (status + token); None: it is not."""
    with connection.cursor() as cursor:
        cursor.execute(query("binding_hash_key"), {"attempt": attempt_id, "token": token})
        row = cursor.fetchone()
    return None if row is None else (str(row[0]), row[1])


@_bounded
def record_schema_changes(attempt_id: uuid.UUID, token: int, changes: list[dict[str, Any]]) -> bool:
    """Store the schema changes the sink committed with the attempt's rows on its row
    (status + token guarded). False: the attempt is no longer ours."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("record_schema_changes"),
            {"attempt": attempt_id, "token": token, "changes": json.dumps(changes)},
        )
        return cursor.rowcount == 1


# An attempt's buffered events as the SQL takes them: a JSON array (EventBuffer.as_json)
# and how many the worker dropped itself.
Events = tuple[str, int]
NO_EVENTS: Events = ("[]", 0)


@_bounded
def _outcome(
    attempt_id: uuid.UUID,
    token: int,
    outcome: str,
    reason: str | None,
    error: str | None,
    rows_read: int | None,
    rows_written: int | None,
    events: Events = NO_EVENTS,
) -> dict[str, Any]:
    """The parameters of a settlement, shared by `settle` and `settle_and_claim`."""
    return {
        "events": events[0],
        "lost": events[1],
        "cap": conf.events_per_attempt(),
        "attempt": attempt_id,
        "token": token,
        "outcome": outcome,
        "reason": reason,
        # Escaped here, where every settlement passes: a NUL would make PostgreSQL
        # refuse the whole settlement and lose the outcome.
        "error": None if error is None else storable(error),
        "rows_read": rows_read,
        "rows_written": rows_written,
    }


@_bounded
def settle(
    attempt_id: uuid.UUID,
    token: int,
    outcome: str,
    *,
    reason: str | None = None,
    error: str | None = None,
    rows_read: int | None = None,
    rows_written: int | None = None,
    events: Events = NO_EVENTS,
) -> str | None:
    """Record an attempt's outcome and its last events, guarded by status + token. None:
    the lease was lost (and nothing was written)."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("settle"),
            _outcome(attempt_id, token, outcome, reason, error, rows_read, rows_written, events),
        )
        (status,) = cursor.fetchone()
    return status


@_bounded
def settle_and_claim(
    attempt_id: uuid.UUID,
    token: int,
    outcome: str,
    *,
    worker_id: str,
    limit: int,
    reason: str | None = None,
    error: str | None = None,
    rows_read: int | None = None,
    rows_written: int | None = None,
    events: Events = NO_EVENTS,
) -> tuple[str | None, list[ClaimedAttempt]]:
    """Settle an attempt and claim up to `limit` more in the same transaction and the same
    round trip (dispatch_settle_claim_v6): the slot the settlement frees is refilled
    without a transaction of its own. The claim runs in a subtransaction: if it fails, the
    settlement still commits (and nothing is claimed); a lost lease claims nothing."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("settle_claim"),
            {
                **_outcome(
                    attempt_id, token, outcome, reason, error, rows_read, rows_written, events
                ),
                "worker": worker_id,
                "limit": limit,
            },
        )
        rows = cursor.fetchall()
    status = rows[0][0] if rows else None
    return status, [_claimed(row[1:]) for row in rows if row[1] is not None]


@dataclass(frozen=True)
class Beat:
    attempt_id: uuid.UUID
    cancel_requested: bool
    lease_seconds: int


# What a heartbeat sends of one held attempt: (attempt, token, rows_read, rows_written),
# optionally followed by its buffered events (Events).
Held = tuple[uuid.UUID, int, int, int] | tuple[uuid.UUID, int, int, int, Events]


def _events_of(h: Held) -> Events:
    return h[4] if len(h) > 4 else NO_EVENTS  # type: ignore[misc]


@_bounded
def heartbeat(worker_id: str, held: Sequence[Held], stats: dict[str, Any]) -> dict[uuid.UUID, Beat]:
    """One statement for all held attempts: (attempt, token, rows_read, rows_written[,
    events]). Returns the attempts that are still this worker's; the events of the
    others were written nowhere (dispatch_heartbeat_v2)."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("heartbeat"),
            {
                "worker": worker_id,
                "attempts": [h[0] for h in held],
                "tokens": [h[1] for h in held],
                "rows_read": [h[2] for h in held],
                "rows_written": [h[3] for h in held],
                "events": [_events_of(h)[0] for h in held],
                "lost": [_events_of(h)[1] for h in held],
                "cap": conf.events_per_attempt(),
                "stats": json.dumps(stats),
            },
        )
        return {row[0]: Beat(*row) for row in cursor.fetchall()}


@dataclass(frozen=True)
class QueueView:
    """What a heartbeat read of the queue, as durations by database time."""

    due_for: float | None  # seconds the oldest ready attempt has been due (None: none is)
    next_in: float | None  # seconds until the next eligible attempt falls due
    expiry_in: float | None  # seconds until the earliest RUNNING lease runs out (<= 0: has)


@_bounded
def queue_view() -> QueueView:
    """Three single-entry index probes (see dispatch_queue_view_v4)."""
    with connection.cursor() as cursor:
        cursor.execute(query("queue_view"))
        due_for, next_in, expiry_in = cursor.fetchone()
    return QueueView(due_for, next_in, expiry_in)


@_bounded
def heartbeat_and_peers(
    stale_seconds: float,
    worker_id: str,
    held: Sequence[Held],
    stats: dict[str, Any],
) -> tuple[dict[uuid.UUID, Beat], tuple[str, ...], QueueView]:
    """The heartbeat, and in the same transaction the live workers that reported a free
    slot (for ranking notifications) and the worker's look at the queue: one transaction
    is all an idle worker spends per heartbeat interval."""
    with transaction.atomic():
        beats = heartbeat(worker_id, held, stats)
        with connection.cursor() as cursor:
            cursor.execute(query("live_workers"), {"stale": stale_seconds})
            peers = tuple(row[0] for row in cursor.fetchall())
        view = queue_view()
    return beats, peers, view


@_bounded
def record_estimates(estimates: Sequence[tuple[uuid.UUID, int, int]]) -> set[uuid.UUID]:
    """Store the rows each (attempt, token, rows) expects to read, status + token guarded;
    returns the attempts written (the others are no longer ours).

    A statement of its own, after the heartbeat's transaction, never inside it: a second
    update of a row the transaction has already updated makes PostgreSQL check the row's
    foreign key again at commit (a deferred constraint), which locks the attempt's run
    (FOR KEY SHARE) at the end of a transaction that holds the attempt: the run -> attempt
    order reversed, and a wait behind whoever holds the run (a settlement, a cancel)."""
    with connection.cursor() as cursor:
        cursor.execute(
            query("record_estimates"),
            {
                "attempts": [e[0] for e in estimates],
                "tokens": [e[1] for e in estimates],
                "rows": [e[2] for e in estimates],
            },
        )
        return {row[0] for row in cursor.fetchall()}


@_bounded
def claimable(run_id: uuid.UUID) -> bool:
    """Whether the run has a due, unblocked PENDING attempt now (a read, no lock)."""
    with connection.cursor() as cursor:
        cursor.execute(query("claimable"), {"run": run_id})
        return cursor.fetchone() is not None


@_bounded
def recover(limit: int = 500, *, refresh: bool = False) -> list[Recovered]:
    """Settle expired leases until none is left (each call of the function settles at
    most `limit` in one transaction). A row whose settlement fails is isolated by the
    function (rolled back alone, reported with `outcome=None` and its error) and not
    picked again in this call, so it can neither stop the pass nor loop it.

    With `refresh`, the repair of blocked marks (`refresh_blocked`) runs in the last
    batch's transaction, in a savepoint: a pass costs one transaction when nothing has
    expired, and a failed refresh (logged) undoes nothing of the recovery."""
    settled: list[Recovered] = []
    failed: list[uuid.UUID] = []
    while True:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(query("recover"), {"limit": limit, "skip": failed})
                batch = [Recovered(*row) for row in cursor.fetchall()]
            # Sent once this batch commits, by whichever process ran the pass.
            signals.settled_many(
                [(r.attempt_id, r.run_id, r.number, r.outcome) for r in batch if r.outcome]
            )
            if refresh and len(batch) < limit:
                try:
                    with transaction.atomic():
                        refresh_blocked()
                except DatabaseError as exc:
                    log.error("refresh of blocked marks failed error=%s", db_error(exc))
        settled.extend(batch)
        failed.extend(r.attempt_id for r in batch if r.outcome is None)
        if len(batch) < limit:
            return settled


@_bounded
def refresh_blocked() -> int:
    with connection.cursor() as cursor:
        cursor.execute(query("refresh_blocked"))
        return int(cursor.fetchone()[0])


@_bounded
def next_available_in() -> float | None:
    """Seconds until the earliest future PENDING attempt is due, by database time."""
    with connection.cursor() as cursor:
        cursor.execute(query("next_available_in"))
        (seconds,) = cursor.fetchone()
    return None if seconds is None else max(0.0, float(seconds))
