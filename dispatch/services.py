"""Operator and program actions: trigger, cancel, retry, run now, release.

Every function here runs in one transaction that takes row locks in the contract's
order (run -> attempt -> binding -> datasources), so any two actions, a claim, a
completion or a recovery pass racing on the same run settle with exactly one outcome.
Wake-ups are sent after the commit. A refusal raises `ActionRefused` with a stable
`code` and a message for the operator; nothing is changed then.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.db.models import Max
from django.db.models.functions import Now

from dispatch import conf, deadline, signals, sqlfiles
from dispatch.models import Attempt, BindingCursor, JobBinding, Run
from dispatch.security import crypto
from dispatch.states import (
    LIVE_STATUSES,
    RETRYABLE_RUN_STATUSES,
    Origin,
    Reason,
    Status,
    Trigger,
)

log = logging.getLogger("dispatch.services")


class Outcome(StrEnum):
    TRIGGERED = "TRIGGERED"  # a new run with attempt 1 PENDING
    EXISTING = "EXISTING"  # idempotency key or schedule slot already had its run
    CANCELLED = "CANCELLED"  # the pending attempt and the run are CANCELLED
    CANCEL_REQUESTED = "CANCEL_REQUESTED"  # the running worker stops at its next heartbeat
    RETRIED = "RETRIED"  # a new OPERATOR attempt, PENDING now
    MADE_AVAILABLE = "MADE_AVAILABLE"  # the pending attempt is due now
    RELEASED = "RELEASED"  # the running attempt is RETRY_SCHEDULED, successor PENDING


class ActionRefused(Exception):
    """An action that does not apply to the row's current state; nothing changed.

    Codes: ALREADY_FINISHED, CANCEL_ALREADY_REQUESTED, NOT_RETRYABLE, NOT_WAITING,
    NOT_RUNNING.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _who(by: Any) -> str:
    if by is None:
        return ""
    return str(getattr(by, "get_username", lambda: by)())


def notify(run_id: uuid.UUID | str) -> None:
    """Send the wake-up for a run. Never raises: a lost wake-up costs only latency.

    Runs as its own autocommit statement with synchronous_commit off for that one
    transaction, so it does not wait for a WAL flush.
    """
    if connection.in_atomic_block:
        # Never inside the caller's transaction: a full notification queue would fail
        # its commit. Sent once it has committed (and not at all if it rolls back).
        transaction.on_commit(lambda: notify(run_id))
        return
    statement = sqlfiles.query("notify")  # outside the try: a missing statement is a bug
    try:
        # In a worker, bounded like its other calls (no limit elsewhere).
        with deadline.bounded("notify"), connection.cursor() as cursor:
            cursor.execute(statement, {"channel": conf.channel(), "payload": str(run_id)})
    except Exception:  # noqa: BLE001 - the trigger has committed; never undo or fail it
        log.warning(
            "wake-up for run=%s not sent; workers will find it by polling", run_id, exc_info=True
        )


def _notify_on_commit(run_id: uuid.UUID) -> None:
    transaction.on_commit(lambda: notify(run_id))


def trigger(
    binding: JobBinding,
    *,
    trigger: str = Trigger.MANUAL,
    idempotency_key: str | None = None,
    requested_by: Any = None,
    schedule_id: uuid.UUID | None = None,
    scheduled_for: datetime | None = None,
) -> Run:
    """Create a run and its attempt 1 (PENDING, due now), commit, and wake a worker, in
    one round trip (`dispatch_trigger_notify_v4`). Inside an outer `atomic` the run is
    created in its transaction (`dispatch_trigger_v4`) and the wake-up waits until it
    commits.

    With an `idempotency_key` (or a schedule slot) that already has a run, that run is
    returned and nothing is created. A disabled binding still gets its run: it waits,
    with a visible `blocked_reason`, until the binding is enabled.
    """
    (run,) = trigger_many(
        [binding],
        trigger=trigger,
        idempotency_keys=[idempotency_key],
        requested_by=requested_by,
        schedule_ids=[schedule_id],
        scheduled_for=[scheduled_for],
    )
    return run


