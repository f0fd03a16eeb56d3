"""Bulk operations: an operator action applied to every row matching a console filter,
worked through by the maintenance loop in keyset batches (docs/console.md, "Bulk
operations"; docs/architecture.md, "Bulk operations").

The console validates the filter (`validate_filters`) and stores the request
(`request`). `work_batch` takes the oldest PENDING operation that no other worker holds
(`FOR UPDATE SKIP LOCKED` on its row), reads the next rows after its keyset cursor by
primary key, applies the action to each through the same service function as the
one-at-a-time action, after the same permission check (the requester's permissions now,
not at request time), writes one admin history entry per row and one `BulkSkip` per
refusal, and moves the cursor and the counts, all in one transaction: a worker killed
mid-batch leaves nothing of that batch, and the next one starts after the last committed
batch. An action is never applied twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ObjectDoesNotExist
from django.db import models, transaction
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from dispatch import services
from dispatch.core import conf
from dispatch.core.db import DB_ERRORS
from dispatch.core.states import Status, Trigger
from dispatch.models import BulkOperation, BulkSkip, BulkStatus, JobBinding, Run
from dispatch.models.core import MANAGED_BY_CHOICES
from dispatch.services import ActionRefused
from dispatch.worker.log import db_error

log = logging.getLogger("dispatch.bulk")


class BulkRequestError(ValueError):
    """A bulk request that cannot be stored (a filter that does not validate, an action
    the model has not, a permission the requester lacks); the message says which."""


# --- what may be filtered on --------------------------------------------------------------


def _choice(values: list[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(f"one of {', '.join(values)}")
        return text

    return parse


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ValueError("an id (a UUID)") from None


def _moment(text: str) -> datetime:
    """What the admin's date filters put in a URL: a date, or a date and time."""
    try:
        moment = parse_datetime(text)
        if moment is None:
            day = parse_date(text)
            if day is not None:
                moment = datetime(day.year, day.month, day.day)
    except ValueError:
        moment = None
    if moment is None:
        raise ValueError("a date (YYYY-MM-DD) or a date and time")
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


def _flag(true: str, false: str, text: str) -> bool:
    if text == true:
        return True
    if text == false:
        return False
    raise ValueError(f"{true} or {false}")


# The changelist's query parameters a bulk operation accepts, per model: exactly those of
# the list's filters (RunAdmin.list_filter, JobBindingAdmin.list_filter), each with its
# parser. A search (`q`) is not among them: its meaning follows the admin's search fields,
# which a stored operation must not depend on.
FILTERS: dict[str, dict[str, Callable[[str], Any]]] = {
    "run": {
        "status__exact": _choice(Status.values),
        "trigger__exact": _choice(Trigger.values),
        "binding__id__exact": _uuid,
        "binding__job__id__exact": _uuid,
        "created_at__gte": _moment,
        "created_at__lt": _moment,
        "finished_at__gte": _moment,
        "finished_at__lt": _moment,
        "finished_at__isnull": partial(_flag, "True", "False"),
    },
    "jobbinding": {
        "enabled__exact": partial(_flag, "1", "0"),
        "job__id__exact": _uuid,
        "managed_by__exact": _choice([value for value, _ in MANAGED_BY_CHOICES]),
    },
}
# The list's own parameters (its order and page): no part of what matches.
IGNORED = frozenset({"o", "p", "all"})
MODELS: dict[str, type[models.Model]] = {"run": Run, "jobbinding": JobBinding}


def validate_filters(model: str, params: Mapping[str, list[str]]) -> dict[str, str]:
    """The filter to store, from a changelist's query parameters ({name: [values]}).
    Raises BulkRequestError naming the first parameter that is not an allowed filter or
    whose value does not parse."""
    allowed = FILTERS[model]
    kept: dict[str, str] = {}
    for name, values in sorted(params.items()):
        if name in IGNORED:
            continue
        if name == "q":
            raise BulkRequestError(
                "A search cannot select a bulk operation's rows: use the list's filters "
                "(the search box's matches are not a stored filter)."
            )
        if name not in allowed:
            raise BulkRequestError(
                f"{name!r} is not a filter a bulk operation accepts; it accepts "
                f"{', '.join(sorted(allowed))}."
            )
        if len(values) != 1:
            raise BulkRequestError(f"The filter {name!r} has {len(values)} values; one only.")
        try:
            allowed[name](values[0])
        except ValueError as exc:
            raise BulkRequestError(
                f"The filter {name!r} must be {exc}, not {values[0]!r}."
            ) from None
        kept[name] = values[0]
    return kept


