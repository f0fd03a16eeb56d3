"""A worker whose LISTEN connection is silently broken, reported by its self-probe.

Only the worker's LISTEN connection (DISPATCH_LISTEN_URL) goes through a proxy the test
owns; its working connections go straight to PostgreSQL. Blackholed, the proxy keeps the
socket open and drops every byte (a broken NAT, a middlebox that lost its state): nothing
errors, the notifications just stop. The probe must notice, and every place an operator
looks must say so: `workerhealth --require-listen`, the metrics endpoint, the admin
overview and the worker's log. After the heal the worker reconnects and reports `ok`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from dispatch.models import Worker
from dispatch.worker.listen import ListenProbe, ListenState, ProbeAction, ProbeReport, probe_report
from tests.support.processes import ROOT, Processes, test_database_url, wait_until, worker_env
from tests.worker.test_partition import proxied_url
from tests.worker.test_worker import start_worker
from tools.blackhole import BlackholeProxy

WORKER = "w-listen-cut"


def start_proxied_worker(
    processes: Processes, proxy: BlackholeProxy, *args: str, connect_timeout: str
) -> Any:
    """A real worker whose LISTEN connection alone goes through `proxy`, probing every
    second."""
    return start_worker(
        processes,
        "--worker-id",
        WORKER,
        *args,
        env=worker_env(
            DISPATCH_LISTEN_URL=proxied_url(proxy.port),
            DISPATCH_LISTEN_PROBE_INTERVAL="1",
            DISPATCH_LISTEN_PROBE_TIMEOUT="1",
            DATABASE_CONNECT_TIMEOUT=connect_timeout,
        ),
    )


def report(worker_id: str = WORKER) -> ProbeReport:
    """The worker's LISTEN probe as its last heartbeat wrote it."""
    stats = Worker.objects.filter(pk=worker_id).values_list("stats", flat=True).first()
    return probe_report(stats)


def workerhealth(worker_id: str = WORKER) -> tuple[int, dict[str, Any]]:
    """`manage.py workerhealth --require-listen` as an orchestrator runs it: exit code and
    its JSON verdict."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "workerhealth"]
        + ["--worker-id", worker_id, "--require-listen"],
        env=worker_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def unhealthy_gauge(client: Client) -> float:
    response = client.get("/metrics")
    assert response.status_code == 200
    [value] = [
        s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
        if s.name == "dispatch_listen_unhealthy_workers"
    ]
    return value


def overview_listen_cell(client: Client, worker_id: str = WORKER) -> str:
    """The LISTEN probe cell (the fourth) of the worker's row on the admin overview."""
    response = client.get(reverse("admin:dispatch_overview"))
    assert response.status_code == 200
    body = response.content.decode()
    row = re.search(rf'<tr[^>]*data-worker="{re.escape(worker_id)}">(.*?)</tr>', body, re.S)
    assert row is not None, f"no row for {worker_id} on the overview"
    cells = re.findall(r"<td>(.*?)</td>", row.group(1), re.S)
    return cells[3]


