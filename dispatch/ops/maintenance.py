"""The maintenance loop every worker runs in a background thread (`runworker`, unless
`DISPATCH_MAINTENANCE` is off): retention at a low rate, the health scan (alerts and
auto-disable), the alert outbox's drain and the batches of bulk operations.

No leader: each task is idempotent and gated by a conditional update on
`dispatch_opsstate` (see `dispatch.ops.retention.begin_pass`), so with any number of workers
each task runs about once per interval. Nothing here runs on the worker's claim or
execution path; a failure is logged and retried on the next tick.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from django.db import connection

from dispatch.core import conf
from dispatch.core.db import DB_ERRORS
from dispatch.ops import bulk, retention
from dispatch.worker.log import db_error

log = logging.getLogger("dispatch.maintenance")


def tick_seconds() -> float:
    """How often the loop looks at its tasks' local timers (no database work)."""
    return 1.0


def _health() -> object:
    from dispatch.ops import alerts

    return alerts.maybe_scan_and_drain()


def _gated(interval: Callable[[], float]) -> Callable[[object], float]:
    """A gated task's next look: half its interval when it was not its turn, a whole one
    when it ran (or failed)."""
    return lambda result: interval() * (0.5 if result is None else 1.0)


def _bulk_next(result: object) -> float:
    """Bulk batches: at the next tick after a tick that worked some (more may wait), else
    after DISPATCH_BULK_INTERVAL (an idle worker's look is one transaction that often)."""
    return tick_seconds() if isinstance(result, int) else conf.bulk_interval()


# Tasks: (name, call, seconds to the next look given what the call returned). A call
# gates itself across workers (a conditional update on dispatch_opsstate; None: another
# worker ran it within its interval). Locally, a worker tries a task again after half its
# interval when it was not its turn, and after a whole interval when it ran it: about two
# transactions per interval and task per worker, whatever the tick. Bulk operations are
# gated by a row lock instead (FOR UPDATE SKIP LOCKED on the operation): each worker works
# a different operation, or none.
TASKS: list[tuple[str, Callable[[], object], Callable[[object], float]]] = [
    ("retention", retention.maybe_prune, _gated(conf.retention_interval)),
    ("health", _health, _gated(conf.health_interval)),
    ("bulk", bulk.work, _bulk_next),
]


def run_once(now: float | None = None, due: dict[str, float] | None = None) -> dict[str, object]:
    """One tick: every task whose local timer in `due` has come (all of them without
    `due`). Returns what each did (None: not its turn; absent: not tried)."""
    now = time.monotonic() if now is None else now
    done: dict[str, object] = {}
    for name, task, next_look in TASKS:
        if due is not None and due.get(name, 0.0) > now:
            continue
        try:
            done[name] = result = task()
        except Exception as exc:  # noqa: BLE001 - the loop's boundary: one task never stops the others
            if isinstance(exc, DB_ERRORS):
                log.warning("maintenance task failed task=%s error=%s", name, db_error(exc))
            else:  # a bug: the traceback says where
                log.error("maintenance task failed task=%s", name, exc_info=True)
            done[name] = result = exc
            with contextlib.suppress(*DB_ERRORS):
                connection.close()  # a broken connection is rebuilt on the next tick
        if due is not None:
            due[name] = now + next_look(result)
    return done


def run_loop(stop_event: threading.Event) -> None:
    """Entry point of the worker's maintenance thread."""
    due: dict[str, float] = {}
    try:
        while not stop_event.wait(tick_seconds()):
            run_once(due=due)
    finally:
        connection.close()
