"""Workers behind a real PgBouncer in transaction-pooling mode: their working connections
(claims, settlements, heartbeats, recovery) go through it, their LISTEN connection goes
direct (DISPATCH_LISTEN_URL). The worker tests' own bodies run unchanged; the processes
get the pooled DATABASE_URL from their environment.

Runs whenever pgbouncer is installed (/usr/sbin/pgbouncer, `.ci/run` installs it);
skipped with a loud reason otherwise, and failed when the CI variable is set.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from dispatch.core.states import Status
from dispatch.models import Attempt, Worker
from dispatch.worker.listen import probe_report
from tests.support.factories import BindingFactory, trigger
from tests.support.gates import Holders
from tests.support.processes import Processes, test_database_url, wait_until
from tests.worker import test_fencing, test_worker
from tests.worker.test_fencing import dst_db  # noqa: F401 - fixture
from tests.worker.test_worker import finished, start_worker
from tools.pgbouncer import PgBouncer, find

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def pgbouncer(
    django_db_setup: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PgBouncer]:
    if find() is None:
        message = (
            "NO PGBOUNCER FOUND: the transaction-pooling tests did not run "
            "(install it with `apt-get install -y pgbouncer`)"
        )
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run them")
        pytest.skip(message)
    s = connection.settings_dict
    bouncer = PgBouncer(
        tmp_path_factory.mktemp("pgbouncer"),
        server_host=s["HOST"] or "127.0.0.1",
        server_port=int(s["PORT"] or 5432),
        pool_size=4,
    )
    bouncer.start()
    yield bouncer
    bouncer.stop()


def pooled_url(bouncer: PgBouncer) -> str:
    return bouncer.url(str(connection.settings_dict["NAME"]))


@pytest.fixture
def processes(tmp_path: Path, pgbouncer: PgBouncer) -> Iterator[Processes]:
    """Every process: working connections through PgBouncer, LISTEN direct."""
    procs = Processes(tmp_path)
    procs.env_overrides = {
        "DATABASE_URL": pooled_url(pgbouncer),
        "DISPATCH_LISTEN_URL": test_database_url(),
        "DISPATCH_LISTEN_PROBE_TIMEOUT": "5",
    }
    logins_before = pgbouncer.logins(str(connection.settings_dict["NAME"]))
    try:
        yield procs
    finally:
        procs.stop_all()
    # The workers' working connections really went through the pooler.
    assert pgbouncer.logins(str(connection.settings_dict["NAME"])) > logins_before


def test_pooled__a_notified_run_is_claimed_by_the_directed_path(processes: Processes) -> None:
    test_worker.test_worker__a_notified_run_is_claimed_by_the_directed_path(processes)
    report = probe_report(Worker.objects.get(pk="w-directed").stats)
    assert report.state == "ok" and report.received >= 1 and report.missed == 0


def test_pooled__kill_9_mid_run_is_retried_by_another_worker(processes: Processes) -> None:
    # Recovery (lease expiry) through the pooler, then the successor's claim.
    test_worker.test_worker__kill_9_mid_run_is_retried_by_another_worker(processes)


def test_pooled__sigterm_drains_releases_and_another_worker_takes_over(
    processes: Processes,
) -> None:
    test_worker.test_worker__sigterm_drains_releases_and_another_worker_takes_over_at_once(
        processes
    )


def test_pooled__exactly_once_when_killed_between_sink_commit_and_outcome(
    dst_db: test_fencing.ScratchDB,  # noqa: F811 - the fixture imported above
    processes: Processes,
    holders: Holders,
) -> None:
    test_fencing.test_exactly_once__worker_killed_between_sink_commit_and_outcome(
        dst_db, processes, holders
    )


def test_listen_url_at_the_pooler__reported_and_runs_complete_by_polling(
    processes: Processes, pgbouncer: PgBouncer
) -> None:
    processes.env_overrides.update(
        DISPATCH_LISTEN_URL=pooled_url(pgbouncer), DISPATCH_LISTEN_PROBE_TIMEOUT="1"
    )
    proc = start_worker(processes, "--poll-interval", "0.5", "--worker-id", "w-misrouted")
    wait_until(
        lambda: "transaction-pooling proxy" in processes.output(proc),
        message="the worker reporting its LISTEN URL",
    )
    assert "falling back to polling" in processes.output(proc).lower()
    runs = [trigger(BindingFactory()) for _ in range(3)]
    for run in runs:
        finished(run)
    assert {a.worker_id for a in Attempt.objects.filter(run__in=runs)} == {"w-misrouted"}
    assert set(Attempt.objects.filter(run__in=runs).values_list("status", flat=True)) == {
        Status.SUCCEEDED
    }
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    stats = Worker.objects.get(pk="w-misrouted").stats
    report = probe_report(stats)
    assert (report.state, report.polling_only, report.missed) == ("pooled", True, 1)
    assert stats.get("directed_hits", 0) == 0  # no wake-up ever reached it
    assert processes.output(proc).count("transaction-pooling proxy") == 1  # said once


def _backends(application_name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s AND pid <> pg_backend_pid()",
            [application_name],
        )
        return int(cursor.fetchone()[0])


def test_connection_budget__direct_worker_listen_main_heartbeat_and_one_per_busy_slot(
    tmp_path: Path,
) -> None:
    """The budget of docs/deployment.md, measured: a worker with 4 slots, 3 of them busy,
    straight to PostgreSQL holds 1 LISTEN + 1 claims/recovery + 1 heartbeat + 1 maintenance
    + 3 slots, and its schedule reconciler 1 working (its wake-ups come through the
    worker's LISTEN connection)."""
    direct = Processes(tmp_path)
    # Its own application name: PgBouncer's server connections carry the default one.
    direct.env_overrides = {
        "DATABASE_URL": test_database_url() + "?application_name=w-budget",
        # The maintenance loop ticks every fifth of this: its connection within 10 s.
        "DISPATCH_RETENTION_INTERVAL": "50",
    }
    try:
        # A slot's connection opens at its run's first database call (a generate -> null
        # run makes it only as it ends) and stays open: the count below is whole once the
        # runs settle, so a short run proves what a long one would.
        binding = BindingFactory(max_concurrency=3, job__source_spec=test_worker.slow_spec(4))
        start_worker(direct, "--concurrency", "4", "--worker-id", "w-budget")
        runs = [trigger(binding) for _ in range(3)]
        wait_until(
            lambda: Attempt.objects.filter(run__in=runs, status=Status.RUNNING).count() == 3,
            message="three slots busy",
        )
        # The heartbeat thread connects on its first beat (a claim wakes it at once), the
        # maintenance thread on its first tick, the reconciler on its first pass.
        wait_until(lambda: _backends("w-budget") == 7, message="7 working connections")
        assert _backends("dispatch-listen w-budget") == 1
        assert _backends("dispatch-schedules-listen") == 0
    finally:
        direct.stop_all()
        # A backend of the stopped worker ends when it next reads its socket; the
        # teardown's TRUNCATE once deadlocked with one still busy. End them first.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE %s"
                " AND pid <> pg_backend_pid()",
                ["%w-budget%"],
            )
        wait_until(
            lambda: _backends("w-budget") + _backends("dispatch-listen w-budget") == 0,
            message="the stopped worker's backends gone",
        )


