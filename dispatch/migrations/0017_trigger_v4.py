from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Version 6 of dispatch's SQL (`sql/migrations/0017_dispatch_v6.sql`):
    `dispatch_trigger_v4`, which takes the runs' ids from the caller and inserts in one
    stable order (two calls with overlapping keys no longer deadlock), and
    `dispatch_trigger_notify_v4`, the trigger, its commit and its wake-ups in one round
    trip. Version 3's trigger stays for the previous release."""

    dependencies = [
        ("dispatch", "0016_sql_functions_v5"),
    ]

    operations = [install("0017_dispatch_v6.sql")]
