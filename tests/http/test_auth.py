"""Who may call the API: tokens (unknown, malformed, expired, revoked, an inactive user's),
the permissions of the console action each endpoint mirrors, a token's binding scope, and
the console's session with its CSRF check. Against a live server over real HTTP."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now
from django.test import Client
from django.utils import timezone

from dispatch.models import ApiToken, Run
from tests.http.conftest import ALL, make_token, make_user
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db(transaction=True)


def assert_problem(answer: Any, status: int, *words: str) -> dict[str, Any]:
    assert answer.status == status, answer.text
    assert answer.headers["Content-Type"] == "application/problem+json"
    problem = answer.json
    assert problem["status"] == status
    assert problem["type"].startswith("/problems/")
    assert problem["title"] and problem["detail"]
    for word in words:
        assert word in problem["detail"], problem
    return problem


def test_no_credentials__401_problem(http: Any) -> None:
    answer = http("GET", "/bindings")
    assert_problem(answer, 401, "Bearer")
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer nope", "Bearer dsp_0123456789_wrong", "Token something", "Bearer "],
)
def test_bad_tokens__401(http: Any, header: str, operator_token: str) -> None:
    assert_problem(http("GET", "/bindings", headers={"Authorization": header}), 401)


def test_a_wrong_secret_with_a_real_prefix__401(http: Any, operator_token: str) -> None:
    forged = operator_token[:-4] + ("aaaa" if not operator_token.endswith("aaaa") else "bbbb")
    assert_problem(http("GET", "/bindings", token=forged), 401, "Unknown")


def test_a_valid_token__reads(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    answer = http("GET", "/bindings", token=operator_token)
    assert answer.status == 200, answer.text
    assert [b["name"] for b in answer.json["items"]] == ["orders"]


def test_an_expired_token__401(http: Any) -> None:
    row, token = make_token(make_user("u", *ALL))
    assert http("GET", "/bindings", token=token).status == 200
    ApiToken.objects.filter(pk=row.pk).update(expires_at=Now() - timedelta(seconds=1))
    assert_problem(http("GET", "/bindings", token=token), 401, "expired")


def test_a_revoked_token__401(http: Any) -> None:
    row, token = make_token(make_user("u", *ALL))
    assert http("GET", "/bindings", token=token).status == 200
    ApiToken.objects.filter(pk=row.pk).update(revoked_at=Now())
    assert_problem(http("GET", "/bindings", token=token), 401, "revoked")


def test_an_inactive_users_token__401(http: Any) -> None:
    user = make_user("u", *ALL)
    _, token = make_token(user)
    user.is_active = False
    user.save()
    assert_problem(http("GET", "/bindings", token=token), 401, "inactive")


def test_last_used_is_written_at_most_once_a_minute(http: Any) -> None:
    row, token = make_token(make_user("u", *ALL))
    assert row.last_used_at is None
    http("GET", "/bindings", token=token)
    first = ApiToken.objects.get(pk=row.pk).last_used_at
    assert first is not None
    http("GET", "/bindings", token=token)
    assert ApiToken.objects.get(pk=row.pk).last_used_at == first
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=Now() - timedelta(minutes=2))
    http("GET", "/bindings", token=token)
    assert ApiToken.objects.get(pk=row.pk).last_used_at > first


@pytest.mark.parametrize(
    ("method", "path", "perm"),
    [
        ("GET", "/bindings", "dispatch.view_jobbinding"),
        ("GET", "/bindings/{binding}", "dispatch.view_jobbinding"),
        ("POST", "/bindings/{binding}/trigger", "dispatch.trigger_binding"),
        ("PUT", "/bindings/{binding}/cursor", "dispatch.set_cursor_binding"),
        ("DELETE", "/bindings/{binding}/cursor", "dispatch.reset_cursor_binding"),
        ("GET", "/runs", "dispatch.view_run"),
        ("GET", "/runs/{run}", "dispatch.view_run"),
        ("GET", "/runs/{run}/wait?timeout=0", "dispatch.view_run"),
        ("POST", "/runs/{run}/cancel", "dispatch.cancel_run"),
        ("POST", "/runs/{run}/retry", "dispatch.retry_run"),
    ],
)
def test_each_endpoint__403_without_the_console_actions_permission(
    http: Any, method: str, path: str, perm: str
) -> None:
    binding = BindingFactory(name="orders")
    run = Run.objects.create(binding=binding)
    url = path.format(binding="orders", run=run.pk)
    body = {"cursor": ["1"]} if method == "PUT" else None
    _, without = make_token(make_user("without", *(p for p in ALL if p != perm)))
    problem = assert_problem(http(method, url, token=without, body=body), 403, perm)
    assert "errors" not in problem
    _, holder = make_token(make_user("holder", perm))
    # With it, the request gets past the permission (whatever the action then says).
    assert http(method, url, token=holder, body=body).status not in (401, 403)


def test_a_token_scoped_to_one_binding_cannot_act_on_another(http: Any) -> None:
    mine, other = BindingFactory(name="mine"), BindingFactory(name="other")
    _, token = make_token(make_user("u", *ALL), bindings=[mine])
    assert http("POST", "/bindings/mine/trigger", token=token).status == 201
    assert_problem(http("POST", "/bindings/other/trigger", token=token), 403, "scope")
    assert not Run.objects.filter(binding=other).exists()
    # Reads are narrowed too: the list shows its binding only, another's run is refused.
    names = [b["name"] for b in http("GET", "/bindings", token=token).json["items"]]
    assert names == ["mine"]
    foreign = Run.objects.create(binding=other)
    assert_problem(http("GET", f"/runs/{foreign.pk}", token=token), 403, "scope")
    assert_problem(http("POST", f"/runs/{foreign.pk}/cancel", token=token), 403, "scope")
    listed = http("GET", "/runs", token=token).json["items"]
    assert {r["binding"] for r in listed} == {"mine"}
    # Its binding's edges name only the bindings in its scope.
    from dispatch.models import BindingEdge

    shared = BindingFactory(name="shared")
    BindingEdge.objects.create(upstream=other, downstream=mine)
    BindingEdge.objects.create(upstream=mine, downstream=BindingFactory(name="third"))
    _, wide = make_token(make_user("w", *ALL), bindings=[mine, shared])
    BindingEdge.objects.create(upstream=shared, downstream=mine)
    detail = http("GET", "/bindings/mine", token=token).json
    assert detail["after"] == [] and detail["before"] == []
    detail = http("GET", "/bindings/mine", token=wide).json
    assert [e["binding"] for e in detail["after"]] == ["shared"] and detail["before"] == []


def test_a_token_without_trigger_permission_cannot_trigger(http: Any) -> None:
    BindingFactory(name="orders")
    _, reader = make_token(make_user("reader", "dispatch.view_jobbinding", "dispatch.view_run"))
    assert_problem(http("POST", "/bindings/orders/trigger", token=reader), 403)
    assert not Run.objects.exists()


def test_session_auth_needs_the_csrf_token_on_unsafe_methods(live_server: Any) -> None:
    BindingFactory(name="orders")
    make_user("console", *ALL, is_staff=True)
    client = Client(enforce_csrf_checks=True)
    assert client.login(username="console", password="pw")
    base = "/api/v1"
    assert client.get(f"{base}/bindings").status_code == 200
    refused = client.post(f"{base}/bindings/orders/trigger", content_type="application/json")
    assert refused.status_code == 403
    assert refused["Content-Type"] == "application/problem+json"
    assert "CSRF" in refused.json()["detail"]
    assert not Run.objects.exists()
    client.get("/admin/")  # its logout form sets the csrftoken cookie
    csrf = client.cookies["csrftoken"].value
    created = client.post(
        f"{base}/bindings/orders/trigger", content_type="application/json", HTTP_X_CSRFTOKEN=csrf
    )
    assert created.status_code == 201, created.content
    assert created.json()["requested_by"] == "console"


def test_a_runs_requested_by_names_the_user_and_the_token(http: Any) -> None:
    BindingFactory(name="orders")
    _, token = make_token(make_user("alice", *ALL), name="airflow-prod")
    answer = http("POST", "/bindings/orders/trigger", token=token)
    assert answer.json["requested_by"] == "alice (API token airflow-prod)"


def test_tokens_are_stored_hashed(transactional_db: Any) -> None:
    row, token = make_token(make_user("u"))
    stored = ApiToken.objects.values().get(pk=row.pk)
    assert token not in str(stored)
    assert token.split("_")[2] not in str(stored)
    assert row.matches(token) and not row.matches(token + "x")
    assert row.expires_at > timezone.now()


def test_a_scoped_token_whose_bindings_are_gone_acts_on_none(http: Any) -> None:
    gone, other = BindingFactory(name="gone"), BindingFactory(name="other")
    row, token = make_token(make_user("u", *ALL), bindings=[gone])
    gone.delete()
    assert row.bindings.count() == 0
    assert_problem(http("POST", "/bindings/other/trigger", token=token), 403, "scope")
    assert http("GET", "/bindings", token=token).json["items"] == []
    assert not Run.objects.filter(binding=other).exists()
