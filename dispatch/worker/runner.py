"""Execute one claimed attempt: decrypt its snapshot, move the data, record the outcome.

Runs outside any dispatch transaction. The only writes it makes to the dispatch tables
are the guarded settlement at the end (and the fence check a sink may ask for); a
settlement that matches no row means the attempt was lost and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from django.db import Error as DjangoDBError
from django.db import connection

from dispatch import services, signals
from dispatch.connectors import columns as column_spec
from dispatch.connectors import incremental, registry
from dispatch.connectors.base import (
    SLICE_OF,
    SLICE_RANGE,
    ConnectorError,
    FenceRejected,
    LeaseLost,
    Stopped,
    copy_format,
    note_event,
    spec_errors,
)
from dispatch.core import conf, deadline
from dispatch.core.db import DB_ERRORS, one_line, storable
from dispatch.core.states import Reason, Status
from dispatch.security import crypto, targets
from dispatch.worker import claims
from dispatch.worker.claims import ClaimedAttempt
from dispatch.worker.events import EventBuffer
from dispatch.worker.log import db_error, where

log = logging.getLogger("dispatch.runner")

MAX_ERROR_CHARS = 4000
# A text value of an event's data (a server's version string, a table's name).
MAX_EVENT_VALUE_CHARS = 200


class StopCause(enum.Enum):
    CANCEL = "cancel"  # the run has a cancel request
    LEASE_LOST = "lease_lost"  # a heartbeat found the attempt no longer ours
    RELEASED = "released"  # the worker is draining and released the attempt
    TIMEOUT = "timeout"  # the job's timeout_seconds elapsed


class ExecutionControl:
    """Shared between an execution thread, the heartbeat thread and the coordinator."""

    def __init__(self, claimed: ClaimedAttempt) -> None:
        self.claimed = claimed
        self.started = time.monotonic()
        self.last_heartbeat_ok = self.started
        self.lease_seconds = claimed.lease_seconds
        self.deadline = self.started + claimed.timeout_seconds if claimed.timeout_seconds else None
        self.rows_read = 0
        self.rows_written = 0
        self.bytes_moved = 0  # COPY bytes handed to the sink (a progress event's bytes)
        # The attempt's events not yet written: the heartbeat and the settlement take them.
        self.events = EventBuffer()
        # The source's estimate of its rows, and whether a heartbeat has recorded it.
        self.rows_estimated: int | None = None
        self.estimate_recorded = False
        self.cause: StopCause | None = None
        self._event = threading.Event()
        # Called (from whichever thread stops the execution) to interrupt what the
        # execution thread is blocked in: a connector's running statement or COPY.
        self._interrupts: dict[int, Callable[[], None]] = {}
        self._interrupts_lock = threading.Lock()
        self._next_interrupt = 0
        self._interrupting = False

    def stop(self, cause: StopCause) -> None:
        first = not self._event.is_set()
        if self.cause is None:
            self.cause = cause
        self._event.set()
        if first:
            self.interrupt()

    def on_stop(self, interrupt: Callable[[], None]) -> Callable[[], None]:
        """Register `interrupt` to be called when the execution is told to stop (at once
        if it already was); returns the function that unregisters it."""
        with self._interrupts_lock:
            key = self._next_interrupt
            self._next_interrupt += 1
            self._interrupts[key] = interrupt
        if self._event.is_set():
            threading.Thread(
                target=self._call, args=(interrupt,), name="dispatch-interrupt", daemon=True
            ).start()

        def unregister() -> None:
            with self._interrupts_lock:
                self._interrupts.pop(key, None)

        return unregister

    def interrupt(self) -> None:
        """Call every registered interrupt, on a thread of its own: a cancel request to
        an unreachable server may take seconds, and the caller (the heartbeat thread, the
        main loop at shutdown) must not wait for it. The coordinator repeats this while a
        stopped execution is still running (a statement started just after one interrupt
        is interrupted by the next); a repeat while one is in flight is skipped."""
        with self._interrupts_lock:
            if self._interrupting:
                return
            interrupts = list(self._interrupts.values())
            if not interrupts:
                return
            self._interrupting = True

        def run() -> None:
            try:
                for interrupt in interrupts:
                    self._call(interrupt)
            finally:
                with self._interrupts_lock:
                    self._interrupting = False

        threading.Thread(target=run, name="dispatch-interrupt", daemon=True).start()

    @staticmethod
    def _call(interrupt: Callable[[], None]) -> None:
        try:
            interrupt()
        except Exception as exc:  # noqa: BLE001 - an interrupt is best effort
            # A connector's interrupt handles the errors it expects: this is a fault, on a
            # thread of its own that ends here.
            log.warning(
                "interrupting the running statement failed error=%s\n%s",
                type(exc).__name__,
                where(exc),
            )

    def next_deadline(self) -> float | None:
        """The monotonic time this execution times out, unless it is already stopping."""
        return None if self._event.is_set() else self.deadline

    def should_stop(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.stop(StopCause.TIMEOUT)
        return self._event.is_set()

    def heartbeat_ok(self, lease_seconds: int, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` (monotonic) extended the lease: the database
        extended it no earlier than that, so the lease is counted from the sending."""
        self.last_heartbeat_ok = max(self.last_heartbeat_ok, sent_at)
        self.lease_seconds = lease_seconds

    def lease_may_be_ours(self, after: float = 0.0) -> bool:
        """By our own clock, could the lease still be valid `after` seconds from now?"""
        return time.monotonic() + after < self.last_heartbeat_ok + self.lease_seconds

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True if told to stop meanwhile."""
        limit = seconds
        if self.deadline is not None:
            limit = min(limit, max(0.0, self.deadline - time.monotonic()))
        self._event.wait(limit)
        return self.should_stop()


class AttemptFence:
    """The attempt's identity and token, for sinks that fence (contract section 4)."""

    def __init__(self, control: ExecutionControl) -> None:
        c = control.claimed
        self.run_id = c.run_id
        self.binding_id = c.binding_id
        self.attempt_id = c.attempt_id
        self.token = c.lease_token
        self._control = control

    def check(self) -> None:
        """Raise LeaseLost unless the attempt is still RUNNING with our token, and our
        last successful heartbeat (by this worker's monotonic clock) is within the lease."""
        if not self._control.lease_may_be_ours():
            raise LeaseLost("no successful heartbeat within the lease")
        # The caller holds the sink's fence row (and the sink's locks) while it asks: the
        # question is bounded like every coordination call (dispatch.core.deadline), and an
        # answer that does not come is a lease that cannot be confirmed, so no commit.
        try:
            with deadline.bounded("fence_check"), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT 1 FROM dispatch_attempt"
                    " WHERE id = %s AND lease_token = %s AND status = 'RUNNING'",
                    [self.attempt_id, self.token],
                )
                found = cursor.fetchone() is not None
        except DjangoDBError as exc:
            with contextlib.suppress(*DB_ERRORS):
                connection.close()
            raise LeaseLost(f"the lease could not be confirmed: {db_error(exc)}") from None
        if not found:
            raise LeaseLost("the attempt is no longer this worker's")


