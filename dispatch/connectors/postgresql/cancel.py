"""Stopping a `postgresql` connector's statement on request, and watching its connection
while it waits on its server."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg import pq

from dispatch.connectors.base import Stopped, TransferContext
from dispatch.connectors.postgresql.connect import _conninfo
from dispatch.core import conf, deadline

# How long a cancel request may take to reach the server (it runs on the worker's
# heartbeat thread, which must not hang on an unreachable host).
CANCEL_TIMEOUT_SECONDS = 5.0

log = logging.getLogger("dispatch.connectors")


class _Canceller:
    """Cancels the statement (or COPY) running on a connector's connection when the
    execution is told to stop: a timeout, an operator's cancel, a lost lease, a release;
    and watches the connection while it waits on its server.

    Stopping works when the server does not answer too: a cancel request that gets no
    answer, or a statement still running CANCEL_TIMEOUT_SECONDS after the first
    interrupt, shuts the connection's socket down (the blocked call fails at once and the
    server rolls the transaction back when it notices).

    A wait on a server that stopped answering without closing the connection (a silent
    partition, a hung middlebox) is found by asking the server, on a connection of its
    own, what the session is doing (`DISPATCH_CONNECTOR_PROBE_SECONDS`): no answer twice
    in a row, the session gone, or the session idle twice in a row while the client waits
    for an answer (one lost on the way) drops the connection, and the attempt fails as a
    transient error naming why. A statement the server reports as running is slow, not
    lost, and is left alone (its own `statement_timeout` bounds it).

    The interrupt and the watcher run on other threads than the transfer. The lock keeps
    them from using the connection while the transfer thread closes it.
    """

    def __init__(
        self, ctx: TransferContext | None, config: dict[str, Any] | None = None, what: str = ""
    ) -> None:
        self._ctx = ctx
        self._config = config
        self._what = what
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._unregister: Callable[[], None] | None = None
        self._interrupted_at: float | None = None
        self._closed = threading.Event()
        # Calls in progress on the connection (the transfer thread's), and since when.
        self._depth = 0
        self.busy_since: float | None = None
        self._pid: int | None = None
        # Why the connection was dropped on purpose (for the attempt's error).
        self.dropped: str | None = None

    def attach(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._conn = conn
        every = conf.connector_probe_seconds()
        if every > 0 and self._config is not None and self._ctx is not None:
            threading.Thread(
                target=self._watch, args=(every,), name=f"dispatch-{self._what}-probe", daemon=True
            ).start()
        if self._ctx is not None:
            self._unregister = self._ctx.on_stop(self._interrupt)
            if self._ctx.should_stop():
                raise Stopped("stop requested while connecting")

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self.busy_since = time.monotonic()

    def leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.busy_since = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """A generator handing out what it read is not waiting on its server."""
        depth, self._depth, self.busy_since = self._depth, 0, None
        try:
            yield
        finally:
            self._depth = depth
            if depth:
                self.busy_since = time.monotonic()

    def watch(self, pid: int | None) -> None:
        """The attached connection's server process (None behind a pooler, whose process
        id is its own: then only an unanswered probe counts)."""
        self._pid = pid

    def interrupt(self) -> None:
        """Cancel what runs on the connection now (escalating as a stop does)."""
        self._interrupt()

    def _interrupt(self) -> None:
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                return
            now = time.monotonic()
            if self._interrupted_at is None:
                self._interrupted_at = now
            elif now - self._interrupted_at >= CANCEL_TIMEOUT_SECONDS:
                if _waiting(conn):
                    self._drop(conn, "the statement did not end after a cancel request")
                return
            try:
                conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
            except psycopg.Error:  # the cancel request got no answer in time
                if _waiting(conn):
                    self._drop(conn, "the server did not answer a cancel request")

    def _drop(self, conn: psycopg.Connection[Any], why: str) -> None:
        """Shut the socket down (under the lock: the descriptor is still the connection's)."""
        if self.dropped is None:
            self.dropped = f"connection dropped: {why}"
        log.warning("%s connection dropped: %s", self._what, why)
        deadline.shutdown_socket(conn.fileno())

    def _watch(self, every: float) -> None:
        misses = 0
        waited: tuple[float, str] | None = None  # (busy since, server's stamp) last seen
        while not self._closed.wait(every):
            conn, since = self._conn, self.busy_since
            if conn is None or conn.closed:
                return
            if since is None or time.monotonic() - since < every:
                misses, waited = 0, None  # not waiting on the server (long enough)
                continue
            state, stamp = self._probe(every, self._pid)
            misses = misses + 1 if state is None else 0
            why = None
            if misses >= 2:
                why = f"no answer from the server for {misses} probes {every:g}s apart"
            elif state == "gone":
                why = "the server ended the session without the client hearing of it"
            elif state == "waits for the client":
                # Twice, in one wait of ours, with nothing done by the server in between:
                # what the client waits for never reached the server (or its answer never
                # came back).
                if waited == (since, stamp):
                    why = "the server waits for the client while the client waits for an answer"
                waited = (since, stamp)
            else:
                waited = None
            if why is None:
                continue
            with self._lock:
                if self._conn is conn and not conn.closed and self.busy_since == since:
                    self._drop(conn, why)
            return

    def _probe(self, timeout: float, pid: int | None) -> tuple[str | None, str]:
        """What the server says of the watched session: ("gone", ""), ("waits for the
        client", when it started to), ("working", ""), ("", "") for an answer that does
        not say; (None, "") if the server did not answer within `timeout`."""
        assert self._config is not None
        try:
            probe = psycopg.connect(
                _conninfo(self._config),
                connect_timeout=max(2, math.ceil(timeout)),
                autocommit=True,
                application_name="dispatch probe",
            )
        except psycopg.OperationalError as exc:
            # A refusal is an answer (the server is there); only silence counts.
            return (None, "") if "timeout" in str(exc).lower() else ("", "")
        try:
            with probe, deadline.guarded(probe, f"{self._what} probe", timeout):
                if pid is None:
                    probe.execute("SELECT 1")
                    return "", ""
                row = probe.execute(
                    # Qualified: this session skips set_safe_search_path.
                    "SELECT state, wait_event, state_change::pg_catalog.text,"
                    " query_start::pg_catalog.text FROM pg_catalog.pg_stat_activity"
                    " WHERE pid OPERATOR(pg_catalog.=) %s",
                    [pid],
                ).fetchone()
        except deadline.DeadlineExceeded:
            return None, ""
        except psycopg.Error:
            return "", ""
        if row is None:
            return "gone", ""
        state, wait_event, state_change, query_start = row
        if state is None:
            return "", ""  # not allowed to see it
        if str(state).startswith("idle"):
            return "waits for the client", f"{state} {state_change}"
        if state == "active" and wait_event == "ClientRead":
            return "waits for the client", f"reading {query_start}"
        return "working", ""

    def close(self, conn: psycopg.Connection[Any]) -> None:
        self._closed.set()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        with self._lock:
            self._conn = None
            # An unfinished COPY or transaction is abandoned: closing rolls back.
            with contextlib.suppress(psycopg.Error, OSError):
                conn.close()


def _waiting(conn: psycopg.Connection[Any]) -> bool:
    """A statement (or COPY) is in flight: the client waits on the server."""
    return bool(conn.info.transaction_status == pq.TransactionStatus.ACTIVE)