def trigger_many(
    bindings: Sequence[JobBinding],
    *,
    trigger: str = Trigger.MANUAL,
    idempotency_keys: Sequence[str | None] | None = None,
    requested_by: Any = None,
    schedule_ids: Sequence[uuid.UUID | None] | None = None,
    scheduled_for: Sequence[datetime | None] | None = None,
) -> list[Run]:
    """`trigger` for many runs at once: one statement creates them all (one transaction
    unless called inside `atomic`) and sends one wake-up per created run. The lists, when
    given, pair up with `bindings`; the result is in the same order. Runs are inserted in
    one stable order (key, schedule, slot), so two calls with overlapping keys wait for
    each other instead of deadlocking."""
    if trigger not in Trigger.values:
        raise ValueError(f"trigger must be one of {', '.join(Trigger.values)}, not {trigger!r}")
    n = len(bindings)
    for name, values in (
        ("idempotency_keys", idempotency_keys),
        ("schedule_ids", schedule_ids),
        ("scheduled_for", scheduled_for),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} items for {n} bindings")
    if n == 0:
        return []
    # The ids are proposed here: a run is ours when its id comes back, and a call asked
    # again with the same ids creates nothing twice.
    ids = [uuid.uuid4() for _ in range(n)]
    params = {
        "ids": ids,
        "bindings": [b.pk for b in bindings],
        "trigger": trigger,
        "requested_by": _who(requested_by),
        "keys": list(idempotency_keys) if idempotency_keys is not None else None,
        "schedules": list(schedule_ids) if schedule_ids is not None else None,
        "slots": list(scheduled_for) if scheduled_for is not None else None,
    }
    if connection.in_atomic_block:
        rows, woken_already = _trigger_rows(params)[0], False
    else:
        rows, woken_already = _trigger_and_notify(params)
    # Runs that already existed (their key or slot had one) are read back whole: the
    # caller gets the stored run, not one rebuilt from its arguments.
    existing = Run.objects.in_bulk(
        [row[0] for row, mine in zip(rows, ids, strict=True) if row[0] != mine]
    )
    runs = []
    woken: list[uuid.UUID] = []
    for i, (run_id, binding_id, status, created_at) in enumerate(rows):
        if run_id != ids[i]:
            runs.append(existing[run_id])
            continue
        run = Run(
            id=run_id,
            binding_id=binding_id,
            trigger=trigger,
            status=status,
            created_at=created_at,
            idempotency_key=idempotency_keys[i] if idempotency_keys is not None else None,
            requested_by=_who(requested_by),
            schedule_id=schedule_ids[i] if schedule_ids is not None else None,
            scheduled_for=scheduled_for[i] if scheduled_for is not None else None,
        )
        run._state.adding = False
        run._state.db = connection.alias
        runs.append(run)
        woken.append(run_id)
        log.info(
            "run triggered run=%s binding=%s trigger=%s",
            run_id,
            bindings[i].name,
            trigger,
        )
    if not woken_already:
        notify_many(woken)  # after the commit (on_commit inside an outer atomic)
    return runs


_Row = tuple[uuid.UUID, uuid.UUID, str, datetime]


def _trigger_rows(params: dict[str, Any]) -> tuple[list[_Row], bool]:
    """(rows, whether this call created any run)."""
    with connection.cursor() as cursor:
        cursor.execute(sqlfiles.query("trigger"), params)
        got = cursor.fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in got], any(r[4] for r in got)


