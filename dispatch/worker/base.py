"""The state the worker coordinator's parts share, and the few steps all of them take."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.db import connection

from dispatch.core import conf
from dispatch.core.db import DB_ERRORS
from dispatch.worker import claims, listen
from dispatch.worker.claims import ClaimedAttempt
from dispatch.worker.listen import ListenOpening
from dispatch.worker.runner import ExecutionControl
from dispatch.worker.stats import DURATION_BUCKETS, Histogram

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


@dataclass
class TickReport:
    """What one `run_once` did (for tests and logs)."""

    claimed: int = 0
    directed_hits: int = 0
    directed_misses: int = 0
    notifications: int = 0
    recovered: int = 0
    finished: int = 0


class CoordinatorBase:
    """The worker's settings and the state its parts share. The main thread admits and
    reaps, executor threads add executions (a settlement that claimed) and count, the
    heartbeat thread leaves its look at the queue and its peers: those are read and
    written under `_lock`."""

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
        wake_on: Mapping[str, threading.Event] | None = None,
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
        # Channels the LISTEN connection also listens on, each with the event a
        # notification on it sets: a background loop's wake-ups (the schedule
        # reconciler's) come through this connection instead of one of its own.
        self.wake_on = dict(wake_on or {})
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
        self._listen_opening: ListenOpening | None = None
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

    def _free(self) -> int:
        return self.concurrency - len(self.executions)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already holds a wake-up
            os.write(self._wake_w, b"x")

    def _reset_connection(self) -> None:
        with contextlib.suppress(*DB_ERRORS):
            connection.close()

    def _count(self, name: str, n: int = 1) -> None:
        """Add to a counter. Every thread counts through here: the heartbeat thread copies
        the counters under the same lock."""
        with self._lock:
            self.stats[name] += n
