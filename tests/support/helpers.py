"""Small helpers for tests that drive the claim, settle and recovery SQL directly."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from django.db import connection, connections
from django.db.models import DurationField, Value
from django.db.models.functions import Now

from dispatch.models import Attempt, Run
from dispatch.worker import claims
from tests.support.processes import test_database_url


def expire(attempt: Attempt | Any, seconds_ago: float = 1.0) -> None:
    """Move an attempt's lease into the past, by database time (what a dead worker does)."""
    Attempt.objects.filter(pk=attempt.pk).update(
        lease_until=Now() - Value(timedelta(seconds=seconds_ago), output_field=DurationField())
    )


def claim_one(worker: str = "w1", **kwargs: Any) -> claims.ClaimedAttempt:
    got = claims.claim(worker, **kwargs)
    assert len(got) == 1, f"expected one claim, got {got}"
    return got[0]


def attempts_of(run: Run) -> list[Attempt]:
    return list(Attempt.objects.filter(run=run).order_by("number"))


def raw_connection() -> psycopg.Connection[Any]:
    """A second connection of our own (to hold locks while the code under test runs)."""
    return psycopg.connect(test_database_url(), autocommit=False)


def in_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """Run target(i) in n threads started together; return results (re-raising errors)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


__all__ = ["attempts_of", "claim_one", "connection", "expire", "in_threads", "raw_connection"]


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    found = [node]
    for child in node.get("Plans", []):
        found += plan_nodes(child)
    return found


def buffers(sql: str) -> tuple[int, dict[str, Any]]:
    """The shared buffers (hit + read) one SELECT touches, and its plan: what a query
    costs, independent of the machine's speed (EXPLAIN (ANALYZE, BUFFERS))."""
    import json

    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        plan = json.loads(plan)
    top = plan[0]["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)), top
