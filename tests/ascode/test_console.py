"""The console marks objects definition files manage: a badge in the lists, a warning on
the change page; a secret typed in the console drops the reference files gave it."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from dispatch.models import Datasource, Job, JobBinding
from scheduling.models import Schedule
from tests.support.ascode import SECRET, apply_text
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

FILES = """
datasources:
  gen: {kind: generate}
  void: {kind: "null"}
  warehouse:
    kind: postgresql
    config: {host: db.example.com, dbname: w, user: u, password: env:DISPATCH_SECRET_WH_PASSWORD}
jobs:
  from-files: {source_spec: {rows: 1}}
bindings:
  b: {job: from-files, source: gen, sink: void}
schedules:
  s: {binding: b, cron: "0 * * * *"}
"""
WARNING = "Managed by files: this {} is defined in definition files"


@pytest.fixture
def applied(secret_env: str) -> None:
    apply_text(FILES)


@pytest.mark.usefixtures("applied")
def test_changelists__badge_the_objects_files_manage(admin_client: Client) -> None:
    JobFactory(name="from-console")
    page = admin_client.get(reverse("admin:dispatch_job_changelist")).content.decode()

    badge = '<span class="dsp-badge dsp-warn" title="defined in definition files'
    assert page.count(badge) == 1
    row_of = {name: page.index(name) for name in ("from-files", "from-console")}
    assert row_of["from-files"] < page.index(badge)  # the badge is on the managed row
    filtered = admin_client.get(
        reverse("admin:dispatch_job_changelist") + "?managed_by__exact=files"
    ).content.decode()
    assert "from-files" in filtered and "from-console" not in filtered
    for name in ("datasource", "jobbinding"):
        assert (
            badge in admin_client.get(reverse(f"admin:dispatch_{name}_changelist")).content.decode()
        )
    assert (
        badge in admin_client.get(reverse("admin:scheduling_schedule_changelist")).content.decode()
    )


@pytest.mark.usefixtures("applied")
def test_change_pages__warn_that_the_next_apply_overwrites_edits(admin_client: Client) -> None:
    console_job = JobFactory(name="from-console")
    pages = {
        "job": ("admin:dispatch_job_change", Job.objects.get(name="from-files").pk),
        "binding": ("admin:dispatch_jobbinding_change", JobBinding.objects.get().pk),
        "datasource": ("admin:dispatch_datasource_change", Datasource.objects.get(name="gen").pk),
        "schedule": ("admin:scheduling_schedule_change", Schedule.objects.get().pk),
    }
    for what, (view, pk) in pages.items():
        page = admin_client.get(reverse(view, args=[pk])).content.decode()
        assert WARNING.format(what) in page, what

    page = admin_client.get(reverse("admin:dispatch_job_change", args=[console_job.pk]))
    assert "Managed by files" not in page.content.decode()


@pytest.mark.usefixtures("applied")
def test_datasource_form__a_secret_typed_in_drops_its_reference(admin_client: Client) -> None:
    warehouse = Datasource.objects.get(name="warehouse")
    form = {
        "name": "warehouse",
        "enabled": "on",
        "config_kind": "postgresql",
        "config__host": "db.example.com",
        "config__dbname": "w",
        "config__user": "u",
    }
    url = reverse("admin:dispatch_datasource_change", args=[warehouse.pk])

    kept = admin_client.post(url, form)  # blank password: the stored one stays
    assert kept.status_code == 302
    warehouse.refresh_from_db()
    assert warehouse.secret_refs == {"password": "env:DISPATCH_SECRET_WH_PASSWORD"}

    typed = admin_client.post(url, {**form, "config__password": "typed-" + SECRET})
    assert typed.status_code == 302
    warehouse.refresh_from_db()
    assert warehouse.config["password"] == "typed-" + SECRET
    assert warehouse.secret_refs == {}
