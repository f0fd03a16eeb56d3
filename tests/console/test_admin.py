"""Admin actions: each one's success path, refusals, permission check and history entry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db.models import DurationField, Value
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from dispatch.connectors.base import (
    Column,
    ConfigField,
    Connector,
    TransientError,
    WriteResult,
    check_unknown,
    require_object,
)
from dispatch.core.states import BlockedReason, Origin, Reason, Status
from dispatch.models import Attempt, Datasource, Job, JobBinding, Run
from dispatch.worker import claims
from tests.support.factories import BindingFactory, DatasourceFactory, trigger
from tests.support.helpers import claim_one

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "s3cr3t-Pa55word-xyz"
TOKEN = "tok-9f8e7d6c5b4a"


class VaultConnector(Connector):
    """A kind with secret settings, for the console's tests (source and sink)."""

    kind = "vaulttest"
    label = "Test kind with secrets"
    roles = frozenset({"source", "sink"})
    config_fields = (
        ConfigField("host", required=True, help="Server name."),
        ConfigField("port", kind=int, help="TCP port."),
        ConfigField("password", required=True, secret=True, help="Login password."),
        ConfigField("token", secret=True, help="Optional API token."),
    )

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, {"rows", "batch", "delay_ms", "fail_after", "seed"})
        return spec

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, set())
        return spec

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        if config.get("host") == "unreachable":
            # A careless connector that leaks its password: the console must scrub it.
            raise TransientError(f"cannot reach unreachable:5432 as admin/{config['password']}")

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: Any, columns: list[Column]
    ) -> Iterator[Any]:
        class Writer:
            n = 0

            def write(self, batch: list[Any]) -> int:
                self.n += len(batch)
                return len(batch)

            def commit(self) -> WriteResult:
                return WriteResult(rows_written=self.n)

        yield Writer()


VAULT_PATH = f"{__name__}.VaultConnector"


@pytest.fixture(autouse=True)
def vault_kind(settings: Any) -> None:
    settings.DISPATCH_CONNECTORS = [VAULT_PATH]


def vault(name: str = "vault-1", **config: Any) -> Datasource:
    return Datasource.objects.create(
        name=name,
        kind="vaulttest",
        config={"host": "db.internal", "port": 5432, "password": PASSWORD, **config},
    )


def staff(*codenames: str, username: str = "operator") -> Client:
    """A logged-in staff user holding exactly these dispatch permissions."""
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="dispatch", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def changelist(model: str) -> str:
    return reverse(f"admin:dispatch_{model}_changelist")


def do_action(
    client: Client, model: str, action: str, objs: list[Any], *, confirm: bool = True
) -> Any:
    data: dict[str, Any] = {"action": action, "_selected_action": [str(o.pk) for o in objs]}
    if confirm:
        data["post"] = "yes"
    return client.post(changelist(model), data)


def object_url(model: str, obj: Any, action: str) -> str:
    return reverse(f"admin:dispatch_{model}_object_action", args=[obj.pk, action])


def texts(response: Any) -> str:
    return " | ".join(str(m) for m in get_messages(response.wsgi_request))


def history(obj: Any) -> list[str]:
    return list(
        LogEntry.objects.filter(object_id=str(obj.pk))
        .order_by("id")
        .values_list("change_message", flat=True)
    )


def running_run(**binding: Any) -> tuple[Run, claims.ClaimedAttempt]:
    run = trigger(BindingFactory(**binding))
    return run, claim_one(run_id=run.id)


def failed_run() -> Run:
    run, c = running_run(job__max_attempts=1)
    claims.settle(
        c.attempt_id, c.lease_token, "PERMANENT", reason=Reason.PERMANENT_ERROR, error="bad"
    )
    run.refresh_from_db()
    assert run.status == Status.FAILED
    return run


# --- trigger ---------------------------------------------------------------------------


def test_trigger__action_creates_a_run_and_records_who(admin_client: Client) -> None:
    binding = BindingFactory()
    response = do_action(admin_client, "jobbinding", "trigger_binding", [binding])
    assert response.status_code == 302
    run = Run.objects.get(binding=binding)
    assert (run.status, run.trigger, run.requested_by) == (Status.PENDING, "MANUAL", "admin")
    assert "Trigger now: 1 binding triggered." in texts(response)
    [entry] = LogEntry.objects.filter(object_id=str(binding.pk))
    assert entry.user.username == "admin"
    assert entry.change_message == f"Trigger now: TRIGGERED (run {run.pk})"


