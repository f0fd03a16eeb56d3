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

The coordinator composes its parts, one module each: admission (claims, slot refills,
ranking), heartbeat (heartbeats, the lease rule, stops) and handover (the LISTEN
connection), over the state they share (base). This module keeps the lifecycle, the main
loop's iteration, recovery, waiting and the executor threads.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import threading
import time
from types import FrameType

import psycopg
from django.db import ProgrammingError as DjangoProgrammingError
from django.db import connection

from dispatch import services, signals
from dispatch.core import conf, deadline
from dispatch.core.db import DB_ERRORS, loggable
from dispatch.core.sqlfiles import query
from dispatch.core.states import Reason, Status
from dispatch.worker import claims, listen
from dispatch.worker.admission import Admission, SlotRefill
from dispatch.worker.base import RECONNECT_MAX_SECONDS, Execution, TickReport
from dispatch.worker.events import EventBuffer
from dispatch.worker.handover import ListenHandover
from dispatch.worker.heartbeat import Heartbeat
from dispatch.worker.log import db_error
from dispatch.worker.runner import Runner, StopCause
from dispatch.worker.stats import Histogram, WorkerSnapshot

log = logging.getLogger("dispatch.worker")


class WorkerDispatchCoordinator(Admission, Heartbeat, ListenHandover):
    """The `runworker` process; constructed with CoordinatorBase's arguments."""

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
                    db_error(exc),
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
                    db_error(exc),
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
                "could not mark worker stopped worker=%s error=%s", self.worker_id, db_error(exc)
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
                db_error(exc),
            )
            self._db_backoff_until = time.monotonic() + self._db_backoff
            self._db_backoff = min(self._db_backoff * 2, RECONNECT_MAX_SECONDS)
            self._refill = True
        return report

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
                    loggable(r.error or ""),
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
            # A heartbeat still writing this execution's events ends first (its events
            # are written, or put back and taken here), as at a settlement.
            events, lost = execution.control.events.take(wait=conf.coordination_timeout() or 10.0)
            try:
                status = claims.settle(
                    c.attempt_id,
                    c.lease_token,
                    "RELEASE",
                    reason=Reason.SHUTDOWN_RELEASED,
                    rows_read=execution.control.rows_read,
                    rows_written=execution.control.rows_written,
                    events=(EventBuffer.as_json(events), lost),
                )
            except DB_ERRORS as exc:
                log.error(
                    "could not release run=%s attempt=%s; recovery will settle it at lease "
                    "expiry error=%s",
                    c.run_id,
                    c.number,
                    db_error(exc),
                )
                continue
            if status is not None:
                signals.settled(
                    run_id=c.run_id,
                    attempt_id=c.attempt_id,
                    attempt=c.number,
                    binding_id=c.binding_id,
                    status=status,
                )
                self._count("released")
                log.info(
                    "attempt released at shutdown run=%s attempt=%s worker=%s token=%s",
                    c.run_id,
                    c.number,
                    self.worker_id,
                    c.lease_token,
                )
                services.notify(c.run_id)

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

    def _sleep_or_stop(self, seconds: float) -> bool:
        self._wait(seconds)
        return self.stopping

    # --- threads ----------------------------------------------------------------------------
    def _executor_loop(self) -> None:
        deadline.set_thread_limit(self.coordination_timeout)
        try:
            self._execute_queued()
        finally:
            # A coordinator run inside a longer-lived process (a test, a host's own
            # runner) leaves no connection of an ended thread behind.
            self._reset_connection()

    def _execute_queued(self) -> None:
        while True:
            execution = self._queue.get()
            if execution is None:
                break
            try:
                runner = Runner(
                    execution.claimed,
                    execution.control,
                    on_event=self._on_event,
                    refill=SlotRefill(self),
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
                        db_error(exc),
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
