-- The worker's heartbeat: its leases extended and its cancel requests read in one call.

-- One heartbeat for all of a worker's attempts: extend each lease that is still the
-- worker's (status + token), store progress, and say which runs have a cancel request.
-- Attempts missing from the result are lost: the worker stops them and records nothing.
-- Locks only the attempt rows (never a run), so it cannot deadlock with a settlement.
CREATE OR REPLACE FUNCTION dispatch_heartbeat_v1(
    p_worker text, p_attempts uuid[], p_tokens bigint[], p_rows_read bigint[],
    p_rows_written bigint[], p_stats jsonb
) RETURNS TABLE (attempt_id uuid, cancel_requested boolean, lease_seconds integer)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    UPDATE dispatch_worker w
       SET heartbeat_at = clock_timestamp(), stats = coalesce(p_stats, w.stats)
     WHERE w.id = p_worker;

    RETURN QUERY
    UPDATE dispatch_attempt a
       SET heartbeat_at = clock_timestamp(),
           lease_until = clock_timestamp() + make_interval(secs => j.lease_seconds),
           rows_read = h.rows_read, rows_written = h.rows_written
      FROM unnest(p_attempts, p_tokens, p_rows_read, p_rows_written)
               AS h(id, token, rows_read, rows_written),
           dispatch_run r, dispatch_jobbinding b, dispatch_job j
     WHERE a.id = h.id AND a.lease_token = h.token AND a.status = 'RUNNING'
       AND a.worker_id = p_worker
       AND r.id = a.run_id AND b.id = r.binding_id AND j.id = b.job_id
    RETURNING a.id, r.cancel_requested_at IS NOT NULL, j.lease_seconds;
END
$$;
