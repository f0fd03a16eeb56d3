"""Client-side deadlines for the worker's coordination calls.

A database that stops answering without closing the connection (a stuck middlebox, a
hung server, a partition whose far side still acknowledges TCP) leaves a blocking call in
psycopg waiting for ever: TCP keepalives and `tcp_user_timeout` see a healthy peer, and a
server-side `statement_timeout` never starts for a statement the server did not receive.
So every coordination call of a worker runs under a deadline of its own: a watchdog
thread shuts the connection's socket down when a call outlives it. The blocked call then
fails at once with a connection error, which the worker handles as any lost connection
(close, reconnect with backoff); `DeadlineExceeded` names the call and the limit.

Shutting the socket down (not closing it) leaves the file descriptor to psycopg, which
owns it: the blocked thread wakes with an end of file, and the connection is discarded
by its own thread.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from django.db import DEFAULT_DB_ALIAS, OperationalError, connection, connections
from django.db.backends.signals import connection_created

log = logging.getLogger("dispatch.worker")


class DeadlineExceeded(OperationalError):
    """A coordination call got no answer from the database in time (a database error:
    the worker handles it as a lost connection)."""


class Watchdog:
    """One thread for the process: shuts down the socket of each call past its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[int, str]] = {}  # key -> (socket fd, what)
        self._fired: set[int] = set()
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired_total = 0

    def arm(self, fd: int, seconds: float, what: str) -> int:
        with self._lock:
            key = next(self._keys)
            self._armed[key] = (fd, what)
            heapq.heappush(self._heap, (time.monotonic() + seconds, key))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="dispatch-deadline", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return key

    def disarm(self, key: int) -> bool:
        """Stop watching; True if the deadline had fired (the socket is shut down)."""
        with self._lock:
            self._armed.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

    def _loop(self) -> None:
        with self._lock:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # disarmed in time
                if not self._heap:
                    self._wake.wait()
                    continue
                at, key = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                    continue
                heapq.heappop(self._heap)
                fd, what = self._armed.pop(key)
                self._fired.add(key)
                self.fired_total += 1
                # Under the lock: the owning thread cannot disarm (and so cannot close
                # the connection and free the descriptor) while it is shut down.
                shutdown_socket(fd)
                log.error("no answer from the database in time, dropping the connection: %s", what)


def shutdown_socket(fd: int) -> None:
    """Shut a connection's socket down by its descriptor (which stays its owner's): a
    call blocked on it wakes with an end of file."""
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            with socket.socket(fileno=dup) as s:
                dup = -1  # the socket object owns (and closes) the duplicate now
                s.shutdown(socket.SHUT_RDWR)
        finally:
            if dup >= 0:
                os.close(dup)


WATCHDOG = Watchdog()
_limits = threading.local()


def set_thread_limit(seconds: float | None) -> None:
    """The deadline of the calling thread's coordination calls (None: no deadline)."""
    _limits.seconds = seconds


def thread_limit() -> float | None:
    return getattr(_limits, "seconds", None)


@contextlib.contextmanager
def guarded(raw: Any, what: str, seconds: float | None) -> Iterator[None]:
    """Run calls on an open psycopg connection `raw` under a deadline of `seconds` (None
    or 0: none). Raises DeadlineExceeded, chained to the connection error, when the
    deadline cut them short; a deadline that fired as the calls returned closes `raw`
    (its socket is shut down)."""
    if seconds is None or seconds <= 0:
        yield
        return
    key = WATCHDOG.arm(raw.fileno(), seconds, what)
    try:
        yield
    except Exception as exc:
        if WATCHDOG.disarm(key):
            raise DeadlineExceeded(
                f"{what}: no answer from the database within {seconds:g}s"
            ) from exc
        raise
    else:
        if WATCHDOG.disarm(key):
            raw.close()


def _connect_within(seconds: float) -> None:
    """Open this thread's connection if it is closed, waiting at most `seconds` (libpq's
    `connect_timeout`, which counts whole seconds and at least 2). The thread's own
    connection object connects with the limit of the call that needs it, so a heartbeat
    bounded by a third of a short lease does not wait the site's longer connect
    timeout."""
    wrapper: Any = connections[DEFAULT_DB_ALIAS]  # this thread's own
    if wrapper.connection is not None:
        return
    _connecting.seconds = seconds
    if not getattr(wrapper, "_dispatch_bounded_connect", False):
        base = type(wrapper).get_connection_params

        def params() -> dict[str, Any]:
            values = dict(base(wrapper))
            cap = max(2, math.ceil(_connecting.seconds))
            current = values.get("connect_timeout")
            if current is None or int(current) <= 0 or int(current) > cap:
                values["connect_timeout"] = cap
            return values

        wrapper.get_connection_params = params
        wrapper._dispatch_bounded_connect = True
    wrapper.ensure_connection()


_connecting = threading.local()


@contextlib.contextmanager
def bounded(what: str, seconds: float | None = None) -> Iterator[None]:
    """Run a coordination call on this thread's Django connection under a deadline (the
    thread's limit unless `seconds` is given). Connecting is bounded by the connection's
    own `connect_timeout`; everything after that (statements, BEGIN and COMMIT of an
    `atomic` block) by the deadline."""
    limit = thread_limit() if seconds is None else seconds
    if limit is None or limit <= 0:
        yield
        return
    _connect_within(limit)
    try:
        with guarded(connection.connection, what, limit):
            yield
    except DeadlineExceeded:
        connection.close()  # its socket is gone: the next call connects again
        raise


def bound_worker_sessions(seconds: float) -> None:
    """The worker process's side of the deadline, for its own connections: connecting
    takes at most `seconds` (`connect_timeout`, capped), and on a direct connection to
    PostgreSQL the session's `statement_timeout` is `seconds` too, so the server also
    gives up on a statement nobody waits for any more. Through a transaction pooler a
    session setting would stay on a pooled server connection that other clients share:
    it is not set there (set `statement_timeout` on the role instead; docs/settings.md)."""
    if seconds <= 0:
        return
    options = connection.settings_dict.setdefault("OPTIONS", {})
    cap = max(1, math.ceil(seconds))
    current = options.get("connect_timeout")
    if current is None or int(current) <= 0 or int(current) > cap:
        options["connect_timeout"] = cap
    millis = int(seconds * 1000)

    def on_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.alias != "default":
            return
        raw = connection.connection
        with guarded(raw, "session set-up", seconds):
            (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
            if int(pid) == raw.info.backend_pid:  # not a proxy's own cancel key
                raw.execute("SELECT set_config('statement_timeout', %s, false)", [f"{millis}ms"])

    connection_created.connect(on_connect, weak=False, dispatch_uid="dispatch-worker-sessions")
