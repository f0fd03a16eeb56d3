from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Re-install the v1 functions on databases migrated before their pre-release fixes
    (the binding lock of the claim, SKIP LOCKED in dispatch_refresh_blocked_v1). Every
    statement in the file is CREATE OR REPLACE, so this is a no-op on a fresh database."""

    dependencies = [("dispatch", "0002_sql_functions_v1")]

    operations = [install("0002_dispatch_v1.sql")]