def matching(model: str, filters: Mapping[str, str]) -> models.QuerySet[Any]:
    """The rows a stored filter selects (re-validated: a stored filter is data)."""
    allowed = FILTERS[model]
    lookups = {}
    for name, value in filters.items():
        if name not in allowed:
            raise BulkRequestError(f"{name!r} is not a filter a bulk operation accepts.")
        lookups[name] = allowed[name](value)
    return MODELS[model]._default_manager.filter(**lookups)


# --- what may be applied -------------------------------------------------------------------


@dataclass(frozen=True)
class BulkAction:
    """One action a bulk operation applies: the same service call and permission as the
    console's one-at-a-time action of that name (tests/console/test_bulk.py holds them
    equal)."""

    model: str
    name: str
    label: str
    perm: str  # "app_label.codename" the requester must hold when each batch runs
    apply: Callable[[Any, Any], tuple[str, str]]  # (row, user) -> (outcome, detail)
    describe: str


def _service(fn: Callable[..., services.Outcome]) -> Callable[[Any, Any], tuple[str, str]]:
    def apply(obj: Any, user: Any) -> tuple[str, str]:
        return fn(obj, by=user), ""

    return apply


def release_running(run: Run, user: Any) -> tuple[str, str]:
    """Release a run's running attempt (the run list's "Release running attempt")."""
    attempt = run.attempts.filter(status=Status.RUNNING).first()
    if attempt is None:
        raise ActionRefused("NOT_RUNNING", f"Run {run.pk} has no running attempt.")
    return services.release_attempt(attempt, by=user), f"attempt {attempt.number}"


def set_enabled(enabled: bool, obj: Any, user: Any) -> tuple[str, str]:
    """Enable or disable a datasource, job or binding (the console's Enable / Disable)."""
    # A conditional update: two operators flipping the same row never both "succeed".
    changed = type(obj).objects.filter(pk=obj.pk, enabled=not enabled).update(enabled=enabled)
    if not changed:
        state = "ENABLED" if enabled else "DISABLED"
        raise ActionRefused(f"ALREADY_{state}", f"{obj} is already {state.lower()}.")
    return ("ENABLED" if enabled else "DISABLED"), ""


ACTIONS: dict[tuple[str, str], BulkAction] = {
    (a.model, a.name): a
    for a in [
        BulkAction(
            "run",
            "retry",
            "Retry",
            "dispatch.retry_run",
            _service(services.retry_run),
            "Add a new attempt (operator retry) to each failed or cancelled run.",
        ),
        BulkAction(
            "run",
            "cancel",
            "Cancel",
            "dispatch.cancel_run",
            _service(services.cancel_run),
            "Cancel each unfinished run (a running one at its worker's next heartbeat).",
        ),
        BulkAction(
            "run",
            "release",
            "Release running attempt",
            "dispatch.release_attempt",
            release_running,
            "Settle each run's running attempt now (its worker is gone); a successor is due.",
        ),
        BulkAction(
            "jobbinding",
            "enable",
            "Enable",
            "dispatch.change_jobbinding",
            partial(set_enabled, True),
            "Allow claims (and fires) of each binding again.",
        ),
        BulkAction(
            "jobbinding",
            "disable",
            "Disable",
            "dispatch.change_jobbinding",
            partial(set_enabled, False),
            "Block future claims of each binding; running attempts are not touched.",
        ),
    ]
}


def actions_of(model: str) -> list[BulkAction]:
    return [a for (m, _), a in ACTIONS.items() if m == model]


# --- the request ---------------------------------------------------------------------------


