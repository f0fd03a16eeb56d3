"""A site that includes `dispatch.urls` under a prefix serves the API and its document
there, and the document's paths carry the prefix."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

from tests.http.conftest import make_token, make_user


@pytest.mark.django_db
@override_settings(ROOT_URLCONF="tests.support.prefixed_urls")
def test_the_api_under_a_prefix() -> None:
    document = Client().get("/dispatch/api/openapi.json").json()
    assert "/dispatch/api/v1/runs" in document["paths"]
    _, token = make_token(make_user("u", "dispatch.view_run"))
    answer = Client().get("/dispatch/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 200
    assert answer.json() == {"items": [], "next_cursor": None}
