# The squash of 0001-0020: the schema as migration 0020 leaves it, built directly on an
# empty database. Django applies it to a database that has applied none of the migrations
# it replaces; a database that applied any of them goes on along 0001-0020 (kept for it),
# after which this one counts as applied too. tests/test_migrations.py checks that both
# roads end in the same schema.
#
# The indexes of dispatch_run and dispatch_attempt are created in the order 0001-0020
# created them, not all at once with their models. When two index paths cost the same
# (statistics taken while a table was empty), PostgreSQL's planner keeps the one of the
# index created last: built the other way round, the claim's pick walked
# dispatch_attempt_pending_idx (every PENDING attempt, blocked ones included) instead of
# dispatch_attempt_ready_idx (tests/worker/test_claim_scale.py). The test checks that
# order too.

import django.core.validators
import django.db.models.deletion
import django.db.models.functions.datetime
import uuid
from django.db import migrations, models

from dispatch.core.sqlfiles import install

# The queue tables' storage parameters (0012_queue_table_autovacuum, which says why).
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


def create_deferred(apps, schema_editor):
    """Run now what the schema editor keeps for the end of the migration (the foreign
    keys' constraints and indexes of the models created so far), as the end of 0001 did,
    so that the indexes added next are created after them."""
    for statement in schema_editor.deferred_sql:
        schema_editor.execute(statement)
    schema_editor.deferred_sql = []


def alter(table: str, params: str, reset: str) -> migrations.RunSQL:
    return migrations.RunSQL(
        f"ALTER TABLE {table} SET ({params})", reverse_sql=f"ALTER TABLE {table} RESET ({reset})"
    )


