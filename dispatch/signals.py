"""Signals for host code: a run started, an attempt finished, a run finished.

Each is sent once the transaction that made the change has committed, so a receiver
reads the committed rows, and in the process that made the change: a worker (claims,
settlements, releases at shutdown, recovery passes), `manage.py recover`, or the process of
an operator's action (the site, `manage.py cancel`). A host site that listens connects its
receivers where every such process loads them (an `AppConfig.ready()`). A receiver that
raises is logged and the sender goes on: it never breaks a worker. Receivers run on the
thread that made the change (a worker's executor or main thread): keep them short, and
hand long work elsewhere (a run of its own, a queue). See docs/api.md.

Arguments (all keyword):

- `run_started`: sender `Run`; `run_id`, `attempt_id`, `attempt` (its number),
  `binding_id`, `worker_id`.
- `attempt_finished`: sender `Attempt`; `run_id`, `attempt_id`, `attempt`, `binding_id`,
  `status` (the attempt's: SUCCEEDED, FAILED, CANCELLED or RETRY_SCHEDULED).
- `run_finished`: sender `Run`; the same arguments, `status` the run's final one
  (SUCCEEDED, FAILED or CANCELLED), sent after the `attempt_finished` of its last attempt.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

from django.db import transaction
from django.dispatch import Signal

from dispatch.core.db import DB_ERRORS, one_line, storable
from dispatch.core.states import TERMINAL_RUN_STATUSES
from dispatch.models import Attempt, Run

log = logging.getLogger("dispatch.signals")

run_started = Signal()
attempt_finished = Signal()
run_finished = Signal()

_SIGNALS = {
    "run_started": run_started,
    "attempt_finished": attempt_finished,
    "run_finished": run_finished,
}


def _send(name: str, sender: type, kwargs: dict[str, Any]) -> None:
    """Send to every receiver; log each that raised, with where it raised and its message
    escaped onto one line (a receiver's text is the host's, not ours to trust)."""
    for receiver, result in _SIGNALS[name].send_robust(sender, **kwargs):
        if isinstance(result, BaseException):
            frames = "".join(traceback.format_tb(result.__traceback__))
            log.error(
                "signal receiver failed signal=%s receiver=%s run=%s error=%s: %s\n"
                "Traceback (most recent call last):\n%s%s",
                name,
                getattr(receiver, "__qualname__", repr(receiver)),
                kwargs.get("run_id"),
                type(result).__name__,
                storable(one_line(result)),
                frames,
                type(result).__qualname__,
            )


def _after_commit(name: str, sender: type, **kwargs: Any) -> None:
    """Send once the current transaction commits (at once in autocommit), not at all if
    it rolls back; nothing is prepared when no receiver is connected."""
    if _SIGNALS[name].has_listeners(sender):
        transaction.on_commit(lambda: _send(name, sender, kwargs))


def started(
    *, run_id: uuid.UUID, attempt_id: uuid.UUID, attempt: int, binding_id: uuid.UUID, worker_id: str
) -> None:
    """A worker claimed the run's attempt and starts executing it."""
    _after_commit(
        "run_started",
        Run,
        run_id=run_id,
        attempt_id=attempt_id,
        attempt=attempt,
        binding_id=binding_id,
        worker_id=worker_id,
    )


def settled(
    *,
    run_id: uuid.UUID,
    attempt_id: uuid.UUID,
    attempt: int,
    binding_id: uuid.UUID,
    status: str,
    final_for_run: bool = True,
) -> None:
    """An attempt reached `status`: `attempt_finished`, then `run_finished` when that
    status is final for the run (a RETRY_SCHEDULED attempt has a successor; a sliced
    run's planning attempt, `final_for_run=False`, leaves its run WAITING)."""
    kwargs: dict[str, Any] = {
        "run_id": run_id,
        "attempt_id": attempt_id,
        "attempt": attempt,
        "binding_id": binding_id,
        "status": status,
    }
    _after_commit("attempt_finished", Attempt, **kwargs)
    if final_for_run and status in TERMINAL_RUN_STATUSES:
        _after_commit("run_finished", Run, **kwargs)


def listening() -> bool:
    """Whether any receiver waits for a finish (callers that must look up arguments first
    skip that work when none does)."""
    return attempt_finished.has_listeners(Attempt) or run_finished.has_listeners(Run)


def settled_many(rows: Sequence[tuple[uuid.UUID, uuid.UUID, int, str]]) -> None:
    """`settled` for (attempt id, run id, number, status) rows whose bindings the caller
    does not have (a recovery pass): they are read once the rows are committed."""
    if not rows or not listening():
        return

    def send() -> None:
        try:
            bindings = dict(
                Run.objects.filter(pk__in=[r[1] for r in rows]).values_list("id", "binding_id")
            )
        except DB_ERRORS as exc:  # the settlements stand; only their signals are lost
            log.error("signals of %d settled attempts not sent error=%s", len(rows), one_line(exc))
            return
        for attempt_id, run_id, number, status in rows:
            if run_id in bindings:  # a run pruned meanwhile has no one left to tell
                settled(
                    run_id=run_id,
                    attempt_id=attempt_id,
                    attempt=number,
                    binding_id=bindings[run_id],
                    status=status,
                )

    transaction.on_commit(send)
