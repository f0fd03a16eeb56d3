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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.db.models import Count, Exists, Max, OuterRef, Q
from django.db.models.functions import Now

from dispatch import signals
from dispatch.core import conf, deadline, sqlfiles
from dispatch.core.progress import Progress
from dispatch.core.states import (
    LIVE_STATUSES,
    RETRYABLE_RUN_STATUSES,
    ChainOn,
    Origin,
    Reason,
    Status,
    Trigger,
)
from dispatch.models import (
    Attempt,
    BindingCursor,
    BindingEdge,
    JobBinding,
    Run,
    Slice,
    SlicePlan,
)
from dispatch.security import crypto

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
    NOT_RUNNING, SLICE_RUN (a cancel or retry of one slice of a sliced run: act on the
    sliced run), BUSY (a sliced run's slices kept changing under the action).
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


# The wake-ups `wakeups_batched` collects (a bulk operation's batch), instead of one
# statement each at commit. Per thread: the maintenance thread's batch collects its own.
_collected: ContextVar[list[uuid.UUID] | None] = ContextVar("dispatch_wakeups", default=None)


def _notify_on_commit(run_id: uuid.UUID) -> None:
    collected = _collected.get()
    if collected is not None:
        collected.append(run_id)
        return
    transaction.on_commit(lambda: notify(run_id))


@contextmanager
def wakeups_batched() -> Iterator[None]:
    """Inside `atomic`: the wake-ups the actions within would each send at commit go as
    one statement (`notify_many`) at that commit, or not at all if it rolls back, and only
    for the runs a worker can act on now: a RUNNING attempt (its worker heartbeats at once
    to learn of a cancel) or a PENDING one that nothing blocks. A wake-up for a blocked
    attempt (its binding disabled or at capacity) would only make the worker ranked first
    for it try a claim that misses; such an attempt is claimed once what blocks it clears
    (a settlement's claim, or a poll). The actions here ask for their wake-up last, after
    their last refusal."""
    collected: list[uuid.UUID] = []
    token = _collected.set(collected)
    try:
        yield
    finally:
        _collected.reset(token)
    if not collected:
        return
    awake = (
        Attempt.objects.filter(run_id__in=collected)
        .filter(Q(status=Status.RUNNING) | Q(status=Status.PENDING, blocked_reason__isnull=True))
        .values_list("run_id", flat=True)
    )
    notify_many(list(dict.fromkeys(awake)))


def _chain_fire(run_id: uuid.UUID, status: str) -> None:
    """The edges of a run this transaction ended (dispatch_chain_fire), after its status
    is written; the downstream runs it made eligible are woken after commit."""
    with connection.cursor() as cursor:
        cursor.execute(sqlfiles.query("chain_fire"), {"run": run_id, "status": status})
        ready = [row[0] for row in cursor.fetchall() if row[0] is not None]
    for down in ready:
        _notify_on_commit(down)


class ChainCycle(ValidationError):
    """Edges refused: they would form a cycle (the message names it: `a -> b -> a`) or
    exceed MAX_EDGES (code "width")."""


def chain_cycle(edges: Sequence[tuple[str, str]]) -> list[str] | None:
    """A cycle in these edges (upstream, downstream), as the path that closes it
    (`[a, b, a]`), or None. Names or ids alike: the graph is only what it is given."""
    after: dict[str, list[str]] = {}
    for up, down in edges:
        after.setdefault(up, []).append(down)
    done: set[str] = set()
    for start in sorted(after):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen_here: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(after.get(node, ()), reverse=True):
                if nxt in path:
                    return path[path.index(nxt) :] + [nxt]
                if nxt not in done and nxt not in seen_here:
                    seen_here.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        done.add(start)
    return None


# The edges of one binding, each way: a settlement creates every downstream run of its run
# in its own transaction (under the worker's statement timeout), so a binding's fan-out is
# bounded, as is its fan-in.
MAX_EDGES = 32


def chain_width_problem(binding: JobBinding | None, upstreams: Sequence[JobBinding]) -> str | None:
    """Why these upstreams of `binding` exceed MAX_EDGES (it waiting for too many, or one
    of them starting too many), or None."""
    if len(upstreams) > MAX_EDGES:
        return f"a binding waits for at most {MAX_EDGES} others ({len(upstreams)} chosen)"
    others = BindingEdge.objects.filter(upstream_id__in=[u.pk for u in upstreams])
    if binding is not None and binding.pk is not None:
        others = others.exclude(downstream_id=binding.pk)
    counts = dict(others.values_list("upstream_id").annotate(n=Count("pk")).order_by())
    for up in upstreams:
        if counts.get(up.pk, 0) + 1 > MAX_EDGES:
            return f"{up.name} already starts {MAX_EDGES} bindings, the most one may start"
    return None


def set_upstreams(binding: JobBinding, upstreams: Sequence[tuple[JobBinding, str]]) -> None:
    """Make `upstreams` ((binding, ChainOn)) the edges into `binding`, refusing a cycle
    (`ChainCycle`, naming it). Takes the edges table in SHARE ROW EXCLUSIVE mode first, so
    two edits check for cycles one after the other (the table trigger
    dispatch_bindingedge_no_cycle checks again, for every writer). Runs in the caller's
    transaction, or one of its own."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(sqlfiles.query("lock_edges"))
        wanted = {up.pk: (up, ChainOn(on)) for up, on in upstreams}
        wide = chain_width_problem(binding, [up for up, _ in wanted.values()])
        if wide is not None:
            raise ChainCycle(wide, code="width")
        others = [
            (str(e.upstream_id), str(e.downstream_id))
            for e in BindingEdge.objects.exclude(downstream_id=binding.pk)
        ]
        proposed = others + [(str(up), str(binding.pk)) for up in wanted]
        cycle = chain_cycle(proposed)
        if cycle is not None:
            # Told from the binding being edited: "this -> ... -> this".
            ring = cycle[:-1]
            start = ring.index(str(binding.pk)) if str(binding.pk) in ring else 0
            cycle = ring[start:] + ring[:start] + [ring[start]]
            names = dict(JobBinding.objects.filter(pk__in=cycle).values_list("pk", "name"))
            text = " -> ".join(names.get(uuid.UUID(n), n) for n in cycle)
            raise ChainCycle(f"these upstreams would form a cycle: {text}", code="cycle")
        current = {e.upstream_id: e for e in BindingEdge.objects.filter(downstream_id=binding.pk)}
        BindingEdge.objects.filter(downstream_id=binding.pk).exclude(
            upstream_id__in=list(wanted)
        ).delete()
        for up_id, (_, on) in wanted.items():
            edge = current.get(up_id)
            if edge is None:
                BindingEdge.objects.create(upstream_id=up_id, downstream_id=binding.pk, on=on)
            elif edge.on != on:
                BindingEdge.objects.filter(pk=edge.pk).update(on=on)


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


def _refuse_slice(run: Run | uuid.UUID | str, action: str) -> tuple[uuid.UUID, bool]:
    """The run's id and whether it is sliced (has a slice plan, written once by its
    planning attempt), in one query; a slice run refused (its sliced run is what an
    operator acts on)."""
    run_id = run.pk if isinstance(run, Run) else uuid.UUID(str(run))
    row = (
        Run.objects.filter(pk=run_id)
        .annotate(sliced=Exists(SlicePlan.objects.filter(run_id=OuterRef("pk"))))
        .values_list("parent_id", "slice_number", "sliced")
        .first()
    )
    if row is None:
        return run_id, False
    if row[0] is not None:
        raise ActionRefused(
            "SLICE_RUN",
            f"Run {run_id} is slice {row[1]} of run {row[0]}: {action} run {row[0]} "
            "(its slices follow).",
        )
    return run_id, bool(row[2])


class _Moved(Exception):  # noqa: N818 - control flow: the rows moved under us, try again
    """A sliced run's slices changed between their lock and the parent's (a settlement
    started one): the action starts again with the new set."""


def _lock_slices(parent_id: uuid.UUID, statuses: Sequence[str]) -> list[Run]:
    """Lock a sliced run's slice runs in `statuses`, ascending id (a slice before its
    parent: the order of settlement and recovery)."""
    return list(
        Run.objects.select_for_update()
        .filter(parent_id=parent_id, status__in=statuses)
        .order_by("pk")
    )


def _same_slices(parent_id: uuid.UUID, statuses: Sequence[str], locked: list[Run]) -> None:
    """Under the parent's lock (no slice can start or end now): raise _Moved if the set
    of slices in `statuses` is no longer the one locked."""
    now = set(
        Run.objects.filter(parent_id=parent_id, status__in=statuses).values_list("pk", flat=True)
    )
    if now != {r.pk for r in locked}:
        raise _Moved


def _retrying(action: Any) -> Any:
    """Run `action()` (one transaction) again when the slices moved under it; a few
    times at most (each retry needs a slice to start or end in a window of milliseconds)."""
    for _ in range(5):
        try:
            return action()
        except _Moved:
            continue
    raise ActionRefused("BUSY", "The run's slices keep changing; try again.")


def _cancel_sliced(run_id: uuid.UUID) -> Outcome | None:
    """Cancel a WAITING sliced run: its queued slices now, its running ones at their next
    heartbeat; the run CANCELLED once none is left running. None: the run is not WAITING
    (still planning: the plain cancel applies)."""
    locked = _lock_slices(run_id, LIVE_STATUSES)
    live = list(
        Attempt.objects.select_for_update()
        .filter(run_id__in=[r.pk for r in locked], status__in=LIVE_STATUSES)
        .order_by("run_id")
    )
    parent = Run.objects.select_for_update().get(pk=run_id)
    if parent.status in LIVE_STATUSES:
        return None
    if parent.status != Status.WAITING:
        raise ActionRefused(
            "ALREADY_FINISHED", f"Run {parent.pk} has already finished ({parent.status})."
        )
    if parent.cancel_requested_at is not None:
        raise ActionRefused(
            "CANCEL_ALREADY_REQUESTED",
            f"Run {parent.pk} already has a cancel request; its running slices stop at their "
            "next heartbeat.",
        )
    _same_slices(run_id, LIVE_STATUSES, locked)
    pending = [a for a in live if a.status == Status.PENDING]
    running = [a.run_id for a in live if a.status == Status.RUNNING]
    if pending:
        Attempt.objects.filter(pk__in=[a.pk for a in pending], status=Status.PENDING).update(
            status=Status.CANCELLED, reason=Reason.CANCELLED_BY_OPERATOR, finished_at=Now()
        )
        Run.objects.filter(pk__in=[a.run_id for a in pending]).update(
            status=Status.CANCELLED, finished_at=Now(), cancel_requested_at=Now()
        )
        for a in pending:
            signals.settled(
                run_id=a.run_id,
                attempt_id=a.pk,
                attempt=a.number,
                binding_id=parent.binding_id,
                status=Status.CANCELLED,
            )
    if running:
        Run.objects.filter(pk__in=running).update(cancel_requested_at=Now())
    plan = SlicePlan.objects.select_for_update().get(run_id=run_id)
    plan.live = max(0, plan.live - len(pending))
    plan.failed += len(pending)
    SlicePlan.objects.filter(run_id=run_id).update(live=plan.live, failed=plan.failed)
    if plan.live == 0:
        Run.objects.filter(pk=run_id).update(
            status=Status.CANCELLED, finished_at=Now(), cancel_requested_at=Now()
        )
        _chain_fire(run_id, Status.CANCELLED)
        return Outcome.CANCELLED
    Run.objects.filter(pk=run_id).update(cancel_requested_at=Now())
    for slice_run in running:
        _notify_on_commit(slice_run)  # each holding worker heartbeats at once
    return Outcome.CANCEL_REQUESTED


def cancel_run(run: Run | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Cancel a run: a PENDING one at once, a RUNNING one at its worker's next heartbeat
    (or when recovery finds its lease expired). Locks run, then attempt.

    A sliced run WAITING on its slices: its queued slices are cancelled at once and its
    running ones get a cancel request; the run is CANCELLED once none is running (a slice
    whose commit wins still counts as done). Locks its live slice runs (ascending id),
    their attempts, then the run. A slice run itself is refused (SLICE_RUN)."""
    run_id, sliced_run = _refuse_slice(run, "cancel")
    if sliced_run:

        def sliced() -> Outcome | None:
            with transaction.atomic():
                return _cancel_sliced(run_id)

        outcome = _retrying(sliced)
        if outcome is not None:
            log.info("sliced run cancel run=%s outcome=%s by=%s", run_id, outcome, _who(by))
            return outcome  # type: ignore[no-any-return]
    try:
        with transaction.atomic():
            locked, live = _lock_run(run_id)
            if live is None and locked.status == Status.WAITING:
                raise _Moved  # planned since the look above: the sliced cancel applies
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
                _chain_fire(locked.pk, Status.CANCELLED)
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
    except _Moved:
        return cancel_run(run_id, by=by)
    log.info("run cancel run=%s outcome=%s by=%s", locked.pk, outcome, _who(by))
    return outcome


