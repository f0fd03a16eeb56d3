"""Schedules against the real database: validation, registration, misfires after
downtime, overlap, disabled bindings and jobs, DST slots fired by the reconciler, the
command and the admin."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import F
from django.test import Client, RequestFactory, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from psycopg import sql

from dispatch.core import sqlfiles as dispatch_sqlfiles
from dispatch.core.states import Status, Trigger
from dispatch.models import Job, JobBinding, Run
from dispatch.worker import claims
from scheduling import admin as sched_admin
from scheduling import conf, cron, sqlfiles, wakeup
from scheduling.models import MisfirePolicy, OverlapPolicy, Schedule, SkipReason, db_now
from scheduling.reconciler import Fired, ScheduleReconciler, Skipped
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, test_database_url

pytestmark = pytest.mark.django_db(transaction=True)


def minute(instant: datetime) -> datetime:
    return instant.replace(second=0, microsecond=0)


def make(binding: JobBinding | None = None, **kwargs: Any) -> Schedule:
    kwargs.setdefault("cron", "* * * * *")
    kwargs.setdefault("timezone", "UTC")
    return Schedule.objects.create(binding=binding or BindingFactory(), **kwargs)


def due_now(**kwargs: Any) -> tuple[Schedule, datetime]:
    """A daily schedule whose slot is the current minute, due now.

    Daily, not every minute: a pass that runs just after a minute boundary still sees
    this one slot only.
    """
    due = minute(db_now())
    schedule = make(cron=f"{due.minute} {due.hour} * * *", **kwargs)
    move(schedule, due)
    return schedule, due


def move(schedule: Schedule, next_fire_at: datetime | None) -> None:
    """Simulate time: put next_fire_at where a reconciler that was away would find it."""
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=next_fire_at)


def runs_of(schedule: Schedule) -> list[Run]:
    return list(Run.objects.filter(schedule_id=schedule.pk).order_by("scheduled_for"))


# --- model: creation and validation ------------------------------------------------------------
def test_create__with_binding_cron_and_timezone_only_registers_from_now() -> None:
    before = db_now()
    schedule = Schedule.objects.create(
        binding=BindingFactory(), cron="*/5 * * * *", timezone="Europe/Berlin"
    )
    schedule.refresh_from_db()
    assert schedule.enabled
    assert schedule.misfire_policy == MisfirePolicy.FIRE_ONCE
    assert schedule.overlap_policy == OverlapPolicy.SKIP
    assert schedule.next_fire_at is not None
    assert before < schedule.next_fire_at <= before + timedelta(minutes=5)
    assert schedule.next_fire_at.minute % 5 == 0
    assert schedule.skip_count == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cron", "61 * * * *", "bad minute field"),
        ("cron", "* * * *", "has 4"),
        ("cron", "@daily", "has 1"),
        ("timezone", "Mars/Olympus", "not an IANA time zone"),
    ],
)
def test_bad_cron_or_timezone__is_a_validation_error_naming_the_field(
    field: str, value: str, message: str
) -> None:
    schedule = Schedule(binding=BindingFactory(), cron="* * * * *", timezone="UTC")
    setattr(schedule, field, value)
    with pytest.raises(ValidationError) as clean_error:
        schedule.full_clean()
    assert message in " ".join(clean_error.value.message_dict[field])
    with pytest.raises(ValidationError) as save_error:
        schedule.save()
    assert message in " ".join(save_error.value.message_dict[field])
    assert not Schedule.objects.exists()


def test_changing_cron_or_timezone__recomputes_next_fire_at() -> None:
    schedule = make(cron="0 0 1 1 *")
    far = schedule.next_fire_at
    assert far is not None
    schedule.cron = "* * * * *"
    schedule.save()
    schedule.refresh_from_db()
    assert schedule.next_fire_at is not None and schedule.next_fire_at < far
    schedule.cron = "0 12 * * *"
    schedule.timezone = "Asia/Tokyo"
    schedule.save()
    assert schedule.next_fire_at.astimezone(ZoneInfo("Asia/Tokyo")).hour == 12


def test_save__never_writes_back_a_stale_next_fire_at() -> None:
    schedule = make()
    stale = Schedule.objects.get(pk=schedule.pk)
    moved = minute(db_now()) - timedelta(minutes=30)
    move(schedule, moved)  # the reconciler's value, newer than `stale`'s copy
    stale.misfire_policy = MisfirePolicy.SKIP
    stale.save()
    schedule.refresh_from_db()
    assert schedule.next_fire_at == moved
    assert schedule.misfire_policy == MisfirePolicy.SKIP


# --- registration, disabling, restarts ----------------------------------------------------------
def test_disabled_schedule__fires_nothing_and_re_enabling_registers_from_now() -> None:
    schedule = make()
    schedule.enabled = False
    schedule.save()
    schedule.refresh_from_db()
    assert schedule.next_fire_at is None
    # Disabled by a bulk update while a slot was due: still nothing fires.
    other = make()
    move(other, minute(db_now()) - timedelta(minutes=5))
    Schedule.objects.filter(pk=other.pk).update(enabled=False)
    report = ScheduleReconciler().run_once()
    assert report.fired == [] and report.skipped == []
    assert Run.objects.count() == 0
    other.refresh_from_db()
    assert other.next_fire_at is None  # cleared by registration
    # Re-enabled: registered from now, the missed past slots are not caught up.
    before = db_now()
    for s in (schedule, other):
        s.refresh_from_db()
        s.enabled = True
        s.save()
        s.refresh_from_db()
        assert s.next_fire_at is not None and s.next_fire_at > before
    assert ScheduleReconciler().run_once().fired == []
    assert Run.objects.count() == 0


def test_registration__sets_null_from_now_and_never_moves_an_existing_value() -> None:
    schedule = make()
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=None)
    missed = minute(db_now()) - timedelta(minutes=10)
    kept = make()
    move(kept, missed)
    registered, _ = ScheduleReconciler().register()
    assert registered == 1
    schedule.refresh_from_db()
    kept.refresh_from_db()
    assert schedule.next_fire_at is not None and schedule.next_fire_at > db_now()
    assert kept.next_fire_at == missed  # a restart never loses the missed slot


def test_restart_after_downtime__keeps_next_fire_at_and_catches_up_once() -> None:
    schedule = make(cron="0 * * * *")
    now = db_now()
    missed = minute(now).replace(minute=0) - timedelta(hours=3)
    move(schedule, missed)
    call_command("reconcile_schedules", stdout=StringIO())  # a reconciler starting up
    runs = runs_of(schedule)
    assert len(runs) == 1
    latest = minute(now).replace(minute=0)
    schedule.refresh_from_db()
    # The latest slot: the catch-up run (or, within the grace, the on-time run that is it).
    assert runs[0].scheduled_for == latest
    assert runs[0].trigger == Trigger.SCHEDULE
    assert schedule.next_fire_at == latest + timedelta(hours=1)
    assert schedule.last_run_id == runs[0].pk


# --- misfire after ten minutes of downtime -------------------------------------------------------
def downtime_schedule(policy: str) -> tuple[Schedule, dict[int, datetime]]:
    """A schedule with slots 10 and 5 minutes ago and 5 minutes ahead, whose reconciler
    has been away since the first: both past slots are misfires whatever the second."""
    base = minute(db_now())
    slot = {offset: base + timedelta(minutes=offset) for offset in (-10, -5, 5)}
    minutes = ",".join(str(s.minute) for s in sorted(slot.values(), key=lambda s: s.minute))
    schedule = make(cron=f"{minutes} * * * *", misfire_policy=policy)
    move(schedule, slot[-10])
    return schedule, slot


def test_ten_minutes_down__fire_once_creates_one_catch_up_run_and_resumes() -> None:
    schedule, slot = downtime_schedule(MisfirePolicy.FIRE_ONCE)
    ScheduleReconciler().register()  # the restart: nothing moves
    schedule.refresh_from_db()
    assert schedule.next_fire_at == slot[-10]
    report = ScheduleReconciler().run_once()
    assert [(f.slot, f.catch_up) for f in report.fired] == [(slot[-5], True)]
    assert [r.scheduled_for for r in runs_of(schedule)] == [slot[-5]]
    schedule.refresh_from_db()
    assert schedule.next_fire_at == slot[5]
    assert schedule.skip_count == 0
    assert ScheduleReconciler().run_once().fired == []  # nothing more until slot[5]


def test_ten_minutes_down__skip_creates_no_run_and_resumes() -> None:
    schedule, slot = downtime_schedule(MisfirePolicy.SKIP)
    report = ScheduleReconciler().run_once()
    assert report.fired == []
    assert [(s.slot, s.reason) for s in report.skipped] == [(slot[-5], SkipReason.MISFIRE)]
    assert runs_of(schedule) == []
    schedule.refresh_from_db()
    assert schedule.next_fire_at == slot[5]
    assert (schedule.skip_count, schedule.last_skip_reason) == (1, SkipReason.MISFIRE)
    assert schedule.last_skip_at is not None


def test_every_minute_after_downtime__fire_once_makes_exactly_one_run() -> None:
    schedule = make()
    move(schedule, minute(db_now()) - timedelta(minutes=10))
    report = ScheduleReconciler().run_once()
    assert len(report.fired) == 1
    (run,) = runs_of(schedule)
    schedule.refresh_from_db()
    assert schedule.next_fire_at == run.scheduled_for + timedelta(minutes=1)
    assert schedule.next_fire_at > db_now()


# --- overlap ----------------------------------------------------------------------------------------
def drive_overlap(policy: str) -> tuple[Schedule, list[datetime], list[Any]]:
    """Six every-minute slots fired one decision at a time, with a run that takes three
    minutes: claimed at its slot, finished at the third slot after it. Time is driven by
    next_fire_at (a grace of an hour keeps every slot on time)."""
    binding = BindingFactory(max_concurrency=5)
    schedule = make(binding, overlap_policy=policy)
    base = minute(db_now()) - timedelta(minutes=6)
    slots = [base + timedelta(minutes=i) for i in range(6)]
    move(schedule, slots[0])
    reconciler = ScheduleReconciler()
    outcomes: list[Any] = []
    running: dict[int, Any] = {}
    with override_settings(DISPATCH_MISFIRE_GRACE_SECONDS=3600):
        for i in range(6):
            if i - 3 in running:  # the run started at slot i-3 has run for 3 minutes
                claimed = running.pop(i - 3)
                assert (
                    claims.settle(claimed.attempt_id, claimed.lease_token, "SUCCEEDED")
                    == "SUCCEEDED"
                )
            outcome = reconciler.fire_one()
            outcomes.append(outcome)
            if isinstance(outcome, Fired) and not running:
                (claimed,) = claims.claim("test-worker", run_id=outcome.run_id, generic=False)
                running[i] = claimed
    return schedule, slots, outcomes


def test_overlap_skip__no_overlapping_runs_and_skips_recorded() -> None:
    schedule, slots, outcomes = drive_overlap(OverlapPolicy.SKIP)
    assert [type(o).__name__ for o in outcomes] == [
        "Fired",
        "Skipped",
        "Skipped",
        "Fired",
        "Skipped",
        "Skipped",
    ]
    assert {o.reason for o in outcomes if isinstance(o, Skipped)} == {SkipReason.OVERLAP}
    assert [r.scheduled_for for r in runs_of(schedule)] == [slots[0], slots[3]]
    schedule.refresh_from_db()
    assert (schedule.skip_count, schedule.last_skip_reason) == (4, SkipReason.OVERLAP)


def test_overlap_queue__creates_every_run_which_waits() -> None:
    schedule, slots, outcomes = drive_overlap(OverlapPolicy.QUEUE)
    assert all(isinstance(o, Fired) for o in outcomes)
    runs = runs_of(schedule)
    assert [r.scheduled_for for r in runs] == slots
    assert [r.status for r in runs] == [
        Status.SUCCEEDED,
        Status.PENDING,
        Status.PENDING,
        Status.RUNNING,
        Status.PENDING,
        Status.PENDING,
    ]
    schedule.refresh_from_db()
    assert schedule.skip_count == 0


# --- disabled binding or job at fire time -----------------------------------------------------------
@pytest.mark.parametrize("what", ["binding", "job"])
def test_disabled_binding_or_job__no_run_and_skip_recorded(what: str) -> None:
    schedule, due = due_now()
    if what == "binding":
        JobBinding.objects.filter(pk=schedule.binding_id).update(enabled=False)
    else:
        Job.objects.filter(pk=schedule.binding.job_id).update(enabled=False)
    report = ScheduleReconciler().run_once()
    reason = SkipReason.BINDING_DISABLED if what == "binding" else SkipReason.JOB_DISABLED
    assert [(s.slot, s.reason) for s in report.skipped] == [(due, reason)]
    assert runs_of(schedule) == []
    schedule.refresh_from_db()
    assert (schedule.skip_count, schedule.last_skip_reason) == (1, reason)
    assert schedule.next_fire_at == due + timedelta(days=1)


# --- DST, fired by the reconciler ----------------------------------------------------------------
def last_transitions(tz_name: str, now: datetime) -> dict[str, datetime]:
    """The most recent spring-forward and fall-back days (local midnight, UTC) before now."""
    tz = ZoneInfo(tz_name)
    found: dict[str, datetime] = {}
    day = now.astimezone(tz).replace(hour=12, minute=0, second=0, microsecond=0, tzinfo=None)
    while len(found) < 2:
        before = (day - timedelta(days=1)).replace(tzinfo=tz).utcoffset()
        after = day.replace(tzinfo=tz).utcoffset()
        assert before is not None and after is not None
        if before != after:
            found.setdefault("spring" if after > before else "fall", day.replace(hour=0))
        day -= timedelta(days=1)
    return {k: v.replace(tzinfo=tz).astimezone(UTC) for k, v in found.items()}


@pytest.mark.parametrize("tz_name", ["Europe/Berlin", "America/New_York"])
def test_daily_0230__reconciler_fires_once_per_day_across_the_transitions(tz_name: str) -> None:
    tz = ZoneInfo(tz_name)
    slots = cron.Slots("30 2 * * *", tz_name)
    reconciler = ScheduleReconciler()
    for kind, day in last_transitions(tz_name, db_now()).items():
        schedule = make(cron="30 2 * * *", timezone=tz_name, overlap_policy=OverlapPolicy.QUEUE)
        move(schedule, slots.next_after(day - timedelta(days=2)))
        # A grace long enough that these past slots are on time: the reconciler fires
        # them one by one, as it would have on those days.
        with override_settings(DISPATCH_MISFIRE_GRACE_SECONDS=10**9):
            while True:
                schedule.refresh_from_db()
                if schedule.next_fire_at > day + timedelta(days=2):
                    break
                assert isinstance(reconciler.fire_one(), Fired)
        fired = [r.scheduled_for.astimezone(tz) for r in runs_of(schedule)]
        dates = [f.date() for f in fired]
        assert len(fired) == 4 and len(set(dates)) == 4, fired
        on_the_day = [f for f in fired if f.date() == day.astimezone(tz).date()]
        assert len(on_the_day) == 1
        expected = "03:00" if kind == "spring" else "02:30"
        if kind == "fall" and tz_name == "Europe/Berlin":
            # 02:30 happens twice; the first is the slot (summer time, +02:00).
            assert on_the_day[0].utcoffset() == timedelta(hours=2)
        assert on_the_day[0].strftime("%H:%M") == expected
        Schedule.objects.filter(pk=schedule.pk).update(enabled=False)


# --- the command ---------------------------------------------------------------------------------
def test_reconcile_schedules__prints_what_it_did() -> None:
    schedule, due = due_now()
    out = StringIO()
    call_command("reconcile_schedules", stdout=out)
    (run,) = runs_of(schedule)
    text = out.getvalue()
    assert f"schedule {schedule.pk} slot {due.isoformat()}: run {run.pk}" in text
    assert "fired 1, skipped 0" in text
    out = StringIO()
    call_command("reconcile_schedules", stdout=out)
    assert "fired 0, skipped 0" in out.getvalue()


def test_reconciler__survives_a_schedule_it_cannot_evaluate() -> None:
    broken = make()
    good, due = due_now()
    # Written behind the model's back: the reconciler logs it and goes on.
    Schedule.objects.filter(pk=broken.pk).update(cron="99 * * * *", next_fire_at=due)
    report = ScheduleReconciler().run_once()
    assert report.failed == [broken.pk]
    assert [f.schedule_id for f in report.fired] == [good.pk]


# --- admin --------------------------------------------------------------------------------------------
def user_with(*codenames: str) -> User:
    user = User.objects.create_user(f"user-{uuid.uuid4().hex[:8]}", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def form_data(binding: JobBinding, **overrides: Any) -> dict[str, Any]:
    data = {
        "binding": str(binding.pk),
        "cron": "*/5 * * * *",
        "timezone": "UTC",
        "enabled": "on",
        "misfire_policy": "FIRE_ONCE",
        "overlap_policy": "SKIP",
    }
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cron", "*/5 * * *", "has 4"),
        ("cron", "0 25 * * *", "bad hour field"),
        ("timezone", "Europe/Atlantis", "not an IANA time zone"),
    ],
)
def test_admin_add__bad_cron_or_timezone_is_a_form_error(
    admin_client: Client, field: str, value: str, message: str
) -> None:
    binding = BindingFactory()
    response = admin_client.post(
        reverse("admin:scheduling_schedule_add"), form_data(binding, **{field: value})
    )
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Schedule.objects.exists()


def test_admin_add__enabled_needs_the_binding_trigger_permission(client: Client) -> None:
    binding = BindingFactory()
    client.force_login(user_with("add_schedule", "change_schedule", "view_schedule"))
    url = reverse("admin:scheduling_schedule_add")
    response = client.post(url, form_data(binding))
    assert response.status_code == 200
    assert "trigger permission" in response.content.decode()
    assert not Schedule.objects.exists()
    # Disabled it may be created; enabling it later needs the permission too.
    assert client.post(url, form_data(binding, enabled=None)).status_code == 302
    schedule = Schedule.objects.get()
    change = reverse("admin:scheduling_schedule_change", args=[schedule.pk])
    response = client.post(change, form_data(binding))
    assert response.status_code == 200 and "trigger permission" in response.content.decode()
    schedule.refresh_from_db()
    assert not schedule.enabled
    # The enable action is not offered, and posting it changes nothing.
    changelist = reverse("admin:scheduling_schedule_changelist")
    assert "enable_schedules" not in client.get(changelist).content.decode()
    client.post(changelist, {"action": "enable_schedules", "_selected_action": [str(schedule.pk)]})
    schedule.refresh_from_db()
    assert not schedule.enabled


def test_admin__with_trigger_permission_creates_and_enables(client: Client) -> None:
    binding = BindingFactory()
    client.force_login(
        user_with("add_schedule", "change_schedule", "view_schedule", "trigger_binding")
    )
    response = client.post(reverse("admin:scheduling_schedule_add"), form_data(binding))
    assert response.status_code == 302
    schedule = Schedule.objects.get()
    assert schedule.enabled and schedule.next_fire_at is not None
    changelist = reverse("admin:scheduling_schedule_changelist")
    client.post(changelist, {"action": "disable_schedules", "_selected_action": [str(schedule.pk)]})
    schedule.refresh_from_db()
    assert not schedule.enabled and schedule.next_fire_at is None
    client.post(changelist, {"action": "enable_schedules", "_selected_action": [str(schedule.pk)]})
    schedule.refresh_from_db()
    assert schedule.enabled and schedule.next_fire_at is not None


def test_admin_changelist__shows_upcoming_times_and_last_run_without_n_plus_1(
    admin_client: Client,
) -> None:
    url = reverse("admin:scheduling_schedule_changelist")

    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(url).status_code == 200
        return len(ctx.captured_queries)

    first = make(cron="30 2 * * *", timezone="Europe/Berlin")
    move(first, minute(db_now()))
    ScheduleReconciler().run_once()
    few = queries()
    for _ in range(6):
        make(binding=BindingFactory())
    assert queries() == few
    page = admin_client.get(url).content.decode()
    (run,) = runs_of(first)
    assert str(run.pk)[:8] in page
    assert page.count("02:30 CET") + page.count("02:30 CEST") >= 5


# --- the wake-up ----------------------------------------------------------------------------------
def test_wakeup__inside_a_transaction_is_delivered_at_its_commit_never_after_a_rollback() -> None:
    with psycopg.connect(test_database_url(), autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(conf.schedule_channel())))
        with pytest.raises(RuntimeError), transaction.atomic():
            wakeup.notify("rolled-back")
            raise RuntimeError("the caller's transaction fails")
        with transaction.atomic():
            wakeup.notify("committed")
        wakeup.notify("outside")
        # Delivered in commit order: the rolled-back one would have come first.
        got = [n.payload for n in listener.notifies(timeout=10, stop_after=2)]
    assert got == ["committed", "outside"]


def test_wakeup__a_missing_statement_raises_instead_of_being_swallowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> str:
        raise KeyError(f"no statement named {name!r}")

    monkeypatch.setattr(sqlfiles, "query", missing)
    with pytest.raises(KeyError, match="notify_in_transaction"), transaction.atomic():
        wakeup.notify(uuid.uuid4())


def test_wakeup__a_database_error_is_logged_and_the_callers_transaction_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    schedule = make()
    # PostgreSQL refuses a channel name of 64 bytes or more (system check scheduling.E001).
    with override_settings(DISPATCH_SCHEDULE_CHANNEL="x" * 100), transaction.atomic():
        Schedule.objects.filter(pk=schedule.pk).update(skip_count=7)
        wakeup.notify(schedule.pk)
        Schedule.objects.filter(pk=schedule.pk).update(skip_count=F("skip_count") + 1)
    assert Schedule.objects.get(pk=schedule.pk).skip_count == 8
    assert f"schedule wake-up not sent schedule={schedule.pk}" in caplog.text


def test_every_statement_name_scheduling_uses_exists_and_is_valid_sql() -> None:
    """A name the code asks for has its statement (a missing one is a KeyError at run
    time), and every statement of scheduling/sql/queries.sql plans against the schema."""
    own_names: set[str] = set()
    dispatch_names: set[str] = set()
    for path in (ROOT / "scheduling").rglob("*.py"):
        text = path.read_text()
        dispatch_names |= set(re.findall(r'dispatch_sqlfiles\.query\(\s*"(\w+)"', text))
        own_names |= set(
            re.findall(r'(?<!dispatch_)(?:sqlfiles\.query|_execute|_guarded)\(\s*"(\w+)"', text)
        )
    assert {"due_schedule", "record_fire", "notify_in_transaction"} <= own_names
    assert dispatch_names == {"notify"}
    assert own_names <= set(sqlfiles.query_names()), own_names - set(sqlfiles.query_names())
    assert dispatch_names <= set(dispatch_sqlfiles.query_names())
    with connection.cursor() as cursor:
        for name in sqlfiles.query_names():
            # EXPLAIN plans without executing: tables, columns and functions exist.
            cursor.execute("EXPLAIN " + re.sub(r"%\((\w+)\)s", "NULL", sqlfiles.query(name)))


# --- system checks --------------------------------------------------------------------------------
def test_checks__bad_channel_and_grace_have_stable_ids() -> None:
    from scheduling.checks import check_settings

    assert check_settings() == []
    with override_settings(DISPATCH_SCHEDULE_CHANNEL="", DISPATCH_MISFIRE_GRACE_SECONDS=0):
        assert [e.id for e in check_settings()] == ["scheduling.E001", "scheduling.E002"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cron", "* * * * *"),  # yearly -> every minute
        ("binding", None),  # moved to another binding (filled in below)
        ("timezone", "Pacific/Kiritimati"),
        ("overlap_policy", "QUEUE"),
    ],
)
def test_admin_change__firing_changes_of_an_enabled_schedule_need_the_trigger_permission(
    client: Client, field: str, value: str | None
) -> None:
    binding = BindingFactory()
    schedule = Schedule.objects.create(binding=binding, cron="0 0 1 1 *", enabled=True)
    if field == "binding":
        value = str(BindingFactory().pk)
    client.force_login(user_with("change_schedule", "view_schedule"))
    change = reverse("admin:scheduling_schedule_change", args=[schedule.pk])
    before = Schedule.objects.values(*sched_admin.FIRING_FIELDS).get(pk=schedule.pk)
    faster = {**form_data(binding, cron="0 0 1 1 *"), field: value}
    response = client.post(change, faster)
    assert response.status_code == 200
    assert "trigger permission of the binding(s) involved" in response.content.decode()
    assert Schedule.objects.values(*sched_admin.FIRING_FIELDS).get(pk=schedule.pk) == before
    # Disabling needs no trigger permission; an unchanged save neither.
    assert client.post(change, form_data(binding, cron="0 0 1 1 *")).status_code == 302
    assert (
        client.post(change, form_data(binding, cron="0 0 1 1 *", enabled=None)).status_code == 302
    )
    # With the permission the same change is saved.
    client.force_login(user_with("change_schedule", "view_schedule", "trigger_binding"))
    assert client.post(change, faster).status_code == 302


def test_save_model__refuses_a_faster_cron_without_the_trigger_permission() -> None:
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="0 0 1 1 *", enabled=True)
    factory = RequestFactory()
    request = factory.post("/")
    request.user = user_with("change_schedule")
    schedule.cron = "* * * * *"
    model_admin = sched_admin.ScheduleAdmin(Schedule, admin.site)
    with pytest.raises(PermissionDenied):
        model_admin.save_model(request, schedule, None, change=True)
    assert Schedule.objects.get(pk=schedule.pk).cron == "0 0 1 1 *"