class SilencingProxy:
    """A local TCP proxy to PostgreSQL whose established connections can be silenced:
    bytes from the server are then dropped, the socket stays open (a LISTEN connection
    that is broken without an error). New connections are forwarded normally."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silenced: set[socket.socket] = set()
        self.live: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.live.append(client)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, client: socket.socket | None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if client is None or client not in self.silenced:
                    dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def silence_all(self) -> None:
        self.silenced.update(self.live)

    def close(self) -> None:
        self.listener.close()


def test_listen_probe__a_silently_broken_listen_connection_is_reported_and_replaced(
    tmp_path: Path,
) -> None:
    s = connection.settings_dict
    proxy = SilencingProxy(s["HOST"] or "127.0.0.1", int(s["PORT"] or 5432))
    procs = Processes(tmp_path)
    procs.env_overrides = {
        "DISPATCH_LISTEN_URL": f"postgres://{s['USER']}@127.0.0.1:{proxy.port}/{s['NAME']}",
        "DISPATCH_LISTEN_PROBE_INTERVAL": "1",
        "DISPATCH_LISTEN_PROBE_TIMEOUT": "1",
    }
    try:
        proc = start_worker(procs, "--poll-interval", "60", "--worker-id", "w-silenced")
        wait_until(
            lambda: (
                "LISTEN self-probe answered" in procs.output(proc)
                or probe_report(Worker.objects.get(pk="w-silenced").stats).received >= 1
            ),
            message="a first answered probe",
        )
        proxy.silence_all()
        wait_until(
            lambda: "LISTEN wake-ups stopped arriving" in procs.output(proc),
            message="the probe reporting the silent connection",
        )
        wait_until(
            lambda: procs.output(proc).count("listening worker=") >= 2, message="re-listening"
        )
        # The new LISTEN connection delivers again: a wake-up is claimed by the directed path.
        run = trigger(BindingFactory())
        finished(run, timeout=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        stats = Worker.objects.get(pk="w-silenced").stats
        report = probe_report(stats)
        assert report.missed >= 1 and report.state == "ok"
        assert stats["directed_hits"] == 1
    finally:
        procs.stop_all()
        proxy.close()
