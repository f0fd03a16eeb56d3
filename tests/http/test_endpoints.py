"""The API's endpoints against a live server: bindings with health and cursor, idempotent
triggers, runs with attempts, cancel and retry, the cursor, bad input as problem+json
(never a 500), and no datasource secret in any answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db.models.functions import Now
from django.test import override_settings
from openapi_spec_validator import validate

from dispatch import services
from dispatch.core.states import Status
from dispatch.models import BindingCursor, BindingEdge, BindingHealth, Run
from tests.http.conftest import ALL, call, make_token, make_user
from tests.http.test_auth import assert_problem
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_bindings__list_and_read_with_health_and_cursor(http: Any, operator_token: str) -> None:
    a = BindingFactory(name="a-orders")
    b = BindingFactory(name="b-users")
    BindingEdge.objects.create(upstream=b, downstream=a, on="COMPLETION")
    BindingHealth.objects.create(binding=a, state="WARNED", consecutive_failures=3, reason="boom")
    BindingCursor.objects.create(
        binding=a, columns=["updated_at"], cursor=["2024-01-01"], version=4
    )
    page = http("GET", "/bindings", token=operator_token).json
    assert [b["name"] for b in page["items"]] == ["a-orders", "b-users"]
    assert page["next_cursor"] is None
    one = http("GET", "/bindings/a-orders", token=operator_token).json
    assert one["health"]["state"] == "WARNED"
    assert one["health"]["consecutive_failures"] == 3
    assert one["cursor"]["cursor"] == ["2024-01-01"] and one["cursor"]["version"] == 4
    assert one["job"] == a.job.name and one["source"] == a.source.name
    assert one["after"] == [{"binding": "b-users", "on": "COMPLETION"}] and one["before"] == []
    by_id = http("GET", f"/bindings/{a.pk}", token=operator_token).json
    assert by_id == one
    assert http("GET", "/bindings/b-users", token=operator_token).json["health"] is None
    assert_problem(http("GET", "/bindings/nope", token=operator_token), 404, "nope")


def test_bindings__pages_by_name(http: Any, operator_token: str) -> None:
    for i in range(5):
        BindingFactory(name=f"b{i}")
    seen: list[str] = []
    cursor = None
    while True:
        path = "/bindings?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = http("GET", path, token=operator_token).json
        seen += [b["name"] for b in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"b{i}" for i in range(5)]


def test_trigger__the_same_key_returns_the_same_run(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    first = http(
        "POST", "/bindings/orders/trigger", token=operator_token, body={"idempotency_key": "k1"}
    )
    assert first.status == 201, first.text
    again = http(
        "POST", "/bindings/orders/trigger", token=operator_token, body={"idempotency_key": "k1"}
    )
    assert again.status == 200, again.text
    assert again.json["id"] == first.json["id"]
    assert Run.objects.count() == 1
    run = first.json
    assert run["trigger"] == "API" and run["status"] == "PENDING" and not run["finished"]
    assert [a["number"] for a in run["attempts"]] == [1]
    # Without a key, each call is a run of its own.
    assert http("POST", "/bindings/orders/trigger", token=operator_token).status == 201
    assert Run.objects.count() == 2


def test_trigger__a_key_of_another_binding_is_a_409(http: Any, operator_token: str) -> None:
    BindingFactory(name="a")
    BindingFactory(name="b")
    http("POST", "/bindings/a/trigger", token=operator_token, body={"idempotency_key": "k"})
    problem = assert_problem(
        http("POST", "/bindings/b/trigger", token=operator_token, body={"idempotency_key": "k"}),
        409,
    )
    assert problem["code"] == "IDEMPOTENCY_CONFLICT"
    assert problem["errors"][0]["field"] == "idempotency_key"
    assert Run.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"idempotency_key": ""}, "idempotency_key"),
        ({"idempotency_key": "x" * 201}, "idempotency_key"),
        ({"idempotency_key": 5}, "idempotency_key"),
        ([1, 2], "body"),
    ],
)
def test_trigger__invalid_input_is_a_422_naming_the_field(
    http: Any, operator_token: str, body: Any, field: str
) -> None:
    BindingFactory(name="orders")
    problem = assert_problem(
        http("POST", "/bindings/orders/trigger", token=operator_token, body=body), 422, field
    )
    assert [e["field"] for e in problem["errors"]] == [field]
    assert not Run.objects.exists()


def test_runs__read_cancel_retry(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    run = http("POST", "/bindings/orders/trigger", token=operator_token).json
    read = http("GET", f"/runs/{run['id']}", token=operator_token).json
    assert read["id"] == run["id"] and read["attempts"][0]["status"] == "PENDING"
    cancelled = http("POST", f"/runs/{run['id']}/cancel", token=operator_token).json
    assert cancelled["outcome"] == "CANCELLED"
    assert cancelled["run"]["status"] == "CANCELLED" and cancelled["run"]["finished"]
    again = assert_problem(http("POST", f"/runs/{run['id']}/cancel", token=operator_token), 409)
    assert again["code"] == "ALREADY_FINISHED"
    retried = http("POST", f"/runs/{run['id']}/retry", token=operator_token).json
    assert retried["outcome"] == "RETRIED"
    assert [a["number"] for a in retried["run"]["attempts"]] == [1, 2]
    refused = assert_problem(http("POST", f"/runs/{run['id']}/retry", token=operator_token), 409)
    assert refused["code"] == "NOT_RETRYABLE"


def test_runs__unknown_or_malformed_ids_are_404(http: Any, operator_token: str) -> None:
    assert_problem(http("GET", "/runs/not-a-uuid", token=operator_token), 404)
    assert_problem(
        http("GET", "/runs/00000000-0000-0000-0000-000000000000", token=operator_token), 404
    )


def test_cursor__set_and_reset_refused_on_a_binding_that_is_not_incremental(
    http: Any, operator_token: str
) -> None:
    BindingFactory(name="orders")
    problem = assert_problem(
        http("PUT", "/bindings/orders/cursor", token=operator_token, body={"cursor": ["1"]}), 409
    )
    assert problem["code"] == "NOT_INCREMENTAL"
    problem = assert_problem(http("DELETE", "/bindings/orders/cursor", token=operator_token), 409)
    assert problem["code"] == "NOT_INCREMENTAL"


def test_cursor__the_services_checks_answer_with_the_field(http: Any, operator_token: str) -> None:
    # An incremental spec (checked without a connection); a null sink keeps no cursor.
    source = DatasourceFactory(kind="postgresql", config={"host": "db.example"})
    job = JobFactory(source_spec={"table": "items", "incremental": {"cursor": ["id"]}})
    BindingFactory(name="inc", job=job, source=source)
    wrong = http("PUT", "/bindings/inc/cursor", token=operator_token, body={"cursor": ["1", "2"]})
    problem = assert_problem(wrong, 422, "give 1 value")
    assert problem["code"] == "BAD_CURSOR" and problem["errors"][0]["field"] == "cursor"
    big = http("PUT", "/bindings/inc/cursor", token=operator_token, body={"cursor": ["x" * 5000]})
    assert assert_problem(big, 422)["code"] == "BAD_CURSOR"
    typed = http("PUT", "/bindings/inc/cursor", token=operator_token, body={"cursor": [1]})
    assert assert_problem(typed, 422)["errors"][0]["field"] == "cursor[0]"
    sink = http("PUT", "/bindings/inc/cursor", token=operator_token, body={"cursor": ["7"]})
    assert assert_problem(sink, 409, "keeps no cursor")["code"] == "SINK_FAILED"


# --- bad input ----------------------------------------------------------------------------
def test_a_body_over_the_limit__413_before_it_is_read(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    with override_settings(DISPATCH_API_MAX_BODY_BYTES=1000):
        answer = http(
            "POST",
            "/bindings/orders/trigger",
            token=operator_token,
            raw=json.dumps({"idempotency_key": "k" * 2000}).encode(),
        )
    problem = assert_problem(answer, 413, "1000 bytes")
    assert problem["errors"] == [{"field": "body", "message": problem["errors"][0]["message"]}]
    assert not Run.objects.exists()


def test_a_body_over_djangos_own_limit__413_not_500(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    with override_settings(DISPATCH_API_MAX_BODY_BYTES=10 << 20, DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        answer = http("POST", "/bindings/orders/trigger", token=operator_token, raw=b" " * 5000)
    assert_problem(answer, 413)


def test_deep_json__400_naming_the_body(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    deep = b"[" * 50_000 + b"]" * 50_000
    answer = http("POST", "/bindings/orders/trigger", token=operator_token, raw=deep)
    problem = assert_problem(answer, 400, "nested")
    assert problem["errors"][0]["field"] == "body"
    # Just over the limit, also refused (the value check after the text check).
    just = json.dumps({"idempotency_key": "k", "x": json.loads("[" * 33 + "]" * 33)}).encode()
    assert_problem(http("POST", "/bindings/orders/trigger", token=operator_token, raw=just), 400)
    assert not Run.objects.exists()


def test_a_body_that_is_not_json__400(http: Any, operator_token: str) -> None:
    BindingFactory(name="orders")
    answer = http("POST", "/bindings/orders/trigger", token=operator_token, raw=b"{nope")
    assert_problem(answer, 400, "not JSON")


@pytest.mark.parametrize(
    "query",
    ["limit=0", "limit=201", "limit=x", "status=NOPE", "since=yesterday", "cursor=%25%25"],
)
def test_runs_list__bad_query_is_a_422_naming_it(
    http: Any, operator_token: str, query: str
) -> None:
    answer = http("GET", f"/runs?{query}", token=operator_token)
    problem = assert_problem(answer, 422)
    assert [e["field"] for e in problem["errors"]] == [query.split("=")[0]]


def test_wait__a_timeout_over_the_maximum_is_a_422(http: Any, operator_token: str) -> None:
    run = Run.objects.create(binding=BindingFactory())
    answer = http("GET", f"/runs/{run.pk}/wait?timeout=61", token=operator_token)
    assert_problem(answer, 422, "60")


# --- secrets ------------------------------------------------------------------------------
SECRET = "pw-never-in-any-answer-7f3a"


def test_no_answer_carries_a_datasource_secret(http: Any, api_url: str) -> None:
    source = DatasourceFactory(
        kind="postgresql",
        config={"host": "db.example", "dbname": "shop", "user": "reader", "password": SECRET},
    )
    binding = BindingFactory(name="orders", source=source)
    run = services.trigger(binding)
    # The claim's redacted copy and an error naming the datasource, as a worker leaves them.
    run.attempts.update(
        source_redacted={"host": "db.example", "password": "********"},
        error="connection to db.example failed",
        status=Status.FAILED,
        finished_at=Now(),
        reason="ERROR",
    )
    Run.objects.filter(pk=run.pk).update(status=Status.FAILED, finished_at=Now())
    # Even a superuser's token: no endpoint returns datasource settings at all.
    _, token = make_token(make_user("root", *ALL, is_superuser=True))
    answers = [
        http("GET", "/bindings", token=token),
        http("GET", "/bindings/orders", token=token),
        http("GET", "/runs", token=token),
        http("GET", f"/runs/{run.pk}", token=token),
        http("GET", f"/runs/{run.pk}/wait?timeout=0", token=token),
        http("POST", f"/runs/{run.pk}/retry", token=token),
        http("POST", "/bindings/orders/trigger", token=token),
        call(api_url.removesuffix("/v1"), "GET", "/openapi.json"),
    ]
    for answer in answers:
        assert answer.status < 300, answer.text
        assert SECRET not in answer.text
        assert "reader" not in answer.text and "********" not in answer.text


# --- the OpenAPI document -----------------------------------------------------------------
def test_openapi_document_validates_and_describes_problems(api_url: str) -> None:
    answer = call(api_url.removesuffix("/v1"), "GET", "/openapi.json")
    assert answer.status == 200
    document = answer.json
    validate(document)  # OpenAPI 3.1, by openapi-spec-validator
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    assert {
        "/api/v1/bindings",
        "/api/v1/bindings/{ref}",
        "/api/v1/bindings/{ref}/trigger",
        "/api/v1/bindings/{ref}/cursor",
        "/api/v1/runs",
        "/api/v1/runs/{run_id}",
        "/api/v1/runs/{run_id}/wait",
        "/api/v1/runs/{run_id}/cancel",
        "/api/v1/runs/{run_id}/retry",
    } <= set(paths)
    trigger = paths["/api/v1/bindings/{ref}/trigger"]["post"]
    assert set(trigger["responses"]) >= {"200", "201", "401", "403", "404", "409", "422"}
    assert list(trigger["responses"]["403"]["content"]) == ["application/problem+json"]
    schemes = document["components"]["securitySchemes"]
    assert schemes["TokenAuth"] == {"type": "http", "scheme": "bearer"}
