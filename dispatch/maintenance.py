"""The maintenance loop every worker runs in a background thread (`runworker`, unless
`DISPATCH_MAINTENANCE` is off): retention at a low rate, the health scan (alerts and
auto-disable) and the alert outbox's drain.

No leader: each task is idempotent and gated by a conditional update on
`dispatch_opsstate` (see `dispatch.retention.begin_pass`), so with any number of workers
each task runs about once per interval. Nothing here runs on the worker's claim or
execution path; a failure is logged and retried on the next tick.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from django.db import connection

from dispatch import conf, retention

log = logging.getLogger("dispatch.maintenance")


def tick_seconds() -> float:
    """How often the loop looks: a fifth of the retention interval, between 1 s and 60 s,
    so an idle worker spends one transaction a minute here at the defaults."""
    return min(60.0, max(1.0, conf.retention_interval() / 5))


# Tasks of one tick, in order. Each is called with no argument and gates itself.
TASKS: list[tuple[str, Callable[[], object]]] = [
    ("retention", retention.maybe_prune),
]


def run_once() -> dict[str, object]:
    """One tick: every task once. Returns what each did (None: not its turn)."""
    done: dict[str, object] = {}
    for name, task in TASKS:
        try:
            done[name] = task()
        except Exception as exc:  # noqa: BLE001 - one task's failure never stops the others
            log.warning("maintenance task failed task=%s error=%s", name, exc)
            done[name] = exc
            with contextlib.suppress(Exception):
                connection.close()  # a broken connection is rebuilt on the next tick
    return done


def run_loop(stop_event: threading.Event) -> None:
    """Entry point of the worker's maintenance thread."""
    try:
        while not stop_event.wait(tick_seconds()):
            run_once()
    finally:
        connection.close()
