"""An attempt's event log, as its worker keeps it until the next heartbeat or the
settlement writes it (sql/functions/events.sql): the worker only buffers, the SQL that
holds the lease token's guard writes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from dispatch.core import conf

# What an event may be (AttemptEvent.kind); `settled` is written by the settlement's SQL.
EVENT_KINDS = (
    "claimed",  # the worker claimed the attempt (worker, token, directed or not)
    "connected",  # a source or sink connection opened (its server's version)
    "lock_wait",  # a wait for a lock longer than DISPATCH_EVENT_LOCK_WAIT_SECONDS
    "read_started",  # the read began (COPY or batches)
    "progress",  # rows and bytes so far, every DISPATCH_EVENT_PROGRESS_SECONDS
    "fence_raised",  # the sink raised the run's fence to this attempt's token
    "committed",  # the sink committed the rows
    "error",  # an error, with its class
    "settled",  # the settlement: the attempt's new status (written by SQL)
)

# The longest message an event keeps (the SQL cuts at 1000 too).
MAX_MESSAGE_CHARS = 1000


class EventBuffer:
    """The events an execution recorded and no heartbeat has written yet. Bounded by the
    cap: more than the cap could never be kept, so those beyond it are only counted
    (`lost`), and the SQL adds them to the attempt's dropped events. Thread-safe: the
    execution thread records, the heartbeat thread takes."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap = conf.events_per_attempt() if cap is None else cap
        self._events: list[tuple[float, str, str, dict[str, Any]]] = []
        self._lost = 0
        # A heartbeat is writing what it took: the settlement waits for it to land (or
        # come back), or an event taken by a heartbeat that commits after the settlement
        # would be refused by the guard and lost.
        self._in_flight = False
        self._cond = threading.Condition()

    def record(self, kind: str, message: str, **data: Any) -> None:
        """Keep one event (its message already free of secrets: the caller sanitizes)."""
        with self._cond:
            if len(self._events) >= self.cap:
                self._lost += 1
                return
            self._events.append((time.monotonic(), kind, message[:MAX_MESSAGE_CHARS], data))

    def take(
        self, *, in_flight: bool = False, wait: float = 0.0
    ) -> tuple[list[tuple[float, str, str, dict[str, Any]]], int]:
        """Everything buffered, and the count of those lost; the buffer is then empty.
        `in_flight`: the taker writes them (a heartbeat) and calls `landed` or `put_back`
        after; `wait`: first wait up to that many seconds for such a write to end."""
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight, timeout=wait)
            events, lost = self._events, self._lost
            self._events, self._lost = [], 0
            self._in_flight = in_flight
        return events, lost

    def landed(self) -> None:
        """The write of what a heartbeat took ended (written, or refused with its lease)."""
        with self._cond:
            self._in_flight = False
            self._cond.notify_all()

    def put_back(self, events: list[tuple[float, str, str, dict[str, Any]]], lost: int) -> None:
        """Return what a failed write took, before what was recorded since (order kept)."""
        with self._cond:
            merged = events + self._events
            self._lost += lost + max(0, len(merged) - self.cap)
            self._events = merged[: self.cap]
            self._in_flight = False
            self._cond.notify_all()

    @staticmethod
    def as_json(events: list[tuple[float, str, str, dict[str, Any]]]) -> str:
        """The events as the SQL takes them: `ago` is seconds before now (monotonic)."""
        now = time.monotonic()
        return json.dumps(
            [
                {"kind": kind, "message": message, "data": data, "ago": round(now - at, 3)}
                for at, kind, message, data in events
            ],
            default=str,
        )
