"""Chains at the settlement (docs/architecture.md, "Chains"): an edge fires in the
transaction that ends its upstream run, exactly once whatever repeats the settlement, a
fan-in waits (WAITING_UPSTREAM) until its last upstream of the chain ends, and cycles
are refused by the database as well as at save."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction

from dispatch import services
from dispatch.core.states import BlockedReason, ChainOn, Status, Trigger
from dispatch.models import Attempt, BindingEdge, JobBinding, Run
from dispatch.worker import claims
from tests.support import factories
from tests.support.helpers import claim_one, expire, raw_connection
from tests.support.processes import test_database_url, wait_until

pytestmark = pytest.mark.django_db


def edge(up: JobBinding, down: JobBinding, on: str = ChainOn.SUCCESS) -> BindingEdge:
    return BindingEdge.objects.create(upstream=up, downstream=down, on=on)


def run_of(binding: JobBinding, root: Run) -> Run | None:
    return Run.objects.filter(binding=binding, chain_root_id=root.pk).first()


def finish(run: Run, outcome: str = "SUCCEEDED", worker: str = "w1") -> str | None:
    """Claim the run (directed) and settle it with `outcome`."""
    (c,) = claims.claim(worker, run_id=run.pk, limit=1, generic=False)
    return claims.settle(c.attempt_id, c.lease_token, outcome)


def test_settle__fires_the_edge_in_its_transaction_and_the_chain_carries_the_root() -> None:
    a, b, c = (factories.BindingFactory(name=n) for n in ("a", "b", "c"))
    edge(a, b)
    edge(b, c)
    root = factories.trigger(a, trigger=Trigger.API, requested_by="alice")
    # Nothing downstream before the upstream ends.
    (claimed,) = claims.claim("w1", run_id=root.pk, limit=1, generic=False)
    assert not Run.objects.filter(chain_root_id=root.pk).exists()
    claims.settle(claimed.attempt_id, claimed.lease_token, "SUCCEEDED")
    down = run_of(b, root)
    assert down is not None and down.status == Status.PENDING
    assert (down.trigger, down.requested_by) == (Trigger.API, "alice")
    (att,) = Attempt.objects.filter(run=down)
    assert att.blocked_reason is None and att.status == Status.PENDING
    assert finish(down) == Status.SUCCEEDED
    last = run_of(c, root)
    assert last is not None and last.chain_root == root.pk
    assert finish(last) == Status.SUCCEEDED
    assert Run.objects.filter(chain_root_id=root.pk).count() == 2


def test_settle__repeated_or_recovered_fires_once() -> None:
    a, b = factories.BindingFactory(), factories.BindingFactory()
    edge(a, b)
    root = factories.trigger(a)
    (c,) = claims.claim("w1", run_id=root.pk, limit=1, generic=False)
    assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED") == Status.SUCCEEDED
    # The same settlement again (an answer lost, a retry of the call): nothing changes.
    assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED") is None
    assert Run.objects.filter(binding=b).count() == 1
    # An expired lease: recovery settles it, the retry succeeds, the edge fires once.
    other = factories.trigger(a)
    (c2,) = claims.claim("w2", run_id=other.pk, limit=1, generic=False)
    expire(Attempt.objects.get(pk=c2.attempt_id))
    (rec,) = claims.recover()
    assert rec.outcome == Status.RETRY_SCHEDULED
    assert not Run.objects.filter(chain_root_id=other.pk).exists()
    assert claims.settle(c2.attempt_id, c2.lease_token, "SUCCEEDED") is None  # too late
    assert finish(other) == Status.SUCCEEDED
    assert claims.recover() == []
    assert Run.objects.filter(binding=b).count() == 2
    assert Run.objects.filter(binding=b, chain_root_id=other.pk).count() == 1


def test_settle__recovery_that_fails_the_run_fires_completion_not_success() -> None:
    a, on_success, on_completion = (factories.BindingFactory() for _ in range(3))
    a.job.max_attempts = 1
    a.job.save()
    edge(a, on_success, ChainOn.SUCCESS)
    edge(a, on_completion, ChainOn.COMPLETION)
    root = factories.trigger(a)
    c = claim_one("w1")
    expire(Attempt.objects.get(pk=c.attempt_id))
    (rec,) = claims.recover()
    assert rec.outcome == Status.FAILED
    assert run_of(on_success, root) is None
    fired = run_of(on_completion, root)
    assert fired is not None and fired.status == Status.PENDING


@pytest.mark.parametrize("outcome", ["PERMANENT", "CANCELLED"])
def test_settle__completion_fires_on_failed_and_cancelled_success_does_not(outcome: str) -> None:
    a, s, d = (factories.BindingFactory() for _ in range(3))
    edge(a, s, ChainOn.SUCCESS)
    edge(a, d, ChainOn.COMPLETION)
    root = factories.trigger(a)
    assert finish(root, outcome) in (Status.FAILED, Status.CANCELLED)
    assert run_of(s, root) is None
    assert run_of(d, root) is not None
    # A retry of the failed upstream that succeeds fires the success edge then, once; the
    # completion edge already fired for this run and does not fire again.
    services.retry_run(root)
    assert finish(root) == Status.SUCCEEDED
    assert run_of(s, root) is not None
    assert Run.objects.filter(binding=d).count() == 1


def test_cancel__of_a_pending_run_fires_its_completion_edges() -> None:
    a, d = factories.BindingFactory(), factories.BindingFactory()
    edge(a, d, ChainOn.COMPLETION)
    root = factories.trigger(a)
    assert services.cancel_run(root) == services.Outcome.CANCELLED
    assert run_of(d, root) is not None


def diamond() -> tuple[JobBinding, JobBinding, JobBinding, JobBinding]:
    """a -> b -> d, a -> c -> d: d a fan-in of two."""
    a, b, c, d = (factories.BindingFactory(name=f"fan-{n}") for n in "abcd")
    edge(a, b)
    edge(a, c)
    edge(b, d)
    edge(c, d)
    return a, b, c, d


def test_fan_in__waits_for_its_last_upstream_marked_waiting_upstream() -> None:
    a, b, c, d = diamond()
    root = factories.trigger(a)
    finish(root)
    rb, rc = run_of(b, root), run_of(c, root)
    assert rb is not None and rc is not None and run_of(d, root) is None
    finish(rb)
    rd = run_of(d, root)
    assert rd is not None
    (att,) = Attempt.objects.filter(run=rd)
    assert att.blocked_reason == BlockedReason.WAITING_UPSTREAM
    # Not claimable, even directed.
    assert claims.claim("w1", run_id=rd.pk, limit=1, generic=False) == []
    # Disabling and enabling the binding keeps the mark (only the chain clears it).
    JobBinding.objects.filter(pk=d.pk).update(enabled=False)
    JobBinding.objects.filter(pk=d.pk).update(enabled=True)
    att.refresh_from_db()
    assert att.blocked_reason == BlockedReason.WAITING_UPSTREAM
    with connection.cursor() as cursor:
        cursor.execute("SELECT dispatch_refresh_blocked_v4()")
    att.refresh_from_db()
    assert att.blocked_reason == BlockedReason.WAITING_UPSTREAM
    finish(rc)
    att.refresh_from_db()
    assert att.blocked_reason is None
    assert finish(rd) == Status.SUCCEEDED
    assert Run.objects.filter(binding=d).count() == 1


def test_fan_in__a_failed_success_upstream_keeps_it_waiting_until_cancelled() -> None:
    a, b, c, d = diamond()
    root = factories.trigger(a)
    finish(root)
    finish(run_of(b, root))  # type: ignore[arg-type]
    finish(run_of(c, root), "PERMANENT")  # type: ignore[arg-type]
    rd = run_of(d, root)
    assert rd is not None
    assert Attempt.objects.get(run=rd).blocked_reason == BlockedReason.WAITING_UPSTREAM
    assert services.cancel_run(rd) == services.Outcome.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_fan_in__two_upstreams_ending_at_once_make_it_eligible_once() -> None:
    a, b, c, d = diamond()
    root = factories.trigger(a)
    finish(root)
    rb, rc = run_of(b, root), run_of(c, root)
    assert rb is not None and rc is not None
    cb = claims.claim("w1", run_id=rb.pk, limit=1, generic=False)[0]
    cc = claims.claim("w2", run_id=rc.pk, limit=1, generic=False)[0]
    # Both settlements in flight together: the first holds its transaction open while
    # the second runs; the second waits for the downstream run's key or lock and then
    # sees the first's committed status.
    first = raw_connection()
    seen = psycopg.connect(test_database_url(), autocommit=True)
    first.execute(
        "SELECT dispatch_settle_v3(%s, %s, 'SUCCEEDED', NULL, NULL, NULL, NULL, NULL, 0, 200)",
        [cb.attempt_id, cb.lease_token],
    )
    done = threading.Event()
    result: list[Any] = []

    def second() -> None:
        with psycopg.connect(test_database_url(), autocommit=True) as conn:
            result.append(
                conn.execute(
                    "SELECT dispatch_settle_v3(%s, %s, 'SUCCEEDED', NULL, NULL, NULL, NULL, NULL, 0, 200)",
                    [cc.attempt_id, cc.lease_token],
                ).fetchone()
            )
        done.set()

    def runs_of_d() -> Any:
        return seen.execute(
            "SELECT count(*) FROM dispatch_run WHERE binding_id = %s", [d.pk]
        ).fetchone()

    # The downstream run is in the first settlement's transaction: not seen before it
    # commits.
    assert runs_of_d() == (0,)
    t = threading.Thread(target=second)
    t.start()
    # The second waits for the first's commit: its backend shows a lock wait.
    wait_until(
        lambda: (
            seen.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s",
                ["%dispatch_settle_v3%"],
            ).fetchone()[0]
            == 1
        ),
        timeout=30,
    )
    assert not done.is_set()
    first.commit()
    first.close()
    t.join(30)
    assert runs_of_d() == (1,)
    seen.close()
    assert result == [("SUCCEEDED",)]
    rd = run_of(d, root)
    assert rd is not None
    (att,) = Attempt.objects.filter(run=rd)
    assert att.blocked_reason is None and att.status == Status.PENDING


def test_cycle__refused_by_the_database_naming_it() -> None:
    a, b, c = (factories.BindingFactory(name=n) for n in ("cy-a", "cy-b", "cy-c"))
    edge(a, b)
    edge(b, c)
    cycle = "cycle: cy-c -> cy-a -> cy-b -> cy-c"
    with pytest.raises(IntegrityError, match=cycle), transaction.atomic():
        edge(c, a)
    with pytest.raises(IntegrityError), transaction.atomic():
        edge(a, a)


def test_cycle__refused_by_set_upstreams_naming_it() -> None:
    a, b, c = (factories.BindingFactory(name=n) for n in ("sv-a", "sv-b", "sv-c"))
    services.set_upstreams(b, [(a, ChainOn.SUCCESS)])
    services.set_upstreams(c, [(b, ChainOn.COMPLETION)])
    with pytest.raises(services.ChainCycle, match="sv-a -> sv-b -> sv-c -> sv-a"):
        services.set_upstreams(a, [(c, ChainOn.SUCCESS)])
    assert not BindingEdge.objects.filter(downstream=a).exists()
    services.set_upstreams(c, [(a, ChainOn.SUCCESS)])
    assert list(BindingEdge.objects.filter(downstream=c).values_list("upstream__name", "on")) == [
        ("sv-a", "SUCCESS")
    ]


def test_chain_cycle__finds_the_path() -> None:
    assert services.chain_cycle([("a", "b"), ("b", "c")]) is None
    assert services.chain_cycle([("a", "b"), ("b", "c"), ("c", "a")]) == ["a", "b", "c", "a"]
    assert services.chain_cycle([("x", "y"), ("a", "b"), ("b", "a")]) == ["a", "b", "a"]
