"""The worker's queries at queue scale: the claim reads what it returns, whatever sits
beside it (blocked, due, finished work; fresh or stale statistics); the timer query's plan
bounds the walk by an index condition on available_at; the refresh of blocked marks is
bounded by the number of bindings; the heartbeat's look at the queue reads single index
entries.

Counts work (EXPLAIN (ANALYZE, BUFFERS)), never times it. 20,000 due PENDING attempts are
inserted with INSERT ... SELECT generate_series and ANALYZEd."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from dispatch.core.sqlfiles import query
from dispatch.worker import claims
from tests.support.factories import BindingFactory

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
# Attempt rows a claim reads: about one per attempt it claims, and a few hundred at most
# where the planner rightly scans a small table (the wanted binding's own rows); a walk
# beside the 20,000 reads them all.
MAX_ROWS_READ = 300
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


def attempt_tuples_read() -> int:
    """Heap tuples of dispatch_attempt this transaction has read so far (fetched by index
    scans or read by sequential ones): the server's per-transaction counters."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
            " WHERE relname = 'dispatch_attempt'"
        )
        return int(cursor.fetchone()[0])


def claim_buffers(limit: int = 10, run: str | None = None) -> tuple[int, int, int]:
    """Buffers the real claim call reads (hit + read, every statement inside it), how many
    attempts it claimed, and how many attempt rows it read; rolled back, so the queue is
    unchanged."""
    with connection.cursor() as cursor:
        cursor.execute("SAVEPOINT measure")
        before = attempt_tuples_read()
        # The worker's own statement (dispatch.worker.claims.claim).
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("claim"),
            {"worker": "measure", "run": run, "limit": limit, "generic": run is None},
        )
        (raw,) = cursor.fetchone()
        read = attempt_tuples_read() - before
        cursor.execute("ROLLBACK TO SAVEPOINT measure")
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"], int(plan["Actual Rows"]), read


def make_busy(binding_id: str) -> None:
    """A binding at capacity: max_concurrency 1 and one run RUNNING."""
    from dispatch.models import JobBinding

    JobBinding.objects.filter(pk=binding_id).update(max_concurrency=1)
    queue(binding_id, 1, due=True)
    assert len(claims.claim("busy", limit=1)) == 1


def analyze() -> None:
    with connection.cursor() as cursor:
        for table in ("dispatch_run", "dispatch_attempt", "dispatch_jobbinding"):
            cursor.execute(f"ANALYZE {table}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "beside",
    ["nothing", "blocked", "blocked-stats-while-empty", "due-eligible", "finished", "at-capacity"],
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
    elif beside == "at-capacity":
        # A queue older than the eligible ten: version 3 walked it, filtering each entry
        # by capacity.
        make_busy(str(other.pk))
        queue(str(other.pk), DUE, due=True)
    queue(str(wanted.pk), 10, due=True)
    if beside != "blocked-stats-while-empty":
        analyze()
    claim_buffers()  # the first call in a session compiles the function: not counted
    buffers, claimed, read = claim_buffers()
    assert claimed == 10
    # The directed claim of one notified run (no generic fallback).
    newest = Run.objects.filter(binding=wanted).order_by("-created_at").first()
    claim_buffers(limit=1, run=str(newest.pk))  # its statements planned: not counted
    directed, one, directed_read = claim_buffers(limit=1, run=str(newest.pk))
    assert one == 1
    print(f"{beside}: {buffers} buffers, {read} rows; directed {directed}, {directed_read}")
    assert buffers <= MAX_CLAIM_BUFFERS, (beside, buffers)
    assert directed <= MAX_DIRECTED_BUFFERS, (beside, directed)
    # The rows it read are the rows it returned (plus the re-check of each), not the
    # 20,000 beside them: version 3 read 20,010 beside the busy binding's queue.
    assert read <= MAX_ROWS_READ, (beside, read)
    assert directed_read <= MAX_ROWS_READ, (beside, directed_read)


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
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT dispatch_refresh_blocked_v4()"
        )
        (raw,) = cursor.fetchone()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    buffers = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert buffers <= MAX_REFRESH_BUFFERS, buffers


