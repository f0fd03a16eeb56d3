"""Runs made by SQL for the bulk operations' tests (tests/console/test_bulk.py,
tests/ops/test_bulk_scale.py, tests/worker/test_bulk_processes.py): thousands in one
statement, the way tests/ops/test_maintenance_scale.py builds its history."""

from __future__ import annotations

from django.db import connection

from dispatch.core.states import Status

FINISHED = {Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}


def make_runs(binding_id: object, n: int, status: str = Status.FAILED) -> None:
    """`n` runs of the binding in `status`, each with one attempt in that status (an
    ERROR for a FAILED one), created a second apart."""
    finished = status in FINISHED
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH r AS (
                INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                          finished_at, requested_by)
                SELECT gen_random_uuid(), %(b)s::uuid, 'MANUAL', %(s)s,
                       now() - make_interval(secs => i + 1),
                       CASE WHEN %(f)s THEN now() - make_interval(secs => i) END, ''
                FROM generate_series(1, %(n)s) AS i
                RETURNING id, created_at, finished_at)
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, claimed_at, finished_at, reason,
                                          error, rows_read, rows_written)
            SELECT gen_random_uuid(), r.id, 1, 'TRIGGER', %(s)s, r.created_at,
                   r.created_at, r.created_at, r.finished_at,
                   CASE WHEN %(s)s = 'FAILED' THEN 'ERROR' END, '', 0, 0
            FROM r
            """,
            {"b": str(binding_id), "n": n, "s": status, "f": finished},
        )