def _retry_sliced(run_id: uuid.UUID) -> list[uuid.UUID]:
    """Retry a FAILED or CANCELLED sliced run: an OPERATOR attempt (a fresh budget) for
    each slice run that ended FAILED or CANCELLED, the run WAITING again, and new slices
    started up to max_slices_in_flight. Slices that committed are not redone. Locks the
    failed slice runs (ascending id), then the run. Returns the slice runs to wake."""
    ended = (Status.FAILED, Status.CANCELLED)
    locked = _lock_slices(run_id, ended)
    parent = Run.objects.select_for_update().get(pk=run_id)
    if parent.status not in RETRYABLE_RUN_STATUSES:
        raise ActionRefused(
            "NOT_RETRYABLE",
            f"Run {parent.pk} is {parent.status}; only FAILED or CANCELLED runs can be retried.",
        )
    _same_slices(run_id, ended, locked)
    ids = [r.pk for r in locked]
    numbers = dict(
        Attempt.objects.filter(run_id__in=ids)
        .values("run_id")
        .annotate(n=Max("number"))
        .values_list("run_id", "n")
    )
    Attempt.objects.bulk_create(
        [
            Attempt(
                run_id=r, number=(numbers.get(r) or 0) + 1, origin=Origin.OPERATOR,
                status=Status.PENDING,
            )
            for r in ids
        ]
    )  # fmt: skip
    Run.objects.filter(pk__in=ids).update(
        status=Status.PENDING, finished_at=None, cancel_requested_at=None
    )
    plan = SlicePlan.objects.select_for_update().get(run_id=run_id)
    plan.failed = max(0, plan.failed - len(ids))
    plan.live += len(ids)
    SlicePlan.objects.filter(run_id=run_id).update(failed=plan.failed, live=plan.live, error="")
    Run.objects.filter(pk=run_id).update(
        status=Status.WAITING, finished_at=None, cancel_requested_at=None
    )
    started: list[uuid.UUID] = []
    if plan.live < plan.in_flight:
        with connection.cursor() as cursor:
            cursor.execute(
                sqlfiles.query("slices_start"),
                {"parent": run_id, "limit": plan.in_flight - plan.live},
            )
            started = [row[0] for row in cursor.fetchall()]
    return ids + started