def _trigger_and_notify(params: dict[str, Any]) -> tuple[list[_Row], bool]:
    """The runs, their commit and their wake-ups in one round trip; (rows, woken).

    If the call fails, either it failed before its commit (nothing was created) or only
    its wake-ups did (the runs are committed). Asking again with the same ids tells
    which and creates nothing twice: an error again is the trigger's own and is raised;
    otherwise the caller gets the runs and sends their wake-ups as a statement of its own
    (which, failing again, is left to polling and logged)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute(sqlfiles.query("trigger_notify"), {**params, "channel": conf.channel()})
            got, bindings, statuses, created_at, _created = cursor.fetchone()
        return list(zip(got, bindings, statuses, created_at, strict=True)), True
    except DatabaseError as exc:
        rows, created_now = _trigger_rows(params)
        log.info(
            "trigger call failed (%s) %s; its wake-ups follow separately",
            type(exc).__name__,
            "before its commit and was asked again" if created_now else "after its commit",
        )
        return rows, False


def notify_many(run_ids: Sequence[uuid.UUID]) -> None:
    """`notify` for several runs in one statement (one notification each)."""
    if not run_ids:
        return
    if len(run_ids) == 1:
        notify(run_ids[0])
        return
    if connection.in_atomic_block:
        ids = list(run_ids)
        transaction.on_commit(lambda: notify_many(ids))
        return
    statement = sqlfiles.query("notify_many")  # outside the try: a missing statement is a bug
    try:
        with deadline.bounded("notify_many"), connection.cursor() as cursor:
            cursor.execute(
                statement, {"channel": conf.channel(), "payloads": [str(r) for r in run_ids]}
            )
    except Exception:  # noqa: BLE001 - the triggers have committed; never undo or fail them
        log.warning(
            "wake-ups for %d runs not sent; workers will find them by polling",
            len(run_ids),
            exc_info=True,
        )


def _lock_run(run: Run | uuid.UUID | str) -> tuple[Run, Attempt | None]:
    """Lock the run, then its live attempt (the contract's order). Inside `atomic`."""
    run_id = run.pk if isinstance(run, Run) else run
    locked = Run.objects.select_for_update().get(pk=run_id)
    live = (
        Attempt.objects.select_for_update()
        .filter(run_id=locked.pk, status__in=LIVE_STATUSES)
        .first()
    )
    return locked, live


def cancel_run(run: Run | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Cancel a run: a PENDING one at once, a RUNNING one at its worker's next heartbeat
    (or when recovery finds its lease expired). Locks run, then attempt."""
    with transaction.atomic():
        locked, live = _lock_run(run)
        if live is None:
            raise ActionRefused(
                "ALREADY_FINISHED", f"Run {locked.pk} has already finished ({locked.status})."
            )
        if live.status == Status.PENDING:
            Attempt.objects.filter(pk=live.pk, status=Status.PENDING).update(
                status=Status.CANCELLED, reason=Reason.CANCELLED_BY_OPERATOR, finished_at=Now()
            )
            Run.objects.filter(pk=locked.pk).update(
                status=Status.CANCELLED, finished_at=Now(), cancel_requested_at=Now()
            )
            signals.settled(
                run_id=locked.pk,
                attempt_id=live.pk,
                attempt=live.number,
                binding_id=locked.binding_id,
                status=Status.CANCELLED,
            )
            outcome = Outcome.CANCELLED
        else:
            if locked.cancel_requested_at is not None:
                raise ActionRefused(
                    "CANCEL_ALREADY_REQUESTED",
                    f"Run {locked.pk} already has a cancel request; its worker stops at the next heartbeat.",
                )
            Run.objects.filter(pk=locked.pk).update(cancel_requested_at=Now())
            # The holding worker heartbeats as soon as it hears its run's id.
            _notify_on_commit(locked.pk)
            outcome = Outcome.CANCEL_REQUESTED
    log.info("run cancel run=%s outcome=%s by=%s", locked.pk, outcome, _who(by))
    return outcome


def retry_run(run: Run | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Add an OPERATOR attempt (a fresh retry budget) to a FAILED or CANCELLED run."""
    with transaction.atomic():
        locked, live = _lock_run(run)
        if live is not None or locked.status not in RETRYABLE_RUN_STATUSES:
            raise ActionRefused(
                "NOT_RETRYABLE",
                f"Run {locked.pk} is {locked.status}; only FAILED or CANCELLED runs can be retried.",
            )
        number = (locked.attempts.aggregate(n=Max("number"))["n"] or 0) + 1
        Attempt.objects.create(
            run=locked, number=number, origin=Origin.OPERATOR, status=Status.PENDING
        )
        Run.objects.filter(pk=locked.pk).update(
            status=Status.PENDING, finished_at=None, cancel_requested_at=None
        )
        _notify_on_commit(locked.pk)
    log.info("run retried run=%s attempt=%s by=%s", locked.pk, number, _who(by))
    return Outcome.RETRIED


def run_now(run: Run | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Make a run's attempt that waits on backoff due now, and wake a worker."""
    with transaction.atomic():
        locked, live = _lock_run(run)
        if live is None:
            raise ActionRefused(
                "ALREADY_FINISHED", f"Run {locked.pk} has already finished ({locked.status})."
            )
        changed = Attempt.objects.filter(
            pk=live.pk, status=Status.PENDING, available_at__gt=Now()
        ).update(available_at=Now())
        if not changed:
            state = "is running" if live.status == Status.RUNNING else "is already due"
            raise ActionRefused(
                "NOT_WAITING", f"Run {locked.pk} {state}; it is not waiting on a backoff."
            )
        _notify_on_commit(locked.pk)
    log.info("run made available run=%s attempt=%s by=%s", locked.pk, live.number, _who(by))
    return Outcome.MADE_AVAILABLE


def release_attempt(attempt: Attempt | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Settle a RUNNING attempt now (an operator who knows its worker is gone): it becomes
    RETRY_SCHEDULED / RELEASED_BY_OPERATOR with a successor due now, outside the retry
    budget. Fencing keeps a worker that is in fact alive harmless."""
    attempt_id = attempt.pk if isinstance(attempt, Attempt) else attempt
    run_id = Attempt.objects.values_list("run_id", flat=True).get(pk=attempt_id)
    with transaction.atomic():
        locked, live = _lock_run(run_id)
        if live is None or live.pk != uuid.UUID(str(attempt_id)) or live.status != Status.RUNNING:
            raise ActionRefused("NOT_RUNNING", f"Attempt {attempt_id} is not running.")
        with connection.cursor() as cursor:
            cursor.execute(
                sqlfiles.query("settle"),
                {
                    "attempt": live.pk,
                    "token": live.lease_token,
                    "outcome": "RELEASE",
                    "reason": Reason.RELEASED_BY_OPERATOR,
                    "error": None,
                    "rows_read": None,
                    "rows_written": None,
                },
            )
            (status,) = cursor.fetchone()
        if status is None:  # cannot happen while we hold the locks; never guess
            raise ActionRefused("NOT_RUNNING", f"Attempt {attempt_id} is not running.")
        signals.settled(
            run_id=locked.pk,
            attempt_id=live.pk,
            attempt=live.number,
            binding_id=locked.binding_id,
            status=status,
        )
        if status == Status.CANCELLED:
            # The run had a cancel request: releasing it settles the cancel instead.
            log.info("attempt released into its requested cancel run=%s", locked.pk)
            return Outcome.CANCELLED
        _notify_on_commit(locked.pk)
    log.info(
        "attempt released run=%s attempt=%s worker=%s by=%s",
        locked.pk,
        live.number,
        live.worker_id,
        _who(by),
    )
    return Outcome.RELEASED


# --- incremental cursors: the operator's reset and set ------------------------------------
def set_binding_cursor(binding: JobBinding, cursor: list[str] | None, *, by: Any = None) -> Any:
    """Reset a binding's incremental cursor (`cursor` None: the next run reads the whole
    source, from the spec's `start` if it has one) or set it to a point (the next run
    reads the rows above it: a backfill from there). Written to the sink, which holds the
    truth, in one transaction that bumps its version (an attempt running meanwhile cannot
    commit over it: its compare-and-set fails and its retry starts from the new cursor),
    then to the console's copy. A value over `limits.MAX_CURSOR_VALUE_BYTES` is refused;
    a cursor store the sink cannot read (a CSV file's state) is replaced, which the
    result's `replaced` says. Returns the sink's new `incremental.CommittedCursor`."""
    from dispatch.connectors import incremental
    from dispatch.connectors.base import ConnectorError
    from dispatch.connectors.registry import UnknownKind, get

    try:
        inc = incremental.parse(binding.job.source_spec)
    except ValidationError as exc:  # a stored spec that no longer validates
        raise ActionRefused(
            "NOT_INCREMENTAL", f"the job's source spec is invalid: {'; '.join(exc.messages)}"
        ) from None
    if inc is None:
        raise ActionRefused(
            "NOT_INCREMENTAL", "the job reads its whole source (its source spec has no incremental)"
        )
    if cursor is not None and (
        not isinstance(cursor, list)
        or len(cursor) != len(inc.cursor)
        or not all(isinstance(v, str) for v in cursor)
    ):
        raise ActionRefused(
            "BAD_CURSOR",
            f"the cursor is over ({', '.join(inc.cursor)}): give {len(inc.cursor)} "
            "value(s) as a JSON list of strings",
        )
    if cursor is not None and (big := incremental.oversized(inc.cursor, cursor)) is not None:
        raise ActionRefused("BAD_CURSOR", incremental.too_large(*big))
    try:
        connector = get(binding.sink.kind)
    except UnknownKind as exc:
        raise ActionRefused("SINK_FAILED", str(exc)) from None
    if not hasattr(connector, "set_cursor"):
        raise ActionRefused("SINK_FAILED", f"a {binding.sink.kind} sink keeps no cursor")
    try:
        config = binding.sink.config
    except crypto.SnapshotUnreadable:  # no detail: it could name key material
        raise ActionRefused(
            "SINK_FAILED", "the sink's stored settings cannot be decrypted (unknown key?)"
        ) from None
    # The new version goes above the console's copy too (a sink whose cursor store was
    # replaced or made again restarts its versions; the copy only moves forward).
    seen = BindingCursor.objects.filter(binding=binding).values_list("version", flat=True)
    try:
        committed = connector.set_cursor(
            config,
            binding.job.sink_spec,
            binding.pk,
            inc.cursor,
            cursor,
            after_version=max(seen, default=0),
        )
    except ConnectorError as exc:
        raise ActionRefused("SINK_FAILED", f"sink: {exc}") from None
    record_cursor_copy(binding.pk, committed, changed_by=_who(by) or "operator")
    log.info(
        "binding cursor %s binding=%s version=%s by=%s%s",
        "reset" if cursor is None else "set",
        binding.name,
        committed.version,
        _who(by) or "operator",
        " (an unreadable cursor store was replaced)" if committed.replaced else "",
    )
    return committed


def record_cursor_copy(
    binding_id: uuid.UUID,
    committed: Any,
    *,
    changed_by: str = "",
) -> bool:
    """Copy a binding's committed cursor (an `incremental.CommittedCursor`, as the sink
    holds it) for the console; only a newer version than the copy's moves it."""
    with connection.cursor() as cursor:
        cursor.execute(
            sqlfiles.query("record_cursor_copy"),
            {
                "binding": binding_id,
                "columns": None if committed.columns is None else json.dumps(committed.columns),
                "cursor": None if committed.cursor is None else json.dumps(committed.cursor),
                "version": committed.version,
                "run": committed.run_id,
                "attempt": committed.attempt_id,
                "changed_by": changed_by,
                "committed_at": committed.committed_at,
            },
        )
        return cursor.rowcount == 1
