"""Progress that tells the truth, on a 1,000,000-row PostgreSQL -> PostgreSQL copy through a
real worker: the source's estimate is recorded when the read begins, and the run page and
`trigger --wait` show the total, the percentage, the rate and the time left while the copy
runs, then the rows and the rate once it has finished.

The sink table is locked by the test after the first block has been read (its COPY waits
for the lock), so the run is caught half-way without guessing a moment."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from dispatch import api
from dispatch.core.states import Status
from dispatch.models import Attempt, Datasource, Run
from tests.support import factories
from tests.support.connectors import ScratchDB, connect, scratch_db
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROWS = 1_000_000
COUNT = re.compile(r"([\d,]+) of ~([\d,]+) rows \((\d+) %\)")


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_prog_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_prog_dst")


def _datasource(name: str, config: dict[str, Any]) -> Datasource:
    ds = Datasource(name=name, kind="postgresql", config=config)
    ds.full_clean()
    ds.save()
    return ds


def _page(client: Client, run: Run) -> str:
    response = client.get(reverse("admin:dispatch_run_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode()


def test_progress__a_million_row_copy_shows_total_percent_rate_and_time_left(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes, admin_client: Client
) -> None:
    src_db.execute("CREATE TABLE big (id bigint, payload text)")
    src_db.execute(f"INSERT INTO big SELECT i, 'row ' || i FROM generate_series(1, {ROWS}) i")
    src_db.execute("ANALYZE big")
    dst_db.execute("CREATE TABLE big (id bigint, payload text)")
    job = factories.JobFactory(
        source_spec={"table": "big"},
        # The sink waits for the test's lock (below) instead of failing after 10 s.
        sink_spec={"table": "big", "lock_timeout_seconds": 120},
        lease_seconds=3,  # a heartbeat (and so fresh counters) every second
        max_attempts=1,
    )
    binding = factories.BindingFactory(
        name="big-copy",
        job=job,
        source=_datasource("big-src", src_db.config),
        sink=_datasource("big-dst", dst_db.config),
    )
    binding.full_clean()
    holder = connect(dst_db.name, autocommit=False)
    try:
        holder.execute("LOCK TABLE big IN SHARE MODE")  # the sink's COPY waits for it
        processes.worker()
        waiting = processes.manage("trigger", "big-copy", "--wait", "--timeout", "120")
        run = wait_until(lambda: Run.objects.filter(binding=binding).first(), message="the run")

        # Half-way: the first block read, its write waiting, a heartbeat since the claim.
        def halfway() -> Attempt | None:
            a = Attempt.objects.filter(run=run).first()
            if a is None or a.status != Status.RUNNING or not a.rows_read:
                return None
            if a.rows_estimated is None or a.heartbeat_at is None or a.claimed_at is None:
                return None
            return a if a.heartbeat_at > a.claimed_at else None

        attempt = wait_until(halfway, timeout=60, message="the copy under way")
        assert attempt.rows_read < ROWS
        assert 0.8 * ROWS <= (attempt.rows_estimated or 0) <= 1.25 * ROWS  # after ANALYZE
        now = api.result(run)
        assert now.progress.rate is not None and now.progress.rate > 0
        assert now.progress.eta_seconds is not None and now.progress.eta_seconds > 0

        page = _page(admin_client, run)
        count = COUNT.search(page)
        assert count is not None, page
        read, total, percent = (int(g.replace(",", "")) for g in count.groups())
        assert read > 0 and total == attempt.rows_estimated and 0 <= percent < 100
        assert re.search(r"[\d,.]+ rows/s", page) and re.search(r"about [^<]+ left", page)

        # `trigger --wait`, not on a terminal: a line once the rate is known.
        line = wait_until(
            lambda: next(
                (
                    ln
                    for ln in processes.output(waiting).splitlines()
                    if "RUNNING:" in ln and "rows/s" in ln
                ),
                None,
            ),
            timeout=30,
            message="a progress line of trigger --wait",
        )
        assert re.search(r"of about [\d,]+ rows read \(\d+ %\)", line), line
        assert re.search(r"about .+ left", line), line
    finally:
        holder.rollback()  # the sink's COPY goes on
        holder.close()

    assert waiting.wait(120) == 0, processes.output(waiting)
    run.refresh_from_db()
    assert run.status == Status.SUCCEEDED
    attempt.refresh_from_db()
    assert (attempt.rows_read, attempt.rows_written) == (ROWS, ROWS)
    assert dst_db.execute("SELECT count(*) FROM big") == [(ROWS,)]
    output = processes.output(waiting)
    assert re.search(rf"Run {run.pk} SUCCEEDED in [\d.]+ s \(1 attempt\)\.", output), output
    assert re.search(r"Rows: 1,000,000 read, 1,000,000 written, [\d,]+ rows/s\.", output), output
    done = _page(admin_client, run)
    assert "1,000,000 rows" in done and re.search(r"[\d,]+ rows/s", done)
    assert "left" not in done.split('id="attempts-timeline"')[1]
