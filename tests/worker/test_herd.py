"""No thundering herd: with 8 idle `runworker` processes, a trigger costs a bounded number
of claim transactions in all, not one or two per worker; and an idle worker at the
default settings commits at most 0.3 transactions a second.

Each notification is claimed by the worker that ranks first for that run (rendezvous
hashing over the live workers with a free slot); the second looks again only if the run
is still claimable a moment later. Counted from the workers' own counters and the
server's, never timed.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest
from django.db import connection
from django.db.models import Max, Min

from dispatch.core.states import Status
from dispatch.models import Attempt, Run, Worker
from dispatch.worker.coordinator import WorkerDispatchCoordinator
from tests.support.factories import BindingFactory, trigger
from tests.support.processes import Processes, wait_until, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WORKERS = 8
TRIGGERS = 50


def claim_calls() -> int:
    return sum(int(w.stats.get("claim_calls", 0)) for w in Worker.objects.all())


def test_herd__8_idle_workers_50_triggers_at_most_2_claim_transactions_each(
    processes: Processes,
) -> None:
    # Polling is a separate safety net (a lost notification costs one poll interval);
    # set long here so that only the wake-ups are counted.
    # Heartbeats at the default interval: each worker's view of its peers stays fresh
    # for three of them (the test settings' 1 s lets a loaded machine drop peers).
    env = worker_env(DISPATCH_IDLE_HEARTBEAT_SECONDS="10")
    procs = [
        processes.worker(
            "--poll-interval", "600", "--concurrency", "2", "--worker-id", f"h{i}", env=env
        )
        for i in range(WORKERS)
    ]
    wait_until(lambda: Worker.objects.count() == WORKERS, message="8 workers registered")
    # Every worker has heartbeated since the last one registered: each one's view of its
    # peers holds all eight.
    wait_until(
        lambda: (
            (b := Worker.objects.aggregate(first=Min("heartbeat_at"), last=Max("started_at")))
            and b["first"] > b["last"]
        ),
        timeout=30,
        message="a heartbeat of every worker after the last registration",
    )
    before = claim_calls()
    bindings = [BindingFactory(max_concurrency=10) for _ in range(5)]
    runs = [trigger(bindings[i % len(bindings)]).id for i in range(TRIGGERS)]
    wait_until(
        lambda: Run.objects.filter(id__in=runs, status=Status.SUCCEEDED).count() == TRIGGERS,
        timeout=60,
        message="every run to succeed",
    )
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(30) == 0, processes.output(proc)
    # The stop writes each worker's final counters.
    spent = claim_calls() - before
    assert spent <= 2 * TRIGGERS, (spent, [w.stats for w in Worker.objects.all()])
    assert Attempt.objects.filter(run_id__in=runs).count() == TRIGGERS  # each ran once
    # Most notifications did not become claims: a worker left it to the peer ranked
    # first, or had no free slot (both are how a herd is avoided); ranking was used.
    stats = [w.stats for w in Worker.objects.all()]
    left = sum(int(st.get("notifications_left_to_peers", 0)) for st in stats)
    busy = sum(int(st.get("notifications_without_slot", 0)) for st in stats)
    assert left > 0, stats
    assert left + busy >= (WORKERS - 2) * TRIGGERS, (left, busy, stats)


IDLE_WORKERS = 4
# Half a minute of the steady state: it ends before the workers' first periodic passes
# (+60 s), whose start-up transactions the server's counter receives only then.
IDLE_WINDOW_SECONDS = 30.0
IDLE_GOAL = 0.3  # transactions per second per idle worker, at the defaults
STATS_SETTLE_SECONDS = 11.0
# The documented defaults (docs/settings.md), over the test settings' short intervals.
DEFAULTS = {
    "DISPATCH_POLL_INTERVAL": "2.0",
    "DISPATCH_IDLE_HEARTBEAT_SECONDS": "10.0",
    "DISPATCH_RECOVERY_INTERVAL": "60.0",
    "DISPATCH_LISTEN_PROBE_INTERVAL": "60.0",
    "DISPATCH_RETENTION_INTERVAL": "300.0",
    "DISPATCH_HEALTH_INTERVAL": "60.0",
}


def server_transactions() -> int:
    """Transactions committed or rolled back in the test database, by the server's own
    counters (every session: the workers' main, heartbeat, maintenance and LISTEN
    connections alike)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def test_idle_workers__at_the_defaults_commit_at_most_0_3_transactions_a_second_each(
    processes: Processes,
) -> None:
    # What earlier tests left for autovacuum is done now, not counted in the window.
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    env = worker_env(**DEFAULTS)
    procs = [
        processes.worker("--concurrency", "4", "--worker-id", f"idle{i}", env=env)
        for i in range(IDLE_WORKERS)
    ]
    # Settled: each has heartbeated with its LISTEN connection confirmed by its probe
    # (start-up's transactions are behind it, and flushed to the statistics).
    wait_until(
        lambda: Worker.objects.filter(stats__listen_healthy=1).count() == IDLE_WORKERS,
        timeout=60,
        message="every idle worker listening, by its own heartbeat",
    )
    beats_before = dict(Worker.objects.values_list("id", "heartbeat_at"))
    # A backend publishes its counters at most once a second, a deferred batch within
    # 10 s: let this process's own polling above (and start-up's) be published first.
    time.sleep(STATS_SETTLE_SECONDS)
    before = server_transactions()
    time.sleep(IDLE_WINDOW_SECONDS)  # the window counted, not a wait for an event
    spent = server_transactions() - before - 1  # minus the first reading's own
    assert all(p.poll() is None for p in procs), [processes.output(p) for p in procs]
    beats_after = dict(Worker.objects.values_list("id", "heartbeat_at"))
    # The workers were alive and heartbeating throughout (an idle load of zero would
    # mean they were not).
    assert all(beats_after[w] > beats_before[w] for w in beats_before), (beats_before, beats_after)
    rate = spent / IDLE_WINDOW_SECONDS / IDLE_WORKERS
    print(f"idle load: {spent} transactions, {rate:.3f} per second per worker")
    assert rate <= IDLE_GOAL, (spent, rate, [w.stats for w in Worker.objects.all()])


@pytest.mark.django_db
def test_rank__every_worker_computes_the_same_first_choice_and_choices_spread() -> None:
    ids = [f"w{i}" for i in range(WORKERS)]
    workers = []
    for worker_id in ids:
        w = WorkerDispatchCoordinator(worker_id=worker_id)
        w._peers = tuple(ids)
        workers.append(w)
    firsts = []
    for _ in range(200):
        run_id = uuid.uuid4()
        places = sorted(w.rank(run_id) for w in workers)
        assert places == list(range(WORKERS))  # one first, one second, ... for each run
        firsts.append(next(w.worker_id for w in workers if w.rank(run_id) == 0))
    # No worker is everybody's first choice: the runs spread over the fleet.
    assert len(set(firsts)) == WORKERS
    assert max(firsts.count(i) for i in ids) < 200 // 2