def test_trigger__disabled_binding_still_creates_a_run_and_says_it_waits(
    admin_client: Client,
) -> None:
    binding = BindingFactory(enabled=False)
    response = do_action(admin_client, "jobbinding", "trigger_binding", [binding])
    run = Run.objects.get(binding=binding)
    assert run.attempts.get().blocked_reason == BlockedReason.BINDING_DISABLED
    message = texts(response)
    assert "was created but waits: binding disabled" in message
    assert "binding disabled" in history(binding)[0]


def test_trigger__object_button_redirects_to_the_new_run(admin_client: Client) -> None:
    binding = BindingFactory()
    page = admin_client.get(reverse("admin:dispatch_jobbinding_change", args=[binding.pk]))
    assert object_url("jobbinding", binding, "trigger_binding") in page.content.decode()
    response = admin_client.post(object_url("jobbinding", binding, "trigger_binding"))
    run = Run.objects.get(binding=binding)
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:dispatch_run_change", args=[run.pk])
    # A GET never changes state.
    assert admin_client.get(object_url("jobbinding", binding, "trigger_binding")).status_code == 405
    assert Run.objects.filter(binding=binding).count() == 1


def test_trigger__needs_the_trigger_permission() -> None:
    binding = BindingFactory()
    client = staff("view_jobbinding", "change_jobbinding")
    page = client.get(changelist("jobbinding"))
    assert page.status_code == 200
    assert 'value="trigger_binding"' not in page.content.decode()
    do_action(client, "jobbinding", "trigger_binding", [binding])
    assert client.post(object_url("jobbinding", binding, "trigger_binding")).status_code == 403
    assert not Run.objects.exists()
    assert not LogEntry.objects.exists()
    allowed = staff("view_jobbinding", "trigger_binding", username="trigger-operator")
    assert 'value="trigger_binding"' in allowed.get(changelist("jobbinding")).content.decode()
    do_action(allowed, "jobbinding", "trigger_binding", [binding])
    assert Run.objects.filter(binding=binding).count() == 1


# --- cancel ----------------------------------------------------------------------------


def test_cancel__asks_for_confirmation_first(admin_client: Client) -> None:
    run = trigger(BindingFactory())
    response = do_action(admin_client, "run", "cancel_run", [run], confirm=False)
    assert response.status_code == 200
    assert "are you sure" in response.content.decode()
    assert Run.objects.get(pk=run.pk).status == Status.PENDING
    assert not LogEntry.objects.exists()


def test_cancel__pending_cancelled_running_requested_finished_skipped(admin_client: Client) -> None:
    pending = trigger(BindingFactory())
    running, _ = running_run()
    finished = failed_run()
    response = do_action(admin_client, "run", "cancel_run", [pending, running, finished])
    message = texts(response)
    assert "1 run cancelled" in message
    assert "1 run cancel requested" in message
    assert "skipped 1 run: 1 already finished" in message
    assert Run.objects.get(pk=pending.pk).status == Status.CANCELLED
    assert Run.objects.get(pk=running.pk).cancel_requested_at is not None
    assert history(pending) == ["Cancel: CANCELLED"]
    assert history(running) == ["Cancel: CANCEL_REQUESTED"]
    assert history(finished)[0].startswith("Cancel: refused (ALREADY_FINISHED)")
    again = do_action(admin_client, "run", "cancel_run", [running])
    assert "cancel already requested" in texts(again)
    assert history(running)[-1].startswith("Cancel: refused (CANCEL_ALREADY_REQUESTED)")


def test_cancel__object_button_confirms_then_cancels(admin_client: Client) -> None:
    run = trigger(BindingFactory())
    url = object_url("run", run, "cancel_run")
    assert (
        url
        in admin_client.get(reverse("admin:dispatch_run_change", args=[run.pk])).content.decode()
    )
    confirm = admin_client.post(url)
    assert confirm.status_code == 200 and "are you sure" in confirm.content.decode()
    assert Run.objects.get(pk=run.pk).status == Status.PENDING
    done = admin_client.post(url, {"post": "yes"})
    assert done.status_code == 302
    assert Run.objects.get(pk=run.pk).status == Status.CANCELLED
    assert history(run) == ["Cancel: CANCELLED"]


def test_cancel__needs_the_cancel_permission() -> None:
    run = trigger(BindingFactory())
    client = staff("view_run", "change_run", "delete_run")
    assert 'value="cancel_run"' not in client.get(changelist("run")).content.decode()
    do_action(client, "run", "cancel_run", [run])
    assert client.post(object_url("run", run, "cancel_run"), {"post": "yes"}).status_code == 403
    assert Run.objects.get(pk=run.pk).status == Status.PENDING
    assert not LogEntry.objects.exists()


# --- retry -----------------------------------------------------------------------------


