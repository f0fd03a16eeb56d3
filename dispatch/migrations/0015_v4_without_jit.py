from django.db import migrations

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """Version 4's functions again (the file is idempotent): the claim holds capacity in
    a loop over its bindings instead of a sorted query, and every function that turns
    sorts off also turns JIT off. With sorts off, a plan that still sorts costs about
    10^10, which crossed `jit_above_cost`: the claim spent 40 ms compiling each call
    (throughput fell from about 900 to 99 runs/s; docs/benchmarks.md)."""

    dependencies = [
        ("dispatch", "0014_claim_v4_capacity"),
    ]

    operations = [install("0014_dispatch_v4.sql")]
