"""API tokens in the console: the token is shown once (on the page answering the save)
and never again, the hash never; a user who is not a superuser makes tokens only for
themselves; revoking refuses the token from then on; the expiry is bounded."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from dispatch.models import ApiToken
from dispatch.models.tokens import digest
from tests.http.conftest import make_user

pytestmark = pytest.mark.django_db

TOKEN = re.compile(r"dsp_[A-Za-z0-9]{10}_[A-Za-z0-9_-]{40,}")


def add(client: Client, **data: Any) -> Any:
    expires = (timezone.now() + timedelta(days=10)).strftime("%Y-%m-%d %H:%M:%S")
    date, time = expires.split()
    form = {"name": "airflow", "expires_at_0": date, "expires_at_1": time, **data}
    return client.post(reverse("admin:dispatch_apitoken_add"), form)


def test_the_token_is_shown_once_and_never_its_hash(admin_client: Client) -> None:
    admin = User.objects.get(username="admin")
    answer = add(admin_client, user=admin.pk)
    assert answer.status_code == 200, answer.content
    assert "no-store" in answer["Cache-Control"]
    page = answer.content.decode()
    (token,) = set(TOKEN.findall(page))
    row = ApiToken.objects.get()
    assert row.secret_hash == digest(token) and row.user == admin
    change = admin_client.get(reverse("admin:dispatch_apitoken_change", args=[row.pk])).content
    listing = admin_client.get(reverse("admin:dispatch_apitoken_changelist")).content
    for shown in (change.decode(), listing.decode()):
        assert token not in shown
        assert row.secret_hash not in shown
        assert f"dsp_{row.prefix}_" in shown  # the public prefix names it
    # And it works: the API accepts it.
    api = Client().get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert api.status_code == 200


def test_a_user_who_is_not_a_superuser_makes_tokens_only_for_themselves() -> None:
    mallory = make_user(
        "mallory",
        "dispatch.add_apitoken",
        "dispatch.view_apitoken",
        "dispatch.change_apitoken",
        is_staff=True,
    )
    root = User.objects.create_superuser("root")
    ApiToken.issue(name="roots", user=root, expires_at=timezone.now() + timedelta(days=1))
    client = Client()
    client.force_login(mallory)
    answer = add(client, user=root.pk)  # a user field posted anyway is ignored
    assert answer.status_code == 200, answer.content
    mine = ApiToken.objects.get(name="airflow")
    assert mine.user == mallory
    listing = client.get(reverse("admin:dispatch_apitoken_changelist")).content.decode()
    assert "airflow" in listing and "roots" not in listing
    other = ApiToken.objects.get(name="roots")
    page = client.get(reverse("admin:dispatch_apitoken_change", args=[other.pk]))
    assert page.status_code == 302  # not found among theirs: back to the list


def test_revoke__the_token_is_refused_from_then_on(admin_client: Client) -> None:
    row, token = ApiToken.issue(
        name="ci",
        user=User.objects.get(username="admin"),
        expires_at=timezone.now() + timedelta(days=1),
    )
    assert Client().get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    url = reverse("admin:dispatch_apitoken_object_action", args=[row.pk, "revoke_token"])
    admin_client.post(url, {"post": "yes"})
    row.refresh_from_db()
    assert row.revoked_at is not None
    refused = Client().get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert refused.status_code == 401
    assert "revoked" in refused.json()["detail"]


def test_the_expiry_is_in_the_future_and_within_the_maximum(admin_client: Client) -> None:
    admin = User.objects.get(username="admin")
    late = timezone.now() + timedelta(days=400)
    answer = add(
        admin_client,
        user=admin.pk,
        expires_at_0=late.strftime("%Y-%m-%d"),
        expires_at_1="00:00:00",
    )
    assert answer.status_code == 200
    assert "at most 365 days" in answer.content.decode()
    past = add(admin_client, user=admin.pk, expires_at_0="2020-01-01", expires_at_1="00:00:00")
    assert "in the future" in past.content.decode()
    assert not ApiToken.objects.exists()


def test_a_token_made_with_bindings_is_narrowed_for_good(admin_client: Client) -> None:
    from tests.support.factories import BindingFactory

    mine, other = BindingFactory(name="mine"), BindingFactory(name="other")
    admin = User.objects.get(username="admin")
    page = add(admin_client, user=admin.pk, bindings=[mine.pk]).content.decode()
    (token,) = set(TOKEN.findall(page))
    row = ApiToken.objects.get()
    assert row.scoped and list(row.bindings.all()) == [mine]
    api = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}", "content_type": "application/json"}
    assert api.post("/api/v1/bindings/mine/trigger", **auth).status_code == 201
    assert api.post("/api/v1/bindings/other/trigger", **auth).status_code == 403
    assert other.runs.count() == 0
