from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Version 3 of the claim: eligibility kept on the attempt row (docs/architecture.md,
    "A claim bounded by what it returns").

    The attempt gets `binding_id` (its run's, written by a trigger on insert; only queued
    attempts are backfilled, the indexes that read it hold only those), two partial
    indexes, the marking triggers and the version 3 functions; then every binding's queued
    attempts are marked once. Version 1's functions stay installed for workers of the
    previous release.
    """

    dependencies = [
        ("dispatch", "0012_queue_table_autovacuum"),
    ]

    operations = [
        migrations.RunSQL(
            """
            ALTER TABLE dispatch_attempt ADD COLUMN binding_id uuid;
            UPDATE dispatch_attempt a SET binding_id = r.binding_id
              FROM dispatch_run r
             WHERE r.id = a.run_id AND a.status = 'PENDING';
            CREATE INDEX dispatch_attempt_eligible_idx ON dispatch_attempt (available_at, id)
             WHERE status = 'PENDING'
               AND (blocked_reason IS NULL OR blocked_reason = 'BINDING_AT_CAPACITY');
            CREATE INDEX dispatch_attempt_queued_idx
                ON dispatch_attempt (binding_id, blocked_reason, available_at)
             WHERE status = 'PENDING';
            """,
            reverse_sql="""
            DROP INDEX IF EXISTS dispatch_attempt_queued_idx;
            DROP INDEX IF EXISTS dispatch_attempt_eligible_idx;
            ALTER TABLE dispatch_attempt DROP COLUMN IF EXISTS binding_id;
            """,
        ),
        install("0013_dispatch_v3.sql"),
        migrations.RunSQL(
            "SELECT dispatch_mark_binding_v3(id) FROM dispatch_jobbinding ORDER BY id",
            reverse_sql=migrations.RunSQL.noop,
        ),
    ]
