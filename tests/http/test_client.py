"""`dispatch.client` against a live server: its calls, DispatchAPIError with the problem
details, pages, no redirect followed with the token, and no Django needed to import it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from dispatch.client import DispatchAPIError, DispatchClient
from dispatch.models import Run
from tests.support.factories import BindingFactory
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client(live_server: Any, operator_token: str) -> DispatchClient:
    return DispatchClient(live_server.url + "/", operator_token)


def test_client__trigger_read_cancel_retry(client: DispatchClient) -> None:
    BindingFactory(name="orders")
    run = client.trigger("orders", idempotency_key="dag-1:orders")
    assert client.trigger("orders", idempotency_key="dag-1:orders")["id"] == run["id"]
    assert client.run(run["id"])["attempts"][0]["number"] == 1
    assert client.cancel(run["id"])["outcome"] == "CANCELLED"
    with pytest.raises(DispatchAPIError) as refused:
        client.cancel(run["id"])
    assert refused.value.status == 409 and refused.value.code == "ALREADY_FINISHED"
    assert client.retry(run["id"])["outcome"] == "RETRIED"
    assert [b["name"] for b in client.bindings()] == ["orders"]
    assert "token" not in repr(client) and "dsp_" not in repr(client)


def test_client__errors_carry_the_problem(client: DispatchClient) -> None:
    with pytest.raises(DispatchAPIError) as missing:
        client.trigger("nope")
    assert missing.value.status == 404
    assert missing.value.problem["type"] == "/problems/not-found"
    assert "nope" in str(missing.value)
    BindingFactory(name="orders")
    with pytest.raises(DispatchAPIError) as invalid:
        client.trigger("orders", idempotency_key="x" * 201)
    assert invalid.value.status == 422
    assert invalid.value.errors[0]["field"] == "idempotency_key"
    bad = DispatchClient(client.api_url.removesuffix("/api/v1"), "dsp_wrong")
    with pytest.raises(DispatchAPIError) as unauthenticated:
        list(bad.runs())
    assert unauthenticated.value.status == 401


def test_client__runs_iterates_over_every_page(client: DispatchClient) -> None:
    binding = BindingFactory(name="orders")
    for _ in range(7):
        Run.objects.create(binding=binding)
    ids = [r["id"] for r in client.runs(binding="orders", page_size=3)]
    assert sorted(ids) == sorted(str(pk) for pk in Run.objects.values_list("pk", flat=True))


def test_client__wait_raises_timeout_error_on_a_run_that_does_not_finish(
    client: DispatchClient,
) -> None:
    BindingFactory(name="orders")
    run = client.trigger("orders")
    with pytest.raises(TimeoutError, match="still PENDING"):
        client.wait(run["id"], timeout=1, poll=0.5)


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []
    location = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.location:
            self.send_response(302)
            self.send_header("Location", self.location + self.path)
            self.end_headers()
            return
        type(self).seen.append(dict(self.headers))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"items": [], "next_cursor": null}')

    def log_message(self, *args: Any) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[HTTPServer]:
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_client__never_follows_a_redirect_with_the_token() -> None:
    class Elsewhere(_Recorder):
        seen: list[dict[str, str]] = []
        location = ""

    for other in _serve(Elsewhere):
        target = f"http://127.0.0.1:{other.server_port}"

        class Redirecting(_Recorder):
            seen: list[dict[str, str]] = []
            location = target

        for first in _serve(Redirecting):
            client = DispatchClient(f"http://127.0.0.1:{first.server_port}/", "dsp_secret_token")
            with pytest.raises(DispatchAPIError) as redirected:
                list(client.runs())
            assert redirected.value.status == 302
            assert target in str(redirected.value)
        # The other host was never asked, so it never saw the token.
        assert Elsewhere.seen == []
        # (It does answer a direct request: the test would see one that was followed.)
        direct = DispatchClient(target + "/", "dsp_direct")
        assert list(direct.runs()) == []
        assert Elsewhere.seen[0]["Authorization"] == "Bearer dsp_direct"


def test_client__imports_without_django() -> None:
    code = "import sys, dispatch.client; assert 'django' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
