-- The worker's look at the queue, read by every heartbeat in the heartbeat's own
-- transaction.
--
-- Three single-entry index probes, each bounded by the time read once (a plain value,
-- so an index condition), whatever the tables hold:
--
--   due_for    seconds the oldest ready attempt has been due (dispatch_attempt_ready_idx,
--              its first entry at or before now), NULL if none is: the worker claims
--              when that is longer than a notified run waits for its worker. Attempts
--              blocked by something disabled or by capacity are not in that index;
--   next_in    seconds until the earliest ready attempt after now falls due (the same
--              index, its first entry after now): the worker's timer.
--   expiry_in  seconds until the earliest RUNNING lease runs out (negative: it has; the
--              running index's first entry): the worker's next recovery pass.
--
-- Each probe is ordered as exactly one index is, so no statistics (fresh, stale, taken
-- while the queue was empty) can plan it as a walk of another index filtered row by
-- row; sorts are off for the same reason. Generic plans: planned once per session.
CREATE OR REPLACE FUNCTION dispatch_queue_view_v4(
    OUT due_for float8, OUT next_in float8, OUT expiry_in float8
) LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_incremental_sort = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_at timestamptz;
BEGIN
    v_at := (
        SELECT a.available_at FROM dispatch_attempt a
         WHERE a.status = 'PENDING'
           AND a.blocked_reason IS NULL
           AND a.available_at <= v_now
         ORDER BY a.available_at, a.id
         LIMIT 1);
    due_for := EXTRACT(EPOCH FROM (v_now - v_at));
    v_at := (
        SELECT a.available_at FROM dispatch_attempt a
         WHERE a.status = 'PENDING'
           AND a.blocked_reason IS NULL
           AND a.available_at > v_now
         ORDER BY a.available_at, a.id
         LIMIT 1);
    next_in := EXTRACT(EPOCH FROM (v_at - v_now));
    v_at := (
        SELECT a.lease_until FROM dispatch_attempt a
         WHERE a.status = 'RUNNING'
         ORDER BY a.lease_until
         LIMIT 1);
    expiry_in := EXTRACT(EPOCH FROM (v_at - v_now));
END
$$;
