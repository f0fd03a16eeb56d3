"""ScheduleReconciler: registers schedules and fires each due slot exactly once.

Lock and transaction contract. *Registration* locks enabled schedules that have no
`next_fire_at` (`FOR UPDATE SKIP LOCKED`), sets it from database `now()` with an update
guarded by `next_fire_at IS NULL` (an existing value is never moved, so a restart never
loses a missed slot), and clears it for disabled schedules. *Firing* runs one short
transaction per due schedule: lock the oldest due schedule `FOR UPDATE SKIP LOCKED`
(`next_fire_at <= now()`), decide from database time what the slot gets (`decide`),
insert the run through `dispatch.services.trigger` (its wake-up is sent after this
transaction commits; `(schedule_id, scheduled_for)` is unique, so a slot can never get two
runs even if everything above failed), and advance `next_fire_at` with an update guarded
by the value the decision was made for. Any number of reconcilers may run at once: the row
lock serialises the work on one schedule, SKIP LOCKED spreads schedules over reconcilers,
and the unique slot is the last line of defence. No advisory lock is taken. Every pass
starts with one autocommit statement (`survey`) that upserts the single heartbeat row
(`scheduling_reconcilerbeat`, its lock held for that statement) and says whether anything
needs registering or is due; an idle pass is that statement alone.

The loop (`run`) sleeps until the earliest `next_fire_at` (a duration computed by the
database, at most `conf.MAX_SLEEP_SECONDS`) and wakes early on a notification on
`DISPATCH_SCHEDULE_CHANNEL`, sent after a schedule is saved (`scheduling.wakeup`): read on
a LISTEN connection of its own (`reconcile_schedules --loop`), or on the worker's
(`runworker`, which listens on that channel too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import psycopg
from django.db import connection, transaction
from psycopg import sql

from dispatch import services
from dispatch.core.db import DB_ERRORS
from dispatch.core.states import Trigger
from dispatch.models import JobBinding, Run
from dispatch.worker import listen as dispatch_listen
from dispatch.worker.log import db_error
from scheduling import conf, cron, sqlfiles
from scheduling.models import MisfirePolicy, OverlapPolicy, SkipReason

log = logging.getLogger("scheduling.reconciler")

# The loop's shortest sleep when a schedule is still due after a pass (another reconciler
# holds it, or it failed): no busy loop.
MIN_SLEEP_SECONDS = 0.2
# Stop-event polling granularity while waiting on the LISTEN socket.
STOP_POLL_SECONDS = 0.25
RECONNECT_MAX_SECONDS = 10.0
# Upper bound on decisions in one pass (each one advances a next_fire_at, so a pass
# always ends; the bound only caps one pass's length).
MAX_DECISIONS_PER_PASS = 10_000


class Action(StrEnum):
    FIRE = "FIRE"  # create the run for `slot` (unless the binding, job or overlap says no)
    SKIP = "SKIP"  # record a skip for missed slots (misfire policy SKIP)
    ADVANCE = "ADVANCE"  # move on without a run or a skip (an on-time slot follows)


@dataclass(frozen=True)
class Decision:
    action: Action
    next_fire_at: datetime
    slot: datetime | None = None
    catch_up: bool = False
    reason: str | None = None


def decide(
    slots: cron.Slots, due: datetime, now: datetime, *, grace: float, misfire_policy: str
) -> Decision:
    """What the slot stored in `next_fire_at` (`due`) gets at database time `now`.

    A slot late by less than `grace` seconds fires on time, and `next_fire_at` moves to the
    slot after it (if that one is due too, the next decision fires it). A later slot is a
    misfire: every missed slot up to the first on-time one collapses into one decision.
    If an on-time slot is already due, `next_fire_at` moves to it (FIRE_ONCE: that run is
    the catch-up; SKIP: a skip is recorded). Otherwise FIRE_ONCE fires the latest missed
    slot and SKIP records a skip; either way `next_fire_at` moves past `now`.
    """
    if (now - due).total_seconds() < grace:
        return Decision(Action.FIRE, slots.next_after(due), slot=due)
    first_on_time = slots.next_after(now - timedelta(seconds=grace))
    if first_on_time <= now:
        if misfire_policy == MisfirePolicy.SKIP:
            return Decision(Action.SKIP, first_on_time, slot=due, reason=SkipReason.MISFIRE)
        return Decision(Action.ADVANCE, first_on_time, slot=due)
    latest = slots.latest_at_or_before(now) or due
    if misfire_policy == MisfirePolicy.SKIP:
        return Decision(Action.SKIP, first_on_time, slot=latest, reason=SkipReason.MISFIRE)
    return Decision(Action.FIRE, first_on_time, slot=latest, catch_up=True)


@dataclass(frozen=True)
class Fired:
    schedule_id: uuid.UUID
    slot: datetime
    run_id: uuid.UUID
    catch_up: bool
    existing: bool  # the slot already had its run (created outside the reconciler)


@dataclass(frozen=True)
class Skipped:
    schedule_id: uuid.UUID
    slot: datetime
    reason: str


@dataclass(frozen=True)
class Survey:
    """What the start of a pass found (`survey` in scheduling/sql/queries.sql)."""

    beat_at: datetime
    needs_registration: bool
    # Seconds until the earliest next_fire_at by database time; None: none registered.
    next_due_in: float | None

    @property
    def due(self) -> bool:
        return self.next_due_in is not None and self.next_due_in <= 0


@dataclass
class PassReport:
    """What one `run_once` did."""

    registered: int = 0
    unregistered: int = 0
    fired: list[Fired] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    advanced: int = 0
    failed: list[uuid.UUID] = field(default_factory=list)
    survey: Survey | None = None

    @property
    def changed(self) -> bool:
        """True when the pass may have moved a next_fire_at (the survey's is stale)."""
        return bool(
            self.registered
            or self.unregistered
            or self.fired
            or self.skipped
            or self.advanced
            or self.failed
        )

    def __str__(self) -> str:
        return (
            f"registered {self.registered}, unregistered {self.unregistered}, "
            f"fired {len(self.fired)}, skipped {len(self.skipped)}, advanced {self.advanced}, "
            f"failed {len(self.failed)}"
        )


class GuardFailed(RuntimeError):
    """A guarded update changed no row although the schedule's lock was held."""


def _execute(name: str, params: dict[str, Any]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sqlfiles.query(name), params)
        return cursor.rowcount


def _guarded(name: str, params: dict[str, Any]) -> None:
    if _execute(name, params) != 1:
        raise GuardFailed(f"{name} changed no row for schedule {params['id']}")


class ScheduleReconciler:
    def __init__(self, *, name: str | None = None, batch: int = 500) -> None:
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.batch = batch

    # --- registration -------------------------------------------------------------------
    def register(self) -> tuple[int, int]:
        """Set `next_fire_at` (from database now) where it is NULL on enabled schedules,
        clear it on disabled ones. Returns (registered, unregistered).

        One transaction per batch: the rows are locked FOR UPDATE SKIP LOCKED (a row
        another reconciler or a save holds is theirs to register) and each update is
        guarded by `next_fire_at IS NULL`. A schedule whose cron or timezone cannot be
        evaluated (written by SQL, or a zone removed from the system's database) is
        logged and left unregistered.
        """
        registered = 0
        with transaction.atomic():
            unregistered = _execute("unregister_disabled", {})
            with connection.cursor() as cursor:
                cursor.execute(sqlfiles.query("unregistered"), {"limit": self.batch})
                rows = cursor.fetchall()
            for schedule_id, expression, timezone, now in rows:
                try:
                    next_fire_at = cron.Slots(expression, timezone).next_after(now)
                except cron.CronError as exc:
                    log.error("schedule not registered schedule=%s error=%s", schedule_id, exc)
                    continue
                registered += _execute(
                    "register", {"id": schedule_id, "next_fire_at": next_fire_at}
                )
                log.info(
                    "schedule registered schedule=%s next_fire_at=%s",
                    schedule_id,
                    next_fire_at.isoformat(),
                )
        return registered, unregistered

    # --- firing ---------------------------------------------------------------------------
    def fire_due(self, report: PassReport | None = None) -> PassReport:
        """Decide every due schedule, one transaction each, until none is due (or every
        one left is held by another reconciler or failed in this pass)."""
        report = report or PassReport()
        failed: set[uuid.UUID] = set()
        for _ in range(MAX_DECISIONS_PER_PASS):
            try:
                outcome = self.fire_one(exclude=failed)
            except _ScheduleFailed as exc:
                failed.add(exc.schedule_id)
                report.failed.append(exc.schedule_id)
                continue
            if outcome is None:
                break
            if isinstance(outcome, Fired):
                report.fired.append(outcome)
            elif isinstance(outcome, Skipped):
                report.skipped.append(outcome)
            else:
                report.advanced += 1
        return report

    def fire_one(self, *, exclude: set[uuid.UUID] | None = None) -> Fired | Skipped | bool | None:
        """Lock the oldest due schedule and act on it, in one transaction.

        Returns what happened (`Fired`, `Skipped`, True for an advance), or None when no
        schedule is due. A schedule that cannot be evaluated raises `_ScheduleFailed`
        after its transaction is rolled back.
        """
        schedule_id: uuid.UUID | None = None
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(sqlfiles.query("due_schedule"), {"exclude": list(exclude or ())})
                    row = cursor.fetchone()
                if row is None:
                    return None
                (
                    schedule_id,
                    binding_id,
                    expression,
                    timezone,
                    misfire_policy,
                    overlap_policy,
                    due,
                    now,
                    binding_enabled,
                    job_enabled,
                ) = row
                slots = cron.Slots(expression, timezone)
                decision = decide(
                    slots,
                    due,
                    now,
                    grace=conf.misfire_grace_seconds(),
                    misfire_policy=misfire_policy,
                )
                return self._apply(
                    schedule_id,
                    binding_id,
                    overlap_policy,
                    due,
                    now,
                    decision,
                    binding_enabled=binding_enabled,
                    job_enabled=job_enabled,
                )
        except cron.CronError as exc:
            assert schedule_id is not None
            log.error("schedule cannot be evaluated schedule=%s error=%s", schedule_id, exc)
            raise _ScheduleFailed(schedule_id) from exc
        except Exception as exc:
            # A database error ends the pass (the loop backs off); anything else is this
            # schedule's problem and must not block the schedules due behind it.
            if schedule_id is None or isinstance(exc, DB_ERRORS):
                raise
            log.exception("schedule failed to fire schedule=%s", schedule_id)
            raise _ScheduleFailed(schedule_id) from exc

    def _apply(
        self,
        schedule_id: uuid.UUID,
        binding_id: uuid.UUID,
        overlap_policy: str,
        due: datetime,
        now: datetime,
        decision: Decision,
        *,
        binding_enabled: bool,
        job_enabled: bool,
    ) -> Fired | Skipped | bool:
        guard = {"id": schedule_id, "expected": due, "next_fire_at": decision.next_fire_at}
        if decision.action == Action.ADVANCE:
            _guarded("advance", guard)
            log.info(
                "schedule missed slots folded into an on-time slot schedule=%s "
                "from=%s next_fire_at=%s",
                schedule_id,
                due.isoformat(),
                decision.next_fire_at.isoformat(),
            )
            return True
        assert decision.slot is not None
        reason = decision.reason
        if decision.action == Action.FIRE:
            if not binding_enabled:
                reason = SkipReason.BINDING_DISABLED
            elif not job_enabled:
                reason = SkipReason.JOB_DISABLED
            elif (
                overlap_policy == OverlapPolicy.SKIP
                # The previous runs' statuses as committed now; one that finishes right
                # after this read only makes this slot a skip it need not have been.
                and Run.objects.live().filter(schedule_id=schedule_id).exists()
            ):
                reason = SkipReason.OVERLAP
        if reason is not None:
            _guarded("record_skip", {**guard, "reason": reason})
            log.info(
                "schedule skipped schedule=%s slot=%s reason=%s next_fire_at=%s",
                schedule_id,
                decision.slot.isoformat(),
                reason,
                decision.next_fire_at.isoformat(),
            )
            return Skipped(schedule_id, decision.slot, reason)
        existing = Run.objects.filter(schedule_id=schedule_id, scheduled_for=decision.slot).exists()
        # Inside this transaction: the trigger's one statement is part of it, and its
        # wake-up (transaction.on_commit) is sent after this transaction commits. A run
        # that already exists for the slot is returned, not duplicated (unique slot).
        run = services.trigger(
            JobBinding.objects.get(pk=binding_id),
            trigger=Trigger.SCHEDULE,
            schedule_id=schedule_id,
            scheduled_for=decision.slot,
            requested_by=f"schedule {schedule_id}",
        )
        _guarded("record_fire", {**guard, "run": run.pk})
        late = (now - decision.slot).total_seconds()
        log.info(
            "schedule fired schedule=%s slot=%s run=%s catch_up=%s late=%.1fs "
            "existing=%s next_fire_at=%s reconciler=%s",
            schedule_id,
            decision.slot.isoformat(),
            run.pk,
            decision.catch_up,
            late,
            existing,
            decision.next_fire_at.isoformat(),
            self.name,
        )
        return Fired(schedule_id, decision.slot, run.pk, decision.catch_up, existing)

    # --- one pass and the loop --------------------------------------------------------------
    def survey(self) -> Survey:
        """Record this pass in the reconciler heartbeat and find what it has to do, in one
        autocommit statement (the heartbeat row's lock is held for that statement only)."""
        with connection.cursor() as cursor:
            cursor.execute(sqlfiles.query("survey"), {"reconciler": self.name[:200]})
            beat_at, needs_registration, next_due_in = cursor.fetchone()
        return Survey(beat_at, bool(needs_registration), next_due_in)

    def run_once(self) -> PassReport:
        """Survey (and beat), register if anything needs it, then fire everything due.
        Returns what it did. An idle pass is the survey's one statement."""
        survey = self.survey()
        report = PassReport(survey=survey)
        if survey.needs_registration:
            report.registered, report.unregistered = self.register()
        if survey.due:
            self.fire_due(report)
        return report

    def next_due_in(self) -> float | None:
        """Seconds until the earliest next_fire_at by database time (None: nothing
        registered)."""
        with connection.cursor() as cursor:
            cursor.execute(sqlfiles.query("next_due_in"))
            (seconds,) = cursor.fetchone()
        return seconds

    def sleep_seconds(self, report: PassReport | None = None) -> float:
        """How long the loop may sleep after `report`'s pass: until the earliest
        next_fire_at, within the bounds. The survey's figure stands when the pass changed
        nothing (an idle pass costs one statement); otherwise it is read again."""
        if report is not None and report.survey is not None and not report.changed:
            seconds = report.survey.next_due_in
        else:
            seconds = self.next_due_in()
        if seconds is None:
            return conf.MAX_SLEEP_SECONDS
        return min(conf.MAX_SLEEP_SECONDS, max(MIN_SLEEP_SECONDS, seconds))

    def run(self, stop_event: threading.Event, wake_event: threading.Event | None = None) -> None:
        """Pass, sleep, repeat until `stop_event` is set; returns within
        `STOP_POLL_SECONDS` of it. Database errors are logged and retried with backoff.

        Woken early by a notification on `DISPATCH_SCHEDULE_CHANNEL`: read on a LISTEN
        connection of its own, or, given `wake_event`, by whoever sets it (runworker's
        LISTEN connection listens on the channel too and sets it)."""
        listener: _Listener | _Woken = _Listener() if wake_event is None else _Woken(wake_event)
        backoff = 0.5
        log.info(
            "schedule reconciler started reconciler=%s channel=%s wake-ups=%s",
            self.name,
            conf.schedule_channel(),
            "own LISTEN connection" if wake_event is None else "the worker's LISTEN connection",
        )
        try:
            while not stop_event.is_set():
                listener.ensure()
                try:
                    report = self.run_once()
                    if report.fired or report.skipped or report.registered:
                        log.debug("schedule pass reconciler=%s %s", self.name, report)
                    sleep = self.sleep_seconds(report)
                    backoff = 0.5
                except DB_ERRORS as exc:
                    _reset_connection()
                    log.error(
                        "database error in schedule reconciler, retrying in %.1fs "
                        "reconciler=%s error=%s",
                        backoff,
                        self.name,
                        db_error(exc),
                    )
                    sleep = backoff
                    backoff = min(backoff * 2, RECONNECT_MAX_SECONDS)
                except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                    # Its transaction was rolled back; the next pass tries again.
                    log.exception("schedule pass failed reconciler=%s", self.name)
                    sleep = backoff
                    backoff = min(backoff * 2, RECONNECT_MAX_SECONDS)
                listener.wait(sleep, stop_event)
        finally:
            listener.close()
            _reset_connection()
            log.info("schedule reconciler stopped reconciler=%s", self.name)


class _ScheduleFailed(Exception):
    def __init__(self, schedule_id: uuid.UUID) -> None:
        super().__init__(str(schedule_id))
        self.schedule_id = schedule_id


class _Listener:
    """The loop's own LISTEN connection (never shared, never through a pooling proxy).
    A notification is only a hint to recompute the sleep; losing the connection costs at
    most the bounded sleep, and it reconnects with backoff."""

    def __init__(self) -> None:
        self.conn: psycopg.Connection[Any] | None = None
        self.retry_at = 0.0
        self.backoff = 0.5

    def ensure(self) -> None:
        if self.conn is not None or time.monotonic() < self.retry_at:
            return
        try:
            conn = dispatch_listen.connect("dispatch-schedules-listen")
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(conf.schedule_channel())))
            self.conn = conn
            self.backoff = 0.5
        except (psycopg.Error, OSError) as exc:
            self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        self.close()
        self.retry_at = time.monotonic() + self.backoff
        log.warning(
            "schedule LISTEN connection unavailable, retrying in %.1fs error=%s",
            self.backoff,
            db_error(exc),
        )
        self.backoff = min(self.backoff * 2, RECONNECT_MAX_SECONDS)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                self.conn.close()
            self.conn = None

    def _drain(self) -> bool:
        assert self.conn is not None
        pgconn = self.conn.pgconn
        woken = False
        try:
            pgconn.consume_input()
            while pgconn.notifies() is not None:
                woken = True
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("LISTEN connection is not OK")
        except (psycopg.Error, OSError) as exc:
            self._lost(exc)
        return woken

    def wait(self, seconds: float, stop_event: threading.Event) -> None:
        """Wait up to `seconds` (monotonic), returning early on a notification or once
        `stop_event` is set."""
        deadline = time.monotonic() + seconds
        while not stop_event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            step = min(remaining, STOP_POLL_SECONDS)
            if self.conn is None:
                stop_event.wait(step)
                continue
            try:
                ready, _, _ = select.select([self.conn.pgconn.socket], [], [], step)
            except (OSError, ValueError, psycopg.Error) as exc:
                self._lost(exc)
                continue
            if ready and self._drain():
                return


