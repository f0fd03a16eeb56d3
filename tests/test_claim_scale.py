"""The worker's timer query at queue scale: its plan bounds the walk by an index condition
on available_at, so a due backlog beside the one future attempt it looks for is not read.

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
