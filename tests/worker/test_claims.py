"""The claim: directed and generic paths, lock order, snapshots, blocked work."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from django.db import connection

from dispatch.core.states import BlockedReason, Status
from dispatch.models import Attempt, Datasource, JobBinding, Run
from dispatch.security import crypto
from dispatch.worker import claims
from tests.support.factories import BindingFactory, DatasourceFactory, SinkFactory, trigger
from tests.support.helpers import attempts_of, claim_one, in_threads, raw_connection
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def test_claim__directed_takes_the_notified_run_not_the_oldest():
    binding = BindingFactory(max_concurrency=5)
    oldest = trigger(binding)
    target = trigger(binding)
    got = claim_one(run_id=target.id, limit=1)
    assert got.run_id == target.id and got.directed
    assert Run.objects.get(pk=oldest.pk).status == Status.PENDING
    assert Run.objects.get(pk=target.pk).status == Status.RUNNING


def test_claim__directed_miss_falls_back_to_generic_in_the_same_call():
    binding = BindingFactory(max_concurrency=5)
    other = trigger(binding)
    got = claim_one(run_id=uuid.uuid4(), limit=1)  # an id that names no run
    assert got.run_id == other.id and not got.directed


def test_claim__skips_locked_attempt():
    binding = BindingFactory(max_concurrency=5)
    locked_run = trigger(binding)
    free_run = trigger(binding)
    with raw_connection() as conn:
        conn.execute("SELECT 1 FROM dispatch_run WHERE id = %s FOR UPDATE", [locked_run.id])
        got = claims.claim("w1", run_id=locked_run.id, limit=2)
    assert [c.run_id for c in got] == [free_run.id]
    assert not got[0].directed


def test_claim__writes_lease_snapshot_and_versions_in_database_time():
    binding = BindingFactory(job__lease_seconds=7)
    run = trigger(binding)
    got = claim_one(limit=1)
    a = Attempt.objects.get(pk=got.attempt_id)
    assert a.status == Status.RUNNING and a.worker_id == "w1"
    assert a.lease_token == got.lease_token
    assert a.claimed_at == a.datasources_resolved_at == a.heartbeat_at
    assert (a.lease_until - a.claimed_at).total_seconds() == 7
    assert (a.source_id, a.sink_id) == (binding.source_id, binding.sink_id)
    assert (a.source_version, a.sink_version) == (1, 1)
    assert (
        crypto.decrypt_config(a.source_snapshot, expected_id=binding.source_id, expected_version=1)
        == {}
    )
    assert a.source_redacted == {} and a.sink_redacted == {}
    assert Run.objects.get(pk=run.pk).status == Status.RUNNING


def test_claim__tokens_increase_across_claims():
    binding = BindingFactory(max_concurrency=10)
    for _ in range(5):
        trigger(binding)
    tokens = [c.lease_token for c in claims.claim("w1", limit=5)]
    assert tokens == sorted(tokens) and len(set(tokens)) == 5


def test_claim__respects_max_concurrency():
    binding = BindingFactory(max_concurrency=2)
    for _ in range(4):
        trigger(binding)
    assert len(claims.claim("w1", limit=4)) == 2
    assert claims.claim("w2", limit=4) == []
    assert Attempt.objects.filter(status=Status.PENDING).count() == 2


def test_claim__not_yet_available_is_not_picked():
    run = trigger(BindingFactory())
    Attempt.objects.filter(run=run).update(
        available_at=Run.objects.get(pk=run.pk).created_at.replace(year=2999)
    )
    assert claims.claim("w1", run_id=run.id, limit=1) == []


def test_claim__snapshot_is_immutable_and_next_attempt_sees_the_edit():
    source = DatasourceFactory(kind="generate", config={})
    binding = BindingFactory(source=source, job__max_attempts=3)
    run = trigger(binding)
    first = claim_one(limit=1)
    source.refresh_from_db()
    source.name = "renamed"
    source.config = {}  # unchanged config: no version bump
    source.save()
    assert Datasource.objects.get(pk=source.pk).version == 1
    # A config change bumps the version; the running attempt keeps its snapshot.
    edited = Datasource.objects.get(pk=source.pk)
    edited.config = {"x": 1}
    edited.save()
    assert Datasource.objects.get(pk=source.pk).version == 2
    a1 = Attempt.objects.get(pk=first.attempt_id)
    assert a1.source_version == 1
    assert (
        crypto.decrypt_config(a1.source_snapshot, expected_id=source.pk, expected_version=1) == {}
    )
    # The attempt fails; its successor's claim takes the new version.
    assert (
        claims.settle(first.attempt_id, first.lease_token, "ERROR", reason="ERROR", error="boom")
        == "RETRY_SCHEDULED"
    )
    second = claim_one(limit=1)
    assert second.run_id == run.id and second.source_version == 2
    a2 = Attempt.objects.get(pk=second.attempt_id)
    assert crypto.decrypt_config(a2.source_snapshot, expected_id=source.pk, expected_version=2) == {
        "x": 1
    }


def test_claim__binding_disabled_blocks_new_claims_and_leaves_running_attempt():
    binding = BindingFactory(max_concurrency=5)
    running_run = trigger(binding)
    running = claim_one(limit=1)
    waiting = trigger(binding)
    JobBinding.objects.filter(pk=binding.pk).update(enabled=False)
    assert claims.claim("w2", run_id=waiting.id, limit=5) == []
    a = Attempt.objects.get(pk=running.attempt_id)
    assert a.status == Status.RUNNING and a.lease_token == running.lease_token
    assert claims.settle(running.attempt_id, running.lease_token, "SUCCEEDED") == "SUCCEEDED"
    assert Run.objects.get(pk=running_run.pk).status == Status.SUCCEEDED
    claims.refresh_blocked()
    assert Attempt.objects.get(run=waiting).blocked_reason == BlockedReason.BINDING_DISABLED


@pytest.mark.parametrize(
    ("disable", "reason"),
    [
        ("job", BlockedReason.JOB_DISABLED),
        ("source", BlockedReason.SOURCE_DISABLED),
        ("sink", BlockedReason.SINK_DISABLED),
    ],
)
def test_claim__disabled_job_or_datasource_blocks_with_reason(disable, reason):
    binding = BindingFactory()
    run = trigger(binding)
    target = getattr(binding, disable)
    # The mark is written by the disabling statement itself (a trigger), whatever wrote
    # it: here a bulk update behind the model's back. The refresh finds nothing stale.
    type(target).objects.filter(pk=target.pk).update(enabled=False)
    assert Attempt.objects.get(run=run).blocked_reason == reason
    assert claims.claim("w1", limit=1) == []
    assert claims.refresh_blocked() == 0
    type(target).objects.filter(pk=target.pk).update(enabled=True)
    assert Attempt.objects.get(run=run).blocked_reason is None
    assert claim_one(limit=1).run_id == run.id


def test_refresh_blocked__repairs_a_stale_mark_either_way():
    enabled, disabled = BindingFactory(), BindingFactory()
    waiting, blocked = trigger(enabled), trigger(disabled)
    JobBinding.objects.filter(pk=disabled.pk).update(enabled=False)
    # Marks as a race between two enables (or an enable and a claim) can leave them.
    Attempt.objects.filter(run=waiting).update(blocked_reason=BlockedReason.JOB_DISABLED)
    Attempt.objects.filter(run=blocked).update(blocked_reason=None)
    assert claims.claim("w1", limit=5) == []  # the stale mark hides the eligible one
    assert claims.refresh_blocked() == 2
    assert Attempt.objects.get(run=waiting).blocked_reason is None
    assert Attempt.objects.get(run=blocked).blocked_reason == BlockedReason.BINDING_DISABLED
    assert [c.run_id for c in claims.claim("w1", limit=5)] == [waiting.id]


def test_claim__blocked_work_never_starves_other_work():
    blocked = BindingFactory(enabled=False)
    for _ in range(30):
        trigger(blocked)  # older than the eligible work
    eligible = BindingFactory(max_concurrency=10)
    wanted = {trigger(eligible).id for _ in range(3)}
    assert {c.run_id for c in claims.claim("w1", limit=10)} == wanted
    assert Attempt.objects.filter(blocked_reason=BlockedReason.BINDING_DISABLED).count() == 30


def test_claim__opposite_roles_claimed_concurrently_never_deadlock():
    """Bindings X->Y and Y->X share datasources in opposite roles; many concurrent claims
    (each taking binding and datasource locks) and completions finish without error."""
    x = DatasourceFactory(kind="generate")
    y = DatasourceFactory(kind="generate")
    # A generate datasource cannot be a sink; the claim does not care about kinds, so for
    # this test the sink role is played by generate rows too.
    forward = BindingFactory(source=x, sink=SinkFactory(), max_concurrency=50)
    backward = BindingFactory(source=y, sink=SinkFactory(), max_concurrency=50)
    JobBinding.objects.filter(pk=forward.pk).update(sink=y)
    JobBinding.objects.filter(pk=backward.pk).update(sink=x)
    runs = [trigger(forward if i % 2 else backward).id for i in range(120)]

    def work(i: int) -> int:
        done = 0
        while True:
            got = claims.claim(f"w{i}", limit=3)
            if not got:
                return done
            for c in got:
                assert claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED") == "SUCCEEDED"
                done += 1

    done = in_threads(6, work)
    assert sum(done) == 120
    assert set(Run.objects.filter(pk__in=runs).values_list("status", flat=True)) == {
        Status.SUCCEEDED
    }


PROBE = """
import json, sys, django
django.setup()
from django.db import connection
from dispatch.worker import claims
with connection.cursor() as c:
    c.execute("SELECT pg_advisory_lock_shared(4242)")  # the start gun, held by the test
    c.execute("SELECT pg_advisory_unlock_shared(4242)")