def request(model: str, action: str, params: Mapping[str, list[str]], user: Any) -> BulkOperation:
    """Store a bulk operation (PENDING) for `user`, with the count of rows matching now.
    Raises BulkRequestError: an unknown action, a permission `user` lacks, a filter that
    does not validate. One short transaction; the work is the maintenance loop's."""
    spec = ACTIONS.get((model, action))
    if spec is None:
        raise BulkRequestError(f"There is no bulk action {action!r} for {model}.")
    if not user.has_perm(spec.perm):
        raise BulkRequestError(f"{spec.label} needs the permission {spec.perm}.")
    filters = validate_filters(model, params)
    total = matching(model, filters).count()
    operation = BulkOperation.objects.create(
        model=model,
        action=action,
        filters=filters,
        requested_by=user,
        requested_by_name=user.get_username(),
        total=total,
    )
    log.info(
        "bulk operation requested operation=%s action=%s model=%s total=%d by=%s",
        operation.pk,
        action,
        model,
        total,
        user.get_username(),
    )
    return operation


def cancel(operation: BulkOperation | int, *, by: Any = None) -> str:
    """Cancel a PENDING operation. Waits for a batch in flight (its row lock) and takes
    effect before the next one; the batches already committed stay applied."""
    pk = operation.pk if isinstance(operation, BulkOperation) else operation
    who = "" if by is None else by.get_username()
    changed = BulkOperation.objects.filter(pk=pk, status=BulkStatus.PENDING).update(
        status=BulkStatus.CANCELLED, finished_at=Now(), updated_at=Now(), cancelled_by=who
    )
    if not changed:
        raise ActionRefused("ALREADY_FINISHED", f"Bulk operation {pk} has already finished.")
    log.info("bulk operation cancelled operation=%s by=%s", pk, who)
    return "CANCELLED"


# --- the batches ---------------------------------------------------------------------------


@dataclass
class BatchReport:
    operation: int
    done: int = 0
    skipped: int = 0
    status: str = BulkStatus.PENDING


def _requester(operation: BulkOperation, perm: str) -> tuple[Any, str]:
    """The requester, read afresh (their permissions as they are now), or why not."""
    user_id = operation.requested_by_id
    user = None if user_id is None else get_user_model()._default_manager.filter(pk=user_id).first()
    if user is None:
        return None, "The requester's account no longer exists."
    if not user.is_active:
        return None, f"{user.get_username()} is no longer active."
    if not user.has_perm(perm):
        return None, f"{user.get_username()} no longer has the permission {perm}."
    return user, ""


def _finish(operation: BulkOperation, status: str, **fields: Any) -> None:
    # We hold the row's lock: exactly this row changes; anything else is a bug.
    changed = BulkOperation.objects.filter(pk=operation.pk, status=BulkStatus.PENDING).update(
        status=status, updated_at=Now(), **fields
    )
    if changed != 1:
        raise RuntimeError(f"bulk operation {operation.pk} changed under its lock")


