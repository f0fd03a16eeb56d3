"""The maintenance tasks at history scale: the health scan and the metrics fold read what
comes after their cursors, not the history before them. Counts work (the server's
per-transaction tuple counters), never times it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import override_settings

from dispatch.models.ops import OpsState
from dispatch.ops import alerts, binding_metrics
from tests.support.factories import BindingFactory

pytestmark = pytest.mark.django_db

HISTORY = 20_000
AFTER = 100  # runs finished after the cursor
# The runs after the cursor, the binding's streak (at most the disable threshold + 1),
# and the attempts of those runs: a few hundred. A walk from the history's start reads
# the 20,000.
MAX_TUPLES = 1_000


def history(binding_id: str, *, analyze: bool) -> None:
    """HISTORY finished runs (one attempt each), one a second, the newest a second ago."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH r AS (
                INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                          finished_at, requested_by)
                SELECT gen_random_uuid(), %(b)s::uuid, 'MANUAL', 'SUCCEEDED',
                       now() - make_interval(secs => i + 1), now() - make_interval(secs => i),
                       ''
                FROM generate_series(1, %(n)s) AS i
                RETURNING id, created_at, finished_at)
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, claimed_at, finished_at, reason,
                                          error, rows_read, rows_written)
            SELECT gen_random_uuid(), r.id, 1, 'TRIGGER', 'SUCCEEDED', r.created_at,
                   r.created_at, r.created_at, r.finished_at, NULL, '', 1, 1
            FROM r
            """,
            {"b": binding_id, "n": HISTORY},
        )
        if analyze:
            cursor.execute("ANALYZE dispatch_run")
            cursor.execute("ANALYZE dispatch_attempt")


def cursor_before_the_last(n: int) -> dict[str, str]:
    """A cursor with `n` runs (and attempts) after it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, finished_at FROM dispatch_run ORDER BY finished_at DESC, id DESC"
            " OFFSET %s LIMIT 1",
            [n],
        )
        run_id, run_at = cursor.fetchone()
        cursor.execute(
            "SELECT id, finished_at FROM dispatch_attempt ORDER BY finished_at DESC, id DESC"
            " OFFSET %s LIMIT 1",
            [n],
        )
        attempt_id, attempt_at = cursor.fetchone()
    return {
        "after_at": run_at.isoformat(),
        "after_id": str(run_id),
        "attempts_after_at": attempt_at.isoformat(),
        "attempts_after_id": str(attempt_id),
    }


def tuples_read() -> int:
    """Heap tuples of the run and attempt tables this transaction has read so far."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(idx_tup_fetch + seq_tup_read) FROM pg_stat_xact_user_tables"
            " WHERE relname IN ('dispatch_run', 'dispatch_attempt')"
        )
        return int(cursor.fetchone()[0] or 0)


@pytest.mark.parametrize("statistics", ["fresh", "as when empty"])
@override_settings(DISPATCH_HEALTH_SCAN_LAG=0.0)
def test_health_scan_and_metrics_fold__read_what_follows_their_cursors_not_the_history(
    statistics: str,
) -> None:
    b = BindingFactory()
    history(str(b.pk), analyze=statistics == "fresh")
    cursor = cursor_before_the_last(AFTER)
    OpsState.objects.create(key=alerts.SCAN_KEY, data=cursor)
    OpsState.objects.create(key=binding_metrics.KEY, data=cursor)

    before = tuples_read()
    report = alerts.scan()
    scanned = tuples_read() - before
    assert report.runs == AFTER
    assert scanned <= MAX_TUPLES, scanned

    before = tuples_read()
    assert binding_metrics.fold() == 2 * AFTER  # runs and attempts
    folded = tuples_read() - before
    assert folded <= MAX_TUPLES, folded
