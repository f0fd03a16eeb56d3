from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    dependencies = [("dispatch", "0001_initial")]

    operations = [
        # Lease tokens: one sequence, so a later claim always holds a larger token.
        migrations.RunSQL(
            "CREATE SEQUENCE IF NOT EXISTS dispatch_lease_token_seq AS bigint",
            reverse_sql="DROP SEQUENCE IF EXISTS dispatch_lease_token_seq",
        ),
        install("0002_dispatch_v1.sql"),
    ]