def retry_run(run: Run | uuid.UUID | str, *, by: Any = None) -> Outcome:
    """Add an OPERATOR attempt (a fresh retry budget) to a FAILED or CANCELLED run.

    A sliced run (planned): only its slices that did not commit are redone (`_retry_sliced`);
    a slice run itself is refused (SLICE_RUN)."""
    run_id, sliced_run = _refuse_slice(run, "retry")
    if sliced_run:

        def sliced() -> list[uuid.UUID]:
            with transaction.atomic():
                woken = _retry_sliced(run_id)
                for slice_run in woken:
                    _notify_on_commit(slice_run)
                return woken

        woken = _retrying(sliced)
        log.info("sliced run retried run=%s slices=%d by=%s", run_id, len(woken), _who(by))
        return Outcome.RETRIED
    with transaction.atomic(), connection.cursor() as cursor:
        # One statement (named `retry_run`): the run locked with what the retry decides on
        # (nothing is refused on an unlocked read: the run's lock orders every change of
        # its attempts), and the attempt added only if nothing refuses it.
        cursor.execute(sqlfiles.query("retry_run"), {"run": run_id})
        row = cursor.fetchone()
        if row is None:
            raise Run.DoesNotExist(f"Run {run_id} does not exist.")
        status, live, sliced_now, number, moved = row
        if live or status not in RETRYABLE_RUN_STATUSES:
            raise ActionRefused(
                "NOT_RETRYABLE",
                f"Run {run_id} is {status}; only FAILED or CANCELLED runs can be retried.",
            )
        if sliced_now:
            # Planned, then ended, since the look above: another planning attempt would
            # find its plan written; the sliced retry locks the slices first.
            raise ActionRefused("BUSY", f"Run {run_id} has just been sliced; try again.")
        assert number is not None and moved == 1, (number, moved)
        _notify_on_commit(run_id)
    log.info("run retried run=%s attempt=%s by=%s", run_id, number, _who(by))
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
                    # No worker events: the settlement logs its own (the release).
                    "events": None,
                    "lost": None,
                    "cap": None,
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