def connected_message(claimed: ClaimedAttempt, data: dict[str, Any]) -> str:
    """A `connected` event's line: the side, its connector kind and its server's version
    (`data`: side, server_version); the kind is put into `data`."""
    side = str(data.get("side"))
    kind = claimed.source_kind if side == "source" else claimed.sink_kind
    data["connector"] = kind
    version = data.get("server_version")
    return f"connected to the {side} ({kind}" + (f", server {version})" if version else ")")


def record_event(
    control: ExecutionControl, secrets: list[str], kind: str, message: str, data: dict[str, Any]
) -> None:
    """Keep an event for the attempt's log. Its message and its data's text come from
    connectors and from servers (a version string is what the server says): sanitized as
    a stored error is, each text value cut to MAX_EVENT_VALUE_CHARS."""
    clean = {
        key: sanitize(value, secrets)[:MAX_EVENT_VALUE_CHARS] if isinstance(value, str) else value
        for key, value in data.items()
    }
    control.events.record(kind, sanitize(message, secrets), **clean)


class Context:
    """The `TransferContext` handed to connectors."""

    def __init__(self, control: ExecutionControl, secrets: list[str] | None = None) -> None:
        self.control = control
        self.fence = AttemptFence(control)
        # The binding's key for a source's `columns.hash` (read after the claim), or None.
        self.hash_key: bytes | None = None
        # What every event's message is cleaned of (the runner's list, kept up to date).
        self.secrets = secrets if secrets is not None else []
        self._progress_every = conf.event_progress_seconds()
        self._lock_wait_over = conf.event_lock_wait_seconds()
        self._progress_at = time.monotonic()
        # The sides ("source", "sink") whose connector told of its connection itself.
        self.connected: set[str] = set()

    def event(self, kind: str, message: str, **data: Any) -> None:
        """An event for the attempt's log (connectors call it through `note_event`): a
        lock wait only over DISPATCH_EVENT_LOCK_WAIT_SECONDS; the message sanitized as a
        stored error is."""
        if kind == "lock_wait":
            seconds = float(data.get("seconds") or 0.0)
            if seconds < self._lock_wait_over:
                return
            data["seconds"] = round(seconds, 3)
            message = f"waited {seconds:.1f}s for a lock: {message}"
        elif kind == "connected":
            # A connector tells when its connection opened (before its fence, say) and
            # its server's version; the runner says which side and kind it is.
            self.connected.add(str(data.get("side")))
            message = connected_message(self.control.claimed, data)
        record_event(self.control, self.secrets, kind, message, data)

    def moved(self, nbytes: int) -> None:
        """COPY bytes handed to the sink (a progress event's bytes)."""
        self.control.bytes_moved += nbytes

    def progress(self, *, rows_read: int = 0, rows_written: int = 0) -> None:
        self.control.rows_read += rows_read
        self.control.rows_written += rows_written
        now = time.monotonic()
        if now - self._progress_at >= self._progress_every:
            self._progress_at = now
            c = self.control
            self.control.events.record(
                "progress",
                f"{c.rows_read} rows read, {c.rows_written} written, {c.bytes_moved} bytes",
                rows_read=c.rows_read,
                rows_written=c.rows_written,
                bytes=c.bytes_moved,
            )
        if self.control.should_stop():
            raise Stopped(self.control.cause.value if self.control.cause else "stop")

    def estimate(self, rows: int) -> None:
        """Keep the source's estimate; the next heartbeat records it on the attempt, in
        its own transaction, with the first rows read."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            return  # a connector's mistake: no total is better than a wrong one
        self.control.rows_estimated = rows

    def should_stop(self) -> bool:
        return self.control.should_stop()

    def on_stop(self, interrupt: Callable[[], None]) -> Callable[[], None]:
        return self.control.on_stop(interrupt)

    def wait(self, seconds: float) -> None:
        if self.control.wait(seconds):
            raise Stopped(self.control.cause.value if self.control.cause else "stop")


_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
_KEY_VALUE_SECRET = re.compile(
    r"(?i)\b(password|passwd|pwd|secret|token)\s*[=:]\s*('[^']*'|\"[^\"]*\"|\S+)"
)


def sanitize(text: str, secrets: list[str]) -> str:
    """Strip secret values, URL credentials and password=... pairs from an error text, and
    escape what cannot be stored (`storable`), before cutting it to its length."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "********")
    text = _URL_CREDENTIALS.sub(r"\1********@", text)
    text = _KEY_VALUE_SECRET.sub(r"\1=********", text)
    # Escaped before the cut, so the stored text keeps its bound (an escape is longer).
    return storable(text)[:MAX_ERROR_CHARS]


