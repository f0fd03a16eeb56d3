"""The LISTEN connection's hand-over to the main thread, and its self-probe ticking."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

import psycopg
from psycopg import sql

from dispatch.core import conf, deadline
from dispatch.worker import listen
from dispatch.worker.base import RECONNECT_MAX_SECONDS, CoordinatorBase
from dispatch.worker.listen import ListenOpening
from dispatch.worker.log import db_error

log = logging.getLogger("dispatch.worker")

# What opening (or using) the LISTEN connection may raise that means only "not now": the
# worker polls meanwhile and reconnects after a backoff. Anything else is a fault.
LISTEN_ERRORS: tuple[type[BaseException], ...] = (psycopg.Error, OSError, deadline.DeadlineExceeded)


class ListenHandover(CoordinatorBase):
    """The LISTEN connection, opened on a thread of its own and adopted by the main thread,
    read for notifications, and dropped when its self-probe says wake-ups do not arrive."""

    def _listen_open_in_background(self) -> None:
        """Open the LISTEN connection on a thread of its own. Connecting to a host that
        swallows packets waits up to `connect_timeout`; on the main thread that wait would
        stop claims, settlements' reaping and recovery, while the worker says it polls.
        The thread hands the connection over (or the error) and wakes the main loop."""
        opening = ListenOpening()
        channel = conf.channel()

        def open_listening() -> None:
            deadline.set_thread_limit(self.coordination_timeout)
            conn = None
            try:
                conn = listen.connect(f"dispatch-listen {self.worker_id}")
                with deadline.guarded(conn, "listen", self.coordination_timeout):
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    for other in self.wake_on:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(other)))
                    proxied = self.probe.listen_on(conn)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                if conn is not None:
                    conn.close()
                # The main thread re-raises a fault (_listen_adopt); at shutdown nobody
                # takes it, so it is logged here.
                if not opening.finish(error=exc) and not isinstance(exc, LISTEN_ERRORS):
                    log.error(
                        "opening the LISTEN connection failed worker=%s",
                        self.worker_id,
                        exc_info=exc,
                    )
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
            if not isinstance(error, LISTEN_ERRORS):
                raise error
            self._listen_lost(error)
            return False
        assert opening.conn is not None
        self._listen = opening.conn
        self.probe.adopted(opening.proxied)
        self._listen_backoff = 0.5
        self._refill = True  # once listening again, one generic pass
        # Likewise each background loop that waits on this connection: what was announced
        # while nothing listened is looked at now.
        for event in self.wake_on.values():
            event.set()
        log.info("listening worker=%s channel=%s", self.worker_id, conf.channel())
        return True

    def _close_listen(self) -> None:
        if self._listen is not None:
            with contextlib.suppress(psycopg.Error, OSError):
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
                contextlib.suppress(*LISTEN_ERRORS),
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
                relname = n.relname.decode("utf-8", "replace")
                if relname == self.probe.channel:
                    self.probe.received(n.extra.decode("utf-8", "replace"))
                    continue
                self.probe.traffic()
                if relname in self.wake_on:
                    self.wake_on[relname].set()
                    continue
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
            db_error(exc),
        )
        self._listen_backoff = min(self._listen_backoff * 2, RECONNECT_MAX_SECONDS)
        self._count("listen_reconnects")