# --- a sliced run's slices, for the console and the APIs ---------------------------------
def slice_label(key: str, lower: str | None, upper: str | None) -> str:
    """A range as text, as errors name it (dispatch_slice_label): "id >= 3 and < 5"."""
    if lower is None and upper is None:
        return "all rows"
    if lower is None:
        return f"{key} < {upper} or null"
    if upper is None:
        return f"{key} >= {lower}"
    return f"{key} >= {lower} and < {upper}"


# What the console shows for a slice, by its run's status ("" = not started yet).
SLICE_STATES = {
    Status.SUCCEEDED: "done",
    Status.RUNNING: "running",
    Status.PENDING: "waiting",
    "": "waiting",
    Status.FAILED: "failed",
    Status.CANCELLED: "failed",
}


@dataclass(frozen=True)
class SliceView:
    number: int
    lower: str | None
    upper: str | None
    label: str
    run_id: uuid.UUID | None  # None: not started yet
    status: str  # the slice run's status; "" when not started
    state: str  # done, running, waiting or failed (SLICE_STATES)
    attempts: int
    progress: Progress  # of the slice run's latest attempt (empty when not started)
    error: str  # the latest attempt's error


@dataclass(frozen=True)
class SlicedRunView:
    plan: SlicePlan
    slices: list[SliceView]  # the page asked for, by number
    # The run's progress as the sum of its slices: rows of the slices that succeeded
    # (the plan's counter) plus those of the running ones as of their last heartbeat.
    rows_written: int
    rows_read_running: int
    rate: float | None  # rows per second of the running slices together (None: none yet)

    @property
    def counts(self) -> dict[str, int]:
        p = self.plan
        return {
            "done": p.succeeded,
            "failed": p.failed,
            "queued_or_running": p.live,
            "not_started": p.total - p.succeeded - p.failed - p.live,
            "total": p.total,
        }


