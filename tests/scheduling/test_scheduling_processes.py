"""Reconcilers as real processes: three racing over the same due schedules, the loop's
wake-up on a saved schedule (through the admin, or asked for inside a transaction) and its
prompt stop, `runworker` (with no flags, `--scheduler`, `--burst`, `--no-scheduler`)
running a scheduled run to the end or not, and `manage.py check` saying when nothing
fires the schedules."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from dispatch.core.states import Status, Trigger
from dispatch.models import Run
from scheduling import conf, wakeup
from scheduling.models import OverlapPolicy, ReconcilerBeat, Schedule, db_now
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, Processes, wait_until, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SCHEDULES = 12


def listening(count: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND datname = current_database()",
            ["dispatch-schedules-listen"],
        )
        (n,) = cursor.fetchone()
    return n >= count


def reconciler_asleep() -> bool:
    """A reconciler's working connection is idle after the last statement of its pass (an
    idle pass's `survey`, or the sleep's `next_due_in`: both read min(next_fire_at) -
    clock_timestamp()): it waits on its LISTEN socket until a notification or the end of
    its bounded sleep."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state = 'idle'"
            " AND query LIKE '%%min(next_fire_at) - clock_timestamp()%%'"
        )
        (n,) = cursor.fetchone()
    return n >= 1


def wake_reconcilers() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, 'test')", [conf.schedule_channel()])


def caught_up() -> bool:
    return not Schedule.objects.filter(enabled=True, next_fire_at__lte=Now()).exists()


def test_three_reconcilers__every_slot_has_exactly_one_run(processes: Processes) -> None:
    binding = BindingFactory()
    schedules = [
        Schedule.objects.create(
            binding=binding, cron="* * * * *", timezone="UTC", overlap_policy=OverlapPolicy.QUEUE
        )
        for _ in range(SCHEDULES)
    ]
    # Every past slot counts as on time, so each one must get its run.
    env = worker_env(DISPATCH_MISFIRE_GRACE_SECONDS="604800")  # the maximum (dispatch.E005)
    procs = [processes.manage("reconcile_schedules", "--loop", env=env) for _ in range(3)]
    wait_until(lambda: listening(3), timeout=30, message="three reconcilers listening")
    started = time.monotonic()
    # Move every schedule into the past, again and again, further each time: the same
    # slots are offered to the three reconcilers at once.
    for minutes in (25, 40, 60):
        Schedule.objects.update(
            next_fire_at=db_now().replace(second=0, microsecond=0) - timedelta(minutes=minutes)
        )
        wake_reconcilers()
        wait_until(caught_up, timeout=120, message="every due slot fired")
    elapsed = time.monotonic() - started
    with connection.cursor() as cursor:
        cursor.execute("SELECT date_trunc('minute', now())")
        (current,) = cursor.fetchone()
    for schedule in schedules:
        slots = list(
            Run.objects.filter(schedule_id=schedule.pk)
            .order_by("scheduled_for")
            .values_list("scheduled_for", flat=True)
        )
        assert len(slots) == len(set(slots))
        # Contiguous, every minute from the earliest moved-to slot up to now: none lost.
        assert slots[0] <= current - timedelta(minutes=60)
        assert slots[-1] >= current - timedelta(minutes=1)
        gaps = [
            b - a for a, b in zip(slots, slots[1:], strict=False) if b - a != timedelta(minutes=1)
        ]
        assert gaps == [], schedule.pk
    # Each run was created by exactly one reconciler (a repeat offer of a slot that already
    # had its run reports existing=True and creates nothing).
    created: Counter[int] = Counter()
    for index, proc in enumerate(procs):
        created[index] = len(
            re.findall(r"schedule fired .* existing=False", Processes.output(proc))
        )
    total = Run.objects.filter(trigger=Trigger.SCHEDULE).count()
    assert sum(created.values()) == total
    for proc in procs:
        assert "Traceback" not in Processes.output(proc)
        assert "GuardFailed" not in Processes.output(proc)
    print(
        f"\n{total} runs over {SCHEDULES} schedules by three reconcilers in {elapsed:.1f}s; "
        f"created per reconciler {dict(created)}"
    )
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(10) == 0


