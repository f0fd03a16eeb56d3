"""The reads behind the API's lists and `manage.py dispatch runs|bindings`: bounded pages
in index order, with opaque keyset cursors.

Runs are listed newest first by (created_at, id) and paged by keyset: the next page starts
below the last row seen, so a page costs the same at any depth and with any number of runs
(no OFFSET, no count). Runs created meanwhile appear on no later page; none is seen twice
or skipped. The indexes serving each filter are named on `dispatch.models.Run`.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.db.models import Prefetch, Q, QuerySet

from dispatch.core.states import Status
from dispatch.http.problems import Problem
from dispatch.models import Attempt, AttemptEvent, JobBinding, Run

T = TypeVar("T")

MAX_PAGE = 200
DEFAULT_PAGE = 50


def encode_cursor(*values: Any) -> str:
    """An opaque page token (its content is no contract)."""
    raw = json.dumps([str(v) if not isinstance(v, str) else v for v in values])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(token: str, count: int) -> list[str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        values = json.loads(raw)
    except ValueError:
        values = None
    if not isinstance(values, list) or len(values) != count:
        raise _bad_cursor()
    if not all(isinstance(v, str) for v in values):
        raise _bad_cursor()
    return values


def _bad_cursor() -> Problem:
    message = "is not a page token this API returned (pass next_cursor as it came)"
    return Problem(422, f"cursor {message}", errors=[{"field": "cursor", "message": message}])


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE:
        message = f"must be between 1 and {MAX_PAGE}"
        raise Problem(422, f"limit {message}", errors=[{"field": "limit", "message": message}])
    return limit


# --- bindings ---------------------------------------------------------------------------
def bindings_queryset() -> QuerySet[JobBinding]:
    return JobBinding.objects.select_related("job", "source", "sink", "health", "cursor_copy")


def find_binding(ref: str) -> JobBinding:
    """A binding by id or name (404 otherwise), with what its schema shows."""
    try:
        as_id: uuid.UUID | None = uuid.UUID(ref)
    except ValueError:
        as_id = None
    found = None
    if as_id is not None:
        found = bindings_queryset().filter(pk=as_id).first()
    if found is None:
        found = bindings_queryset().filter(name=ref).first()
    if found is None:
        raise Problem(404, f"No binding with id or name {ref!r}.")
    return found


@dataclass
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None


def bindings_page(
    *, limit: int = DEFAULT_PAGE, cursor: str | None = None, scope: Collection[uuid.UUID] | None
) -> Page[JobBinding]:
    """Bindings by name (the unique index on name), `limit` at a time."""
    check_limit(limit)
    qs = bindings_queryset().order_by("name")
    if scope is not None:
        qs = qs.filter(pk__in=list(scope))
    if cursor:
        (after,) = decode_cursor(cursor, 1)
        qs = qs.filter(name__gt=after)
    rows = list(qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_cursor(rows[-1].name) if more else None)


# --- runs -------------------------------------------------------------------------------
def runs_page(
    *,
    limit: int = DEFAULT_PAGE,
    cursor: str | None = None,
    binding: JobBinding | None = None,
    status: str | None = None,
    since: datetime | None = None,
    scope: Collection[uuid.UUID] | None = None,
) -> Page[Run]:
    """Runs newest first, `limit` at a time, below the page token's (created_at, id).

    One indexed read per page: dispatch_run_created_idx unfiltered (or since),
    dispatch_run_binding_idx with a binding, dispatch_run_status_idx with a status;
    equal creation times (runs triggered by one statement) are ordered by id on the few
    rows that share one."""
    check_limit(limit)
    if status is not None and status not in Status.values:
        message = f"must be one of {', '.join(Status.values)}"
        raise Problem(422, f"status {message}", errors=[{"field": "status", "message": message}])
    qs = Run.objects.select_related("binding").order_by("-created_at", "-id")
    if binding is not None:
        qs = qs.filter(binding=binding)
    elif scope is not None:
        qs = qs.filter(binding_id__in=list(scope))
    if status is not None:
        qs = qs.filter(status=status)
    if since is not None:
        qs = qs.filter(created_at__gte=since)
    if cursor:
        created, last_id = decode_cursor(cursor, 2)
        try:
            at = datetime.fromisoformat(created)
            below = uuid.UUID(last_id)
        except ValueError:
            raise _bad_cursor() from None
        # `created_at <= at` is the index condition; the OR only sorts out the rows that
        # share `at` (a row comparison would not use the one-column indexes).
        qs = qs.filter(created_at__lte=at).filter(
            Q(created_at__lt=at) | Q(created_at=at, id__lt=below)
        )
    rows = list(qs[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    token = encode_cursor(rows[-1].created_at.isoformat(), rows[-1].pk) if more else None
    return Page(rows, token)


def find_run(ref: str | uuid.UUID) -> Run:
    """A run by id (404 otherwise), its binding selected."""
    try:
        run_id = ref if isinstance(ref, uuid.UUID) else uuid.UUID(str(ref))
    except ValueError:
        raise Problem(404, f"{str(ref)!r} is not a run id (a UUID).") from None
    found = Run.objects.select_related("binding").filter(pk=run_id).first()
    if found is None:
        raise Problem(404, f"No run {run_id}.")
    return found


def attempts_of(run: Run) -> list[Attempt]:
    # dispatch_attempt_run_number_uniq (run, number); the snapshots and redacted copies
    # are never read. Their event logs in one more query (dispatch_attemptevent_seq_uniq),
    # at most DISPATCH_EVENTS_PER_ATTEMPT + 1 rows an attempt.
    return list(
        Attempt.objects.filter(run_id=run.pk)
        .defer("source_snapshot", "sink_snapshot", "source_redacted", "sink_redacted")
        .order_by("number")
        .prefetch_related(
            Prefetch("events", queryset=AttemptEvent.objects.order_by("attempt_id", "seq"))
        )
    )
