-- Named statements that do not need a function of their own. Each is fetched by name
-- with dispatch.core.sqlfiles.query(); parameters are %(name)s placeholders.

-- name: claim
-- The claim, in one round trip (see dispatch_claim_v5).
SELECT * FROM dispatch_claim_v5(%(worker)s, %(run)s, %(limit)s, %(generic)s);

-- name: settle
-- A guarded settlement of one attempt with its last events (see dispatch_settle_v3);
-- NULL = lease lost.
SELECT dispatch_settle_v3(%(attempt)s, %(token)s, %(outcome)s, %(reason)s, %(error)s,
                          %(rows_read)s, %(rows_written)s, %(events)s::jsonb, %(lost)s,
                          %(cap)s);

-- name: settle_claim
-- A settlement and the claim of up to `limit` more attempts, in one round trip and one
-- transaction (see dispatch_settle_claim_v6): the status on every row, the claimed
-- attempt's columns after it (all NULL on the one row of a claim that found nothing).
SELECT s.settled, (s.claimed).*
  FROM dispatch_settle_claim_v6(%(attempt)s, %(token)s, %(outcome)s, %(reason)s, %(error)s,
                                %(rows_read)s, %(rows_written)s, %(events)s::jsonb,
                                %(lost)s, %(cap)s, %(worker)s, %(limit)s) s;

-- name: recover
-- One row-isolated recovery pass (see dispatch_recover_v2): outcome NULL + error = a row
-- whose settlement failed and was skipped.
SELECT * FROM dispatch_recover_v2(%(limit)s, %(skip)s::uuid[]);

-- name: heartbeat
-- The events of each attempt travel as one JSON text per attempt (events.sql).
SELECT * FROM dispatch_heartbeat_v2(%(worker)s, %(attempts)s::uuid[], %(tokens)s::bigint[],
                                    %(rows_read)s::bigint[], %(rows_written)s::bigint[],
                                    %(events)s::jsonb[], %(lost)s::integer[], %(cap)s,
                                    %(stats)s::jsonb);

-- name: live_workers
-- Workers that heartbeated within %(stale)s seconds, are not stopped and reported a free
-- slot: the candidates of the notification ranking (dispatch.worker.admission, `rank`).
SELECT id FROM dispatch_worker
 WHERE stopped_at IS NULL
   AND heartbeat_at > clock_timestamp() - make_interval(secs => %(stale)s)
   AND coalesce((stats ->> 'free_slots')::int, 1) > 0;

-- name: queue_view
-- The worker's look at the queue, in the heartbeat's transaction (see
-- dispatch_queue_view_v4): seconds the oldest ready attempt has been due, seconds to the
-- next due attempt, seconds to the earliest lease expiry.
SELECT * FROM dispatch_queue_view_v4();

-- name: claimable
-- The handoff check: does the run still have a due, unblocked PENDING attempt? Through
-- the unique live-attempt index.
SELECT 1 FROM dispatch_attempt
 WHERE run_id = %(run)s AND status IN ('PENDING', 'RUNNING') AND status = 'PENDING'
   AND available_at <= clock_timestamp() AND blocked_reason IS NULL;

-- name: refresh_blocked
-- Repairs stale eligibility marks; bounded by the number of bindings (see
-- dispatch_refresh_blocked_v4).
SELECT dispatch_refresh_blocked_v4();

-- name: next_available_in
-- Seconds until the earliest future PENDING attempt becomes due (by database time), for
-- the worker's timer; NULL when there is none. The time is read once, in an InitPlan
-- (a scalar subquery), so the comparison is an index condition on available_at of
-- dispatch_attempt_pending_idx and the min() stops at the first future entry: the due
-- backlog (available_at <= now) is never walked. A bare clock_timestamp() is volatile
-- and can only filter row by row. A cheap statement: run it outside a transaction.
SELECT EXTRACT(EPOCH FROM (min(available_at) - (SELECT clock_timestamp())))::float8
  FROM dispatch_attempt
 WHERE status = 'PENDING' AND available_at > (SELECT clock_timestamp());

-- name: trigger
-- Runs and their attempt 1 in one round trip (see dispatch_trigger_v4), inside the
-- caller's transaction; the caller sends the wake-ups after it commits.
SELECT * FROM dispatch_trigger_v4(%(ids)s::uuid[], %(bindings)s::uuid[], %(trigger)s,
                                  %(requested_by)s, %(keys)s::text[], %(schedules)s::uuid[],
                                  %(slots)s::timestamptz[]);

