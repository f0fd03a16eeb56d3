"""The site's metrics endpoint: access control, and its series after a few runs, parsed
with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from dispatch import claims, services
from tests.factories import BindingFactory, trigger

pytestmark = pytest.mark.django_db


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics__refused_without_staff_or_token(client):
    assert client.get("/metrics").status_code == 403
    with override_settings(DISPATCH_METRICS_TOKEN="t0ken"):
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer t0ken").status_code == 200


def test_metrics__series_after_a_few_runs(client):
    ok = BindingFactory(name="b-ok", max_concurrency=2)  # room for the due one beside RUNNING
    blocked = BindingFactory(name="b-off", enabled=False)
    done = trigger(ok)
    [c] = claims.claim("w-m", run_id=done.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    failed = trigger(ok)
    [c] = claims.claim("w-m", run_id=failed.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR")
    trigger(ok)  # due, unblocked
    services.trigger(blocked)  # due, blocked
    running = trigger(ok)
    claims.claim("w-m", run_id=running.id, limit=1, generic=False)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO dispatch_worker (id, host, pid, concurrency, stats) VALUES"
            " ('w-m', 'h', 1, 2, '{\"claims_directed\": 3, \"directed_hits\": 3,"
            ' "fenced_commits": 1, "listen_healthy": 0}\')'
        )
    client.force_login(User.objects.create_user("staff", is_staff=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    got = samples(response.content.decode())
    assert got[("dispatch_runs", (("status", "PENDING"),))] == 2
    assert got[("dispatch_runs", (("status", "RUNNING"),))] == 1
    assert got[("dispatch_runs_finished_last_hour", (("status", "SUCCEEDED"),))] == 1
    assert got[("dispatch_runs_finished_last_hour", (("status", "FAILED"),))] == 1
    assert got[("dispatch_due_unclaimed", (("binding", "b-ok"), ("blocked_reason", "NONE")))] == 1
    assert (
        got[
            (
                "dispatch_due_unclaimed",
                (("binding", "b-off"), ("blocked_reason", "BINDING_DISABLED")),
            )
        ]
        == 1
    )
    assert got[("dispatch_oldest_wait_seconds", ())] >= 0
    assert got[("dispatch_live_workers", ())] == 1
    assert got[("dispatch_worker_events", (("event", "directed_hits"),))] == 3
    assert got[("dispatch_worker_events", (("event", "fenced_commits"),))] == 1
    assert got[("dispatch_listen_unhealthy_workers", ())] == 1
    assert ("dispatch_table_dead_tuples", (("table", "dispatch_run"),)) in got
    assert not any(str(done.id) in str(key) for key in got)  # no run ids as labels
