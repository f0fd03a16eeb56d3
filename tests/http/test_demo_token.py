"""`make run`'s API token: `demo_api_token` gives the demo login a fresh token, prints it
once, and revokes the one before (only hashes are kept, so a token is never shown twice)."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from dispatch.models import ApiToken
from project import dev


def issue() -> str:
    out = StringIO()
    call_command("demo_api_token", "--url", "http://127.0.0.1:8000/api/v1/", stdout=out)
    found = re.search(r"Authorization: Bearer (dsp_\S+)", out.getvalue())
    assert found, out.getvalue()
    assert "http://127.0.0.1:8000/api/v1/" in out.getvalue()
    return found.group(1)


def status(token: str) -> int:
    return Client().get("/api/v1/bindings", HTTP_AUTHORIZATION=f"Bearer {token}").status_code


@pytest.mark.django_db
def test_demo_api_token__a_fresh_token_each_run_the_previous_revoked() -> None:
    with pytest.raises(CommandError, match="seed_demo"):
        issue()
    User.objects.create_superuser("admin")
    first = issue()
    assert status(first) == 200
    second = issue()
    assert second != first
    assert (status(first), status(second)) == (401, 200)
    assert ApiToken.objects.filter(name="demo", revoked_at__isnull=True).count() == 1


def test_make_run_prints_the_token_beside_the_login() -> None:
    source = dev.cmd_run.__code__.co_consts
    assert "demo_api_token" in source