def test_reconcile_loop__wakes_on_a_saved_schedule_and_stops_promptly(processes: Processes) -> None:
    proc = processes.manage("reconcile_schedules", "--loop")
    wait_until(lambda: listening(1), timeout=30, message="reconciler listening")
    # Nothing is registered: the loop sleeps its full bound (30 s) unless woken.
    time.sleep(0.5)
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="* * * * *", timezone="UTC")
    Schedule.objects.filter(pk=schedule.pk).update(
        next_fire_at=db_now().replace(second=0, microsecond=0)
    )
    started = time.monotonic()
    schedule.refresh_from_db()
    schedule.save()  # keeps the due next_fire_at, wakes the loop after the commit
    wait_until(
        lambda: Run.objects.filter(schedule_id=schedule.pk).exists(),
        timeout=10,
        message="the scheduled run",
    )
    woke_in = time.monotonic() - started
    assert woke_in < 5, woke_in
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert proc.wait(10) == 0
    assert time.monotonic() - stopped < 3
    out = Processes.output(proc)
    assert "schedule reconciler stopped" in out
    print(f"\nwoken in {woke_in:.2f}s; stopped in {time.monotonic() - stopped:.2f}s")


@pytest.mark.parametrize("way", ["admin", "inside_a_transaction"])
def test_reconcile_loop__woken_within_a_second_by_a_schedule_written_in_a_transaction(
    processes: Processes, admin_client: Client, way: str
) -> None:
    # A yearly slot: once registered, the loop sleeps its full bound (30 s) unless woken.
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="0 0 1 1 *", timezone="UTC")
    due = schedule.slots().latest_at_or_before(db_now())
    assert due is not None
    processes.manage("reconcile_schedules", "--loop")
    wait_until(
        lambda: listening(1) and reconciler_asleep(), timeout=30, message="the reconciler asleep"
    )
    if way == "admin":
        # The slot came due (as time passing would make it), then an operator edits the
        # schedule: the admin saves it inside its own transaction, keeping next_fire_at.
        Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=due)
        response = admin_client.post(
            reverse("admin:scheduling_schedule_change", args=[schedule.pk]),
            {
                "binding": str(schedule.binding_id),
                "cron": schedule.cron,
                "timezone": "UTC",
                "enabled": "on",
                "misfire_policy": "FIRE_ONCE",
                "overlap_policy": "QUEUE",
            },
        )
        assert response.status_code == 302, response.content.decode()[-2000:]
    else:
        # A write the caller announces inside its transaction: sent at its commit.
        with transaction.atomic():
            Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=due)
            wakeup.notify(schedule.pk)
    committed = time.monotonic()
    run = wait_until(
        lambda: Run.objects.filter(schedule_id=schedule.pk, scheduled_for=due).first(),
        timeout=1.0,
        message="the woken reconciler's run for the due slot",
    )
    woke_in = time.monotonic() - committed
    assert run.trigger == Trigger.SCHEDULE
    print(f"\n{way}: the reconciler fired the due slot {woke_in:.3f}s after the commit")


def test_runworker_scheduler__scheduled_run_succeeds(processes: Processes) -> None:
    binding = BindingFactory()
    # A daily slot five minutes ago, missed: FIRE_ONCE catches exactly it up, whatever
    # minute boundary the test happens to cross (an every-minute slot could be superseded
    # by the next one while the worker starts).
    due = db_now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    schedule = Schedule.objects.create(
        binding=binding, cron=f"{due.minute} {due.hour} * * *", timezone="UTC"
    )
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=due)
    worker = processes.worker("--scheduler", "--concurrency", "2")

    def succeeded() -> Run | None:
        return Run.objects.filter(schedule_id=schedule.pk, status=Status.SUCCEEDED).first()

    run = wait_until(succeeded, timeout=30, message="the scheduled run to succeed")
    assert run.trigger == Trigger.SCHEDULE
    assert run.scheduled_for == due
    assert Run.objects.filter(schedule_id=schedule.pk).count() == 1
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert "schedule reconciler started" in Processes.output(worker)


def test_runworker_without_flags__fires_an_every_minute_schedule_and_runs_it(
    processes: Processes,
) -> None:
    """The layout a host site gets by following the README: one `runworker`, no flags."""
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="* * * * *", timezone="UTC")
    # The current minute's slot, due now (as a minute passing would make it).
    Schedule.objects.filter(pk=schedule.pk).update(
        next_fire_at=db_now().replace(second=0, microsecond=0)
    )
    worker = processes.worker()
    run = wait_until(
        lambda: Run.objects.filter(schedule_id=schedule.pk, status=Status.SUCCEEDED).first(),
        timeout=30,
        message="the scheduled run to succeed",
    )
    assert run.trigger == Trigger.SCHEDULE
    assert ReconcilerBeat.objects.get().beat_at >= run.created_at - timedelta(seconds=1)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert "schedule reconciler started" in Processes.output(worker)
    assert "wake-ups=the worker's LISTEN connection" in Processes.output(worker)