-- name: trigger_notify
-- Outside any transaction: the runs, their commit, then their wake-ups in a transaction
-- of their own, in one round trip (see dispatch_trigger_notify_v4).
CALL dispatch_trigger_notify_v4(%(channel)s, %(ids)s::uuid[], %(bindings)s::uuid[],
                                %(trigger)s, %(requested_by)s, %(keys)s::text[],
                                %(schedules)s::uuid[], %(slots)s::timestamptz[],
                                NULL, NULL, NULL, NULL, NULL);

-- name: notify
-- The wake-up, as its own autocommit transaction after the trigger committed: a full
-- notification queue fails this statement only, never the trigger. synchronous_commit is
-- off for this one transaction (set_config(..., true) lasts until its commit), so the
-- wake-up does not wait for a WAL flush.
SELECT set_config('synchronous_commit', 'off', true), pg_notify(%(channel)s, %(payload)s);

-- name: notify_many
-- The wake-ups of trigger_many: one notification per run, in one statement.
SELECT set_config('synchronous_commit', 'off', true),
       count(pg_notify(%(channel)s, x)) FROM unnest(%(payloads)s::text[]) AS x;

-- name: register_worker
INSERT INTO dispatch_worker (id, host, pid, concurrency, started_at, heartbeat_at, stats)
VALUES (%(id)s, %(host)s, %(pid)s, %(concurrency)s, clock_timestamp(), clock_timestamp(), '{}')
ON CONFLICT (id) DO UPDATE
   SET host = EXCLUDED.host, pid = EXCLUDED.pid, concurrency = EXCLUDED.concurrency,
       started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at,
       stopped_at = NULL, stats = '{}';

-- name: stop_worker
UPDATE dispatch_worker SET stopped_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
       stats = %(stats)s::jsonb
 WHERE id = %(id)s;

-- name: record_cursor
-- An incremental attempt's cursors, once its read is bounded: where it starts (the sink's
-- committed cursor, else the spec's start) and what it commits with its rows. Guarded by
-- status and token, like a settlement.
UPDATE dispatch_attempt
   SET cursor_from = %(cursor_from)s::jsonb, cursor_to = %(cursor_to)s::jsonb
 WHERE id = %(attempt)s AND lease_token = %(token)s AND status = 'RUNNING';

-- name: record_receipt
-- The receipt a sink committed with an attempt's rows (its rows and digest), recorded
-- after that commit and before the settlement. Guarded by status and token, like a
-- settlement; the sink's own receipt row is the truth, this the console's copy.
UPDATE dispatch_attempt
   SET receipt_rows = %(rows)s, receipt_digest = %(digest)s
 WHERE id = %(attempt)s AND lease_token = %(token)s AND status = 'RUNNING';

-- name: record_schema_changes
-- The schema changes a sink made or found in the transaction that committed an attempt's
-- rows (docs/connectors.md, "Schema changes"), recorded after that commit and before the
-- settlement, for the console and the health scan's alert. Guarded by status and token.
UPDATE dispatch_attempt
   SET schema_changes = %(changes)s::jsonb
 WHERE id = %(attempt)s AND lease_token = %(token)s AND status = 'RUNNING';

-- name: record_estimates
-- The rows each of a worker's attempts expects to read (its source's estimate: progress
-- only, nothing decides on it), written once per attempt by the heartbeat thread after a
-- heartbeat, in a statement of its own (claims.record_estimates says why not inside the
-- heartbeat's transaction). Locks only attempt rows; guarded by status and token.
UPDATE dispatch_attempt a SET rows_estimated = e.rows
  FROM unnest(%(attempts)s::uuid[], %(tokens)s::bigint[], %(rows)s::bigint[])
       AS e(id, token, rows)
 WHERE a.id = e.id AND a.lease_token = e.token AND a.status = 'RUNNING'
RETURNING a.id;

-- name: record_cursor_copy
-- The console's copy of a binding's committed cursor, moved only forward (by the sink's
-- version): a late writer with an older version changes nothing.
INSERT INTO dispatch_bindingcursor AS c (binding_id, columns, cursor, version, run_id,
                                         attempt_id, changed_by, committed_at, recorded_at)
VALUES (%(binding)s, %(columns)s::jsonb, %(cursor)s::jsonb, %(version)s, %(run)s,
        %(attempt)s, %(changed_by)s, %(committed_at)s, now())
ON CONFLICT (binding_id) DO UPDATE
   SET columns = EXCLUDED.columns, cursor = EXCLUDED.cursor, version = EXCLUDED.version,
       run_id = EXCLUDED.run_id, attempt_id = EXCLUDED.attempt_id,
       changed_by = EXCLUDED.changed_by, committed_at = EXCLUDED.committed_at,
       recorded_at = now()
 WHERE c.version < EXCLUDED.version;

-- name: slices_plan
-- A sliced run's planning attempt records its plan and starts its first slices, guarded
-- by status + token (see dispatch_slices_plan_v1): the run's new status (NULL: the
-- attempt was lost) and the started slice runs.
SELECT * FROM dispatch_slices_plan_v1(%(attempt)s, %(token)s, %(key)s, %(key_type)s,
                                      %(method)s, %(basis)s, %(lowers)s::text[],
                                      %(uppers)s::text[], %(source_spec)s::jsonb,
                                      %(sink_spec)s::jsonb);

