"""States, origins and reason codes: the one module that owns the transition table.

Who moves an attempt in and out of each state is written on the member. A run's status
is always its latest attempt's status, written in the same transaction (the SQL
functions in `dispatch/sql/` and `dispatch.services` do both together).
"""

from __future__ import annotations

from django.db import models


class Status(models.TextChoices):
    # In: trigger, operator retry, automatic retry, release successor.
    # Out: claim (-> RUNNING), operator cancel (-> CANCELLED).
    PENDING = "PENDING", "Pending"
    # In: claim. Out: the worker's outcome, recovery at lease expiry, release.
    RUNNING = "RUNNING", "Running"
    # In: the worker's successful outcome (or ALREADY_COMMITTED). Terminal.
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    # In: worker error or expired lease with no retry left, permanent error. Terminal for
    # the attempt; an operator retry adds a new attempt to the run.
    FAILED = "FAILED", "Failed"
    # In: operator cancel of a pending run, a running one that saw its cancel request,
    # recovery of an expired lease with a cancel request. Terminal for the attempt.
    CANCELLED = "CANCELLED", "Cancelled"
    # In: worker error or expired lease with retry budget left, release. Terminal for the
    # attempt: its successor is the new PENDING attempt created in the same transaction.
    RETRY_SCHEDULED = "RETRY_SCHEDULED", "Retry scheduled"
    # A run's status only, never an attempt's: a sliced run whose slices are being
    # copied (docs/architecture.md, "Slices"). In: the planning attempt's settlement
    # (dispatch_slices_plan_v1), an operator retry of a FAILED or CANCELLED sliced run.
    # Out: the settlement of its slices (SUCCEEDED when all committed, FAILED when one
    # failed, CANCELLED after an operator's cancel). Not RUNNING: it holds no capacity.
    WAITING = "WAITING", "Waiting on slices"


LIVE_STATUSES = (Status.PENDING, Status.RUNNING)
# Run statuses of a run that is not finished (a sliced run WAITING on its slices too).
UNFINISHED_RUN_STATUSES = (Status.PENDING, Status.RUNNING, Status.WAITING)
TERMINAL_RUN_STATUSES = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
# Run statuses from which an operator retry is legal.
RETRYABLE_RUN_STATUSES = (Status.FAILED, Status.CANCELLED)

# attempt status -> statuses it may move to (RETRY_SCHEDULED is never a run's status for
# long: its successor attempt is PENDING in the same transaction).
TRANSITIONS: dict[str, frozenset[str]] = {
    Status.PENDING: frozenset({Status.RUNNING, Status.CANCELLED}),
    Status.RUNNING: frozenset(
        {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.RETRY_SCHEDULED}
    ),
    Status.SUCCEEDED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
    Status.RETRY_SCHEDULED: frozenset(),
    # Never an attempt's status (a check constraint refuses it on an attempt).
    Status.WAITING: frozenset(),
}

# A sliced run's own moves (its status is its slices' combined state once planned):
# RUNNING (the planning attempt) -> WAITING -> SUCCEEDED | FAILED | CANCELLED, and an
# operator retry FAILED | CANCELLED -> WAITING.
SLICED_RUN_TRANSITIONS: dict[str, frozenset[str]] = {
    Status.RUNNING: frozenset({Status.WAITING}),
    Status.WAITING: frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}),
    Status.FAILED: frozenset({Status.WAITING}),
    Status.CANCELLED: frozenset({Status.WAITING}),
}


class Trigger(models.TextChoices):
    MANUAL = "MANUAL", "Manual"  # an operator (admin action or `manage.py trigger`)
    SCHEDULE = "SCHEDULE", "Schedule"  # a schedule slot fired by the reconciler
    API = "API", "API"  # a program calling dispatch.services.trigger


class Origin(models.TextChoices):
    TRIGGER = "TRIGGER", "Trigger"  # attempt 1; opens a retry budget
    RETRY = "RETRY", "Automatic retry"  # after an error or an expired lease
    OPERATOR = "OPERATOR", "Operator retry"  # opens a fresh retry budget
    RELEASE = "RELEASE", "Release successor"  # outside the retry budget


class Reason(models.TextChoices):
    """Why an attempt ended the way it did (`Attempt.reason`). The single list of codes."""

    ERROR = "ERROR", "The connector raised an error; retried per policy"
    PERMANENT_ERROR = (
        "PERMANENT_ERROR",
        "A permanent error (bad credentials, missing table); not retried",
    )
    LEASE_EXPIRED = "LEASE_EXPIRED", "The worker stopped heartbeating; settled by recovery"
    CANCELLED_BY_OPERATOR = "CANCELLED_BY_OPERATOR", "An operator cancelled the run"
    TIMEOUT = "TIMEOUT", "The job's timeout_seconds elapsed"
    SNAPSHOT_UNREADABLE = (
        "SNAPSHOT_UNREADABLE",
        "The encrypted snapshot could not be decrypted or verified",
    )
    SHUTDOWN_RELEASED = "SHUTDOWN_RELEASED", "A draining worker released the attempt"
    RELEASED_BY_OPERATOR = "RELEASED_BY_OPERATOR", "An operator released the attempt"
    ALREADY_COMMITTED = "ALREADY_COMMITTED", "The run's data was already committed to the sink"
    SLICES_PLANNED = (
        "SLICES_PLANNED",
        "The run was split into slices; its slices copy the rows (a sliced run's first attempt)",
    )


class BlockedReason(models.TextChoices):
    """Why a due PENDING attempt is not being claimed (`Attempt.blocked_reason`)."""

    JOB_DISABLED = "JOB_DISABLED", "Job disabled"
    BINDING_DISABLED = "BINDING_DISABLED", "Binding disabled"
    SOURCE_DISABLED = "SOURCE_DISABLED", "Source datasource disabled"
    SINK_DISABLED = "SINK_DISABLED", "Sink datasource disabled"
    BINDING_AT_CAPACITY = "BINDING_AT_CAPACITY", "Binding at max_concurrency"
    # In: the settlement of one upstream of a fan-in while others of its chain have not
    # ended as their edge asks (dispatch_chain_fire, chains.sql). Out: the settlement of
    # its last such upstream (-> the binding's own mark or none), an operator cancel.
    # No other marking touches it (marks.sql, capacity.sql).
    WAITING_UPSTREAM = "WAITING_UPSTREAM", "Waiting for upstream runs"


class ChainOn(models.TextChoices):
    """When an edge (`BindingEdge.on`) fires its downstream binding."""

    # The upstream run ended SUCCEEDED.
    SUCCESS = "SUCCESS", "on success"
    # The upstream run ended at all: SUCCEEDED, FAILED or CANCELLED.
    COMPLETION = "COMPLETION", "on completion"
