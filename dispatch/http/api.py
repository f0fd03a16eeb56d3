"""The `NinjaAPI` that `dispatch.urls` mounts under `api/v1/`, its body limits and its
problem+json handlers.

Routers: `bindings`, `runs` and `definitions` (the diff and apply of definition files,
`dispatch.ascode`), added in `build()`; another resource gets a router module of its own
in this package, added there the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError
from ninja.parser import Parser

from dispatch.core import conf
from dispatch.http import problems
from dispatch.http.auth import SessionAuth, TokenAuth
from dispatch.http.problems import Problem
from dispatch.security import jsondepth

VERSION = "1"


class BodyRefused(Exception):
    """A request body the parser will not read (too deep, not JSON): a Problem."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.detail)
        self.problem = problem


class BoundedParser(Parser):
    """JSON bodies with the depth limit checked on the text before `json.loads` (which
    recurses once per level) and on the value after."""

    def parse_body(self, request: HttpRequest) -> Any:
        text = request.body.decode("utf-8", errors="replace")
        if jsondepth.text_too_deep(text):
            message = jsondepth.MESSAGE
            raise BodyRefused(
                Problem(400, f"The body {message}.", errors=[{"field": "body", "message": message}])
            )
        try:
            value = json.loads(text)
        except ValueError as exc:
            message = f"is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"  # type: ignore[attr-defined]
            raise BodyRefused(
                Problem(400, f"The body {message}.", errors=[{"field": "body", "message": message}])
            ) from None
        if jsondepth.value_too_deep(value):
            message = jsondepth.MESSAGE
            raise BodyRefused(
                Problem(400, f"The body {message}.", errors=[{"field": "body", "message": message}])
            )
        # Every body of this API is an object; ninja would read another value's
        # attributes (none) and see an empty object.
        if not isinstance(value, dict):
            message = f"must be a JSON object, not {type(value).__name__}"
            raise BodyRefused(
                Problem(422, f"The body {message}.", errors=[{"field": "body", "message": message}])
            )
        return value


def _too_large(limit: int) -> HttpResponse:
    message = f"is larger than {limit} bytes (DISPATCH_API_MAX_BODY_BYTES)"
    return problems.response(
        413, f"The body {message}.", errors=[{"field": "body", "message": message}]
    )


def bounded_body(run: Callable[..., Any]) -> Callable[..., Any]:
    """Refuse a body over DISPATCH_API_MAX_BODY_BYTES from its Content-Length, before
    authentication and before a byte of it is read."""

    @wraps(run)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        limit = conf.api_max_body_bytes()
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return problems.response(
                400,
                "The Content-Length header is not a number.",
                errors=[{"field": "Content-Length", "message": "is not a number"}],
            )
        if length > limit:
            return _too_large(limit)
        return run(request, *args, **kwargs)

    return wrapper


def build() -> NinjaAPI:
    api = NinjaAPI(
        title="dispatch",
        version=VERSION,
        description="Trigger, follow, cancel and retry runs of dispatch's bindings "
        "(docs/api.md, “HTTP API”). Errors are application/problem+json (RFC 9457).",
        auth=[TokenAuth(), SessionAuth()],
        parser=BoundedParser(),
        urls_namespace="dispatch-api",
        # The document is served at api/openapi.json by dispatch.urls; no docs page (its
        # assets would come from elsewhere).
        openapi_url=None,
        docs_url=None,
    )
    from dispatch.http import bindings, definitions, runs

    api.add_router("/bindings", bindings.router)
    api.add_router("/runs", runs.router)
    api.add_router("/definitions", definitions.router)
    api.add_decorator(bounded_body, mode="view")
    _handlers(api)
    return api


def _handlers(api: NinjaAPI) -> None:
    def on_problem(request: HttpRequest, exc: Any) -> HttpResponse:
        return problems.of(exc)

    def on_validation(request: HttpRequest, exc: Any) -> HttpResponse:
        errors = problems.validation_errors(exc.errors)
        return problems.response(422, problems.summary(errors), errors=errors)

    def on_django_validation(request: HttpRequest, exc: Any) -> HttpResponse:
        errors = problems.django_errors(exc)
        return problems.response(422, problems.summary(errors), errors=errors)

    def on_http_error(request: HttpRequest, exc: Any) -> HttpResponse:
        # ninja wraps what the body parser raises into a 400 "Cannot parse request body".
        if isinstance(exc.__cause__, BodyRefused):
            return problems.of(exc.__cause__.problem)
        if isinstance(exc, AuthenticationError):
            return problems.response(
                401, "Send `Authorization: Bearer <token>` (or log in to the console)."
            )
        return problems.response(exc.status_code, str(exc.message))

    def on_404(request: HttpRequest, exc: Any) -> HttpResponse:
        return problems.response(404, str(exc) or "Not found.")

    def on_denied(request: HttpRequest, exc: Any) -> HttpResponse:
        return problems.response(403, str(exc) or "Permission denied.")

    def on_too_big(request: HttpRequest, exc: Any) -> HttpResponse:
        return _too_large(conf.api_max_body_bytes())

    api.add_exception_handler(Problem, on_problem)
    api.add_exception_handler(NinjaValidationError, on_validation)
    api.add_exception_handler(DjangoValidationError, on_django_validation)
    api.add_exception_handler(HttpError, on_http_error)
    api.add_exception_handler(Http404, on_404)
    api.add_exception_handler(PermissionDenied, on_denied)
    api.add_exception_handler(RequestDataTooBig, on_too_big)


api = build()


def openapi_json(request: HttpRequest) -> JsonResponse:
    """The OpenAPI 3.1 document of the API (public: it describes, it holds no data)."""
    document = dict(api.get_openapi_schema())
    # ninja describes every response as application/json; errors are problem+json.
    for operations in document["paths"].values():
        for operation in operations.values():
            for status, answer in operation.get("responses", {}).items():
                if int(status) >= 400 and "application/json" in answer.get("content", {}):
                    answer["content"] = {
                        problems.PROBLEM_TYPE: answer["content"]["application/json"]
                    }
    return JsonResponse(document, json_dumps_params={"indent": 1})
