"""Failure alerts and auto-disable (dispatch/alerts.py): the health scan over real runs
(settled through the real claim and settlement), email through Django's test backend,
and a webhook received by a local HTTP server this test starts."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core import mail
from django.db.models.functions import Now
from django.test import override_settings

from dispatch.models import JobBinding, Run
from dispatch.models.ops import Alert, AlertKind, AlertStatus, BindingHealth, HealthState
from dispatch.ops import alerts
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger

pytestmark = pytest.mark.django_db(transaction=True)

BASE = {
    "DISPATCH_HEALTH_SCAN_LAG": 0.0,
    "DISPATCH_ALERT_NOTIFIERS": ["email"],
    "ADMINS": [("ops", "ops@example.com")],
    "EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend",
    "DISPATCH_ALERT_EMAIL_DOMAINS": ["example.com"],
}


def finish(binding: JobBinding, outcome: str, error: str = "sink: relation missing") -> Run:
    """One run of `binding` through the real claim and settlement: FAILED or SUCCEEDED."""
    run = trigger(binding)
    (c,) = claims.claim("w-alerts", run_id=run.id, limit=1, generic=False)
    if outcome == "FAILED":
        claims.settle(
            c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR", error=error
        )
    else:
        claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    run.refresh_from_db()
    assert run.status == outcome
    return run


def health_of(binding: JobBinding) -> BindingHealth:
    return BindingHealth.objects.get(binding=binding)


def kinds(binding: JobBinding) -> list[tuple[str, str]]:
    return sorted(Alert.objects.filter(binding_id=binding.pk).values_list("kind", "status"))


@override_settings(**BASE, DISPATCH_WARN_FAILURES=2, DISPATCH_AUTO_DISABLE_FAILURES=3)
def test_auto_disable__warned_then_disabled_at_the_threshold_then_reset_by_reenabling(
    admin_client: Any,
) -> None:
    b = BindingFactory()
    other = BindingFactory()
    finish(other, "SUCCEEDED")
    finish(b, "FAILED")
    alerts.scan()
    assert health_of(b).state == HealthState.OK and health_of(b).consecutive_failures == 1
    finish(b, "FAILED")
    alerts.scan()
    assert health_of(b).state == HealthState.WARNED
    assert "2 consecutive failed runs (warning at 2)" in health_of(b).reason
    finish(b, "FAILED")
    report = alerts.scan()
    b.refresh_from_db()
    h = health_of(b)
    assert (h.state, b.enabled) == (HealthState.AUTO_DISABLED, False)
    assert h.reason == "auto-disabled: 3 consecutive failed runs (threshold 3)"
    assert report.disabled == [b.name]
    page = admin_client.get(f"/admin/dispatch/jobbinding/{b.pk}/change/").content.decode()
    assert "Auto-disabled: 3 failed run(s) in a row" in page
    assert "auto-disabled: 3 consecutive failed runs (threshold 3)" in page
    assert kinds(b) == sorted(
        [(AlertKind.RUN_FAILED, AlertStatus.PENDING)] * 3
        + [
            (AlertKind.BINDING_WARNED, AlertStatus.PENDING),
            (AlertKind.BINDING_AUTO_DISABLED, AlertStatus.PENDING),
        ]
    )
    # A second pass over the same runs changes nothing and enqueues nothing.
    from dispatch.models.ops import OpsState

    OpsState.objects.filter(key=alerts.SCAN_KEY).update(data={})
    alerts.scan()
    assert len(kinds(b)) == 5
    other.refresh_from_db()
    assert other.enabled and health_of(other).state == HealthState.OK
    # Re-enabled by an operator: the failures before count no more.
    JobBinding.objects.filter(pk=b.pk).update(enabled=True)
    finish(b, "FAILED")
    report = alerts.scan()
    b.refresh_from_db()
    h = health_of(b)
    assert report.reset == [b.name]
    assert (h.state, h.consecutive_failures, b.enabled) == (HealthState.OK, 1, True)
    # Mail goes out on the drain; the disable says why.
    assert alerts.drain() == 6
    subjects = [m.subject for m in mail.outbox]
    assert f"[dispatch] {b.name} was disabled" in subjects
    assert subjects.count(f"[dispatch] run of {b.name} failed for good") == 4
    disabled = next(m for m in mail.outbox if m.subject.endswith("was disabled"))
    assert disabled.to == ["ops@example.com"]
    assert "3 consecutive failed runs (threshold 3)" in disabled.body


@override_settings(**BASE, DISPATCH_AUTO_DISABLE_FAILURES=100, DISPATCH_AUTO_DISABLE_DAYS=7)
def test_auto_disable__no_success_for_days() -> None:
    b = BindingFactory()
    finish(b, "FAILED")
    alerts.scan()
    assert health_of(b).state == HealthState.OK
    # As if the streak had begun eight days ago (its first failed run's creation).
    BindingHealth.objects.filter(binding=b).update(failing_since=Now() - timedelta(days=8))
    report = alerts.scan()  # no new run: the failing bindings' pass decides
    b.refresh_from_db()
    assert report.disabled == [b.name] and not b.enabled
    assert health_of(b).reason.startswith("auto-disabled: no successful run for 8.0 days")


@override_settings(**BASE)
def test_alerts__email_to_the_binding_addresses_on_failure_and_recovery() -> None:
    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="a@example.com, b@example.com")
    run = finish(b, "FAILED", error="sink: relation public.orders does not exist")
    alerts.scan()
    assert alerts.drain() == 1
    (failed,) = mail.outbox
    assert failed.to == ["a@example.com", "b@example.com"]
    assert str(run.id) in failed.body
    # The error stays in the console (docs/security.md, "Alerts").
    assert "relation public.orders does not exist" not in failed.body
    finish(b, "SUCCEEDED")
    report = alerts.scan()
    assert report.recovered == [b.name]
    assert alerts.drain() == 1
    assert mail.outbox[1].subject == f"[dispatch] {b.name} succeeded again"
    # Muted: nothing more is enqueued.
    BindingHealth.objects.filter(binding=b).update(alerts_muted=True)
    finish(b, "FAILED")
    alerts.scan()
    assert alerts.drain() == 0 and len(mail.outbox) == 2


@override_settings(**BASE, DISPATCH_ALERT_RATE_LIMIT=2)
def test_alerts__rate_limited_per_binding_and_kind() -> None:
    b = BindingFactory()
    for _ in range(3):
        finish(b, "FAILED")
    alerts.scan()
    statuses = sorted(
        Alert.objects.filter(kind=AlertKind.RUN_FAILED).values_list("status", flat=True)
    )
    assert statuses == [AlertStatus.PENDING, AlertStatus.PENDING, AlertStatus.SUPPRESSED]
    assert alerts.drain() == 2


class Hook(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((dict(self.headers), body))
        self.send_response(type(self).answers.pop(0) if type(self).answers else 200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    Hook.received, Hook.answers = [], [500]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


def test_alerts__webhook_signed_retried_with_backoff_then_sent(hook: str) -> None:
    secret = "webhook-secret-4f1c"
    with override_settings(
        **{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["webhook"]},
        DISPATCH_ALERT_WEBHOOK_URL=hook,
        DISPATCH_ALERT_WEBHOOK_SECRET=secret,
        DISPATCH_ALERT_BACKOFF=0.0,
    ):
        b = BindingFactory()
        run = finish(b, "FAILED")
        alerts.scan()
        assert alerts.drain() == 0  # the server answered 500
        (alert,) = Alert.objects.all()
        assert (alert.status, alert.attempts) == (AlertStatus.PENDING, 1)
        assert "answered HTTP 500" in alert.last_error
        assert alerts.drain() == 1  # retried (no backoff here), the server said 200
        alert.refresh_from_db()
        assert (alert.status, alert.attempts) == (AlertStatus.SENT, 2)
    assert len(Hook.received) == 2
    headers, body = Hook.received[-1]
    scheme = dict(part.split("=", 1) for part in headers["X-Dispatch-Signature"].split(","))
    expected = hmac.new(
        secret.encode(), scheme["t"].encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    assert hmac.compare_digest(scheme["v1"], expected)
    payload = json.loads(body)
    assert (payload["kind"], payload["binding"], payload["run_id"]) == (
        AlertKind.RUN_FAILED,
        b.name,
        str(run.id),
    )
    assert secret not in body.decode() and all(secret not in v for v in headers.values())


@override_settings(
    **{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["webhook"]},
    DISPATCH_ALERT_MAX_ATTEMPTS=2,
    DISPATCH_ALERT_BACKOFF=0.0,
    DISPATCH_ALERT_WEBHOOK_URL="http://127.0.0.1:9/none",
)
def test_alerts__an_unreachable_webhook_gives_up_after_the_last_attempt() -> None:
    b = BindingFactory()
    finish(b, "FAILED")
    alerts.scan()
    alerts.drain()
    alerts.drain()
    (alert,) = Alert.objects.all()
    assert (alert.status, alert.attempts) == (AlertStatus.FAILED, 2)
    assert "webhook at 127.0.0.1:9 unreachable" in alert.last_error
    assert alerts.drain() == 0  # given up: not sent again


def test_alerts__a_bindings_named_webhook_instead_of_the_sites_default(
    hook: str, admin_client: Any
) -> None:
    """A binding picks one of the site's named webhooks (never a URL of its own): its
    alerts go there, signed with that webhook's secret; other bindings keep the default."""
    Hook.answers = []
    team_secret = "team-secret-93ad"
    with override_settings(
        **{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["webhook"]},
        DISPATCH_ALERT_WEBHOOK_URL="http://127.0.0.1:9/default",  # nobody listens
        DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": hook, "secret": team_secret}},
        DISPATCH_ALERT_MAX_ATTEMPTS=1,
    ):
        mine, other = BindingFactory(), BindingFactory()
        page = admin_client.get(f"/admin/dispatch/jobbinding/{mine.pk}/change/").content.decode()
        assert '<option value="team-a">team-a</option>' in page
        BindingHealth.objects.create(binding=mine, alert_webhook="team-a")
        run = finish(mine, "FAILED")
        finish(other, "FAILED")
        alerts.scan()
        assert alerts.drain() == 1
        assert sorted(Alert.objects.values_list("binding_id", "notifier", "status")) == sorted(
            [
                (mine.pk, "webhook:team-a", AlertStatus.SENT),
                (other.pk, "webhook", AlertStatus.FAILED),
            ]
        )
        # A name the site no longer has: a clear error on the alert, nothing sent.
        with override_settings(DISPATCH_ALERT_WEBHOOKS={}):
            finish(mine, "FAILED")
            alerts.scan()
            alerts.drain()
            latest = Alert.objects.filter(binding_id=mine.pk).order_by("-created_at").first()
            assert latest is not None and latest.status == AlertStatus.FAILED
            assert "webhook 'team-a' is not in DISPATCH_ALERT_WEBHOOKS" in latest.last_error
    ((headers, body),) = Hook.received
    scheme = dict(part.split("=", 1) for part in headers["X-Dispatch-Signature"].split(","))
    expected = hmac.new(
        team_secret.encode(), scheme["t"].encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    assert hmac.compare_digest(scheme["v1"], expected)
    assert json.loads(body)["run_id"] == str(run.id)


@override_settings(
    DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": "https://hooks.example/a"}},
    DISPATCH_ALERT_EMAIL_DOMAINS=["example.com"],
)
def test_alerts__binding_alert_settings_validated_naming_the_field() -> None:
    from django.core.exceptions import ValidationError

    b = BindingFactory()
    with pytest.raises(ValidationError) as bad_hook:
        BindingHealth(binding=b, alert_webhook="https://evil.example/").full_clean()
    assert "is not one of the site's webhooks (DISPATCH_ALERT_WEBHOOKS: team-a)" in str(
        bad_hook.value.message_dict["alert_webhook"]
    )
    with pytest.raises(ValidationError) as bad_mail:
        BindingHealth(binding=b, alert_emails="ops@example.com, not-an-address").full_clean()
    assert "'not-an-address' is not an email address" in str(
        bad_mail.value.message_dict["alert_emails"]
    )
    BindingHealth(binding=b, alert_webhook="team-a", alert_emails="a@example.com").full_clean()


def test_alerts__malformed_webhooks_fail_a_system_check_without_quoting_the_url() -> None:
    from dispatch.checks import check_alert_webhooks

    with override_settings(
        DISPATCH_ALERT_WEBHOOK_URL="https://ops:S3CRET-PASS@hooks.example/default",
        DISPATCH_ALERT_WEBHOOKS={
            "ok": {"url": "https://hooks.example/ok", "secret": "s"},
            "no-host": {"url": "file:///etc/passwd"},
            "extra": {"url": "https://hooks.example/", "token": "x"},
            "space": {"url": "https://hooks.example/services/T0KEN SECRET"},
            "v6": {"url": "https://[bad-host/x"},
        },
    ):
        errors = check_alert_webhooks()
    assert [e.id for e in errors] == ["dispatch.E014"] * 5
    messages = " ".join(e.msg for e in errors)
    assert "DISPATCH_ALERT_WEBHOOK_URL: its url must not hold a user or password" in messages
    assert "['no-host']: its url must be an http(s) URL with a host" in messages
    assert "['extra']: it must be a dict with the keys" in messages
    assert "['space']: its url holds whitespace or control characters" in messages
    assert "['v6']: its url does not parse" in messages
    assert "S3CRET" not in messages and "T0KEN" not in messages


@override_settings(**{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["webhook"]}, DISPATCH_ALERT_BACKOFF=0.0)
def test_alerts__a_webhook_failure_never_quotes_the_url(hook: str) -> None:
    """A URL the check would refuse, set anyway: the error names the host, never the
    path (which may carry a token)."""
    b = BindingFactory()
    finish(b, "FAILED")
    with override_settings(DISPATCH_ALERT_WEBHOOK_URL=hook + "/services/T0KEN SECRET"):
        alerts.scan()
        assert alerts.drain() == 0
    (alert,) = Alert.objects.all()
    host = hook.split("/")[2]
    assert alert.last_error == f"webhook at {host} failed: InvalidURL"
    assert "T0KEN" not in alert.last_error


@override_settings(DISPATCH_ALERT_EMAIL_DOMAINS=["example.com"])
def test_alerts__a_bindings_recipients_are_capped_and_kept_to_the_sites_domains() -> None:
    from django.core.exceptions import ValidationError

    from dispatch.models.ops import MAX_ALERT_RECIPIENTS

    b = BindingFactory()
    many = ", ".join(f"ops{i}@example.com" for i in range(MAX_ALERT_RECIPIENTS + 1))
    with pytest.raises(ValidationError) as too_many:
        BindingHealth(binding=b, alert_emails=many).full_clean()
    assert f"{MAX_ALERT_RECIPIENTS + 1} addresses; a binding's alerts go to at most" in str(
        too_many.value.message_dict["alert_emails"]
    )
    with pytest.raises(ValidationError) as elsewhere:
        BindingHealth(binding=b, alert_emails="ops@example.com, x@elsewhere.test").full_clean()
    assert "'x@elsewhere.test' is not at one of the site's alert domains" in str(
        elsewhere.value.message_dict["alert_emails"]
    )
    BindingHealth(binding=b, alert_emails="ops@EXAMPLE.com").full_clean()


def binding_post(binding: JobBinding, **health: str) -> dict[str, str]:
    """The binding page's form as a browser posts it, with its alert settings inline."""
    return {
        "name": binding.name,
        "job": str(binding.job_id),
        "source": str(binding.source_id),
        "sink": str(binding.sink_id),
        "enabled": "on",
        "max_concurrency": str(binding.max_concurrency),
        "health-TOTAL_FORMS": "1",
        "health-INITIAL_FORMS": "1" if BindingHealth.objects.filter(binding=binding) else "0",
        "health-MIN_NUM_FORMS": "0",
        "health-MAX_NUM_FORMS": "1",
        "health-0-binding": str(binding.pk),
        **{f"health-0-{k}": v for k, v in health.items()},
    }


@override_settings(DISPATCH_ALERT_EMAIL_DOMAINS=["example.com"])
def test_alerts__saving_the_binding_page_writes_its_alert_settings_only(
    admin_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The health scan moves the row while the page is being saved (here: between the
    form's validation and its save, from another connection): the page writes the
    alert settings, never the scan's state back."""
    from tests.support.helpers import raw_connection

    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="old@example.com")
    clean = BindingHealth.clean

    def scan_meanwhile(self: BindingHealth) -> None:
        clean(self)
        with raw_connection() as other:
            other.execute(
                "UPDATE dispatch_bindinghealth SET state = 'AUTO_DISABLED',"
                " consecutive_failures = 30, reason = 'auto-disabled: 30' WHERE binding_id = %s",
                [b.pk],
            )
            other.commit()

    monkeypatch.setattr(BindingHealth, "clean", scan_meanwhile)
    url = f"/admin/dispatch/jobbinding/{b.pk}/change/"
    response = admin_client.post(url, binding_post(b, alert_emails="new@example.com"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    h = health_of(b)
    assert (h.alert_emails, h.state, h.consecutive_failures) == (
        "new@example.com",
        HealthState.AUTO_DISABLED,
        30,
    )


@override_settings(DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": "https://hooks.example/a"}})
def test_alerts__a_webhook_the_site_dropped_is_shown_and_blocks_no_other_edit(
    admin_client: Any,
) -> None:
    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_webhook="gone")
    url = f"/admin/dispatch/jobbinding/{b.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert "gone (no longer configured: its alerts fail)" in page
    data = {**binding_post(b, alert_webhook="gone"), "max_concurrency": "3"}
    assert admin_client.post(url, data).status_code == 302
    b.refresh_from_db()
    assert b.max_concurrency == 3 and health_of(b).alert_webhook == "gone"
    # Choosing an unknown name anew is refused, naming the field's choices.
    response = admin_client.post(url, binding_post(b, alert_webhook="elsewhere"))
    assert response.status_code == 200
    assert health_of(b).alert_webhook == "gone"


# --- what alerts carry, and to whom (docs/security.md, "Alerts") -----------------------------
QUOTING = 'COPY narrow, line 1, column note: "customer-ssn-1"'


def test_alerts__no_error_text_in_mail_or_webhook_even_when_it_quotes_a_value(
    hook: str,
) -> None:
    """A source's or sink's error may quote a value of the data; the mail and the webhook
    carry the run's link, status, reason and counts instead, and an outbox row written
    before (its payload still holding `error`) is sent without it."""
    Hook.answers = []
    with override_settings(
        **{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["email", "webhook"]},
        DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": hook, "secret": ""}},
    ):
        b = BindingFactory(name="narrow")
        BindingHealth.objects.create(
            binding=b, alert_emails="team@example.com", alert_webhook="team-a"
        )
        run = finish(b, "FAILED", error=QUOTING)
        alerts.scan()
        Alert.objects.create(
            kind=AlertKind.RUN_FAILED,
            notifier="email",
            binding_id=b.pk,
            binding_name=b.name,
            dedup_key="written-by-the-previous-release",
            payload={"binding": b.name, "error": QUOTING, "recipients": ["ops@example.com"]},
        )
        assert alerts.drain() == 3
    assert len(mail.outbox) == 2 and len(Hook.received) == 1
    for message in mail.outbox:
        assert "customer-ssn-1" not in message.subject + message.body
    ((_, body),) = Hook.received
    assert "customer-ssn-1" not in body.decode()
    payload = json.loads(body)
    assert "error" not in payload
    link = f"/admin/dispatch/run/{run.id}/change/"
    assert payload["link"] == link
    assert (payload["status"], payload["reason"], payload["attempts"]) == (
        "FAILED",
        "PERMANENT_ERROR",
        1,
    )
    assert (payload["rows_read"], payload["rows_written"]) == (0, 0)
    assert run.finished_at is not None
    assert payload["finished_at"] == run.finished_at.isoformat()
    (failed,) = [m for m in mail.outbox if m.to == ["team@example.com"]]
    for line in (f"run: {link}", "status: FAILED", "reason: PERMANENT_ERROR", "attempts: 1"):
        assert line in failed.body.splitlines()


def test_alerts__addresses_outside_the_domains_refused_by_the_form_and_never_mailed() -> None:
    """Unset, DISPATCH_ALERT_EMAIL_DOMAINS allows no address of a binding's own (its
    alerts go to ADMINS); a listed domain allows its addresses; "*" any. An address stored
    past the form, or before the setting narrowed, is dropped at enqueue and again at send,
    the outbox row saying why."""
    from django.core.exceptions import ValidationError

    b = BindingFactory()
    unset = {k: v for k, v in BASE.items() if k != "DISPATCH_ALERT_EMAIL_DOMAINS"}
    with override_settings(**unset):
        with pytest.raises(ValidationError) as refused:
            BindingHealth(binding=b, alert_emails="team@example.com").full_clean()
        assert "DISPATCH_ALERT_EMAIL_DOMAINS allows no binding's own addresses" in str(
            refused.value.message_dict["alert_emails"]
        )
        BindingHealth.objects.create(binding=b, alert_emails="team@example.com, x@outside.test")
        finish(b, "FAILED")
        alerts.scan()
        assert alerts.drain() == 1
    assert mail.outbox[-1].to == ["ops@example.com"]  # ADMINS
    with override_settings(**BASE):  # example.com only
        with pytest.raises(ValidationError):  # clean(): the binding has its row already
            BindingHealth(binding=b, alert_emails="x@outside.test").clean()
        finish(b, "FAILED")
        alerts.scan()
        assert alerts.drain() == 1
    assert mail.outbox[-1].to == ["team@example.com"]
    latest = Alert.objects.filter(binding_id=b.pk).order_by("-created_at").first()
    assert latest is not None
    assert latest.payload["withheld"] == ["x@outside.test: outside DISPATCH_ALERT_EMAIL_DOMAINS"]
    with override_settings(**{**BASE, "DISPATCH_ALERT_EMAIL_DOMAINS": ["*"]}):
        BindingHealth(binding=b, alert_emails="x@outside.test").clean()
        finish(b, "FAILED")
        alerts.scan()
    # Enqueued while "*" allowed it, sent after the setting narrowed: dropped at send.
    with override_settings(**BASE):
        assert alerts.drain() == 1
    assert mail.outbox[-1].to == ["team@example.com"]
    with override_settings(**{**BASE, "DISPATCH_ALERT_EMAIL_DOMAINS": ["*"]}):
        finish(b, "FAILED")
        alerts.scan()
        assert alerts.drain() == 1
    assert mail.outbox[-1].to == ["team@example.com", "x@outside.test"]


@override_settings(**{**BASE, "DISPATCH_ALERT_EMAIL_DOMAINS": ["*"]})
def test_alerts__a_failure_before_the_address_was_set_is_not_mailed_to_it() -> None:
    """New recipients get alerts of failures after they were added (the database moves
    `alert_settings_changed_at` whatever wrote the change); earlier ones go to ADMINS."""
    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="old@example.com")
    before = finish(b, "FAILED")
    BindingHealth.objects.filter(binding=b).update(alert_emails="old@example.com, new@outside.test")
    after = finish(b, "FAILED")
    alerts.scan()
    assert alerts.drain() == 2
    sent = {m.body.split("run_id: ")[1].split()[0]: m.to for m in mail.outbox}
    assert sent == {
        str(before.id): ["ops@example.com"],
        str(after.id): ["old@example.com", "new@outside.test"],
    }
    before_alert = Alert.objects.get(run_id=before.id)
    assert before_alert.payload["withheld"] == [
        "old@example.com: recipients added after the event",
        "new@outside.test: recipients added after the event",
    ]


def test_alerts__a_failure_before_the_webhook_was_chosen_is_not_posted_to_it(hook: str) -> None:
    Hook.answers = []
    with override_settings(
        **{**BASE, "DISPATCH_ALERT_NOTIFIERS": ["webhook"]},
        DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": hook, "secret": ""}},
    ):
        b = BindingFactory()
        BindingHealth.objects.create(binding=b)
        before = finish(b, "FAILED")
        BindingHealth.objects.filter(binding=b).update(alert_webhook="team-a")
        after = finish(b, "FAILED")
        alerts.scan()
        assert alerts.drain() == 1
    # No default webhook: the earlier failure has none to go to.
    assert [json.loads(body)["run_id"] for _, body in Hook.received] == [str(after.id)]
    assert not Alert.objects.filter(run_id=before.id).exists()


def test_alerts__only_an_added_recipient_moves_the_settings_time() -> None:
    """The trigger moves `alert_settings_changed_at` when an address or a named webhook is
    added, from any writer; removing one, or another edit, leaves it."""
    from tests.support.helpers import raw_connection

    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="a@example.com, b@example.com")

    def changed_at() -> Any:
        return BindingHealth.objects.values_list("alert_settings_changed_at", flat=True).get(
            binding=b
        )

    def write(sql: str) -> None:
        with raw_connection() as other:
            other.execute(sql, [b.pk])
            other.commit()

    first = changed_at()
    write(
        "UPDATE dispatch_bindinghealth SET alert_emails = ' B@example.com',"
        " alerts_muted = true WHERE binding_id = %s"
    )
    write("UPDATE dispatch_bindinghealth SET alert_webhook = '' WHERE binding_id = %s")
    assert changed_at() == first
    write(
        "UPDATE dispatch_bindinghealth SET alert_emails = 'b@example.com, c@example.com'"
        " WHERE binding_id = %s"
    )
    second = changed_at()
    assert second > first
    write("UPDATE dispatch_bindinghealth SET alert_webhook = 'team-a' WHERE binding_id = %s")
    assert changed_at() > second


def alert_user(*codenames: str) -> Any:
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:8]}", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


