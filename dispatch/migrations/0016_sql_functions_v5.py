import django.db.models.deletion
from django.db import migrations, models

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Version 5 of the claim path (`sql/migrations/0016_dispatch_v5.sql`): the binding's
    state in one PL/pgSQL call instead of LANGUAGE sql helpers planned again on every
    call, a release of capacity marks that stops at once when the binding holds none, a
    claim that holds capacity only for the bindings it filled, and
    `dispatch_settle_claim_v5` (a settlement and the next claim in one round trip). The
    triggers move to version 5's functions, which keep version 4's marks, so workers of
    the previous release keep working.

    Three indexes fewer to write on every claim and settlement: version 3's eligible
    index (no worker of version 4 or 5 reads it; a version 3 claim still works without
    it) and the foreign-key indexes that a composite index already leads with."""

    dependencies = [
        ("dispatch", "0015_v4_without_jit"),
    ]

    operations = [
        install("0016_dispatch_v5.sql"),
        migrations.RunSQL(
            "DROP INDEX IF EXISTS dispatch_attempt_eligible_idx",
            reverse_sql="""
            CREATE INDEX IF NOT EXISTS dispatch_attempt_eligible_idx
                ON dispatch_attempt (available_at, id)
             WHERE status = 'PENDING'
               AND (blocked_reason IS NULL OR blocked_reason = 'BINDING_AT_CAPACITY')
            """,
        ),
        migrations.AlterField(
            model_name="attempt",
            name="run",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="attempts",
                to="dispatch.run",
            ),
        ),
        migrations.AlterField(
            model_name="run",
            name="binding",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="runs",
                to="dispatch.jobbinding",
            ),
        ),
    ]