got = claims.claim(sys.argv[1], run_id=sys.argv[2], limit=1)
print(json.dumps([[str(g.run_id), g.directed] for g in got]))
"""


def test_claim__two_processes_race_the_directed_claim_exactly_one_wins():
    binding = BindingFactory(max_concurrency=5)
    target = trigger(binding)
    other = trigger(binding)
    with raw_connection() as gate:
        gate.execute("SELECT pg_advisory_lock(4242)")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", PROBE, f"racer-{i}", str(target.id)],
                cwd=ROOT,
                env=worker_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        # Both probes are connected and waiting at the gate before it opens.
        from tests.support.processes import wait_until

        wait_until(
            lambda: (
                gate.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()[0]
                == 2
            ),
            message="both racers at the gate",
        )
        gate.commit()
        gate.execute("SELECT pg_advisory_unlock(4242)")
        outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    results = [tuple(o[0]) for o in outputs]
    assert sorted(results, key=lambda r: r[1]) == [(str(other.id), False), (str(target.id), True)]
    assert [a.status for a in attempts_of(target)] == [Status.RUNNING]
    assert [a.status for a in attempts_of(other)] == [Status.RUNNING]


def test_claim__does_not_wait_for_an_open_transaction_that_created_a_run_of_the_binding():
    """Inserting a run takes FOR KEY SHARE on its binding (the foreign key) until commit;
    the claim's binding lock must not queue behind it."""

    binding = BindingFactory(max_concurrency=5)
    due = trigger(binding)
    with raw_connection() as other:
        other.execute("SELECT 1 FROM dispatch_jobbinding WHERE id = %s FOR KEY SHARE", [binding.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")
        try:
            got = claims.claim("w1", limit=1)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    assert [c.run_id for c in got] == [due.id]


def test_datasource__saving_other_fields_never_writes_back_a_stale_config():
    source = DatasourceFactory(config={"v": 1})
    stale = Datasource.objects.get(pk=source.pk)
    fresh = Datasource.objects.get(pk=source.pk)
    fresh.config = {"v": 2}
    fresh.save()
    stale.name = "renamed-elsewhere"
    stale.save()  # loaded before the edit: must not restore version 1's ciphertext
    current = Datasource.objects.get(pk=source.pk)
    assert (current.name, current.version, current.config) == ("renamed-elsewhere", 2, {"v": 2})


def test_claim__work_unblocked_after_a_disable_runs_in_its_order():
    binding = BindingFactory(max_concurrency=10)
    first = [trigger(binding).id for _ in range(3)]
    JobBinding.objects.filter(pk=binding.pk).update(enabled=False)
    assert set(
        Attempt.objects.filter(run_id__in=first).values_list("blocked_reason", flat=True)
    ) == {BlockedReason.BINDING_DISABLED}
    later = trigger(BindingFactory(max_concurrency=10)).id  # newer than the blocked ones
    assert [c.run_id for c in claims.claim("w1", limit=10)] == [later]
    JobBinding.objects.filter(pk=binding.pk).update(enabled=True)
    assert [c.run_id for c in claims.claim("w1", limit=10)] == first


# --- capacity kept on the attempt row (sql/functions/capacity.sql) ------------------------
def marks(*runs: Run) -> list[str | None]:
    return [Attempt.objects.get(run=r, status=Status.PENDING).blocked_reason for r in runs]


CAP = BlockedReason.BINDING_AT_CAPACITY


def test_capacity__a_filled_binding_holds_its_queue_and_a_finished_run_lets_the_oldest_go():
    binding = BindingFactory(max_concurrency=1)
    first, second, third = (trigger(binding) for _ in range(3))
    assert marks(first, second, third) == [None, None, None]  # queued while it had room
    got = claim_one(limit=5)
    assert got.run_id == first.id
    # The claim that filled the binding marked the rest: no later pick walks them.
    assert marks(second, third) == [CAP, CAP]
    late = trigger(binding)
    assert marks(late) == [CAP]  # queued while full: marked on insert
    assert claims.claim("w2", limit=5) == []
    assert claims.settle(got.attempt_id, got.lease_token, "SUCCEEDED") == Status.SUCCEEDED
    # The room the run made lets exactly the oldest one go.
    assert marks(second, third, late) == [None, CAP, CAP]
    assert [c.run_id for c in claims.claim("w2", limit=5)] == [second.id]
    assert marks(third, late) == [CAP, CAP]


def test_capacity__a_changed_max_concurrency_releases_or_holds_in_order():
    binding = BindingFactory(max_concurrency=1)
    runs = [trigger(binding) for _ in range(4)]
    claim_one(limit=1)
    assert marks(*runs[1:]) == [CAP, CAP, CAP]
    JobBinding.objects.filter(pk=binding.pk).update(max_concurrency=3)
    assert marks(*runs[1:]) == [None, None, CAP]  # room for two more: the oldest two
    JobBinding.objects.filter(pk=binding.pk).update(max_concurrency=1)
    assert marks(*runs[1:]) == [CAP, CAP, CAP]  # full again: held


def test_capacity__an_expired_lease_makes_room_for_the_oldest_waiting_run_not_its_retry():
    from tests.support.helpers import expire

    binding = BindingFactory(max_concurrency=1, job__max_attempts=3)
    running, waiting = trigger(binding), trigger(binding)
    got = claim_one(limit=1)
    assert got.run_id == running.id and marks(waiting) == [CAP]
    expire(Attempt.objects.get(pk=got.attempt_id))
    [settled] = claims.recover()
    assert settled.outcome == Status.RETRY_SCHEDULED
    # The retry was queued behind the waiting run, which is older: the room goes to it.
    assert marks(waiting, running) == [None, CAP]
    assert [c.run_id for c in claims.claim("w2", limit=5)] == [waiting.id]


def test_capacity__enabling_a_full_binding_turns_its_disabled_marks_into_capacity_marks():
    binding = BindingFactory(max_concurrency=2)
    JobBinding.objects.filter(pk=binding.pk).update(enabled=False)
    runs = [trigger(binding) for _ in range(4)]
    assert set(marks(*runs)) == {BlockedReason.BINDING_DISABLED}
    JobBinding.objects.filter(pk=binding.pk).update(enabled=True)
    assert marks(*runs) == [None, None, CAP, CAP]  # its room, oldest first
    assert [c.run_id for c in claims.claim("w1", limit=5)] == [r.id for r in runs[:2]]
    assert claims.refresh_blocked() == 0  # nothing stale


def test_capacity__the_refresh_repairs_a_capacity_mark_left_stale_either_way():
    binding = BindingFactory(max_concurrency=1)
    held, free = trigger(binding), trigger(BindingFactory(max_concurrency=1))
    claim_one(run_id=trigger(binding).id, limit=1, generic=False)  # fills `binding`
    Attempt.objects.filter(run=held).update(blocked_reason=None)  # a straggler
    Attempt.objects.filter(run=free).update(blocked_reason=CAP)  # a mark nobody let go
    assert claims.refresh_blocked() == 2
    assert marks(held, free) == [CAP, None]


# --- a settlement and the next claim in one call (dispatch_settle_claim_v6) ---------------
def test_settle_claim__settles_and_claims_the_next_in_one_transaction():
    binding = BindingFactory(max_concurrency=1)
    first, second = trigger(binding), trigger(binding)
    got = claim_one(limit=1)
    assert marks(second) == [CAP]  # the binding is full
    status, more = claims.settle_and_claim(
        got.attempt_id, got.lease_token, "SUCCEEDED", worker_id="w1", limit=1
    )
    # The run that finished made the room the same call's claim took.
    assert status == Status.SUCCEEDED
    assert [c.run_id for c in more] == [second.id]
    assert Run.objects.get(pk=first.pk).status == Status.SUCCEEDED
    assert Run.objects.get(pk=second.pk).status == Status.RUNNING
    assert more[0].source_snapshot and more[0].lease_token > got.lease_token


def test_settle_claim__nothing_to_claim_and_a_lost_lease():
    binding = BindingFactory(max_concurrency=2)
    trigger(binding)
    got = claim_one(limit=1)
    assert claims.settle_and_claim(
        got.attempt_id, got.lease_token + 1, "SUCCEEDED", worker_id="w1", limit=1
    ) == (None, [])  # a wrong token settles nothing and claims nothing
    assert claims.settle_and_claim(
        got.attempt_id, got.lease_token, "SUCCEEDED", worker_id="w1", limit=1
    ) == (Status.SUCCEEDED, [])


def test_settle_claim__a_claim_that_raises_leaves_the_settlement_standing():
    binding = BindingFactory(max_concurrency=5)
    first, second = trigger(binding), trigger(binding)
    got = claim_one(limit=1)
    with raw_connection() as conn:
        # A claim by worker "boom" raises inside the call (a stand-in for any failure of
        # the claim: a constraint, a full disk); the settlement must commit alone.
        conn.execute(
            """
            CREATE FUNCTION dispatch_test_boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'boom'; END $$;
            CREATE TRIGGER boom BEFORE UPDATE ON dispatch_attempt FOR EACH ROW
              WHEN (NEW.worker_id = 'boom') EXECUTE FUNCTION dispatch_test_boom();
            """
        )
        conn.commit()
    try:
        status, more = claims.settle_and_claim(
            got.attempt_id, got.lease_token, "SUCCEEDED", worker_id="boom", limit=1
        )
    finally:
        with raw_connection() as conn:
            conn.execute(
                "DROP TRIGGER boom ON dispatch_attempt; DROP FUNCTION dispatch_test_boom()"
            )
            conn.commit()
    assert (status, more) == (Status.SUCCEEDED, [])
    assert Run.objects.get(pk=first.pk).status == Status.SUCCEEDED
    assert Run.objects.get(pk=second.pk).status == Status.PENDING
    assert Attempt.objects.get(run=second).worker_id is None


def test_functions__every_one_that_turns_sorts_off_turns_jit_off_too():
    # With sorts off, a plan that still sorts costs about 10^10, past jit_above_cost: each
    # call would spend tens of milliseconds compiling (docs/benchmarks.md).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname, proconfig FROM pg_proc"
            " WHERE proname LIKE 'dispatch\\_%%' AND 'enable_sort=off' = ANY (proconfig)"
        )
        rows = cursor.fetchall()
    assert {name for name, _ in rows} >= {"dispatch_claim_v5", "dispatch_release_capacity"}
    assert [name for name, config in rows if "jit=off" not in config] == []


# --- one live attempt per run: the database refuses a second ------------------------------
def test_database__refuses_a_second_live_attempt_of_a_run():
    """`dispatch_attempt_one_live_per_run` (rebuilt by 0020 on databases that went through
    0016, which dropped it): a run never has two PENDING or RUNNING attempts, whoever
    writes them."""
    from django.db import IntegrityError, transaction

    run = trigger()
    (first,) = attempts_of(run)
    with pytest.raises(IntegrityError, match="one_live_per_run"), transaction.atomic():
        Attempt.objects.create(
            run=run,
            number=first.number + 1,
            origin=first.origin,
            status=Status.PENDING,
            available_at=first.available_at,
        )