@override_settings(
    DISPATCH_ALERT_EMAIL_DOMAINS=["*"],
    DISPATCH_ALERT_WEBHOOKS={"team-a": {"url": "https://hooks.example/a"}},
)
def test_alerts__setting_recipients_needs_the_permission_to_view_runs(client: Any) -> None:
    """Binding and health rights alone (no run view) show the recipients read-only; a
    crafted POST changes nothing. With `dispatch.view_run` they are set."""
    rights = (
        "view_jobbinding",
        "change_jobbinding",
        "view_bindinghealth",
        "change_bindinghealth",
        "add_bindinghealth",
    )
    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="old@example.com")
    url = f"/admin/dispatch/jobbinding/{b.pk}/change/"
    client.force_login(alert_user(*rights))
    page = client.get(url).content.decode()
    assert 'name="health-0-alert_emails"' not in page and "old@example.com" in page
    response = client.post(
        url,
        binding_post(b, alert_emails="x@outside.test", alert_webhook="team-a", alerts_muted="on"),
    )
    assert response.status_code == 302, response.content.decode()[-3000:]
    h = health_of(b)
    assert (h.alert_emails, h.alert_webhook, h.alerts_muted) == ("old@example.com", "", True)
    client.force_login(alert_user(*rights, "view_run"))
    assert 'name="health-0-alert_emails"' in client.get(url).content.decode()
    response = client.post(url, binding_post(b, alert_emails="x@outside.test"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert health_of(b).alert_emails == "x@outside.test"
    # A binding without a health row yet: the row is added without the recipients.
    other = BindingFactory()
    client.force_login(alert_user(*rights))
    other_url = f"/admin/dispatch/jobbinding/{other.pk}/change/"
    assert (
        client.post(other_url, binding_post(other, alert_emails="x@outside.test")).status_code
        == 302
    )
    assert not BindingHealth.objects.filter(binding=other).exclude(alert_emails="").exists()


def test_alerts__malformed_or_refused_domains_are_reported_by_system_checks() -> None:
    from dispatch.checks import check_alert_email_domains, check_stored_alert_addresses

    with override_settings(
        DISPATCH_ALERT_EMAIL_DOMAINS=["example.com", "@example.org", "*.example.net", "a b"]
    ):
        errors = check_alert_email_domains()
    assert [e.id for e in errors] == ["dispatch.E017"] * 3
    messages = " ".join(e.msg for e in errors)
    for entry in ("'@example.org'", "'*.example.net'", "'a b'"):
        assert f"entry {entry} is not a domain" in messages
    with override_settings(
        DISPATCH_ALERT_EMAIL_DOMAINS="*, example.com, bücher.de, xn--bcher-kva.de"
    ):
        assert check_alert_email_domains() == []
    b = BindingFactory()
    BindingHealth.objects.create(binding=b, alert_emails="team@example.com, x@outside.test")
    with override_settings(DISPATCH_ALERT_EMAIL_DOMAINS=["example.com"]):
        (warning,) = check_stored_alert_addresses(databases=["default"])
        assert warning.id == "dispatch.W002"
        assert "1 binding(s)" in warning.msg and "outside.test" not in warning.msg
    with override_settings(DISPATCH_ALERT_EMAIL_DOMAINS=["*"]):
        assert check_stored_alert_addresses(databases=["default"]) == []


@override_settings(**BASE)
def test_scan__a_run_that_changed_its_sink_table_is_alerted_with_the_changes() -> None:
    binding = BindingFactory()
    changed = trigger(binding)
    (c,) = claims.claim("w-alerts", run_id=changed.id, limit=1, generic=False)
    recorded = [
        {"column": "extra", "change": "added", "type": "numeric(8,2)"},
        {"column": "note", "change": "ignored", "type": "text"},
        {"column": "code", "change": "widened", "type": "bigint", "from": "integer"},
    ]
    # Guarded by the lease token, like every write after the claim.
    assert not claims.record_schema_changes(c.attempt_id, c.lease_token + 1, recorded)
    assert claims.record_schema_changes(c.attempt_id, c.lease_token, recorded)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    # A run whose sink only ignored a column changed nothing in the sink: no alert.
    quiet = trigger(binding)
    (q,) = claims.claim("w-alerts", run_id=quiet.id, limit=1, generic=False)
    assert claims.record_schema_changes(q.attempt_id, q.lease_token, recorded[1:2])
    claims.settle(q.attempt_id, q.lease_token, "SUCCEEDED")
    alerts.scan()
    alerts.scan()  # a second pass enqueues nothing twice
    (alert,) = Alert.objects.filter(binding_id=binding.pk)
    assert (alert.kind, alert.run_id) == (AlertKind.SCHEMA_CHANGED, changed.id)
    assert alert.payload["schema_changes"] == [recorded[0], recorded[2]]
    assert alerts.drain() == 1
    (message,) = mail.outbox
    assert message.subject == f"[dispatch] {binding.name} changed its sink table's columns"
    assert "schema_changes: extra added numeric(8,2); code widened integer -> bigint" in (
        message.body
    )
