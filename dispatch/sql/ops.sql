-- Named statements of the operations side: retention, maintenance state, health scan,
-- alert outbox and the metrics' gauges. Fetched with dispatch.core.sqlfiles.ops_query(NAME).
-- None of them runs in the claim path; every one that locks takes SKIP LOCKED, so it
-- never waits for a claim, a settlement or an operator, and they never wait for it.

-- name: ops_state_ensure
INSERT INTO dispatch_opsstate (key, data, updated_at)
VALUES (%(key)s, '{}', '1970-01-01T00:00:00Z')
ON CONFLICT (key) DO NOTHING;

-- name: ops_state_begin
-- Start a pass of a maintenance task if the last one began at least %(interval)s seconds
-- ago (by database time). The conditional update lets exactly one caller through per
-- interval: it saves work, it carries no correctness (every pass is idempotent).
UPDATE dispatch_opsstate SET updated_at = clock_timestamp()
 WHERE key = %(key)s
   AND updated_at <= clock_timestamp() - make_interval(secs => %(interval)s)
RETURNING data;

-- name: ops_state_record
-- Merge what a pass did into the task's state, stamped with the database's clock.
UPDATE dispatch_opsstate
   SET data = data || %(data)s::jsonb || jsonb_build_object('last_pass_at', clock_timestamp())
 WHERE key = %(key)s;

-- name: ops_state_read
SELECT data, updated_at FROM dispatch_opsstate WHERE key = %(key)s;