# --- the heartbeat's look at the queue -------------------------------------------------
# Three single-entry probes of two partial indexes and one heap page each: about a dozen
# buffers. A walk of the pending index past 20,000 blocked attempts reads hundreds.
MAX_VIEW_BUFFERS = 60


def view_buffers() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM dispatch_queue_view_v4()"
        )
        (raw,) = cursor.fetchone()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "beside", ["nothing", "blocked", "blocked-stats-while-empty", "finished", "at-capacity"]
)
def test_queue_view__sees_only_eligible_work_and_reads_a_bounded_number_of_buffers(
    beside: str,
) -> None:
    from dispatch.models import Attempt, JobBinding

    # Committed, so the table can be vacuumed first: the other tests here roll back
    # tens of thousands of inserts, whose dead index entries a probe would step over
    # until a vacuum (as in production between autovacuums; measured apart).
    with connection.cursor() as cursor:
        cursor.execute("VACUUM dispatch_attempt")
    wanted = BindingFactory(max_concurrency=100)
    other = BindingFactory(max_concurrency=100)
    if beside == "blocked-stats-while-empty":
        analyze()
    if beside.startswith("blocked"):
        JobBinding.objects.filter(pk=other.pk).update(enabled=False)
        queue(str(other.pk), DUE, due=True)  # due, and older than anything eligible
        queue(str(other.pk), DUE, due=False)  # and due in an hour
    elif beside == "finished":
        finished(str(other.pk), 100_000)
    elif beside == "at-capacity":
        make_busy(str(other.pk))
        queue(str(other.pk), DUE, due=True)  # held: marked on insert
        queue(str(other.pk), DUE, due=False)
        Attempt.objects.filter(status="RUNNING").update(lease_until=Now() + timedelta(seconds=3600))
    if beside != "blocked-stats-while-empty":
        analyze()
    # Blocked work is neither due nor a timer for the worker.
    view = claims.queue_view()
    assert view.due_for is None and view.next_in is None, view
    if beside != "at-capacity":
        assert view.expiry_in is None, view

    queue(str(wanted.pk), 1, due=False)
    view = claims.queue_view()
    assert view.due_for is None and view.next_in is not None, view
    assert 3500 < view.next_in <= 3600, view
    queue(str(wanted.pk), 10, due=True)
    running = Attempt.objects.filter(run__binding=wanted, available_at__lte=Now()).first()
    Attempt.objects.filter(pk=running.pk).update(
        status="RUNNING",
        worker_id="w",
        lease_token=1,
        claimed_at=Now(),
        lease_until=Now() + timedelta(seconds=30),
    )
    view = claims.queue_view()
    # The oldest of the ten has been due for 10 s (queue() spaces them a second apart).
    assert view.due_for is not None and 8 < view.due_for < 60, view
    assert view.expiry_in is not None and 25 < view.expiry_in <= 30, view  # the earliest

    view_buffers()  # a plan invalidated meanwhile (an autovacuum's ANALYZE) is re-made here
    buffers = view_buffers()
    print(f"{beside}: {buffers} buffers")
    assert buffers <= MAX_VIEW_BUFFERS, (beside, buffers)


def run_table_scans() -> tuple[int, int]:
    """Sequential and index scans of dispatch_run in this transaction so far."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables WHERE relname = 'dispatch_run'"
        )
        seq, idx = cursor.fetchone()
    return int(seq), int(idx)


@pytest.mark.django_db
def test_attempt_insert_trigger__stays_on_primary_keys_under_statistics_of_an_empty_queue():
    """The insert trigger looks up each attempt's run and binding, with plans cached for
    the session. Planned at the first row of a bulk insert after statistics of an empty
    queue (the run table then one page), the lookup scanned the whole, growing run table
    for every attempt: 20,000 queued in one statement took a minute. Now each is one
    primary-key probe, whatever the statistics. Counted by the server's per-transaction
    scan counters."""
    binding = BindingFactory()
    analyze()  # the queue is empty: statistics that say so (and cached plans re-made)
    seq_before, idx_before = run_table_scans()
    queue(str(binding.pk), DUE, due=True)  # runs and their attempts in one statement
    seq, idx = run_table_scans()
    assert seq - seq_before == 0, seq - seq_before  # version 3's trigger: 20,000
    assert idx - idx_before >= DUE
