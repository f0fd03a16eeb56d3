"""The invariant checker must be able to fail: each test builds one violating state on
purpose (rows written directly, bypassing the guarded SQL) and asserts that exactly the
check in question reports it; a consistent state reports nothing."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import override_settings

from dispatch.core.states import BlockedReason, Origin, Reason, Status
from dispatch.models import Attempt, JobBinding, Run
from dispatch.models.ops import BindingHealth, HealthState
from dispatch.ops import alerts
from dispatch.verify import invariants
from dispatch.verify.invariants import Scope
from dispatch.worker import claims
from tests.support.factories import BindingFactory, JobFactory, trigger

pytestmark = pytest.mark.django_db(transaction=True)


def succeeded_run(**job: Any) -> Run:
    """A run taken through the real claim and settlement to SUCCEEDED."""
    run = trigger(BindingFactory(job=JobFactory(**job)))
    (claimed,) = claims.claim("w-inv", run_id=run.id)
    assert claims.settle(claimed.attempt_id, claimed.lease_token, "SUCCEEDED") == "SUCCEEDED"
    run.refresh_from_db()
    return run


def checks_failing(report: invariants.Report) -> set[str]:
    return {v.check for v in report.violations}


def scope_of(*runs: Run) -> Scope:
    return Scope(run_ids=frozenset(r.id for r in runs))


def add_attempt(run: Run, number: int, **fields: Any) -> Attempt:
    defaults: dict[str, Any] = {
        "origin": Origin.RETRY,
        "status": Status.FAILED,
        "reason": Reason.ERROR,
        # Settled when the run was created: before any later attempt began.
        "finished_at": run.created_at,
    }
    defaults.update(fields)
    return Attempt.objects.create(run=run, number=number, **defaults)


def test_check__consistent_runs_pass() -> None:
    run = succeeded_run()
    report = invariants.check(scope_of(run))
    assert report.ok, report.render()
    assert report.counts["runs"] == 1 and report.counts["succeeded"] == 1


def test_check__reports_a_lost_run() -> None:
    run = succeeded_run()
    lost = uuid.uuid4()
    report = invariants.check(Scope(run_ids=frozenset({run.id, lost})))
    assert checks_failing(report) == {"run_lost"}
    assert str(lost) in report.render()


def test_check__reports_a_stuck_run() -> None:
    run = trigger(BindingFactory())
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"run_not_terminal"}
    assert "PENDING" in report.render()


def test_check__reports_run_status_not_its_latest_attempts() -> None:
    run = succeeded_run()
    Run.objects.filter(pk=run.pk).update(status=Status.FAILED)
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"run_status"}
    assert "latest attempt 1 is SUCCEEDED" in report.render()


def test_check__reports_two_succeeded_attempts() -> None:
    run = succeeded_run()
    add_attempt(run, 2, status=Status.SUCCEEDED, reason=None)
    report = invariants.check(scope_of(run))
    assert "duplicate_success" in checks_failing(report)


def test_check__reports_a_gap_in_attempt_numbers() -> None:
    run = succeeded_run()
    Attempt.objects.filter(run=run).update(number=2)
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"attempt_numbers"}


def test_check__reports_a_budget_over_max_attempts_but_not_release_successors() -> None:
    run = succeeded_run(max_attempts=2)
    Attempt.objects.filter(run=run).update(number=4)
    add_attempt(run, 1, origin=Origin.TRIGGER, status=Status.RETRY_SCHEDULED)
    add_attempt(
        run,
        2,
        origin=Origin.RELEASE,
        status=Status.RETRY_SCHEDULED,
        reason=Reason.SHUTDOWN_RELEASED,
    )
    add_attempt(run, 3, origin=Origin.RETRY, status=Status.RETRY_SCHEDULED)
    Attempt.objects.filter(run=run, number=4).update(origin=Origin.RETRY)
    # TRIGGER, RELEASE, RETRY, RETRY: three attempts in the budget, max 2.
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"retry_budget"}
    assert "holds 3 attempts, max_attempts is 2" in report.render()
    # An operator retry opens a new budget: TRIGGER, RELEASE, RETRY | OPERATOR is fine.
    Attempt.objects.filter(run=run, number=4).update(origin=Origin.OPERATOR)
    assert invariants.check(scope_of(run)).ok


def test_check__reports_a_failure_without_reason_and_a_lost_lease_that_succeeded() -> None:
    run = succeeded_run()
    Attempt.objects.filter(run=run).update(number=2, reason=Reason.LEASE_EXPIRED)
    add_attempt(run, 1, origin=Origin.TRIGGER, status=Status.RETRY_SCHEDULED, reason=None)
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"reason"}
    text = report.render()
    assert "RETRY_SCHEDULED without a reason" in text
    assert "SUCCEEDED although it lost its lease (LEASE_EXPIRED)" in text


def test_check__reports_an_attempt_that_finished_after_its_successor_was_claimed() -> None:
    run = succeeded_run()
    later = Attempt.objects.get(run=run)
    Attempt.objects.filter(pk=later.pk).update(number=2, origin=Origin.RETRY)
    # Attempt 1 "finished" a second after attempt 2 was claimed: a stale worker's write.
    add_attempt(
        run,
        1,
        origin=Origin.TRIGGER,
        status=Status.RETRY_SCHEDULED,
        reason=Reason.LEASE_EXPIRED,
        lease_until=later.claimed_at - timedelta(seconds=5),
        finished_at=later.claimed_at + timedelta(seconds=1),
    )
    Attempt.objects.filter(pk=later.pk).update(created_at=later.claimed_at)
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"stale_finish"}
    assert "after attempt 2 began" in report.render()


def failed_run(binding: JobBinding) -> Run:
    """A run of `binding` taken through the real claim and settlement to FAILED."""
    run = trigger(binding)
    (claimed,) = claims.claim("w-inv", run_id=run.id, limit=1, generic=False)
    claims.settle(
        claimed.attempt_id, claimed.lease_token, "PERMANENT", reason="PERMANENT_ERROR", error="x"
    )
    run.refresh_from_db()
    assert run.status == Status.FAILED
    return run


@override_settings(
    DISPATCH_HEALTH_SCAN_LAG=0.0, DISPATCH_WARN_FAILURES=0, DISPATCH_AUTO_DISABLE_FAILURES=2
)
def test_check__a_run_waiting_behind_a_binding_the_health_scan_disabled_is_no_violation() -> None:
    binding = BindingFactory()
    failed = [failed_run(binding), failed_run(binding)]
    alerts.scan()  # the product's own auto-disable, at its threshold of 2
    binding.refresh_from_db()
    assert not binding.enabled
    waiting = trigger(binding)
    assert Attempt.objects.get(run=waiting).blocked_reason == BlockedReason.BINDING_DISABLED
    report = invariants.check(scope_of(*failed, waiting))
    assert report.ok, report.render()
    assert report.counts["waiting_auto_disabled"] == 1 and report.counts["pending"] == 1
    assert (
        f"1 run(s) wait behind binding {binding.name}, disabled by the health scan "
        "(auto-disabled: 2 consecutive failed runs (threshold 2))"
    ) in report.render()


def test_check__a_run_behind_a_disabled_binding_is_stuck_unless_the_product_disabled_it() -> None:
    from tools.chaos import waiting_auto_disabled

    binding = BindingFactory()
    run = trigger(binding)
    scope = scope_of(run)

    def stuck() -> bool:
        report = invariants.check(scope)
        # The campaign's quiescence uses the same rule as a filter: it waits for this run.
        return (
            checks_failing(report) == {"run_not_terminal"}
            and "waiting_auto_disabled" not in report.counts
            and not Run.objects.filter(waiting_auto_disabled(), pk=run.pk).exists()
        )

    def waits() -> bool:
        return (
            invariants.check(scope).ok
            and Run.objects.filter(waiting_auto_disabled(), pk=run.pk).exists()
        )

    # Disabled by an operator: no health row says the product did it.
    JobBinding.objects.filter(pk=binding.pk).update(enabled=False)
    assert Attempt.objects.get(run=run).blocked_reason == BlockedReason.BINDING_DISABLED
    assert stuck()
    health = BindingHealth.objects.create(
        binding=binding, state=HealthState.WARNED, reason="warned: 20 consecutive failed runs"
    )
    assert stuck()
    # AUTO_DISABLED, but without the reason the scan always records.
    BindingHealth.objects.filter(pk=health.pk).update(state=HealthState.AUTO_DISABLED, reason="")
    assert stuck()
    BindingHealth.objects.filter(pk=health.pk).update(
        reason="auto-disabled: 30 consecutive failed runs (threshold 30)"
    )
    assert waits()  # every condition holds
    # The attempt is not marked (a claim could take it), or marked for something else.
    for mark in (None, BlockedReason.JOB_DISABLED):
        Attempt.objects.filter(run=run).update(blocked_reason=mark)
        assert stuck(), mark
    Attempt.objects.filter(run=run).update(blocked_reason=BlockedReason.BINDING_DISABLED)
    assert waits()
    # Enabled again (its health row not yet reset by a scan): the run must go on.
    JobBinding.objects.filter(pk=binding.pk).update(enabled=True)
    assert stuck()


def test_check__scope_by_requested_by_tag() -> None:
    tagged = trigger(BindingFactory(), requested_by="campaign-x")
    succeeded_run()  # untagged, out of scope
    report = invariants.check(Scope(requested_by="campaign-x"))
    assert report.counts["runs"] == 1
    assert {v.subject for v in report.violations} == {str(tagged.id)}


# --- the command ------------------------------------------------------------------------
def test_command__exit_1_with_a_readable_report(tmp_path: Path) -> None:
    run = trigger(BindingFactory())
    ids = tmp_path / "runs.txt"
    ids.write_text(f"# campaign\n{run.id}\n")
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("check_invariants", "--run-ids", str(ids), "--no-sinks", stdout=out)
    assert exit_info.value.code == 1
    assert "1 VIOLATION(S)" in out.getvalue()
    assert f"{run.id}: PENDING" in out.getvalue()


def test_command__exit_0_with_a_summary(tmp_path: Path) -> None:
    run = succeeded_run()
    ids = tmp_path / "runs.txt"
    ids.write_text(f"{run.id}\n")
    out = io.StringIO()
    call_command("check_invariants", "--run-ids", str(ids), stdout=out)
    assert out.getvalue().startswith("invariants: OK")
    assert "runs=1" in out.getvalue()


def test_command__bad_run_id_file(tmp_path: Path) -> None:
    ids = tmp_path / "runs.txt"
    ids.write_text("not-a-uuid\n")
    with pytest.raises(CommandError, match="line 1: 'not-a-uuid' is not a run id"):
        call_command("check_invariants", "--run-ids", str(ids))
    with pytest.raises(CommandError, match="cannot read --run-ids"):
        call_command("check_invariants", "--run-ids", str(tmp_path / "missing.txt"))
    with pytest.raises(CommandError, match="--history 'public.events': expected SOURCE=HISTORY"):
        call_command("check_invariants", "--history", "public.events")


# --- PostgreSQL sinks ---------------------------------------------------------------------
def _sink_config() -> dict[str, Any]:
    s = connection.settings_dict
    config: dict[str, Any] = {
        "host": s["HOST"] or "127.0.0.1",
        "dbname": s["NAME"],
        "user": s["USER"],
    }
    if s.get("PORT"):
        config["port"] = int(s["PORT"])
    if s.get("PASSWORD"):
        config["password"] = s["PASSWORD"]
    return config


def _pg_sink_run(mode: str = "append") -> Run:
    """A SUCCEEDED run whose binding writes to inv_sink in this very database (rows and
    fence are written by the test, as a committed sink attempt would leave them)."""
    from tests.support.factories import DatasourceFactory

    sink = DatasourceFactory(kind="postgresql", config=_sink_config())
    job = JobFactory(
        source_spec={"rows": 3, "batch": 3}, sink_spec={"table": "public.inv_sink", "mode": mode}
    )
    run = trigger(BindingFactory(job=job, sink=sink))
    (claimed,) = claims.claim("w-inv", run_id=run.id)
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS inv_sink, dispatch_fence")
        cursor.execute("CREATE TABLE IF NOT EXISTS inv_sink (id bigint, customer text)")
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS dispatch_fence (run_id uuid PRIMARY KEY,"
            " binding_id uuid, token bigint NOT NULL, attempt_id uuid, committed_at timestamptz)"
        )
        cursor.execute("INSERT INTO inv_sink SELECT g, 'c' FROM generate_series(1, 3) g")
        cursor.execute(
            "INSERT INTO dispatch_fence VALUES (%s, %s, %s, %s, now())",
            [run.id, run.binding_id, claimed.lease_token, claimed.attempt_id],
        )
    claims.settle(claimed.attempt_id, claimed.lease_token, "SUCCEEDED")
    return run


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # the sink is this database
def test_check__pg_sink_consistent_then_duplicated_rows() -> None:
    run = _pg_sink_run()
    report = invariants.check(scope_of(run))
    assert report.ok, report.render()
    assert report.counts["sink_tables"] == 1
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO inv_sink VALUES (2, 'again')")  # one row twice
    report = invariants.check(scope_of(run))
    assert checks_failing(report) == {"sink_rows"}
    assert "multiplicities {1: 2, 2: 1}" in report.render()


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # the sink is this database
def test_check__pg_sink_lost_rows() -> None:
    run = _pg_sink_run()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM inv_sink WHERE id = 3")
    assert checks_failing(invariants.check(scope_of(run))) == {"sink_rows"}


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # the sink is this database
def test_check__pg_sink_fence_uncommitted_or_naming_another_attempt() -> None:
    run = _pg_sink_run()
    with connection.cursor() as cursor:
        cursor.execute("UPDATE dispatch_fence SET attempt_id = %s", [uuid.uuid4()])
    report = invariants.check(scope_of(run))
    assert "sink_fence" in checks_failing(report)
    assert "which is not this run's" in report.render()
    with connection.cursor() as cursor:
        cursor.execute("UPDATE dispatch_fence SET committed_at = NULL")
    report = invariants.check(scope_of(run))
    assert "SUCCEEDED but its fence is not committed" in report.render()


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # the sink is this database
def test_check__pg_sink_committed_by_a_later_attempt_than_the_succeeded_one() -> None:
    run = _pg_sink_run()
    first = Attempt.objects.get(run=run)
    # Attempt 2 (a stale successor) committed the data after attempt 1 was recorded.
    Attempt.objects.filter(pk=first.pk).update(number=1)
    stale = add_attempt(run, 2, lease_token=first.lease_token + 1000, finished_at=first.finished_at)
    Run.objects.filter(pk=run.pk).update(status=Status.FAILED)
    Attempt.objects.filter(pk=first.pk).update(status=Status.SUCCEEDED)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE dispatch_fence SET attempt_id = %s, token = %s",
            [stale.id, stale.lease_token],
        )
    report = invariants.check(scope_of(run))
    assert "after attempt 1 recorded SUCCEEDED" in report.render()


# --- schedules ------------------------------------------------------------------------------
def _schedule_model() -> Any:
    from scheduling.models import Schedule

    return Schedule


def test_check__schedule_slots_missing_and_bogus() -> None:
    from scheduling import verify as schedule_checks

    schedule_model = _schedule_model()
    binding = BindingFactory()
    schedule = schedule_model(binding=binding, cron="* * * * *", timezone="UTC")
    schedule.save()
    # Pretend it was created 10 minutes ago and the reconciler has handled every slot
    # since (next_fire_at advanced), but only fired two of them.
    schedule_model.objects.filter(pk=schedule.pk).update(
        created_at=schedule.next_fire_at - timedelta(minutes=10, seconds=30)
    )
    slots = schedule_checks.slots_between(
        schedule_checks.load_schedules(
            invariants.load(Scope(schedule_ids=frozenset({schedule.id})))
        )[0],
        schedule.next_fire_at - timedelta(minutes=10, seconds=30),
        schedule.next_fire_at,
    )
    assert len(slots) == 10
    for slot in slots[:2]:
        trigger(binding, trigger="SCHEDULE", schedule_id=schedule.id, scheduled_for=slot)
    scope = Scope(schedule_ids=frozenset({schedule.id}))
    report = invariants.check(scope, sinks=False)
    assert "schedule_slots" in checks_failing(report)
    assert "8 due slot(s) without a run but only 0 recorded skip(s)" in report.render()
    # The schedules' check is scheduling's, found through its AppConfig: the command's
    # --schedule runs it, and a check without the installed apps' checks does not.
    assert schedule_checks.check in invariants.app_checks()
    out = io.StringIO()
    with pytest.raises(SystemExit):
        call_command("check_invariants", "--schedule", str(schedule.id), "--no-sinks", stdout=out)
    assert "schedule_slots: 1" in out.getvalue() and "schedules=1" in out.getvalue()
    assert "8 due slot(s) without a run" in out.getvalue()
    without_apps = invariants.check(scope, sinks=False, installed_apps=False)
    assert "schedule_slots" not in checks_failing(without_apps)
    assert "schedules" not in without_apps.counts
    # Recorded skips account for the rest.
    schedule_model.objects.filter(pk=schedule.pk).update(skip_count=8)
    report = invariants.check(scope, sinks=False)
    assert "schedule_slots" not in checks_failing(report)
    # A run for an instant that is not a slot of the cron.
    trigger(
        binding,
        trigger="SCHEDULE",
        schedule_id=schedule.id,
        scheduled_for=slots[3] + timedelta(seconds=7),
    )
    report = invariants.check(scope, sinks=False)
    assert "not a due slot" in report.render()


def _pg_values_run(mode: str) -> Run:
    """A SUCCEEDED run copying inv_source (a PostgreSQL table) into inv_sink, both in this
    very database, with the sink as a committed attempt leaves it."""
    from tests.support.factories import DatasourceFactory

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS inv_source, inv_sink, dispatch_fence")
        cursor.execute("CREATE TABLE inv_source (id bigint, span interval, doc json)")
        cursor.execute(
            "INSERT INTO inv_source VALUES (1, '1 year 2 mons', '{\"b\": 2.50, \"b\": 1}'),"
            " (2, NULL, '[]')"
        )
        cursor.execute("CREATE TABLE inv_sink (LIKE inv_source)")
        cursor.execute("INSERT INTO inv_sink SELECT * FROM inv_source")
        cursor.execute(
            "CREATE TABLE dispatch_fence (run_id uuid PRIMARY KEY, binding_id uuid,"
            " token bigint NOT NULL, attempt_id uuid, committed_at timestamptz)"
        )
    source = DatasourceFactory(kind="postgresql", config=_sink_config())
    sink = DatasourceFactory(kind="postgresql", config=_sink_config())
    job = JobFactory(
        source_spec={"table": "public.inv_source"},
        sink_spec={"table": "public.inv_sink", "mode": mode},
    )
    run = trigger(BindingFactory(job=job, source=source, sink=sink))
    (claimed,) = claims.claim("w-inv", run_id=run.id)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO dispatch_fence VALUES (%s, %s, %s, %s, now())",
            [run.id, run.binding_id, claimed.lease_token, claimed.attempt_id],
        )
    claims.settle(claimed.attempt_id, claimed.lease_token, "SUCCEEDED")
    return run


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # source and sink are this database
def test_check__pg_sink_values_compared_with_the_source_row_by_row() -> None:
    run = _pg_values_run("replace")
    report = invariants.check(scope_of(run), values=True)
    assert report.ok, report.render()
    # A value changed on the way (an interval's units: same length, other text).
    with connection.cursor() as cursor:
        cursor.execute("UPDATE inv_sink SET span = '425 days' WHERE id = 1")
    report = invariants.check(scope_of(run), values=True)
    assert checks_failing(report) == {"sink_values"}
    assert "1 source row version(s) missing, 1 row(s) too many" in report.render()
    assert "425 days" in report.render()
    # Without `values` the checker does not read the source (its rows may change).
    assert invariants.check(scope_of(run)).ok


@override_settings(DISPATCH_ALLOW_SITE_DATABASE=True)  # source and sink are this database
def test_check__pg_sink_values_append_holds_each_row_once_per_committed_run() -> None:
    run = _pg_values_run("append")
    assert invariants.check(scope_of(run), values=True).ok
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO inv_sink SELECT * FROM inv_source WHERE id = 2")
    report = invariants.check(scope_of(run), values=True)
    assert checks_failing(report) == {"sink_values"}
    assert "0 source row version(s) missing, 1 row(s) too many" in report.render()


# --- incremental bindings -------------------------------------------------------------------
@pytest.fixture
def inc_src() -> Any:
    from tests.support.connectors import scratch_db

    yield from scratch_db("dispatch_invinc_src")


@pytest.fixture
def inc_dst() -> Any:
    from tests.support.connectors import scratch_db

    yield from scratch_db("dispatch_invinc_dst")


def _inc_binding(src: Any, dst: Any, mode: str) -> Any:
    from tests.support.factories import DatasourceFactory

    sink_spec: dict[str, Any] = {"table": f"public.inc_{mode}", "mode": mode, "create": True}
    if mode == "upsert":
        sink_spec["key"] = ["id"]
    job = JobFactory(
        source_spec={"table": "public.events", "incremental": {"cursor": ["updated_at", "id"]}},
        sink_spec=sink_spec,
    )
    return BindingFactory(
        job=job,
        source=DatasourceFactory(kind="postgresql", config=src.config),
        sink=DatasourceFactory(kind="postgresql", config=dst.config),
    )


def _inc_run(binding: Any) -> Run:
    """One run of `binding` through the real claim and an in-process execution."""
    from dispatch.worker.runner import ExecutionControl, Runner

    run = trigger(binding)
    (claimed,) = claims.claim("w-inv", run_id=run.id, limit=1, generic=False)
    assert Runner(claimed, ExecutionControl(claimed)).execute() == Status.SUCCEEDED
    return run


def test_check__incremental_append_and_upsert_against_the_source_history(
    inc_src: Any, inc_dst: Any, tmp_path: Path
) -> None:
    """Real runs over a source that changes between them; the checker proves the append
    sink holds every version a committed snapshot held exactly once, and the upsert sink
    equals the source at the committed cursor. Then one violation at a time."""
    from tools.chaos import INCREMENTAL_SOURCE, INCREMENTAL_TABLE, mutate_source

    inc_src.execute(INCREMENTAL_SOURCE)
    history = {INCREMENTAL_TABLE: f"{INCREMENTAL_TABLE}_history"}
    append, upsert = (
        _inc_binding(inc_src, inc_dst, "append"),
        _inc_binding(inc_src, inc_dst, "upsert"),
    )
    runs = []

    def change(*steps: tuple[str, int | None]) -> None:
        from tests.support.connectors import connect

        with connect(inc_src.name) as conn:
            for kind, row in steps:
                mutate_source(conn, kind, row)

    def both() -> None:
        runs.extend([_inc_run(append), _inc_run(upsert)])

    change(*[("insert", None)] * 5)
    both()
    change(("update", 2), ("insert", None))
    both()
    # Row 3 changes twice before the next read: its middle version is in no snapshot.
    change(("update", 3), ("update", 3), ("update", 1))
    both()
    scope = scope_of(*runs)
    report = invariants.check(scope, history=history)
    assert report.ok, report.render()
    assert report.counts["incremental_bindings"] == 2
    assert inc_src.execute("SELECT count(*) FROM events_history") == [(10,)]
    assert inc_dst.execute("SELECT count(*) FROM inc_append") == [(9,)]  # all but 3's v2
    assert invariants.check(scope).ok  # without the history: the current rows only
    ids = tmp_path / "runs.txt"
    ids.write_text("".join(f"{r.id}\n" for r in runs))
    out = io.StringIO()
    call_command(
        "check_invariants",
        "--run-ids",
        str(ids),
        "--history",
        f"{INCREMENTAL_TABLE}=public.events_history",
        stdout=out,
    )
    assert "invariants: OK" in out.getvalue() and "incremental_bindings=2" in out.getvalue()
    for table in ("inc_append", "inc_upsert"):
        inc_dst.execute(f"CREATE TABLE {table}_kept AS SELECT * FROM {table}")

    def failing(statement: str, undo: str = "") -> str:
        inc_dst.execute(statement)
        found = invariants.check(scope, history=history)
        for table in ("inc_append", "inc_upsert"):
            inc_dst.execute(f"TRUNCATE {table}; INSERT INTO {table} SELECT * FROM {table}_kept")
        if undo:
            inc_dst.execute(undo)
        assert invariants.check(scope, history=history).ok
        assert checks_failing(found) == {"incremental"}, found.render()
        return found.render()

    # A version twice in the append sink (a batch written again).
    text = failing("INSERT INTO inc_append SELECT * FROM inc_append WHERE id = 6")
    assert "1 row version(s) are in the sink more than once" in text
    # A version a committed snapshot held, lost (row 2's first version, read by run 1).
    text = failing("DELETE FROM inc_append WHERE id = 2 AND version = 1")
    assert "1 row version(s) a committed snapshot held" in text and "not in the sink" in text
    # A row the source never held.
    text = failing("UPDATE inc_append SET payload = 'forged' WHERE id = 4")
    assert "1 sink row(s) are no version the source ever held" in text
    # The upsert sink one version behind the source at the committed cursor.
    text = failing("UPDATE inc_upsert SET payload = 'stale' WHERE id = 1")
    assert "differs from the source at the committed cursor" in text
    # The sink's cursor moved by hand past what any committed attempt ended at.
    inc_dst.execute("CREATE TABLE cursor_kept AS SELECT * FROM dispatch_cursor")
    text = failing(
        "UPDATE dispatch_cursor SET cursor = ARRAY['2999-01-01 00:00:00+00', '1']",
        "TRUNCATE dispatch_cursor; INSERT INTO dispatch_cursor SELECT * FROM cursor_kept",
    )
    assert "is no committed attempt's cursor_to" in text
