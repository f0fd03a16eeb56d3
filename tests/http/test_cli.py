"""`manage.py dispatch runs list|show` and `dispatch bindings list`: readable tables, and
JSON that is the HTTP API's (the same schemas), for scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from dispatch import services
from dispatch.http.schemas import BindingOut, RunDetail, RunOut
from dispatch.models import BindingHealth, Run
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT, worker_env


def dispatch(*args: str) -> str:
    out = StringIO()
    call_command("dispatch", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_runs_list__table_filters_limit_and_json() -> None:
    a, b = BindingFactory(name="orders"), BindingFactory(name="users")
    runs = [services.trigger(a) for _ in range(3)] + [services.trigger(b)]
    Run.objects.filter(pk=runs[0].pk).update(status="FAILED")
    table = dispatch("runs", "list")
    assert table.splitlines()[0].split()[:3] == ["RUN", "BINDING", "STATUS"]
    assert len(table.splitlines()) == 5
    assert str(runs[3].pk) in table.splitlines()[1]  # newest first
    listed = json.loads(dispatch("runs", "list", "--binding", "orders", "--json"))
    assert [RunOut.model_validate(r).binding for r in listed] == ["orders"] * 3
    failed = json.loads(dispatch("runs", "list", "--status", "FAILED", "--json"))
    assert [r["id"] for r in failed] == [str(runs[0].pk)]
    assert len(json.loads(dispatch("runs", "list", "--limit", "2", "--json"))) == 2
    with pytest.raises(CommandError, match="No binding"):
        dispatch("runs", "list", "--binding", "nope")
    with pytest.raises(CommandError, match="--limit"):
        dispatch("runs", "list", "--limit", "0")


@pytest.mark.django_db
def test_runs_show__the_api_schema_as_json() -> None:
    run = services.trigger(BindingFactory(name="orders"), idempotency_key="k-1")
    shown = dispatch("runs", "show", str(run.pk))
    assert f"run        {run.pk}" in shown and "attempt 1: PENDING" in shown
    detail = RunDetail.model_validate(json.loads(dispatch("runs", "show", str(run.pk), "--json")))
    assert detail.id == run.pk and detail.idempotency_key == "k-1"
    assert [a.number for a in detail.attempts] == [1]
    with pytest.raises(CommandError, match="not a run id"):
        dispatch("runs", "show", "nope")


@pytest.mark.django_db
def test_bindings_list__health_and_json() -> None:
    a = BindingFactory(name="orders")
    BindingFactory(name="users", enabled=False)
    BindingHealth.objects.create(binding=a, state="WARNED", consecutive_failures=2)
    table = dispatch("bindings", "list").splitlines()
    assert table[1].split()[:3] == ["orders", "yes", "WARNED"]
    assert table[2].split()[:3] == ["users", "no", "-"]
    items = [
        BindingOut.model_validate(b) for b in json.loads(dispatch("bindings", "list", "--json"))
    ]
    assert [(b.name, b.health.state if b.health else None) for b in items] == [
        ("orders", "WARNED"),
        ("users", None),
    ]


@pytest.mark.django_db(transaction=True)
def test_the_commands_run_from_the_command_line() -> None:
    run = services.trigger(BindingFactory(name="orders"))
    done = subprocess.run(
        [sys.executable, "manage.py", "dispatch", "runs", "list", "--json"],
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in json.loads(done.stdout)] == [str(run.pk)]
