"""Admission: the worker's directed and generic claims, slot refills and its rank for a run."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid

from dispatch import services, signals
from dispatch.core.states import Reason
from dispatch.worker import claims, listen
from dispatch.worker.base import STALE_HEARTBEATS, CoordinatorBase, Execution, TickReport
from dispatch.worker.claims import ClaimedAttempt
from dispatch.worker.runner import ExecutionControl

log = logging.getLogger("dispatch.worker")

# Notifications: the worker ranked second for a run looks again this long after the
# notification, in case the first-ranked one could not take it (busy, stopping, gone).
HANDOFF_SECONDS = 1.0
# A heartbeat's look claims work that has been due this long: longer than a notified run
# waits for its first- or second-ranked worker, so it does not race the wake-ups.
UNCLAIMED_SECONDS = 2 * HANDOFF_SECONDS


class SlotRefill:
    """The Refill a runner uses to claim its slot's next attempt in its settlement."""

    def __init__(self, coordinator: Admission) -> None:
        self.coordinator = coordinator
        self.worker_id = coordinator.worker_id

    def limit(self) -> int:
        return 0 if self.coordinator.stopping else 1

    def adopt(self, claimed: list[ClaimedAttempt]) -> None:
        c = self.coordinator
        # What the slot's own claim found (with --burst: an empty one may be the end).
        c._last_claim_empty = not claimed
        for attempt in claimed:
            if not c._start(attempt, unless_stopping=True):
                # The worker began to stop while this settlement claimed: hand the
                # attempt back at once (a release costs no retry budget).
                status = claims.settle(
                    attempt.attempt_id,
                    attempt.lease_token,
                    "RELEASE",
                    reason=Reason.SHUTDOWN_RELEASED,
                )
                if status:
                    signals.settled(
                        run_id=attempt.run_id,
                        attempt_id=attempt.attempt_id,
                        attempt=attempt.number,
                        binding_id=attempt.binding_id,
                        status=status,
                    )
                    services.notify(attempt.run_id)
                continue
            c._count("claims_generic")
            c._count("claims_at_settlement")


