"""An apply against an edit in flight, on a second connection: the apply waits for the
edit's row lock, then sees the committed edit and writes nothing."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from dispatch import ascode
from dispatch.models import Job, JobBinding
from tests.support.ascode import apply_text, plan_text
from tests.support.helpers import raw_connection
from tests.support.processes import wait_until

FILES = """
datasources:
  gen: {kind: generate}
  void: {kind: "null"}
jobs:
  copy: {source_spec: {rows: 5}}
bindings:
  b: {job: copy, source: gen, sink: void}
"""


@pytest.mark.django_db(transaction=True)
def test_apply__waits_for_an_edit_in_flight_then_refuses_and_writes_nothing() -> None:
    apply_text(FILES)
    plan = plan_text(FILES.replace("{job: copy,", "{max_concurrency: 3, job: copy,"))
    outcome: list[str] = []

    def apply() -> None:
        try:
            ascode.apply(plan)
            outcome.append("applied")
        except ascode.Conflict as exc:
            outcome.append(str(exc))
        finally:
            connections.close_all()

    with raw_connection() as console, raw_connection() as probe:
        probe.autocommit = True  # pg_stat_activity is read afresh each time
        # A console save in progress: the job's row is locked by an uncommitted UPDATE.
        console.execute("UPDATE dispatch_job SET description = 'edited' WHERE name = 'copy'")
        applying = threading.Thread(target=apply)
        applying.start()
        wait_until(
            lambda: (
                probe.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE '%dispatch_job%FOR NO KEY UPDATE%'"
                ).fetchone()[0]
                == 1
            ),
            message="the apply waiting on the job's row lock",
        )
        console.commit()
        applying.join(30)

    assert outcome == [
        "job 'copy' was changed since the plan was made (a console edit or another apply): "
        "nothing was written; plan and apply again"
    ]
    assert JobBinding.objects.get().max_concurrency == 1  # locked first, never written
    assert Job.objects.get().description == "edited"