def test_runworker_reconciler__woken_through_the_workers_listen_connection(
    processes: Processes,
) -> None:
    # A yearly slot: once registered, the loop sleeps its full bound (30 s) unless woken.
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="0 0 1 1 *", timezone="UTC")
    due = schedule.slots().latest_at_or_before(db_now())
    assert due is not None
    worker = processes.worker("--worker-id", "w-wake")
    wait_until(
        lambda: "listening worker=w-wake" in Processes.output(worker) and reconciler_asleep(),
        timeout=30,
        message="the worker listening and its reconciler asleep",
    )
    assert not listening(1)  # no LISTEN connection of the reconciler's own
    with transaction.atomic():
        Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=due)
        wakeup.notify(schedule.pk)
    committed = time.monotonic()
    wait_until(
        lambda: Run.objects.filter(schedule_id=schedule.pk, scheduled_for=due).exists(),
        timeout=1.0,
        message="the woken reconciler's run for the due slot",
    )
    print(f"\nrunworker's reconciler fired the slot {time.monotonic() - committed:.3f}s after")


@pytest.mark.parametrize(("flags", "runs"), [((), 1), (("--no-scheduler",), 0)])
def test_runworker_burst__fires_what_is_due_then_drains_unless_no_scheduler(
    processes: Processes, flags: tuple[str, ...], runs: int
) -> None:
    """`--burst` runs one reconciler pass before it drains, so its exit is the signal that
    the pass happened (or, with --no-scheduler, did not)."""
    due = db_now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    # A daily slot five minutes ago, missed: FIRE_ONCE catches exactly it up.
    schedule = Schedule.objects.create(
        binding=BindingFactory(), cron=f"{due.minute} {due.hour} * * *", timezone="UTC"
    )
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=due)
    worker = processes.worker("--burst", *flags)
    assert worker.wait(60) == 0, Processes.output(worker)
    out = Processes.output(worker)
    assert Run.objects.filter(schedule_id=schedule.pk).count() == runs, out
    assert Run.objects.filter(schedule_id=schedule.pk, status=Status.SUCCEEDED).count() == runs
    assert ("schedule pass" in out) == bool(runs), out
    assert ReconcilerBeat.objects.exists() == bool(runs)


def manage_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_manage_check__warns_of_overdue_schedules_with_no_reconciler_and_never_fails() -> None:
    quiet = manage_check(worker_env())
    assert quiet.returncode == 0 and "scheduling.W001" not in quiet.stdout + quiet.stderr
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="* * * * *", timezone="UTC")
    Schedule.objects.filter(pk=schedule.pk).update(
        next_fire_at=db_now() - timedelta(seconds=2 * conf.STALLED_AFTER_SECONDS)
    )
    result = manage_check(worker_env())
    assert result.returncode == 0, result.stderr  # a warning, not an error
    assert "scheduling.W001" in result.stderr
    assert "no schedule reconciler has ever run" in result.stderr
    # A database that is down: the check says nothing (the commands that need the
    # database say so), and `check` itself does not fail.
    down = manage_check(worker_env(DATABASE_URL="postgres://postgres@127.0.0.1:9/nowhere"))
    assert down.returncode == 0, down.stderr
    assert "Traceback" not in down.stderr and "scheduling.W001" not in down.stderr


REGISTER_AT_START = (
    "import threading, project.wsgi\n"
    "for t in threading.enumerate():\n"
    "    if t.name == 'schedule-registration':\n"
    "        t.join(30)\n"
    "print('site up')\n"
)


def test_site_start__registers_schedules(processes: Processes) -> None:
    schedule = Schedule.objects.create(binding=BindingFactory(), cron="* * * * *", timezone="UTC")
    Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=None)
    result = subprocess.run(
        [sys.executable, "-c", REGISTER_AT_START],
        env=worker_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "site up" in result.stdout
    schedule.refresh_from_db()
    assert schedule.next_fire_at is not None and schedule.next_fire_at > db_now()


def test_site_start__a_database_that_is_down_does_not_stop_the_site() -> None:
    env = worker_env(DATABASE_URL="postgres://postgres@127.0.0.1:9/nowhere")
    result = subprocess.run(
        [sys.executable, "-c", REGISTER_AT_START],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "site up" in result.stdout
    assert "schedules not registered at start" in result.stderr
