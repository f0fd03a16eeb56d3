"""Heartbeats: every held lease extended in one statement; executions stopped at their
deadline, or when their lease runs out without a heartbeat confirming it."""

from __future__ import annotations

import logging
import time
import uuid

from dispatch.core import deadline
from dispatch.core.db import DB_ERRORS
from dispatch.worker import claims
from dispatch.worker.base import STALE_HEARTBEATS, CoordinatorBase, Execution
from dispatch.worker.events import EventBuffer
from dispatch.worker.log import db_error
from dispatch.worker.runner import StopCause

log = logging.getLogger("dispatch.worker")


class Heartbeat(CoordinatorBase):
    """The heartbeat thread (one statement extends every held lease and brings back a look
    at the queue and the live peers) and the lease thread, which stops what the database
    no longer confirms without waiting for the database."""

    def heartbeat_once(self) -> None:
        """One heartbeat for every held attempt (and the worker row)."""
        with self._lock:
            held = [e for e in self.executions.values() if not e.done.is_set()]
            stats = dict(self.stats)
        stats.update(self.probe.stats())
        stats["free_slots"] = 0 if self.stopping else self._free()
        # Each attempt's buffered events go with its lease (written only if the lease is
        # still ours); given back to the buffer if the heartbeat fails.
        taken = [e.control.events.take(in_flight=True) for e in held]
        sent_at = time.monotonic()
        try:
            beats, peers, view = claims.heartbeat_and_peers(
                STALE_HEARTBEATS * self.idle_heartbeat,
                self.worker_id,
                [
                    (
                        e.claimed.attempt_id,
                        e.claimed.lease_token,
                        e.control.rows_read,
                        e.control.rows_written,
                        (EventBuffer.as_json(events), lost),
                    )
                    for e, (events, lost) in zip(held, taken, strict=True)
                ],
                stats,
            )
        except BaseException:
            for e, (events, lost) in zip(held, taken, strict=True):
                e.control.events.put_back(events, lost)
            raise
        for e in held:
            e.control.events.landed()
        with self._lock:
            self._peers = peers
            self._view = (sent_at, view)
        self._wake()  # the main thread applies the view (_take_view)
        for e in held:
            beat = beats.get(e.claimed.attempt_id)
            if beat is None:
                if not e.done.is_set():
                    log.warning(
                        "lease lost run=%s attempt=%s worker=%s token=%s",
                        e.claimed.run_id,
                        e.claimed.number,
                        self.worker_id,
                        e.claimed.lease_token,
                    )
                    e.control.stop(StopCause.LEASE_LOST)
                continue
            e.control.heartbeat_ok(beat.lease_seconds, sent_at)
            if beat.cancel_requested:
                e.control.stop(StopCause.CANCEL)
        self._record_estimates([e for e in held if e.claimed.attempt_id in beats])

    def _record_estimates(self, held: list[Execution]) -> None:
        """The row estimates of reads that began since the last heartbeat, once per
        attempt: one short statement, only when there is one to write (a run that ends
        before its first heartbeat writes none, and costs no transaction more). Progress
        only: a failure is logged and tried again at the next heartbeat."""
        pending: list[tuple[uuid.UUID, int, int]] = []
        for e in held:
            rows = e.control.rows_estimated
            if rows is not None and not e.control.estimate_recorded:
                pending.append((e.claimed.attempt_id, e.claimed.lease_token, rows))
        if not pending:
            return
        try:
            recorded = claims.record_estimates(pending)
        except DB_ERRORS as exc:
            self._reset_connection()
            log.warning(
                "row estimates not recorded worker=%s error=%s", self.worker_id, db_error(exc)
            )
            return
        for e in held:
            if e.claimed.attempt_id in recorded:
                e.control.estimate_recorded = True

    def _heartbeat_interval(self) -> float:
        with self._lock:
            leases = [e.control.lease_seconds for e in self.executions.values()]
        return min(leases) / 3 if leases else self.idle_heartbeat

    def _enforce_stops(self) -> float | None:
        """Time out what is past its deadline, and interrupt again what was told to stop
        but still runs (a statement may have started just after the last interrupt).
        The executor thread may be blocked in a connector's statement, where it checks
        nothing: this thread stops it. Returns the nearest deadline still ahead."""
        with self._lock:
            held = [e for e in self.executions.values() if not e.done.is_set()]
        nearest: float | None = None
        for e in held:
            stopping = e.control.cause is not None
            if e.control.should_stop():  # a passed deadline stops it (and interrupts) here
                if stopping:
                    e.control.interrupt()
                continue
            due = e.control.next_deadline()
            if due is not None and (nearest is None or due < nearest):
                nearest = due
        return nearest

    def _stop_unconfirmed(self) -> float | None:
        """Stop every execution whose lease has run out by our own clock without a
        heartbeat confirming it (the database does not answer): recovery may give its run
        to another worker now (and the sink's fence would refuse a late commit anyway).
        Returns the monotonic time the next held lease runs out."""
        with self._lock:
            held = [e for e in self.executions.values() if not e.done.is_set()]
        nearest: float | None = None
        for e in held:
            if e.control.cause is not None:
                continue
            if not e.control.lease_may_be_ours():
                log.warning(
                    "lease not confirmed in time, stopping run=%s attempt=%s worker=%s",
                    e.claimed.run_id,
                    e.claimed.number,
                    self.worker_id,
                )
                e.control.stop(StopCause.LEASE_LOST)
                continue
            ends = e.control.last_heartbeat_ok + e.control.lease_seconds
            nearest = ends if nearest is None else min(nearest, ends)
        return nearest

    def _lease_loop(self) -> None:
        """The lease rule on a thread of its own, which never waits for the database: the
        heartbeat thread may be blocked in a call or a connect (each bounded, but together
        longer than what is left of a lease)."""
        while not self._stop_threads.is_set():
            ends = self._stop_unconfirmed()
            # At the next lease's end, and at least every second for executions
            # claimed meanwhile (a lease is at least 2 s).
            wait = 1.0 if ends is None else min(1.0, max(0.0, ends - time.monotonic()) + 0.01)
            self._stop_threads.wait(wait)

    def _heartbeat_loop(self) -> None:
        try:
            self._heartbeats()
        finally:
            self._reset_connection()  # an ended thread leaves no connection behind

    def _heartbeats(self) -> None:
        # The first heartbeat at once: its look at the queue times the first recovery
        # pass and the timer, and lets polling stop, without waiting an idle period.
        next_beat = time.monotonic()
        while not self._stop_threads.is_set():
            due = self._enforce_stops()
            interval = self._heartbeat_interval()
            now = time.monotonic()
            next_beat = min(next_beat, now + interval)
            wake = next_beat if due is None else min(next_beat, due)
            self._heartbeat_waiting = max(0.0, wake - now)
            woken = self._heartbeat_now.wait(self._heartbeat_waiting)
            self._heartbeat_now.clear()
            if self._stop_threads.is_set():
                break
            if not woken and time.monotonic() < next_beat:
                continue  # woken for a deadline only: no heartbeat is due yet
            next_beat = time.monotonic() + interval
            # A heartbeat never waits longer than a third of the lease it extends: the
            # rest of the lease is left for the next try.
            deadline.set_thread_limit(
                min(self.coordination_timeout, interval) if self.coordination_timeout > 0 else None
            )
            try:
                self.heartbeat_once()
            except DB_ERRORS as exc:
                self._reset_connection()
                log.error("heartbeat failed worker=%s error=%s", self.worker_id, db_error(exc))
                self._stop_threads.wait(0.5)
            except Exception:  # noqa: BLE001 - the heartbeat thread must never die
                log.exception("heartbeat crashed worker=%s", self.worker_id)
                self._stop_threads.wait(0.5)
