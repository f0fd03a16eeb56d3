"""The invariant checker learns slices: real sliced runs (planned and copied by the runner,
in process, between two scratch databases) pass; each test then plants one violation
(rows written directly, bypassing the guarded SQL) and sees the check in question report
it: a parent SUCCEEDED with a slice FAILED, counters that are not the slices', ranges
with a gap, a slice's rows twice, a staged `replace` left behind, a stale slice recorded
as committed, a fence of the sliced run itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dispatch import services
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, JobBinding, Run, Slice, SlicePlan
from dispatch.verify import invariants
from dispatch.verify.invariants import Scope
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory, trigger

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 1_000
SLICES = 4


@pytest.fixture
def src() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_invsl_src")


@pytest.fixture
def dst() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_invsl_dst")


def binding(src: ScratchDB, dst: ScratchDB, mode: str, *, max_attempts: int = 2) -> JobBinding:
    src.execute(
        "CREATE TABLE IF NOT EXISTS public.items (id bigint PRIMARY KEY, name text,"
        " amount numeric(10,2), doc jsonb)"
    )
    src.execute(
        "INSERT INTO public.items SELECT i, 'n' || i, i / 7.0, jsonb_build_object('i', i)"
        " FROM generate_series(1, %s) i ON CONFLICT DO NOTHING",
        [ROWS],
    )
    src.execute("ANALYZE public.items")
    job = JobFactory(
        source_spec={"table": "public.items", "slices": {"key": "id", "count": SLICES}},
        sink_spec={"table": f"public.copy_{mode}", "mode": mode, "create": True},
        max_attempts=max_attempts,
    )
    return BindingFactory(
        job=job,
        max_concurrency=SLICES,
        source=DatasourceFactory(kind="postgresql", config=src.config),
        sink=DatasourceFactory(kind="postgresql", config=dst.config),
    )


def execute(run_id: Any) -> str | None:
    (claimed,) = claims.claim("w-inv", run_id=run_id, limit=1, generic=False)
    return Runner(claimed, ExecutionControl(claimed)).execute()


def slice_runs(parent: Run) -> list[Run]:
    return list(Run.objects.filter(parent=parent).order_by("slice_number"))


def sliced_run(b: JobBinding, *, skip: frozenset[int] = frozenset()) -> Run:
    """A run of `b` planned by the runner, then each slice copied by it (those in `skip`
    left queued)."""
    run = trigger(b)
    assert execute(run.id) == Status.WAITING
    for child in slice_runs(run):
        if child.slice_number not in skip:
            assert execute(child.id) == Status.SUCCEEDED
    run.refresh_from_db()
    return run


def check(run: Run) -> invariants.Report:
    return invariants.check(Scope(run_ids=frozenset({run.id})), values=True)


def failing(report: invariants.Report) -> set[str]:
    return {v.check for v in report.violations}


def test_sliced_append__consistent_then_a_slices_rows_twice(src: Any, dst: Any) -> None:
    run = sliced_run(binding(src, dst, "append"))
    assert run.status == Status.SUCCEEDED
    report = check(run)
    assert report.ok, report.render()
    assert report.counts["runs"] == 1 + SLICES  # the slice runs come with their parent
    # Slice 2's rows (ids 250..499 of 1..1000 in 4 equal ranges) once more.
    lower = Slice.objects.get(parent=run, number=2).lower
    upper = Slice.objects.get(parent=run, number=2).upper
    dst.execute(
        "INSERT INTO public.copy_append SELECT * FROM public.copy_append"
        " WHERE id >= %s AND id < %s",
        [int(lower), int(upper)],
    )
    report = check(run)
    assert failing(report) == {"sink_values"}
    assert f"{int(upper) - int(lower)} row(s) too many" in report.render()


def test_sliced_run__succeeded_with_a_slice_failed(src: Any, dst: Any) -> None:
    run = sliced_run(binding(src, dst, "append"))
    third = slice_runs(run)[2]
    Run.objects.filter(pk=third.pk).update(status=Status.FAILED)
    Attempt.objects.filter(run=third).update(status=Status.FAILED, reason=Reason.ERROR)
    report = check(run)
    assert "slices" in failing(report)
    assert f"run is SUCCEEDED with {SLICES - 1} of {SLICES} slices SUCCEEDED" in report.render()
    assert "plan counts succeeded/failed/live (4, 0, 0)" in report.render()


def test_sliced_run__counters_ranges_and_waiting_forever(src: Any, dst: Any) -> None:
    run = sliced_run(binding(src, dst, "append"))
    SlicePlan.objects.filter(run=run).update(rows_written=ROWS + 1)
    report = check(run)
    assert failing(report) == {"slices"}
    assert f"plan says {ROWS + 1} rows written" in report.render()
    SlicePlan.objects.filter(run=run).update(rows_written=ROWS)
    assert check(run).ok
    # A gap between slices 2 and 3: the rows in it belong to no slice.
    upper = Slice.objects.get(parent=run, number=2).upper
    Slice.objects.filter(parent=run, number=3).update(lower=str(int(upper or 0) + 5))
    report = check(run)
    assert failing(report) == {"slices"}
    assert f"slice 2 ends at {upper} but slice 3 starts at" in report.render()


def test_sliced_run__waiting_with_nothing_left_to_settle_it(src: Any, dst: Any) -> None:
    run = sliced_run(binding(src, dst, "append"), skip=frozenset({4}))
    assert run.status == Status.WAITING
    report = check(run)
    # Slice 4 queued: not finished yet (as any pending run), no other finding.
    assert failing(report) == {"run_not_terminal"}
    Run.objects.filter(parent=run, slice_number=4).delete()
    SlicePlan.objects.filter(run=run).update(live=0)
    report = check(run)
    assert "WAITING with no slice queued or running" in report.render()
    # Slice 4's run gone: the plan says 4 started, 3 have a run.
    assert "the plan has started 4 slice(s) but slices [1, 2, 3] have a run" in report.render()


def test_sliced_run__retried_after_a_slice_failed(src: Any, dst: Any) -> None:
    """A slice fails for good: the parent FAILED with the other slices' rows committed
    (each exactly once, which the checker accepts); an operator retry redoes only the
    failed slice and the run SUCCEEDS with every row once."""
    b = binding(src, dst, "append", max_attempts=1)
    run = sliced_run(b, skip=frozenset({3}))
    third = slice_runs(run)[2]
    (claimed,) = claims.claim("w-inv", run_id=third.id, limit=1, generic=False)
    claims.settle(claimed.attempt_id, claimed.lease_token, "PERMANENT", reason=Reason.ERROR)
    run.refresh_from_db()
    assert run.status == Status.FAILED
    report = check(run)
    assert report.ok, report.render()
    assert services.retry_run(run) == services.Outcome.RETRIED
    assert execute(third.id) == Status.SUCCEEDED
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    report = check(run)
    assert report.ok, report.render()
    assert dst.execute("SELECT count(*), count(DISTINCT id) FROM public.copy_append") == [
        (ROWS, ROWS)
    ]


def test_sliced_replace__staging_left_and_a_stale_slice_recorded(src: Any, dst: Any) -> None:
    from dispatch.connectors.postgresql.writer import staging_name

    run = sliced_run(binding(src, dst, "replace"))
    assert run.status == Status.SUCCEEDED
    report = check(run)
    assert report.ok, report.render()
    stage = staging_name(str(run.id))
    assert dst.execute("SELECT to_regclass(%s)", [f"public.{stage}"]) == [(None,)]
    # The staging table still holding rows after the swap.
    dst.execute(f"CREATE TABLE public.{stage} AS SELECT * FROM public.copy_replace LIMIT 3")
    report = check(run)
    assert failing(report) == {"slices_sink"}
    assert "SUCCEEDED but its staging table still holds 3 row(s)" in report.render()
    dst.execute(f"DELETE FROM public.{stage}")
    report = check(run)
    assert report.ok and any("empty staging table" in n for n in report.notes)
    # A slice recorded as committed by a run that is not its own (a stale commit).
    stale = trigger(run.binding)
    dst.execute(
        "INSERT INTO public.dispatch_slice_commit VALUES (%s, 2, %s, 5, now())",
        [run.id, stale.id],
    )
    report = check(run)
    assert failing(report) == {"slices_sink"}
    assert f"recorded as committed by run {stale.id}, not the slice's run" in report.render()


def test_sliced_run__a_fence_of_its_own_and_a_planning_reason_elsewhere(src: Any, dst: Any) -> None:
    run = sliced_run(binding(src, dst, "append"))
    planning = Attempt.objects.get(run=run)
    dst.execute(
        "INSERT INTO public.dispatch_fence (run_id, binding_id, token, attempt_id, committed_at)"
        " VALUES (%s, %s, %s, %s, now())",
        [run.id, run.binding_id, planning.lease_token, planning.id],
    )
    report = check(run)
    assert "a sliced run has a fence of its own" in report.render()
    plain = trigger(BindingFactory())
    (c,) = claims.claim("w-inv", run_id=plain.id, limit=1, generic=False)
    claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED")
    Attempt.objects.filter(run=plain).update(reason=Reason.SLICES_PLANNED)
    report = invariants.check(Scope(run_ids=frozenset({plain.id})), sinks=False)
    assert failing(report) == {"reason"}
    assert "SLICES_PLANNED but its run has no slice plan" in report.render()
