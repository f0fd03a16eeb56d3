"""A spec saved without the form's validation is validated again when an attempt is
claimed: an invalid one fails the attempt for good, never retried (issue 30, finding 12)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dispatch.core.states import Reason, Status
from dispatch.models import Datasource, Job, JobBinding, Run
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of
from tests.support.processes import Processes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("claimspec")


def failed_once(processes: Processes, binding: JobBinding, field: str) -> str:
    """Break the job's `field` as code that never calls full_clean() would, run it with a
    real worker, and return the error of its only attempt."""
    Job.objects.filter(pk=binding.job_id).update(**{field: {"tabel": "x"}})
    run = trigger(binding)
    worker = processes.worker("--burst")
    assert worker.wait(60) == 0, processes.output(worker)
    assert Run.objects.get(pk=run.pk).status == Status.FAILED
    [attempt] = attempts_of(run)  # no retry attempt was created
    assert (attempt.status, attempt.reason) == (Status.FAILED, Reason.PERMANENT_ERROR)
    return attempt.error


def test_claim__a_query_source_spec_saved_past_the_form_fails_for_good(
    processes: Processes, src_db: ScratchDB
):
    source = Datasource(name="pg-source", kind="postgresql", config=src_db.config)
    source.full_clean()
    source.save()
    binding = BindingFactory(source=source, job__max_attempts=3)
    error = failed_once(processes, binding, "source_spec")
    assert "source_spec: unknown field(s) tabel" in error


def test_claim__a_sink_spec_saved_past_the_form_fails_for_good(processes: Processes):
    binding = BindingFactory(job__max_attempts=3)
    error = failed_once(processes, binding, "sink_spec")
    assert "sink_spec: unknown field(s) tabel" in error


def test_claim__a_valid_spec_still_runs(processes: Processes):
    run = trigger(BindingFactory())
    worker = processes.worker("--burst")
    assert worker.wait(60) == 0, processes.output(worker)
    assert Run.objects.get(pk=run.pk).status == Status.SUCCEEDED
