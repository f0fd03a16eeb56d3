from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Version 4 (docs/architecture.md, "A claim bounded by what it returns" and "Idle
    cost"): capacity kept on the attempt row (`dispatch_attempt_ready_idx`, the capacity
    triggers, `dispatch_claim_v4`, `dispatch_refresh_blocked_v4`) and the worker's look at
    the queue (`dispatch_queue_view_v4`). Then every binding at capacity holds its queue
    once. Version 3's functions and its eligible index stay for workers of the previous
    release during a rolling deploy.
    """

    dependencies = [
        ("dispatch", "0013_claim_v3_eligibility"),
    ]

    operations = [
        migrations.RunSQL(
            """
            CREATE INDEX dispatch_attempt_ready_idx ON dispatch_attempt (available_at, id)
             WHERE status = 'PENDING' AND blocked_reason IS NULL;
            """,
            reverse_sql="DROP INDEX IF EXISTS dispatch_attempt_ready_idx;",
        ),
        install("0014_dispatch_v4.sql"),
        migrations.RunSQL(
            "SELECT dispatch_hold_capacity_v4(id) FROM dispatch_jobbinding ORDER BY id",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]
