"""Chains through real worker processes killed inside a settlement: a chain of three
(a -> b -> c) and a fan-in of two (c and d -> e, with a -> d), where the worker settling
an upstream is SIGKILLed while its settlement waits to create the downstream run. Every
downstream binding runs exactly once in the chain (docs/architecture.md, "Chains").

A gate is a connection of the test holding the downstream bindings' rows FOR UPDATE: the
settlement's insert of a downstream run needs FOR KEY SHARE on its binding (the foreign
key), so it waits there, after the upstream's own status is written in the same
transaction. The worker is killed and its waiting backend ended (a dead client's
statement would otherwise go on once the gate opens), the gate opens, and a new worker
recovers the upstream (lease 2 s) and settles it again."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from dispatch.core.states import Status
from dispatch.models import Attempt, BindingEdge, JobBinding, Run
from tests.support import factories
from tests.support.processes import Processes, test_database_url, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def gates() -> Iterator[dict[str, psycopg.Connection[Any]]]:
    opened: dict[str, psycopg.Connection[Any]] = {}
    yield opened
    for conn in opened.values():
        conn.close()


def _gate(bindings: list[JobBinding]) -> psycopg.Connection[Any]:
    conn = psycopg.connect(test_database_url(), autocommit=False)
    conn.execute(
        "SELECT 1 FROM dispatch_jobbinding WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
        [[b.pk for b in bindings]],
    )
    return conn


def _blocked_by(gate: psycopg.Connection[Any]) -> list[int]:
    with psycopg.connect(test_database_url(), autocommit=True) as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                [gate.info.backend_pid],
            )
        ]


def test_chain_and_fan_in__worker_killed_in_each_settlement_every_downstream_runs_once(
    processes: Processes, gates: dict[str, psycopg.Connection[Any]]
) -> None:
    job = factories.JobFactory(source_spec={"rows": 3, "batch": 3}, lease_seconds=2, max_attempts=5)
    a, b, c, d, e = (factories.BindingFactory(name=f"ch-{n}", job=job) for n in "abcde")
    for up, down in ((a, b), (b, c), (a, d), (c, e), (d, e)):
        BindingEdge.objects.create(upstream=up, downstream=down)
    # One gate per settling step: a's (creates b and d), b's (creates c), c's or d's
    # (creates e, the fan-in).
    gates["a"] = _gate([b, d])
    gates["b"] = _gate([c])
    gates["cd"] = _gate([e])
    root = factories.trigger(a)
    worker = processes.worker("--worker-id", "w0")
    killed = 0
    while gates:
        name, pids = wait_until(
            lambda: next(((n, p) for n, g in gates.items() if (p := _blocked_by(g))), None),
            timeout=60,
            message="a settlement waiting on a gate",
        )
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        killed += 1
        gate = gates.pop(name)
        with psycopg.connect(test_database_url(), autocommit=True) as conn:
            for pid in pids:
                conn.execute("SELECT pg_terminate_backend(%s)", [pid])
        gate.rollback()
        gate.close()
        worker = processes.worker("--worker-id", f"w{killed}")
    wait_until(
        lambda: Run.objects.filter(
            binding=e, chain_root_id=root.pk, status=Status.SUCCEEDED
        ).exists(),
        timeout=90,
        message="the fan-in's run succeeds",
    )
    assert killed == 3
    chain = Run.objects.filter(chain_root_id=root.pk)
    assert sorted(chain.values_list("binding__name", flat=True)) == [
        "ch-b", "ch-c", "ch-d", "ch-e"
    ]  # fmt: skip
    for run in [root, *chain]:
        run.refresh_from_db()
        assert run.status == Status.SUCCEEDED, run
        assert Attempt.objects.filter(run=run, status=Status.SUCCEEDED).count() == 1, run
    # Each kill left its upstream's attempt to recovery: three runs settled twice.
    retried = [r for r in [root, *chain] if Attempt.objects.filter(run=r).count() > 1]
    assert len(retried) == 3
    assert Run.objects.filter(binding__in=[b, c, d, e]).count() == 4
