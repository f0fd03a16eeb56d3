"""`manage.py dispatch <subcommand>`: dispatch's commands under one name no other app
takes, each run by its own command class; and dispatch.W003 naming the app whose command
wins when another app listed first has a `runworker`."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command

from dispatch.core import commands
from dispatch.core.states import Status, Trigger
from dispatch.models import Run
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=worker_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dispatch_trigger_then_dispatch_worker__run_end_to_end() -> None:
    binding = BindingFactory(name="namespaced")
    triggered = manage("dispatch", "trigger", "namespaced")
    assert triggered.returncode == 0, triggered.stderr
    run = Run.objects.get(pk=triggered.stdout.strip())
    assert run.binding_id == binding.pk and run.trigger == Trigger.MANUAL
    worker = manage("dispatch", "worker", "--burst", "--no-scheduler")
    assert worker.returncode == 0, worker.stderr
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED


def test_dispatch_subcommand__through_call_command() -> None:
    BindingFactory(name="called")
    out = io.StringIO()
    call_command("dispatch", "trigger", "called", "--idempotency-key", "k", stdout=out)
    call_command("dispatch", "trigger", "called", "--idempotency-key", "k", stdout=io.StringIO())
    assert str(Run.objects.get().pk) == out.getvalue().strip()
    # The subcommand's own errors, as from the command itself.
    with pytest.raises(CommandError, match="No binding with id or name 'missing'"):
        call_command("dispatch", "trigger", "missing", stdout=io.StringIO())


def test_dispatch_unknown_or_missing_subcommand__names_the_known_ones() -> None:
    with pytest.raises(CommandError, match="Unknown subcommand 'nope'; one of: .*worker"):
        call_command("dispatch", "nope")
    with pytest.raises(CommandError, match="Name a subcommand: one of .*worker"):
        call_command("dispatch")
    result = manage("dispatch", "nope")
    assert result.returncode == 1
    assert "Unknown subcommand 'nope'" in result.stderr and "Traceback" not in result.stderr


def test_dispatch_help__lists_the_subcommands_and_each_has_its_own_help() -> None:
    listed = manage("dispatch", "--help")
    assert listed.returncode == 0, listed.stderr
    for name in (*commands.BUILTIN, "schedules"):
        assert f"\n  {name} " in listed.stdout, (name, listed.stdout)
    assert "manage.py runworker: Claim and execute runs" in listed.stdout
    assert "manage.py reconcile_schedules: Register schedules" in listed.stdout
    worker = manage("dispatch", "worker", "--help")
    assert worker.returncode == 0, worker.stderr
    assert "usage: manage.py dispatch worker" in worker.stdout
    assert "--concurrency" in worker.stdout and "--no-scheduler" in worker.stdout
    schedules = manage("dispatch", "schedules", "--help")
    assert (
        "usage: manage.py dispatch schedules" in schedules.stdout and "--loop" in schedules.stdout
    )


def test_check_w002__names_the_app_whose_runworker_wins() -> None:
    shadowed = manage("check", DJANGO_SETTINGS_MODULE="tests.support.settings_shadow")
    assert shadowed.returncode == 0, shadowed.stderr  # a warning, not an error
    out = shadowed.stderr
    assert "dispatch.W003" in out
    assert (
        "`manage.py runworker` runs the command of the app tests.support.shadow_commands, "
        "not the one of dispatch" in out
    )
    assert "manage.py dispatch worker" in out
    # That app's runworker is the one `runworker` runs; the namespace still reaches ours.
    other = manage("runworker", DJANGO_SETTINGS_MODULE="tests.support.settings_shadow")
    assert "the other app's runworker" in other.stdout
    ours = manage(
        "dispatch", "worker", "--help", DJANGO_SETTINGS_MODULE="tests.support.settings_shadow"
    )
    assert "--concurrency" in ours.stdout
    # The repository's own settings: dispatch's commands are its own.
    plain = manage("check")
    assert plain.returncode == 0, plain.stderr
    assert "dispatch.W003" not in plain.stdout + plain.stderr