-- name: slices_start
-- Start up to `limit` slices of a sliced run that have no run yet (see
-- dispatch_slices_start_v1); the caller holds the parent run's lock.
SELECT * FROM dispatch_slices_start_v1(%(parent)s, %(limit)s);

-- name: slice_of
-- What a claimed slice run copies: its range and its plan (the frozen specs), by the
-- slice's run id (dispatch_slice.run_id is unique).
SELECT s.parent_id, s.number, s.lower, s.upper, p.total, p.key, p.key_type,
       p.source_spec, p.sink_spec
  FROM dispatch_slice s
  JOIN dispatch_sliceplan p ON p.run_id = s.parent_id
 WHERE s.run_id = %(run)s;

-- name: binding_hash_key
-- The hash key of a claimed attempt's binding (its `columns.hash`), read after the claim
-- and only while the attempt is still this worker's (status and token). The ciphertext
-- goes back to the worker alone; it is never part of the attempt's snapshot or row.
SELECT b.hash_key_ciphertext, b.id
  FROM dispatch_attempt a
  JOIN dispatch_run r ON r.id = a.run_id
  JOIN dispatch_jobbinding b ON b.id = r.binding_id
 WHERE a.id = %(attempt)s AND a.lease_token = %(token)s AND a.status = 'RUNNING';

-- name: chain_fire
-- The edges of a run an operator's action ended (dispatch_chain_fire, chains.sql), in
-- that action's transaction, after the run's status is written. Returns the downstream
-- runs made eligible, for the wake-ups after commit.
SELECT dispatch_chain_fire(%(run)s::uuid, %(status)s, clock_timestamp());

-- name: lock_edges
-- Before any write to dispatch_bindingedge: edits of edges check for cycles one after the
-- other (the table trigger dispatch_bindingedge_no_cycle takes the same lock; taking it
-- first means no transaction upgrades its lock while another waits for it).
SELECT dispatch_lock_edges();

-- name: retry_run
-- An operator's retry of a run that is not sliced (services.retry_run), in one statement:
-- the run locked with what the retry decides on (its last attempt's number, a live
-- attempt, a slice plan written since the caller looked), then, only if the run is FAILED
-- or CANCELLED with nothing live and no plan, a PENDING OPERATOR attempt and the run back
-- to PENDING. The caller reads why nothing was added from the first columns.
WITH locked AS (
    SELECT r.id, r.status,
           EXISTS (SELECT 1 FROM dispatch_sliceplan p WHERE p.run_id = r.id) AS sliced,
           EXISTS (SELECT 1 FROM dispatch_attempt a
                    WHERE a.run_id = r.id AND a.status IN ('PENDING', 'RUNNING')) AS live,
           (SELECT max(a.number) FROM dispatch_attempt a WHERE a.run_id = r.id) AS last
      FROM dispatch_run r
     WHERE r.id = %(run)s
       FOR UPDATE OF r
), added AS (
    INSERT INTO dispatch_attempt (id, run_id, number, origin, status, error, rows_read,
                                  rows_written)
    SELECT gen_random_uuid(), l.id, coalesce(l.last, 0) + 1, 'OPERATOR', 'PENDING', '', 0, 0
      FROM locked l
     WHERE l.status IN ('FAILED', 'CANCELLED') AND NOT l.live AND NOT l.sliced
    RETURNING run_id, number
), moved AS (
    UPDATE dispatch_run r
       SET status = 'PENDING', finished_at = NULL, cancel_requested_at = NULL
      FROM added
     WHERE r.id = added.run_id
    RETURNING r.id
)
SELECT l.status, l.live, l.sliced, (SELECT a.number FROM added a),
       (SELECT count(*) FROM moved)
  FROM locked l;