-- name: prune_pick_runs
-- Finished runs of one status whose retention has passed, oldest first, that no rule
-- protects (docs/operations.md, "What retention never deletes"), locked FOR UPDATE SKIP
-- LOCKED: a run an operator or a settlement holds is left for the next pass.
-- Index: dispatch_run_status_idx (status, created_at); finished_at >= created_at, so the
-- created_at bound follows from the finished_at one and lets the scan stop early.
SELECT r.id, r.finished_at
  FROM dispatch_run r
 WHERE r.status = %(status)s
   AND r.created_at < now() - make_interval(secs => %(seconds)s)
   AND r.finished_at < now() - make_interval(secs => %(seconds)s)
   -- R1, live work: the status is final, and no attempt is live (a run's status is its
   -- latest attempt's; this re-checks it through dispatch_attempt_one_live_per_run).
   AND r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
   AND NOT EXISTS (SELECT 1 FROM dispatch_attempt a
                    WHERE a.run_id = r.id AND a.status IN ('PENDING', 'RUNNING'))
   -- A slice run goes with its sliced run (prune_delete_slices), and a sliced run only
   -- once none of its slices is live (siblings may still run after it FAILED)
   -- (dispatch_run_slice_uniq leads with parent_id).
   AND r.parent_id IS NULL
   AND NOT EXISTS (SELECT 1 FROM dispatch_run s
                    WHERE s.parent_id = r.id AND s.status IN ('PENDING', 'RUNNING'))
   -- R2, the latest run of the binding (dispatch_run_binding_idx).
   AND EXISTS (SELECT 1 FROM dispatch_run n
                WHERE n.binding_id = r.binding_id AND n.created_at > r.created_at)
   -- R3, the latest successful run of the binding: what "last good sync" and an
   -- incremental sync's resume point are read from.
   AND (r.status <> 'SUCCEEDED'
        OR EXISTS (SELECT 1 FROM dispatch_run n
                    WHERE n.binding_id = r.binding_id AND n.status = 'SUCCEEDED'
                      AND n.created_at > r.created_at))
   -- R4, the latest run of a schedule: its slot record, read by the overlap policy and
   -- the schedule's last_run (index of dispatch_run_schedule_slot_uniq).
   AND (r.schedule_id IS NULL
        OR EXISTS (SELECT 1 FROM dispatch_run n
                    WHERE n.schedule_id = r.schedule_id AND n.scheduled_for > r.scheduled_for))
   -- R5, not yet read by the health scan (failure alerts, auto-disable) or the metrics
   -- fold: finished no later than the oldest of their cursors (one read of two rows, an
   -- uncorrelated InitPlan; a run sharing the cursor's very microsecond but not yet read
   -- is the one case it misses). A task that never ran has no cursor and holds nothing
   -- back.
   AND r.finished_at <= coalesce(
         (SELECT min(t.at) FROM dispatch_opsstate o
            CROSS JOIN LATERAL (VALUES ((o.data->>'after_at')::timestamptz),
                                       ((o.data->>'attempts_after_at')::timestamptz)) t(at)
           WHERE o.key IN ('health', 'metrics')),
         'infinity')
 ORDER BY r.created_at
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED;

-- name: prune_delete_attempts
-- The attempts of runs locked by prune_pick_runs (final, so nobody else locks them).
DELETE FROM dispatch_attempt WHERE run_id = ANY (%(runs)s::uuid[]) RETURNING id;

-- name: prune_delete_slices
-- The slices of the sliced runs among those picked (none of them live: the pick checks),
-- with their plans and ranges: the slice runs' and their attempts' ids. The foreign keys
-- are checked at commit, so the order of the parts does not matter. It locks slice runs
-- after their parent (the reverse of a settlement's order); the only action that could
-- hold one meanwhile is an operator's retry of that very run in the same moment, and
-- PostgreSQL's deadlock detection then fails one of the two (this pass retries at the
-- next one).
WITH slice_runs AS (
    SELECT id FROM dispatch_run WHERE parent_id = ANY (%(runs)s::uuid[])),
del_attempts AS (
    DELETE FROM dispatch_attempt WHERE run_id IN (SELECT id FROM slice_runs) RETURNING id),
del_ranges AS (
    DELETE FROM dispatch_slice WHERE parent_id = ANY (%(runs)s::uuid[]) RETURNING id),
del_plans AS (
    DELETE FROM dispatch_sliceplan WHERE run_id = ANY (%(runs)s::uuid[]) RETURNING run_id),
del_runs AS (
    DELETE FROM dispatch_run WHERE id IN (SELECT id FROM slice_runs) RETURNING id)
SELECT (SELECT coalesce(array_agg(id), '{}') FROM del_runs),
       (SELECT coalesce(array_agg(id), '{}') FROM del_attempts),
       (SELECT count(*) FROM del_ranges) + (SELECT count(*) FROM del_plans);

-- name: prune_delete_events
-- The event logs of the attempts pruned in this batch (theirs and their slice runs'): one
-- probe of dispatch_attemptevent_seq_uniq (attempt_id, seq) per attempt, at most
-- DISPATCH_EVENTS_PER_ATTEMPT + 1 rows each, whatever the table holds besides.
DELETE FROM dispatch_attemptevent WHERE attempt_id = ANY (%(attempts)s::uuid[]);

-- name: prune_delete_runs
DELETE FROM dispatch_run WHERE id = ANY (%(runs)s::uuid[]);

-- name: prune_workers
-- Rows of workers stopped (or silent, after a kill) longer than the retention, unless
-- one still holds a RUNNING attempt (recovery settles that first).
DELETE FROM dispatch_worker
 WHERE id IN (
    SELECT w.id FROM dispatch_worker w
     WHERE coalesce(w.stopped_at, w.heartbeat_at) < now() - make_interval(secs => %(seconds)s)
       AND NOT EXISTS (SELECT 1 FROM dispatch_attempt a
                        WHERE a.worker_id = w.id AND a.status = 'RUNNING')
     LIMIT %(limit)s
       FOR UPDATE OF w SKIP LOCKED);

-- name: prune_alerts
-- Sent, failed or suppressed alerts older than the retention (never a PENDING one).
-- Index: dispatch_alert_created_idx.
DELETE FROM dispatch_alert
 WHERE id IN (
    SELECT id FROM dispatch_alert
     WHERE status <> 'PENDING' AND created_at < now() - make_interval(secs => %(seconds)s)
     ORDER BY created_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED);

-- name: prune_bulk_operations
-- Finished bulk operations (done, cancelled, refused) older than the retention, with
-- their skipped rows; never one in progress. The foreign key from dispatch_bulkskip is
-- checked at commit (deferred), so the two deletes may run in either order. A small
-- table (one row per request): no index of its own.
WITH gone AS (
    SELECT id FROM dispatch_bulkoperation
     WHERE status <> 'PENDING' AND finished_at < now() - make_interval(secs => %(seconds)s)
     ORDER BY finished_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED),
skips AS (
    DELETE FROM dispatch_bulkskip s USING gone WHERE s.operation_id = gone.id)
DELETE FROM dispatch_bulkoperation o USING gone WHERE o.id = gone.id;

-- name: prune_oldest_finished
-- The oldest finished run of each final status (for the console and the metrics): one
-- index probe per status (dispatch_run_status_idx).
SELECT s.status,
       (SELECT r.created_at FROM dispatch_run r WHERE r.status = s.status
         ORDER BY r.created_at LIMIT 1)
  FROM unnest(ARRAY['SUCCEEDED', 'FAILED', 'CANCELLED']) AS s(status);

-- name: metrics_live_runs
-- Live runs by status: index dispatch_run_status_idx, only the live rows.
SELECT s.status, (SELECT count(*) FROM dispatch_run r WHERE r.status = s.status)
  FROM unnest(ARRAY['PENDING', 'RUNNING']) AS s(status);

-- name: metrics_finished_last_hour
-- Index dispatch_run_finished_idx: a range of one hour.
SELECT status, count(*) FROM dispatch_run
 WHERE finished_at > now() - interval '1 hour'
 GROUP BY status;

-- name: metrics_due
-- Due PENDING attempts by binding and blocked reason (index dispatch_attempt_pending_idx:
-- the due rows only), the bindings with the most first, at most %(limit)s series.
SELECT b.name, coalesce(a.blocked_reason, 'NONE'), count(*),
       EXTRACT(EPOCH FROM (clock_timestamp() - min(a.available_at)))::float8
  FROM dispatch_attempt a
  JOIN dispatch_run r ON r.id = a.run_id
  JOIN dispatch_jobbinding b ON b.id = r.binding_id
 WHERE a.status = 'PENDING' AND a.available_at <= clock_timestamp()
 GROUP BY b.name, a.blocked_reason
 ORDER BY count(*) DESC
 LIMIT %(limit)s;

-- name: metrics_live_workers
SELECT stats FROM dispatch_worker
 WHERE stopped_at IS NULL AND heartbeat_at > now() - interval '45 seconds';

-- name: metrics_tables
SELECT relname::text, n_live_tup, n_dead_tup FROM pg_stat_user_tables
 WHERE relname IN ('dispatch_run', 'dispatch_attempt', 'dispatch_worker', 'dispatch_alert')
 ORDER BY relname;

-- name: metrics_binding_counters
-- The folded counters of at most %(limit)s bindings (primary keys of both tables).
SELECT b.name, m.counters FROM dispatch_bindingmetrics m
  JOIN dispatch_jobbinding b ON b.id = m.binding_id
 ORDER BY b.name
 LIMIT %(limit)s;

-- name: metrics_binding_health
-- One row per binding with a health row: as many as bindings.
SELECT state, count(*) FROM dispatch_bindinghealth GROUP BY state;

-- name: metrics_alerts_last_day
-- Index dispatch_alert_created_idx: a range of one day.
SELECT status, kind, count(*) FROM dispatch_alert
 WHERE created_at > now() - interval '1 day'
 GROUP BY status, kind;

-- name: fold_runs
-- The metrics fold's next runs that reached a final status, after its cursor: a keyset
-- over (finished_at, id). The lower bound on finished_at is the index condition
-- (dispatch_run_finished_idx); the OR only breaks ties at the cursor's instant.
SELECT r.id, r.finished_at, r.binding_id, r.status
  FROM dispatch_run r
 WHERE r.finished_at >= %(after_at)s
   AND (r.finished_at > %(after_at)s OR r.id > %(after_id)s)
   AND r.finished_at <= now() - make_interval(secs => %(lag)s)
 ORDER BY r.finished_at, r.id
 LIMIT %(limit)s;

-- name: fold_attempts
-- The metrics fold's next settled attempts after its cursor (dispatch_attempt_finished_idx):
-- each attempt once, whatever happens to its run later (an operator's retry finishes the
-- run again with new attempts; the old ones are not read again).
SELECT a.id, a.finished_at, a.binding_id, a.status, a.available_at, a.claimed_at,
       a.rows_read, a.rows_written
  FROM dispatch_attempt a
 WHERE a.finished_at >= %(after_at)s
   AND (a.finished_at > %(after_at)s OR a.id > %(after_id)s)
   AND a.finished_at <= now() - make_interval(secs => %(lag)s)
 ORDER BY a.finished_at, a.id
 LIMIT %(limit)s;

-- name: maintenance_lag
-- How far the health scan's and the metrics fold's cursors are behind now, seconds.
SELECT o.key, t.cursor, EXTRACT(EPOCH FROM (now() - t.at))::float8
  FROM dispatch_opsstate o
  CROSS JOIN LATERAL (VALUES ('runs', (o.data->>'after_at')::timestamptz),
                             ('attempts', (o.data->>'attempts_after_at')::timestamptz)) t(cursor, at)
 WHERE o.key IN ('health', 'metrics') AND t.at IS NOT NULL;