def test_retry__failed_run_gets_an_operator_attempt_pending_is_refused(
    admin_client: Client,
) -> None:
    failed = failed_run()
    pending = trigger(BindingFactory())
    response = do_action(admin_client, "run", "retry_run", [failed, pending])
    message = texts(response)
    assert "1 run retried" in message and "1 not failed or cancelled" in message
    assert Attempt.objects.get(run=failed, number=2).origin == Origin.OPERATOR
    assert history(failed) == ["Retry: RETRIED"]
    assert history(pending)[0].startswith("Retry: refused (NOT_RETRYABLE)")


def test_retry__needs_the_retry_permission() -> None:
    failed = failed_run()
    client = staff("view_run", "cancel_run")
    assert 'value="retry_run"' not in client.get(changelist("run")).content.decode()
    do_action(client, "run", "retry_run", [failed])
    assert client.post(object_url("run", failed, "retry_run")).status_code == 403
    assert Attempt.objects.filter(run=failed).count() == 1


# --- run now ---------------------------------------------------------------------------


def waiting_on_backoff() -> Run:
    run, c = running_run(job__backoff_seconds=3600, job__backoff_max_seconds=3600)
    claims.settle(c.attempt_id, c.lease_token, "ERROR", reason=Reason.ERROR, error="boom")
    return run


def test_run_now__backoff_wait_made_due_claimed_one_refused(admin_client: Client) -> None:
    waiting = waiting_on_backoff()
    running, _ = running_run()
    response = do_action(admin_client, "run", "run_now", [waiting, running])
    message = texts(response)
    assert "1 run made available now" in message
    assert "not waiting on a backoff (claimed meanwhile" in message
    assert claim_one(run_id=waiting.id).run_id == waiting.id
    assert history(waiting) == ["Run now: MADE_AVAILABLE"]
    assert history(running)[0].startswith("Run now: refused (NOT_WAITING)")


def test_run_now__needs_the_run_now_permission() -> None:
    waiting = waiting_on_backoff()
    client = staff("view_run", "retry_run")
    do_action(client, "run", "run_now", [waiting])
    assert client.post(object_url("run", waiting, "run_now")).status_code == 403
    assert Attempt.objects.filter(
        run=waiting, status=Status.PENDING, available_at__gt=Now()
    ).exists()


# --- release ---------------------------------------------------------------------------


def test_release__running_attempt_released_finished_one_refused(admin_client: Client) -> None:
    run, c = running_run()
    done, d = running_run()
    claims.settle(d.attempt_id, d.lease_token, "SUCCEEDED")
    attempt, finished = Attempt.objects.get(pk=c.attempt_id), Attempt.objects.get(pk=d.attempt_id)
    confirm = do_action(admin_client, "attempt", "release_attempt", [attempt], confirm=False)
    assert "are you sure" in confirm.content.decode()
    response = do_action(admin_client, "attempt", "release_attempt", [attempt, finished])
    message = texts(response)
    assert "1 attempt released" in message and "1 not running" in message
    attempt.refresh_from_db()
    assert (attempt.status, attempt.reason) == (Status.RETRY_SCHEDULED, Reason.RELEASED_BY_OPERATOR)
    assert Attempt.objects.get(run=run, number=2).origin == Origin.RELEASE
    assert history(attempt) == ["Release: RELEASED"]
    assert history(finished)[0].startswith("Release: refused (NOT_RUNNING)")


def test_release__offered_on_the_run_page_for_its_running_attempt(admin_client: Client) -> None:
    run, c = running_run()
    url = object_url("run", run, "release_attempt")
    assert (
        url
        in admin_client.get(reverse("admin:dispatch_run_change", args=[run.pk])).content.decode()
    )
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert Attempt.objects.get(pk=c.attempt_id).status == Status.RETRY_SCHEDULED
    assert history(run) == ["Release running attempt: RELEASED (attempt 1)"]
    again = admin_client.post(url, {"post": "yes"})
    assert "no running attempt" not in texts(again)  # the summary names the refusal
    assert "not running" in texts(again)


def test_release__needs_the_release_permission() -> None:
    run, c = running_run()
    attempt = Attempt.objects.get(pk=c.attempt_id)
    client = staff("view_run", "view_attempt", "cancel_run")
    do_action(client, "attempt", "release_attempt", [attempt])
    assert (
        client.post(object_url("attempt", attempt, "release_attempt"), {"post": "yes"}).status_code
        == 403
    )
    assert (
        client.post(object_url("run", run, "release_attempt"), {"post": "yes"}).status_code == 403
    )
    assert Attempt.objects.get(pk=c.attempt_id).status == Status.RUNNING


