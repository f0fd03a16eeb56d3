"""`dispatch_apply --prune`: only objects an apply created, never one with live runs."""

from __future__ import annotations

import textwrap

import pytest

from dispatch import ascode, services
from dispatch.core.states import Status
from dispatch.models import MANAGED_BY_FILES, Attempt, Datasource, JobBinding, Run
from scheduling.models import Schedule
from tests.support.ascode import apply_text, plan_text
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db

BASE = textwrap.dedent("""
    datasources:
      gen: {kind: generate}
      void: {kind: "null"}
    jobs:
      copy: {source_spec: {rows: 5}}
    bindings:
      keep-me: {job: copy, source: gen, sink: void}
""")
EXTRA = textwrap.dedent("""
    datasources:
      gen2: {kind: generate}
    jobs:
      copy2: {source_spec: {rows: 5}}
    bindings:
      drop-me: {job: copy2, source: gen2, sink: void}
    schedules:
      drop-me-hourly: {binding: drop-me, cron: "0 * * * *"}
""")

# Two documents in one text: sections may appear in several documents, an object once.
ALL = BASE + "---\n" + EXTRA


def test_prune__deletes_what_the_files_no_longer_define_and_nothing_else() -> None:
    apply_text(ALL)
    console = BindingFactory(name="made-in-console")
    finished = services.trigger(JobBinding.objects.get(name="drop-me"))
    Attempt.objects.filter(run=finished).update(
        status=Status.SUCCEEDED, finished_at=finished.created_at
    )
    Run.objects.filter(pk=finished.pk).update(status=Status.SUCCEEDED)

    without_prune = plan_text(BASE)
    assert not without_prune.has_changes
    assert "--prune deletes them" in without_prune.render()
    plan = plan_text(BASE, prune=True)
    deleted = sorted((c.label, c.name) for c in plan.changes if c.action == "delete")
    result = ascode.apply(plan)

    assert deleted == [
        ("binding", "drop-me"),
        ("datasource", "gen2"),
        ("job", "copy2"),
        ("schedule", "drop-me-hourly"),
    ]
    assert result.deleted == 4
    assert set(JobBinding.objects.values_list("name", flat=True)) == {"keep-me", "made-in-console"}
    assert not Datasource.objects.filter(name="gen2").exists()
    assert not Schedule.objects.exists()
    assert not Run.objects.filter(pk=finished.pk).exists()  # its finished history went too
    console.refresh_from_db()  # never managed: never pruned
    assert console.managed_by == ""


def test_prune__keeps_a_binding_with_a_live_run_and_what_it_uses() -> None:
    apply_text(ALL)
    live = services.trigger(JobBinding.objects.get(name="drop-me"))

    plan = plan_text(BASE, prune=True)
    kept = {c.name: c.reason for c in plan.changes if c.action == "keep"}
    ascode.apply(plan)

    assert kept["drop-me"].startswith("not deleted: it has 1 live run(s) (PENDING or RUNNING)")
    assert kept["copy2"] == "not deleted: binding drop-me (kept) uses it as job"
    assert kept["gen2"] == "not deleted: binding drop-me (kept) uses it as source"
    assert Run.objects.filter(pk=live.pk).exists()
    assert JobBinding.objects.filter(name="drop-me", managed_by=MANAGED_BY_FILES).exists()
    assert not Schedule.objects.exists()  # the schedule itself had no live run
    assert "! binding drop-me: keep" in plan.render()


def test_prune__a_run_triggered_after_the_plan_stops_the_delete() -> None:
    apply_text(ALL)
    plan = plan_text(BASE, prune=True)
    services.trigger(JobBinding.objects.get(name="drop-me"))

    with pytest.raises(ascode.Conflict, match="binding 'drop-me' can no longer be deleted"):
        ascode.apply(plan)

    assert Schedule.objects.filter(name="drop-me-hourly").exists()  # rolled back as well
