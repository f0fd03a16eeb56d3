"""No thundering herd: with 8 idle `runworker` processes, a trigger costs a bounded number
of claim transactions in all, not one or two per worker.

Each notification is claimed by the worker that ranks first for that run (rendezvous
hashing over the live workers with a free slot); the second looks again only if the run
is still claimable a moment later. Counted from the workers' own counters, never timed.
"""

from __future__ import annotations

import signal
import uuid

import pytest
from django.db.models import Max, Min

from dispatch.coordinator import WorkerDispatchCoordinator
from dispatch.models import Attempt, Run, Worker
from dispatch.states import Status
from tests.conftest import Processes, wait_until
from tests.factories import BindingFactory, trigger

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
    procs = [
        processes.worker("--poll-interval", "600", "--concurrency", "2", "--worker-id", f"h{i}")
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
    left = sum(int(w.stats.get("notifications_left_to_peers", 0)) for w in Worker.objects.all())
    assert left >= (WORKERS - 2) * TRIGGERS // 2, left


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
