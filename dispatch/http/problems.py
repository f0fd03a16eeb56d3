"""Errors as `application/problem+json` (RFC 9457): `type`, `title`, `status`, `detail`,
and for invalid input `errors`, one `{"field": ..., "message": ...}` per problem.

Every refusal the API makes goes through here, so a client sees one shape whatever
refused it: the request's validation (422), a body too large (413) or too deep (400),
authentication (401), a permission (403), an unknown object (404), an action that does
not apply or a key of another binding (409). Nothing a client sends becomes a 500.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpRequest, HttpResponse

PROBLEM_TYPE = "application/problem+json"
# `type` URIs: relative references naming the problem (RFC 9457 section 3.1.1); clients
# may switch on them. They stay stable across releases.
TYPES: dict[int, tuple[str, str]] = {
    400: ("bad-request", "The request cannot be read"),
    401: ("unauthenticated", "Authentication required"),
    403: ("forbidden", "Permission denied"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    409: ("conflict", "The action does not apply"),
    413: ("too-large", "Request body too large"),
    422: ("invalid", "Invalid input"),
    429: ("throttled", "Too many requests"),
}


class Problem(Exception):
    """A refusal with its status, a detail for the client, and optionally the fields that
    are wrong (`errors`) and a stable `code` (e.g. an action's refusal code)."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        errors: Sequence[dict[str, str]] = (),
        code: str | None = None,
        title: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = list(errors)
        self.code = code
        self.title = title


def body(
    status: int,
    detail: str,
    *,
    errors: Iterable[dict[str, str]] = (),
    code: str | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    slug, default_title = TYPES.get(status, ("error", "Error"))
    data: dict[str, Any] = {
        "type": f"/problems/{slug}",
        "title": title or default_title,
        "status": status,
        "detail": detail,
    }
    listed = list(errors)
    if listed:
        data["errors"] = listed
    if code:
        data["code"] = code
    return data


def response(
    status: int,
    detail: str,
    *,
    errors: Iterable[dict[str, str]] = (),
    code: str | None = None,
    title: str | None = None,
) -> HttpResponse:
    resp = HttpResponse(
        json.dumps(body(status, detail, errors=errors, code=code, title=title)),
        status=status,
        content_type=PROBLEM_TYPE,
    )
    if status == 401:
        resp["WWW-Authenticate"] = 'Bearer realm="dispatch"'
    return resp


def of(problem: Problem) -> HttpResponse:
    return response(
        problem.status,
        problem.detail,
        errors=problem.errors,
        code=problem.code,
        title=problem.title,
    )


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic location as a field path: ("body", "payload", "cursor", 0) ->
    "cursor[0]" (the request part and ninja's wrapper names left out), ("query",
    "limit") -> "limit"."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header", "payload")]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "body"


def validation_errors(errors: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """ninja's (pydantic's) errors as field/message pairs; the input value is never
    echoed (it could be a secret typed in the wrong place)."""
    return [
        {"field": field_path(e.get("loc", ())), "message": str(e.get("msg", "is invalid"))}
        for e in errors
    ]


def django_errors(exc: DjangoValidationError) -> list[dict[str, str]]:
    if hasattr(exc, "error_dict"):
        return [
            {"field": "body" if name == "__all__" else name, "message": message}
            for name, messages in exc.message_dict.items()
            for message in messages
        ]
    return [{"field": "body", "message": message} for message in exc.messages]


def summary(errors: Sequence[dict[str, str]]) -> str:
    """One line naming every field that is wrong."""
    shown = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return shown + more


def unauthenticated(request: HttpRequest, detail: str) -> HttpResponse:
    return response(401, detail)
