"""The run list's keyset pages: every run exactly once (ties on created_at included),
filters, and a page that costs the same buffers whatever the number of runs."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from dispatch.http import reads
from dispatch.models import JobBinding, Run
from tests.support.factories import BindingFactory
from tests.support.helpers import buffers, plan_nodes


def insert_runs(binding: JobBinding, n: int, *, start: int = 1, tie: int = 1) -> None:
    """`n` runs, `tie` of them sharing each creation time (as one trigger_many may)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, requested_by)
            SELECT gen_random_uuid(), %(b)s::uuid, 'API',
                   CASE WHEN i %% 3 = 0 THEN 'FAILED' ELSE 'SUCCEEDED' END,
                   timestamptz '2026-01-01' - make_interval(secs => (i / %(tie)s) * 6), ''
            FROM generate_series(%(start)s, %(end)s) AS i
            """,
            {"b": str(binding.pk), "start": start, "end": start + n - 1, "tie": tie},
        )
        cursor.execute("ANALYZE dispatch_run")


def walk(get: Any, query: str) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = get(f"/runs?{query}" + (f"&cursor={cursor}" if cursor else ""))
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


@pytest.mark.django_db(transaction=True)
def test_keyset_pages_return_every_run_once_in_order(http: Any, operator_token: str) -> None:
    a, b = BindingFactory(name="a"), BindingFactory(name="b")
    insert_runs(a, 23, tie=4)
    insert_runs(b, 11, start=100, tie=3)

    def get(path: str) -> Any:
        answer = http("GET", path, token=operator_token)
        assert answer.status == 200, answer.text
        return answer.json

    everything = walk(get, "limit=3")
    ids = [r["id"] for r in everything]
    assert len(ids) == len(set(ids)) == 34
    assert set(ids) == {str(i) for i in Run.objects.values_list("pk", flat=True)}
    keys = [(r["created_at"], uuid.UUID(r["id"])) for r in everything]
    assert keys == sorted(keys, reverse=True)
    of_a = walk(get, "limit=4&binding=a")
    assert len(of_a) == 23 and {r["binding"] for r in of_a} == {"a"}
    failed = walk(get, "limit=2&status=FAILED")
    assert {r["id"] for r in failed} == {
        str(i) for i in Run.objects.filter(status="FAILED").values_list("pk", flat=True)
    }
    since = everything[10]["created_at"]
    recent = walk(get, f"limit=5&since={since.replace('+', '%2B')}")
    assert [r["id"] for r in recent] == [r["id"] for r in everything if r["created_at"] >= since]


@pytest.mark.django_db(transaction=True)
def test_a_cursor_that_was_not_issued_is_a_422(http: Any, operator_token: str) -> None:
    for cursor in ("abc", "W10", "WyJ4IiwgInkiXQ"):  # garbage, [], ["x", "y"]
        answer = http("GET", f"/runs?cursor={cursor}", token=operator_token)
        assert answer.status == 422, answer.text
        assert answer.json["errors"][0]["field"] == "cursor"


def page_cost(client: Client, url: str) -> tuple[int, list[str]]:
    """The buffers the run queries of one page touch, and their plans' node types."""
    with CaptureQueriesContext(connection) as queries:
        answer = client.get(url)
    assert answer.status_code == 200, answer.content
    total, nodes = 0, []
    for q in queries.captured_queries:
        if "dispatch_run" in q["sql"] and q["sql"].lstrip().upper().startswith("SELECT"):
            cost, plan = buffers(q["sql"])
            total += cost
            nodes += [n["Node Type"] + ":" + n.get("Relation Name", "") for n in plan_nodes(plan)]
    return total, nodes


def vacuum() -> None:
    """Dead rows other tests rolled back (the console's 100,000 runs) would be read by the
    first scan that meets them: gone, the buffers counted are the query's own."""
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE dispatch_run")


# Committed, not in a transaction: VACUUM runs outside one.
@pytest.mark.django_db(transaction=True)
def test_a_page_costs_the_same_with_few_and_many_runs() -> None:
    """Flat cost: the first page and a deep page read about as many buffers with 75 runs
    as with 60,000 (an OFFSET or a count would grow with the table: hundreds of buffers
    more), and no plan scans or sorts the whole table."""
    a, b = BindingFactory(name="a"), BindingFactory(name="b")
    client = Client()
    client.force_login(User.objects.create_superuser("root"))

    def costs(shape: bool) -> dict[str, int]:
        found = {}
        for name, query in [
            ("all", "limit=50"),
            ("binding", "limit=50&binding=a"),
            ("status", "limit=50&status=SUCCEEDED"),
        ]:
            first = client.get(f"/api/v1/runs?{query}").json()
            cost, nodes = page_cost(client, f"/api/v1/runs?{query}")
            if shape:  # (a table of 150 rows is read whole: the planner's right choice)
                assert not [n for n in nodes if n.startswith("Seq Scan:dispatch_run")], nodes
                assert "Sort:" not in nodes, nodes  # an Incremental Sort over ties only
            found[name] = cost
            deep, _ = page_cost(client, f"/api/v1/runs?{query}&cursor={first['next_cursor']}")
            found[f"{name}, page 2"] = deep
        return found

    insert_runs(a, 75, tie=2)
    insert_runs(b, 75, start=1000, tie=2)
    vacuum()
    few = costs(shape=False)
    insert_runs(a, 30_000, start=10_000, tie=2)
    insert_runs(b, 30_000, start=50_000, tie=2)
    vacuum()
    many = costs(shape=True)
    # A page from the middle of the 60,150 runs.
    middle = Run.objects.order_by("-created_at", "-id")[30_000]
    token = reads.encode_cursor(middle.created_at.isoformat(), middle.pk)
    many["all, page 2"] = max(
        many["all, page 2"], page_cost(client, f"/api/v1/runs?limit=50&cursor={token}")[0]
    )
    for name, cost in few.items():
        # One more index level at most, and pages of equal rows on other heap pages.
        assert many[name] <= cost + 12, (name, few, many)