def run_slices(
    run: Run | uuid.UUID | str, *, offset: int = 0, limit: int | None = 200
) -> SlicedRunView | None:
    """A sliced run's plan, counters and slices (a page of them, by number: a run may have
    100,000), each with its status, rows and rate; None for a run that is not sliced (or
    not planned yet). Reads only: no lock."""
    run_id = run.pk if isinstance(run, Run) else uuid.UUID(str(run))
    plan = SlicePlan.objects.filter(run_id=run_id).first()
    if plan is None:
        return None
    rows = Slice.objects.filter(parent_id=run_id).order_by("number").select_related("run")
    page = list(rows[offset : None if limit is None else offset + limit])
    run_ids = [s.run_id for s in page if s.run_id is not None]
    latest = {
        a.run_id: a
        for a in Attempt.objects.filter(run_id__in=run_ids)
        .order_by("run_id", "-number")
        .distinct("run_id")
    }
    views = []
    for s in page:
        attempt = latest.get(s.run_id) if s.run_id is not None else None
        status = s.run.status if s.run is not None else ""
        views.append(
            SliceView(
                number=s.number,
                lower=s.lower,
                upper=s.upper,
                label=slice_label(plan.key, s.lower, s.upper),
                run_id=s.run_id,
                status=status,
                state=SLICE_STATES.get(status, "waiting"),
                attempts=attempt.number if attempt is not None else 0,
                progress=Progress.of(attempt),
                error=attempt.error if attempt is not None else "",
            )
        )
    running = list(
        Attempt.objects.filter(
            run__parent_id=run_id, run__status=Status.RUNNING, status=Status.RUNNING
        )
    )
    progress = [Progress.of(a) for a in running]
    rates = [p.rate for p in progress if p.rate is not None]
    return SlicedRunView(
        plan=plan,
        slices=views,
        rows_written=plan.rows_written + sum(p.rows_written for p in progress),
        rows_read_running=sum(p.rows_read for p in progress),
        rate=sum(rates) if rates else None,
    )
