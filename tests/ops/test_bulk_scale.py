"""A bulk operation's batch costs the same at 2,000 runs and at 1,000,000: it reads the
rows after its keyset cursor, never the table before it. Counts work (the server's
per-transaction tuple counters, and the buffers of the batch's read under EXPLAIN
(ANALYZE, BUFFERS)), never times it.

The tables are built by INSERT ... SELECT generate_series: 2,000 runs of which a quarter
FAILED, then 998,000 more of which one in a thousand FAILED (an outage's failures among a
long history), each FAILED run with its attempt (the retry reads and writes them); the
others SUCCEEDED, without attempts (the batch must never reach them: they make the run
table and its indexes large, and the FAILED rows sparse in primary-key order, where a walk
of the primary key would read a thousand runs for each one it retries)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection

from dispatch.models import BulkOperation, BulkStatus
from dispatch.ops import bulk
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db

SMALL = 2_000
LARGE = 1_000_000
BATCH = 200
BIG = ("dispatch_run", "dispatch_attempt")


def add_runs(binding_id: object, n: int, every: int) -> None:
    """`n` runs: one in `every` FAILED with one attempt, the others SUCCEEDED."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH r AS (
                INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                          finished_at, requested_by)
                SELECT gen_random_uuid(), %(b)s::uuid, 'MANUAL',
                       CASE WHEN i %% %(every)s = 0 THEN 'FAILED' ELSE 'SUCCEEDED' END,
                       now() - make_interval(secs => i + 1), now() - make_interval(secs => i),
                       ''
                FROM generate_series(1, %(n)s) AS i
                RETURNING id, status, created_at, finished_at)
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, claimed_at, finished_at, reason,
                                          error, rows_read, rows_written)
            SELECT gen_random_uuid(), r.id, 1, 'TRIGGER', 'FAILED', r.created_at,
                   r.created_at, r.created_at, r.finished_at, 'ERROR', '', 0, 0
            FROM r WHERE r.status = 'FAILED'
            """,
            {"b": str(binding_id), "n": n, "every": every},
        )
        cursor.execute("ANALYZE dispatch_run")
        cursor.execute("ANALYZE dispatch_attempt")


def counters() -> tuple[int, int]:
    """Heap tuples of the run and attempt tables read by this transaction so far, and its
    sequential scans of them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(idx_tup_fetch + seq_tup_read), sum(seq_scan)"
            " FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [list(BIG)],
        )
        read, scans = cursor.fetchone()
    return int(read or 0), int(scans or 0)


def batch_read_buffers(operation: BulkOperation) -> tuple[int, list[str]]:
    """The buffers the batch's read touches, and its plan's node types."""
    sql, params = bulk.next_rows(operation, BATCH).query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    top: dict[str, Any] = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    nodes, stack = [], [top]
    while stack:
        node = stack.pop()
        nodes.append(
            f"{node['Node Type']} {node.get('Relation Name', '')} {node.get('Index Name', '')}"
        )
        stack += node.get("Plans", [])
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)), nodes


def one_batch(user: User) -> tuple[int, int, int, list[str]]:
    """A retry of the FAILED runs, its cursor past the first 100 of them: the cost of its
    next batch (tuples read, sequential scans, buffers of the read, the read's plan)."""
    operation = bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    first = list(
        bulk.matching("run", operation.filters).order_by("pk").values_list("pk", flat=True)[99:100]
    )
    BulkOperation.objects.filter(pk=operation.pk).update(cursor=first[0])
    operation.refresh_from_db()
    buffers, plan = batch_read_buffers(operation)
    before_read, before_scans = counters()
    report = bulk.work_batch(BATCH)
    read, scans = counters()
    assert report is not None and report.done == BATCH and report.status == BulkStatus.PENDING
    BulkOperation.objects.filter(pk=operation.pk).update(status=BulkStatus.CANCELLED)
    return read - before_read, scans - before_scans, buffers, plan


def test_bulk_batch__costs_the_same_at_a_million_runs_as_at_two_thousand() -> None:
    binding = BindingFactory(enabled=False)
    user = User.objects.create_superuser("root")
    add_runs(binding.pk, SMALL, every=4)
    small_read, small_scans, small_buffers, small_plan = one_batch(user)

    add_runs(binding.pk, LARGE - SMALL, every=1000)
    large_read, large_scans, large_buffers, large_plan = one_batch(user)

    # The batch's read is a range of (status, id) at both sizes, never a scan of the runs.
    for plan in (small_plan, large_plan):
        assert any("dispatch_run_status_id_idx" in node for node in plan), plan
        assert not any(node.startswith("Seq Scan dispatch_run") for node in plan), plan
    assert small_scans == large_scans == 0
    # Per run retried: its row, its attempts, the binding; a few tuples each. The same at
    # both sizes (a B-tree one level deeper costs a buffer, not a tuple).
    assert small_read <= 20 * BATCH, small_read
    # At most two tuples more per run retried: the plans of the retry's lookups depend on
    # the indexes' physical size too, which earlier tests of the session leave bloated
    # (measured 1,203 -> 1,203 alone, 1,201 -> 1,403 after tests/worker/test_claim_scale.py);
    # a batch that read every FAILED run or walked the table grows with the matches
    # (1,500 -> 2,298 without the index).
    assert large_read <= small_read + 2 * BATCH, (small_read, large_read)
    # The read's buffers: the index range and the 200 heap pages it points into, plus a
    # level or two of the larger B-trees.
    assert large_buffers <= small_buffers * 1.5 + 20, (small_buffers, large_buffers)
    print(
        f"per batch of {BATCH}: tuples read {small_read} at {SMALL:,} runs, {large_read} at "
        f"{LARGE:,}; buffers of the read {small_buffers} and {large_buffers}"
    )
