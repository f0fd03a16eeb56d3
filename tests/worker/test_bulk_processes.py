"""A bulk operation in real worker processes: killed halfway (SIGKILL), resumed by
another worker after the last committed batch, every row's action applied once."""

from __future__ import annotations

import signal

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection

from dispatch.core.states import Origin, Status
from dispatch.models import BulkOperation, BulkStatus
from dispatch.ops import bulk
from tests.support.bulk import make_runs
from tests.support.factories import BindingFactory
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

RUNS = 10_000
BATCH = 500


def progress(pk: int) -> BulkOperation:
    return BulkOperation.objects.get(pk=pk)


def test_bulk_retry__survives_a_worker_killed_halfway_each_run_retried_once(
    processes: Processes,
) -> None:
    # A disabled binding: the retried runs wait (blocked), no worker executes them.
    binding = BindingFactory(enabled=False)
    make_runs(binding.pk, RUNS, Status.FAILED)
    user = User.objects.create_user("operator", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="retry_run"))
    op = bulk.request("run", "retry", {"status__exact": ["FAILED"]}, user)
    assert op.total == RUNS

    # The health scan's budget is half its interval: short turns beside the batches.
    # A long budget: batches back to back, not a second's pause after every five.
    env = worker_env(
        DISPATCH_BULK_BATCH=str(BATCH),
        DISPATCH_BULK_INTERVAL="0.2",
        DISPATCH_BULK_BUDGET="60",
        DISPATCH_HEALTH_INTERVAL="1",
    )
    first = processes.worker("--worker-id", "bulk-a", "--no-scheduler", env=env)
    wait_until(
        lambda: progress(op.pk).done >= RUNS // 2,
        timeout=600,
        message="the first worker half way through the operation",
    )
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    killed = progress(op.pk)
    # Killed mid-operation: what it committed stays, the batch in flight is gone whole.
    assert killed.status == BulkStatus.PENDING and RUNS // 2 <= killed.done < RUNS
    assert killed.done == BATCH * killed.batches

    processes.worker("--worker-id", "bulk-b", "--no-scheduler", env=env)
    wait_until(
        lambda: progress(op.pk).status == BulkStatus.DONE,
        timeout=600,
        message="the second worker finishing the operation",
    )
    done = progress(op.pk)
    assert (done.done, done.skipped) == (RUNS, 0)
    with connection.cursor() as cursor:
        # Per run: its operator attempts (exactly one each), over every run of the binding.
        cursor.execute(
            """
            SELECT n, count(*) FROM (
                SELECT r.id, count(a.id) FILTER (WHERE a.origin = %s) AS n
                FROM dispatch_run r LEFT JOIN dispatch_attempt a ON a.run_id = r.id
                WHERE r.binding_id = %s GROUP BY r.id) per_run
            GROUP BY n
            """,
            [Origin.OPERATOR, binding.pk],
        )
        assert dict(cursor.fetchall()) == {1: RUNS}
    entries = LogEntry.objects.filter(change_message__startswith=f"Retry (bulk operation {op.pk})")
    assert entries.count() == RUNS
    assert entries.values("object_id").distinct().count() == RUNS
