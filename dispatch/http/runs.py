"""Runs: list (filters, keyset pages), read with attempts, wait (long-poll), cancel, retry.

Reading needs the console's view permission on runs; cancel and retry need
`dispatch.cancel_run` and `dispatch.retry_run`, as the console's actions do.
"""

from __future__ import annotations

import contextlib
from datetime import datetime

from django.http import HttpRequest
from ninja import Query, Router, Schema
from pydantic import Field

from dispatch import api
from dispatch.core import conf
from dispatch.core.states import Status
from dispatch.http import reads
from dispatch.http.auth import Caller, require, require_binding
from dispatch.http.problems import Problem
from dispatch.http.schemas import (
    ActionOut,
    RunDetail,
    RunPage,
    responses,
    run_detail,
    run_out,
)
from dispatch.models import Run

router = Router(tags=["runs"])

VIEW = "dispatch.view_run"
# Between two reads of a waited-on run: a settled run is answered within this.
WAIT_POLL_SECONDS = 0.5


class RunFilters(Schema):
    binding: str | None = Field(default=None, description="a binding's id or name")
    status: Status | None = None
    since: datetime | None = Field(default=None, description="created at or after")
    limit: int = Field(default=reads.DEFAULT_PAGE, ge=1, le=reads.MAX_PAGE)
    cursor: str | None = Field(default=None, max_length=1000)


@router.get("", response=responses({200: RunPage}), summary="List runs")
def list_runs(request: HttpRequest, filters: Query[RunFilters]) -> RunPage:
    """Runs newest first, `limit` (at most 200) at a time; pass `next_cursor` back as
    `cursor` for the next page."""
    who = require(request, VIEW)
    binding = None
    if filters.binding is not None:
        binding = reads.find_binding(filters.binding)
        require_binding(who, binding)
    page = reads.runs_page(
        limit=filters.limit,
        cursor=filters.cursor,
        binding=binding,
        status=filters.status.value if filters.status is not None else None,
        since=filters.since,
        scope=who.scope,
    )
    return RunPage(items=[run_out(r) for r in page.items], next_cursor=page.next_cursor)


def _visible(who: Caller, run_id: str) -> Run:
    run = reads.find_run(run_id)
    require_binding(who, run.binding_id)
    return run


def _detail(run: Run) -> RunDetail:
    found = reads.find_run(run.pk)
    return run_detail(found, reads.attempts_of(found))


@router.get("/{run_id}", response=responses({200: RunDetail}), summary="Read a run")
def read_run(request: HttpRequest, run_id: str) -> RunDetail:
    """A run with its attempts (their reasons, sanitized errors and row counts)."""
    return _detail(_visible(require(request, VIEW), run_id))


class WaitQuery(Schema):
    timeout: float = Field(default=30.0, ge=0, description="seconds, at most 60 by default")


@router.get(
    "/{run_id}/wait", response=responses({200: RunDetail}), summary="Wait for a run to finish"
)
def wait_run(request: HttpRequest, run_id: str, query: Query[WaitQuery]) -> RunDetail:
    """Hold the request until the run has finished or `timeout` seconds have passed, then
    answer with the run: `finished` says which. Reads the run's row every half second
    (no lock); each waiting request holds one of the site's threads and a connection."""
    who = require(request, VIEW)
    most = conf.api_wait_max_seconds()
    if query.timeout > most:
        message = f"must be at most {most:g} seconds (DISPATCH_API_WAIT_MAX_SECONDS)"
        raise Problem(422, f"timeout {message}", errors=[{"field": "timeout", "message": message}])
    run = _visible(who, run_id)
    # On timeout, answered with the run as it stands.
    with contextlib.suppress(api.WaitTimeout):
        api.wait(run, timeout=query.timeout, poll_interval=WAIT_POLL_SECONDS)
    return _detail(run)


def _action(request: HttpRequest, run_id: str, perm: str, name: str) -> ActionOut:
    who = require(request, perm)
    run = _visible(who, run_id)
    act = api.cancel if name == "cancel" else api.retry
    try:
        outcome = act(run, by=who.label)
    except api.ActionRefused as exc:
        raise Problem(409, exc.message, code=exc.code) from None
    return ActionOut(outcome=str(outcome), run=_detail(run))


@router.post("/{run_id}/cancel", response=responses({200: ActionOut}, 409), summary="Cancel a run")
def cancel_run(request: HttpRequest, run_id: str) -> ActionOut:
    """A pending run is cancelled at once (CANCELLED); a running one at its worker's
    next heartbeat (CANCEL_REQUESTED). A finished run is a 409."""
    return _action(request, run_id, "dispatch.cancel_run", "cancel")


@router.post("/{run_id}/retry", response=responses({200: ActionOut}, 409), summary="Retry a run")
def retry_run(request: HttpRequest, run_id: str) -> ActionOut:
    """A FAILED or CANCELLED run gets a new attempt with a fresh retry budget (RETRIED);
    any other state is a 409."""
    return _action(request, run_id, "dispatch.retry_run", "retry")