class _Woken:
    """The loop's wake-ups when the process it runs in listens for it: `event` is set on
    a notification (runworker's LISTEN connection, see `SchedulingConfig`). Losing one
    costs at most the bounded sleep, as with a LISTEN connection of its own."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def ensure(self) -> None:
        return None

    def close(self) -> None:
        return None

    def wait(self, seconds: float, stop_event: threading.Event) -> None:
        """Wait up to `seconds`, returning early when woken (the event is cleared, so a
        notification during the next pass wakes the loop again) or once `stop_event` is
        set."""
        deadline = time.monotonic() + seconds
        while not stop_event.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self.event.wait(min(remaining, STOP_POLL_SECONDS)):
                self.event.clear()
                return


def run_loop(stop_event: threading.Event, wake_event: threading.Event | None = None) -> None:
    """Entry point for `runworker` (a thread beside the engine, unless --no-scheduler,
    woken through the worker's LISTEN connection; found through
    `SchedulingConfig.scheduler_loop`) and `reconcile_schedules --loop`."""
    try:
        ScheduleReconciler().run(stop_event, wake_event)
    except Exception:  # noqa: BLE001 - a background thread must say why it died
        log.exception("schedule reconciler crashed")
        raise


def run_pass() -> PassReport | None:
    """One pass in the calling thread: `runworker --burst` fires what is due before it
    drains (found through `SchedulingConfig.scheduler_pass`). A database error is logged
    and the pass skipped (None): the worker then waits for the database, saying so."""
    reconciler = ScheduleReconciler()
    try:
        report = reconciler.run_once()
    except DB_ERRORS as exc:
        _reset_connection()
        log.warning("schedule pass skipped reconciler=%s error=%s", reconciler.name, db_error(exc))
        return None
    log.info("schedule pass reconciler=%s %s", reconciler.name, report)
    return report


def register_at_startup() -> threading.Thread:
    """Register schedules when the site starts, in a background thread so that a slow or
    unreachable database never holds up (or stops) the site; a failure is logged and the
    next reconciler pass registers instead."""

    def target() -> None:
        try:
            registered, unregistered = ScheduleReconciler().register()
            log.info(
                "schedules registered at start registered=%d unregistered=%d",
                registered,
                unregistered,
            )
        except DB_ERRORS as exc:  # a database that is down or slow: never stop the site
            log.warning(
                "schedules not registered at start (the reconciler will) error=%s", db_error(exc)
            )
        except Exception:
            # The thread's boundary: the site starts anyway, and the traceback says why.
            log.exception("schedules not registered at start (the reconciler will)")
        finally:
            _reset_connection()

    thread = threading.Thread(target=target, name="schedule-registration", daemon=True)
    thread.start()
    return thread


def _reset_connection() -> None:
    with contextlib.suppress(*DB_ERRORS):
        connection.close()
