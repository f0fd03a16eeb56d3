from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Install the version 2 functions (clamped settlement, row-isolated recovery) beside
    version 1, which stays for workers of the previous release."""

    dependencies = [
        ("dispatch", "0009_job_source_query_permission"),
    ]

    operations = [install("0010_dispatch_v2.sql")]
