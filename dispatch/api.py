"""The Python API for host code: trigger runs, cancel, retry, and wait for them.

A thin, typed layer over `dispatch.services` (the functions the admin and the management
commands call): the same transactions, locks and wake-ups. A binding is given as the
instance, its primary key or its name; a run as the instance or its id. Mistakes raise
`DispatchError`s that say what is wrong; nothing is changed then. The signals a host
site may connect to are in `dispatch.signals`. docs/api.md has the details.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import DurationField, ExpressionWrapper, F
from django.db.models.functions import Coalesce, Now

from dispatch import services
from dispatch.core.progress import Progress
from dispatch.core.states import TERMINAL_RUN_STATUSES, Status, Trigger
from dispatch.models import Attempt, JobBinding, Run
from dispatch.services import Outcome

__all__ = [
    "ActionRefused",
    "BindingRef",
    "DispatchError",
    "IdempotencyConflict",
    "NotFound",
    "Outcome",
    "RunRef",
    "RunResult",
    "WaitTimeout",
    "cancel",
    "result",
    "retry",
    "trigger",
    "trigger_many",
    "wait",
]

BindingRef = JobBinding | uuid.UUID | str
RunRef = Run | uuid.UUID | str

# The longest idempotency key a run stores (Run.idempotency_key).
MAX_KEY_LENGTH = 200


class DispatchError(Exception):
    """Every error the API raises for a mistake of its caller or a refused action."""


class NotFound(DispatchError, LookupError):
    """No binding, or no run, by that reference."""


class IdempotencyConflict(DispatchError):
    """The idempotency key already names a run of another binding (keys are unique across
    all runs): nothing was created."""

    def __init__(self, key: str, run: Run) -> None:
        super().__init__(
            f"idempotency key {key!r} already names run {run.pk} of another binding "
            f"({run.binding_id}); keys are unique across all bindings"
        )
        self.key = key
        self.run = run


class ActionRefused(DispatchError):
    """The action does not apply to the run's state (`code`: ALREADY_FINISHED,
    CANCEL_ALREADY_REQUESTED, NOT_RETRYABLE); nothing was changed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WaitTimeout(DispatchError, TimeoutError):
    """`wait` gave up before the run finished; `result` is the run as last seen."""

    def __init__(self, result: RunResult, timeout: float) -> None:
        super().__init__(f"run {result.run_id} is still {result.status} after {timeout:g} s")
        self.result = result
        self.timeout = timeout


@dataclass(frozen=True)
class RunResult:
    """A run as it stands: its status and its latest attempt's reason, error and rows.
    Durations are in database time."""

    run_id: uuid.UUID
    binding: str
    status: str
    # Attempts so far (retries and releases included).
    attempts: int
    # The latest attempt's reason code and error text (stored sanitized), if any.
    reason: str | None
    error: str
    created_at: datetime
    finished_at: datetime | None
    # From the trigger to the end (to the database's now while the run is live).
    duration_seconds: float
    # The latest attempt's rows, estimate, rate and time left.
    progress: Progress = field(default_factory=Progress)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES

    @property
    def succeeded(self) -> bool:
        return self.status == Status.SUCCEEDED

    @property
    def rows_read(self) -> int:
        return self.progress.rows_read

    @property
    def rows_written(self) -> int:
        return self.progress.rows_written

    @property
    def error_line(self) -> str:
        """The error's first non-empty line ("" without an error)."""
        return next((line.strip() for line in self.error.splitlines() if line.strip()), "")


# --- references -------------------------------------------------------------------------
def _as_uuid(value: Any) -> uuid.UUID | None:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _binding(ref: BindingRef) -> JobBinding:
    if isinstance(ref, JobBinding):
        return ref
    if not isinstance(ref, uuid.UUID | str):
        raise TypeError(f"a binding is a JobBinding, its id or its name, not {type(ref).__name__}")
    as_id = _as_uuid(ref)
    found = JobBinding.objects.filter(pk=as_id).first() if as_id is not None else None
    if found is None and isinstance(ref, str):
        found = JobBinding.objects.filter(name=ref).first()
    if found is None:
        raise NotFound(f"no binding with id or name {str(ref)!r}")
    return found


def _run_id(ref: RunRef) -> uuid.UUID:
    if isinstance(ref, Run):
        return ref.pk
    if not isinstance(ref, uuid.UUID | str):
        raise TypeError(f"a run is a Run or its id, not {type(ref).__name__}")
    as_id = _as_uuid(ref)
    if as_id is None:
        raise NotFound(f"{ref!r} is not a run id (a UUID)")
    return as_id


def _check_key(key: str | None) -> None:
    if key is None:
        return
    if not isinstance(key, str) or not key:
        raise ValueError("an idempotency key is a non-empty string (or None for none)")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"an idempotency key has at most {MAX_KEY_LENGTH} characters, not {len(key)}"
        )


# --- actions ---------------------------------------------------------------------------
def trigger(
    binding: BindingRef, *, idempotency_key: str | None = None, requested_by: Any = None
) -> Run:
    """Create a run of `binding` (trigger `API`), commit it and wake a worker; inside an
    outer `atomic` the run is part of that transaction and the wake-up waits for its
    commit. With an `idempotency_key` that already names a run of this binding, that run
    is returned and nothing is created (whatever its status); one of another binding
    raises `IdempotencyConflict`. `requested_by` is a user or a text, shown in the
    console."""
    (run,) = trigger_many(
        [binding],
        idempotency_keys=None if idempotency_key is None else [idempotency_key],
        requested_by=requested_by,
    )
    return run


