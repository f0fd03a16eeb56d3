"""Who calls, and what they may do.

Two ways in: `Authorization: Bearer <token>` (an `ApiToken`: its user's permissions,
narrowed to its bindings if it names any), and the console's own session (Django's login
cookie, with its CSRF token on every unsafe method). Either way every endpoint then checks
the permission of the console action it mirrors (`require`), on the caller's user.

Refusals: no credentials, or a token that is malformed, unknown, expired, revoked or whose
user is inactive -> 401; a permission or a binding outside the token's scope -> 403. The
token itself is never logged or echoed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db.models.functions import Now
from django.http import HttpRequest
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from dispatch.http.problems import Problem
from dispatch.models import ApiToken, JobBinding
from dispatch.models.tokens import split

# `requested_by` of a run holds 150 characters.
REQUESTED_BY_LENGTH = 150


@dataclass
class Caller:
    """The user a request acts as, and the token it came with (None: a session)."""

    user: Any
    token: ApiToken | None = None
    _scope: frozenset[uuid.UUID] | None = field(default=None, repr=False)
    _scope_loaded: bool = field(default=False, repr=False)

    @property
    def scope(self) -> frozenset[uuid.UUID] | None:
        """The bindings the token is narrowed to (None: no narrowing)."""
        if not self._scope_loaded:
            if self.token is not None and self.token.scoped:
                # Possibly empty (its bindings deleted since): then it acts on none.
                self._scope = frozenset(self.token.bindings.values_list("pk", flat=True))
            self._scope_loaded = True
        return self._scope

    @property
    def label(self) -> str:
        """Who asked, as a run's `requested_by` records it."""
        name = str(self.user.get_username())
        if self.token is not None:
            name = f"{name} (API token {self.token.name})"
        return name[:REQUESTED_BY_LENGTH]


class TokenAuth(HttpBearer):
    """`Authorization: Bearer dsp_...`. A request without the header falls through to the
    session; one with a bad token is refused at once (never retried as a session)."""

    def __call__(self, request: HttpRequest) -> Caller | None:
        # ninja's HttpBearer.__call__ logs an unexpected header in DEBUG, which could be
        # a token sent with the wrong scheme: this one logs nothing.
        value = request.headers.get("Authorization")
        if not value:
            return None
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            raise Problem(401, "The Authorization header must be `Bearer <token>`.")
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Caller:
        public = split(token)
        if public is None:
            raise Problem(401, "The bearer token is not a dispatch API token (dsp_...).")
        row = (
            ApiToken.objects.select_related("user")
            .annotate(db_now=Now())
            .filter(prefix=public)
            .first()
        )
        # The same answer for an unknown prefix and a wrong secret.
        if row is None or not row.matches(token):
            raise Problem(401, "Unknown API token.")
        if row.revoked_at is not None:
            raise Problem(401, f"The API token {row.name!r} was revoked.")
        if row.expires_at <= row.db_now:  # type: ignore[attr-defined]
            raise Problem(401, f"The API token {row.name!r} expired.")
        if not row.user.is_active:
            raise Problem(401, "The API token's user is inactive.")
        row.touch()
        return Caller(user=row.user, token=row)


class SessionAuth(APIKeyCookie):
    """The console's session: a logged-in user, with Django's CSRF check on unsafe
    methods. Without a session the request is unauthenticated (401), not a CSRF failure."""

    def __init__(self) -> None:
        from django.conf import settings

        self.param_name = settings.SESSION_COOKIE_NAME
        super().__init__(csrf=True)

    def __call__(self, request: HttpRequest) -> Caller | None:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        if check_csrf(request) is not None:
            raise Problem(
                403, "CSRF check failed: send the csrftoken cookie's value as X-CSRFToken."
            )
        return Caller(user=user)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        raise NotImplementedError  # __call__ decides


def caller(request: HttpRequest) -> Caller:
    found = getattr(request, "auth", None)
    if not isinstance(found, Caller):  # every endpoint is authenticated
        raise Problem(401, "Authentication required.")
    return found


def require(request: HttpRequest, perm: str) -> Caller:
    """The caller, if its user holds `perm` ("app_label.codename"); else 403."""
    who = caller(request)
    if not who.user.has_perm(perm):
        raise Problem(403, f"This needs the permission {perm!r}.")
    return who


def require_binding(who: Caller, binding: JobBinding | uuid.UUID) -> None:
    """403 when the caller's token is narrowed to other bindings."""
    binding_id = binding.pk if isinstance(binding, JobBinding) else binding
    scope = who.scope
    if scope is not None and binding_id not in scope:
        raise Problem(403, "This API token may not act on this binding (its binding scope).")
