"""Is anything firing the schedules? The reconciler's heartbeat row (one upsert per pass, an
idle pass being that one statement), and the three places that say so when schedules are
overdue and no reconciler runs: the system check scheduling.W001, the console's overview
and the schedules list."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from scheduling import conf
from scheduling.checks import check_reconciler_running
from scheduling.models import ReconcilerBeat, Schedule, db_now
from scheduling.reconciler import ScheduleReconciler
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db

STALE = timedelta(seconds=conf.STALLED_AFTER_SECONDS)
NEVER = "no schedule reconciler has ever run"
SINCE = "no schedule reconciler has run since"


def overdue(by: timedelta, cron: str = "* * * * *") -> Schedule:
    """An enabled schedule whose next slot is `by` in the past (no reconciler fired it)."""
    schedule = Schedule.objects.create(binding=BindingFactory(), cron=cron, timezone="UTC")
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=db_now() - by)
    return schedule


def beat(ago: timedelta) -> None:
    ReconcilerBeat.objects.update_or_create(
        pk=1, defaults={"beat_at": db_now() - ago, "reconciler": "host:1"}
    )


# --- the heartbeat ----------------------------------------------------------------------------
def test_run_once__upserts_the_one_heartbeat_row_in_database_time() -> None:
    now = db_now()  # the test's transaction: now() is the same in every statement
    ScheduleReconciler(name="first:1").run_once()
    assert list(ReconcilerBeat.objects.values_list("id", "beat_at", "reconciler")) == [
        (1, now, "first:1")
    ]
    ScheduleReconciler(name="second:2").run_once()
    assert list(ReconcilerBeat.objects.values_list("id", "beat_at", "reconciler")) == [
        (1, now, "second:2")
    ]


def test_run_once__an_idle_pass_is_one_statement_whatever_the_schedules() -> None:
    for _ in range(5):
        # Yearly: registered at save, not due.
        Schedule.objects.create(binding=BindingFactory(), cron="0 0 1 1 *", timezone="UTC")
    reconciler = ScheduleReconciler()
    with CaptureQueriesContext(connection) as ctx:
        report = reconciler.run_once()
        sleep = reconciler.sleep_seconds(report)
    assert len(ctx.captured_queries) == 1, [q["sql"][-200:] for q in ctx.captured_queries]
    assert "scheduling_reconcilerbeat" in ctx.captured_queries[0]["sql"]
    assert not report.changed and report.survey is not None and not report.survey.due
    assert sleep == conf.MAX_SLEEP_SECONDS  # the next slot is months away


def test_run_once__the_survey_still_registers_and_fires() -> None:
    due = overdue(timedelta(seconds=10))
    unregistered = Schedule.objects.create(binding=BindingFactory(), cron="* * * * *")
    Schedule.objects.filter(pk=unregistered.pk).update(next_fire_at=None)
    report = ScheduleReconciler().run_once()
    assert report.registered == 1 and [f.schedule_id for f in report.fired] == [due.pk]


# --- the system check -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overdue_by", "beat_ago", "says"),
    [
        (STALE * 2, None, NEVER),
        (STALE * 2, STALE * 3, SINCE),
        (STALE * 2, timedelta(seconds=5), None),  # a reconciler runs: not its problem
        (STALE / 2, None, None),  # not overdue for long
    ],
    ids=["overdue-never", "overdue-stale-beat", "overdue-fresh-beat", "recently-due"],
)
def test_check_w001__warns_only_when_overdue_and_no_recent_reconciler_pass(
    overdue_by: timedelta, beat_ago: timedelta | None, says: str | None
) -> None:
    overdue(overdue_by)
    if beat_ago is not None:
        beat(beat_ago)
    found = check_reconciler_running()
    if says is None:
        assert found == []
        return
    (warning,) = found
    assert warning.id == "scheduling.W001"
    assert says in warning.msg and "1 enabled schedule(s) overdue" in warning.msg
    assert "runworker" in warning.hint and "--no-scheduler" in warning.hint


def test_check_w001__ignores_disabled_schedules() -> None:
    schedule = overdue(STALE * 2)
    Schedule.objects.filter(pk=schedule.pk).update(enabled=False)
    assert check_reconciler_running() == []


def test_check_w001__says_nothing_on_a_database_without_the_tables() -> None:
    overdue(STALE * 2)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE scheduling_reconcilerbeat RENAME TO gone_for_this_test")
        assert check_reconciler_running() == []
        # The check's savepoint kept the caller's transaction usable.
        assert Schedule.objects.count() == 1
        transaction.set_rollback(True)


# --- the console --------------------------------------------------------------------------------
def test_overview__warns_when_schedules_are_overdue_and_no_reconciler_runs(
    admin_client: Client,
) -> None:
    url = reverse("admin:dispatch_overview")
    assert 'id="overview-notices"' not in admin_client.get(url).content.decode()
    overdue(STALE * 2)
    body = admin_client.get(url).content.decode()
    assert 'id="overview-notices"' in body
    assert NEVER in body and "--no-scheduler" in body
    assert f'href="{reverse("admin:scheduling_schedule_changelist")}"' in body
    beat(timedelta(seconds=1))
    assert 'id="overview-notices"' not in admin_client.get(url).content.decode()


def test_schedule_list__notes_overdue_schedules_while_no_reconciler_runs(
    admin_client: Client,
) -> None:
    stuck = overdue(STALE * 2)
    overdue(STALE / 2, cron="*/5 * * * *")  # due, not for long
    beat(STALE * 3)
    url = reverse("admin:scheduling_schedule_changelist")
    body = admin_client.get(url).content.decode()
    assert body.count(SINCE) == 1
    assert stuck.cron in body
    beat(timedelta(seconds=1))
    assert SINCE not in admin_client.get(url).content.decode()