def _secret_values(connector: Any, config: dict[str, Any]) -> list[str]:
    return [str(config[k]) for k in connector.secret_fields() if config.get(k)]


# Settled for good: no successor attempt is due at once, so a settlement that also
# claimed (and found nothing) leaves nothing for a refill to find.
FINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class Refill(Protocol):
    """How a runner claims the next attempt for its slot in its settlement's transaction
    (dispatch.worker.coordinator supplies it)."""

    worker_id: str

    def limit(self) -> int:
        """How many attempts to claim (0: none, e.g. the worker is stopping)."""

    def adopt(self, claimed: list[ClaimedAttempt]) -> None:
        """Start executing what the settlement claimed."""


# COPY blocks read ahead of the writer: at most this many wait in the queue, so a copy
# holds at most QUEUE_BLOCKS + 2 blocks (one being read, one being written), about
# (QUEUE_BLOCKS + 2) MiB with the PostgreSQL reader's blocks.
QUEUE_BLOCKS = 4
# How long the writer side waits for the reading thread to end after it stopped reading
# before it interrupts the read (a source still computing its first row).
PUMP_JOIN_SECONDS = 1.0


class _Failed:
    """What the reading thread hands over when the read raised."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


class CopyPump:
    """Iterate `chunks` (a source's COPY blocks) on a thread of its own, handing the blocks
    through a queue of QUEUE_BLOCKS: the source and the sink then work at the same time,
    as the two processes of `psql | psql` do (each side waits in libpq or select with the
    GIL released). An error of the read is raised here, in the consumer's thread; when the
    consumer stops early (its own error, a stop), the reading thread is told to end, the
    read is interrupted if it does not end within PUMP_JOIN_SECONDS (`interrupt`, e.g. a
    cancel request to the source), and the thread is joined before the error goes on.
    Memory stays bounded by the queue whatever the speed of either side."""

    def __init__(
        self,
        chunks: Iterator[tuple[bytes, int]],
        *,
        interrupt: Callable[[], None] | None = None,
        blocks: int = QUEUE_BLOCKS,
    ) -> None:
        self._chunks = chunks
        self._interrupt = interrupt
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=blocks)
        self._abort = threading.Event()
        self.thread = threading.Thread(target=self._read, name="dispatch-copy-read", daemon=True)

    def _put(self, item: Any) -> bool:
        """Queue `item` unless the consumer has gone; False if it has."""
        while not self._abort.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        chunks = self._chunks
        try:
            for item in chunks:
                if not self._put(item):
                    break
            else:
                self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failed(exc))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        self.thread.start()
        try:
            while True:
                item = self.queue.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
        finally:
            self._stop()

    def _stop(self) -> None:
        self._abort.set()
        self.thread.join(PUMP_JOIN_SECONDS)
        while self.thread.is_alive():
            # Still in the read (waiting on its server): interrupt it, again each second
            # (a connector escalates a cancel request that gets no answer to dropping the
            # connection).
            if self._interrupt is not None:
                self._interrupt()
            self.thread.join(PUMP_JOIN_SECONDS)


def _open_both(
    stack: contextlib.ExitStack,
    source: Any,
    sink: Any,
    source_args: tuple[dict[str, Any], dict[str, Any]],
    sink_args: tuple[dict[str, Any], dict[str, Any]],
    ctx: Context,
) -> tuple[Any, Any]:
    """Open the reader, then the writer with the reader's columns (a sink may create its
    table); both at once, the writer on a thread of its own, when the sink can be opened
    before it knows the columns (`open_before_columns`): the two connections and their
    set-up then overlap. Both end up on `stack`; an error of either is raised after both
    are open or failed (the reader's first), and what did open is closed."""
    if not getattr(sink, "open_before_columns", False):
        reader = stack.enter_context(source.open_reader(*source_args, ctx))
        writer = stack.enter_context(sink.open_writer(*sink_args, ctx, reader.columns))
        return reader, writer
    columns: list[Any] = []  # filled below, before the writer's first use
    opened: dict[str, Any] = {}

    def open_writer() -> None:
        cm = sink.open_writer(*sink_args, ctx, columns)
        try:
            opened["writer"] = cm.__enter__()
            opened["cm"] = cm
        except BaseException as exc:  # noqa: BLE001 - raised on the runner's thread below
            opened["error"] = exc

    # The site database's fingerprint (the target policy's check of each connection) is
    # read here once: the sink's thread must not open a site connection of its own.
    with targets.site_fingerprint_pinned():
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(open_writer,), name="dispatch-open-sink", daemon=True
        )
        thread.start()
        try:
            reader = stack.enter_context(source.open_reader(*source_args, ctx))
        finally:
            thread.join()
            if "cm" in opened:
                stack.push(opened["cm"])
    if "error" in opened:
        raise opened["error"]
    columns.extend(reader.columns)
    return reader, opened["writer"]


