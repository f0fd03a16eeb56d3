"""Bulk operations: the request from a list's filter, the batches of the maintenance loop
(called directly here; tests/worker/test_bulk_processes.py runs them in worker processes),
skipped rows, cancel, permissions and filters that do not validate."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import connection
from django.test import Client
from django.urls import reverse

from dispatch.console import admin as console_admin
from dispatch.core.states import Origin, Status
from dispatch.models import Attempt, BulkOperation, BulkSkip, BulkStatus, JobBinding, Run
from dispatch.ops import bulk, maintenance
from tests.support.bulk import make_runs
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db


def staff(*codenames: str, username: str = "operator") -> tuple[User, Client]:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="dispatch", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return user, client


def bulk_url(model: str, action: str, query: str) -> str:
    return reverse(f"admin:dispatch_{model}_bulk", args=[action]) + "?" + query


def request_bulk(client: Client, model: str, action: str, query: str) -> Any:
    return client.post(bulk_url(model, action, query), {"post": "yes"})


def drain(size: int = 50) -> list[bulk.BatchReport]:
    reports = []
    while (report := bulk.work_batch(size)) is not None:
        reports.append(report)
    return reports


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_bulk_retry__every_matching_run_once_with_its_history_and_a_link_from_the_list() -> None:
    binding = BindingFactory(enabled=False)  # the retried runs wait: nothing claims them
    make_runs(binding.pk, 120, Status.FAILED)
    make_runs(binding.pk, 5, Status.SUCCEEDED)  # not matching the filter
    user, client = staff("view_run", "retry_run", "view_bulkoperation")

    listing = client.get(reverse("admin:dispatch_run_changelist") + "?status__exact=FAILED")
    page = listing.content.decode()
    assert "Apply to all 120 matching this filter" in page
    assert bulk_url("run", "retry", "status__exact=FAILED").replace("&", "&amp;") in page
    assert "Cancel…" not in page  # no cancel permission, no cancel link

    confirm = client.get(bulk_url("run", "retry", "status__exact=FAILED"))
    assert confirm.status_code == 200
    assert "Retry all 120 runs matching" in confirm.content.decode()
    assert not BulkOperation.objects.exists()  # a GET stores nothing

    response = request_bulk(client, "run", "retry", "status__exact=FAILED")
    op = BulkOperation.objects.get()
    assert (op.model, op.action, op.filters, op.total) == (
        "run",
        "retry",
        {"status__exact": "FAILED"},
        120,
    )
    assert op.requested_by == user and op.status == BulkStatus.PENDING
    assert response.status_code == 302
    assert response["Location"].endswith("?status__exact=FAILED")
    page_url = reverse("admin:dispatch_bulkoperation_change", args=[op.pk])
    (message,) = messages_of(response)
    assert f'href="{page_url}"' in message and "120 runs" in message

    reports = drain(size=50)
    assert [r.done for r in reports] == [50, 50, 20]
    op.refresh_from_db()
    assert (op.status, op.done, op.skipped, op.batches) == (BulkStatus.DONE, 120, 0, 3)
    retried = Attempt.objects.filter(origin=Origin.OPERATOR, status=Status.PENDING)
    assert retried.count() == 120 and retried.values("run").distinct().count() == 120
    assert Run.objects.filter(status=Status.PENDING).count() == 120
    entries = LogEntry.objects.filter(change_message__startswith=f"Retry (bulk operation {op.pk})")
    assert entries.count() == 120 and entries.values("object_id").distinct().count() == 120
    assert set(entries.values_list("user_id", flat=True)) == {user.pk}

    shown = client.get(page_url).content.decode()
    assert 'data-done="120" data-skipped="0" data-total="120"' in shown
    assert "Finished: done." in shown


def test_bulk_retry__a_run_not_retryable_is_skipped_with_its_reason() -> None:
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 3, Status.FAILED)
    make_runs(binding.pk, 2, Status.SUCCEEDED)
    user, client = staff("view_run", "retry_run", "view_bulkoperation")
    request_bulk(client, "run", "retry", f"binding__id__exact={binding.pk}")
    drain()
    op = BulkOperation.objects.get()
    assert (op.status, op.total, op.done, op.skipped) == (BulkStatus.DONE, 5, 3, 2)
    skips = list(BulkSkip.objects.filter(operation=op))
    assert {s.code for s in skips} == {"NOT_RETRYABLE"}
    assert all("SUCCEEDED" in s.message for s in skips)
    refused = LogEntry.objects.filter(change_message__contains="refused (NOT_RETRYABLE)")
    assert sorted(refused.values_list("object_id", flat=True)) == sorted(
        str(s.object_id) for s in skips
    )
    shown = client.get(reverse("admin:dispatch_bulkoperation_change", args=[op.pk]))
    assert "NOT_RETRYABLE" in shown.content.decode()
    assert "only FAILED or CANCELLED runs can be retried" in shown.content.decode()


def test_bulk_page__pages_through_the_skipped_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from dispatch.console import bulk as console_bulk

    monkeypatch.setattr(console_bulk, "SKIPS_SHOWN", 2)
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 5, Status.SUCCEEDED)
    user, client = staff("view_run", "retry_run", "view_bulkoperation")
    request_bulk(client, "run", "retry", f"binding__id__exact={binding.pk}")
    drain()
    op = BulkOperation.objects.get()
    skips = list(BulkSkip.objects.filter(operation=op).order_by("id"))
    assert len(skips) == 5
    page = reverse("admin:dispatch_bulkoperation_change", args=[op.pk])
    pages = []
    url = page
    for _ in range(4):
        html = client.get(url).content.decode()
        pages.append([s.object_repr for s in skips if s.object_repr in html])
        if 'rel="next"' not in html:
            break
        after = html.split("?after=", 1)[1].split("#", 1)[0]
        url = f"{page}?after={after}"
    assert [len(p) for p in pages] == [2, 2, 1]
    assert sum(pages, []) == [s.object_repr for s in skips]


def test_bulk_cancel__stops_before_the_next_batch_and_keeps_what_was_done() -> None:
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 30, Status.PENDING)
    user, client = staff("view_run", "cancel_run", "view_bulkoperation", "cancel_bulkoperation")
    request_bulk(client, "run", "cancel", "status__exact=PENDING")
    op = BulkOperation.objects.get()
    first = bulk.work_batch(10)
    assert first is not None and first.done == 10
    assert Run.objects.filter(status=Status.CANCELLED).count() == 10

    page = reverse("admin:dispatch_bulkoperation_change", args=[op.pk])
    button = 'title="Stop the bulk operation before its next batch.'
    assert button in client.get(page).content.decode()
    cancel = reverse("admin:dispatch_bulkoperation_object_action", args=[op.pk, "cancel_bulk"])
    client.post(cancel, {"post": "yes"})
    op.refresh_from_db()
    assert op.status == BulkStatus.CANCELLED and op.cancelled_by == "operator"
    assert bulk.work_batch(10) is None  # nothing of it is worked any more
    assert Run.objects.filter(status=Status.CANCELLED).count() == 10
    assert Run.objects.filter(status=Status.PENDING).count() == 20
    assert button not in client.get(page).content.decode()
    # A second cancel is refused (the operation has finished).
    client.post(cancel, {"post": "yes"})
    assert (
        LogEntry.objects.filter(change_message__contains="refused (ALREADY_FINISHED)").count() == 1
    )


def test_bulk_disable_and_enable__bindings_by_filter() -> None:
    job = BindingFactory().job
    mine = [BindingFactory(job=job) for _ in range(4)]
    other = BindingFactory()
    user, client = staff("view_jobbinding", "change_jobbinding")
    listing = client.get(
        reverse("admin:dispatch_jobbinding_changelist") + f"?job__id__exact={job.pk}"
    )
    assert "Apply to all 5 matching" in listing.content.decode()
    request_bulk(client, "jobbinding", "disable", f"job__id__exact={job.pk}")
    drain(size=2)
    assert set(JobBinding.objects.filter(job=job).values_list("enabled", flat=True)) == {False}
    assert JobBinding.objects.get(pk=other.pk).enabled

    JobBinding.objects.filter(pk=mine[0].pk).update(enabled=True)
    request_bulk(client, "jobbinding", "enable", f"enabled__exact=0&job__id__exact={job.pk}")
    drain(size=2)
    op = BulkOperation.objects.get(action="enable")
    assert (op.status, op.total, op.done, op.skipped) == (BulkStatus.DONE, 4, 4, 0)
    assert set(JobBinding.objects.filter(job=job).values_list("enabled", flat=True)) == {True}


def test_bulk__a_user_without_the_permission_gets_nothing_applied() -> None:
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 4, Status.FAILED)
    # The action's permission without the list's: nothing either.
    _, blind = staff("retry_run", username="blind")
    assert blind.get(bulk_url("run", "retry", "status__exact=FAILED")).status_code == 403
    user, client = staff("view_run")
    assert (
        "Apply to all"
        not in client.get(
            reverse("admin:dispatch_run_changelist") + "?status__exact=FAILED"
        ).content.decode()
    )
    assert client.get(bulk_url("run", "retry", "status__exact=FAILED")).status_code == 403
    assert request_bulk(client, "run", "retry", "status__exact=FAILED").status_code == 403
    with pytest.raises(bulk.BulkRequestError, match="dispatch.retry_run"):
        bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    assert not BulkOperation.objects.exists()

    # Granted at request time, withdrawn before the batches: refused, nothing applied.
    retry = Permission.objects.get(codename="retry_run")
    user.user_permissions.add(retry)
    user = User.objects.get(pk=user.pk)
    op = bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    user.user_permissions.remove(retry)
    report = bulk.work_batch(10)
    assert report is not None and report.status == BulkStatus.REFUSED
    op.refresh_from_db()
    assert op.status == BulkStatus.REFUSED and "retry_run" in op.error and op.done == 0
    assert Run.objects.filter(status=Status.FAILED).count() == 4
    assert not Attempt.objects.filter(origin=Origin.OPERATOR).exists()
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("status__exact=BOGUS", "'status__exact' must be one of"),
        ("binding__id__exact=12", "must be an id (a UUID)"),
        ("requested_by=alice", "'requested_by' is not a filter a bulk operation accepts"),
        ("q=nightly", "A search cannot select a bulk operation's rows"),
        ("created_at__gte=yesterday", "must be a date"),
        ("status__exact=FAILED&status__exact=PENDING", "has 2 values; one only"),
    ],
)
def test_bulk__a_filter_that_does_not_validate_is_refused_with_a_clear_error(
    query: str, said: str
) -> None:
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 2, Status.FAILED)
    user, client = staff("view_run", "retry_run")
    response = request_bulk(client, "run", "retry", query)
    assert response.status_code == 302
    (message,) = messages_of(response)
    assert said in message, message
    assert not BulkOperation.objects.exists()


def test_bulk__list_order_and_page_are_no_part_of_the_filter() -> None:
    BindingFactory(enabled=False)
    assert bulk.validate_filters("run", {"o": ["-1"], "p": ["3"], "status__exact": ["FAILED"]}) == {
        "status__exact": "FAILED"
    }


def test_bulk__the_date_filters_of_the_list_validate() -> None:
    # What the run list's "Past 7 days" puts in its links.
    user, client = staff("view_run", "retry_run")
    page = client.get(reverse("admin:dispatch_run_changelist")).content.decode()
    assert "created_at__gte=" in page
    filters = bulk.validate_filters(
        "run",
        {"created_at__gte": ["2026-12-01 00:00:00+00:00"], "created_at__lt": ["2026-12-08"]},
    )
    assert bulk.matching("run", filters).count() == 0


@pytest.mark.parametrize(
    ("model", "admin_class"), [("run", "RunAdmin"), ("jobbinding", "JobBindingAdmin")]
)
def test_bulk__every_filter_of_the_list_is_a_filter_a_bulk_operation_accepts(
    model: str, admin_class: str
) -> None:
    from django.contrib import admin as django_admin
    from django.test import RequestFactory

    BindingFactory()
    user = User.objects.create_superuser("root")
    request = RequestFactory().get("/")
    request.user = user
    modeladmin = django_admin.site._registry[bulk.MODELS[model]]
    assert type(modeladmin).__name__ == admin_class
    changelist = modeladmin.get_changelist_instance(request)
    offered = {p for spec in changelist.filter_specs for p in spec.expected_parameters()}
    # Every filter declares an "is empty" parameter; a list shows that choice only for a
    # nullable field (of these, finished_at): the others match nothing.
    offered = {p for p in offered if not p.endswith("__isnull") or p == "finished_at__isnull"}
    assert offered <= set(bulk.FILTERS[model]), offered - set(bulk.FILTERS[model])


def test_bulk__each_action_is_the_one_at_a_time_actions_permission() -> None:
    specs = {
        ("run", "retry"): console_admin.RETRY,
        ("run", "cancel"): console_admin.CANCEL,
        ("run", "release"): console_admin.RELEASE_FROM_RUN,
    }
    for key, spec in specs.items():
        assert bulk.ACTIONS[key].perm == spec.perm, key
    for name in ("enable", "disable"):
        assert bulk.ACTIONS[("jobbinding", name)].perm == "dispatch.change_jobbinding"
    # Each list filter has its parameters among the accepted ones.
    assert set(bulk.FILTERS) == set(bulk.MODELS)


def test_maintenance_timer__next_tick_after_work_the_interval_when_idle() -> None:
    from django.test import override_settings

    due: dict[str, float] = {}
    with override_settings(DISPATCH_BULK_INTERVAL=30.0):
        assert maintenance.run_once(now=100.0, due=due)["bulk"] is None
        assert due["bulk"] == 130.0  # idle: one look per interval
        binding = BindingFactory(enabled=False)
        make_runs(binding.pk, 2, Status.FAILED)
        user, _ = staff("retry_run")
        bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
        assert maintenance.run_once(now=200.0, due=due)["bulk"] == 2
        assert due["bulk"] == 200.0 + maintenance.tick_seconds()  # busy: the next tick


def test_maintenance_tick__works_pending_operations() -> None:
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 3, Status.FAILED)
    user, _ = staff("retry_run")
    bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    assert maintenance.run_once()["bulk"] == 3
    assert BulkOperation.objects.get().status == BulkStatus.DONE
    assert maintenance.run_once()["bulk"] is None


@pytest.mark.django_db(transaction=True)
def test_bulk_batch__wakes_its_retried_runs_with_one_statement_at_its_commit() -> None:
    from django.test.utils import CaptureQueriesContext

    from dispatch.core import conf
    from tests.support.helpers import raw_connection

    binding = BindingFactory(max_concurrency=100)
    make_runs(binding.pk, 30, Status.FAILED)
    blocked = BindingFactory(enabled=False)  # its retried runs wait: no wake-up for them
    make_runs(blocked.pk, 5, Status.FAILED)
    user, _ = staff("retry_run")
    bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    with raw_connection() as listener:
        listener.autocommit = True
        listener.execute(f'LISTEN "{conf.channel()}"')
        with CaptureQueriesContext(connection) as queries:
            report = bulk.work_batch(50)
        # A last notification of our own: those committed before it arrive before it.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, 'end')", [conf.channel()])
        heard = set()
        for note in listener.notifies(timeout=30):
            if note.payload == "end":
                break
            heard.add(note.payload)
    assert report is not None and report.done == 35
    assert heard == {
        str(pk) for pk in Run.objects.filter(binding=binding).values_list("pk", flat=True)
    }
    sent = [q["sql"] for q in queries.captured_queries if "pg_notify" in q["sql"]]
    assert len(sent) == 1, sent


def test_bulk_release__the_running_attempt_released_a_pending_run_skipped() -> None:
    from tests.support.factories import trigger
    from tests.support.helpers import claim_one

    binding = BindingFactory()
    runs = [trigger(binding), trigger(binding)]
    claimed = claim_one("w-gone")
    user, client = staff("view_run", "release_attempt")
    request_bulk(client, "run", "release", f"binding__id__exact={binding.pk}")
    drain()
    op = BulkOperation.objects.get()
    assert (op.status, op.done, op.skipped) == (BulkStatus.DONE, 1, 1)
    (skip,) = BulkSkip.objects.all()
    assert skip.code == "NOT_RUNNING" and str(skip.object_id) != str(claimed.run_id)
    assert Attempt.objects.get(pk=claimed.attempt_id).status == Status.RETRY_SCHEDULED
    assert {str(r.pk) for r in runs} == {str(claimed.run_id), str(skip.object_id)}


def test_bulk_batch__a_stored_filter_no_longer_accepted_refuses_the_operation() -> None:
    user, _ = staff("retry_run")
    op = bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    BulkOperation.objects.filter(pk=op.pk).update(filters={"status__in": "FAILED"})
    report = bulk.work_batch(10)
    assert report is not None and report.status == BulkStatus.REFUSED
    op.refresh_from_db()
    assert op.status == BulkStatus.REFUSED and "'status__in' is not a filter" in op.error


@pytest.mark.django_db(transaction=True)
def test_bulk_retry__a_row_the_database_refuses_is_skipped_and_the_rest_go_on() -> None:
    """A run another session holds locked past the lock timeout: that row is skipped with
    the database's reason (no host, user or password in it), the batch commits the rest,
    and the operation ends instead of retrying the same batch ahead of every other."""
    from tests.support.helpers import raw_connection

    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, 4, Status.FAILED)
    user, client = staff("view_run", "retry_run", "view_bulkoperation")
    request_bulk(client, "run", "retry", f"binding__id__exact={binding.pk}")
    held = Run.objects.filter(binding=binding).order_by("pk").first()
    holder = raw_connection()
    try:
        holder.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [held.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")
        try:
            drain()
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    finally:
        holder.close()
    op = BulkOperation.objects.get()
    assert (op.status, op.done, op.skipped) == (BulkStatus.DONE, 3, 1)
    (skip,) = BulkSkip.objects.filter(operation=op)
    assert skip.object_id == held.pk and skip.code == "DATABASE_ERROR"
    assert "LockNotAvailable" in skip.message and "postgres" not in skip.message.lower()
    assert Run.objects.get(pk=held.pk).status == Status.FAILED
    assert Run.objects.filter(binding=binding, status=Status.PENDING).count() == 3


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("DISPATCH_BULK_BATCH", 0),  # a batch of none would never end its operation
        ("DISPATCH_BULK_BATCH", 2.5),
        ("DISPATCH_BULK_BATCH", True),
        ("DISPATCH_BULK_BUDGET", -1),
        ("DISPATCH_BULK_INTERVAL", "30"),
        ("DISPATCH_BULK_RETENTION_DAYS", 0),
    ],
)
def test_e022__a_bulk_setting_out_of_its_bounds_is_named(setting: str, value: Any) -> None:
    from django.test import override_settings

    from dispatch import checks

    assert checks.check_bulk_settings() == []
    with override_settings(**{setting: value}):
        (error,) = checks.check_bulk_settings()
    assert error.id == "dispatch.E022" and setting in error.msg and repr(value) in error.msg
