"""Bindings: list and read (health, committed cursor), trigger, set and reset the cursor.

Each endpoint checks the permission of the console action it mirrors: viewing bindings,
`dispatch.trigger_binding`, `dispatch.set_cursor_binding`, `dispatch.reset_cursor_binding`.
A binding is named by its id or its name.
"""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Query, Router, Schema
from ninja.responses import Status
from pydantic import Field

from dispatch import api, services
from dispatch.http import reads
from dispatch.http.auth import require, require_binding
from dispatch.http.problems import Problem
from dispatch.http.schemas import (
    BindingDetail,
    BindingPage,
    CursorIn,
    CursorResult,
    RunDetail,
    TriggerIn,
    binding_detail,
    binding_out,
    responses,
    run_detail,
)
from dispatch.models import JobBinding, Run

router = Router(tags=["bindings"])

VIEW = "dispatch.view_jobbinding"


class BindingFilters(Schema):
    limit: int = Field(default=reads.DEFAULT_PAGE, ge=1, le=reads.MAX_PAGE)
    cursor: str | None = Field(default=None, max_length=1000)


@router.get("", response=responses({200: BindingPage}), summary="List bindings")
def list_bindings(request: HttpRequest, filters: Query[BindingFilters]) -> BindingPage:
    """Bindings by name, with their health and committed cursor, `limit` at a time."""
    who = require(request, VIEW)
    page = reads.bindings_page(limit=filters.limit, cursor=filters.cursor, scope=who.scope)
    return BindingPage(items=[binding_out(b) for b in page.items], next_cursor=page.next_cursor)


@router.get("/{ref}", response=responses({200: BindingDetail}), summary="Read a binding")
def read_binding(request: HttpRequest, ref: str) -> BindingDetail:
    """A binding with its health, cursor and edges (`after`: what it waits for;
    `before`: what waits for it)."""
    who = require(request, VIEW)
    binding = reads.find_binding(ref)
    require_binding(who, binding)
    return binding_detail(binding, who.scope)


@router.post(
    "/{ref}/trigger",
    response=responses({200: RunDetail, 201: RunDetail}, 409),
    summary="Trigger a run",
)
def trigger(request: HttpRequest, ref: str, payload: TriggerIn | None = None) -> Status:
    """Create a run (trigger API) and wake a worker: 201 with the new run. With an
    `idempotency_key` that already names a run of this binding, 200 with that run and
    nothing created; one naming another binding's run is a 409."""
    who = require(request, "dispatch.trigger_binding")
    binding = reads.find_binding(ref)
    require_binding(who, binding)
    key = payload.idempotency_key if payload is not None else None
    existed = key is not None and Run.objects.filter(idempotency_key=key).exists()
    try:
        run = api.trigger(binding, idempotency_key=key, requested_by=who.label)
    except api.IdempotencyConflict as exc:
        raise Problem(
            409,
            str(exc),
            code="IDEMPOTENCY_CONFLICT",
            errors=[{"field": "idempotency_key", "message": "names a run of another binding"}],
        ) from None
    found = reads.find_run(run.pk)
    return Status(200 if existed else 201, run_detail(found, reads.attempts_of(found)))


def _cursor_result(binding: JobBinding, committed: object) -> CursorResult:
    return CursorResult(
        binding=binding.name,
        cursor=list(committed.cursor) if committed.cursor is not None else None,  # type: ignore[attr-defined]
        version=committed.version,  # type: ignore[attr-defined]
        replaced=committed.replaced,  # type: ignore[attr-defined]
    )


def _set(request: HttpRequest, binding: JobBinding, cursor: list[str] | None) -> CursorResult:
    try:
        committed = services.set_binding_cursor(binding, cursor, by=request.auth.label)  # type: ignore[attr-defined]
    except services.ActionRefused as exc:
        status = 422 if exc.code == "BAD_CURSOR" else 409
        errors = [{"field": "cursor", "message": exc.message}] if status == 422 else []
        raise Problem(status, exc.message, code=exc.code, errors=errors) from None
    return _cursor_result(binding, committed)


@router.put(
    "/{ref}/cursor",
    response=responses({200: CursorResult}, 409),
    summary="Set the incremental cursor",
)
def set_cursor(request: HttpRequest, ref: str, payload: CursorIn) -> CursorResult:
    """Set the cursor committed in the sink (one string per cursor column, each at most
    4 KiB): the next run reads the rows above it. As the console's "Set cursor"."""
    who = require(request, "dispatch.set_cursor_binding")
    binding = reads.find_binding(ref)
    require_binding(who, binding)
    return _set(request, binding, payload.cursor)


@router.delete(
    "/{ref}/cursor",
    response=responses({200: CursorResult}, 409),
    summary="Reset the incremental cursor",
)
def reset_cursor(request: HttpRequest, ref: str) -> CursorResult:
    """Forget the cursor committed in the sink: the next run reads the whole source. As
    the console's "Reset cursor"."""
    who = require(request, "dispatch.reset_cursor_binding")
    binding = reads.find_binding(ref)
    require_binding(who, binding)
    return _set(request, binding, None)
