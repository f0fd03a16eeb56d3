"""Retention: what is deleted, what never is, and that pruning never blocks claims."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import DurationField, Value
from django.db.models.functions import Now
from django.test import override_settings

from dispatch.core import sqlfiles
from dispatch.core.states import Status
from dispatch.models import Attempt, AttemptEvent, Run, Worker
from dispatch.ops import retention
from dispatch.worker import claims
from scheduling.models import db_now
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import raw_connection
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = pytest.mark.django_db(transaction=True)

OUTCOME = {Status.SUCCEEDED: "SUCCEEDED", Status.FAILED: "PERMANENT", Status.CANCELLED: "CANCELLED"}


def finished_run(binding, status: str, days_ago: float, **kwargs) -> Run:
    """A run that went the real way (trigger, claim, settle), then aged by `days_ago`."""
    run = trigger(binding, **kwargs)
    [c] = claims.claim("w-ret", run_id=run.id, limit=1, generic=False)
    assert claims.settle(c.attempt_id, c.lease_token, OUTCOME[status]) == status
    age(run, days_ago)
    return run


def age(run: Run, days_ago: float) -> None:
    ago = Now() - Value(timedelta(days=days_ago), output_field=DurationField())
    Run.objects.filter(pk=run.pk).update(created_at=ago, finished_at=ago)
    Attempt.objects.filter(run=run).update(created_at=ago, finished_at=ago)


def exists(run: Run) -> bool:
    return Run.objects.filter(pk=run.pk).exists()


def history(obj) -> LogEntry:
    user = User.objects.get_or_create(username="operator")[0]
    return LogEntry.objects.create(
        user=user,
        content_type=ContentType.objects.get_for_model(obj),
        object_id=str(obj.pk),
        object_repr=str(obj.pk),
        action_flag=CHANGE,
        change_message="cancel: CANCELLED",
    )


def test_prune__deletes_old_finished_runs_and_keeps_every_protected_one():
    a = BindingFactory()
    old_ok = finished_run(a, Status.SUCCEEDED, 30)
    old_ok_entry = history(old_ok)
    old_attempt_entry = history(Attempt.objects.get(run=old_ok))
    young_failed = finished_run(a, Status.FAILED, 30)  # FAILED is kept 90 days
    old_failed = finished_run(a, Status.FAILED, 100)
    age(old_failed, 100)
    latest_ok = finished_run(a, Status.SUCCEEDED, 20)  # R3: latest success of `a`
    latest_a = finished_run(a, Status.CANCELLED, 95)  # R2: latest run of `a` (newest created)
    Run.objects.filter(pk=latest_a.pk).update(created_at=Now())
    kept_entry = history(latest_a)

    # R4: the latest run of a schedule is its slot record; an older slot of it goes.
    b = BindingFactory()
    schedule = uuid.uuid4()
    slot = db_now()  # the slot's time, as the reconciler passes it (a datetime)
    older_slot = finished_run(b, Status.SUCCEEDED, 40, schedule_id=schedule, scheduled_for=slot)
    Run.objects.filter(pk=older_slot.pk).update(scheduled_for=Now() - timedelta(days=40))
    latest_slot = finished_run(b, Status.SUCCEEDED, 30, schedule_id=schedule, scheduled_for=slot)
    finished_run(b, Status.SUCCEEDED, 1)  # newer manual runs of the binding
    newest_b = finished_run(b, Status.SUCCEEDED, 0)

    # R1: live runs, however old.
    c = BindingFactory()
    pending = trigger(c)
    running = trigger(c)
    claims.claim("w-live", run_id=running.id, limit=1, generic=False)
    Run.objects.filter(pk__in=[pending.pk, running.pk]).update(
        created_at=Now() - timedelta(days=400)
    )
    trigger(c)  # a newer run, so R2 does not protect them

    dry = retention.prune(dry_run=True)
    assert dry.runs == {Status.SUCCEEDED: 2, Status.FAILED: 1}
    assert Run.objects.count() == 12  # nothing deleted by the dry run

    report = retention.prune()
    assert report.runs == dry.runs
    assert report.attempts == 3 and report.history_entries == 2
    assert not exists(old_ok) and not exists(old_failed) and not exists(older_slot)
    assert not Attempt.objects.filter(run_id__in=[old_ok.pk, old_failed.pk]).exists()
    for kept in (young_failed, latest_ok, latest_a, latest_slot, newest_b, pending, running):
        assert exists(kept), kept
    assert not LogEntry.objects.filter(pk__in=[old_ok_entry.pk, old_attempt_entry.pk]).exists()
    assert LogEntry.objects.filter(pk=kept_entry.pk).exists()
    assert report.pruned_through is not None
    assert retention.pruned_through() == report.pruned_through

    again = retention.prune()  # idempotent: nothing left to do
    assert again.total_runs == 0
    state = retention.read_state()["data"]
    assert state["deleted_runs_total"] == 3 and state["last_deleted_runs"] == 0


@override_settings(DISPATCH_RETENTION_DAYS={"SUCCEEDED": None, "FAILED": 1, "CANCELLED": None})
def test_prune__a_status_kept_forever_is_never_pruned_and_batches_are_small():
    binding = BindingFactory()
    runs = [finished_run(binding, s, 5) for s in [Status.SUCCEEDED, Status.FAILED] * 3]
    finished_run(binding, Status.SUCCEEDED, 0)
    report = retention.prune(batch=1, max_batches=2)
    assert report.runs == {Status.FAILED: 2} and report.more and report.batches == 2
    report = retention.prune(batch=1)
    assert report.runs == {Status.FAILED: 1} and not report.more
    assert all(exists(r) for r in runs if r.status == Status.SUCCEEDED)


def test_prune__skips_a_run_somebody_holds_and_does_not_wait_for_it():
    binding = BindingFactory()
    held = finished_run(binding, Status.SUCCEEDED, 30)
    free = finished_run(binding, Status.SUCCEEDED, 30)
    finished_run(binding, Status.SUCCEEDED, 0)
    with raw_connection() as other:
        other.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [held.id])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")  # a wait would fail the test
        report = retention.prune()
        other.rollback()
    assert report.total_runs == 1 and exists(held) and not exists(free)


def test_prune__an_open_pruning_batch_never_blocks_a_claim_or_a_trigger():
    binding = BindingFactory()
    finished_run(binding, Status.SUCCEEDED, 30)
    finished_run(binding, Status.SUCCEEDED, 30)
    waiting = trigger(binding)  # live work of the same binding
    with raw_connection() as pruner:
        # A batch in the middle of its transaction: picked, attempts and runs deleted.
        rows = pruner.execute(
            sqlfiles.ops_query("prune_pick_runs"),
            {"status": "SUCCEEDED", "seconds": 86400.0, "limit": 10},
        ).fetchall()
        ids = [r[0] for r in rows]
        assert len(ids) == 1  # the other is the latest success (R3)
        attempts = pruner.execute(
            sqlfiles.ops_query("prune_delete_attempts"), {"runs": ids}
        ).fetchall()
        pruner.execute(
            sqlfiles.ops_query("prune_delete_events"), {"attempts": [a[0] for a in attempts]}
        )
        pruner.execute(sqlfiles.ops_query("prune_delete_runs"), {"runs": ids})
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '500ms'")  # a wait fails the claim
        got = claims.claim("w-claim", run_id=waiting.id, limit=1)
        assert [c.run_id for c in got] == [waiting.id]
        assert trigger(binding).status == Status.PENDING
        pruner.commit()
    assert Run.objects.filter(pk__in=ids).count() == 0


def test_prune__removes_old_stopped_workers_but_never_one_that_holds_an_attempt():
    with connection.cursor() as cursor:
        for wid, stopped in (("gone", True), ("holding", False), ("recent", True)):
            cursor.execute(
                "INSERT INTO dispatch_worker (id, host, pid, concurrency, started_at,"
                " heartbeat_at, stopped_at, stats) VALUES (%s, 'h', 1, 1, now(), now(),"
                " CASE WHEN %s THEN now() END, '{}')",
                [wid, stopped],
            )
        cursor.execute(
            "UPDATE dispatch_worker SET heartbeat_at = now() - interval '30 days',"
            " stopped_at = stopped_at - interval '30 days' WHERE id IN ('gone', 'holding')"
        )
    run = trigger(BindingFactory())
    claims.claim("holding", run_id=run.id, limit=1)
    report = retention.prune()
    assert report.workers == 1
    assert sorted(Worker.objects.values_list("id", flat=True)) == ["holding", "recent"]


def test_prune__removes_old_finished_bulk_operations_with_their_skips_never_one_in_progress():
    from dispatch.models import BulkOperation, BulkSkip, BulkStatus

    def operation(status: str, days: int) -> BulkOperation:
        op = BulkOperation.objects.create(model="run", action="retry", status=status)
        BulkSkip.objects.create(
            operation=op, object_id=uuid.uuid4(), object_repr="r", code="C", message="m"
        )
        BulkOperation.objects.filter(pk=op.pk).update(
            finished_at=Now() - Value(timedelta(days=days), output_field=DurationField())
        )
        return op

    old = operation(BulkStatus.DONE, 100)
    recent = operation(BulkStatus.CANCELLED, 10)
    running = operation(BulkStatus.PENDING, 100)  # a finished_at it cannot have: still kept
    report = retention.prune()
    assert report.bulk_operations == 1
    assert sorted(BulkOperation.objects.values_list("pk", flat=True)) == [recent.pk, running.pk]
    assert not BulkSkip.objects.filter(operation_id=old.pk).exists()
    assert BulkSkip.objects.count() == 2


def test_prune_command__dry_run_reports_and_deletes_nothing(capsys):
    binding = BindingFactory()
    old = finished_run(binding, Status.SUCCEEDED, 30)
    finished_run(binding, Status.SUCCEEDED, 0)
    call_command("prune", "--dry-run")
    assert "would delete 1 run(s) (SUCCEEDED 1)" in capsys.readouterr().out
    assert exists(old)
    call_command("prune")
    assert "deleted 1 run(s)" in capsys.readouterr().out
    assert not exists(old)


def test_maybe_prune__one_pass_per_interval_whoever_asks():
    with override_settings(DISPATCH_RETENTION_INTERVAL=3600):
        assert retention.maybe_prune() is not None
        assert retention.maybe_prune() is None  # another worker, same interval


def test_every_ops_statement_is_valid_sql_against_the_schema():
    import re

    with connection.cursor() as cursor:
        for name in sqlfiles.ops_query_names():
            statement = re.sub(r"%\((\w+)\)s", "NULL", sqlfiles.ops_query(name))
            cursor.execute(f"EXPLAIN {statement}")


@pytest.mark.slow
def test_prune__under_running_workers_deletes_only_finished_unprotected_runs(
    processes: Processes,
):
    """Two workers execute a stream of runs while pruning with a zero-day retention (each
    worker's maintenance loop plus this process, back to back): every run still reaches
    its outcome, no worker loses a lease, and the latest run of each binding stays."""
    env = worker_env(
        DISPATCH_RETENTION_SUCCEEDED_DAYS="0",
        DISPATCH_RETENTION_INTERVAL="0",
        DISPATCH_RETENTION_BATCH="5",
    )
    bindings = [BindingFactory(max_concurrency=2) for _ in range(3)]
    workers = [
        processes.worker("--concurrency", "2", "--worker-id", f"w-prune-{i}", env=env)
        for i in range(2)
    ]
    triggered: list[uuid.UUID] = []
    last: dict[uuid.UUID, uuid.UUID] = {}
    with override_settings(DISPATCH_RETENTION_DAYS={"SUCCEEDED": 0}, DISPATCH_RETENTION_BATCH=5):
        for _ in range(8):
            for b in bindings:
                for _ in range(3):
                    last[b.id] = trigger(b).id
                    triggered.append(last[b.id])
            retention.prune()
        wait_until(
            lambda: not Run.objects.filter(pk__in=triggered).live().exists(),
            timeout=60,
            message="every run finished",
        )
        retention.prune()
    remaining = Run.objects.filter(pk__in=triggered)
    assert set(remaining.values_list("status", flat=True)) == {Status.SUCCEEDED}
    assert remaining.count() < len(triggered)  # pruning did happen meanwhile
    for run_id in last.values():  # R2: the latest run of each binding stays
        assert Run.objects.filter(pk=run_id).exists()
    assert not Attempt.objects.exclude(run__in=Run.objects.all()).exists()
    for proc in workers:
        assert proc.poll() is None
        out = processes.output(proc)
        assert "lease lost" not in out and "outcome not recorded" not in out, out[-3000:]


def test_prune__never_deletes_a_run_the_health_scan_or_the_metrics_fold_has_not_read():
    """R5: a failed run pruned before the health scan read it would never alert, and one
    pruned before the metrics fold would never be counted."""
    from dispatch.models.ops import OpsState
    from dispatch.ops import alerts, binding_metrics

    b = BindingFactory()
    read = finished_run(b, Status.FAILED, 100)
    unread = finished_run(b, Status.FAILED, 95)
    finished_run(b, Status.SUCCEEDED, 0)
    cursor_at = Run.objects.values_list("finished_at", flat=True).get(pk=read.pk)
    # The scan has read up to `read` (itself included); the fold further: the older
    # cursor rules.
    OpsState.objects.create(
        key=alerts.SCAN_KEY, data={"after_at": cursor_at.isoformat(), "after_id": str(read.pk)}
    )
    OpsState.objects.create(
        key=binding_metrics.KEY,
        data={"after_at": (cursor_at + timedelta(days=5)).isoformat(), "after_id": "x"},
    )
    report = retention.prune()
    assert report.total_runs == 1 and not exists(read) and exists(unread)
    OpsState.objects.filter(key__in=[alerts.SCAN_KEY, binding_metrics.KEY]).update(
        data={"after_at": (cursor_at + timedelta(days=6)).isoformat(), "after_id": "x"}
    )
    report = retention.prune()
    assert report.total_runs == 1 and not exists(unread)


@override_settings(DISPATCH_HEALTH_SCAN_LAG=0.0)
def test_prune_command__brings_the_scan_and_the_fold_up_to_date_first(capsys):
    """A site whose workers run without maintenance prunes from cron: a stale health
    cursor (rule R5) would otherwise hold every run back for ever."""
    from dispatch.models.ops import OpsState
    from dispatch.ops import alerts

    binding = BindingFactory()
    old = finished_run(binding, Status.SUCCEEDED, 30)
    finished_run(binding, Status.SUCCEEDED, 0)
    stale = Run.objects.values_list("finished_at", flat=True).get(pk=old.pk)
    OpsState.objects.create(
        key=alerts.SCAN_KEY,
        data={"after_at": (stale - timedelta(days=1)).isoformat(), "after_id": str(old.pk)},
    )
    assert retention.prune().total_runs == 0  # held back by the stale cursor
    call_command("prune")
    out = capsys.readouterr().out
    assert "health scan: 2 run(s) read" in out and "deleted 1 run(s)" in out
    assert not exists(old)


def test_prune__deletes_the_event_logs_of_its_runs_reading_only_theirs():
    """A batch's delete of event logs probes its attempts' rows only: the same work with
    10,000 events of kept runs in the table as without (counted, never timed)."""
    a = BindingFactory()
    old = [finished_run(a, Status.SUCCEEDED, 30) for _ in range(2)]
    kept = finished_run(a, Status.SUCCEEDED, 0)
    kept_attempt = Attempt.objects.get(run=kept)
    with connection.cursor() as cursor:
        # A big history of events beside the batch (the kept run's: never pruned here).
        cursor.execute(
            "INSERT INTO dispatch_attemptevent (attempt_id, seq, at, kind, message, data)"
            " SELECT %s, 100 + i, now(), 'progress', '', '{}' FROM generate_series(1, 10000) i",
            [kept_attempt.pk],
        )
        cursor.execute("ANALYZE dispatch_attemptevent")
    assert AttemptEvent.objects.filter(attempt__run__in=old).count() == 2  # `settled` each

    def counters() -> tuple[int, int, int]:
        # The backend's counters not flushed yet (earlier statements' included): read
        # before and after, the difference is the pass's.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT seq_scan, coalesce(idx_tup_fetch, 0) + seq_tup_read, n_tup_del"
                " FROM pg_stat_xact_user_tables WHERE relname = 'dispatch_attemptevent'"
            )
            return cursor.fetchone()

    with transaction.atomic():
        before = counters()
        report = retention.prune()
        after = counters()
    seq_scans, read, deleted = (a - b for a, b in zip(after, before, strict=True))
    assert report.total_runs == 2 and report.events == 2
    assert (seq_scans, deleted) == (0, 2) and read <= 10, (seq_scans, read, deleted)
    assert not AttemptEvent.objects.filter(attempt__run__in=old).exists()
    assert AttemptEvent.objects.filter(attempt=kept_attempt).count() == 10_001
