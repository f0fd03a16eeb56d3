from django.db import migrations

from dispatch.core.sqlfiles import install

# Every function of snapshots 0002-0017 that sql/functions/ no longer holds: the entry
# points no release calls (claims v1, v3, v4, settle and recover v1, the refreshes v1
# and v3, trigger v3), the helpers and trigger functions now installed without a
# version in their names, and version 4's copy of the capacity code (the claim, the
# triggers and the refresh all use one implementation now). Not CASCADE: the triggers
# were moved to the unsuffixed functions first, so nothing may depend on these.
DROP_OLD_FUNCTIONS = """
DROP FUNCTION IF EXISTS dispatch_claim_v1(text, uuid, integer, boolean);
DROP FUNCTION IF EXISTS dispatch_claim_v3(text, uuid, integer, boolean);
DROP FUNCTION IF EXISTS dispatch_claim_v4(text, uuid, integer, boolean);
DROP FUNCTION IF EXISTS dispatch_settle_v1(uuid, bigint, text, text, text, bigint, bigint);
DROP FUNCTION IF EXISTS dispatch_recover_v1(integer);
DROP FUNCTION IF EXISTS dispatch_refresh_blocked_v1();
DROP FUNCTION IF EXISTS dispatch_refresh_blocked_v3();
DROP FUNCTION IF EXISTS dispatch_trigger_v3(uuid[], text, text, text[], uuid[], timestamptz[]);
DROP FUNCTION IF EXISTS dispatch_blocked_reason_v1(boolean, boolean, boolean, boolean, bigint, integer);
DROP FUNCTION IF EXISTS dispatch_binding_running_v1(uuid);
DROP FUNCTION IF EXISTS dispatch_binding_disabled_v3(uuid);
DROP FUNCTION IF EXISTS dispatch_binding_room_v4(uuid);
DROP FUNCTION IF EXISTS dispatch_binding_state_v5(uuid);
DROP FUNCTION IF EXISTS dispatch_mark_binding_v3(uuid);
DROP FUNCTION IF EXISTS dispatch_mark_binding_v4(uuid);
DROP FUNCTION IF EXISTS dispatch_release_capacity_v4(uuid);
DROP FUNCTION IF EXISTS dispatch_hold_capacity_v4(uuid);
DROP FUNCTION IF EXISTS dispatch_release_capacity_v5(uuid);
DROP FUNCTION IF EXISTS dispatch_hold_capacity_v5(uuid);
DROP FUNCTION IF EXISTS dispatch_attempt_before_insert_v3();
DROP FUNCTION IF EXISTS dispatch_attempt_before_insert_v4();
DROP FUNCTION IF EXISTS dispatch_attempt_before_insert_v5();
DROP FUNCTION IF EXISTS dispatch_run_left_running_v4();
DROP FUNCTION IF EXISTS dispatch_run_left_running_v5();
DROP FUNCTION IF EXISTS dispatch_job_enabled_changed_v3();
DROP FUNCTION IF EXISTS dispatch_job_enabled_changed_v4();
DROP FUNCTION IF EXISTS dispatch_binding_changed_v3();
DROP FUNCTION IF EXISTS dispatch_binding_changed_v4();
DROP FUNCTION IF EXISTS dispatch_datasource_enabled_changed_v3();
DROP FUNCTION IF EXISTS dispatch_datasource_enabled_changed_v4();
"""


# The partial unique index of Attempt's `dispatch_attempt_one_live_per_run` constraint (at
# most one PENDING or RUNNING attempt per run), as Django creates it. 0016's AlterField of
# `Attempt.run` to db_index=False dropped it along with the foreign key's own index:
# Django drops every plain btree index on exactly that column that is not one of the
# model's Meta.indexes, and an index backing a UniqueConstraint is not one of those. A
# database created by the squash has it; one that went through 0016 gets it back here.
# The build holds a SHARE lock on dispatch_attempt (writes wait) for one scan of it, and
# fails if two live attempts of one run exist (which the constraint exists to forbid).
RESTORE_ONE_LIVE_PER_RUN = """
CREATE UNIQUE INDEX IF NOT EXISTS "dispatch_attempt_one_live_per_run"
    ON "dispatch_attempt" ("run_id") WHERE "status" IN ('PENDING', 'RUNNING')
"""


class Migration(migrations.Migration):
    """dispatch's SQL by concern (`sql/functions/`, docs/sql.md), installed from its
    frozen snapshot `sql/migrations/0020_functions.sql`.

    The entry points Python calls keep their names and behaviour (dispatch_claim_v5,
    dispatch_settle_claim_v5, dispatch_settle_v2, dispatch_recover_v2,
    dispatch_heartbeat_v1, dispatch_queue_view_v4, dispatch_refresh_blocked_v4,
    dispatch_trigger_v4, dispatch_trigger_notify_v4), so workers of the previous release
    keep working. Helpers and trigger functions lose their version and are replaced in
    place from now on; every trigger moves to them; one capacity implementation (version
    5's) serves the claim, the triggers and the refresh. The attempt insert trigger now
    raises (SQLSTATE 23503) instead of queueing an attempt whose run's binding it cannot
    see. Then every function the snapshot does not hold is dropped, and the unique index
    of one live attempt per run that 0016 dropped by accident is built again.

    Not reversible in the database (a noop backwards): the functions dropped here are
    the old snapshots', and migrating back would leave the current ones installed.
    """

    dependencies = [
        ("dispatch", "0019_binding_metrics_and_webhook"),
    ]

    operations = [
        install("0020_functions.sql"),
        migrations.RunSQL(DROP_OLD_FUNCTIONS, reverse_sql=migrations.RunSQL.noop),
        migrations.RunSQL(RESTORE_ONE_LIVE_PER_RUN, reverse_sql=migrations.RunSQL.noop),
    ]
