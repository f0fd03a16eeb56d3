"""WorkerDispatchCoordinator: the `runworker` process.

One main thread admits work and keeps time; `concurrency` executor threads run attempts;
one heartbeat thread extends every held lease in one statement. Admission paths:

- directed: a notification names a run; with a free slot the worker claims that run's
  attempt, falling back to generic work in the same call when it misses;
- generic: the end of every execution, a reconnect, the timer for the earliest future
  `available_at`, and polling refill free slots with the oldest eligible attempts. While
  notifications arrive, the poll is the heartbeat's look at the queue (one transaction per
  idle heartbeat says whether eligible work is due); without them, a claim pass every
  `poll_interval`.

Notifications are hints: a lost, duplicated, malformed or unknown one changes latency
only. The worker never compares its clock with a database timestamp: delays come from
the database as durations and are kept on the local monotonic clock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import select
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg
from django.db import ProgrammingError as DjangoProgrammingError
from django.db import connection
from psycopg import sql

from dispatch import conf, deadline, services
from dispatch.db import DB_ERRORS, one_line
from dispatch.sqlfiles import query
from dispatch.states import Reason, Status
from dispatch.worker import claims, listen
from dispatch.worker.claims import ClaimedAttempt
from dispatch.worker.runner import ExecutionControl, Runner, StopCause
from dispatch.worker.stats import DURATION_BUCKETS, Histogram, WorkerSnapshot

log = logging.getLogger("dispatch.worker")

# Notifications: the worker ranked second for a run looks again this long after the
# notification, in case the first-ranked one could not take it (busy, stopping, gone).
HANDOFF_SECONDS = 1.0
# A heartbeat's look claims work that has been due this long: longer than a notified run
# waits for its first- or second-ranked worker, so it does not race the wake-ups.
UNCLAIMED_SECONDS = 2 * HANDOFF_SECONDS
# A peer whose heartbeat is older than this many idle heartbeat periods is left out of
# the ranking; a queue view older than this many no longer stands in for polling.
STALE_HEARTBEATS = 3
RECONNECT_MAX_SECONDS = 10.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Execution:
    claimed: ClaimedAttempt
    control: ExecutionControl
    done: threading.Event = field(default_factory=threading.Event)
    # Its settlement also claimed for its slot (dispatch.worker.claims.settle_and_claim): no
    # refill claim is needed when it is reaped.
    refilled: bool = False


class _ListenOpening:
    """What the thread that opens a LISTEN connection hands the main thread: `done` is
    set once the connection (or the error) is in place, so the main thread never takes a
    half-made hand-over, and a connection finished after the worker gave up on it (at
    shutdown) is closed by the thread itself."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        self.proxied = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def finish(
        self,
        *,
        conn: psycopg.Connection[Any] | None = None,
        proxied: bool = False,
        error: BaseException | None = None,
    ) -> None:
        with self._lock:
            if self._abandoned:
                if conn is not None:
                    conn.close()
                return
            self.conn, self.proxied, self.error = conn, proxied, error
            self.done.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class _SlotRefill:
    """The Refill a runner uses to claim its slot's next attempt in its settlement."""

    def __init__(self, coordinator: WorkerDispatchCoordinator) -> None:
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
                if claims.settle(
                    attempt.attempt_id,
                    attempt.lease_token,
                    "RELEASE",
                    reason=Reason.SHUTDOWN_RELEASED,
                ):
                    services.notify(attempt.run_id)
                continue
            c._count("claims_generic")
            c._count("claims_at_settlement")


@dataclass
class TickReport:
    """What one `run_once` did (for tests and logs)."""

    claimed: int = 0
    directed_hits: int = 0
    directed_misses: int = 0
    notifications: int = 0
    recovered: int = 0
    finished: int = 0


