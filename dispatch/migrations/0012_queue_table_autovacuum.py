from django.db import migrations

# Storage parameters of the queue tables (docs/operations.md, "Table health").
#
# dispatch_attempt and dispatch_run are updated on every claim, heartbeat and settlement
# and, with retention, deleted from in batches. At PostgreSQL's default scale factor
# (0.2) a table of a million rows waits for 200,000 dead tuples before autovacuum starts,
# and the claim's index scan over the pending index wades through the dead entries
# meanwhile. A fixed threshold plus 1 % keeps the dead share small whatever the size; a
# higher cost limit lets the vacuum keep pace with a busy queue.
#
# dispatch_worker is a handful of rows updated by every heartbeat: fillfactor 50 leaves
# room for HOT updates (no indexed column changes), and a fixed threshold vacuums it
# often (it is tiny, so that is cheap).
QUEUE = (
    "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_vacuum_insert_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02, "
    "autovacuum_vacuum_cost_limit = 2000"
)
QUEUE_RESET = (
    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_vacuum_insert_scale_factor, autovacuum_analyze_scale_factor, "
    "autovacuum_vacuum_cost_limit"
)
WORKER = "fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200"
WORKER_RESET = "fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold"
OUTBOX = "autovacuum_vacuum_scale_factor = 0.05, autovacuum_vacuum_threshold = 500"
OUTBOX_RESET = "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold"


def alter(table: str, params: str, reset: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        f"ALTER TABLE {table} SET ({params})", reverse_sql=f"ALTER TABLE {table} RESET ({reset})"
    )


class Migration(migrations.Migration):
    dependencies = [("dispatch", "0011_operations_tables")]

    operations = [
        alter("dispatch_attempt", QUEUE, QUEUE_RESET),
        alter("dispatch_run", QUEUE, QUEUE_RESET),
        alter("dispatch_worker", WORKER, WORKER_RESET),
        alter("dispatch_alert", OUTBOX, OUTBOX_RESET),
    ]