class Runner:
    """Runs one attempt to its outcome. `on_fenced` counts stale commits a sink refused."""

    def __init__(
        self,
        claimed: ClaimedAttempt,
        control: ExecutionControl,
        on_event: Callable[[str], None] = lambda name: None,
        refill: Refill | None = None,
    ) -> None:
        self.claimed = claimed
        self.control = control
        self.on_event = on_event
        self.refill = refill
        self.worker_id = refill.worker_id if refill is not None else ""
        # Whether the settlement also claimed this slot's next attempt (or found none).
        self.refilled = False
        self.secrets: list[str] = []
        self.cursor: incremental.Prepared | None = None
        # A slice run: its range and its plan (read after the claim).
        self.slice: claims.SliceOf | None = None
        # Whether the attempt's log has its error event (the settlement adds one if not).
        self._error_logged = False

    def _log(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        c = self.claimed
        log.log(
            level, message + " run=%s attempt=%s token=%s", *args, c.run_id, c.number, c.lease_token
        )

    def _record(self, kind: str, message: str, **data: Any) -> None:
        """An event for the attempt's log, its message cleaned as a stored error is."""
        record_event(self.control, self.secrets, kind, message, data)

    def _error_event(self, exc: BaseException) -> None:
        """An error for the attempt's log, with its class (the settlement's error event
        is then not repeated)."""
        self._error_logged = True
        self._record("error", f"{type(exc).__name__}: {exc}", error_class=type(exc).__name__)

    def _connected(self, ctx: Context, reader: Any, writer: Any) -> None:
        """The source's and the sink's connections are open: a `connected` event for each
        side whose connector did not log its own (a file, a generator)."""
        for side, opened in (("source", reader), ("sink", writer)):
            if side in ctx.connected:
                continue
            data: dict[str, Any] = {
                "side": side,
                "server_version": getattr(opened, "server_version", None),
            }
            self._record("connected", connected_message(self.claimed, data), **data)

    def settle(
        self, outcome: str, reason: str | None = None, error: str | None = None
    ) -> str | None:
        clean_error = sanitize(error, self.secrets) if error else None
        if clean_error and not self._error_logged:
            # An error without an exception (a bad spec, a snapshot that does not open):
            # its reason stands for the class.
            self._error_logged = True
            self.control.events.record("error", clean_error, reason=reason or outcome)
        # Taken once: a retry of the settlement sends the same events (if the first try
        # committed, the retry matches no row and writes nothing).
        events, lost = self.control.events.take(wait=conf.coordination_timeout() or 10.0)
        logged = (EventBuffer.as_json(events), lost)
        # The settlement is guarded by status + token, so repeating it after a lost
        # connection is safe: if the first one committed, the repeat matches no row. Keep
        # trying while the lease may still be ours (the execution stays registered, so the
        # heartbeat keeps extending it); after that, recovery settles the attempt.
        delay = 0.5
        retrying = False
        while True:
            try:
                # A retry settles only: if the first try committed a claim along with the
                # settlement before its answer was lost, claiming again would strand it.
                limit = self.refill.limit() if self.refill is not None and not retrying else 0
                if limit > 0 and self.refill is not None:
                    status, more = claims.settle_and_claim(
                        self.claimed.attempt_id,
                        self.claimed.lease_token,
                        outcome,
                        worker_id=self.refill.worker_id,
                        limit=limit,
                        reason=reason,
                        error=clean_error,
                        rows_read=self.control.rows_read,
                        rows_written=self.control.rows_written,
                        events=logged,
                    )
                    self.refilled = status in FINAL_STATUSES
                    if self.refilled or more:
                        self.refill.adopt(more)
                else:
                    status = claims.settle(
                        self.claimed.attempt_id,
                        self.claimed.lease_token,
                        outcome,
                        reason=reason,
                        error=clean_error,
                        rows_read=self.control.rows_read,
                        rows_written=self.control.rows_written,
                        events=logged,
                    )
                break
            except DB_ERRORS as exc:
                retrying = True
                if not self.control.lease_may_be_ours(after=delay):
                    raise
                self._log(
                    "outcome not recorded yet, retrying in %.1fs error=%s",
                    delay,
                    db_error(exc),
                    level=logging.WARNING,
                )
                with contextlib.suppress(*DB_ERRORS):
                    connection.close()
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        if status is None:
            self.on_event("lease_lost")
            self._log(
                "attempt lost before its outcome was recorded outcome=%s",
                outcome,
                level=logging.WARNING,
            )
        else:
            self.on_event(f"settled_{status.lower()}")
            # The error as the attempt stored it (secrets and URL credentials masked,
            # control characters escaped), on one line.
            self._log(
                "attempt settled status=%s reason=%s rows_read=%d rows_written=%d duration=%.3fs%s",
                status,
                reason,
                self.control.rows_read,
                self.control.rows_written,
                time.monotonic() - self.control.started,
                f" error={one_line(clean_error)}" if clean_error else "",
            )
            c = self.claimed
            signals.settled(
                run_id=c.run_id,
                attempt_id=c.attempt_id,
                attempt=c.number,
                binding_id=c.binding_id,
                status=status,
            )
            if status == Status.RETRY_SCHEDULED:
                # A successor waits for its backoff: wake the fleet, so that whichever
                # worker ranks first learns its due time (a directed claim that finds it
                # not yet due sets that worker's timer), not only this busy one.
                services.notify(self.claimed.run_id)
            elif self.slice is not None and status in FINAL_STATUSES:
                # The settlement may have started the next slice (a run this worker's
                # claim may not have taken): the parent's id wakes a worker, whose
                # directed claim misses and falls back to generic work.
                services.notify(self.slice.parent_id)
        return status

    def execute(self) -> str | None:
        c = self.claimed
        self._record(
            "claimed",
            f"claimed by worker {self.worker_id or '-'} with lease token {c.lease_token}"
            + (" (directed)" if c.directed else ""),
            worker=self.worker_id,
            token=c.lease_token,
            directed=c.directed,
        )
        signals.started(
            run_id=c.run_id,
            attempt_id=c.attempt_id,
            attempt=c.number,
            binding_id=c.binding_id,
            worker_id=self.worker_id,
        )
        try:
            source_config = crypto.decrypt_config(
                c.source_snapshot, expected_id=c.source_id, expected_version=c.source_version
            )
            sink_config = crypto.decrypt_config(
                c.sink_snapshot, expected_id=c.sink_id, expected_version=c.sink_version
            )
        except crypto.KeyUnavailable:
            return self._keys_unusable()
        except crypto.SnapshotUnreadable as exc:
            return self.settle(
                "PERMANENT", Reason.SNAPSHOT_UNREADABLE, f"snapshot unreadable: {exc}"
            )
        try:
            source = registry.get(c.source_kind)
            sink = registry.get(c.sink_kind)
        except registry.UnknownKind as exc:
            return self.settle("PERMANENT", Reason.PERMANENT_ERROR, str(exc))
        source_spec, sink_spec = c.source_spec, c.sink_spec
        if claims.is_slice_run(c.run_id):
            # A slice: the specs frozen in its plan (a job edited meanwhile does not mix
            # one run's slices), and its range.
            try:
                self.slice = claims.slice_of(c.run_id)
            except DB_ERRORS as exc:
                return self.settle(
                    "ERROR", Reason.ERROR, f"the slice's plan could not be read: {db_error(exc)}"
                )
            if self.slice is None:
                return self.settle(
                    "PERMANENT", Reason.PERMANENT_ERROR, "a slice run that no plan names"
                )
            source_spec, sink_spec = self.slice.source_spec, self.slice.sink_spec
        # A spec saved without the form's validation (from code, by an update) is checked
        # here with the same validator before anything connects: a bad one fails for good,
        # with the validator's words, instead of failing inside a connector as transient.
        problems = spec_errors(source, "source", source_spec) + spec_errors(sink, "sink", sink_spec)
        if problems:
            return self.settle(
                "PERMANENT", Reason.PERMANENT_ERROR, "invalid job spec: " + "; ".join(problems)
            )
        self.secrets = _secret_values(source, source_config) + _secret_values(sink, sink_config)
        if self.slice is None and isinstance(source_spec, dict) and source_spec.get("slices"):
            return self._plan(source, sink, source_config, source_spec, sink_spec)
        if self.slice is not None:
            sl = self.slice
            source_spec = {
                **source_spec,
                SLICE_RANGE: {"key": sl.key, "lower": sl.lower, "upper": sl.upper},
            }
            sink_spec = {
                **sink_spec,
                SLICE_OF: {"parent": str(sl.parent_id), "number": sl.number, "total": sl.total},
            }
        ctx = Context(self.control, self.secrets)
        if column_spec.hashes(source_spec):
            refused = self._load_hash_key(ctx)
            if refused is not None:
                return refused
        try:
            with contextlib.ExitStack() as stack:
                reader, writer = _open_both(
                    stack,
                    source,
                    sink,
                    (source_config, source_spec),
                    (sink_config, sink_spec),
                    ctx,
                )
                self._connected(ctx, reader, writer)
                self.cursor = incremental.prepare(reader, writer)
                if self.cursor is not None:
                    self._record_cursor(self.cursor)
                self._transfer(ctx, reader, writer)
                # A run whose data is already committed succeeds whatever else is asked;
                # otherwise a stop requested meanwhile wins over committing now.
                if not getattr(writer, "already_committed", False) and self.control.should_stop():
                    raise Stopped("stop before commit")
                result = writer.commit()
        except FenceRejected as exc:
            self._error_event(exc)
            self.on_event("fenced_commits")
            # What a log line quotes of a connector's error is escaped (`one_line`): a
            # source or sink must not be able to write log lines of its own.
            self._log(
                "stale commit refused by the sink fence: %s", one_line(exc), level=logging.WARNING
            )
            return None
        except (Stopped, LeaseLost) as exc:
            return self._stopped(exc)
        except ConnectorError as exc:
            return self._connector_failed(exc)
        except Exception as exc:  # noqa: BLE001 - any failure of a connector is the attempt's
            # Not a ConnectorError: a fault of a connector (or of this code). The attempt
            # records it; the worker log keeps its message, sanitized as the attempt's
            # error is (secrets masked), and where it was raised.
            self._error_event(exc)
            log.warning(
                "attempt error %s: %s run=%s attempt=%s token=%s\n%s",
                type(exc).__name__,
                one_line(sanitize(str(exc), self.secrets)),
                c.run_id,
                c.number,
                c.lease_token,
                where(exc),
            )
            if self.control.cause is not None:
                return self._stopped(exc)
            return self.settle("ERROR", Reason.ERROR, f"{type(exc).__name__}: {exc}")
        self.control.rows_written = max(self.control.rows_written, result.rows_written)
        self._record(
            "committed",
            "already committed by an earlier attempt"
            if result.already_committed
            else f"the sink committed {result.rows_written} rows",
            rows_written=result.rows_written,
            already_committed=bool(result.already_committed),
        )
        if getattr(reader, "rows_counted_by_sink", False):
            # The source passed its bytes through uncounted (a CSV file): its rows are
            # the ones the sink parsed.
            self.control.rows_read = result.rows_written
        committed = getattr(writer, "cursor_committed", None)
        if committed is not None:
            self._copy_cursor(committed)
        receipt = getattr(writer, "receipt_committed", None)
        if receipt is not None:
            self._record_receipt(*receipt)
        changes = getattr(writer, "schema_changes", None)
        if changes and not result.already_committed:
            self._record_schema_changes(list(changes))
        return self.settle(
            "SUCCEEDED", Reason.ALREADY_COMMITTED if result.already_committed else None
        )

    def _keys_unusable(self) -> str | None:
        """This worker's keys are wrong: the run is not at fault. Hand the attempt back (a
        release consumes no retry budget) and tell the coordinator to stop."""
        self.on_event("keys_unusable")
        self._log(
            "no configured key opens the snapshot; releasing the attempt and stopping "
            "(check DISPATCH_ENCRYPTION_KEYS)",
            level=logging.ERROR,
        )
        return self.settle(
            "RELEASE",
            Reason.SHUTDOWN_RELEASED,
            "released: the worker's keys (DISPATCH_ENCRYPTION_KEYS) open no snapshot",
        )

    def _load_hash_key(self, ctx: Context) -> str | None:
        """The binding's hash key for `columns.hash`, onto `ctx`, read while the attempt is
        still ours; the settlement when it cannot be (None: loaded). The key joins the
        secrets every error text is cleaned of."""
        c = self.claimed
        try:
            found = claims.binding_hash_key(c.attempt_id, c.lease_token)
        except DB_ERRORS as exc:
            return self.settle(
                "ERROR", Reason.ERROR, f"the binding's hash key could not be read: {db_error(exc)}"
            )
        if found is None:
            return self._stopped(LeaseLost("the attempt is no longer this worker's"))
        ciphertext, binding_id = found
        if not ciphertext:
            return self.settle(
                "PERMANENT",
                Reason.PERMANENT_ERROR,
                "columns.hash needs the binding's hash key: set one on the binding",
            )
        try:
            key = crypto.decrypt_binding_secret(ciphertext, expected_id=binding_id, name="hash_key")
        except crypto.KeyUnavailable:
            return self._keys_unusable()
        except crypto.SnapshotUnreadable as exc:
            return self.settle(
                "PERMANENT", Reason.SNAPSHOT_UNREADABLE, f"the binding's hash key: {exc}"
            )
        self.secrets.append(key)
        ctx.hash_key = key.encode("utf-8")
        return None

    def _plan(
        self,
        source: Any,
        sink: Any,
        source_config: dict[str, Any],
        source_spec: dict[str, Any],
        sink_spec: dict[str, Any],
    ) -> str | None:
        """A sliced run's first attempt: compute the ranges on the source, then record the
        plan and start the first slices in one guarded transaction
        (`claims.plan_slices`); the run waits on its slices from there."""
        c = self.claimed
        planner = getattr(source, "plan_slices", None)
        if planner is None:
            return self.settle(
                "PERMANENT", Reason.PERMANENT_ERROR, f"a {c.source_kind} source cannot be sliced"
            )
        if not getattr(sink, "sliced_writes", False):
            return self.settle(
                "PERMANENT",
                Reason.PERMANENT_ERROR,
                f"a {c.sink_kind} sink cannot take a sliced source",
            )
        ctx = Context(self.control, self.secrets)
        try:
            plan = planner(source_config, source_spec, ctx)
            if self.control.should_stop():
                raise Stopped("stop before the plan is recorded")
        except (Stopped, LeaseLost) as exc:
            return self._stopped(exc)
        except ConnectorError as exc:
            return self._connector_failed(exc)
        try:
            status, started = claims.plan_slices(
                c.attempt_id,
                c.lease_token,
                key=plan.key,
                key_type=plan.key_type,
                method=plan.method,
                basis=plan.basis,
                bounds=plan.bounds,
                source_spec=source_spec,
                sink_spec=sink_spec,
            )
        except DB_ERRORS as exc:
            # Not recorded, or recorded with its answer lost: the guarded settlement
            # tells which (it matches nothing if the plan committed).
            return self.settle(
                "ERROR", Reason.ERROR, f"the slice plan could not be recorded: {db_error(exc)}"
            )
        if status is None:
            self.on_event("lease_lost")
            self._log("attempt lost before its slice plan was recorded", level=logging.WARNING)
            return None
        self.on_event("slices_planned" if status == Status.WAITING else f"settled_{status.lower()}")
        self._log(
            "sliced run planned status=%s slices=%d started=%d key=%s basis=%s",
            status,
            len(plan.bounds),
            len(started),
            plan.key,
            one_line(plan.basis),
        )
        signals.settled(
            run_id=c.run_id,
            attempt_id=c.attempt_id,
            attempt=c.number,
            binding_id=c.binding_id,
            status=Status.SUCCEEDED if status == Status.WAITING else status,
            final_for_run=status != Status.WAITING,
        )
        services.notify_many(started)
        return status

    def _record_cursor(self, prepared: incremental.Prepared) -> None:
        """The attempt's cursors on its row, and the sink's committed cursor as this
        attempt found it into the console's copy. Neither decides anything (the sink's
        own row does), so a failure here is logged and the transfer goes on."""
        c = self.claimed
        end = prepared.bounds.cursor if prepared.bounds is not None else prepared.start
        try:
            claims.record_cursor(c.attempt_id, c.lease_token, prepared.start, end)
            if prepared.committed.version > 0:
                self._copy_cursor(prepared.committed)
        except DB_ERRORS as exc:
            self._log("cursor not recorded: %s", type(exc).__name__, level=logging.WARNING)

    def _record_receipt(self, rows: int, digest: str | None) -> None:
        """The sink's receipt on the attempt's row, for the console. The sink's own
        receipt is what verification reads, so a failure here is logged and the
        settlement goes on."""
        c = self.claimed
        try:
            claims.record_receipt(c.attempt_id, c.lease_token, rows, digest)
        except DB_ERRORS as exc:
            self._log("receipt not recorded: %s", type(exc).__name__, level=logging.WARNING)

    def _record_schema_changes(self, changes: list[dict[str, Any]]) -> None:
        """The schema changes the sink committed with the rows, on the attempt's row (the
        console shows them, the health scan alerts on them). The sink's table is the
        truth, so a failure here is logged and the settlement goes on."""
        c = self.claimed
        self._log("sink schema changed changes=%s", one_line(json.dumps(changes)))
        try:
            claims.record_schema_changes(c.attempt_id, c.lease_token, changes)
        except DB_ERRORS as exc:
            self._log("schema changes not recorded: %s", type(exc).__name__, level=logging.WARNING)

    def _copy_cursor(self, committed: incremental.CommittedCursor) -> None:
        try:
            services.record_cursor_copy(
                self.claimed.binding_id,
                committed,
                changed_by=f"run {committed.run_id}" if committed.run_id else "",
            )
        except DB_ERRORS as exc:
            self._log("cursor copy not recorded: %s", type(exc).__name__, level=logging.WARNING)

    @staticmethod
    def _transfer(ctx: Context, reader: Any, writer: Any) -> None:
        """Move every row: raw COPY blocks when both sides speak PostgreSQL COPY, else
        decoded batches. Progress (and so the stop check) follows each block or batch."""
        if getattr(writer, "already_committed", False):
            return  # the run's data is already in the sink: nothing to read
        fmt = copy_format(reader, writer)
        # A test's or a tool's context may take no events and count no bytes.
        note_event(
            ctx,
            "read_started",
            "the read began" + (f" (COPY {fmt})" if fmt is not None else " (batches)"),
            copy=fmt,
        )
        moved = getattr(ctx, "moved", None)
        if fmt is not None:
            options = getattr(writer, "copy_options", None)
            chunks = (
                reader.copy_chunks(fmt) if options is None else reader.copy_chunks(fmt, options)
            )
            for data, rows in CopyPump(chunks, interrupt=getattr(reader, "interrupt", None)):
                if moved is not None:
                    moved(len(data))
                ctx.progress(rows_read=rows)
                ctx.progress(rows_written=writer.write_copy(data, rows))
            return
        if getattr(writer, "json_text", False) and hasattr(reader, "json_text"):
            reader.json_text = True
        for batch in reader.batches():
            ctx.progress(rows_read=len(batch))
            ctx.progress(rows_written=writer.write(batch))

    def _connector_failed(self, exc: ConnectorError) -> str | None:
        """A connector's error ends the attempt: a stop asked meanwhile wins (the error is
        its consequence); else a permanent error fails it, another one is retried."""
        self._error_event(exc)
        if self.control.cause is not None:
            return self._stopped(exc)
        outcome, reason = (
            ("PERMANENT", Reason.PERMANENT_ERROR) if exc.permanent else ("ERROR", Reason.ERROR)
        )
        return self.settle(outcome, reason, str(exc))

    def _stopped(self, exc: BaseException) -> str | None:
        cause = self.control.cause
        if cause is StopCause.CANCEL:
            return self.settle("CANCELLED", Reason.CANCELLED_BY_OPERATOR)
        if cause is StopCause.TIMEOUT:
            return self.settle(
                "ERROR", Reason.TIMEOUT, f"timed out after {self.claimed.timeout_seconds}s"
            )
        # LEASE_LOST or RELEASED (or a sink that found the lease lost): the attempt is no
        # longer ours; record nothing.
        self.on_event("lease_lost" if cause is not StopCause.RELEASED else "released_stopped")
        self._log(
            "attempt stopped without recording cause=%s detail=%s",
            cause.value if cause else "lease_lost",
            one_line(exc),
            level=logging.WARNING,
        )
        return None