class Migration(migrations.Migration):

    replaces = [
        ('dispatch', '0001_initial'),
        ('dispatch', '0002_sql_functions_v1'),
        ('dispatch', '0003_sql_functions_v1_refresh'),
        ('dispatch', '0004_run_running_index'),
        ('dispatch', '0005_job_time_bounds'),
        ('dispatch', '0006_json_depth_limits'),
        ('dispatch', '0007_overview_entry'),
        ('dispatch', '0008_console_list_indexes'),
        ('dispatch', '0009_job_source_query_permission'),
        ('dispatch', '0010_sql_functions_v2'),
        ('dispatch', '0011_operations_tables'),
        ('dispatch', '0012_queue_table_autovacuum'),
        ('dispatch', '0013_claim_v3_eligibility'),
        ('dispatch', '0014_claim_v4_capacity'),
        ('dispatch', '0015_v4_without_jit'),
        ('dispatch', '0016_sql_functions_v5'),
        ('dispatch', '0017_trigger_v4'),
        ('dispatch', '0018_incremental_cursor_copy'),
        ('dispatch', '0019_binding_metrics_and_webhook'),
        ('dispatch', '0020_sql_functions_by_concern'),
    ]

    initial = True

    dependencies = [
    ]

    operations = [
        migrations.CreateModel(
            name='Datasource',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=200, unique=True)),
                ('kind', models.CharField(help_text='The connector kind, e.g. postgresql.', max_length=50)),
                ('config_ciphertext', models.TextField(editable=False)),
                ('redacted_config', models.JSONField(default=dict, editable=False)),
                ('enabled', models.BooleanField(default=True)),
                ('version', models.PositiveIntegerField(default=1, editable=False)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
            ],
            options={
                'ordering': ['name'],
                'permissions': [('test_datasource', "Can test a datasource's connection")],
                'constraints': [models.CheckConstraint(condition=models.Q(models.Func(models.F('redacted_config'), models.Value('lax $.**{33 to last}', output_field=models.TextField()), function='jsonb_path_exists', output_field=models.BooleanField(), template='%(function)s(%(expressions)s::jsonpath)'), _negated=True), name='dispatch_datasource_redacted_depth')],
            },
        ),
        migrations.CreateModel(
            name='Worker',
            fields=[
                ('id', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('host', models.CharField(max_length=255)),
                ('pid', models.IntegerField()),
                ('concurrency', models.PositiveIntegerField()),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('heartbeat_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('stopped_at', models.DateTimeField(blank=True, null=True)),
                ('stats', models.JSONField(blank=True, default=dict)),
            ],
            options={
                'ordering': ['-started_at'],
            },
        ),
        migrations.CreateModel(
            name='Job',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=200, unique=True)),
                ('description', models.TextField(blank=True, default='')),
                ('enabled', models.BooleanField(default=True)),
                ('source_spec', models.JSONField(blank=True, default=dict)),
                ('sink_spec', models.JSONField(blank=True, default=dict)),
                ('max_attempts', models.PositiveIntegerField(default=3, help_text='Attempts in one retry budget (since the trigger or the last operator retry).', validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(100)])),
                ('backoff_seconds', models.FloatField(default=10.0, help_text='Delay before the first automatic retry; doubles each retry. At most 7 days.', validators=[django.core.validators.MinValueValidator(0.0), django.core.validators.MaxValueValidator(604800)])),
                ('backoff_max_seconds', models.FloatField(default=600.0, help_text='The longest retry delay. At most 7 days.', validators=[django.core.validators.MinValueValidator(0.0), django.core.validators.MaxValueValidator(604800)])),
                ('lease_seconds', models.PositiveIntegerField(default=30, help_text='A worker heartbeats every lease/3 seconds; recovery settles an attempt whose lease ran out.', validators=[django.core.validators.MinValueValidator(2), django.core.validators.MaxValueValidator(86400)])),
                ('timeout_seconds', models.PositiveIntegerField(blank=True, help_text='Bounds one execution (at most 7 days); empty for no bound.', null=True, validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(604800)])),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
            ],
            options={
                'ordering': ['name'],
                'constraints': [models.CheckConstraint(condition=models.Q(('lease_seconds__gte', 2)), name='dispatch_job_lease_min'), models.CheckConstraint(condition=models.Q(('max_attempts__gte', 1)), name='dispatch_job_attempts_min'), models.CheckConstraint(condition=models.Q(('backoff_seconds__gte', 0), ('backoff_max_seconds__gte', 0)), name='dispatch_job_backoff_nonnegative'), models.CheckConstraint(condition=models.Q(('backoff_seconds__lte', 604800), ('backoff_max_seconds__lte', 604800)), name='dispatch_job_backoff_max'), models.CheckConstraint(condition=models.Q(('lease_seconds__lte', 86400)), name='dispatch_job_lease_max'), models.CheckConstraint(condition=models.Q(('max_attempts__lte', 100)), name='dispatch_job_attempts_max'), models.CheckConstraint(condition=models.Q(('timeout_seconds__isnull', True), models.Q(('timeout_seconds__gte', 1), ('timeout_seconds__lte', 604800)), _connector='OR'), name='dispatch_job_timeout_range'), models.CheckConstraint(condition=models.Q(models.Func(models.F('source_spec'), models.Value('lax $.**{33 to last}', output_field=models.TextField()), function='jsonb_path_exists', output_field=models.BooleanField(), template='%(function)s(%(expressions)s::jsonpath)'), _negated=True), name='dispatch_job_source_spec_depth'), models.CheckConstraint(condition=models.Q(models.Func(models.F('sink_spec'), models.Value('lax $.**{33 to last}', output_field=models.TextField()), function='jsonb_path_exists', output_field=models.BooleanField(), template='%(function)s(%(expressions)s::jsonpath)'), _negated=True), name='dispatch_job_sink_spec_depth')],
                'permissions': [('write_source_query', 'Can write SQL queries that sources run (query specs)')],
            },
        ),
        migrations.CreateModel(
            name='JobBinding',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=200, unique=True)),
                ('enabled', models.BooleanField(default=True)),
                ('max_concurrency', models.PositiveIntegerField(default=1, help_text='Attempts of this binding that may run at once.', validators=[django.core.validators.MinValueValidator(1)])),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('job', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='bindings', to='dispatch.job')),
                ('sink', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='sink_bindings', to='dispatch.datasource')),
                ('source', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='source_bindings', to='dispatch.datasource')),
            ],
            options={
                'verbose_name': 'binding',
                'ordering': ['name'],
                'permissions': [('trigger_binding', 'Can trigger a run of a binding'), ('reset_cursor_binding', "Can reset a binding's incremental cursor"), ('set_cursor_binding', "Can set a binding's incremental cursor")],
                'constraints': [models.CheckConstraint(condition=models.Q(('max_concurrency__gte', 1)), name='dispatch_binding_concurrency_min')],
            },
        ),
        migrations.CreateModel(
            name='Run',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('trigger', models.CharField(choices=[('MANUAL', 'Manual'), ('SCHEDULE', 'Schedule'), ('API', 'API')], default='MANUAL', max_length=20)),
                ('status', models.CharField(choices=[('PENDING', 'Pending'), ('RUNNING', 'Running'), ('SUCCEEDED', 'Succeeded'), ('FAILED', 'Failed'), ('CANCELLED', 'Cancelled'), ('RETRY_SCHEDULED', 'Retry scheduled')], default='PENDING', max_length=20)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('cancel_requested_at', models.DateTimeField(blank=True, null=True)),
                ('schedule_id', models.UUIDField(blank=True, null=True)),
                ('scheduled_for', models.DateTimeField(blank=True, null=True)),
                ('idempotency_key', models.CharField(blank=True, max_length=200, null=True)),
                ('requested_by', models.CharField(blank=True, default='', max_length=150)),
                ('binding', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name='runs', to='dispatch.jobbinding')),
            ],
            options={
                'ordering': ['-created_at'],
                'permissions': [('cancel_run', 'Can cancel a run'), ('retry_run', 'Can retry a failed or cancelled run'), ('run_now', 'Can make a run waiting on backoff available now')],
            },
        ),
        migrations.CreateModel(
            name='Attempt',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('number', models.PositiveIntegerField()),
                ('origin', models.CharField(choices=[('TRIGGER', 'Trigger'), ('RETRY', 'Automatic retry'), ('OPERATOR', 'Operator retry'), ('RELEASE', 'Release successor')], default='TRIGGER', max_length=20)),
                ('status', models.CharField(choices=[('PENDING', 'Pending'), ('RUNNING', 'Running'), ('SUCCEEDED', 'Succeeded'), ('FAILED', 'Failed'), ('CANCELLED', 'Cancelled'), ('RETRY_SCHEDULED', 'Retry scheduled')], default='PENDING', max_length=20)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('available_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('blocked_reason', models.CharField(blank=True, choices=[('JOB_DISABLED', 'Job disabled'), ('BINDING_DISABLED', 'Binding disabled'), ('SOURCE_DISABLED', 'Source datasource disabled'), ('SINK_DISABLED', 'Sink datasource disabled'), ('BINDING_AT_CAPACITY', 'Binding at max_concurrency')], max_length=40, null=True)),
                ('worker_id', models.CharField(blank=True, max_length=200, null=True)),
                ('lease_token', models.BigIntegerField(blank=True, null=True)),
                ('lease_until', models.DateTimeField(blank=True, null=True)),
                ('heartbeat_at', models.DateTimeField(blank=True, null=True)),
                ('claimed_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('source_snapshot', models.TextField(blank=True, null=True)),
                ('sink_snapshot', models.TextField(blank=True, null=True)),
                ('source_redacted', models.JSONField(blank=True, null=True)),
                ('sink_redacted', models.JSONField(blank=True, null=True)),
                ('source_version', models.PositiveIntegerField(blank=True, null=True)),
                ('sink_version', models.PositiveIntegerField(blank=True, null=True)),
                ('datasources_resolved_at', models.DateTimeField(blank=True, null=True)),
                ('reason', models.CharField(blank=True, choices=[('ERROR', 'The connector raised an error; retried per policy'), ('PERMANENT_ERROR', 'A permanent error (bad credentials, missing table); not retried'), ('LEASE_EXPIRED', 'The worker stopped heartbeating; settled by recovery'), ('CANCELLED_BY_OPERATOR', 'An operator cancelled the run'), ('TIMEOUT', "The job's timeout_seconds elapsed"), ('SNAPSHOT_UNREADABLE', 'The encrypted snapshot could not be decrypted or verified'), ('SHUTDOWN_RELEASED', 'A draining worker released the attempt'), ('RELEASED_BY_OPERATOR', 'An operator released the attempt'), ('ALREADY_COMMITTED', "The run's data was already committed to the sink")], max_length=40, null=True)),
                ('error', models.TextField(blank=True, default='')),
                ('rows_read', models.BigIntegerField(default=0)),
                ('rows_written', models.BigIntegerField(default=0)),
                ('sink', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='dispatch.datasource')),
                ('source', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='dispatch.datasource')),
                ('run', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='attempts', to='dispatch.run')),
                ('cursor_from', models.JSONField(blank=True, editable=False, null=True)),
                ('cursor_to', models.JSONField(blank=True, editable=False, null=True)),
            ],
            options={
                'ordering': ['run', 'number'],
                'permissions': [('release_attempt', 'Can release a running attempt')],
            },
        ),
        migrations.CreateModel(
            name='Overview',
            fields=[
            ],
            options={
                'verbose_name': 'overview',
                'verbose_name_plural': 'overview',
                'proxy': True,
                'default_permissions': (),
                'indexes': [],
                'constraints': [],
            },
            bases=('dispatch.run',),
        ),
        # From here on, the indexes of runs and attempts in the order 0001-0020 created
        # them (see the top of this file).
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['status', '-created_at'], name='dispatch_run_status_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['binding', '-created_at'], name='dispatch_run_binding_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('finished_at__isnull', False)), fields=['finished_at'], name='dispatch_run_finished_idx'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.UniqueConstraint(condition=models.Q(('idempotency_key__isnull', False)), fields=('idempotency_key',), name='dispatch_run_idempotency_key_uniq'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.UniqueConstraint(fields=('schedule_id', 'scheduled_for'), name='dispatch_run_schedule_slot_uniq'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ['PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'RETRY_SCHEDULED'])), name='dispatch_run_status_valid'),
        ),
        migrations.AddConstraint(
            model_name='run',
            constraint=models.CheckConstraint(condition=models.Q(('status', 'RETRY_SCHEDULED'), _negated=True), name='dispatch_run_status_not_retry'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(condition=models.Q(('status', 'PENDING')), fields=['available_at', 'id'], name='dispatch_attempt_pending_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(condition=models.Q(('status', 'RUNNING')), fields=['lease_until'], name='dispatch_attempt_running_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(fields=['status', '-created_at'], name='dispatch_attempt_status_idx'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.UniqueConstraint(fields=('run', 'number'), name='dispatch_attempt_run_number_uniq'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.CheckConstraint(condition=models.Q(('number__gte', 1)), name='dispatch_attempt_number_min'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ['PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'RETRY_SCHEDULED'])), name='dispatch_attempt_status_valid'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('status', 'RUNNING'), _negated=True), models.Q(('lease_token__isnull', False), ('lease_until__isnull', False), ('worker_id__isnull', False), ('claimed_at__isnull', False)), _connector='OR'), name='dispatch_attempt_running_has_lease'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ['PENDING', 'RUNNING']), ('finished_at__isnull', False), _connector='OR'), name='dispatch_attempt_finished_has_time'),
        ),
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.CheckConstraint(condition=models.Q(('status', 'RUNNING'), models.Q(('source_snapshot__isnull', True), ('sink_snapshot__isnull', True)), _connector='OR'), name='dispatch_attempt_snapshot_only_while_running'),
        ),
        # The foreign keys' constraints and indexes, which Django keeps for the end of a
        # migration, here: where 0001 ended.
        migrations.RunPython(create_deferred, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('status', 'RUNNING')), fields=['binding'], name='dispatch_run_running_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(fields=['-created_at'], name='dispatch_attempt_created_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(condition=models.Q(('finished_at__isnull', False)), fields=['finished_at'], name='dispatch_attempt_finished_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(fields=['origin', '-created_at'], name='dispatch_attempt_origin_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(condition=models.Q(('reason__isnull', False)), fields=['reason', '-created_at'], name='dispatch_attempt_reason_idx'),
        ),
        migrations.AddIndex(
            model_name='attempt',
            index=models.Index(condition=models.Q(('blocked_reason__isnull', False)), fields=['blocked_reason', '-created_at'], name='dispatch_attempt_blocked_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['-created_at'], name='dispatch_run_created_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['trigger', '-created_at'], name='dispatch_run_trigger_idx'),
        ),
        migrations.CreateModel(
            name='OpsState',
            fields=[
                ('key', models.CharField(max_length=40, primary_key=True, serialize=False)),
                ('data', models.JSONField(blank=True, default=dict)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'maintenance state',
            },
        ),
        migrations.CreateModel(
            name='Alert',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('kind', models.CharField(choices=[('RUN_FAILED', 'Run failed for good'), ('BINDING_RECOVERED', 'Failing binding succeeded again'), ('BINDING_WARNED', 'Binding warned (failing)'), ('BINDING_AUTO_DISABLED', 'Binding auto-disabled')], max_length=30)),
                ('notifier', models.CharField(max_length=50)),
                ('binding_id', models.UUIDField(blank=True, null=True)),
                ('binding_name', models.CharField(blank=True, default='', max_length=200)),
                ('run_id', models.UUIDField(blank=True, null=True)),
                ('dedup_key', models.CharField(max_length=300, unique=True)),
                ('status', models.CharField(choices=[('PENDING', 'Pending'), ('SENT', 'Sent'), ('FAILED', 'Failed (gave up)'), ('SUPPRESSED', 'Suppressed (rate limit)')], default='PENDING', max_length=20)),
                ('payload', models.JSONField(default=dict)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('next_attempt_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('sent_at', models.DateTimeField(blank=True, null=True)),
                ('last_error', models.TextField(blank=True, default='')),
            ],
            options={
                'ordering': ['-created_at'],
                'indexes': [models.Index(condition=models.Q(('status', 'PENDING')), fields=['next_attempt_at'], name='dispatch_alert_due_idx'), models.Index(fields=['binding_id', 'kind', '-created_at'], name='dispatch_alert_binding_idx'), models.Index(fields=['created_at'], name='dispatch_alert_created_idx')],
                'constraints': [models.CheckConstraint(condition=models.Q(('status__in', ['PENDING', 'SENT', 'FAILED', 'SUPPRESSED'])), name='dispatch_alert_status_valid')],
            },
        ),
        migrations.CreateModel(
            name='BindingHealth',
            fields=[
                ('binding', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='health', serialize=False, to='dispatch.jobbinding')),
                ('state', models.CharField(choices=[('OK', 'OK'), ('WARNED', 'Warned'), ('AUTO_DISABLED', 'Auto-disabled')], default='OK', max_length=20)),
                ('consecutive_failures', models.PositiveIntegerField(default=0)),
                ('failing_since', models.DateTimeField(blank=True, null=True)),
                ('last_success_at', models.DateTimeField(blank=True, null=True)),
                ('last_failure_at', models.DateTimeField(blank=True, null=True)),
                ('counted_since', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('reason', models.CharField(blank=True, default='', max_length=200)),
                ('warned_at', models.DateTimeField(blank=True, null=True)),
                ('disabled_at', models.DateTimeField(blank=True, null=True)),
                ('alert_emails', models.TextField(blank=True, default='', help_text="Comma-separated addresses for this binding's alerts; empty: the site's ADMINS.")),
                ('alerts_muted', models.BooleanField(default=False, help_text='Send no alerts for this binding (auto-disable still applies).')),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('alert_webhook', models.CharField(blank=True, db_default='', default='', help_text="The name of one of the site's DISPATCH_ALERT_WEBHOOKS for this binding's alerts; empty: the site's default webhook (DISPATCH_ALERT_WEBHOOK_URL), if any.", max_length=100)),
            ],
            options={
                'verbose_name': 'binding health',
                'verbose_name_plural': 'binding health',
                'indexes': [models.Index(condition=models.Q(('failing_since__isnull', False)), fields=['failing_since'], name='dispatch_health_failing_idx')],
                'constraints': [models.CheckConstraint(condition=models.Q(('state__in', ['OK', 'WARNED', 'AUTO_DISABLED'])), name='dispatch_health_state_valid')],
            },
        ),
        # Lease tokens: one sequence, so a later claim always holds a larger token (0002).
        migrations.RunSQL(
            "CREATE SEQUENCE IF NOT EXISTS dispatch_lease_token_seq AS bigint",
            reverse_sql="DROP SEQUENCE IF EXISTS dispatch_lease_token_seq",
        ),
        # The queue tables' storage parameters (0012).
        alter("dispatch_attempt", QUEUE, QUEUE_RESET),
        alter("dispatch_run", QUEUE, QUEUE_RESET),
        alter("dispatch_worker", WORKER, WORKER_RESET),
        alter("dispatch_alert", OUTBOX, OUTBOX_RESET),
        # Eligibility and capacity kept on the attempt row (0013, 0014; sql/functions/
        # marks.sql and capacity.sql): the run's binding, copied on insert by a trigger,
        # and the two partial indexes the marking and the claim read. Not in the model:
        # only the SQL reads them.
        migrations.RunSQL(
            """
            ALTER TABLE dispatch_attempt ADD COLUMN binding_id uuid;
            CREATE INDEX dispatch_attempt_queued_idx
                ON dispatch_attempt (binding_id, blocked_reason, available_at)
             WHERE status = 'PENDING';
            """,
            reverse_sql="""
            DROP INDEX IF EXISTS dispatch_attempt_queued_idx;
            ALTER TABLE dispatch_attempt DROP COLUMN IF EXISTS binding_id;
            """,
        ),
        migrations.RunSQL(
            """
            CREATE INDEX dispatch_attempt_ready_idx ON dispatch_attempt (available_at, id)
             WHERE status = 'PENDING' AND blocked_reason IS NULL;
            """,
            reverse_sql="DROP INDEX IF EXISTS dispatch_attempt_ready_idx;",
        ),
        migrations.CreateModel(
            name='BindingCursor',
            fields=[
                ('binding', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='cursor_copy', serialize=False, to='dispatch.jobbinding')),
                ('columns', models.JSONField(blank=True, null=True)),
                ('cursor', models.JSONField(blank=True, null=True)),
                ('version', models.BigIntegerField(default=0)),
                ('run_id', models.UUIDField(blank=True, null=True)),
                ('attempt_id', models.UUIDField(blank=True, null=True)),
                ('changed_by', models.CharField(blank=True, default='', max_length=200)),
                ('committed_at', models.DateTimeField(blank=True, null=True)),
                ('recorded_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'binding cursor',
            },
        ),
        migrations.CreateModel(
            name='BindingMetrics',
            fields=[
                ('binding', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='metrics', serialize=False, to='dispatch.jobbinding')),
                ('counters', models.JSONField(default=dict)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'binding metrics',
                'verbose_name_plural': 'binding metrics',
            },
        ),
        # One live attempt per run (0020 built it again after 0016 had dropped it).
        migrations.AddConstraint(
            model_name='attempt',
            constraint=models.UniqueConstraint(condition=models.Q(('status__in', ['PENDING', 'RUNNING'])), fields=('run',), name='dispatch_attempt_one_live_per_run'),
        ),
        # The functions and triggers, from the snapshot 0020 installs.
        install("0020_functions.sql"),
    ]
