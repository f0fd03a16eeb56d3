"""The site's metrics endpoint: access control, and its series after a few runs, parsed
with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from dispatch import services
from dispatch.worker import claims
from tests.support.factories import BindingFactory, trigger

pytestmark = pytest.mark.django_db


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def viewer(name: str) -> User:
    """A staff user who may view runs: what the metrics need."""
    user = User.objects.create_user(name, is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_run"))
    return user


def test_metrics__refused_without_the_run_view_permission_or_the_token(client):
    assert client.get("/metrics").status_code == 403
    # Staff alone is not enough: every binding's name and failure counts are on the page.
    client.force_login(User.objects.create_user("staff-only", is_staff=True))
    assert client.get("/metrics").status_code == 403
    client.force_login(viewer("viewer"))
    assert client.get("/metrics").status_code == 200
    client.logout()
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
            ' "fenced_commits": 1, "listen_healthy": 0, "listen_state": 2}\'),'
            # Still starting (its first probe not back yet): not counted as unhealthy.
            " ('w-s', 'h', 2, 1, '{\"listen_healthy\": 0, \"listen_state\": 0}')"
        )
    client.force_login(viewer("staff"))
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
    assert got[("dispatch_live_workers", ())] == 2
    assert got[("dispatch_worker_events", (("event", "directed_hits"),))] == 3
    assert got[("dispatch_worker_events", (("event", "fenced_commits"),))] == 1
    assert got[("dispatch_listen_unhealthy_workers", ())] == 1
    assert ("dispatch_table_dead_tuples", (("table", "dispatch_run"),)) in got
    assert not any(str(done.id) in str(key) for key in got)  # no run ids as labels


@pytest.mark.django_db(transaction=True)
@override_settings(DISPATCH_HEALTH_SCAN_LAG=0.0)
def test_metrics__counters_and_histograms_folded_once_from_finished_runs(client):
    from datetime import timedelta

    from dispatch.models import Attempt
    from dispatch.ops import binding_metrics

    b = BindingFactory(name="b-fold")
    other = BindingFactory(name="b-other")
    ok = trigger(b)
    [c] = claims.claim("w-f", run_id=ok.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=40, rows_written=39)
    # Known times, in the past: waited 0.3 s (le 0.5, not 0.25), ran 2 s (le 2.5, not 1).
    due = Attempt.objects.get(pk=c.attempt_id).available_at - timedelta(seconds=10)
    Attempt.objects.filter(pk=c.attempt_id).update(
        available_at=due,
        claimed_at=due + timedelta(seconds=0.3),
        finished_at=due + timedelta(seconds=2.3),
    )
    bad = trigger(b)
    [c] = claims.claim("w-f", run_id=bad.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR")
    trigger(other)  # live: counted when it finishes, not before

    assert binding_metrics.fold() == 4  # two runs, their two attempts
    assert binding_metrics.fold() == 0  # nothing twice
    client.force_login(viewer("staff2"))
    got = samples(client.get("/metrics").content.decode())
    bl = ("binding", "b-fold")
    assert got[("dispatch_runs_finished_total", (bl, ("status", "SUCCEEDED")))] == 1
    assert got[("dispatch_runs_finished_total", (bl, ("status", "FAILED")))] == 1
    assert got[("dispatch_attempts_finished_total", (bl, ("status", "SUCCEEDED")))] == 1
    assert got[("dispatch_rows_read_total", (bl,))] == 40
    assert got[("dispatch_rows_written_total", (bl,))] == 39
    assert got[("dispatch_run_duration_seconds_count", (bl,))] == 2
    assert got[("dispatch_run_duration_seconds_bucket", (bl, ("le", "1.0")))] == 1  # the failed
    assert got[("dispatch_run_duration_seconds_bucket", (bl, ("le", "2.5")))] == 2
    assert got[("dispatch_queue_wait_seconds_bucket", (bl, ("le", "0.25")))] <= 1
    assert got[("dispatch_queue_wait_seconds_bucket", (bl, ("le", "0.5")))] == 2
    assert got[("dispatch_queue_wait_seconds_bucket", (bl, ("le", "+Inf")))] == 2
    assert 2.0 <= got[("dispatch_run_duration_seconds_sum", (bl,))] < 3.0
    assert not any(k[1] and ("binding", "b-other") in k[1] for k in got if "finished" in k[0])
    assert got[("dispatch_bindings_by_health", (("state", "OK"),))] == 0  # no scan ran
    # The fold's cursors lag by about the scan lag (0 here) plus this test's own time.
    lags = {k[1]: v for k, v in got.items() if k[0] == "dispatch_maintenance_lag_seconds"}
    assert set(lags) == {
        (("cursor", "runs"), ("task", "metrics")),
        (("cursor", "attempts"), ("task", "metrics")),
    }
    assert all(0 <= v < 60 for v in lags.values()), lags


@pytest.mark.django_db(transaction=True)
def test_metrics__two_folds_at_once_take_turns_and_count_nothing_twice():
    """The second fold waits on the cursor's row lock, then starts from the cursor the
    first committed with its counters."""
    import threading

    from dispatch.models.ops import BindingMetrics, OpsState
    from dispatch.ops import binding_metrics
    from tests.support.helpers import in_threads, raw_connection
    from tests.support.processes import wait_until

    with override_settings(DISPATCH_HEALTH_SCAN_LAG=0.0):
        b = BindingFactory(name="b-twice")
        for _ in range(3):
            run = trigger(b)
            [c] = claims.claim("w-t", run_id=run.id, limit=1, generic=False)
            claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
        OpsState.objects.get_or_create(key=binding_metrics.KEY)
        holder = raw_connection()
        holder.autocommit = False
        holder.execute("SELECT 1 FROM dispatch_opsstate WHERE key = 'metrics' FOR UPDATE")
        results: list[list[int]] = []
        folding = threading.Thread(
            target=lambda: results.append(in_threads(2, lambda i: binding_metrics.fold()))
        )
        folding.start()
        with raw_connection() as probe:
            probe.autocommit = True  # pg_stat_activity is read afresh each time
            wait_until(
                lambda: (
                    probe.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE '%dispatch_opsstate%'"
                    ).fetchone()[0]
                    == 2
                ),
                message="both folds waiting on the cursor's row",
            )
        holder.commit()
        holder.close()
        folding.join(30)
    assert sorted(results[0]) == [0, 6]  # three runs and their attempts, once
    assert BindingMetrics.objects.get(binding=b).counters["runs"] == {"SUCCEEDED": 3}


@pytest.mark.django_db(transaction=True)
@override_settings(DISPATCH_HEALTH_SCAN_LAG=0.0)
def test_metrics__a_run_retried_by_an_operator_counts_each_attempt_once():
    """The run finishes twice (counted twice: runs that reached a final status); its
    first attempt, settled before the retry, is not read again."""
    from dispatch.models.ops import BindingMetrics
    from dispatch.ops import binding_metrics

    b = BindingFactory(name="b-retried")
    run = trigger(b)
    [c] = claims.claim("w-r", run_id=run.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "PERMANENT", reason="PERMANENT_ERROR", rows_read=100)
    assert binding_metrics.fold() == 2
    services.retry_run(run)
    [c] = claims.claim("w-r", run_id=run.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", rows_read=10, rows_written=10)
    assert binding_metrics.fold() == 2
    counters = BindingMetrics.objects.get(binding=b).counters
    assert counters["attempts"] == {"FAILED": 1, "SUCCEEDED": 1}
    assert counters["runs"] == {"FAILED": 1, "SUCCEEDED": 1}
    assert (counters["rows_read"], counters["rows_written"]) == (110, 10)
    assert sum(counters["duration"]["counts"]) == 2


def test_metrics__a_cut_per_binding_list_says_so(client, monkeypatch):
    """Past MAX_BINDINGS bindings the per-binding series keep the first ones; a gauge says
    which families were cut, so a binding pushed out is not silently unwatched."""
    from dispatch.ops import metrics

    monkeypatch.setattr(metrics, "MAX_BINDINGS", 2)
    client.force_login(viewer("cut"))
    bindings = [BindingFactory(name=f"b-cut-{i}") for i in range(2)]
    for b in bindings:
        trigger(b)  # due: one series each
    with connection.cursor() as cursor:
        for b in bindings:
            cursor.execute(
                "INSERT INTO dispatch_bindingmetrics (binding_id, counters) VALUES (%s, '{}')",
                [b.pk],
            )
    got = samples(client.get("/metrics").content.decode())
    assert got[("dispatch_metrics_series_truncated", (("family", "due"),))] == 0
    assert got[("dispatch_metrics_series_truncated", (("family", "binding_counters"),))] == 0

    third = BindingFactory(name="b-cut-2")
    trigger(third)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO dispatch_bindingmetrics (binding_id, counters) VALUES (%s, '{}')",
            [third.pk],
        )
    got = samples(client.get("/metrics").content.decode())
    assert got[("dispatch_metrics_series_truncated", (("family", "due"),))] == 1
    assert got[("dispatch_metrics_series_truncated", (("family", "binding_counters"),))] == 1
    shown = {
        dict(labels).get("binding") for (name, labels) in got if name == "dispatch_rows_read_total"
    }
    assert shown == {"b-cut-0", "b-cut-1"}