class Admission(CoordinatorBase):
    """Claiming, on the main thread (a settlement's claim for its own slot comes from an
    executor thread, through SlotRefill): a notified run's attempt for the worker ranked
    first for it, generic refills of free slots, and the timer for the next due attempt.
    Each claim is one short transaction (dispatch.worker.claims)."""

    def rank(self, run_id: uuid.UUID) -> int:
        """This worker's place among the live workers with a free slot for one run:
        rendezvous hashing, so every worker computes the same order from the same view
        and each run has its own first choice (docs/architecture.md, "Where we depart
        from the contract")."""
        with self._lock:
            peers = set(self._peers)
        peers.add(self.worker_id)
        if len(peers) == 1:
            return 0
        order = sorted(
            peers,
            key=lambda w: hashlib.blake2b(run_id.bytes + w.encode(), digest_size=8).digest(),
            reverse=True,
        )
        return order.index(self.worker_id)

    def _admit(self, notifications: list[uuid.UUID], report: TickReport, now: float) -> None:
        # Executor threads add executions too (a settlement that claimed): read under
        # the lock.
        with self._lock:
            held_runs = {e.claimed.run_id for e in self.executions.values()}
        generic_exhausted = False
        due_handoffs = [r for r, at in self._handoffs.items() if now >= at]
        for run_id in due_handoffs:
            del self._handoffs[run_id]
        for run_id in dict.fromkeys(notifications):  # duplicates in one read are one hint
            if run_id in held_runs:
                # Our own run: probably a cancel request. Heartbeat now to learn it.
                self._heartbeat_now.set()
                continue
            if self._free() <= 0:
                self._count("notifications_without_slot")
                continue
            place = self.rank(run_id)
            if place > 0:
                # Another worker is first for this run: one claim per notification, not
                # one per worker. The second looks again after HANDOFF_SECONDS.
                if place == 1:
                    self._handoffs[run_id] = now + HANDOFF_SECONDS
                self._count("notifications_left_to_peers")
                continue
            if self._claim_notified(run_id, report, generic_exhausted) == 0 and self._free() > 0:
                generic_exhausted = True  # no more generic work right now
        for run_id in due_handoffs:
            if self._free() <= 0 or run_id in held_runs:
                continue
            self._count("handoff_checks")
            if claims.claimable(run_id):
                self._claim_notified(run_id, report, generic_exhausted)
        self._admit_generic(report, now, generic_exhausted)

    def _claim_notified(
        self, run_id: uuid.UUID, report: TickReport, generic_exhausted: bool
    ) -> int:
        """A directed claim of one attempt: the notified run's, or on a miss the oldest
        eligible one (unless generic work is exhausted). One slot only: filling the others
        with generic work would take runs whose first-ranked workers are claiming them
        now, and turn their directed claims into misses. Returns how many generic attempts
        came with it."""
        got = self._claim(run_id=run_id, generic=not generic_exhausted, limit=1)
        hit = any(c.directed for c in got)
        report.claimed += len(got)
        report.directed_hits += hit
        report.directed_misses += not hit
        self._count("directed_hits" if hit else "directed_misses")
        return len(got) - hit

    def _take_view(self) -> None:
        """Apply the last heartbeat's look at the queue: work due for longer than a
        wake-up takes refills free slots, the next due attempt sets the timer, the
        earliest lease expiry the next recovery."""
        with self._lock:
            taken, self._view = self._view, None
        if taken is None:
            return
        sent_at, view = taken
        self._view_at = sent_at
        if view.due_for is not None and view.due_for >= UNCLAIMED_SECONDS:
            self._refill = True
        if view.next_in is not None:
            at = sent_at + max(0.0, view.next_in) + 0.001
            if self._timer is None or at < self._timer:
                self._timer = at
        self._expiry_at = None if view.expiry_in is None else sent_at + max(0.0, view.expiry_in)

    def _notifications_arrive(self, now: float) -> bool:
        """Whether polling can stop: the LISTEN connection delivers (its self-probe or a
        wake-up came back since it connected) and heartbeats bring fresh looks at the
        queue, which stand in for the poll (docs/architecture.md, "Idle cost")."""
        return (
            not self.burst
            and self._listen is not None
            and self.probe.state is listen.ListenState.OK
            and self._view_at is not None
            and now - self._view_at < STALE_HEARTBEATS * self.idle_heartbeat
        )

    def _admit_generic(self, report: TickReport, now: float, generic_exhausted: bool) -> None:
        timer_due = self._timer is not None and now >= self._timer
        poll_due = now >= self._next_poll and not self._notifications_arrive(now)
        if self._free() > 0 and (self._refill or poll_due or timer_due):
            if timer_due:
                self._timer = None
            got = [] if generic_exhausted else self._claim_generic()
            report.claimed += len(got)
            self._next_poll = time.monotonic() + self.poll_interval
            self._refill = False

    def _claim(
        self,
        *,
        run_id: uuid.UUID | None = None,
        generic: bool = True,
        set_timer: bool = True,
        limit: int | None = None,
    ) -> list[ClaimedAttempt]:
        free = self._free() if limit is None else min(limit, self._free())
        if free <= 0:
            return []
        got = claims.claim(self.worker_id, run_id=run_id, limit=free, generic=generic)
        self._count("claim_calls")
        for claimed in got:
            self._start(claimed)
        generic_got = [c for c in got if not c.directed]
        self._count("claims_generic", len(generic_got))
        self._count("claims_directed", len(got) - len(generic_got))
        if set_timer and generic and len(got) < free:
            self._after_empty_claim()
        return got

    def _claim_generic(self) -> list[ClaimedAttempt]:
        got: list[ClaimedAttempt] = []
        # A batch may come back short while more is claimable (a binding at capacity among
        # the oldest candidates): ask again until a call returns nothing or slots are full.
        while self._free() > 0:
            batch = self._claim(set_timer=False)
            got.extend(batch)
            if not batch:
                break
        if self._free() > 0:
            self._after_empty_claim()  # once per pass, not once per call
        self._last_claim_empty = not got
        return got

    def _after_empty_claim(self) -> None:
        """Nothing more is due now: sleep until the earliest future attempt is due."""
        delay = claims.next_available_in()
        self._timer = None if delay is None else time.monotonic() + delay + 0.001

    def _start(self, claimed: ClaimedAttempt, *, unless_stopping: bool = False) -> bool:
        """Register and queue an execution. With `unless_stopping` (a settlement's claim,
        from an executor thread), refuse once the worker is stopping: the check and the
        registration are one step under the lock, so the shutdown's release of what is
        held cannot miss it."""
        execution = Execution(claimed, ExecutionControl(claimed))
        with self._lock:
            if unless_stopping and self.stopping:
                return False
            self.executions[claimed.attempt_id] = execution
        log.info(
            "attempt claimed run=%s attempt=%s worker=%s token=%s directed=%s",
            claimed.run_id,
            claimed.number,
            self.worker_id,
            claimed.lease_token,
            claimed.directed,
        )
        self._queue.put(execution)
        soonest = claimed.lease_seconds / 3
        if claimed.timeout_seconds:
            soonest = min(soonest, claimed.timeout_seconds)
        if soonest < self._heartbeat_waiting:
            # The heartbeat thread waits longer than this lease (or timeout) allows: wake
            # it to recompute (otherwise a claim costs no extra heartbeat).
            self._heartbeat_now.set()
        return True

    def _reap(self) -> int:
        with self._lock:
            finished = [e for e in self.executions.values() if e.done.is_set()]
            for e in finished:
                del self.executions[e.claimed.attempt_id]
        if any(not e.refilled for e in finished):
            self._refill = True
        return len(finished)
