"""Every admin page: no secret in any response, no server error; query counts that do not
grow with the rows shown."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.db.models import Model
from django.db.models.functions import Now
from django.test import Client
from django.urls import NoReverseMatch, reverse

from dispatch.core.states import Origin, Reason, Status
from dispatch.models import Attempt, Job, JobBinding, Run, Worker
from dispatch.worker import claims
from tests.console.test_admin import PASSWORD, TOKEN, vault, vault_kind  # noqa: F401 - fixture
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import claim_one

pytestmark = pytest.mark.django_db(transaction=True)


def secret_world() -> dict[str, Any]:
    """Datasources with a known password and token, a running attempt (live snapshots),
    a finished one (redacted copies), a failure, a worker and history entries."""
    source = vault("vault-source", token=TOKEN)
    sink = vault("vault-sink", token=TOKEN)
    job = Job.objects.create(name="vault-job", source_spec={"rows": 5}, sink_spec={})
    binding = JobBinding.objects.create(name="vault-binding", job=job, source=source, sink=sink)
    done = trigger(binding)
    c = claim_one("w-secret", run_id=done.id)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=5, rows_written=5)
    failed = trigger(binding)
    c = claim_one("w-secret", run_id=failed.id)
    claims.settle(
        c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR, error="connection reset"
    )
    running = trigger(binding)
    live = claim_one("w-secret", run_id=running.id)
    Worker.objects.create(id="w-secret", host="h1", pid=42, concurrency=2)
    snapshots = (
        Attempt.objects.filter(pk=live.attempt_id)
        .values_list("source_snapshot", "sink_snapshot")
        .get()
    )
    assert all(snapshots), "the running attempt must hold its encrypted snapshots"
    forbidden = [PASSWORD, TOKEN, *snapshots, source.config_ciphertext, sink.config_ciphertext]
    return {"source": source, "binding": binding, "running": running, "forbidden": forbidden}


def admin_urls(client: Client) -> list[str]:
    """Changelist, add, change and history of every registered model (first row each),
    discovered from the admin site's registry, plus the console's own pages."""
    urls = [
        reverse("admin:index"),
        reverse("admin:dispatch_overview"),
        reverse("admin:app_list", args=["dispatch"]),
    ]
    for model, model_admin in admin.site._registry.items():
        info = model._meta.app_label, model._meta.model_name
        urls.append(reverse("admin:{}_{}_changelist".format(*info)))
        urls.append(reverse("admin:{}_{}_add".format(*info)))
        obj: Model | None = model._default_manager.order_by("pk").first()
        rows = list(model._default_manager.all()[:5]) if obj is not None else []
        for row in rows:
            for view in ("change", "history"):
                urls.append(reverse("admin:{}_{}_{}".format(*info, view), args=[row.pk]))
            for spec in getattr(model_admin, "object_actions", ()):
                if spec.destructive:  # GET shows the confirmation page
                    with contextlib.suppress(NoReverseMatch):
                        urls.append(
                            reverse(
                                "admin:{}_{}_object_action".format(*info), args=[row.pk, spec.name]
                            )
                        )
    return urls


def test_every_admin_page__shows_no_secret_and_no_error(admin_client: Client) -> None:
    world = secret_world()
    # Actions that write history entries and messages, a failing one included.
    bad = vault("vault-bad", host="unreachable")
    admin_client.post(
        reverse("admin:dispatch_datasource_changelist"),
        {"action": "test_datasource", "_selected_action": [bad.pk, world["source"].pk]},
    )
    admin_client.post(
        reverse("admin:dispatch_run_changelist"),
        {"action": "cancel_run", "_selected_action": [world["running"].pk], "post": "yes"},
    )
    assert LogEntry.objects.count() >= 3
    urls = admin_urls(admin_client)
    assert len(urls) > 30
    models = {m._meta.model_name for m in admin.site._registry}
    assert {"datasource", "job", "jobbinding", "run", "attempt", "worker"} <= models
    for url in urls:
        response = admin_client.get(url, follow=True)
        assert response.status_code in (200, 403), f"{url}: {response.status_code}"
        body = response.content.decode()
        for secret in world["forbidden"]:
            assert secret not in body, f"{url} shows a secret or ciphertext"
    # The redacted snapshot is what an attempt page shows instead.
    attempt = Attempt.objects.filter(run=world["running"]).get()
    page = admin_client.get(
        reverse("admin:dispatch_attempt_change", args=[attempt.pk])
    ).content.decode()
    assert "********" in page and "db.internal" in page


def test_history_entries_hold_no_secret(admin_client: Client) -> None:
    world = secret_world()
    bad = vault("vault-bad", host="unreachable")
    admin_client.post(
        reverse("admin:dispatch_datasource_changelist"),
        {"action": "test_datasource", "_selected_action": [bad.pk]},
    )
    url = reverse("admin:dispatch_datasource_change", args=[world["source"].pk])
    admin_client.post(
        url,
        {
            "name": "vault-source",
            "enabled": "on",
            "config__host": "db2",
            "config__port": "5432",
            "config__password": "N3w-pa55-word!",
        },
    )
    for entry in LogEntry.objects.all():
        for secret in (PASSWORD, TOKEN, "N3w-pa55-word!"):
            assert secret not in entry.change_message
            assert secret not in entry.object_repr


def bulk_runs(n: int) -> None:
    """n runs with 2 attempts each, inserted in bulk (setup only: no claim semantics)."""
    binding = BindingFactory()
    runs = Run.objects.bulk_create(
        [
            Run(binding=binding, status=Status.PENDING if i % 3 else Status.SUCCEEDED)
            for i in range(n)
        ]
    )
    attempts = []
    for i, run in enumerate(runs):
        attempts.append(
            Attempt(
                run=run,
                number=1,
                status=Status.RETRY_SCHEDULED,
                origin=Origin.TRIGGER,
                reason=Reason.ERROR,
                error="x",
                finished_at=run.created_at,
                worker_id="w1",
            )
        )
        attempts.append(
            Attempt(
                run=run,
                number=2,
                origin=Origin.RETRY,
                status=Status.PENDING if i % 3 else Status.SUCCEEDED,
                finished_at=None if i % 3 else run.created_at,
                rows_read=i,
                rows_written=i,
            )
        )
    Attempt.objects.bulk_create(attempts)
    Run.objects.filter(status=Status.SUCCEEDED).update(finished_at=Now())


# Session, user, count, page, filters' choices, ...: a fixed number, whatever the row count.
LIST_QUERIES = 12


@pytest.mark.parametrize("model", ["run", "attempt"])
def test_changelist__query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any, model: str
) -> None:
    bulk_runs(200)
    url = reverse(f"admin:dispatch_{model}_changelist") + "?all="
    with django_assert_max_num_queries(LIST_QUERIES):
        response = admin_client.get(url)
    assert response.status_code == 200
    assert response.context["cl"].result_count >= 200
    assert len(response.context["cl"].result_list) >= 200


def test_other_changelists_and_run_page__bounded_queries(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    bulk_runs(20)
    for i in range(30):
        BindingFactory(name=f"b-{i}")
    Worker.objects.bulk_create(
        [Worker(id=f"w{i}", host="h", pid=i, concurrency=1) for i in range(30)]
    )
    for model in ("jobbinding", "datasource", "job", "worker"):
        with django_assert_max_num_queries(LIST_QUERIES):
            assert (
                admin_client.get(reverse(f"admin:dispatch_{model}_changelist")).status_code == 200
            )
    run = Run.objects.first()
    assert run is not None
    for _ in range(10):
        Attempt.objects.create(
            run=run,
            number=Attempt.objects.filter(run=run).count() + 1,
            status=Status.FAILED,
            finished_at=run.created_at,
        )
    with django_assert_max_num_queries(14):
        assert (
            admin_client.get(reverse("admin:dispatch_run_change", args=[run.pk])).status_code == 200
        )
    job = Job.objects.first()
    with django_assert_max_num_queries(14):
        assert (
            admin_client.get(reverse("admin:dispatch_job_change", args=[job.pk])).status_code == 200
        )


def test_overview__bounded_queries_and_content(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    bulk_runs(50)
    world = secret_world()
    BindingFactory(enabled=False)
    trigger(JobBinding.objects.get(enabled=False))
    Worker.objects.create(id="w-dead", host="h2", pid=7, concurrency=1)
    Worker.objects.filter(pk="w-dead").update(heartbeat_at=Now() - timedelta(hours=1))
    from dispatch.models.ops import Alert, BindingHealth, HealthState

    sick = BindingFactory(name="sick-binding", enabled=False)
    BindingHealth.objects.create(
        binding=sick,
        state=HealthState.AUTO_DISABLED,
        consecutive_failures=30,
        reason="auto-disabled: 30 consecutive failed runs (threshold 30)",
    )
    Alert.objects.create(
        kind="BINDING_AUTO_DISABLED", notifier="email", dedup_key="k", status="SENT"
    )
    # 16 before the health, alerts and retention sections, one query each; one for the
    # scheduling app's notice (schedules overdue with no reconciler), in a savepoint
    # inside this test's transaction (two more).
    with django_assert_max_num_queries(22):
        response = admin_client.get(reverse("admin:dispatch_overview"))
    body = response.content.decode()
    assert "sick-binding" in body and "30 consecutive failed runs (threshold 30)" in body
    assert "Alerts, last 24 hours: sent 1" in body
    assert "LISTEN probe" in body
    assert response.status_code == 200
    assert "<svg" in body and "dsp-chart" in body
    assert "Binding disabled" in body  # a blocked run and why
    assert "dead?" in body  # w-dead has not heartbeated for an hour
    assert "vault-binding" in body  # bindings at capacity (max_concurrency 1, one running)
    assert "connection reset" in body  # failures of the last 24 h
    assert world["forbidden"][0] not in body


def test_run_and_attempt_pages__show_the_schema_changes(admin_client: Client) -> None:
    binding = BindingFactory()
    run = trigger(binding)
    c = claim_one("w-schema", run_id=run.id)
    changes = [{"column": "code", "change": "widened", "type": "bigint", "from": "integer"}]
    assert claims.record_schema_changes(c.attempt_id, c.lease_token, changes)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    for url in (
        reverse("admin:dispatch_run_change", args=[run.pk]),
        reverse("admin:dispatch_attempt_change", args=[c.attempt_id]),
    ):
        page = admin_client.get(url).content.decode()
        assert "Schema changes:" in page
        assert '<div class="readonly">code widened integer -&gt; bigint</div>' in page
