"""A webhook that answers with a redirect: a failed delivery, never followed (urllib would
turn the POST into a GET without its body and forward the signature to the new host)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from dispatch.models.ops import Alert, AlertStatus
from dispatch.ops import alerts
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger

pytestmark = pytest.mark.django_db(transaction=True)


class Target(http.server.BaseHTTPRequestHandler):
    """Where the redirect points: records every request, whatever its method."""

    received: list[tuple[str, dict[str, str]]] = []

    def _record(self) -> None:
        type(self).received.append((self.command, dict(self.headers)))
        self.send_response(200)
        self.end_headers()

    do_GET = do_POST = do_HEAD = _record  # noqa: N815 - the standard library's names

    def log_message(self, *args: Any) -> None:
        pass


class Redirector(http.server.BaseHTTPRequestHandler):
    """The configured webhook: answers every POST with `status` and a Location."""

    status = 302
    location = ""
    received: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(self.command)
        self.send_response(type(self).status)
        self.send_header("Location", type(self).location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def target() -> Iterator[str]:
    Target.received = []
    yield from serve(Target)


@pytest.fixture
def redirector() -> Iterator[str]:
    Redirector.received = []
    yield from serve(Redirector)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_webhook__a_redirect_is_a_failed_delivery_and_is_not_followed(
    status: int, redirector: str, target: str
) -> None:
    Redirector.status = status
    Redirector.location = f"{target}/elsewhere?token=from-the-redirect"
    with override_settings(
        DISPATCH_HEALTH_SCAN_LAG=0.0,
        DISPATCH_ALERT_NOTIFIERS=["webhook"],
        DISPATCH_ALERT_WEBHOOK_URL=f"{redirector}/hook",
        DISPATCH_ALERT_WEBHOOK_SECRET="webhook-secret-77e2",
        DISPATCH_ALERT_MAX_ATTEMPTS=1,
    ):
        binding = BindingFactory()
        run = trigger(binding)
        (c,) = claims.claim("w-redirect", run_id=run.id, limit=1, generic=False)
        claims.settle(c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR")
        alerts.scan()
        assert alerts.drain() == 0
    (alert,) = Alert.objects.filter(binding_id=binding.pk)
    assert alert.status == AlertStatus.FAILED
    assert f"answered HTTP {status}" in alert.last_error
    assert "redirect" in alert.last_error
    assert "from-the-redirect" not in alert.last_error  # the Location is never quoted
    assert Redirector.received == ["POST"]
    assert Target.received == []
