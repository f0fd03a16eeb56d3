"""Slices in the dispatch database, driven through the real SQL (no connector): planning
(dispatch_slices_plan_v1), the settlement of slices and of their parent
(dispatch_slice_settled inside dispatch_settle_v3), max_slices_in_flight, the operator's
cancel and retry of a sliced run, siblings settling at once, and what the claim and the
settlement read beside 10,000 queued slices (buffers counted, never timed)."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
from django.db import connection

from dispatch import services
from dispatch.core.sqlfiles import query
from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, JobBinding, Run, Slice, SlicePlan
from dispatch.worker import claims
from tests.support import factories
from tests.support.helpers import expire, in_threads, raw_connection
from tests.support.processes import wait_until

SPEC = {"table": "items", "slices": {"key": "id", "count": 4}}


def sliced_binding(in_flight: int | None = None, concurrency: int = 100) -> JobBinding:
    job = factories.JobFactory(max_slices_in_flight=in_flight, max_attempts=2)
    return factories.BindingFactory(job=job, max_concurrency=concurrency)


def bounds(n: int) -> list[tuple[str | None, str | None]]:
    edges: list[str | None] = [None, *[str(i * 100) for i in range(1, n)], None]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def planned(n: int, in_flight: int | None = None, concurrency: int = 100) -> Run:
    """A run planned into `n` slices of id by its (claimed) first attempt."""
    binding = sliced_binding(in_flight, concurrency)
    run = factories.trigger(binding)
    c = claims.claim("planner", run_id=run.pk, limit=1)[0]
    status, started = claims.plan_slices(
        c.attempt_id,
        c.lease_token,
        key="id",
        key_type="bigint",
        method="count",
        basis="test",
        bounds=bounds(n),
        source_spec=SPEC,
        sink_spec={"table": "copy"},
    )
    assert status == Status.WAITING
    assert len(started) == min(n, in_flight or n)
    return Run.objects.get(pk=run.pk)


def claim_slice(number: int, parent: Run, worker: str = "w") -> claims.ClaimedAttempt:
    run = Run.objects.get(parent=parent, slice_number=number)
    got = claims.claim(worker, run_id=run.pk, limit=1, generic=False)
    assert len(got) == 1, f"slice {number} not claimable"
    return got[0]


def plan_of(run: Run) -> SlicePlan:
    return SlicePlan.objects.get(run=run)


@pytest.mark.django_db
def test_plan__records_the_ranges_starts_the_first_slices_and_waits() -> None:
    parent = planned(5, in_flight=2)
    assert parent.status == Status.WAITING and parent.finished_at is None
    (planning,) = Attempt.objects.filter(run=parent)
    assert (planning.status, planning.reason) == (Status.SUCCEEDED, Reason.SLICES_PLANNED)
    assert planning.source_snapshot is None
    plan = plan_of(parent)
    assert (plan.total, plan.in_flight, plan.live, plan.succeeded) == (5, 2, 2, 0)
    assert plan.source_spec == SPEC
    assert [(s.number, s.lower, s.upper) for s in Slice.objects.filter(parent=parent)] == [
        (1, None, "100"), (2, "100", "200"), (3, "200", "300"), (4, "300", "400"), (5, "400", None)
    ]  # fmt: skip
    children = list(Run.objects.filter(parent=parent).order_by("slice_number"))
    assert [c.slice_number for c in children] == [1, 2]
    # Version-8 ids: the worker tells a slice from its claim.
    assert all(claims.is_slice_run(c.pk) for c in children)
    assert not claims.is_slice_run(parent.pk)
    assert all(c.binding_id == parent.binding_id for c in children)
    assert [a.status for c in children for a in c.attempts.all()] == ["PENDING", "PENDING"]
    # A WAITING run holds no capacity and has nothing to claim.
    assert not Run.objects.filter(binding=parent.binding, status=Status.RUNNING).exists()
    assert claims.claim("other", run_id=parent.pk, limit=1, generic=False) == []
    assert claims.slice_of(children[0].pk) == claims.SliceOf(
        parent.pk, 1, None, "100", 5, "id", "bigint", SPEC, {"table": "copy"}
    )


@pytest.mark.django_db
def test_plan__a_lost_planning_attempt_records_nothing() -> None:
    binding = sliced_binding()
    run = factories.trigger(binding)
    c = claims.claim("planner", run_id=run.pk, limit=1)[0]
    status, started = claims.plan_slices(
        c.attempt_id, c.lease_token + 1, key="id", key_type="bigint", method="count",
        basis="", bounds=bounds(3), source_spec=SPEC, sink_spec={},
    )  # fmt: skip
    assert (status, started) == (None, [])
    assert not SlicePlan.objects.filter(run=run).exists()
    assert Run.objects.get(pk=run.pk).status == Status.RUNNING


@pytest.mark.django_db
def test_settle__each_slice_starts_the_next_and_the_last_succeeds_the_run() -> None:
    parent = planned(4, in_flight=2)
    for number, rows in ((1, 10), (2, 20), (3, 30), (4, 40)):
        c = claim_slice(number, parent)
        assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_written=rows) == (
            Status.SUCCEEDED
        )
        plan = plan_of(parent)
        assert plan.succeeded == number
        # The in-flight bound: never more than two slice runs queued or running.
        live = Run.objects.filter(parent=parent, status__in=["PENDING", "RUNNING"]).count()
        assert live == plan.live == min(2, 4 - number)
    parent.refresh_from_db()
    assert parent.status == Status.SUCCEEDED and parent.finished_at is not None
    plan = plan_of(parent)
    assert plan.rows_written == 100
    assert list(Slice.objects.filter(parent=parent).values_list("rows_written", flat=True)) == [
        10, 20, 30, 40
    ]  # fmt: skip
    view = services.run_slices(parent)
    assert view is not None and view.counts["done"] == 4 and view.rows_written == 100
    assert [s.state for s in view.slices] == ["done"] * 4
    assert view.slices[1].label == "id >= 100 and < 200"


@pytest.mark.django_db
def test_settle__a_failed_slice_fails_the_run_naming_it_and_starts_nothing_more() -> None:
    parent = planned(5, in_flight=2)
    one, two = claim_slice(1, parent), claim_slice(2, parent)
    claims.settle(two.attempt_id, two.lease_token, "PERMANENT", reason="PERMANENT_ERROR",
                  error="sink write: check constraint")  # fmt: skip
    parent.refresh_from_db()
    assert parent.status == Status.FAILED
    assert (
        plan_of(parent).error == "slice 2 of 5 (id >= 100 and < 200): sink write: check constraint"
    )
    # The sibling already running finishes and counts; the run stays FAILED; nothing new.
    claims.settle(one.attempt_id, one.lease_token, "SUCCEEDED", rows_written=7)
    parent.refresh_from_db()
    plan = plan_of(parent)
    assert parent.status == Status.FAILED
    assert (plan.succeeded, plan.failed, plan.live) == (1, 1, 0)
    assert Run.objects.filter(parent=parent).count() == 2
    view = services.run_slices(parent)
    assert [s.state for s in view.slices] == ["done", "failed", "waiting", "waiting", "waiting"]


@pytest.mark.django_db
def test_settle__an_expired_slice_without_attempts_left_fails_the_run_with_its_reason() -> None:
    parent = planned(3)
    for attempt in (1, 2):  # max_attempts = 2
        c = claim_slice(1, parent)
        expire(Attempt.objects.get(pk=c.attempt_id))
        claims.recover()
        assert Attempt.objects.get(pk=c.attempt_id).reason == Reason.LEASE_EXPIRED, attempt
    parent.refresh_from_db()
    assert parent.status == Status.FAILED
    assert plan_of(parent).error == "slice 1 of 3 (id < 100 or null): LEASE_EXPIRED"


@pytest.mark.django_db
def test_retry__redoes_only_the_slices_that_did_not_commit() -> None:
    parent = planned(4, in_flight=2)
    one, two = claim_slice(1, parent), claim_slice(2, parent)
    claims.settle(one.attempt_id, one.lease_token, "SUCCEEDED", rows_written=5)
    three = claim_slice(3, parent)
    claims.settle(two.attempt_id, two.lease_token, "PERMANENT", reason="PERMANENT_ERROR",
                  error="boom")  # fmt: skip
    claims.settle(three.attempt_id, three.lease_token, "SUCCEEDED", rows_written=5)
    parent.refresh_from_db()
    assert parent.status == Status.FAILED
    # A slice run is not retried on its own.
    slice_two = Run.objects.get(parent=parent, slice_number=2)
    with pytest.raises(services.ActionRefused) as refused:
        services.retry_run(slice_two)
    assert refused.value.code == "SLICE_RUN" and f"run {parent.pk}" in refused.value.message
    with pytest.raises(services.ActionRefused, match="SLICE_RUN|slice 2"):
        services.cancel_run(slice_two)

    assert services.retry_run(parent) == services.Outcome.RETRIED
    parent.refresh_from_db()
    plan = plan_of(parent)
    assert parent.status == Status.WAITING
    assert (plan.failed, plan.live, plan.error) == (0, 2, "")
    # Slice 2 gets an operator attempt (a fresh budget); slice 4 starts; 1 and 3 are left.
    assert [(a.number, a.origin, a.status) for a in slice_two.attempts.order_by("number")] == [
        (1, Origin.TRIGGER, Status.FAILED), (2, Origin.OPERATOR, Status.PENDING)
    ]  # fmt: skip
    for number in (1, 3):
        assert Attempt.objects.filter(run__parent=parent, run__slice_number=number).count() == 1
    for number in (2, 4):
        c = claim_slice(number, parent)
        claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_written=5)
    parent.refresh_from_db()
    assert parent.status == Status.SUCCEEDED and plan_of(parent).rows_written == 20
    with pytest.raises(services.ActionRefused, match="NOT_RETRYABLE|only FAILED"):
        services.retry_run(parent)


@pytest.mark.django_db
def test_cancel__queued_slices_at_once_running_ones_at_their_heartbeat() -> None:
    parent = planned(5, in_flight=3)
    running = claim_slice(1, parent)
    assert services.cancel_run(parent) == services.Outcome.CANCEL_REQUESTED
    parent.refresh_from_db()
    assert parent.status == Status.WAITING and parent.cancel_requested_at is not None
    states = dict(Run.objects.filter(parent=parent).values_list("slice_number", "status"))
    assert states == {1: Status.RUNNING, 2: Status.CANCELLED, 3: Status.CANCELLED}
    beats = claims.heartbeat("w", [(running.attempt_id, running.lease_token, 0, 0)], {})
    assert beats[running.attempt_id].cancel_requested
    with pytest.raises(services.ActionRefused, match="already has a cancel request"):
        services.cancel_run(parent)
    claims.settle(running.attempt_id, running.lease_token, "CANCELLED")
    parent.refresh_from_db()
    assert parent.status == Status.CANCELLED
    assert Run.objects.filter(parent=parent).count() == 3  # nothing new started
    # The retry starts over what did not commit: the three cancelled and two not started.
    services.retry_run(parent)
    assert plan_of(parent).live == 3
    assert Run.objects.filter(parent=parent, status=Status.PENDING).count() == 3


@pytest.mark.django_db
def test_cancel__of_a_sliced_run_with_nothing_running_is_immediate() -> None:
    parent = planned(2)
    assert services.cancel_run(parent) == services.Outcome.CANCELLED
    parent.refresh_from_db()
    assert parent.status == Status.CANCELLED
    assert set(Run.objects.filter(parent=parent).values_list("status", flat=True)) == {
        Status.CANCELLED
    }


@pytest.mark.django_db(transaction=True)
def test_settle__siblings_settling_at_once_both_count_on_the_parent() -> None:
    """Two slices settle in two sessions at the same moment: both wait on the parent's row
    (held here by a third session), then both update its counters; no lost update, no
    deadlock, and the last one succeeds the run."""
    parent = planned(2)
    a, b = claim_slice(1, parent), claim_slice(2, parent)
    holder = raw_connection()
    try:
        holder.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [parent.pk])

        def settle(i: int) -> str | None:
            c = (a, b)[i]
            return claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_written=i + 1)

        results: list[Any] = []
        thread = threading.Thread(target=lambda: results.append(in_threads(2, settle)))
        thread.start()

        def waiting() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    [holder.info.backend_pid],
                )
                return cursor.fetchone()[0] >= 1

        wait_until(waiting, message="a settlement waits on the parent")
        holder.rollback()
        thread.join(60)
    finally:
        holder.close()
    assert results == [[Status.SUCCEEDED, Status.SUCCEEDED]]
    parent.refresh_from_db()
    plan = plan_of(parent)
    assert (plan.succeeded, plan.live, plan.rows_written) == (2, 0, 3)
    assert parent.status == Status.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_retry_and_settlement_at_once_lock_a_slice_before_its_parent() -> None:
    """An operator's retry of a FAILED sliced run and the settlement of a sibling that was
    still running take their locks in one order (slice, then parent): whichever waits,
    both finish (a deadlock would fail one of them), and the counters add up."""
    parent = planned(3, in_flight=2)
    one, two = claim_slice(1, parent), claim_slice(2, parent)
    claims.settle(one.attempt_id, one.lease_token, "PERMANENT", reason="PERMANENT_ERROR",
                  error="x")  # fmt: skip

    def act(i: int) -> Any:
        if i == 0:
            return services.retry_run(parent.pk)
        return claims.settle(two.attempt_id, two.lease_token, "SUCCEEDED", rows_written=1)

    for _ in range(1):
        results = in_threads(2, act)
    assert results == [services.Outcome.RETRIED, Status.SUCCEEDED]
    plan = plan_of(parent)
    live = Run.objects.filter(parent=parent, status__in=["PENDING", "RUNNING"]).count()
    assert plan.live == live and plan.succeeded == 1 and plan.failed == 0


# --- what the claim and the settlement read beside 10,000 queued slices --------------------
MAX_CLAIM_BUFFERS = 2_500  # as tests/worker/test_claim_scale.py
MAX_SETTLE_BUFFERS = 600
QUEUED = 10_000


def explain_buffers(statement: str, params: dict[str, Any]) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SAVEPOINT measure")
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
        (raw,) = cursor.fetchone()
        cursor.execute("ROLLBACK TO SAVEPOINT measure")
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def nested_plans(statement: str, params: dict[str, Any]) -> str:
    """The plans of every statement `statement` runs, functions' included (auto_explain's
    notices): what a failed flatness assertion shows, so that a plan flip can be read."""
    notes: list[str] = []
    connection.connection.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    with connection.cursor() as cursor:
        cursor.execute("SAVEPOINT plans")
        cursor.execute("LOAD 'auto_explain'")
        for setting in (
            "log_min_duration = 0",
            "log_nested_statements = on",
            "log_analyze = on",
            "log_buffers = on",
            "log_level = notice",
        ):
            cursor.execute(f"SET LOCAL auto_explain.{setting}")
        cursor.execute("SET LOCAL client_min_messages = notice")
        cursor.execute(statement, params)
        cursor.execute("ROLLBACK TO SAVEPOINT plans")
    return "\n\n".join(notes)


def claim_cost() -> int:
    params = {"worker": "measure", "run": None, "limit": 1, "generic": True}
    explain_buffers(query("claim"), params)  # the first call compiles: not counted
    return explain_buffers(query("claim"), params)


def analyze() -> None:
    with connection.cursor() as cursor:
        for table in ("dispatch_run", "dispatch_attempt", "dispatch_slice", "dispatch_sliceplan"):
            cursor.execute(f"ANALYZE {table}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("in_flight", "fresh_statistics"),
    [(4, True), (None, True), (4, False)],
    ids=["plan-rows", "queued-slice-runs", "plan-rows-statistics-of-eight"],
)
def test_scale__a_slice_claim_and_settlement_read_the_same_beside_10000_queued_slices(
    in_flight: int | None, fresh_statistics: bool
) -> None:
    """With max_slices_in_flight 4 the 9,996 slices not started are plan rows, which no
    claim reads; with all in flight they are 10,000 queued slice runs, which the claim
    walks no more than any queue (it stops at what it returns). Either way a claim and a
    slice's settlement (which starts the next slice) cost what they cost beside a run of
    eight slices, also with the statistics still those of the eight-slice run (a plan
    that trusted them would read every range of the big plan)."""
    # Eight slices, so that with four in flight the measured settlement starts the next
    # slice in the baseline too (as it does in the big run): like is compared with like.
    small = planned(8, in_flight=in_flight)
    analyze()
    baseline_claim = claim_cost()
    c = claims.claim("w", limit=1)[0]
    settle = {
        "attempt": c.attempt_id, "token": c.lease_token, "outcome": "SUCCEEDED",
        "reason": None, "error": None, "rows_read": 1, "rows_written": 1,
        "events": None, "lost": None, "cap": None,
    }  # fmt: skip
    explain_buffers(query("settle"), settle)
    baseline_settle = explain_buffers(query("settle"), settle)

    big = planned(QUEUED, in_flight=in_flight)
    assert plan_of(big).live == (in_flight or QUEUED)
    if fresh_statistics:
        analyze()
    Run.objects.filter(parent=small).delete()  # the claim must take a slice of the big run
    claimed_cost = claim_cost()
    c = claims.claim("w", limit=1)[0]
    assert Run.objects.get(pk=c.run_id).parent_id == big.pk
    settle.update(attempt=c.attempt_id, token=c.lease_token)
    explain_buffers(query("settle"), settle)
    settle_cost = explain_buffers(query("settle"), settle)
    print(
        f"in_flight={in_flight}: claim {baseline_claim} -> {claimed_cost}, settle "
        f"{baseline_settle} -> {settle_cost}"
    )
    assert claimed_cost <= MAX_CLAIM_BUFFERS
    assert settle_cost <= MAX_SETTLE_BUFFERS
    # Flat: not a buffer per queued slice (10,000 slices would be hundreds of pages).
    assert claimed_cost <= baseline_claim + 100, (baseline_claim, claimed_cost)
    assert settle_cost <= baseline_settle + 100, (
        f"settle {baseline_settle} -> {settle_cost}:\n{nested_plans(query('settle'), settle)}"
    )


@pytest.mark.django_db
def test_scale__the_settlement_of_a_slice_has_no_loop_over_its_siblings() -> None:
    """The parent's settlement is counters on one row: the functions' text has no loop
    and no count over a parent's slices (what a scan one by one would need)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT prosrc FROM pg_proc WHERE proname IN ('dispatch_slice_settled', 'dispatch_settle_v3')"
        )
        bodies = [row[0] for row in cursor.fetchall()]
    assert len(bodies) == 2
    for body in bodies:
        lowered = body.lower()
        assert "for " not in lowered.replace("for update", ""), body
        assert "count(" not in lowered.replace("count(*) into v_used", ""), body