def trigger_many(
    bindings: Sequence[BindingRef],
    *,
    idempotency_keys: Sequence[str | None] | None = None,
    requested_by: Any = None,
) -> list[Run]:
    """`trigger` for several runs in one statement and one transaction, in the order
    given (the result pairs up with `bindings`; `idempotency_keys`, when given, too).
    Nothing is created if a binding is unknown or a key already names another binding's
    run (checked first; a key another binding takes at the same moment raises
    `IdempotencyConflict` once the other runs of the call are created)."""
    if isinstance(bindings, str | JobBinding | uuid.UUID):
        raise TypeError("bindings is a sequence of bindings (use trigger() for one)")
    if idempotency_keys is not None:
        if len(idempotency_keys) != len(bindings):
            raise ValueError(
                f"idempotency_keys has {len(idempotency_keys)} items for {len(bindings)} bindings"
            )
        for key in idempotency_keys:
            _check_key(key)
    resolved = [_binding(b) for b in bindings]
    if idempotency_keys is not None:
        _refuse_foreign_keys(resolved, idempotency_keys)
    runs = services.trigger_many(
        resolved,
        trigger=Trigger.API,
        idempotency_keys=idempotency_keys,
        requested_by=requested_by,
    )
    if idempotency_keys is not None:
        # A key first used by another binding between the check above and the trigger.
        for binding, key, run in zip(resolved, idempotency_keys, runs, strict=True):
            if key is not None and run.binding_id != binding.pk:
                raise IdempotencyConflict(key, run)
    return runs


def _refuse_foreign_keys(bindings: list[JobBinding], keys: Sequence[str | None]) -> None:
    """Refuse, before anything is created, keys that already name another binding's run."""
    wanted = {key: b.pk for b, key in zip(bindings, keys, strict=True) if key is not None}
    if not wanted:
        return
    for run in Run.objects.filter(idempotency_key__in=list(wanted)):
        key = run.idempotency_key or ""
        if run.binding_id != wanted[key]:
            raise IdempotencyConflict(key, run)


def cancel(run: RunRef, *, by: Any = None) -> Outcome:
    """Cancel a run: a PENDING one at once (`Outcome.CANCELLED`), a RUNNING one at its
    worker's next heartbeat (`Outcome.CANCEL_REQUESTED`; `wait` sees it end)."""
    run_id = _run_id(run)
    try:
        return services.cancel_run(run_id, by=by)
    except Run.DoesNotExist:
        raise NotFound(f"no run {run_id}") from None
    except services.ActionRefused as exc:
        raise ActionRefused(exc.code, exc.message) from None


def retry(run: RunRef, *, by: Any = None) -> Outcome:
    """Give a FAILED or CANCELLED run a new attempt with a fresh retry budget
    (`Outcome.RETRIED`)."""
    run_id = _run_id(run)
    try:
        return services.retry_run(run_id, by=by)
    except Run.DoesNotExist:
        raise NotFound(f"no run {run_id}") from None
    except services.ActionRefused as exc:
        raise ActionRefused(exc.code, exc.message) from None


# --- reading and waiting ---------------------------------------------------------------
def result(run: RunRef) -> RunResult:
    """The run as it stands now (two indexed reads)."""
    run_id = _run_id(run)
    row = (
        Run.objects.filter(pk=run_id)
        .annotate(
            # Database time: a live run's duration runs on the server's clock.
            elapsed=ExpressionWrapper(
                Coalesce(F("finished_at"), Now()) - F("created_at"),
                output_field=DurationField(),
            )
        )
        .values("status", "created_at", "finished_at", "elapsed", "binding__name")
        .first()
    )
    if row is None:
        raise NotFound(f"no run {run_id}")
    latest = (
        Attempt.objects.filter(run_id=run_id)
        .only(
            "number",
            "status",
            "reason",
            "error",
            "rows_read",
            "rows_written",
            "rows_estimated",
            "claimed_at",
            "heartbeat_at",
            "finished_at",
        )
        .order_by("-number")
        .first()
    )
    return RunResult(
        run_id=run_id,
        binding=row["binding__name"],
        status=row["status"],
        attempts=latest.number if latest is not None else 0,
        reason=latest.reason if latest is not None else None,
        error=latest.error if latest is not None else "",
        created_at=row["created_at"],
        finished_at=row["finished_at"],
        duration_seconds=max(0.0, row["elapsed"].total_seconds()),
        progress=Progress.of(latest) if latest is not None else Progress(),
    )


def wait(
    run: RunRef,
    *,
    timeout: float | None = None,
    poll_interval: float = 1.0,
    on_progress: Callable[[RunResult], None] | None = None,
) -> RunResult:
    """Wait until the run has finished (SUCCEEDED, FAILED or CANCELLED) and return it.

    Reads the run's row, first after 0.1 s and backing off to `poll_interval` seconds
    between reads: a wait costs one short read per interval, never a busy loop and never a
    lock. `on_progress` is called with each read of the unfinished run. After `timeout`
    seconds (None: no limit) raises `WaitTimeout`, which carries the run as last seen.
    Wait after the transaction that created the run has committed: until then no worker
    can see it."""
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be at least 0 seconds, not {timeout}")
    if poll_interval <= 0:
        raise ValueError(f"poll_interval must be positive, not {poll_interval}")
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = min(0.1, poll_interval)
    while True:
        current = result(run)
        if current.finished:
            return current
        if on_progress is not None:
            on_progress(current)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise WaitTimeout(current, timeout or 0.0)
        pause = delay if deadline is None else min(delay, deadline - now)
        time.sleep(max(0.0, pause))
        delay = min(poll_interval, delay * 2)
