"""Fixtures of the HTTP API's tests: users with chosen permissions, their tokens, and a
plain urllib client against `live_server` (a real HTTP server on a thread)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.utils import timezone

from dispatch.models import ApiToken, JobBinding


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    @property
    def json(self) -> Any:
        return json.loads(self.text)


def call(
    base: str,
    method: str,
    path: str,
    *,
    token: str | None = None,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"{base}{path}", data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=90) as response:
            return Answer(response.status, dict(response.headers), response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, dict(exc.headers), exc.read().decode())


def make_user(name: str, *perms: str, **fields: Any) -> User:
    user = User.objects.create_user(name, password="pw", **fields)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return user


def make_token(
    user: User, *, bindings: list[JobBinding] | None = None, days: float = 30, name: str = "t"
) -> tuple[ApiToken, str]:
    return ApiToken.issue(
        name=name,
        user=user,
        expires_at=timezone.now() + timedelta(days=days),
        bindings=bindings or (),
    )


@pytest.fixture
def api_url(live_server: Any) -> str:
    return f"{live_server.url}/api/v1"


@pytest.fixture
def http(api_url: str) -> Callable[..., Answer]:
    def request(method: str, path: str, **kwargs: Any) -> Answer:
        return call(api_url, method, path, **kwargs)

    return request


ALL = (
    "dispatch.view_jobbinding",
    "dispatch.view_run",
    "dispatch.trigger_binding",
    "dispatch.cancel_run",
    "dispatch.retry_run",
    "dispatch.set_cursor_binding",
    "dispatch.reset_cursor_binding",
)


@pytest.fixture
def operator_token(transactional_db: Any) -> str:
    """A token of a user holding every permission the API checks (not a superuser)."""
    return make_token(make_user("operator", *ALL))[1]
