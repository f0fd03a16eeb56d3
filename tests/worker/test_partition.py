"""A worker behind a silent partition: its coordination connections (working and LISTEN)
go through a proxy the test owns, which for a while keeps every socket open and answers
nothing (tests/blackhole.py). The worker must notice within two leases (client-side
deadlines, dispatch.core.deadline), stop the execution whose lease it can no longer confirm,
leave the run to another worker's recovery, and rejoin after the heal."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Run, Worker
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of
from tests.support.processes import Processes, wait_until, worker_env
from tests.worker.test_worker import finished, slow_spec, start_worker
from tools.blackhole import BlackholeProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LEASE = 3  # seconds: the partition below lasts four leases


def proxied_url(port: int) -> str:
    s = connection.settings_dict
    user = s["USER"] or "postgres"
    return f"postgres://{user}@127.0.0.1:{port}/{s['NAME']}"


def test_partition__a_blackholed_worker_notices_stops_and_rejoins(processes: Processes):
    s = connection.settings_dict
    with BlackholeProxy(s["HOST"] or "127.0.0.1", int(s["PORT"] or 5432)) as proxy:
        url = proxied_url(proxy.port)
        binding = BindingFactory(
            job__lease_seconds=LEASE,
            job__max_attempts=3,
            job__backoff_seconds=0,
            job__backoff_max_seconds=0,
            job__source_spec=slow_spec(6),
        )
        cut = start_worker(
            processes,
            "--worker-id",
            "w-cut",
            env=worker_env(DATABASE_URL=url, DISPATCH_LISTEN_URL=url),
        )
        run = trigger(binding)
        wait_until(
            lambda: Attempt.objects.filter(run=run, worker_id="w-cut", status="RUNNING").exists(),
            message="the run claimed by the worker behind the proxy",
        )
        proxy.blackhole()
        cut_at = time.monotonic()

        # It notices within two leases: a call cut short by its deadline, and the execution
        # whose lease it cannot confirm stopped without recording anything.
        try:
            wait_until(
                lambda: (
                    "no answer from the database in time" in processes.output(cut)
                    and "attempt stopped without recording cause=lease_lost"
                    in processes.output(cut)
                ),
                timeout=2 * LEASE + 1,
                message="the blackholed worker to notice and stop its execution",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{processes.output(cut)[-3000:]}") from None
        assert time.monotonic() - cut_at <= 2 * LEASE + 1
        assert cut.poll() is None, processes.output(cut)

        # Another worker recovers the run at its lease's end and completes it.
        other = start_worker(processes, "--worker-id", "w-other")
        finished(run, Status.SUCCEEDED, timeout=30)
        first, second = attempts_of(run)[:2]
        assert (first.worker_id, first.reason) == ("w-cut", Reason.LEASE_EXPIRED)
        assert second.worker_id == "w-other"
        # Meanwhile the cut worker's row goes stale (the console's worker list shows its
        # heartbeat's age): nothing it sent during the partition arrived.
        stale = Worker.objects.get(pk="w-cut")
        assert Worker.objects.filter(
            pk="w-cut", heartbeat_at__lt=Now() - timedelta(seconds=LEASE)
        ).exists()
        other.send_signal(signal.SIGTERM)
        other.wait(30)

        # Four leases after the cut, heal; a new run must be claimed by the cut worker (the
        # only one left) within seconds.
        time.sleep(max(0.0, cut_at + 4 * LEASE - time.monotonic()))
        assert proxy.dropped_bytes > 0  # the partition really swallowed traffic
        proxy.heal()
        healed_at = time.monotonic()
        fresh = trigger(BindingFactory(job__lease_seconds=LEASE))
        done = finished(fresh, Status.SUCCEEDED, timeout=20)
        rejoined = time.monotonic() - healed_at
        assert Attempt.objects.get(run=done).worker_id == "w-cut"
        assert rejoined < 15, rejoined
        wait_until(
            lambda: Worker.objects.get(pk="w-cut").heartbeat_at > stale.heartbeat_at,
            timeout=10,
            message="the cut worker's heartbeat to resume",
        )
        assert Run.objects.get(pk=run.pk).status == Status.SUCCEEDED  # still once
