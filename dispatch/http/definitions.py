"""Definition files over HTTP: the diff (`plan`) and the apply, with the code the
`dispatch apply` command runs (`dispatch.ascode`, docs/as-code.md).

Both take the files' texts in the body, never paths on the server. Planning shows the
definitions' fields (secrets as their references), so it needs the console's view
permission of each kind the body defines; applying needs, besides, every permission the
console would ask for the same changes (`Plan.permissions()`). A token narrowed to
bindings may do neither: definitions reach every object. The apply plans again in its own
request (a plan holds resolved secrets in memory only) and writes in one transaction,
refusing with 409 what changed since it read it.
"""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Router, Schema
from pydantic import Field

from dispatch import ascode
from dispatch.http.auth import Caller, caller
from dispatch.http.problems import Problem
from dispatch.http.schemas import responses

router = Router(tags=["definitions"])

# Viewing the definitions a body would change: the console's view permissions.
VIEW = ("dispatch.view_datasource", "dispatch.view_job", "dispatch.view_jobbinding")
MAX_FILES = 50


class DefinitionFile(Schema):
    name: str = Field(min_length=1, max_length=200, description="reported in problems")
    text: str = Field(description="the file's YAML, as `dispatch apply` reads it")


class DefinitionsIn(Schema):
    files: list[DefinitionFile] = Field(min_length=1, max_length=MAX_FILES)
    prune: bool = Field(
        default=False,
        description="delete objects an earlier apply created that the files no longer "
        "define (never one with live runs)",
    )


class PlanOut(Schema):
    changes: list[dict[str, object]]
    counts: dict[str, int]
    orphans: list[str]
    prune: bool
    text: str = Field(description="the diff as `dispatch apply` prints it")


class ApplyOut(Schema):
    plan: PlanOut
    created: int
    changed: int
    deleted: int
    unchanged: int
    kept: int
    summary: str


def _caller(request: HttpRequest) -> Caller:
    who = caller(request)
    if who.scope is not None:
        raise Problem(
            403, "This API token is narrowed to bindings; definitions reach every object."
        )
    missing = [p for p in VIEW if not who.user.has_perm(p)]
    if missing:
        raise Problem(403, f"This needs the permission {missing[0]!r}.")
    return who


def _plan(body: DefinitionsIn) -> ascode.Plan:
    documents: list[ascode.Document] = []
    problems: list[ascode.Problem] = []
    for file in body.files:
        try:
            documents.extend(ascode.load_text(file.text, source=file.name))
        except ascode.DefinitionError as exc:
            problems.extend(exc.problems)
    try:
        if problems:
            raise ascode.DefinitionError(problems)
        return ascode.plan(documents, prune=body.prune)
    except ascode.DefinitionError as exc:
        errors = [
            {
                "field": f"{p.file}:{p.line}: {p.path}" if p.line else f"{p.file}: {p.path}",
                "message": p.message,
            }
            for p in exc.problems
        ]
        raise Problem(
            422,
            f"{len(exc.problems)} problem(s) in the definitions; nothing was written.",
            errors=errors,
        ) from None


def _plan_out(plan: ascode.Plan) -> PlanOut:
    return PlanOut(**plan.as_dict(), text=plan.render())


@router.post("/plan", response=responses({200: PlanOut}), summary="Diff definition files")
def plan_definitions(request: HttpRequest, body: DefinitionsIn) -> PlanOut:
    """What applying the files would create, change and delete, field by field (secrets
    as their references); nothing is written."""
    _caller(request)
    return _plan_out(_plan(body))


@router.post("/apply", response=responses({200: ApplyOut}, 409), summary="Apply definition files")
def apply_definitions(request: HttpRequest, body: DefinitionsIn) -> ApplyOut:
    """Validate every file, then write the changes in one transaction; 409 when an object
    changed since it was read (nothing written then: plan and apply again)."""
    who = _caller(request)
    plan = _plan(body)
    missing = sorted(p for p in plan.permissions() if not who.user.has_perm(p))
    if missing:
        raise Problem(403, f"Applying these changes needs the permission {missing[0]!r}.")
    try:
        result = ascode.apply(plan)
    except ascode.Conflict as exc:
        raise Problem(409, str(exc), code="changed-since-plan") from None
    return ApplyOut(
        plan=_plan_out(plan),
        created=result.created,
        changed=result.changed,
        deleted=result.deleted,
        unchanged=result.unchanged,
        kept=result.kept,
        summary=result.summary(),
    )