# --- test connection -------------------------------------------------------------------


def test_test_datasource__ok_and_failure_without_the_secret(admin_client: Client) -> None:
    good = vault("good")
    bad = vault("bad", host="unreachable")
    response = do_action(admin_client, "datasource", "test_datasource", [good, bad])
    message = texts(response)
    assert "1 datasource connection OK" in message
    assert "connection failed (bad: cannot reach unreachable:5432 as admin/********)" in message
    assert PASSWORD not in message
    assert history(good) == ["Test connection: CONNECTION_OK"]
    assert PASSWORD not in history(bad)[0] and "CONNECTION_FAILED" in history(bad)[0]


def test_test_datasource__object_button_and_permission() -> None:
    ds = vault()
    denied = staff("view_datasource", "change_datasource")
    assert denied.post(object_url("datasource", ds, "test_datasource")).status_code == 403
    do_action(denied, "datasource", "test_datasource", [ds])
    assert not LogEntry.objects.exists()
    allowed = staff("view_datasource", "test_datasource", username="tester")
    response = allowed.post(object_url("datasource", ds, "test_datasource"))
    assert response.status_code == 302
    assert "connection OK" in texts(response)
    assert history(ds) == ["Test connection: CONNECTION_OK"]


# --- enable / disable ------------------------------------------------------------------


@pytest.mark.parametrize("model", ["datasource", "job", "jobbinding"])
def test_enable_disable__confirmed_counted_recorded(admin_client: Client, model: str) -> None:
    binding = BindingFactory()
    obj = {"datasource": binding.source, "job": binding.job, "jobbinding": binding}[model]
    other = {
        "datasource": DatasourceFactory(enabled=False),
        "job": Job.objects.create(name="off", enabled=False),
        "jobbinding": BindingFactory(enabled=False),
    }[model]
    confirm = do_action(admin_client, model, "disable", [obj], confirm=False)
    assert "are you sure" in confirm.content.decode()
    assert type(obj).objects.get(pk=obj.pk).enabled
    response = do_action(admin_client, model, "disable", [obj, other])
    assert "1 " in texts(response) and "disabled" in texts(response)
    assert "already disabled" in texts(response)
    assert not type(obj).objects.get(pk=obj.pk).enabled
    assert history(obj) == ["Disable: DISABLED"]
    do_action(admin_client, model, "enable", [obj])
    assert type(obj).objects.get(pk=obj.pk).enabled
    assert history(obj)[-1] == "Enable: ENABLED"


def test_enable_disable__needs_change_permission() -> None:
    binding = BindingFactory()
    client = staff("view_jobbinding", "trigger_binding")
    assert 'value="disable"' not in client.get(changelist("jobbinding")).content.decode()
    do_action(client, "jobbinding", "disable", [binding])
    assert JobBinding.objects.get(pk=binding.pk).enabled


def test_disabling_a_binding_never_touches_its_running_attempt(admin_client: Client) -> None:
    run, c = running_run()
    do_action(admin_client, "jobbinding", "disable", [run.binding])
    assert Attempt.objects.get(pk=c.attempt_id).status == Status.RUNNING


# --- history rows are read-only ----------------------------------------------------------


@pytest.mark.parametrize("model", ["run", "attempt", "worker"])
def test_history_rows__no_add_no_delete_no_edit(admin_client: Client, model: str) -> None:
    run, c = running_run()
    from dispatch.models import Worker

    Worker.objects.create(id="w1", host="h", pid=1, concurrency=1)
    obj = {
        "run": run,
        "attempt": Attempt.objects.get(pk=c.attempt_id),
        "worker": Worker.objects.get(pk="w1"),
    }[model]
    assert admin_client.get(reverse(f"admin:dispatch_{model}_add")).status_code == 403
    change = reverse(f"admin:dispatch_{model}_change", args=[obj.pk])
    page = admin_client.get(change)
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()
    assert admin_client.post(change, {"status": "SUCCEEDED"}).status_code == 403
    assert (
        admin_client.get(reverse(f"admin:dispatch_{model}_delete", args=[obj.pk])).status_code
        == 403
    )


def test_lease_expired_display_reason(admin_client: Client) -> None:
    run, c = running_run(job__max_attempts=1)
    Attempt.objects.filter(pk=c.attempt_id).update(
        lease_until=Now() - Value(timedelta(seconds=5), output_field=DurationField())
    )
    claims.recover()
    page = admin_client.get(reverse("admin:dispatch_run_change", args=[run.pk])).content.decode()
    assert "LEASE_EXPIRED" in page and "Failed" in page