def work_batch(size: int | None = None) -> BatchReport | None:
    """One batch of the oldest PENDING operation no other worker holds; None: none.

    One transaction: the operation's row locked (`FOR UPDATE SKIP LOCKED`: another
    worker takes the next operation, or none), the next `size` matching rows after the
    cursor (by primary key) each through its action's service (its own savepoint and row
    locks, held to the batch's commit), the history entries, the skips, and the cursor and
    counts. A cancel waits on the row lock and so lands between two batches."""
    size = conf.bulk_batch() if size is None else size
    with transaction.atomic():
        operation = (
            BulkOperation.objects.select_for_update(skip_locked=True)
            .filter(status=BulkStatus.PENDING)
            .order_by("id")
            .first()
        )
        if operation is None:
            return None
        report = BatchReport(operation.pk)
        spec = ACTIONS.get((operation.model, operation.action))
        if spec is None:
            _finish(
                operation,
                BulkStatus.REFUSED,
                error=f"Unknown action {operation.action!r}.",
                finished_at=Now(),
            )
            report.status = BulkStatus.REFUSED
            return report
        user, why = _requester(operation, spec.perm)
        if user is None:
            _finish(operation, BulkStatus.REFUSED, error=why, finished_at=Now())
            log.warning("bulk operation refused operation=%s reason=%s", operation.pk, why)
            report.status = BulkStatus.REFUSED
            return report
        try:
            batch = list(next_rows(operation, size))
        except BulkRequestError as exc:  # a stored filter this release no longer accepts
            _finish(operation, BulkStatus.REFUSED, error=str(exc), finished_at=Now())
            report.status = BulkStatus.REFUSED
            return report
        content_type = ContentType.objects.get_for_model(MODELS[operation.model])
        entries: list[LogEntry] = []
        skips: list[BulkSkip] = []
        label = f"{spec.label} (bulk operation {operation.pk})"
        # The runs to wake go as one NOTIFY statement at the batch's commit.
        with services.wakeups_batched():
            for obj in batch:
                name = str(obj)[:200]
                try:
                    # A savepoint: a row the database refuses (a lock timeout, a deadlock)
                    # is skipped with its reason, never the batch's undoing, which would
                    # leave the operation retrying it ahead of every later operation.
                    with transaction.atomic():
                        outcome, detail = spec.apply(obj, user)
                except ActionRefused as refused:
                    code, message = refused.code, refused.message
                except ObjectDoesNotExist:  # deleted since the read (retention)
                    code, message = "GONE", f"{name} no longer exists."
                except DB_ERRORS as exc:
                    code, message = "DATABASE_ERROR", f"The database refused it: {db_error(exc)}"
                else:
                    report.done += 1
                    text = f"{label}: {outcome}" + (f" ({detail})" if detail else "")
                    entries.append(_entry(user, content_type, obj, name, text))
                    continue
                report.skipped += 1
                skips.append(
                    BulkSkip(
                        operation=operation, object_id=obj.pk, object_repr=name[:300], code=code,
                        message=message,
                    )
                )  # fmt: skip
                text = f"{label}: refused ({code}): {message}"
                entries.append(_entry(user, content_type, obj, name, text))
        LogEntry.objects.bulk_create(entries)
        BulkSkip.objects.bulk_create(skips)
        last = batch[-1].pk if batch else operation.cursor
        finished = len(batch) < size
        fields: dict[str, Any] = {
            "cursor": last,
            "done": operation.done + report.done,
            "skipped": operation.skipped + report.skipped,
            "batches": operation.batches + 1,
        }
        if finished:
            fields["finished_at"] = Now()
        _finish(operation, BulkStatus.DONE if finished else BulkStatus.PENDING, **fields)
        report.status = BulkStatus.DONE if finished else BulkStatus.PENDING
    log.info(
        "bulk batch operation=%s done=%d skipped=%d status=%s",
        report.operation,
        report.done,
        report.skipped,
        report.status,
    )
    return report


def next_rows(operation: BulkOperation, size: int) -> models.QuerySet[Any]:
    """The batch's rows: the next `size` matching rows after the cursor, by primary key.
    Over a status filter, a range of dispatch_run_status_id_idx (status, id) whatever the
    table's size; the other filters narrow what that range (or the primary key's) yields."""
    rows = matching(operation.model, operation.filters)
    if operation.cursor is not None:
        rows = rows.filter(pk__gt=operation.cursor)
    if operation.model == "run":
        rows = rows.select_related("binding")  # each row's name in its history entry
    return rows.order_by("pk")[:size]


def _entry(user: Any, content_type: ContentType, obj: Any, name: str, text: str) -> LogEntry:
    return LogEntry(
        user_id=user.pk,
        content_type=content_type,
        object_id=str(obj.pk),
        object_repr=name,
        action_flag=CHANGE,
        change_message=text,
    )


def work() -> int | None:
    """The maintenance task: batches for up to `DISPATCH_BULK_BUDGET` seconds; the rows
    handled (the next look at the next tick), or None when no operation was waiting or
    each was held elsewhere (the next look after `DISPATCH_BULK_INTERVAL`)."""
    handled: int | None = None
    until = time.monotonic() + conf.bulk_budget()
    while time.monotonic() < until:
        report = work_batch()
        if report is None:
            break
        handled = (handled or 0) + report.done + report.skipped
    return handled
