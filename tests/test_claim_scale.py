"""The worker's queries at queue scale: the claim reads what it returns, whatever sits
beside it (blocked, due, finished work; fresh or stale statistics); the timer query's plan
bounds the walk by an index condition on available_at; the refresh of blocked marks is
bounded by the number of bindings.

Counts work (EXPLAIN (ANALYZE, BUFFERS)), never times it. 20,000 due PENDING attempts are
inserted with INSERT ... SELECT generate_series and ANALYZEd."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from dispatch import claims
from dispatch.sqlfiles import query
from tests.factories import BindingFactory

DUE = 20_000
# The min() over an index range that starts after now: the index root, one or two inner
# pages and the first leaf, plus the heap page of the entry found. A walk over the due
# backlog reads its 20,000 index entries (dozens of leaf pages) and their heap pages.
MAX_BUFFERS = 20
# The claim of 10 attempts: reading them through the eligible index plus writing them
# (heap and a dozen indexes of two tables) costs about 1,000-1,900 buffers on the test
# server whatever sits beside them. Version 1 read 61,436 beside 20,000 blocked attempts:
# it walked them.
MAX_CLAIM_BUFFERS = 2_500
MAX_DIRECTED_BUFFERS = 400
# The refresh: one pass over the bindings with a few index probes each.
MAX_REFRESH_BUFFERS = 200


def queue(binding_id: str, n: int, due: bool) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH r AS (
                INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                          requested_by)
                SELECT gen_random_uuid(), %(b)s::uuid, 'MANUAL', 'PENDING',
                       now() - make_interval(secs => i), ''
                FROM generate_series(1, %(n)s) AS i
                RETURNING id, created_at)
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, reason, error, rows_read,
                                          rows_written)
            SELECT gen_random_uuid(), r.id, 1, 'TRIGGER', 'PENDING', r.created_at,
                   CASE WHEN %(due)s THEN r.created_at
                        ELSE now() + interval '1 hour' END,
                   NULL, '', 0, 0
            FROM r
            """,
            {"b": binding_id, "n": n, "due": due},
        )


def nodes(node: dict[str, Any]):
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


@pytest.mark.django_db
def test_timer_query_has_an_index_condition_on_available_at_and_skips_the_due_backlog():
    binding = BindingFactory()
    queue(str(binding.pk), DUE, due=True)
    queue(str(binding.pk), 1, due=False)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE dispatch_run")
        cursor.execute("ANALYZE dispatch_attempt")
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("next_available_in"))
        (raw,) = cursor.fetchone()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "dispatch_attempt"]
    assert scans, plan
    assert all("Seq Scan" not in n["Node Type"] for n in scans), plan
    assert any("available_at >" in n.get("Index Cond", "") for n in scans), plan
    buffers = sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in scans)
    assert buffers <= MAX_BUFFERS, (buffers, plan)
    delay = claims.next_available_in()
    assert delay is not None and 3500 < delay <= 3600


# --- the claim -----------------------------------------------------------------------------
def finished(binding_id: str, n: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH r AS (
                INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                          finished_at, requested_by)
                SELECT gen_random_uuid(), %(b)s::uuid, 'MANUAL', 'SUCCEEDED',
                       now() - make_interval(secs => i), now(), ''
                FROM generate_series(1, %(n)s) AS i
                RETURNING id, created_at)
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, finished_at, reason, error,
                                          rows_read, rows_written)
            SELECT gen_random_uuid(), r.id, 1, 'TRIGGER', 'SUCCEEDED', r.created_at,
                   r.created_at, now(), NULL, '', 0, 0
            FROM r
            """,
            {"b": binding_id, "n": n},
        )


def claim_buffers(limit: int = 10, run: str | None = None) -> tuple[int, int]:
    """Buffers the real claim call reads (hit + read, every statement inside it), and
    how many attempts it claimed; rolled back, so the queue is unchanged."""
    with connection.cursor() as cursor:
        cursor.execute("SAVEPOINT measure")
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)"
            " SELECT * FROM dispatch_claim_v3('measure', %s::uuid, %s, %s)",
            [run, limit, run is None],
        )
        (raw,) = cursor.fetchone()
        cursor.execute("ROLLBACK TO SAVEPOINT measure")
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], int(plan["Actual Rows"])


def analyze() -> None:
    with connection.cursor() as cursor:
        for table in ("dispatch_run", "dispatch_attempt", "dispatch_jobbinding"):
            cursor.execute(f"ANALYZE {table}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "beside",
    ["nothing", "blocked", "blocked-stats-while-empty", "due-eligible", "finished"],
)
def test_claim__reads_a_bounded_number_of_buffers_whatever_sits_beside(beside: str) -> None:
    from dispatch.models import JobBinding, Run

    wanted = BindingFactory(max_concurrency=100)
    other = BindingFactory(max_concurrency=100)
    if beside == "blocked-stats-while-empty":
        analyze()  # statistics of an empty queue, kept while it fills
    if beside.startswith("blocked"):
        # Disabled first: the attempts are marked as they are queued (the steady state;
        # marks written by a later disable leave dead index entries until vacuum).
        JobBinding.objects.filter(pk=other.pk).update(enabled=False)
        queue(str(other.pk), DUE, due=True)  # older than the eligible ten
    elif beside == "due-eligible":
        queue(str(other.pk), DUE, due=True)
    elif beside == "finished":
        finished(str(other.pk), 100_000)
    queue(str(wanted.pk), 10, due=True)
    if beside != "blocked-stats-while-empty":
        analyze()
    claim_buffers()  # the first call in a session compiles the function: not counted
    buffers, claimed = claim_buffers()
    assert claimed == 10
    # The directed claim of one notified run (no generic fallback).
    newest = Run.objects.filter(binding=wanted).order_by("-created_at").first()
    directed, one = claim_buffers(limit=1, run=str(newest.pk))
    assert one == 1
    print(f"{beside}: {buffers} buffers, directed {directed}")
    assert buffers <= MAX_CLAIM_BUFFERS, (beside, buffers)
    assert directed <= MAX_DIRECTED_BUFFERS, (beside, directed)


@pytest.mark.django_db
def test_refresh_blocked__reads_a_bounded_number_of_buffers_beside_a_blocked_backlog() -> None:
    from dispatch.models import JobBinding

    blocked = BindingFactory()
    JobBinding.objects.filter(pk=blocked.pk).update(enabled=False)
    queue(str(blocked.pk), DUE, due=True)
    queue(str(BindingFactory().pk), DUE, due=True)
    analyze()
    assert claims.refresh_blocked() == 0  # nothing was stale; and the function is compiled
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT dispatch_refresh_blocked_v3()"
        )
        (raw,) = cursor.fetchone()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    buffers = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert buffers <= MAX_REFRESH_BUFFERS, buffers