@pytest.mark.django_db
def test_slice_ids_are_version_8_and_other_runs_version_4() -> None:
    parent = planned(3)
    assert {
        uuid.UUID(str(r)).version
        for r in Run.objects.filter(parent=parent).values_list("pk", flat=True)
    } == {8}  # noqa: E501
    assert parent.pk.version == 4


@pytest.mark.django_db
def test_runs_listing__names_each_slice_and_its_sliced_run() -> None:
    from io import StringIO

    from django.core.management import call_command

    parent = planned(2)
    child = Run.objects.get(parent=parent, slice_number=2)
    out = StringIO()
    call_command("dispatch_runs", "list", stdout=out)
    assert f"{child.pk}" in out.getvalue()
    assert f"slice 2 of {parent.pk}" in out.getvalue()
    assert "WAITING" in out.getvalue()
    out = StringIO()
    call_command("dispatch_runs", "show", str(child.pk), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert (shown["parent_id"], shown["slice_number"]) == (str(parent.pk), 2)
    out = StringIO()
    call_command("dispatch_runs", "show", str(parent.pk), stdout=out)
    assert "status     WAITING" in out.getvalue()
    assert "SLICES_PLANNED" in out.getvalue()


@pytest.mark.django_db
def test_console__run_list_and_pages_render_with_slice_runs(admin_client: Any) -> None:
    from django.urls import reverse

    parent = planned(3, in_flight=2)
    c = claim_slice(1, parent)
    claims.settle(c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR", error="x")
    listing = admin_client.get(reverse("admin:dispatch_run_changelist"))
    assert listing.status_code == 200
    for run in (parent, *Run.objects.filter(parent=parent)):
        page = admin_client.get(reverse("admin:dispatch_run_change", args=[run.pk]))
        assert page.status_code == 200, run
    overview = admin_client.get(reverse("admin:dispatch_overview_changelist"), follow=True)
    assert overview.status_code == 200


@pytest.mark.django_db
def test_save__slices_need_a_sink_that_takes_them_and_max_slices_in_flight_at_least_1() -> None:
    from django.core.exceptions import ValidationError
    from django.db import IntegrityError, transaction

    from dispatch.models import Datasource, Job

    src = Datasource(name="pg-src", kind="postgresql", config={"host": "h", "dbname": "d"})
    src.save()
    csv = Datasource(name="csv-sink", kind="csv", config={"base_dir": "/tmp"})
    csv.save()
    job = factories.JobFactory(source_spec=SPEC, sink_spec={"path": "out.csv"})
    binding = JobBinding(name="b-csv", job=job, source=src, sink=csv)
    with pytest.raises(ValidationError, match="a csv sink cannot take a sliced source"):
        binding.full_clean()
    job.max_slices_in_flight = 0
    with pytest.raises(ValidationError, match="max_slices_in_flight"):
        job.full_clean()
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(max_slices_in_flight=0)


@pytest.mark.django_db(transaction=True)
def test_retention__a_sliced_run_goes_with_its_slices_and_not_while_one_is_live() -> None:
    from datetime import timedelta

    from django.db.models import DurationField, Value
    from django.db.models.functions import Now

    from dispatch.ops import retention

    def age(run: Run) -> None:
        ago = Now() - Value(timedelta(days=60), output_field=DurationField())
        Run.objects.filter(pk=run.pk).update(created_at=ago, finished_at=ago)

    done = planned(2)
    for number in (1, 2):
        c = claim_slice(number, done)
        claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_written=1)
    failed = planned(2)
    one, two = claim_slice(1, failed), claim_slice(2, failed)
    claims.settle(one.attempt_id, one.lease_token, "PERMANENT", reason="PERMANENT_ERROR",
                  error="x")  # fmt: skip
    # Slice 2 of the FAILED run still runs: its run is kept for now.
    for run in (done, failed):
        run.refresh_from_db()
        age(run)
    newer = factories.trigger(done.binding)  # R2: not the latest run of its binding
    factories.trigger(failed.binding)
    with override_failed_retention():
        report = retention.prune()
    assert not Run.objects.filter(pk=done.pk).exists()
    assert not Run.objects.filter(parent_id=done.pk).exists()
    assert not Slice.objects.filter(parent_id=done.pk).exists()
    assert not SlicePlan.objects.filter(run_id=done.pk).exists()
    assert report.attempts == 3  # the planning attempt and one per slice
    assert Run.objects.filter(pk=failed.pk).exists() and Run.objects.filter(pk=newer.pk).exists()
    claims.settle(two.attempt_id, two.lease_token, "SUCCEEDED", rows_written=1)
    with override_failed_retention():
        retention.prune()
    assert not Run.objects.filter(pk=failed.pk).exists()
    assert not Run.objects.filter(parent_id=failed.pk).exists()


def override_failed_retention() -> Any:
    from django.test import override_settings

    return override_settings(DISPATCH_RETENTION_DAYS={"SUCCEEDED": 7, "FAILED": 7, "CANCELLED": 7})