class WorkerDispatchCoordinator:
    def __init__(
        self,
        *,
        concurrency: int = 1,
        poll_interval: float | None = None,
        worker_id: str | None = None,
        burst: bool = False,
        recovery_interval: float | None = None,
        shutdown_grace: float | None = None,
        background: list[Callable[[threading.Event], None]] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.concurrency = concurrency
        self.poll_interval = conf.poll_interval() if poll_interval is None else poll_interval
        self.recovery_interval = (
            conf.recovery_interval() if recovery_interval is None else recovery_interval
        )
        self.shutdown_grace = (
            conf.shutdown_grace_seconds() if shutdown_grace is None else shutdown_grace
        )
        self.idle_heartbeat = conf.idle_heartbeat_seconds()
        self.coordination_timeout = conf.coordination_timeout()
        self.worker_id = worker_id or default_worker_id()
        self.burst = burst
        self.background = background or []
        self.stats: Counter[str] = Counter()
        self._execution_seconds = Histogram(DURATION_BUCKETS)
        self.executions: dict[uuid.UUID, Execution] = {}
        # Reentrant: request_stop takes it and may run in a signal handler on the main
        # thread while that thread holds it.
        self._lock = threading.RLock()
        self._queue: queue.Queue[Execution | None] = queue.Queue()
        self._stop_threads = threading.Event()
        self._heartbeat_now = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._listen: psycopg.Connection[Any] | None = None
        # A thread opening the LISTEN connection, and what it hands over.
        self._listen_opening: _ListenOpening | None = None
        self._listen_retry_at = 0.0
        self._listen_backoff = 0.5
        self.probe = listen.ListenProbe(
            self.worker_id,
            interval=conf.listen_probe_interval(),
            timeout=conf.listen_probe_timeout(),
        )
        self._db_backoff_until = 0.0
        self._db_backoff = 0.5
        now = time.monotonic()
        self._next_poll = now
        self._next_recovery = now
        self._timer: float | None = None
        self._refill = True
        # The last generic pass claimed nothing (with --burst: time to exit).
        self._last_claim_empty = False
        self.stopping = False
        self._drain_deadline: float | None = None
        self._threads: list[threading.Thread] = []
        # How long the heartbeat thread is waiting this time (seconds).
        self._heartbeat_waiting = self.idle_heartbeat
        # The last heartbeat's look at the queue, left by the heartbeat thread for the
        # main thread (under the lock) with the monotonic time it was sent; and when the
        # main thread last took one. The earliest lease expiry it showed (monotonic).
        self._view: tuple[float, claims.QueueView] | None = None
        self._view_at: float | None = None
        self._expiry_at: float | None = None
        # Live workers with a free slot, as the last heartbeat read them (this one
        # included), for ranking notifications; and the runs this worker is second for.
        self._peers: tuple[str, ...] = ()
        self._handoffs: dict[uuid.UUID, float] = {}

    # --- lifecycle ----------------------------------------------------------------------
    def run(self) -> int:
        """Run until SIGTERM/SIGINT (or, with `burst`, until nothing is claimable)."""
        self._install_signal_handlers()
        deadline.set_thread_limit(self.coordination_timeout)
        self._register()
        self._start_threads()
        try:
            while True:
                self.run_once()
                if self._finished():
                    break
                self._wait(self._next_timeout())
        finally:
            self._shutdown()
        return 0

    def request_stop(self, *, immediate: bool = False) -> None:
        """Begin draining: stop claiming, let executions finish within the grace period."""
        if not self.stopping:
            with self._lock:  # see _start(unless_stopping=True)
                self.stopping = True
            self._drain_deadline = time.monotonic() + self.shutdown_grace
            log.info(
                "worker draining worker=%s held=%d grace=%.1fs",
                self.worker_id,
                len(self.executions),
                self.shutdown_grace,
            )
        if immediate:
            self._drain_deadline = time.monotonic()
        self._wake()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            # A second signal skips the rest of the grace period.
            self.request_stop(immediate=self.stopping)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _register(self) -> None:
        """Insert the worker row, waiting (with a clear log line) while the database is
        down instead of exiting in a crash loop."""
        delay = 0.5
        while True:
            try:
                with connection.cursor() as cursor:
                    cursor.execute(
                        query("register_worker"),
                        {
                            "id": self.worker_id,
                            "host": socket.gethostname(),
                            "pid": os.getpid(),
                            "concurrency": self.concurrency,
                        },
                    )
                db = connection.settings_dict
                log.info(
                    "worker started worker=%s concurrency=%d channel=%s database=%s:%s/%s",
                    self.worker_id,
                    self.concurrency,
                    conf.channel(),
                    db.get("HOST") or "local socket",
                    db.get("PORT") or "5432",
                    db.get("NAME"),
                )
                return
            except (DjangoProgrammingError, psycopg.errors.UndefinedTable) as exc:
                # The tables are missing: retrying cannot help (dispatch.E013).
                log.error(
                    "the database is not migrated (run `manage.py migrate`) worker=%s error=%s",
                    self.worker_id,
                    one_line(exc),
                )
                raise SystemExit(
                    "dispatch.E013: the database is not migrated; run `manage.py migrate`."
                ) from None
            except DB_ERRORS as exc:
                self._reset_connection()
                log.error(
                    "database unavailable, retrying in %.1fs worker=%s error=%s",
                    delay,
                    self.worker_id,
                    one_line(exc),
                )
                if self._sleep_or_stop(delay):
                    raise SystemExit(0) from None
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    def _start_threads(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._executor_loop, name=f"executor-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        t.start()
        self._threads.append(t)
        t = threading.Thread(target=self._lease_loop, name="leases", daemon=True)
        t.start()
        self._threads.append(t)
        for target in self.background:
            t = threading.Thread(
                target=target,
                args=(self._stop_threads,),
                daemon=True,
                name=getattr(target, "__name__", "background"),
            )
            t.start()
            self._threads.append(t)

    def _finished(self) -> bool:
        if self.stopping:
            if not self.executions:
                return True
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._release_all()
                return True
            return False
        # --burst: nothing claimable now and our own executions have finished.
        return self.burst and not self.executions and not self._refill and self._last_claim_empty

    def _shutdown(self) -> None:
        self._stop_threads.set()
        self._heartbeat_now.set()
        with self._lock:
            stats = dict(self.stats)
        stats.update(self.probe.stats())  # the LISTEN state as it was while running
        self._close_listen()
        self._abandon_listen_opening()
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    query("stop_worker"), {"id": self.worker_id, "stats": json.dumps(stats)}
                )
        except DB_ERRORS as exc:
            log.warning(
                "could not mark worker stopped worker=%s error=%s", self.worker_id, one_line(exc)
            )
        for _ in range(self.concurrency):
            self._queue.put(None)
        log.info("worker stopped worker=%s stats=%s", self.worker_id, stats)

    # --- one iteration --------------------------------------------------------------------
    def run_once(self) -> TickReport:
        """Reap finished executions, read notifications, claim, recover. Never raises for
        a database error: it logs, backs off and tries again on the next iteration."""
        report = TickReport()
        report.finished = self._reap()
        notifications = self._read_notifications()
        report.notifications = len(notifications)
        self._take_view()
        now = time.monotonic()
        if now < self._db_backoff_until:
            return report
        try:
            if not self.stopping:
                self._admit(notifications, report, now)
            self._tick_probe(now)
            if now >= self._next_recovery or (
                self._expiry_at is not None and now >= self._expiry_at
            ):
                self._expiry_at = None  # the next heartbeat shows the next one
                report.recovered = self._recover()
                self._next_recovery = time.monotonic() + self.recovery_interval
            self._db_backoff = 0.5
        except DB_ERRORS as exc:
            self._reset_connection()
            log.error(
                "database error, retrying in %.1fs worker=%s error=%s",
                self._db_backoff,
                self.worker_id,
                one_line(exc),
            )
            self._db_backoff_until = time.monotonic() + self._db_backoff
            self._db_backoff = min(self._db_backoff * 2, RECONNECT_MAX_SECONDS)
            self._refill = True
        return report

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

    def _free(self) -> int:
        return self.concurrency - len(self.executions)

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

    def _recover(self) -> int:
        results = claims.recover(refresh=True)
        settled = [r for r in results if r.outcome is not None]
        for r in results:
            if r.outcome is None:  # isolated by the pass: rolled back alone, left RUNNING
                log.error(
                    "lease expired, settlement failed run=%s attempt=%s worker=%s error=%s",
                    r.run_id,
                    r.number,
                    self.worker_id,
                    r.error,
                )
                self._count("recovery_failures")
                continue
            log.info(
                "lease expired, settled run=%s attempt=%s outcome=%s worker=%s",
                r.run_id,
                r.number,
                r.outcome,
                self.worker_id,
            )
        self._count("recovered", len(settled))
        if settled:
            self._refill = True  # a successor may be due at once (and sets the timer)
            # Wake the fleet for the successors: the first-ranked worker of each claims it
            # or, if its backoff has not passed, sets its timer to it.
            services.notify_many([r.run_id for r in settled if r.outcome == Status.RETRY_SCHEDULED])
        return len(settled)

    def _release_all(self) -> None:
        """End of the grace period: release what is still running so that another worker
        can take it at once (fenced: if the execution commits first, it wins)."""
        with self._lock:
            running = list(self.executions.values())
        for execution in running:
            execution.control.stop(StopCause.RELEASED)
            c = execution.claimed
            try:
                status = claims.settle(
                    c.attempt_id,
                    c.lease_token,
                    "RELEASE",
                    reason=Reason.SHUTDOWN_RELEASED,
                    rows_read=execution.control.rows_read,
                    rows_written=execution.control.rows_written,
                )
            except DB_ERRORS as exc:
                log.error(
                    "could not release run=%s attempt=%s; recovery will settle it at lease "
                    "expiry error=%s",
                    c.run_id,
                    c.number,
                    one_line(exc),
                )
                continue
            if status is not None:
                self._count("released")
                log.info(
                    "attempt released at shutdown run=%s attempt=%s worker=%s token=%s",
                    c.run_id,
                    c.number,
                    self.worker_id,
                    c.lease_token,
                )
                services.notify(c.run_id)

    # --- notifications ----------------------------------------------------------------------
    def _listen_open_in_background(self) -> None:
        """Open the LISTEN connection on a thread of its own. Connecting to a host that
        swallows packets waits up to `connect_timeout`; on the main thread that wait would
        stop claims, settlements' reaping and recovery, while the worker says it polls.
        The thread hands the connection over (or the error) and wakes the main loop."""
        opening = _ListenOpening()
        channel = conf.channel()

        def open_listening() -> None:
            deadline.set_thread_limit(self.coordination_timeout)
            conn = None
            try:
                conn = listen.connect(f"dispatch-listen {self.worker_id}")
                with deadline.guarded(conn, "listen", self.coordination_timeout):
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    proxied = self.probe.listen_on(conn)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                if conn is not None:
                    conn.close()
                opening.finish(error=exc)
            else:
                opening.finish(conn=conn, proxied=proxied)
            self._wake()

        self._listen_opening = opening
        threading.Thread(target=open_listening, name="dispatch-listen-open", daemon=True).start()

    def _listen_adopt(self) -> bool:
        """Take the connection the opening thread made (True), or start one when the
        backoff allows; False while none is ready."""
        opening = self._listen_opening
        if opening is None:
            if time.monotonic() >= self._listen_retry_at:
                self._listen_open_in_background()
            return False
        if not opening.done.is_set():
            return False
        self._listen_opening = None
        if opening.error is not None:
            error = opening.error
            if not isinstance(error, (psycopg.Error, OSError, deadline.DeadlineExceeded)):
                raise error
            self._listen_lost(error)
            return False
        assert opening.conn is not None
        self._listen = opening.conn
        self.probe.adopted(opening.proxied)
        self._listen_backoff = 0.5
        self._refill = True  # once listening again, one generic pass
        log.info("listening worker=%s channel=%s", self.worker_id, conf.channel())
        return True

    def _close_listen(self) -> None:
        if self._listen is not None:
            with contextlib.suppress(Exception):
                self._listen.close()
            self._listen = None
        self.probe.disconnected()

    def _abandon_listen_opening(self) -> None:
        """At shutdown: a connection an opening thread made, now or later, is closed."""
        if self._listen_opening is not None:
            self._listen_opening.abandon()
            self._listen_opening = None

    def _tick_probe(self, now: float) -> None:
        """The LISTEN self-probe: a missed probe reconnects (or, behind a transaction
        pooler, stops listening for good); polling goes on either way."""
        if self._listen is None:
            return
        action = self.probe.tick(now, self.poll_interval)
        if action is listen.ProbeAction.NONE:
            return
        self._count("listen_probe_failures")
        if action is listen.ProbeAction.STOP_LISTENING:
            with (
                contextlib.suppress(Exception),
                deadline.guarded(self._listen, "unlisten", self.coordination_timeout),
            ):
                self._listen.execute("UNLISTEN *")  # best effort: the pooler keeps it
        self._close_listen()
        self._listen_retry_at = now + self._listen_backoff
        self._listen_backoff = min(self._listen_backoff * 2, RECONNECT_MAX_SECONDS)
        self._refill = True

    def _read_notifications(self) -> list[uuid.UUID]:
        if self._listen is None:
            if self.probe.state is listen.ListenState.POOLED:
                return []  # polling only: the LISTEN URL is a transaction pooler
            if not self._listen_adopt():
                return []
        assert self._listen is not None
        pgconn = self._listen.pgconn
        run_ids: list[uuid.UUID] = []
        try:
            pgconn.consume_input()
            while (n := pgconn.notifies()) is not None:
                if n.relname.decode("utf-8", "replace") == self.probe.channel:
                    self.probe.received(n.extra.decode("utf-8", "replace"))
                    continue
                self.probe.traffic()
                self._count("notifications")
                try:
                    run_ids.append(uuid.UUID(n.extra.decode("utf-8", "replace").strip()))
                except ValueError:
                    self._count("notifications_malformed")
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("LISTEN connection is not OK")
        except (psycopg.Error, OSError) as exc:
            self._listen_lost(exc)
        return run_ids

    def _listen_lost(self, exc: BaseException) -> None:
        self._close_listen()
        self._listen_retry_at = time.monotonic() + self._listen_backoff
        log.warning(
            "LISTEN connection lost, reconnecting in %.1fs and polling meanwhile "
            "worker=%s error=%s",
            self._listen_backoff,
            self.worker_id,
            one_line(exc),
        )
        self._listen_backoff = min(self._listen_backoff * 2, RECONNECT_MAX_SECONDS)
        self._count("listen_reconnects")

    # --- waiting ------------------------------------------------------------------------------
    def _next_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [self._next_recovery]
        if self._expiry_at is not None:
            deadlines.append(self._expiry_at)
        if not self.stopping:
            if self._free() > 0:
                if not self._notifications_arrive(now):
                    deadlines.append(self._next_poll)
                if self._timer is not None:
                    deadlines.append(self._timer)
                if self._handoffs:
                    deadlines.append(min(self._handoffs.values()))
        elif self._drain_deadline is not None:
            deadlines.append(self._drain_deadline)
        if self._listen is None:
            # While a thread opens it, its end wakes the loop (no deadline to keep).
            if self.probe.state is not listen.ListenState.POOLED and self._listen_opening is None:
                deadlines.append(self._listen_retry_at)
        elif (probe_at := self.probe.next_deadline()) is not None:
            deadlines.append(probe_at)
        if self._db_backoff_until > now:
            deadlines.append(self._db_backoff_until)
        elif self._refill and self._free() > 0 and not self.stopping:
            return 0.0  # a refill was asked for after this iteration's admission (recovery)
        return max(0.0, min(deadlines) - now)

    def _wait(self, timeout: float) -> None:
        fds = [self._wake_r]
        if self._listen is not None:
            fds.append(self._listen.pgconn.socket)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            ready = []
            time.sleep(min(timeout, 0.1))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already holds a wake-up
            os.write(self._wake_w, b"x")

    def _sleep_or_stop(self, seconds: float) -> bool:
        self._wait(seconds)
        return self.stopping

    def _reset_connection(self) -> None:
        with contextlib.suppress(*DB_ERRORS):
            connection.close()

    # --- threads ----------------------------------------------------------------------------
    def _executor_loop(self) -> None:
        deadline.set_thread_limit(self.coordination_timeout)
        while True:
            execution = self._queue.get()
            if execution is None:
                break
            try:
                runner = Runner(
                    execution.claimed,
                    execution.control,
                    on_event=self._on_event,
                    refill=_SlotRefill(self),
                )
                started = time.monotonic()
                try:
                    runner.execute()
                    execution.refilled = runner.refilled
                    self._count_execution(execution, time.monotonic() - started)
                except DB_ERRORS as exc:
                    # The outcome could not be recorded: the lease runs out and recovery
                    # settles the attempt; the connection is rebuilt for the next one.
                    self._reset_connection()
                    self._count("settle_failed")
                    log.error(
                        "outcome not recorded run=%s attempt=%s error=%s",
                        execution.claimed.run_id,
                        execution.claimed.number,
                        one_line(exc),
                    )
            except BaseException:  # noqa: BLE001 - an executor thread must never die
                log.exception("executor crashed run=%s", execution.claimed.run_id)
            finally:
                execution.done.set()
                self._wake()

    def _count_execution(self, execution: Execution, seconds: float) -> None:
        """Count a settled execution for the worker's metrics port."""
        with self._lock:
            self.stats["executions_finished"] += 1
            self.stats["rows_read"] += execution.control.rows_read or 0
            self.stats["rows_written"] += execution.control.rows_written or 0
            self._execution_seconds.observe(seconds)

    def metrics_snapshot(self) -> WorkerSnapshot:
        """What the worker's metrics port (`runworker --metrics-port`) shows."""
        with self._lock:
            counters = {k: int(v) for k, v in self.stats.items()}
            busy = sum(1 for e in self.executions.values() if not e.done.is_set())
            seconds = Histogram(
                self._execution_seconds.bounds,
                list(self._execution_seconds.counts),
                self._execution_seconds.total,
            )
        probe = self.probe.stats()
        state = list(listen.ListenState)[probe["listen_state"]]
        return WorkerSnapshot(
            counters=counters,
            concurrency=self.concurrency,
            busy=busy,
            listen_state=state.value,
            listen_healthy=bool(probe["listen_healthy"]),
            execution_seconds=seconds,
        )

    def _on_event(self, name: str) -> None:
        self._count(name)
        if name == "keys_unusable" and not self.stopping:
            # Keys that open no snapshot would fail every run: stop claiming and release
            # what is held at once (dispatch.security.keycheck; docs/security.md).
            log.error(
                "worker stopping: its encryption keys open no snapshot worker=%s", self.worker_id
            )
            self.request_stop(immediate=True)

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter. Every thread counts through here: the heartbeat thread copies
        the counters under the same lock."""
        with self._lock:
            self.stats[name] += n

    def heartbeat_once(self) -> None:
        """One heartbeat for every held attempt (and the worker row)."""
        with self._lock:
            held = [e for e in self.executions.values() if not e.done.is_set()]
            stats = dict(self.stats)
        stats.update(self.probe.stats())
        stats["free_slots"] = 0 if self.stopping else self._free()
        sent_at = time.monotonic()
        beats, peers, view = claims.heartbeat_and_peers(
            STALE_HEARTBEATS * self.idle_heartbeat,
            self.worker_id,
            [
                (
                    e.claimed.attempt_id,
                    e.claimed.lease_token,
                    e.control.rows_read,
                    e.control.rows_written,
                )
                for e in held
            ],
            stats,
        )
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
                log.error("heartbeat failed worker=%s error=%s", self.worker_id, one_line(exc))
                self._stop_threads.wait(0.5)
            except Exception:  # noqa: BLE001 - the heartbeat thread must never die
                log.exception("heartbeat crashed worker=%s", self.worker_id)
                self._stop_threads.wait(0.5)