@pytest.mark.django_db
def test_listen_probe__a_missed_probe_reports_silent_until_a_new_connection_is_up() -> None:
    probe = ListenProbe("w-unit", interval=1.0, timeout=1.0)
    with psycopg.connect(test_database_url(), autocommit=True) as conn:
        probe.connected(conn)
        assert probe.tick(100.0, 0.5) is ProbeAction.NONE  # the start-up probe goes out
        assert probe.sent == 1
        assert probe.tick(101.0, 0.5) is ProbeAction.RECONNECT  # and never comes back
        assert probe.state is ListenState.SILENT
        probe.disconnected()  # the worker drops the silent connection
        assert probe.state is ListenState.SILENT
        assert probe_report(probe.stats()).state == "silent"
        assert probe.stats()["listen_healthy"] == 0
        probe.connected(conn)  # a new connection is up: judged afresh
        assert probe.state is ListenState.STARTING
        probe.disconnected()  # lost without a verdict
        assert probe.state is ListenState.DISCONNECTED


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_listen_probe__a_silently_broken_listen_connection_is_reported_everywhere_and_heals(
    processes: Processes,
) -> None:
    staff = Client()
    staff.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    s = connection.settings_dict
    with BlackholeProxy(s["HOST"] or "127.0.0.1", int(s["PORT"] or 5432)) as proxy:
        # Each reconnect through the black hole waits connect_timeout for the server
        # (libpq's minimum is 2 s); it bounds how soon after the heal one succeeds.
        proc = start_proxied_worker(processes, proxy, connect_timeout="2")

        def log() -> str:
            return processes.output(proc)

        # Healthy first: the start-up probe came back over the proxied LISTEN connection.
        healthy = wait_until(
            lambda: (r := report()).state == "ok" and r.received >= 1 and r,
            timeout=20,
            message="the worker's first answered probe",
        )
        assert proxy.accepted == 1  # the LISTEN connection alone goes through the proxy
        code, verdict = workerhealth()
        assert (code, verdict["healthy"], verdict["listen"]) == (0, True, "ok"), verdict
        assert unhealthy_gauge(staff) == 0
        assert '<span class="dsp-badge dsp-ok">ok</span>' in overview_listen_cell(staff)

        # Silently broken: the socket stays open, the notifications never come back.
        proxy.blackhole()
        try:
            silent = wait_until(
                lambda: (r := report()).state == "silent" and r,
                timeout=20,
                message="the worker to report its LISTEN connection silent",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last report {report()}\n{log()[-3000:]}") from None
        assert silent.missed >= 1 and silent.sent > healthy.sent
        assert not silent.healthy
        assert proxy.dropped_bytes > 0
        assert re.search(
            r"WARNING dispatch.worker LISTEN wake-ups stopped arriving \(self-probe "
            rf"unanswered after 1.0s\); reconnecting, polling every .* worker={WORKER}\n",
            log(),
        ), log()
        # Its reconnects through the black hole fail too; the verdict stands meanwhile.
        wait_until(
            lambda: "LISTEN connection lost, reconnecting in" in log(),
            timeout=20,
            message="a failed reconnect through the black hole",
        )
        assert report().state == "silent"

        code, verdict = workerhealth()
        assert code == 1, verdict
        assert verdict == {
            "worker": WORKER,
            "healthy": False,
            "problem": "LISTEN connection silent",
            "heartbeat_age_seconds": verdict["heartbeat_age_seconds"],
            "listen": "silent",
        }
        assert unhealthy_gauge(staff) == 1
        cell = overview_listen_cell(staff)
        assert re.search(r'<span class="dsp-badge dsp-bad"[^>]*>silent</span>', cell), cell

        # Healed: a reconnect gets through, its start-up probe comes back, all clear again.
        proxy.heal()
        try:
            back = wait_until(
                lambda: (r := report()).state == "ok" and r.received > silent.received and r,
                timeout=40,
                message="the worker to report its LISTEN connection ok again",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last report {report()}\n{log()[-3000:]}") from None
        assert back.missed >= silent.missed
        assert proxy.accepted >= 2 and log().count(f"listening worker={WORKER}") >= 2
        code, verdict = workerhealth()
        assert (code, verdict["listen"]) == (0, "ok"), verdict
        assert unhealthy_gauge(staff) == 0
        assert '<span class="dsp-badge dsp-ok">ok</span>' in overview_listen_cell(staff)
        assert proc.poll() is None, log()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_listen_probe__claims_go_on_while_a_listen_reconnect_hangs(
    processes: Processes,
) -> None:
    """Reconnecting through the black hole waits `connect_timeout` for the server (capped
    at the coordination timeout, 10 s); the worker opens the connection on a thread of
    its own, so its polling claims the work meanwhile. Ordered by the log, not by a
    clock: the run is done before the hanging reconnect has even failed. (On the main
    thread, the reconnect held every claim until it failed.)"""
    from dispatch.core.states import Status
    from dispatch.models import Run
    from tests.support.factories import BindingFactory, trigger

    s = connection.settings_dict
    with BlackholeProxy(s["HOST"] or "127.0.0.1", int(s["PORT"] or 5432)) as proxy:
        proc = start_proxied_worker(
            processes, proxy, "--poll-interval", "0.5", connect_timeout="10"
        )
        wait_until(lambda: report().state == "ok", timeout=20, message="the first probe")
        proxy.blackhole()
        wait_until(lambda: report().state == "silent", timeout=20, message="silent")
        # The worker dropped the silent connection and is opening another through the
        # black hole: a second connection accepted by the proxy, never answered.
        wait_until(lambda: proxy.accepted >= 2, timeout=20, message="the hanging reconnect")
        run = trigger(BindingFactory())  # its wake-up is swallowed: polling must find it
        wait_until(
            lambda: Run.objects.filter(pk=run.pk, status=Status.SUCCEEDED).exists(),
            timeout=25,
            message="the run claimed by polling while the reconnect hangs",
        )
        log = processes.output(proc)
        assert "LISTEN connection lost, reconnecting in" not in log, log[-3000:]
        assert proc.poll() is None
